"""Seeded perturbations and per-example two-point differences (the zeroth-order signal).

A direction z ~ N(0, I) over the trainable pytree is a pure function of a *public* key: leaf i
gets ``normal(fold_in(key, i))``, drawn in float32 and cast to the leaf's dtype. z is never
stored between steps; the update regenerates it from the same key. θ ± εz are built
functionally from an untouched θ (no in-place +ε/−2ε/+ε drift), and the losses and their
difference are taken in float32 even for bf16/fp16 weights:

    ĝ_i = (ℓ_i(θ + εz) − ℓ_i(θ − εz)) / (2ε)

A step keeps no activations for backpropagation; besides θ it holds one transient perturbed
copy of the trainable leaves (θ + εz, then θ − εz), which for LoRA is a few kilobytes.

The per-example loss has the signature of the DP engine, ``loss_fn(trainable, frozen, example)``
returning a scalar; it is vmapped over the batch and evaluated in microbatches of static size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "apply_directions", "clip_differences", "direction", "direction_keys", "perturbed",
    "per_example_losses", "two_point_differences",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


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
    out = [jax.random.normal(jax.random.fold_in(key, i), jnp.shape(x), jnp.float32)
           .astype(jnp.result_type(x)) if _is_float(x) else jnp.zeros_like(x)
           for i, x in enumerate(leaves)]
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
        z = jax.random.normal(jax.random.fold_in(key, i), jnp.shape(x), jnp.float32)
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


def two_point_differences(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                          key: jax.Array, eps: float,
                          microbatch_size: int | None = None) -> jax.Array:
    """Per-example projected gradients ĝ_i = (ℓ_i(θ+εz) − ℓ_i(θ−εz)) / (2ε), float32, shape (N,).

    z = `direction` (key, trainable). Non-finite differences (a diverged loss) become 0 so that
    one bad example cannot poison a subset mean; callers clip the result to [−c, c].
    """
    plus = per_example_losses(loss_fn, perturbed(trainable, key, eps), frozen, batch,
                              microbatch_size)
    # The barrier orders θ − εz after the first pass, so θ + εz is dead before it is built:
    # one transient copy instead of two.
    trainable, plus = lax.optimization_barrier((trainable, plus))
    minus = per_example_losses(loss_fn, perturbed(trainable, key, -eps), frozen, batch,
                               microbatch_size)
    g = (plus - minus) / jnp.float32(2.0 * eps)
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
            return acc + c * jax.random.normal(jax.random.fold_in(k, i), jnp.shape(x),
                                               jnp.float32), None

        total, _ = lax.scan(add, jnp.zeros(jnp.shape(x), jnp.float32), (keys, coefficients))
        out.append((x.astype(jnp.float32) - lr * total / jnp.float32(num))
                   .astype(jnp.result_type(x)))
    return jax.tree.unflatten(treedef, out)
