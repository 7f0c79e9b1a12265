"""Per-example gradients, joint L2 clipping and the clipped sum.

The core takes a per-example loss ``loss_fn(trainable, frozen, example) -> scalar`` and never
imports a model. ``example`` is one row of ``batch`` (every leaf of ``batch`` has a leading batch
axis that is vmapped away).

Formal guarantees:
  With ``clipping="joint"`` every real example contributes a vector of joint L2 norm at most
  ``l2_clip`` (over the whole trainable pytree) to the clipped sum, so the sum has L2 sensitivity
  ``l2_clip`` under add/remove-one and ``2 * l2_clip`` under replace-one neighbouring.
  With ``clipping="per_layer"`` each of the L leaves is clipped to ``l2_clip`` on its own; the
  joint norm can reach ``l2_clip * sqrt(L)`` and the sensitivity is reported as such.
  Padded rows (``mask == False``) and rows whose gradient is not finite contribute exactly zero.

Sharp edges:
  * Microbatching changes memory, never the result (up to float summation order).
  * ``sparse_rows`` (embedding tables) is exact only if the model uses the id field solely as
    row indices into that table: the ids are remapped to positions in a per-example table of
    the unique rows the example touches, so that no per-example copy of the table is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pavejax._tree import named_leaves

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]

_CLIPPINGS = ("joint", "per_layer")
#: How per-example gradient norms and the clipped sum are computed (never what they are).
METHODS = ("vmap", "ghost", "ghost_two_pass")


def _finite_float(name: str, value: float, *, positive: bool = True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}.") from None
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}; "
                         f"pass e.g. {name}=1.0.")
    return v


@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """How per-example gradients are bounded.

    Attributes:
      l2_clip: clip norm C (> 0, finite). Joint: bound on the whole per-example gradient;
        per-layer: bound on each leaf.
      clipping: ``"joint"`` (default; sensitivity C) or ``"per_layer"`` (sensitivity C*sqrt(L)).
      sparse_rows: mapping from a trainable leaf path (``"a/b/embedding"``) to the example field
        holding the int row ids that index it (``"input_ids"``); see the module docstring.
      method: ``"vmap"`` (default: per-example gradients materialised by ``jax.vmap``, in
        microbatches), ``"ghost"`` (ghost clipping with book-keeping: norms from activations and
        output gradients, one backward pass; :mod:`pavejax.privacy.ghost`) or
        ``"ghost_two_pass"`` (ghost norms, then a second backward of the clip-weighted loss;
        less memory, more time). All three compute the same clipped sum up to float summation
        order; the guarantee does not depend on the choice.
    """

    l2_clip: float
    clipping: str = "joint"
    sparse_rows: Mapping[str, str] | tuple = ()
    method: str = "vmap"

    def __post_init__(self):
        object.__setattr__(self, "l2_clip", _finite_float("l2_clip", self.l2_clip))
        if self.clipping not in _CLIPPINGS:
            raise ValueError(f"clipping must be one of {_CLIPPINGS}, got {self.clipping!r}.")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
        if self.method != "vmap" and self.clipping != "joint":
            raise ValueError(f"method={self.method!r} supports joint clipping only; use "
                             "clipping='joint' or method='vmap' for per-layer clipping.")
        # Stored as sorted pairs so that the config is hashable (a static jit argument).
        object.__setattr__(self, "sparse_rows", tuple(sorted(dict(self.sparse_rows).items())))

    def sensitivity(self, num_leaves: int, relation: str = "add_remove") -> float:
        """L2 sensitivity of the clipped sum for a trainable pytree with ``num_leaves`` leaves."""
        base = self.l2_clip * (math.sqrt(num_leaves) if self.clipping == "per_layer" else 1.0)
        if relation in ("add_remove", "add_or_remove_one"):
            return base
        if relation in ("replace_one",):
            return 2.0 * base
        raise ValueError(f"relation must be 'add_remove' or 'replace_one', got {relation!r}.")


class ClipResult(NamedTuple):
    """Output of :func:`clipped_sum` (all arrays, jit-friendly).

    grad_sum: pytree like ``trainable``, the sum of clipped per-example gradients of real rows.
    losses: (B,) float32 per-example losses (0 on padded rows).
    norms: (B,) float32 joint per-example gradient norms before clipping (0 on padded rows).
    num_clipped: int32 count of real rows whose gradient was scaled down.
    num_nonfinite: int32 count of real rows whose loss or gradient was NaN/Inf (they contribute 0).
    """

    grad_sum: PyTree
    losses: jax.Array
    norms: jax.Array
    num_clipped: jax.Array
    num_nonfinite: jax.Array


def leaf_paths(tree: PyTree) -> list[str]:
    """Paths of the leaves of ``tree`` in flattening order (``pavejax.lora.path_string``)."""
    return list(named_leaves(tree))


def per_example_norms(grads: PyTree) -> jax.Array:
    """Joint L2 norm over all leaves of per-example gradients with leading axis B -> (B,)."""
    sq = []
    for g in jax.tree.leaves(grads):
        # A sum over the axes, not a reshape: a reshape would gather a leaf sharded on a
        # non-leading dimension onto every device.
        g = g.astype(jnp.float32)
        sq.append(jnp.sum(g * g, axis=tuple(range(1, g.ndim))))
    return jnp.sqrt(sum(sq[1:], sq[0]))


def clip_per_example(grads: PyTree, l2_clip: float, *, clipping: str = "joint"):
    """Clips per-example gradients (leading axis B) -> (clipped, norms (B,), scales).

    Joint clipping scales example i by min(1, C / ||g_i||) over the whole pytree; per-layer
    clipping applies the same rule to each leaf separately. Non-finite examples get scale 0.
    """
    norms = per_example_norms(grads)
    if clipping == "joint":
        scale = clip_coefficients(norms, l2_clip)
        clipped = jax.tree.map(lambda g: g * _bcast(scale, g).astype(g.dtype), grads)
        return clipped, norms, scale
    finite = jnp.isfinite(norms)

    def _leaf(g):
        n = per_example_norms(g)
        return g * _bcast(jnp.where(finite, clip_coefficients(n, l2_clip), 0.0), g).astype(g.dtype)

    clipped = jax.tree.map(_leaf, grads)
    return clipped, norms, jnp.where(finite, clip_coefficients(norms, l2_clip), 0.0)


def clip_coefficients(norms: jax.Array, l2_clip: float) -> jax.Array:
    """Per-example joint clipping factors ``min(1, C / ||g_i||)`` from the norms; 0 where a norm
    is not finite (such an example contributes nothing). Multiply example i's gradient by it."""
    c = jnp.float32(l2_clip)
    safe = jnp.where(jnp.isfinite(norms), norms, jnp.float32(1.0))
    scale = jnp.minimum(jnp.float32(1.0), c / jnp.maximum(safe, jnp.float32(1e-30)))
    return jnp.where(jnp.isfinite(norms), scale, jnp.float32(0.0))


def _bcast(v: jax.Array, like: jax.Array) -> jax.Array:
    return v.reshape(v.shape + (1,) * (like.ndim - 1))


def _get(tree, path):
    for k in path.split("/"):
        tree = tree[k] if not isinstance(tree, (list, tuple)) else tree[int(k)]
    return tree


def _with_sparse(trainable, example, sparse_rows):
    """Replaces each sparse table by the unique rows this example touches (not differentiated)."""
    if not sparse_rows:
        return trainable, example, {}
    paths = leaf_paths(trainable)
    leaves, treedef = jax.tree.flatten(trainable)
    example = dict(example)
    rows = {}
    for p, field in sparse_rows:
        ids = example[field]
        uniq, inv = jnp.unique(ids.reshape(-1), size=ids.size, return_inverse=True)
        idx = paths.index(p)
        leaves[idx] = leaves[idx][uniq]
        example[field] = inv.reshape(ids.shape).astype(ids.dtype)
        rows[p] = uniq
    return jax.tree.unflatten(treedef, leaves), example, rows


def _check_sparse(trainable, batch, sparse_rows):
    paths = leaf_paths(trainable)
    for p, field in sparse_rows:
        if p not in paths:
            raise ValueError(f"sparse_rows names {p!r}, which is not a trainable leaf; "
                             f"available: {paths[:8]}{' ...' if len(paths) > 8 else ''}.")
        if not isinstance(batch, Mapping) or field not in batch:
            raise ValueError(f"sparse_rows needs the example field {field!r} holding row ids; "
                             "pass the batch as a dict with that key.")
        if not jnp.issubdtype(batch[field].dtype, jnp.integer):
            raise TypeError(f"sparse_rows field {field!r} must hold integer ids, "
                            f"got {batch[field].dtype}.")


def _chunk_clipped_sum(loss_fn, trainable, frozen, batch, mask, cfg: ClipConfig):
    """Clipped sum over one (micro)batch; the per-example gradients live only in this chunk.

    The sum is a contraction of per-example coefficients with the per-example gradients (one
    read of them), not a scale-then-sum (several passes); rows that are padding or not finite
    get coefficient 0, and a NaN anywhere switches to a path that zeroes such rows first.
    ``cfg.method`` other than ``"vmap"`` goes to :mod:`pavejax.privacy.ghost` (same contract).
    """
    if cfg.method != "vmap":
        from pavejax.privacy.ghost import ghost_pass

        g = ghost_pass(loss_fn, trainable, frozen, batch,
                       two_pass=cfg.method == "ghost_two_pass")
        finite = jnp.isfinite(g.norms) & jnp.isfinite(g.losses)
        keep = mask & finite
        coef = jnp.where(keep, clip_coefficients(g.norms, cfg.l2_clip), 0.0)
        scale = jnp.where(keep, clip_coefficients(g.norms, cfg.l2_clip), 1.0)
        total = g.clipped_sum(coef, keep)
        return total, chunk_stats(g.losses, g.norms, mask, keep, finite, scale)

    def one(example):
        small, ex, rows = _with_sparse(trainable, example, cfg.sparse_rows)
        loss, g = jax.value_and_grad(loss_fn)(small, frozen, ex)
        return loss.astype(jnp.float32), g, rows

    losses, grads, rows = jax.vmap(one)(batch)
    norms = per_example_norms(grads)
    finite = jnp.isfinite(norms) & jnp.isfinite(losses)
    keep = mask & finite
    if cfg.clipping == "joint":
        coefs = jax.tree.map(
            lambda _: jnp.where(keep, clip_coefficients(norms, cfg.l2_clip), 0.0), grads)
        scale = jnp.where(keep, clip_coefficients(norms, cfg.l2_clip), 1.0)
    else:
        coefs = jax.tree.map(
            lambda g: jnp.where(keep, clip_coefficients(per_example_norms(g), cfg.l2_clip), 0.0),
            grads)
        scale = jnp.where(keep, clip_coefficients(norms, cfg.l2_clip), 1.0)

    def fast(grads):
        return _weighted_sum(trainable, grads, coefs, rows)

    def safe(grads):
        clean = jax.tree.map(
            lambda g: jnp.where(_bcast(keep, g), g, jnp.zeros((), g.dtype)), grads)
        return _weighted_sum(trainable, clean, coefs, rows)

    total = jax.lax.cond(jnp.all(finite), fast, safe, grads)
    return total, chunk_stats(losses, norms, mask, keep, finite, scale)


def chunk_stats(losses, norms, mask, keep, finite, scale):
    """(losses of kept rows, norms of real rows, #clipped, #non-finite) of one chunk; the
    statistics part of the chunk contract shared by the vmap and ghost paths."""
    return (
        jnp.where(keep, losses, 0.0),
        jnp.where(mask, norms, 0.0),
        jnp.sum((keep & (scale < 1.0)).astype(jnp.int32)),
        jnp.sum((mask & ~finite).astype(jnp.int32)),
    )


def _weighted_sum(trainable, grads, coefs, rows):
    """sum_i coef_i * g_i per leaf; sparse tables are scattered into their rows."""
    paths = leaf_paths(trainable)
    t_leaves, treedef = jax.tree.flatten(trainable)
    g_leaves, c_leaves = jax.tree.leaves(grads), jax.tree.leaves(coefs)
    out = []
    for p, t, g, c in zip(paths, t_leaves, g_leaves, c_leaves):
        c = c.astype(g.dtype)
        if p in rows:
            flat = (g * _bcast(c, g)).reshape((-1,) + t.shape[1:])
            out.append(jnp.zeros_like(t).at[rows[p].reshape(-1)].add(flat.astype(t.dtype)))
        else:
            out.append(jnp.tensordot(c, g, axes=1).astype(t.dtype))
    return jax.tree.unflatten(treedef, out)


def check_microbatch_size(microbatch_size: int | None) -> int | None:
    """Validates a microbatch size (a performance knob: it never changes the result)."""
    if microbatch_size is not None and (isinstance(microbatch_size, bool) or not isinstance(
            microbatch_size, int) or microbatch_size < 1):
        raise ValueError(f"microbatch_size must be a positive int or None, "
                         f"got {microbatch_size!r}.")
    return microbatch_size


def clipped_sum(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                mask: jax.Array | None, cfg: ClipConfig, *, microbatch_size: int | None = None,
                axis_name: str | None = None) -> ClipResult:
    """Sum over real rows of per-example gradients, each clipped as ``cfg`` says.

    Args:
      loss_fn: per-example loss ``(trainable, frozen, example) -> scalar``.
      trainable: pytree differentiated per example.
      frozen: pytree passed through unchanged (not differentiated, not batched).
      batch: pytree whose leaves have a leading axis B (padded to a static size).
      mask: (B,) bool, True for real rows; ``None`` means all rows are real.
      cfg: the :class:`ClipConfig`.
      microbatch_size: examples per vmapped chunk (memory only, never the result); ``None``
        vmaps the whole batch at once. The batch size must be a multiple of it.
      axis_name: inside the caller's ``shard_map`` whose ``axis_name`` axis shards the batch:
        each device clips its own rows and the sums (and counts) are ``psum``-ed over the axis,
        so every device returns the global clipped sum; ``losses``/``norms`` stay per shard.
        The parameters are ``pcast`` to varying first (see :mod:`pavejax.privacy.sharding`:
        without it JAX would sum per-example gradients across shards *before* clipping).

    Returns:
      :class:`ClipResult`. Jittable; with ``microbatch_size`` the batch is processed in
      sequential chunks (``lax.scan``), so at most ``microbatch_size`` per-example gradients
      exist at once.
    """
    if axis_name is not None:
        varying = jax.tree.map(lambda p: jax.lax.pcast(p, axis_name, to="varying"), trainable)
        r = clipped_sum(loss_fn, varying, frozen, batch, mask, cfg,
                        microbatch_size=microbatch_size)
        return ClipResult(jax.lax.psum(r.grad_sum, axis_name), r.losses, r.norms,
                          jax.lax.psum(r.num_clipped, axis_name),
                          jax.lax.psum(r.num_nonfinite, axis_name))
    bsz = jax.tree.leaves(batch)[0].shape[0]
    if cfg.sparse_rows:
        _check_sparse(trainable, batch, cfg.sparse_rows)
    mask = jnp.ones((bsz,), bool) if mask is None else jnp.asarray(mask).astype(bool)
    if mask.shape != (bsz,):
        raise ValueError(f"mask must have shape ({bsz},) to match the batch, got {mask.shape}.")
    mb = check_microbatch_size(microbatch_size)
    if mb is None or mb >= bsz:
        total, (losses, norms, nclip, nbad) = _chunk_clipped_sum(
            loss_fn, trainable, frozen, batch, mask, cfg)
        return ClipResult(total, losses, norms, nclip, nbad)
    if bsz % mb:
        raise ValueError(f"batch size {bsz} is not a multiple of microbatch_size {mb}; "
                         "pad the batch (mask the padding) or pick a divisor.")
    chunks = jax.tree.map(lambda x: x.reshape((bsz // mb, mb) + x.shape[1:]), (batch, mask))
    zero = jax.tree.map(jnp.zeros_like, trainable)

    def body(acc, chunk):
        b, m = chunk
        total, (losses, norms, nclip, nbad) = _chunk_clipped_sum(
            loss_fn, trainable, frozen, b, m, cfg)
        acc_sum, acc_clip, acc_bad = acc
        acc_sum = jax.tree.map(jnp.add, acc_sum, total)
        return (acc_sum, acc_clip + nclip, acc_bad + nbad), (losses, norms)

    # Counters derived from the mask: inside a caller's shard_map they are then per-device
    # (varying) values like the loop's outputs, which lax.scan requires.
    count0 = jnp.sum(jnp.zeros_like(mask, jnp.int32))
    init = (zero, count0, count0)
    (total, nclip, nbad), (losses, norms) = jax.lax.scan(body, init, chunks)
    return ClipResult(total, losses.reshape(bsz), norms.reshape(bsz), nclip, nbad)
