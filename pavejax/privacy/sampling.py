"""Batch sampling with static shapes: Poisson (mask over a padded batch) and fixed-size.

Poisson sampling includes each of the n examples independently with probability q. Under jit
the batch must have a static size, so the sampled indices are written into a padded array of
``max_batch`` rows with a boolean mask marking the real ones.

Realised rate (exact): example i is included iff its 64 random bits, read as an integer
u_i uniform on [0, 2^64), satisfy u_i < T with T = floor(q * 2^64) computed exactly on the host
from the float64 q (:func:`poisson_threshold`); so P(include) = T / 2^64, which lies in
(q - 2^-64, q]. It equals q exactly for every q >= 2^-12 (the float64 spacing there is a
multiple of 2^-64), q = 1 included (everyone is drawn). The error is one-sided on purpose: a
rate above the accounted q would make every step leak more than the ledger says (a float32
uniform compared with float32(q) lives on a 2^-23 grid and realises ceil(q 2^23) / 2^23,
e.g. +0.6% at q = 1.6e-5 and 6x at q = 2e-8), whereas a rate below q is covered by the
accounting for q (the privacy curve of a Poisson-subsampled mechanism is non-decreasing in q).
The 64 bits are two uint32 words compared lexicographically, so no x64 mode is needed.

Overflow policy (explicit): if more than ``max_batch`` examples are drawn, the draw's
``overflow`` flag is set and the step must not be released: :func:`check_step` (which every
pavejax driver calls on each step's statistics) raises :class:`BatchOverflowError` instead of
silently dropping examples (dropping would make the mechanism a truncated Poisson sample, which
the Poisson accounting does not cover). The flag is an array, so sampling runs inside ``jit`` and
``lax.scan``; the check happens on the host after the call, before anything is kept. The draw
depends only on the key and the public n, never on data values, so the error reveals nothing
about the data. The default ``max_batch`` makes an overflow less likely than ``1e-9`` per step
(binomial tail), so a run of a million steps almost surely never sees one.

Fixed-size sampling draws exactly b distinct indices uniformly (without replacement); it is
accounted as sampling without replacement under replace-one neighbouring.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

_KINDS = ("poisson", "fixed", "full")


class BatchOverflowError(RuntimeError):
    """A Poisson draw selected more examples than the padded batch holds."""


class Draw(NamedTuple):
    """One sampled batch: row ``indices`` (max_batch,) int32 into the data set, ``mask``
    (max_batch,) bool marking the real rows, and ``overflow`` (bool scalar array): True when
    a Poisson draw selected more than ``max_batch`` examples, so the step must be refused."""

    indices: jax.Array
    mask: jax.Array
    overflow: jax.Array


def max_batch_for(dataset_size: int, q: float, failure_prob: float = 1e-9) -> int:
    """Smallest padded size m with P(Binomial(n, q) > m) <= failure_prob."""
    if q >= 1.0:
        return int(dataset_size)
    m = int(stats.binom.isf(failure_prob, dataset_size, q)) + 1
    return max(1, min(int(dataset_size), m))


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Which examples a step sees.

    Attributes:
      kind: ``"poisson"`` (each example w.p. q = batch_size / dataset_size), ``"fixed"``
        (exactly batch_size distinct examples) or ``"full"`` (every example, q = 1).
      dataset_size: n, the number of examples (public).
      batch_size: expected batch size (Poisson) or exact batch size (fixed). Ignored for full.
      max_batch: padded physical batch for Poisson; default from :func:`max_batch_for`. Round it
        up to a multiple of your microbatch size if you microbatch.
    """

    kind: str
    dataset_size: int
    batch_size: int | None = None
    max_batch: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"sampling kind must be one of {_KINDS}, got {self.kind!r}.")
        if not isinstance(self.dataset_size, (int, np.integer)) or self.dataset_size < 1:
            raise ValueError(f"dataset_size must be an int >= 1, got {self.dataset_size!r}; "
                             "an empty data set cannot be trained on.")
        if self.kind == "full":
            object.__setattr__(self, "batch_size", int(self.dataset_size))
        b = self.batch_size
        if not isinstance(b, (int, np.integer)) or not 1 <= b <= self.dataset_size:
            raise ValueError(f"batch_size must be an int in [1, dataset_size={self.dataset_size}]"
                             f", got {b!r}.")
        if self.kind == "poisson" and self.max_batch is None:
            object.__setattr__(self, "max_batch", max_batch_for(self.dataset_size, self.q))
        if self.kind != "poisson":
            object.__setattr__(self, "max_batch", int(b))
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}.")

    @property
    def q(self) -> float:
        """Sampling probability (1 for full batch)."""
        return 1.0 if self.kind == "full" else self.batch_size / self.dataset_size

    @property
    def expected_batch_size(self) -> float:
        """The public normaliser of the noisy sum."""
        return float(self.batch_size)

    def sample(self, key: jax.Array) -> Draw:
        """Draws one batch as a :class:`Draw` (pure and jittable; static shapes).

        A Poisson draw larger than ``max_batch`` sets ``overflow``; the caller must then refuse
        the step (:func:`check_step` raises on it; see the module docstring).
        """
        no = jnp.zeros((), bool)
        if self.kind == "full":
            return Draw(jnp.arange(self.dataset_size, dtype=jnp.int32),
                        jnp.ones(self.max_batch, bool), no)
        if self.kind == "fixed":
            idx = jax.random.choice(key, self.dataset_size, (self.batch_size,), replace=False)
            return Draw(idx.astype(jnp.int32), jnp.ones(self.batch_size, bool), no)
        idx, mask, count = poisson_indices(key, self.dataset_size, self.q, self.max_batch)
        return Draw(idx, mask, count > self.max_batch)


def poisson_threshold(q: float) -> int:
    """T = floor(q * 2^64), exactly (from the float64 value of q), for q in (0, 1].

    An example whose 64 uniform bits read as an integer below T is included, so the realised
    inclusion probability is T / 2^64, in (q - 2^-64, q]; T = 2^64 exactly when q = 1.
    """
    q = float(q)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the Poisson sampling rate q must be in (0, 1], got {q!r}.")
    return int(fractions.Fraction(q) * 2**64)  # int() of a positive Fraction is its floor


def poisson_mask(key: jax.Array, dataset_size: int, q: float) -> jax.Array:
    """(dataset_size,) bool: entry i True independently w.p. exactly T/2^64 <= q, T = floor(q 2^64).

    Example i's 64 bits are ``hi = bits[0, i]`` and ``lo = bits[1, i]`` of
    ``jax.random.bits(key, (2, dataset_size), uint32)``; it is included iff
    ``hi * 2^32 + lo < T`` (compared word by word, so no x64 mode is needed).
    """
    t = poisson_threshold(q)
    if t == 2**64:
        return jnp.ones((dataset_size,), bool)
    t_hi, t_lo = jnp.uint32(t >> 32), jnp.uint32(t & 0xFFFFFFFF)
    hi, lo = jax.random.bits(key, (2, dataset_size), jnp.uint32)
    return (hi < t_hi) | ((hi == t_hi) & (lo < t_lo))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def poisson_indices(key: jax.Array, dataset_size: int, q: float, max_batch: int):
    """Poisson draw as (indices, mask, count); indices beyond ``count`` are padding (index 0).

    Each example is drawn independently w.p. ``poisson_threshold(q) / 2**64`` (never above q).
    ``count`` may exceed ``max_batch``; the caller must then refuse the step (overflow policy).
    """
    chosen = poisson_mask(key, dataset_size, q)
    count = jnp.sum(chosen.astype(jnp.int32))
    (idx,) = jnp.nonzero(chosen, size=max_batch, fill_value=0)
    mask = jnp.arange(max_batch) < count
    return idx.astype(jnp.int32), mask, count


def pad_batch(batch: Any, mask: jax.Array, multiple: int) -> tuple[Any, jax.Array]:
    """Pads the leading axis to a multiple of ``multiple`` with masked-out copies of the first
    rows (mask False), so a batch splits evenly over the devices of a mesh. Padding rows never
    contribute to a clipped sum."""
    pad = (-mask.shape[0]) % int(multiple)
    if not pad:
        return batch, mask
    if pad > mask.shape[0]:
        reps = -(-pad // mask.shape[0])
        filler = jax.tree.map(lambda x: jnp.concatenate([x] * reps)[:pad], batch)
    else:
        filler = jax.tree.map(lambda x: x[:pad], batch)
    batch = jax.tree.map(lambda x, f: jnp.concatenate([x, f]), batch, filler)
    return batch, jnp.concatenate([mask, jnp.zeros((pad,), bool)])


def take_batch(data, indices: jax.Array):
    """Gathers rows ``indices`` of every leaf of ``data`` (leading axis n)."""
    return jax.tree.map(lambda x: jnp.take(x, indices, axis=0), data)
