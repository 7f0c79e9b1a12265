"""Gaussian privatiser on the clipped sum, normalised by the expected batch size.

Formal guarantee:
  Releasing ``(S + N(0, (z * Delta)^2 I)) / b_exp``, where S is a clipped sum with add/remove
  sensitivity Delta, is the Gaussian mechanism with noise multiplier z relative to Delta (the
  division by the public constant b_exp is post-processing). Under replace-one neighbouring the
  sensitivity doubles; the :mod:`pavejax.accounting` ledger applies that factor, so events always
  carry z relative to the add/remove sensitivity.

The noise-adding step is also an optax ``GradientTransformation``
(:func:`gaussian_privatizer`): its input is the clipped sum, its output the noisy mean, and its
key lives in its state, so ``optax.chain(privatizer, optax.adamw(schedule))`` is a DP optimiser
whose every ``update`` is one Gaussian release (its event: ``DPConfig.step_event``).

Sharp edges:
  * Normalise by the *expected* batch size q*n, never by the realised Poisson batch size: the
    realised size depends on the data set and dividing by it is not covered by the analysis.
  * Noise is added once to the sum (after any cross-device reduction), never per device.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


def fresh_key() -> jax.Array:
    """A typed PRNG key filled from the operating system's randomness (``secrets``).

    Use it for DP noise and sampling: a key derived from a recorded or guessable seed lets
    anyone regenerate the noise and subtract it from the release. The key is never written
    anywhere except a training checkpoint (which is not a release).
    """
    like = jax.random.key_data(jax.random.key(0))
    raw = secrets.token_bytes(like.size * like.dtype.itemsize)
    data = np.frombuffer(raw, dtype=like.dtype).reshape(like.shape)
    return jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(jax.random.key(0)))


#: Leaves with more elements than this draw their noise in blocks of leading-axis rows, one block
#: after the other inside a loop (see :func:`gaussian_noise_like`). Whole-leaf draws cannot be
#: sequenced: XLA materialises threefry's counters (2x the leaf) and words early, for every leaf
#: at once (measured 817 MiB of scratch for SmolLM2's 106M non-embedding weights, 59 MiB blocked).
MAX_DRAW_ELEMS = 1 << 16
#: Values per block of a blocked draw (at least two blocks per blocked leaf).
BLOCK_ELEMS = 1 << 18


def _block_rows(shape: tuple[int, ...], max_elems: int) -> int | None:
    """Rows per block for a blocked draw of ``shape``, or None to draw it whole."""
    n = math.prod(shape)
    if len(shape) < 1 or n <= max_elems or shape[0] < 2:
        return None
    per_row = n // shape[0]
    target = min(BLOCK_ELEMS, n // 2) // per_row
    if target < 1:
        return None
    r = max(d for d in range(1, min(target, shape[0]) + 1) if shape[0] % d == 0)
    return r if 4 * r >= target else None     # no divisor near the target: draw it whole


def _noisy_leaf(s: jax.Array, key: jax.Array, std: jax.Array, inv: jax.Array,
                max_elems: int | None) -> jax.Array:
    """``(s + std * N(0, I)) * inv`` for one leaf; a large leaf block by block, in place (the
    blocks of rows ``[j r, (j + 1) r)`` use ``fold_in(key, j)``)."""
    shape = tuple(s.shape)
    r = None if max_elems is None else _block_rows(shape, max_elems)
    if r is None:
        n = jax.random.normal(key, shape, jnp.float32)
        return (s + n.astype(s.dtype) * std.astype(s.dtype)) * inv.astype(s.dtype)

    def body(j, acc):
        n = jax.random.normal(jax.random.fold_in(key, j), (r,) + shape[1:], jnp.float32)
        rows = jax.lax.dynamic_slice_in_dim(acc, j * r, r, 0)
        new = (rows + n.astype(s.dtype) * std.astype(s.dtype)) * inv.astype(s.dtype)
        return jax.lax.dynamic_update_slice_in_dim(acc, new, j * r, 0)

    return jax.lax.fori_loop(0, shape[0] // r, body, s)


def gaussian_noise_like(key: jax.Array, tree: PyTree, stddev: float, *,
                        max_draw_elems: int | None = MAX_DRAW_ELEMS) -> PyTree:
    """N(0, stddev^2) noise with the structure and dtypes of ``tree`` (float32 draws).

    Leaf i uses ``fold_in(key, i)``, so the noise of a leaf does not depend on the others. A
    leaf with more than ``max_draw_elems`` elements is drawn in blocks of leading-axis rows
    (block j from ``fold_in(leaf key, j)``, about ``max_draw_elems`` values each, one after the
    other): the values are still independent N(0, stddev^2), and the draw needs one block of
    scratch memory instead of several arrays of the leaf's size (threefry's counters and output
    words are not fused on CPU and GPU: measured 324 MiB of XLA temp memory for a 49152 x 576
    table drawn whole, 20 MiB blocked). ``None`` draws every leaf whole. Under a parameter
    sharding, a blocked leaf is drawn by a loop over row blocks that the partitioner may run on
    every device (the same values; the scratch stays one block); whole leaves are drawn
    shard by shard.
    """
    leaves, treedef = jax.tree.flatten(tree)
    one, std = jnp.float32(1.0), jnp.float32(stddev)
    noise = [
        _noisy_leaf(jnp.zeros(x.shape, jnp.float32), jax.random.fold_in(key, i), std, one,
                    max_draw_elems).astype(x.dtype)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, noise)


def _concrete(x: Any) -> float | None:
    """The Python float of ``x``, or None when it is traced (checked by the caller's plan)."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"expected a real number, got {x!r}") from None


def _check_noise_args(noise_multiplier: Any, expected_batch_size: Any) -> None:
    z = _concrete(noise_multiplier)
    if z is not None and not (math.isfinite(z) and z >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}.")
    b = _concrete(expected_batch_size)
    if b is not None and not (math.isfinite(b) and b > 0):
        raise ValueError("expected_batch_size must be > 0 (q * dataset size for Poisson "
                         f"sampling), got {expected_batch_size!r}.")


def privatize_sum(grad_sum: PyTree, key: jax.Array, *, noise_multiplier: float | jax.Array,
                  sensitivity: float, expected_batch_size: float,
                  max_draw_elems: int | None = MAX_DRAW_ELEMS) -> PyTree:
    """Noisy mean gradient ``(grad_sum + N(0, (noise_multiplier*sensitivity)^2)) / b_exp``.

    Args:
      grad_sum: clipped sum (pytree).
      key: PRNG key used for this release only.
      noise_multiplier: z >= 0, noise std in units of ``sensitivity``. May be a traced array
        (e.g. a ``vmap`` over several budgets): the values are then checked by whoever accounts
        for them, not here.
      sensitivity: add/remove L2 sensitivity of ``grad_sum`` (the clip norm for joint clipping).
      expected_batch_size: public normaliser (q*n for Poisson sampling, b for fixed-size).
      max_draw_elems: leaves larger than this draw their noise in blocks
        (:func:`gaussian_noise_like`); ``None`` draws whole leaves.
    """
    _check_noise_args(noise_multiplier, expected_batch_size)
    std = jnp.asarray(noise_multiplier, jnp.float32) * jnp.float32(sensitivity)
    inv = 1.0 / jnp.asarray(expected_batch_size, jnp.float32)
    leaves, treedef = jax.tree.flatten(grad_sum)
    out = [_noisy_leaf(x, jax.random.fold_in(key, i), std, inv, max_draw_elems)
           for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


class PrivatizerState(NamedTuple):
    """State of :func:`gaussian_privatizer`: the raw data of its secret key and the number of
    releases made so far (release t draws its noise from ``fold_in(key, t)``)."""

    key_data: jax.Array
    count: jax.Array


def gaussian_privatizer(key: jax.Array, *, noise_multiplier: float | jax.Array,
                        sensitivity: float | Callable[[int], float],
                        expected_batch_size: float) -> optax.GradientTransformation:
    """The Gaussian release as an optax transformation: clipped sum in, noisy mean out.

    ``update(grad_sum, state)`` returns :func:`privatize_sum` of ``grad_sum`` with the noise of
    ``fold_in(key, state.count)`` and increments the count, so ``optax.chain(privatizer,
    optax.adamw(schedule))`` is a private optimiser whose every ``update`` is one Gaussian
    release. Feed it the *clipped sum* (:func:`pavejax.privacy.clipped_sum`), never a mean.

    Args:
      key: the secret noise key (use :func:`fresh_key`); it lives in the transformation's state
        (as raw key data, so checkpoints can hold it) and never in a release.
      noise_multiplier: z (may be a traced array inside a ``vmap``).
      sensitivity: the add/remove sensitivity of the sum, or a function of the number of
        leaves (per-layer clipping: ``C * sqrt(L)``).
      expected_batch_size: the public normaliser.

    :meth:`pavejax.privacy.DPConfig.privatizer` builds one from a config, whose
    :meth:`~pavejax.privacy.DPConfig.step_event` is the event of each ``update``.
    """
    _check_noise_args(noise_multiplier, expected_batch_size)
    impl = jax.random.key_impl(key)

    def init(params):
        del params
        return PrivatizerState(jax.random.key_data(key), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        del params
        sens = sensitivity(len(jax.tree.leaves(updates))) if callable(sensitivity) \
            else sensitivity
        k = jax.random.fold_in(jax.random.wrap_key_data(state.key_data, impl=impl), state.count)
        out = privatize_sum(updates, k, noise_multiplier=noise_multiplier, sensitivity=sens,
                            expected_batch_size=expected_batch_size)
        return out, PrivatizerState(state.key_data, state.count + 1)

    return optax.GradientTransformation(init, update)
