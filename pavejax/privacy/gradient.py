"""One private gradient: sample, clip per example, sum, add noise once, normalise, account.

Pieces, from the most composable to the most convenient:

* :func:`noisy_gradient` (pure, jittable): clipped sum + Gaussian noise on a given padded batch;
* :func:`private_gradient` (pure, jittable): samples the batch from the whole data set first and
  returns the overflow flag with the statistics (:func:`~pavejax.privacy.check_step` raises on
  the flags on the host);
* :class:`DPConfig` is the plan: its :meth:`~DPConfig.step_event` is the ``DpEvent`` of one
  step without running it, and :meth:`~DPConfig.privatizer` the noise-adding optax
  transformation for a user's own ``optax.chain``;
* ``DPGradient(loss_fn, config)(trainable, frozen, data, key)`` is the thin host wrapper: it
  runs :func:`private_gradient`, checks the flags and returns the noisy mean gradient, step
  statistics and the event describing exactly the noise just added.

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
import optax

from pavejax.privacy import autotune as _at
from pavejax.privacy.checks import check_step
from pavejax.privacy.clipping import ClipConfig, LossFn, check_microbatch_size, clipped_sum
from pavejax.privacy.noise import gaussian_privatizer, privatize_sum
from pavejax.privacy.sampling import SamplingConfig, pad_batch, take_batch
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
      sparse_rows: trainable-leaf path -> example id field, for embedding tables.
      clip_method: how per-example norms and the clipped sum are computed: ``"vmap"``
        (materialised per-example gradients), ``"ghost"`` (ghost clipping with book-keeping)
        or ``"ghost_two_pass"``; see :class:`~pavejax.privacy.ClipConfig`. It changes time and
        memory, never the released quantity (up to float summation order) or the guarantee.
    """

    l2_clip: float
    noise_multiplier: float
    sampling: SamplingConfig
    relation: str = "add_remove"
    clipping: str = "joint"
    sparse_rows: Mapping[str, str] | tuple = ()
    clip_method: str = "vmap"

    def __post_init__(self):
        z = self.noise_multiplier
        if not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {z!r}; "
                             "use pavejax.accounting.calibrate to pick one for a target ε.")
        if self.relation not in _RELATIONS:
            raise ValueError(f"relation must be one of {_RELATIONS}, got {self.relation!r}.")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError("sampling must be a pavejax.privacy.SamplingConfig.")
        object.__setattr__(self, "clip", ClipConfig(self.l2_clip, self.clipping,
                                                    self.sparse_rows, self.clip_method))

    def step_event(self):
        """The ``dp_accounting.DpEvent`` of one step (multiplier relative to add/remove)."""
        from pavejax.accounting import gaussian_step_event

        s = self.sampling
        return gaussian_step_event(self.noise_multiplier, q=s.q,
                                   sampling="poisson" if s.kind == "poisson" else "fixed",
                                   dataset_size=s.dataset_size, batch_size=s.batch_size)


    def sensitivity(self, num_leaves: int) -> float:
        """Add/remove L2 sensitivity of the clipped sum over ``num_leaves`` trainable leaves."""
        return self.clip.sensitivity(num_leaves, "add_remove")

    def privatizer(self, key: jax.Array, *,
                   noise_multiplier: float | jax.Array | None = None
                   ) -> optax.GradientTransformation:
        """The noise-adding optax transformation of this plan (clipped sum in, noisy mean out;
        :func:`pavejax.privacy.gaussian_privatizer`); each ``update`` is one release whose event
        is :meth:`step_event`. ``noise_multiplier`` overrides ``self.noise_multiplier`` with a
        (possibly traced) value; the caller then accounts for that value."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        return gaussian_privatizer(key, noise_multiplier=z, sensitivity=self.sensitivity,
                                   expected_batch_size=self.sampling.expected_batch_size)


class StepInfo(NamedTuple):
    """Per-step statistics (device arrays; they are *not* private releases, keep them local)."""

    losses: jax.Array
    norms: jax.Array
    mask: jax.Array
    num_clipped: jax.Array
    num_nonfinite: jax.Array
    overflow: jax.Array | bool = False


def noisy_gradient(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                   mask: jax.Array, key: jax.Array, config: DPConfig,
                   mesh: jax.sharding.Mesh | None = None, *,
                   microbatch_size: int | None = None, axis_name: str | None = None,
                   noise_multiplier: float | jax.Array | None = None):
    """Pure, jittable core: (noisy mean gradient, :class:`StepInfo`) for a given padded batch.

    ``mesh`` shards the batch over its ``'data'`` axis (:func:`data_parallel_clipped_sum`);
    ``axis_name`` is for a call inside the caller's own ``shard_map`` (see
    :func:`~pavejax.privacy.clipped_sum`; the noise key must then be the same on every device
    so the noise is added once). ``noise_multiplier`` overrides the config's (a traced value
    for a vmapped sweep; the caller accounts for it).
    """
    if mesh is not None:
        r = data_parallel_clipped_sum(loss_fn, trainable, frozen, batch, mask, config.clip, mesh,
                                      microbatch_size=microbatch_size)
    else:
        r = clipped_sum(loss_fn, trainable, frozen, batch, mask, config.clip,
                        microbatch_size=microbatch_size, axis_name=axis_name)
    z = config.noise_multiplier if noise_multiplier is None else noise_multiplier
    grad = privatize_sum(r.grad_sum, key, noise_multiplier=z,
                         sensitivity=config.sensitivity(len(jax.tree.leaves(trainable))),
                         expected_batch_size=config.sampling.expected_batch_size)
    return grad, StepInfo(r.losses, r.norms, mask, r.num_clipped, r.num_nonfinite)


def sample_padded(data: PyTree, key: jax.Array, config: DPConfig, multiple: int):
    """The batch a private step releases from: ``key`` split into the sampling and noise keys,
    the config's draw taken from ``data`` and padded (masked) to a multiple of ``multiple``.
    Returns ``(batch, mask, draw, noise_key)``."""
    k_sample, k_noise = jax.random.split(key)
    draw = config.sampling.sample(k_sample)
    batch, mask = pad_batch(take_batch(data, draw.indices), draw.mask, multiple)
    return batch, mask, draw, k_noise


def private_gradient(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, data: PyTree,
                     key: jax.Array, config: DPConfig, mesh: jax.sharding.Mesh | None = None, *,
                     microbatch_size: int | None = None,
                     noise_multiplier: float | jax.Array | None = None):
    """Pure, jittable: samples a batch of ``data`` (leaves with leading axis n) as the config
    says, then :func:`noisy_gradient`. Returns (noisy mean gradient, :class:`StepInfo`) whose
    ``overflow`` and ``num_nonfinite`` flags the caller must check before using the gradient
    (:func:`~pavejax.privacy.check_step`). ``key`` is split into the sampling and noise keys.
    """
    multiple = math.lcm(mesh.size if mesh is not None else 1, microbatch_size or 1)
    batch, mask, draw, k_noise = sample_padded(data, key, config, multiple)
    grad, info = noisy_gradient(loss_fn, trainable, frozen, batch, mask, k_noise, config, mesh,
                                microbatch_size=microbatch_size,
                                noise_multiplier=noise_multiplier)
    return grad, info._replace(overflow=draw.overflow)


class DPGradient:
    """A private-gradient oracle bound to a loss and a :class:`DPConfig` (a thin host wrapper
    over :func:`private_gradient` and :func:`~pavejax.privacy.check_step`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pavejax.accounting import Ledger
      >>> from pavejax.privacy import fresh_key
      >>> def loss_fn(w, frozen, ex):
      ...     return jnp.sum((ex["x"] @ w - ex["y"]) ** 2)
      >>> data = {"x": jnp.ones((256, 3)), "y": jnp.zeros(256)}
      >>> dp = DPGradient(loss_fn, DPConfig(l2_clip=1.0, noise_multiplier=1.1,
      ...     sampling=SamplingConfig("poisson", dataset_size=256, batch_size=64)))
      >>> grad, info, event = dp(jnp.zeros(3), None, data, fresh_key())
      >>> ledger = Ledger("add_remove")
      >>> _ = ledger.record(event)
      >>> grad.shape
      (3,)
    """

    def __init__(self, loss_fn: LossFn, config: DPConfig, mesh: jax.sharding.Mesh | None = None,
                 *, microbatch_size: int | str | None = None,
                 memory_budget_bytes: int | None = None, budget_fraction: float = 0.8):
        self.loss_fn = loss_fn
        self.config = config
        self.mesh = mesh
        # microbatch_size="auto": the largest size whose compiled step fits the memory budget,
        # chosen on the first call (pavejax.privacy.autotune; memory_budget_bytes is required
        # on CPU). self.pure is None until then.
        self.memory_budget_bytes, self.budget_fraction = memory_budget_bytes, budget_fraction
        self.pure = self._core = None
        self.microbatch_size = microbatch_size
        if microbatch_size != "auto":
            self._bind(check_microbatch_size(microbatch_size))

    def _bind(self, microbatch_size: int | None) -> None:
        self.microbatch_size = microbatch_size
        self.pure = functools.partial(private_gradient, self.loss_fn, config=self.config,
                                      mesh=self.mesh, microbatch_size=microbatch_size)
        self._core = jax.jit(self.pure)

    def check_data(self, data: PyTree) -> None:
        """Raises unless ``data`` has the config's ``dataset_size`` rows."""
        n = jax.tree.leaves(data)[0].shape[0]
        if n != self.config.sampling.dataset_size:
            raise ValueError(f"data has {n} examples but the sampling config says "
                             f"dataset_size={self.config.sampling.dataset_size}; rebuild the "
                             "config for this data set (q depends on it).")

    def __call__(self, trainable: PyTree, frozen: PyTree, data: PyTree, key: jax.Array):
        """Samples a batch from ``data`` (leaves with leading axis n) and releases one gradient.

        Returns ``(noisy_mean_grad, StepInfo, DpEvent)``. Raises ``BatchOverflowError`` or
        ``NonFiniteError`` (a ``ValueError``) when the step's flags say so (nothing is released
        in that case).
        """
        self.check_data(data)
        if self._core is None:
            self._bind(_dp_gradient_microbatch_size(self, trainable, frozen, data, key))
        grad, info = self._core(trainable, frozen, data, key)
        check_step(info)
        return grad, info, self.config.step_event()


def auto_microbatch_size(loss_fn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                         mask: jax.Array | None, config, *,
                         memory_budget_bytes: int | None = None, budget_fraction: float = 0.8,
                         mesh: jax.sharding.Mesh | None = None, key: Any = None) -> int:
    """The largest microbatch size whose compiled :func:`~pavejax.privacy.noisy_gradient` step
    needs at most the budget of temporary memory (compiled on abstract shapes, never run).

    Args:
      loss_fn, trainable, frozen, batch, mask, config, mesh: as for ``noisy_gradient``; the
        arrays may be ``jax.ShapeDtypeStruct`` (only shapes, dtypes and shardings are used).
      memory_budget_bytes: XLA temporary bytes the step may use (per device). Default:
        :func:`~pavejax.privacy.autotune.default_memory_budget` of the arguments
        (``budget_fraction`` of the device's ``bytes_limit`` minus the argument bytes);
        required on CPU, which reports no limit.
      budget_fraction: the fraction of the device memory used for the default budget.
      key: the noise key or its ``ShapeDtypeStruct`` (default: a typed ``jax.random.key``).

    Returns:
      A divisor of the batch size (of the per-device batch with ``mesh``); the batch size itself
      means no microbatching (equivalent to ``microbatch_size=None``).

    Raises:
      MicrobatchDoesNotFitError (a ``ValueError``): even microbatch 1 exceeds the budget (the
        message says how many bytes it needs). ``ValueError``: no budget given on a backend
        without ``memory_stats``. ``RuntimeError``: the backend gives no memory analysis.
    """
    if key is None:
        key = jax.eval_shape(lambda: jax.random.key(0))
    args = _at._abstract((trainable, frozen, batch, mask, key))
    budget = (_at._check_budget(memory_budget_bytes) if memory_budget_bytes is not None
              else _at.default_memory_budget(*args, budget_fraction=budget_fraction, mesh=mesh))
    bsz = jax.tree.leaves(args[2])[0].shape[0]

    def make_step(mb):
        return functools.partial(noisy_gradient, loss_fn, config=config, mesh=mesh,
                                 microbatch_size=mb)

    cache_key = ("noisy_gradient", loss_fn, config, mesh, budget, _at._signature(args))
    return _at.search_microbatch_size(make_step, args, bsz, budget, cache_key, mesh)


def _dp_gradient_microbatch_size(dp, trainable: PyTree, frozen: PyTree, data: PyTree,
                                key: jax.Array) -> int:
    """The size ``DPGradient(..., microbatch_size="auto")`` uses: the search above on the step it
    actually runs (:func:`~pavejax.privacy.private_gradient`, sampling included), for the padded
    batch the config samples; the default budget subtracts the whole data set's bytes."""
    config, mesh = dp.config, dp.mesh
    args = _at._abstract((trainable, frozen, data, key))
    budget = (_at._check_budget(dp.memory_budget_bytes) if dp.memory_budget_bytes is not None
              else _at.default_memory_budget(*args, budget_fraction=dp.budget_fraction, mesh=mesh))
    multiple = mesh.size if mesh is not None else 1
    mask = jax.eval_shape(lambda k: pad_batch(None, config.sampling.sample(k).mask, multiple)[1],
                          args[3])

    def make_step(mb):
        return functools.partial(private_gradient, dp.loss_fn, config=config, mesh=mesh,
                                 microbatch_size=mb)

    cache_key = ("private_gradient", dp.loss_fn, config, mesh, budget, _at._signature(args))
    return _at.search_microbatch_size(make_step, args, mask.shape[0], budget, cache_key, mesh)
