"""One private gradient: sample, clip per example, sum, add noise once, normalise, account.

``DPGradient(loss_fn, config)(trainable, frozen, data, key)`` returns the noisy mean gradient,
step statistics and the ``dp_accounting.DpEvent`` describing exactly the noise just added.

Formal guarantee:
  One call is a (Poisson-, fixed-size- or un-) subsampled Gaussian mechanism on the clipped
  per-example gradients with noise multiplier ``config.noise_multiplier`` relative to the
  add/remove sensitivity (``l2_clip``, or ``l2_clip * sqrt(L)`` with per-layer clipping). The
  returned event composes in a :class:`pavejax.accounting.Ledger` built with ``config.relation``
  (replace-one doubles the sensitivity; the ledger accounts for it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pavejax.privacy.clipping import ClipConfig, LossFn, clipped_sum
from pavejax.privacy.noise import privatize_sum
from pavejax.privacy.sampling import SamplingConfig, take_batch
from pavejax.privacy.sharding import data_parallel_clipped_sum

PyTree = Any
_RELATIONS = ("add_remove", "replace_one")


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """Everything that determines the privacy of one gradient release.

    Attributes:
      l2_clip: per-example clip norm C.
      noise_multiplier: z >= 0; noise std = z * (add/remove sensitivity). 0 is non-private.
      sampling: a :class:`SamplingConfig` (Poisson, fixed-size or full batch).
      relation: ``"add_remove"`` or ``"replace_one"`` neighbouring. An add/remove figure holds
        only while the data set's size stays hidden (the rate ``q = b / n`` and the normaliser
        are then fixed public constants and ``n`` is published nowhere); pavejax's releases
        state their sizes, so they take ``"replace_one"`` and refuse add/remove ledgers.
      clipping: ``"joint"`` (default) or ``"per_layer"``.
      microbatch_size: examples per vmapped chunk (memory), ``None`` for all at once.
      sparse_rows: trainable-leaf path -> example id field, for embedding tables.
    """

    l2_clip: float
    noise_multiplier: float
    sampling: SamplingConfig
    relation: str = "add_remove"
    clipping: str = "joint"
    microbatch_size: int | None = None
    sparse_rows: Mapping[str, str] | tuple = ()

    def __post_init__(self):
        z = self.noise_multiplier
        if not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {z!r}; "
                             "use pavejax.accounting.calibrate_noise to pick one for a target ε.")
        if self.relation not in _RELATIONS:
            raise ValueError(f"relation must be one of {_RELATIONS}, got {self.relation!r}.")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError("sampling must be a pavejax.privacy.SamplingConfig.")
        object.__setattr__(self, "clip", ClipConfig(self.l2_clip, self.clipping,
                                                    self.microbatch_size, self.sparse_rows))

    def step_event(self):
        """The ``dp_accounting.DpEvent`` of one step (multiplier relative to add/remove)."""
        from pavejax.accounting import gaussian_step_event

        s = self.sampling
        return gaussian_step_event(self.noise_multiplier, q=s.q,
                                   sampling="poisson" if s.kind == "poisson" else "fixed",
                                   dataset_size=s.dataset_size, batch_size=s.batch_size)


class StepInfo(NamedTuple):
    """Per-step statistics (device arrays; they are *not* private releases, keep them local)."""

    losses: jax.Array
    norms: jax.Array
    mask: jax.Array
    num_clipped: jax.Array
    num_nonfinite: jax.Array


def noisy_gradient(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                   mask: jax.Array, key: jax.Array, config: DPConfig,
                   mesh: jax.sharding.Mesh | None = None):
    """Pure, jittable core: (noisy mean gradient, :class:`StepInfo`) for a given padded batch."""
    if mesh is None:
        r = clipped_sum(loss_fn, trainable, frozen, batch, mask, config.clip)
    else:
        r = data_parallel_clipped_sum(loss_fn, trainable, frozen, batch, mask, config.clip, mesh)
    sens = config.clip.sensitivity(len(jax.tree.leaves(trainable)), "add_remove")
    grad = privatize_sum(r.grad_sum, key, noise_multiplier=config.noise_multiplier,
                         sensitivity=sens,
                         expected_batch_size=config.sampling.expected_batch_size)
    return grad, StepInfo(r.losses, r.norms, mask, r.num_clipped, r.num_nonfinite)


class DPGradient:
    """A private-gradient oracle bound to a loss and a :class:`DPConfig`.

    Example:
      >>> dp = DPGradient(loss_fn, DPConfig(l2_clip=1.0, noise_multiplier=1.1,
      ...     sampling=SamplingConfig("poisson", dataset_size=n, batch_size=64)))
      >>> grad, info, event = dp(trainable, frozen, data, key)
      >>> ledger.record(event)
    """

    def __init__(self, loss_fn: LossFn, config: DPConfig, mesh: jax.sharding.Mesh | None = None):
        self.loss_fn = loss_fn
        self.config = config
        self.mesh = mesh
        self._core = jax.jit(functools.partial(noisy_gradient, loss_fn, config=config, mesh=mesh))

    def __call__(self, trainable: PyTree, frozen: PyTree, data: PyTree, key: jax.Array):
        """Samples a batch from ``data`` (leaves with leading axis n) and releases one gradient.

        Returns ``(noisy_mean_grad, StepInfo, DpEvent)``. Raises ``ValueError`` when a real
        example produced a non-finite loss or gradient (nothing is released in that case).
        """
        n = jax.tree.leaves(data)[0].shape[0]
        if n != self.config.sampling.dataset_size:
            raise ValueError(f"data has {n} examples but the sampling config says "
                             f"dataset_size={self.config.sampling.dataset_size}; rebuild the "
                             "config for this data set (q depends on it).")
        k_sample, k_noise = jax.random.split(key)
        idx, mask = self.config.sampling.sample(k_sample)
        batch = take_batch(data, idx)
        # Pad (masked out) to a multiple of the device count and of the microbatch size.
        multiple = math.lcm(self.mesh.size if self.mesh is not None else 1,
                            self.config.microbatch_size or 1)
        pad = (-mask.shape[0]) % multiple
        if pad:
            batch = jax.tree.map(lambda x: jnp.concatenate([x, x[:pad]]), batch)
            mask = jnp.concatenate([mask, jnp.zeros((pad,), bool)])
        grad, info = self._core(trainable, frozen, batch, mask, k_noise)
        bad = int(info.num_nonfinite)
        if bad:
            raise ValueError(
                f"{bad} example(s) in this batch produced a NaN/Inf loss or gradient; nothing was "
                "released. Check the inputs for NaN/Inf, the loss for log(0) or overflow, and "
                "lower the learning rate if the parameters diverged.")
        return grad, info, self.config.step_event()
