"""Seeded perturbations and per-example two-point differences (the zeroth-order signal).

A direction z ~ N(0, I) over the trainable pytree is a pure function of a *public* key: leaf i
gets ``normal(fold_in(key, i))``, drawn in float32 and cast to the leaf's dtype. z is never
stored between steps; a step draws it twice, once for θ + εz and once for the update
(θ − εz is the reflection 2θ − (θ + εz)). θ ± εz are built functionally from an untouched θ
(no in-place +ε/−2ε/+ε drift), and the losses and their difference are taken in float32 even
for bf16/fp16 weights:

    ĝ_i = (ℓ_i(θ + εz) − ℓ_i(θ − εz)) / (2ε)

A step keeps no activations for backpropagation; besides θ it holds only the transient perturbed
leaves (θ + εz, then θ − εz), which for LoRA are a few kilobytes.

The per-example loss has the signature of the DP engine, ``loss_fn(trainable, frozen, example)``
returning a scalar; it is vmapped over the batch and evaluated in microbatches of static size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "apply_directions", "clip_differences", "direction", "direction_keys", "perturbed",
    "per_example_losses", "two_point_differences",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array):
    # Threefry-2x32 with 20 rounds, unrolled: XLA fuses it into one elementwise loop. JAX's CPU
    # lowering rolls the rounds into a while loop over whole arrays, which is ~3x slower and
    # holds four leaf-sized uint32 buffers at once.
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r))) ^ x1
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


@functools.partial(jax.jit, static_argnums=1)
def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Bit for bit ``jax.random.normal(key, shape, float32)``, faster on CPU for threefry keys.

    Reproduces JAX's partitionable threefry bits (counter = flat index), its mantissa-fill
    uniform on [nextafter(−1, 0), 1) and √2·erfinv. Other key kinds use `jax.random.normal`.
    """
    size = math.prod(shape)
    if (not jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or size >= 2**32
            or str(jax.random.key_impl(key)) != "threefry2x32"):
        return jax.random.normal(key, shape, jnp.float32)
    k = jax.random.key_data(key)
    counter = lax.iota(jnp.uint32, size).reshape(shape)
    b1, b2 = _threefry2x32(k[0], k[1], jnp.zeros(shape, jnp.uint32), counter)
    mantissa = ((b1 ^ b2) >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
    unit = lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1.0)
    lo = jnp.float32(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    u = lax.max(lo, unit * (jnp.float32(1.0) - lo) + lo)
    return jnp.float32(math.sqrt(2.0)) * lax.erf_inv(u)


def direction_keys(public_key: jax.Array, step: int | jax.Array, num_directions: int) -> jax.Array:
    """The K public direction keys of ``step``: ``fold_in(fold_in(public_key, step), k)``.

    They depend only on the public key and the step counter, never on data or on the
    mechanism's secret randomness. Shape (K,) of typed keys.
    """
    step_key = jax.random.fold_in(public_key, step)
    return jax.vmap(lambda k: jax.random.fold_in(step_key, k))(jnp.arange(num_directions))


def direction(key: jax.Array, params: PyTree) -> PyTree:
    """z ~ N(0, I) shaped like ``params``: leaf i from ``fold_in(key, i)``, float32, cast to the
    leaf dtype. Non-float leaves (integer buffers) get zeros: they are never perturbed."""
    leaves, treedef = jax.tree.flatten(params)
    out = [_normal(jax.random.fold_in(key, i), jnp.shape(x)).astype(jnp.result_type(x))
           if _is_float(x) else jnp.zeros_like(x) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def perturbed(params: PyTree, key: jax.Array, scale: float | jax.Array) -> PyTree:
    """θ + scale·z(key), computed leaf by leaf in float32 and cast back to each leaf's dtype."""
    leaves, treedef = jax.tree.flatten(params)
    scale = jnp.asarray(scale, jnp.float32)
    out = []
    for i, x in enumerate(leaves):
        if not _is_float(x):
            out.append(x)
            continue
        z = _normal(jax.random.fold_in(key, i), jnp.shape(x))
        out.append((x.astype(jnp.float32) + scale * z).astype(jnp.result_type(x)))
    return jax.tree.unflatten(treedef, out)


def _num_examples(batch: PyTree) -> int:
    sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"every batch leaf needs the same leading (example) axis, got sizes "
                         f"{sorted(sizes)}")
    return sizes.pop()


def per_example_losses(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                       microbatch_size: int | None = None) -> jax.Array:
    """ℓ_i for every example of ``batch`` as a float32 vector of shape (N,).

    With ``microbatch_size`` the batch is padded (by repeating rows) to a multiple of it and
    evaluated chunk by chunk with `lax.map`, so peak activation memory is one microbatch.
    """
    n = _num_examples(batch)
    single = jax.vmap(lambda ex: loss_fn(trainable, frozen, ex).astype(jnp.float32))
    if microbatch_size is None or microbatch_size >= n:
        return single(batch)
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    chunks = -(-n // microbatch_size)
    idx = jnp.arange(chunks * microbatch_size) % n
    shaped = jax.tree.map(
        lambda x: jnp.take(x, idx, axis=0).reshape((chunks, microbatch_size) + x.shape[1:]),
        batch)
    return lax.map(single, shaped).reshape(-1)[:n]


def _reflect(center: PyTree, point: PyTree) -> PyTree:
    """2·center − point leaf by leaf (in float32, cast back): θ − εz from θ and θ + εz."""
    def one(c, p):
        if not _is_float(c):
            return c
        c32 = c.astype(jnp.float32)
        return (c32 + (c32 - p.astype(jnp.float32))).astype(jnp.result_type(c))

    return jax.tree.map(one, center, point)


def two_point_differences(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                          key: jax.Array, eps: float | jax.Array,
                          microbatch_size: int | None = None) -> jax.Array:
    """Per-example projected gradients ĝ_i = (ℓ_i(θ+εz) − ℓ_i(θ−εz)) / (2ε), float32, shape (N,).

    z = `direction` (key, trainable) is drawn once: θ − εz is formed as 2θ − (θ + εz), which
    reuses the first pass's copy in place of a second draw and mirrors the realised (rounded)
    perturbation exactly. θ itself is never modified, so nothing drifts across steps. Besides θ
    the step holds the perturbed leaves (XLA currently keeps θ + εz and θ − εz, under 2x the
    trainable bytes in total) and no leaf-sized random-bit buffers. ``eps`` may be traced.
    Non-finite differences (a diverged loss) become 0 so that one bad example cannot poison a
    subset mean; callers clip the result to [−c, c].
    """
    eps = jnp.asarray(eps, jnp.float32)
    point = perturbed(trainable, key, eps)
    plus = per_example_losses(loss_fn, point, frozen, batch, microbatch_size)
    # The barrier orders the reflection after the first pass, so θ + εz dies as θ − εz is built.
    point, plus = lax.optimization_barrier((point, plus))
    minus = per_example_losses(loss_fn, _reflect(trainable, point), frozen, batch,
                               microbatch_size)
    g = (plus - minus) / (jnp.float32(2.0) * eps)
    return jnp.where(jnp.isfinite(g), g, jnp.float32(0.0))


def clip_differences(g: jax.Array, clip: float | jax.Array) -> jax.Array:
    """Clips each per-example scalar to [−clip, clip] (|ĝ_i| <= clip: the DP-ZO sensitivity)."""
    c = jnp.asarray(clip, jnp.float32)
    return jnp.clip(g, -c, c)


def apply_directions(params: PyTree, keys: jax.Array, coefficients: jax.Array,
                     learning_rate: float | jax.Array) -> PyTree:
    """θ − η · (1/K) Σ_k Y_k z(key_k), regenerating each z_k from its key (K = len(keys)).

    ``coefficients`` has shape (K,) (the released scalars Y_k). The sum is formed in float32 and
    cast back to each leaf's dtype.
    """
    num = keys.shape[0]
    lr = jnp.asarray(learning_rate, jnp.float32)
    coefficients = coefficients.astype(jnp.float32)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, x in enumerate(leaves):
        if not _is_float(x):
            out.append(x)
            continue

        def add(acc, kc, i=i, x=x):
            k, c = kc
            return acc + c * _normal(jax.random.fold_in(k, i), jnp.shape(x)), None

        total, _ = lax.scan(add, jnp.zeros(jnp.shape(x), jnp.float32), (keys, coefficients))
        out.append((x.astype(jnp.float32) - lr * total / jnp.float32(num))
                   .astype(jnp.result_type(x)))
    return jax.tree.unflatten(treedef, out)
