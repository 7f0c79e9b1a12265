"""Model-merging operators on pytrees: WA, TA, TIES, DARE, PCB, WUDI, Iso-C, Fisher, RegMean.

Every operator has one signature, ``op(base, task_vectors, *, <keywords>) -> merged``:
``base`` is the shared pretrained pytree w0 and ``task_vectors`` holds tau_t = w_t - w0 for
T tasks, either as a sequence of T pytrees or as one pytree whose leaves carry a leading task
axis T (see :func:`task_vectors`); everything else is a keyword. The result has the structure
and dtypes of ``base``.

Per-task inputs are keyword pytrees that follow the task-vector convention (the structure of
``base`` with a leading task axis T on each leaf, or a list of T pytrees shaped like ``base``):

- ``fisher(fishers=)``: diagonal Fisher estimates, leaves (T, *leaf.shape);
- ``regmean(grams=)``: input Grams (T, in, in) on the 2-D kernels to merge by RegMean,
  ``None`` on the leaves to average;
- ``dare(masks=)``: boolean keep-masks, leaves (T, *leaf.shape), or ``key=`` to draw them;
- ``ties(weights=)``, ``fisher(weights=)``: per-task weights, shape (T,).

Under ``jax.jit`` and ``jax.vmap``: hyper-parameters that enter only the arithmetic
(``scaling``, ``weights``, ``drop_rate``, ``min_fisher``, ``reduce_non_diagonal``, WUDI's
``lr``) may be traced arrays, so ``jax.vmap(lambda lam: ties(base, tvs, scaling=lam))`` sweeps
lambda in one program. Hyper-parameters that fix shapes, sizes or branches (``density``,
``ratio``, ``clamp``, ``iters``, ``normalize`` and the string options) must be Python values;
a traced one raises ``TypeError`` naming it. Range checks run on concrete values only.

Privacy: merging the task vectors of DP-trained models is post-processing; it costs nothing
beyond the training ledgers (tasks on disjoint data compose in parallel). :func:`fisher` and
:func:`regmean` additionally read data statistics (Fisher diagonals, Gram matrices): they are
private only if those statistics were themselves released by a DP mechanism and accounted;
with plain statistics they are **non-private**.

Semantics follow the reference implementations named in each docstring; where a reference
would divide by zero (all-zero task vectors) these functions return 0 for that term instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pavejax._tree import named_leaves
from pavejax.optim import promotion_safe

PyTree = Any


# ------------------------------------------------------------------ plumbing


def task_vectors(base: PyTree, finetuned: Sequence[PyTree]) -> PyTree:
    """Stacked task vectors ``tau[t] = finetuned[t] - base``: leaves of shape (T, *leaf.shape)."""
    if not isinstance(finetuned, (list, tuple)) or not finetuned:
        raise TypeError("finetuned must be a non-empty list of parameter pytrees (one per task).")
    return jax.tree.map(lambda b, *ws: jnp.stack([w - b for w in ws]), base, *finetuned)


def _stacked(base: PyTree, tvs: PyTree) -> PyTree:
    if isinstance(tvs, (list, tuple)):
        if not tvs:
            raise ValueError("task_vectors is empty; pass at least one task vector.")
        tvs = jax.tree.map(lambda *xs: jnp.stack(xs), *tvs)
    if jax.tree.structure(tvs) != jax.tree.structure(base):
        raise ValueError("task_vectors must have the structure of base (plus a leading task "
                         "axis); build them with pavejax.merging.task_vectors.")
    for b, t in zip(jax.tree.leaves(base), jax.tree.leaves(tvs), strict=True):
        if t.shape[1:] != b.shape:
            raise ValueError(f"a task-vector leaf has shape {t.shape}; expected (T, *{b.shape}).")
    return tvs


def apply_task_vector(base: PyTree, merged_tv: PyTree,
                      scaling: float | jax.Array = 1.0) -> PyTree:
    """``base + scaling * merged_tv`` in the dtypes of ``base`` (``scaling`` may be traced)."""
    return jax.tree.map(lambda b, t: (b + t.astype(b.dtype) * jnp.asarray(scaling, b.dtype)),
                        base, merged_tv)


def _grams_leaves(base: PyTree, grams: PyTree) -> list[jax.Array | None]:
    """RegMean's Grams aligned with ``base``'s leaves: an array, or None for "average"."""
    if isinstance(grams, (list, tuple)):
        if not grams:
            raise ValueError("grams is empty; pass one Gram pytree per task or stacked Grams.")
        grams = jax.tree.map(lambda *xs: jnp.stack(xs), *grams)
    try:
        leaves = jax.tree.structure(base).flatten_up_to(grams)
    except (ValueError, TypeError) as e:
        raise ValueError("grams must have the structure of base, with stacked Grams "
                         "(T, in, in) on the kernels to merge and None on the other leaves "
                         f"({e}).") from None
    return leaves


def _flat(tvs: PyTree) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """(T, d) matrix of all leaves, and a function mapping a (d,) vector back to a pytree."""
    leaves, treedef = jax.tree.flatten(tvs)
    shapes = [x.shape[1:] for x in leaves]
    sizes = [math.prod(s) for s in shapes]
    mat = jnp.concatenate([x.reshape(x.shape[0], -1).astype(jnp.float32) for x in leaves], 1)

    def unflat(v: jax.Array) -> PyTree:
        parts, start = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            parts.append(v[start:start + size].reshape(shape))
            start += size
        return jax.tree.unflatten(treedef, parts)

    return mat, unflat


def _traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _static(name: str, value: Any, why: str) -> Any:
    """``value`` unchanged, or a TypeError if it is traced: ``name`` must be known at trace time."""
    if _traced(value):
        raise TypeError(f"{name} must be a Python value, not a traced array: it {why}, which "
                        f"must be known when the operator is traced. Pass a Python number "
                        f"(under jax.jit, close over it or list {name!r} in static_argnames); "
                        f"only multipliers such as scaling may be traced.")
    return value


def _check_fraction(name: str, value: Any, *, closed_low: bool = False,
                    static: str | None = None) -> Any:
    """Range check of a fraction on concrete values; ``static`` (why) forbids a traced value."""
    if static is not None:
        _static(name, value, static)
    elif _traced(value):
        return value
    v = float(value)
    if not (0 <= v <= 1 if closed_low else 0 < v <= 1):
        raise ValueError(f"{name} must be in {'[0' if closed_low else '(0'}, 1], got {value!r}.")
    return v


def _minmax_rows(x: jax.Array) -> jax.Array:
    lo, hi = jnp.min(x, 1, keepdims=True), jnp.max(x, 1, keepdims=True)
    rng = hi - lo
    return jnp.where(rng > 0, (x - lo) / jnp.where(rng > 0, rng, 1.0), 0.0)


# ------------------------------------------------------------------ averaging family


def weight_average(base: PyTree, task_vectors: PyTree) -> PyTree:
    """Weight averaging: ``mean_t w_t = w0 + mean_t tau_t`` (fusion_bench ``simple_average``)."""
    tvs = _stacked(base, task_vectors)
    return apply_task_vector(base, jax.tree.map(lambda t: jnp.mean(t, 0), tvs))


def task_arithmetic(base: PyTree, task_vectors: PyTree, *,
                    scaling: float | jax.Array = 0.3) -> PyTree:
    """Task arithmetic: ``w0 + scaling * sum_t tau_t`` (default 0.3, as in DP-Merging).

    ``scaling`` may be traced: ``jax.vmap(lambda s: task_arithmetic(w0, tvs, scaling=s))``.
    """
    tvs = _stacked(base, task_vectors)
    return apply_task_vector(base, jax.tree.map(lambda t: jnp.sum(t, 0), tvs), scaling)


# ------------------------------------------------------------------ TIES


@functools.partial(jax.jit, static_argnums=(1, 2))
def _ties_global(mat: jax.Array, density: float, merge: str) -> jax.Array:
    t, d = mat.shape
    k = d - int(d * density)  # reference: keep |x| >= the k-th smallest |x| (int(d*K)+1 kept)
    if k <= 0:
        trimmed = mat
    else:
        thr = jnp.sort(jnp.abs(mat), axis=1)[:, k - 1:k]
        trimmed = jnp.where(jnp.abs(mat) >= thr, mat, 0.0)
    sign = jnp.sign(jnp.sum(trimmed, 0))
    sign = jnp.where(sign == 0, jnp.sign(jnp.sum(sign)), sign)
    keep = jnp.where(sign[None, :] > 0, trimmed > 0, trimmed < 0)
    sel = jnp.where(keep, trimmed, 0.0)
    if merge == "sum":
        return jnp.sum(sel, 0)
    if merge == "mean":
        return jnp.sum(sel, 0) / jnp.maximum(jnp.sum((sel != 0).astype(jnp.float32), 0), 1.0)
    return jnp.max(jnp.abs(sel), 0) * sign


@functools.partial(jax.jit, static_argnums=(1, 2))
def _ties_tensor(x: jax.Array, density: float, merge: str, weights: jax.Array) -> jax.Array:
    t = x.shape[0]
    flat = x.reshape(t, -1).astype(jnp.float32)
    n = flat.shape[1]
    if density < 1:
        k = int(density * n)
        if k == 0:
            flat = jnp.zeros_like(flat)
        else:
            _, idx = jax.lax.top_k(jnp.abs(flat), k)  # ties: the lower index is kept
            keep = jnp.zeros_like(flat, dtype=bool).at[jnp.arange(t)[:, None], idx].set(True)
            flat = jnp.where(keep, flat, 0.0)
    weighted = flat * weights[:, None]
    majority = jnp.where(jnp.sum(weighted, 0) >= 0, 1.0, -1.0)
    mask = jnp.sign(weighted) == majority[None, :]
    total = jnp.sum(jnp.where(mask, weighted, 0.0), 0)
    if merge == "mean":
        div = jnp.sum(jnp.where(mask, weights[:, None], 0.0), 0)
        total = total / jnp.where(div == 0, 1.0, div)
    return total.reshape(x.shape[1:])


_TIES_MERGES = ("sum", "mean", "max")


def ties(base: PyTree, task_vectors: PyTree, *, density: float = 0.2, merge: str = "sum",
         scaling: float | jax.Array = 0.3, scope: str = "global",
         weights: Sequence[float] | jax.Array | None = None) -> PyTree:
    """TIES-Merging: trim to the top ``density`` magnitudes, elect signs by mass, disjoint merge.

    ``scope="global"`` follows the original paper's code (= fusion_bench ``ties_merging``): the
    whole model is flattened per task; entries with ``|x| >=`` the (d - int(d*density))-th
    smallest magnitude are kept (ties at the threshold are all kept); the elected sign is
    ``sign(sum_t trimmed_t)``, zero sums taking the sign of the sum of elected signs; then
    ``merge`` is ``"sum"`` (disjoint sum), ``"mean"`` (over agreeing nonzeros) or ``"max"``.
    ``scope="tensor"`` follows mergekit ``ties``: per leaf exactly int(density*n) entries are
    kept (ties broken toward the lower index), ``weights`` multiply tau_t before the election,
    zero sums elect +1, ``merge="mean"`` divides by the sum of agreeing weights.
    Result: ``w0 + scaling * tau_merged``. Defaults: density 0.2, disjoint sum, scaling 0.3.
    ``scaling`` and ``weights`` may be traced; ``density`` must be a Python number.
    """
    tvs = _stacked(base, task_vectors)
    density = _check_fraction("density", density, static="sets how many entries are kept")
    if merge not in _TIES_MERGES:
        raise ValueError(f"merge must be one of {_TIES_MERGES}, got {merge!r}.")
    if scope == "global":
        if weights is not None:
            raise ValueError("weights are a mergekit (scope='tensor') feature; scale the task "
                             "vectors yourself for scope='global'.")
        mat, unflat = _flat(tvs)
        merged = unflat(_ties_global(mat, density, merge))
    elif scope == "tensor":
        if merge == "max":
            raise ValueError("merge='max' exists only for scope='global'.")
        t = jax.tree.leaves(tvs)[0].shape[0]
        w = jnp.ones(t, jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
        if w.shape != (t,):
            raise ValueError(f"weights must have one entry per task ({t}), got {w.shape}.")
        merged = jax.tree.map(lambda x: _ties_tensor(x, density, merge, w), tvs)
    else:
        raise ValueError(f"scope must be 'global' or 'tensor', got {scope!r}.")
    return apply_task_vector(base, merged, scaling)


# ------------------------------------------------------------------ DARE


def dare_masks(key: jax.Array, task_vectors: PyTree, drop_rate: float) -> PyTree:
    """Seeded Bernoulli keep-masks (True w.p. ``1 - drop_rate``), one per leaf and task."""
    leaves, treedef = jax.tree.flatten(task_vectors)
    return jax.tree.unflatten(treedef, [
        jax.random.uniform(jax.random.fold_in(key, i), x.shape) >= jnp.float32(drop_rate)
        for i, x in enumerate(leaves)])


def dare(base: PyTree, task_vectors: PyTree, *, key: jax.Array | None = None,
         drop_rate: float | jax.Array = 0.5, scaling: float | jax.Array = 0.3,
         masks: PyTree | None = None) -> PyTree:
    """DARE + task arithmetic: ``w0 + scaling * sum_t m_t * tau_t / (1 - drop_rate)``.

    The keep-masks ``m_t`` come from ``key`` (:func:`dare_masks`) or are given as ``masks``
    (bool, in the task-vector convention). E[m * tau / (1 - p)] = tau. Rescaling is
    fusion_bench's ``1 / (1 - p)``, not mergekit's L1-norm matching. ``drop_rate`` and
    ``scaling`` may be traced.
    """
    tvs = _stacked(base, task_vectors)
    p = drop_rate if _traced(drop_rate) else float(drop_rate)
    if not _traced(p) and not 0 <= p < 1:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate!r}.")
    if masks is None:
        if key is None:
            raise ValueError("dare needs a PRNG key (key=...) or explicit masks (masks=...).")
        masks = dare_masks(key, tvs, p)
    else:
        masks = _stacked(base, masks)
    inv = 1.0 / (1.0 - p)
    dropped = jax.tree.map(lambda t, m: jnp.where(m, t, 0) * jnp.asarray(inv, t.dtype), tvs,
                           masks)
    return apply_task_vector(base, jax.tree.map(lambda t: jnp.sum(t, 0), dropped), scaling)


# ------------------------------------------------------------------ PCB


def _clamp_quantile(x: jax.Array, lo: float, hi: float) -> jax.Array:
    d = x.shape[1]
    s = jnp.sort(x, axis=1)
    return jnp.clip(x, s[:, int(d * lo)][:, None], s[:, int(d * (1 - hi)) - 1][:, None])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pcb_flat(mat: jax.Array, ratio: float, clamp: float, variant: str) -> jax.Array:
    t = mat.shape[0]
    a = _clamp_quantile(jnp.abs(mat), clamp, clamp)
    tc = jnp.sign(mat) * a
    intra = jnp.exp(jnp.float32(t) * jnp.square(_minmax_rows(a)))
    if variant == "official":
        inter = jnp.tanh(mat * jnp.sum(mat, 0, keepdims=True))
    else:
        inter = jnp.tanh(mat * jnp.sum(jnp.sign(mat) * _minmax_rows(a), 0, keepdims=True))
    scale = _minmax_rows(_clamp_quantile(intra * inter, 1 - ratio, 0.0))
    return jnp.sum(tc * scale, 0) / jnp.maximum(jnp.sum(scale, 0), 1e-12)


def pcb(base: PyTree, task_vectors: PyTree, *, ratio: float = 0.1, clamp: float = 1e-4,
        scaling: float | jax.Array = 1.0, variant: str = "official") -> PyTree:
    """PCB-Merging (official ``PCB_merge``): balance, drop to the top ``ratio``, rescale.

    On the flattened (T, d) task vectors: magnitudes ``a`` clamped to their [clamp, 1-clamp]
    order statistics, ``tc = sign(tau) * a``; intra = exp(T * minmax(a)^2); inter =
    tanh(tau * sum_j tau_j) (``variant="vision"``: tanh(tau * sum_j sign(tau_j) minmax(a_j)));
    scale = minmax(beta clamped below at its int(d(1-ratio))-th order statistic) with beta =
    intra * inter; ``tau_m = sum_t tc_t scale_t / max(sum_t scale_t, 1e-12)``; result
    ``w0 + scaling * tau_m``. Defaults are those of the official file (ratio 0.1, clamp 1e-4);
    the vision code uses ratio 0.05, clamp 0.01, scaling 1.2. ``scaling`` may be traced;
    ``ratio`` and ``clamp`` must be Python numbers.
    """
    tvs = _stacked(base, task_vectors)
    ratio = _check_fraction("ratio", ratio, static="picks an order statistic")
    clamp = _check_fraction("clamp", clamp, closed_low=True, static="picks an order statistic")
    if variant not in ("official", "vision"):
        raise ValueError(f"variant must be 'official' or 'vision', got {variant!r}.")
    mat, unflat = _flat(tvs)
    merged = _pcb_flat(mat, ratio, clamp, variant)
    return apply_task_vector(base, unflat(merged), scaling)


# ------------------------------------------------------------------ WUDI and Iso-C (2-D leaves)


def _is_matrix(path: str, leaf: jax.Array) -> bool:
    return leaf.ndim == 2


def _wudi_loss(m: jax.Array, taus: jax.Array, layout: str) -> jax.Array:
    diff = m[None] - taus
    # torch (out, in): ||(M - W_t) W_t^T||_F^2; flax kernels K = W^T: ||(M - K_t)^T K_t||_F^2.
    spec = "toi,tpi->top" if layout == "torch" else "tio,tip->top"
    inter = jnp.einsum(spec, diff, taus)
    norms = jnp.sum(jnp.square(taus), axis=(1, 2))
    per_task = jnp.sum(jnp.square(inter), axis=(1, 2)) / jnp.maximum(norms, 1e-30)
    return jnp.sum(jnp.where(norms > 0, per_task, 0.0))


@functools.partial(jax.jit, static_argnums=(1, 3))
def _wudi_leaf(taus: jax.Array, iters: int, lr: jax.Array, layout: str) -> jax.Array:
    taus = taus.astype(jnp.float32)
    tx = promotion_safe(optax.adam(lr))
    grad = jax.grad(_wudi_loss)
    m0 = jnp.sum(taus, 0)

    def body(carry, _):
        m, state = carry
        upd, state = tx.update(grad(m, taus, layout), state, m)
        return (optax.apply_updates(m, upd), state), None

    (m, _), _ = jax.lax.scan(body, (m0, tx.init(m0)), None, length=iters)
    return m


def wudi(base: PyTree, task_vectors: PyTree, *, iters: int = 300, lr: float | jax.Array = 1e-5,
         layout: str = "flax", others: str = "mean",
         selector: Callable[[str, jax.Array], bool] | None = None) -> PyTree:
    """WUDI-Merging: per linear layer, data-free Adam on the interference loss.

    For each selected 2-D leaf the merged tau_m starts at ``sum_t tau_t`` and runs ``iters``
    full-batch Adam steps (lr ``lr``, betas 0.9/0.999, eps 1e-8) on
    ``sum_t ||(tau_m - tau_t) tau_t^T||_F^2 / ||tau_t||_F^2`` in torch's (out, in) layout.
    Flax kernels are (in, out) = W^T, so ``layout="flax"`` (default) evaluates the *same*
    objective as ``||(K_m - K_t)^T K_t||_F^2``. Unselected leaves get the mean of the task
    vectors (``others="mean"``, fusion_bench) or stay at w0 (``"zero"``, official ViT code).
    ``selector(path, leaf)`` defaults to "every 2-D leaf". Result: ``w0 + tau_m`` (no scaling).
    ``lr`` may be traced; ``iters`` must be a Python int.
    """
    tvs = _stacked(base, task_vectors)
    if layout not in ("flax", "torch"):
        raise ValueError(f"layout must be 'flax' (in, out) or 'torch' (out, in), got {layout!r}.")
    if others not in ("mean", "zero"):
        raise ValueError(f"others must be 'mean' or 'zero', got {others!r}.")
    _static("iters", iters, "sets the number of Adam steps (the scan length)")
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be an int >= 0, got {iters!r}.")
    selector = _is_matrix if selector is None else selector
    names = list(named_leaves(base))
    leaves, treedef = jax.tree.flatten(tvs)
    merged = []
    for name, b, t in zip(names, jax.tree.leaves(base), leaves, strict=True):
        if b.ndim == 2 and selector(name, b):
            merged.append(_wudi_leaf(t, iters, lr if _traced(lr) else float(lr), layout))
        else:
            merged.append(jnp.mean(t, 0) if others == "mean" else jnp.zeros_like(b))
    return apply_task_vector(base, jax.tree.unflatten(treedef, merged))


def iso_c(base: PyTree, task_vectors: PyTree, *, scaling: float | jax.Array = 1.0) -> PyTree:
    """Iso-C: for each 2-D leaf, ``sum_t tau_t = U S V^T`` becomes ``U mean(S) V^T``.

    Other leaves get the mean of the task vectors. Result ``w0 + scaling * tau_m``
    (fusion_bench ``iso_c`` with ``scaling_factor`` 1.0; ``scaling`` may be traced).
    Transpose-equivariant, so the layout of the kernels does not matter.
    """
    tvs = _stacked(base, task_vectors)

    def leaf(t: jax.Array) -> jax.Array:
        if t.ndim != 3:
            return jnp.mean(t, 0)
        u, s, vt = jnp.linalg.svd(jnp.sum(t.astype(jnp.float32), 0), full_matrices=False)
        return (u * jnp.mean(s)) @ vt

    return apply_task_vector(base, jax.tree.map(leaf, tvs), scaling)


# ------------------------------------------------------------------ data-dependent (statistics)


def fisher(base: PyTree, task_vectors: PyTree, *, fishers: PyTree,
           weights: Sequence[float] | jax.Array | None = None, normalize: bool = True,
           min_fisher: float | jax.Array = 1e-6) -> PyTree:
    """Fisher merging: ``w = sum_t c_t F_t w_t / sum_t c_t F_t`` elementwise on full weights.

    ``fishers``: diagonal Fisher estimates in the task-vector convention (leaves
    (T, *leaf.shape), >= 0). ``F_t`` gets ``+ min_fisher``; ``c_t`` (``weights``, shape (T,))
    defaults to 1/T and, with ``normalize``, becomes ``c_t (1/||F_t||) / sum_s c_s (1/||F_s||)``
    with ``||F_t||`` the global L2 norm of task t's raw Fisher (fusion_bench
    ``merging_with_fisher_weights``). ``weights`` and ``min_fisher`` may be traced.
    **Non-private** unless the Fisher estimates were released by a DP mechanism (they are read
    from the task data).
    """
    tvs = _stacked(base, task_vectors)
    fs = _stacked(base, fishers)
    t = jax.tree.leaves(tvs)[0].shape[0]
    c = jnp.full((t,), 1.0 / t, jnp.float32) if weights is None else jnp.asarray(
        weights, jnp.float32)
    if c.shape != (t,):
        raise ValueError(f"weights must have one entry per task ({t}), got shape {c.shape}.")
    if _static("normalize", normalize, "chooses a branch"):
        norms = jnp.sqrt(sum(jnp.sum(jnp.square(f.reshape(t, -1).astype(jnp.float32)), 1)
                             for f in jax.tree.leaves(fs)))
        inv = 1.0 / norms
        c = c * inv / jnp.sum(c * inv)

    def leaf(b, tau, f):
        shape = (t,) + (1,) * b.ndim
        w = (f.astype(jnp.float32) + jnp.float32(min_fisher)) * c.reshape(shape)
        thetas = b[None].astype(jnp.float32) + tau.astype(jnp.float32)
        return (jnp.sum(w * thetas, 0) / jnp.sum(w, 0)).astype(b.dtype)

    return jax.tree.map(leaf, base, tvs, fs)


def regmean(base: PyTree, task_vectors: PyTree, *, grams: PyTree,
            reduce_non_diagonal: float | jax.Array = 0.95) -> PyTree:
    """RegMean on Flax kernels (in, out): ``K = (sum_t G~_t)^-1 sum_t G~_t K_t``.

    ``grams`` has the structure of ``base``: on each 2-D kernel to merge, the stacked input
    Grams (T, in, in), ``G_t = X_t^T X_t / n_t``; ``None`` on the leaves that get the plain
    mean of the models (or a list of T such pytrees). ``G~_t`` scales off-diagonals by
    ``reduce_non_diagonal`` (may be traced). For a flat dict of parameters,
    ``{**{k: None for k in base}, "kernel": g}`` selects one kernel. **Non-private** unless the
    Grams were released by a DP mechanism (they are read from the task data).
    """
    tvs = _stacked(base, task_vectors)
    r = _check_fraction("reduce_non_diagonal", reduce_non_diagonal, closed_low=True)
    names = list(named_leaves(base))
    leaves, treedef = jax.tree.flatten(tvs)
    out = []
    for name, b, tau, g in zip(names, jax.tree.leaves(base), leaves, _grams_leaves(base, grams),
                               strict=True):
        thetas = b[None].astype(jnp.float32) + tau.astype(jnp.float32)
        if g is None:
            out.append(jnp.mean(thetas, 0).astype(b.dtype))
            continue
        g = jnp.asarray(g, jnp.float32)
        if b.ndim != 2 or g.shape != (thetas.shape[0], b.shape[0], b.shape[0]):
            raise ValueError(f"grams[{name!r}] has shape {g.shape}; expected (T, in, in) = "
                             f"({thetas.shape[0]}, {b.shape[0]}, {b.shape[0]}) for a 2-D kernel.")
        eye = jnp.eye(b.shape[0], dtype=jnp.float32)
        g = g * (r + (1.0 - r) * eye)[None]
        rhs = jnp.einsum("tij,tjo->io", g, thetas)
        out.append(jnp.linalg.solve(jnp.sum(g, 0), rhs).astype(b.dtype))
    return jax.tree.unflatten(treedef, out)


OPERATORS: dict[str, Callable[..., PyTree]] = {
    "wa": weight_average, "ta": task_arithmetic, "ties": ties, "dare": dare, "pcb": pcb,
    "wudi": wudi, "iso_c": iso_c, "fisher": fisher, "regmean": regmean,
}
