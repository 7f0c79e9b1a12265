"""Seeded perturbations and per-example two-point differences (the zeroth-order signal).

A direction z ~ N(0, I) over the trainable pytree is a pure function of a *public* key: leaf i
gets ``normal(fold_in(key, i))`` (bit for bit `jax.random.normal`), drawn in float32 and cast to
the leaf's dtype. z is never stored between steps. A step draws it once: θ + εz is built
functionally from an untouched θ (no in-place +ε/−2ε/+ε drift), θ − εz is its reflection
2θ − (θ + εz), and the one-direction update θ − ηYz is taken along the realised perturbation
(θ − (θ − εz))/ε (`update_from_mirror`), so no second draw is needed; with K > 1 directions the
update regenerates each z_k (`apply_directions`). Losses and their difference are float32 even
for bf16/fp16 weights:

    ĝ_i = (ℓ_i(θ + εz) − ℓ_i(θ − εz)) / (2ε)

A step keeps no activations for backpropagation; besides θ it holds one perturbed copy (θ + εz,
overwritten by θ − εz), which for LoRA is a few kilobytes, and one microbatch of activations.
Same-shaped leaves draw their z in one loop (`lax.map`), so a transformer compiles ~10
random-number kernels rather than ~100.

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
    "apply_directions", "clip_differences", "direction", "direction_keys", "mirror_point",
    "perturbed", "per_example_losses", "pseudo_gradient", "two_point_differences",
    "update_from_mirror",
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
    return _direction_keys(public_key, jnp.asarray(step, jnp.uint32), num_directions)


@functools.partial(jax.jit, static_argnums=2)
def _direction_keys(public_key: jax.Array, step: jax.Array, num_directions: int) -> jax.Array:
    # Jitted: unjitted, the vmapped fold_ins cost tens of milliseconds of dispatch per step.
    step_key = jax.random.fold_in(public_key, step)
    return jax.vmap(lambda k: jax.random.fold_in(step_key, k))(
        jnp.arange(num_directions, dtype=jnp.uint32))


def _float_groups(leaves: list, max_bytes: int | None = None) -> list[tuple[tuple, list[int]]]:
    """Indices of the float leaves grouped by shape, each group at most ``max_bytes`` of
    float32 (default: the largest leaf, so a group's stacked z is never bigger than it)."""
    sizes = [4 * math.prod(jnp.shape(x)) for x in leaves if _is_float(x)]
    cap = max(sizes, default=0) if max_bytes is None else max_bytes
    by_shape: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_float(x):
            by_shape.setdefault(tuple(jnp.shape(x)), []).append(i)
    groups = []
    for shape, idx in by_shape.items():
        per = max(1, cap // max(4 * math.prod(shape), 1))
        groups += [(shape, idx[j:j + per]) for j in range(0, len(idx), per)]
    return groups


def _leaf_normals(key: jax.Array, leaves: list) -> list:
    """z for every float leaf (None for the others): leaf i is ``normal(fold_in(key, i))``.

    Leaves of one shape are drawn by one `lax.map` over their indices, so XLA compiles one
    random-number kernel per distinct shape instead of one per leaf (a transformer has ~10
    shapes but ~100 leaves; the unrolled generator dominates compile time). A group's draws
    are materialised together, which costs at most one largest leaf of float32.
    """
    out: list = [None] * len(leaves)
    for shape, idx in _float_groups(leaves):
        zs = _group_normals(key, shape, idx)
        for j, i in enumerate(idx):
            out[i] = zs[j]
    return out


def _group_normals(key: jax.Array, shape: tuple, idx: list[int],
                   after: jax.Array | None = None) -> jax.Array:
    """Stacked (len(idx), *shape) float32 draws ``normal(fold_in(key, i))`` for i in idx.

    ``after`` (a float32 scalar, any value): the stack's buffer is filled with it before the
    draws overwrite every row, so the buffer is not allocated before ``after`` is computed."""
    ids = jnp.asarray(idx, jnp.uint32)
    if len(idx) == 1:
        return _normal(jax.random.fold_in(key, ids[0]), shape)[None]
    if after is None:
        return lax.map(lambda i: _normal(jax.random.fold_in(key, i), shape), ids)

    def body(j, acc):
        return lax.dynamic_update_index_in_dim(
            acc, _normal(jax.random.fold_in(key, ids[j]), shape), j, 0)

    return lax.fori_loop(0, len(idx), body, jnp.full((len(idx), *shape), after, jnp.float32))


def direction(key: jax.Array, params: PyTree) -> PyTree:
    """z ~ N(0, I) shaped like ``params``: leaf i from ``fold_in(key, i)``, float32, cast to the
    leaf dtype. Non-float leaves (integer buffers) get zeros: they are never perturbed."""
    leaves, treedef = jax.tree.flatten(params)
    zs = _leaf_normals(key, leaves)
    out = [jnp.zeros_like(x) if z is None else z.astype(jnp.result_type(x))
           for x, z in zip(leaves, zs, strict=True)]
    return jax.tree.unflatten(treedef, out)


def perturbed(params: PyTree, key: jax.Array, scale: float | jax.Array) -> PyTree:
    """θ + scale·z(key), computed leaf by leaf in float32 and cast back to each leaf's dtype.

    The groups of same-shaped leaves are drawn one after another, so besides θ and the result
    it holds one group's draws at a time (at most one largest leaf of float32)."""
    leaves, treedef = jax.tree.flatten(params)
    scale = jnp.asarray(scale, jnp.float32)
    out = list(leaves)
    after = jnp.float32(0.0)
    for shape, idx in _float_groups(leaves):
        zs = _group_normals(key, shape, idx, after=after)
        for j, i in enumerate(idx):
            x = leaves[i]
            out[i] = (x.astype(jnp.float32) + scale * zs[j]).astype(jnp.result_type(x))
        # 0·(this group's results): the next group's draws cannot start before they exist, so
        # one group's z stack is live at a time (unordered, XLA allocates every stack at once).
        after = jnp.float32(0.0) * sum(out[i].reshape(-1)[0].astype(jnp.float32) for i in idx)
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


def mirror_point(center: PyTree, point: PyTree) -> PyTree:
    """2·center − point leaf by leaf (in float32, cast back): θ − εz from θ and θ + εz.

    Jitted with ``donate_argnums=1`` it overwrites the perturbed copy in place."""
    def one(c, p):
        if not _is_float(c):
            return c
        c32 = c.astype(jnp.float32)
        return (c32 + (c32 - p.astype(jnp.float32))).astype(jnp.result_type(c))

    return jax.tree.map(one, center, point)


def two_point_differences(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                          key: jax.Array, eps: float | jax.Array,
                          microbatch_size: int | None = None, *, return_mirror: bool = False
                          ) -> jax.Array | tuple[jax.Array, PyTree]:
    """Per-example projected gradients ĝ_i = (ℓ_i(θ+εz) − ℓ_i(θ−εz)) / (2ε), float32, shape (N,).

    z = `direction` (key, trainable) is drawn once: θ − εz is formed as 2θ − (θ + εz), which
    reuses the first pass's copy in place of a second draw and mirrors the realised (rounded)
    perturbation exactly. θ itself is never modified, so nothing drifts across steps.

    This is the one-function (jit-able, vmap-able, scannable) form that `pavejax.paczero.step`
    runs. The two forward passes are the two iterations of one loop, so the forward is compiled
    once and XLA cannot merge the passes' broadcasts of frozen weights into shared materialised
    buffers (which made a straight-line pair of passes several times slower than two single
    passes on CPU). The first iteration draws z and writes θ + εz into the loop's carry, the
    second reflects the carry in place, so z's draws and each pass's activations share the
    loop body's memory: a step holds θ, one perturbed copy and one pass's activations
    (inference memory plus one copy of θ). ``eps`` may be traced. Non-finite differences (a
    diverged loss) become 0 so that one bad example cannot poison a subset mean; callers clip
    the result to [−c, c].

    With ``return_mirror`` it also returns the mirror point θ − εz (the loop's final carry, so
    no extra memory during the passes): `update_from_mirror` turns it into the update without
    drawing z again.
    """
    eps = jnp.asarray(eps, jnp.float32)
    n = _num_examples(batch)

    def body(i, carry):
        point, losses = carry
        point = lax.cond(i == 0, lambda q: perturbed(trainable, key, eps),
                         lambda q: mirror_point(trainable, q), point)
        # Tied to the loop-varying point, the frozen weights and the batch cannot have their
        # broadcasts hoisted out of the loop (XLA would keep them alive through both passes:
        # about a third more activation memory than inference).
        point, fr, data = lax.optimization_barrier((point, frozen, batch))
        losses = losses.at[i].set(per_example_losses(loss_fn, point, fr, data, microbatch_size))
        return point, losses

    init = (jax.tree.map(jnp.zeros_like, trainable), jnp.zeros((2, n), jnp.float32))
    mirror, losses = lax.fori_loop(0, 2, body, init)
    g = (losses[0] - losses[1]) / (jnp.float32(2.0) * eps)
    g = jnp.where(jnp.isfinite(g), g, jnp.float32(0.0))
    return (g, mirror) if return_mirror else g


def update_from_mirror(params: PyTree, mirror: PyTree, coefficient: jax.Array,
                       learning_rate: float | jax.Array, eps: float | jax.Array) -> PyTree:
    """θ − η·Y·(θ − mirror)/ε: the one-direction update along the realised perturbation.

    ``mirror`` is θ − εz (`mirror_point` of θ + εz, as `two_point_differences` with
    ``return_mirror=True`` returns it), so
    (θ − mirror)/ε is z up to float rounding (|error| <= about ulp(θ)/ε per coordinate, ~1e-4
    of z for weights of size 1 and ε = 1e-3 in float32): the direction whose two-point
    difference was measured. It costs one elementwise pass and no random numbers, against a
    full regeneration of z in `apply_directions`. Jit it with ``donate_argnums=0`` so the new
    θ reuses the old buffers. ``coefficient``: the released scalar Y (shape () or (1,)).
    """
    step = (jnp.asarray(learning_rate, jnp.float32) * jnp.reshape(coefficient, ()).astype(
        jnp.float32) / jnp.asarray(eps, jnp.float32))

    def one(x, m):
        if not _is_float(x):
            return x
        x32 = x.astype(jnp.float32)
        return (x32 - step * (x32 - m.astype(jnp.float32))).astype(jnp.result_type(x))

    return jax.tree.map(one, params, mirror)


def clip_differences(g: jax.Array, clip: float | jax.Array) -> jax.Array:
    """Clips each per-example scalar to [−clip, clip] (|ĝ_i| <= clip: the DP-ZO sensitivity)."""
    c = jnp.asarray(clip, jnp.float32)
    return jnp.clip(g, -c, c)


def _direction_sums(leaves: list, keys: jax.Array, coefficients: jax.Array):
    """Yields (leaf indices, stacked float32 Σ_k Y_k z_k) per group of same-shaped float leaves,
    regenerating each z_k from its key (K = len(keys)); one group's draws live at a time."""
    coefficients = coefficients.astype(jnp.float32)
    for shape, idx in _float_groups(leaves):
        if keys.shape[0] == 1:
            yield idx, coefficients[0] * _group_normals(keys[0], shape, idx)
            continue

        def add(acc, kc, shape=shape, idx=idx):
            k, c = kc
            return acc + c * _group_normals(k, shape, idx), None

        zero = jnp.zeros((len(idx), *shape), jnp.float32)
        yield idx, lax.scan(add, zero, (keys, coefficients))[0]


def apply_directions(params: PyTree, keys: jax.Array, coefficients: jax.Array,
                     learning_rate: float | jax.Array) -> PyTree:
    """θ − η · (1/K) Σ_k Y_k z(key_k), regenerating each z_k from its key (K = len(keys)).

    ``coefficients`` has shape (K,) (the released scalars Y_k). The sum is formed in float32 and
    cast back to each leaf's dtype. Equals ``θ − η · pseudo_gradient(θ, keys, Y)`` without
    materialising the pseudo-gradient (jit it with ``donate_argnums=0`` to update in place).
    """
    step = jnp.asarray(learning_rate, jnp.float32) / jnp.float32(keys.shape[0])
    leaves, treedef = jax.tree.flatten(params)
    out = list(leaves)
    for idx, total in _direction_sums(leaves, keys, coefficients):
        for j, i in enumerate(idx):
            x = leaves[i]
            out[i] = (x.astype(jnp.float32) - step * total[j]).astype(jnp.result_type(x))
    return jax.tree.unflatten(treedef, out)


def pseudo_gradient(params: PyTree, keys: jax.Array, coefficients: jax.Array) -> PyTree:
    """The zeroth-order pseudo-gradient g = (1/K) Σ_k Y_k z(key_k), shaped like ``params``.

    Feed it to any optax optimiser in place of a gradient: ``optax.sgd(η)`` then gives exactly
    the update θ − η g of `apply_directions` (up to rounding). Each z_k is regenerated from its
    public key; ``coefficients`` (K,) are the released scalars Y_k. Float leaves get float32
    sums cast to their dtype; non-float leaves get zeros (they are never perturbed). Costs one
    θ-sized buffer, which `apply_directions` and `update_from_mirror` (the default SGD path)
    avoid.

    Example:
      >>> import optax
      >>> params, y = {"w": jnp.zeros(3)}, jnp.array([1.0, -1.0])
      >>> keys = direction_keys(jax.random.key(0), 0, 2)
      >>> sgd = optax.sgd(0.1)
      >>> updates, _ = sgd.update(pseudo_gradient(params, keys, y), sgd.init(params), params)
      >>> new = optax.apply_updates(params, updates)
      >>> bool(jnp.allclose(new["w"], apply_directions(params, keys, y, 0.1)["w"]))
      True
    """
    scale = jnp.float32(1.0) / jnp.float32(keys.shape[0])
    leaves, treedef = jax.tree.flatten(params)
    out = [jnp.zeros_like(x) for x in leaves]
    for idx, total in _direction_sums(leaves, keys, coefficients):
        for j, i in enumerate(idx):
            out[i] = (scale * total[j]).astype(jnp.result_type(leaves[i]))
    return jax.tree.unflatten(treedef, out)
