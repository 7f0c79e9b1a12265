"""Low-rank (LoRA-style) factors for selected leaves of any params pytree.

Orientation. Flax stores a dense kernel as ``W`` of shape ``(d_in, d_out)`` and computes
``y = x @ W``. An adapted leaf becomes

    W' = W + (alpha / r) * A @ B,      A: (d_in, r) "down", frozen;   B: (r, d_out) "up", trained.

In the papers' ``(out, in)`` notation the weight is ``W^T`` and the update reads ``W^T + B_p A_p``
with ``A_p = A^T`` of shape ``(r, in)`` and ``B_p = B^T`` of shape ``(out, r)``; the factor
distributions are the same, only transposed. A leaf with more than two dimensions (a conv kernel
``(kh, kw, c_in, c_out)``, an attention kernel ``(in, heads, head_dim)``) is read as the matrix
``(prod(shape[:-1]), shape[-1])``: only the last axis counts as the output axis, and the delta is
reshaped back to the leaf's shape.

Factors. ``B`` (trainable) and ``A`` (frozen, secret) are two separate flat dicts keyed by the
leaf's path string (key names joined by ``"/"``, e.g. ``"encoder/layer_0/query/kernel"``). A flat
dict keeps ``A`` out of any pytree handed to ``jax.grad``/optimisers, flattens in sorted path
order (the same order as :func:`flatten_B`), and serialises as it is.

Merged or factored. :func:`apply_lora` merges the delta into the params (works with any model).
A model that takes ``lora=LoraAdapters(B, A, config)`` (the BERT encoder and text classifier of
:mod:`pavejax.models`) instead adds ``(alpha / r) * (x A) B`` to each adapted layer's output:
the same function, and per-example gradients of ``B`` that are rank-r products rather than
projections of a dense ``(d_in, d_out)`` cotangent per example, which makes DP-SGD with LoRA
cheaper. :func:`lora_update` is the term itself, for other models.

Secret A. ``A`` is derived from the key with ``jax.random.fold_in(key, i)``, ``i`` the position
of the leaf in sorted path order, so one key and one selection always give the same ``A``. The
conditional sketch guarantee of compact PAVE needs ``A`` (and its key) to stay secret; release
:func:`a_hash`, never ``A``.

Sharp edges:
  * No value checks inside :func:`apply_lora` (it must jit and differentiate without a host
    sync): a NaN or inf in ``B`` or ``A`` propagates into exactly the adapted leaves.
  * ``A`` depends on the whole selection: adding a leaf to the selection can shift the index,
    and hence ``A``, of other leaves. Fix the predicate once per backbone.
  * With ``init="gaussian"`` the sketch gain ``E[A^T A] = (d_in / r) I_r`` grows with fan-in,
    so leaves of different ``d_in`` weigh differently in ``B A`` relative to ``B``;
    ``"kaiming_uniform"`` gives ``I_r / 3`` for every leaf.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax._tree import named_leaves as named_leaves, path_string as path_string

PyTree = Any
Factors = dict[str, jax.Array]
Predicate = Callable[[str, Any], bool]

_INITS = ("gaussian", "kaiming_uniform")
_HASH_DOMAIN = b"pavejax.lora.A.v1"
_SHOWN_PATHS = 8


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, scale and initialisation of the low-rank factors.

    Attributes:
      rank: ``r >= 1``; each adapted leaf must have ``r <= min(d_in, d_out)``.
      alpha: scale numerator, ``> 0``; the update is ``(alpha / r) * A @ B``. ``None`` (default)
        means ``alpha = r``, i.e. scale 1, so that ``B`` is in the units of the papers' plain
        ``W + B A`` (PEFT's defaults ``r=8, lora_alpha=8`` also give scale 1).
      init: ``"gaussian"`` (default): ``A_ij ~ N(0, 1/r)`` (PAVE privacy paper), so
        ``E[A A^T] = I_{d_in}`` and ``x -> x @ A`` is a Johnson-Lindenstrauss sketch; or
        ``"kaiming_uniform"``: ``A_ij ~ U(-b, b)`` with ``b = 1/sqrt(d_in)`` (PEFT's default
        ``kaiming_uniform_(a=sqrt(5))`` over ``fan_in = d_in``), so ``E[A^T A] = I_r / 3`` for
        every leaf whatever its fan-in.
      dtype: floating dtype of ``A`` and ``B`` (default float32).
    """

    rank: int
    alpha: float | None = None
    init: str = "gaussian"
    dtype: Any = jnp.float32

    def __post_init__(self):
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
            raise TypeError(f"rank must be an int, got {rank!r}; pass e.g. rank=8.")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}; pass e.g. rank=8.")
        object.__setattr__(self, "rank", int(rank))
        alpha = float(rank) if self.alpha is None else self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating):
            raise TypeError(f"alpha must be a real number or None, got {alpha!r}.")
        if not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}; "
                             f"pass alpha=None for scale 1 (alpha = rank).")
        object.__setattr__(self, "alpha", float(alpha))
        if self.init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {self.init!r}.")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise TypeError(f"dtype must be a floating dtype, got {self.dtype!r}.") from None
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype must be a floating dtype such as float32 or bfloat16, "
                            f"got {dtype}.")
        object.__setattr__(self, "dtype", dtype)

    @property
    def scale(self) -> float:
        """The multiplier ``alpha / rank`` of ``A @ B``."""
        return self.alpha / self.rank


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(d_in, d_out) of a kernel of ``shape`` seen as a matrix: all leading axes are inputs."""
    return math.prod(shape[:-1]), shape[-1]


def _check_adaptable(path: str, leaf: Any) -> None:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        dtype = np.asarray(leaf).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"leaf {path!r} has dtype {dtype}; only floating leaves can carry LoRA "
                        f"factors. Narrow the predicate, e.g. path.endswith('kernel').")
    if np.ndim(leaf) < 2:
        raise ValueError(f"leaf {path!r} has shape {np.shape(leaf)}; LoRA needs a leaf with at "
                         f"least 2 dimensions (in..., out). Narrow the predicate, e.g. "
                         f"path.endswith('kernel').")


def _adaptable(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.ndim(leaf) >= 2


def select_paths(params: PyTree, predicate: Predicate) -> tuple[str, ...]:
    """Path strings of the leaves for which ``predicate(path, leaf)`` is true, sorted.

    Every selected leaf must be floating with ``ndim >= 2`` (read as ``(prod(in dims), out)``);
    a selected integer/key leaf raises ``TypeError``, a selected 0-/1-D leaf ``ValueError``.
    A predicate that selects nothing raises ``ValueError`` listing some adaptable paths.
    """
    leaves = named_leaves(params)
    chosen = [p for p, leaf in leaves.items() if predicate(p, leaf)]
    if not chosen:
        candidates = [p for p, leaf in leaves.items() if _adaptable(leaf)] or list(leaves)
        shown = ", ".join(repr(p) for p in candidates[:_SHOWN_PATHS])
        more = " ..." if len(candidates) > _SHOWN_PATHS else ""
        raise ValueError(f"the predicate matched no leaf of the {len(leaves)} in params. "
                         f"Adaptable paths include: {shown}{more}. Adjust the predicate, e.g. "
                         f"lambda path, leaf: path.endswith('kernel').")
    for p in chosen:
        _check_adaptable(p, leaves[p])
    return tuple(sorted(chosen))


def _init_a(key: jax.Array, d_in: int, config: LoraConfig) -> jax.Array:
    shape = (d_in, config.rank)
    if config.init == "gaussian":
        a = jax.random.normal(key, shape, jnp.float32) * (1.0 / math.sqrt(config.rank))
    else:
        bound = 1.0 / math.sqrt(d_in)  # sqrt(6 / ((1 + 5) * fan_in)) for a = sqrt(5)
        a = jax.random.uniform(key, shape, jnp.float32, minval=-bound, maxval=bound)
    return a.astype(config.dtype)


def init_lora(key: jax.Array, params: PyTree, predicate: Predicate,
              config: LoraConfig) -> tuple[Factors, Factors]:
    """Create ``(B, A)`` for the leaves selected by ``predicate`` (see :func:`select_paths`).

    For a selected leaf ``W`` read as ``(d_in, d_out)``: ``A`` has shape ``(d_in, r)`` and is
    drawn from ``fold_in(key, i)`` (``i``: index of the path in sorted order) with the
    distribution ``config.init``; ``B`` has shape ``(r, d_out)`` and is zero, so the adapted
    params equal ``params`` at the start. Both are dicts ``{path: array}`` of ``config.dtype``.
    ``B`` is the trainable pytree; ``A`` is frozen and secret (release :func:`a_hash` only).

    Raises ``ValueError`` if ``r > min(d_in, d_out)`` for some selected leaf.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a LoraConfig, got {type(config).__name__}.")
    paths = select_paths(params, predicate)
    leaves = named_leaves(params)
    dims = {p: matrix_shape(np.shape(leaves[p])) for p in paths}
    too_small = [f"{p!r} {np.shape(leaves[p])}" for p, (i, o) in dims.items()
                 if config.rank > min(i, o)]
    if too_small:
        raise ValueError(f"rank {config.rank} exceeds min(d_in, d_out) of " +
                         ", ".join(too_small) + "; lower the rank or deselect those leaves.")
    a = {p: _init_a(jax.random.fold_in(key, i), dims[p][0], config)
         for i, p in enumerate(paths)}
    b = {p: jnp.zeros((config.rank, dims[p][1]), config.dtype) for p in paths}
    return b, a


def _check_mapping(name: str, factors: Any) -> None:
    if not isinstance(factors, Mapping):
        raise TypeError(f"{name} must be a dict {{path: array}} as returned by init_lora, "
                        f"got {type(factors).__name__}.")


def _check_pair(b: Mapping, a: Mapping, config: LoraConfig) -> None:
    _check_mapping("B", b)
    _check_mapping("A", a)
    if set(b) != set(a):
        only_b, only_a = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        raise ValueError(f"B and A must have the same paths; only in B: {only_b}, "
                         f"only in A: {only_a}.")
    for p in b:
        ash, bsh = np.shape(a[p]), np.shape(b[p])
        if len(ash) != 2 or len(bsh) != 2 or ash[1] != config.rank or bsh[0] != config.rank:
            raise ValueError(f"at {p!r} expected A (d_in, {config.rank}) and B "
                             f"({config.rank}, d_out), got A {ash} and B {bsh}; were the factors "
                             f"made with this config?")


def lora_delta(B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
               config: LoraConfig) -> Factors:
    """Dense updates ``{path: (alpha / r) * A @ B}``, each of shape ``(d_in, d_out)``.

    Computed in the factors' dtype at the highest matmul precision (so the result does not
    depend on the backend's default float32 matmul mode). Pure and jittable.
    """
    _check_pair(B, A, config)
    return {p: jnp.matmul(A[p], B[p], precision=jax.lax.Precision.HIGHEST) * config.scale
            for p in sorted(B)}


def apply_lora(params: PyTree, B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
               config: LoraConfig) -> PyTree:
    """Params with ``W + (alpha / r) * A @ B`` at the adapted paths, unchanged elsewhere.

    Pure, jittable (``config`` static) and differentiable w.r.t. ``B`` and ``A``. The delta is
    reshaped to the leaf's shape and cast to the leaf's dtype before the addition; leaves that
    are not adapted are returned as the same objects. No finiteness check: NaN/inf in the
    factors reach exactly the adapted leaves.
    """
    _check_pair(B, A, config)
    leaves = named_leaves(params)
    missing = sorted(set(B) - set(leaves))
    if missing:
        raise ValueError(f"paths {missing} are not leaves of params; the factors were made for "
                         f"another params structure.")
    for p in B:
        d_in, d_out = matrix_shape(np.shape(leaves[p]))
        if (np.shape(A[p])[0], np.shape(B[p])[1]) != (d_in, d_out):
            raise ValueError(f"at {p!r} the leaf {np.shape(leaves[p])} needs A ({d_in}, r) and "
                             f"B (r, {d_out}), got A {np.shape(A[p])} and B {np.shape(B[p])}.")
    deltas = lora_delta(B, A, config)

    def update(keypath, w):
        delta = deltas.get(path_string(keypath))
        if delta is None:
            return w
        return w + delta.reshape(np.shape(w)).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(update, params)


@jax.tree_util.register_pytree_with_keys_class
class LoraAdapters:
    """LoRA factors handed to a model's forward pass, applied factored instead of merged.

    A model that accepts ``lora=LoraAdapters(B, A, config)`` computes, at every adapted dense
    kernel ``W`` (path ``p``, relative to the module called),

        y = x @ W + bias + (alpha / r) * (x @ A[p]) @ B[p],

    which equals ``x @ (W + (alpha / r) * A[p] @ B[p]) + bias`` (the params of
    :func:`apply_lora`) up to float rounding, so outputs and gradients are those of the merged
    model. Why factored: the gradient w.r.t. ``B[p]`` is then ``(alpha / r) * (x A)^T delta``, a
    rank-r product, whereas differentiating through the merged weight first forms the
    ``(d_in, d_out)`` cotangent ``x^T delta`` and projects it with ``A^T``. Per example (DP-SGD
    with per-example clipping) that dense cotangent is formed once per example and adapted
    kernel; the factored form never builds it. The forward pass costs two extra rank-r matmuls
    per adapted kernel instead of one ``(d_in, r) @ (r, d_out)`` merge.

    ``B`` and ``A`` are the dicts of :func:`init_lora` (keyed by path strings relative to the
    module called). A pytree (``B`` and ``A`` are its children, ``config`` is static), so it
    passes through ``jax.jit``/``vmap``/``grad``; ``B`` is what ``jax.grad`` should see (put it in
    the trainable pytree and build the adapters inside the loss). Models that support it:
    :class:`pavejax.models.BertEncoder` and :class:`pavejax.models.TextClassifier`; any model can
    apply a factor pair with :func:`lora_update`.

    Sharp edges: the adapter product runs in ``x``'s dtype at the highest matmul precision (as
    :func:`lora_delta`), while the merged path casts ``A @ B`` to the kernel's dtype first; with
    float32 kernels both agree to float32 rounding. No finiteness checks (as :func:`apply_lora`).
    """

    def __init__(self, B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
                 config: LoraConfig):
        if not isinstance(config, LoraConfig):
            raise TypeError(f"config must be a LoraConfig, got {type(config).__name__}.")
        _check_pair(B, A, config)
        self.B, self.A, self.config = dict(B), dict(A), config

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return ((keys("B"), self.B), (keys("A"), self.A)), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        # No validation: tree utilities rebuild nodes with arbitrary leaves (None, sentinels).
        out = object.__new__(cls)
        out.B, out.A = children
        out.config = config
        return out

    @property
    def paths(self) -> tuple[str, ...]:
        """The adapted paths, sorted."""
        return tuple(sorted(self.B))

    def __contains__(self, path: str) -> bool:
        return path in self.B

    def __repr__(self) -> str:
        return f"LoraAdapters(paths={list(self.paths)}, config={self.config})"

    def under(self, prefix: str) -> LoraAdapters:
        """The adapters whose path starts with ``prefix + "/"``, re-rooted below ``prefix``."""
        head = prefix.rstrip("/") + "/"
        keep = [p for p in self.B if p.startswith(head)]
        return LoraAdapters({p[len(head):]: self.B[p] for p in keep},
                            {p[len(head):]: self.A[p] for p in keep}, self.config)

    def check_targets(self, targets: Mapping[str, tuple[int, int]], where: str) -> None:
        """Raises ``ValueError`` unless every path is a key of ``targets`` ({path: (d_in,
        d_out)}, the kernels ``where`` can adapt factored) with factors of matching shape."""
        unknown = [p for p in self.paths if p not in targets]
        if unknown:
            shown = ", ".join(repr(p) for p in sorted(targets)[:_SHOWN_PATHS])
            raise ValueError(
                f"{where} cannot apply factored LoRA at {unknown}: paths are relative to the "
                f"module called, and the adaptable kernels include {shown} ... Build the factors "
                f"with init_lora on that module's params, or merge them with apply_lora.")
        for p in self.paths:
            d_in, d_out = targets[p]
            if (np.shape(self.A[p])[0], np.shape(self.B[p])[1]) != (d_in, d_out):
                raise ValueError(f"at {p!r} the kernel ({d_in}, {d_out}) needs A ({d_in}, r) and "
                                 f"B (r, {d_out}), got A {np.shape(self.A[p])} and "
                                 f"B {np.shape(self.B[p])}.")

    def update(self, path: str, x: jax.Array) -> jax.Array:
        """``(alpha / r) * (x @ A[path]) @ B[path]``: (..., d_in) -> (..., d_out), ``x``'s dtype."""
        return lora_update(x, self.A[path], self.B[path], self.config)


def lora_update(x: jax.Array, a: jax.Array, b: jax.Array, config: LoraConfig) -> jax.Array:
    """The factored LoRA term ``(alpha / r) * (x @ a) @ b`` to add to a dense layer's output.

    Args:
      x: (..., d_in) inputs of the adapted dense layer (floating).
      a: (d_in, r) frozen factor; b: (r, d_out) trainable factor (as :func:`init_lora` makes).
      config: the :class:`LoraConfig` (only its scale is used).

    Returns:
      (..., d_out) in ``x``'s dtype. Both products run at the highest matmul precision; the
      scale multiplies the rank-r intermediate (skipped when it is 1). Pure and jittable.
    """
    hi = jax.lax.Precision.HIGHEST
    low = jnp.matmul(x, a.astype(x.dtype), precision=hi)
    if config.scale != 1.0:
        low = low * jnp.asarray(config.scale, x.dtype)
    return jnp.matmul(low, b.astype(x.dtype), precision=hi)


def num_parameters(B: Mapping[str, jax.Array]) -> int:
    """Number of trainable scalars in ``B`` (sum of ``r * d_out`` over adapted leaves)."""
    _check_mapping("B", B)
    return sum(math.prod(np.shape(v)) for v in B.values())


def flatten_B(B: Mapping[str, jax.Array]) -> jax.Array:
    """The 1-D float32 vector of all ``B`` entries: paths in sorted order, each ``B[path]``
    (shape ``(r, d_out)``) raveled row-major.

    This is the released PAVE parameter vector. It equals ``concat(vec(B_p^T))`` in the paper's
    ``(out, r)`` notation with ``vec`` column-major. Pure and jittable.
    """
    _check_mapping("B", B)
    if not B:
        raise ValueError("B is empty; create it with init_lora.")
    return jnp.concatenate([jnp.ravel(B[p]).astype(jnp.float32) for p in sorted(B)])


def unflatten_B(vec: jax.Array, like: Mapping[str, jax.Array]) -> Factors:
    """Inverse of :func:`flatten_B`: split ``vec`` into the shapes and dtypes of ``like``.

    Exact for float32 and lower-precision factors. Raises ``ValueError`` if ``vec`` is not 1-D
    or its length differs from ``num_parameters(like)``.
    """
    _check_mapping("like", like)
    if np.ndim(vec) != 1:
        raise ValueError(f"vec must be 1-D, got shape {np.shape(vec)}; pass flatten_B(B).")
    total = num_parameters(like)
    if np.shape(vec)[0] != total:
        raise ValueError(f"vec has {np.shape(vec)[0]} entries but like holds {total}; was vec "
                         f"flattened from factors of the same structure?")
    out, start = {}, 0
    for p in sorted(like):
        shape = np.shape(like[p])
        size = math.prod(shape)
        out[p] = vec[start:start + size].reshape(shape).astype(like[p].dtype)
        start += size
    return out


def a_hash(A: Mapping[str, jax.Array]) -> str:
    """Hex sha256 naming ``A`` without revealing it (host-side, not jittable).

    Hashes, for each path in sorted order: the UTF-8 path, dtype name, shape and the
    little-endian row-major bytes, with length prefixes and a domain tag. Any change of a value,
    dtype, shape or path changes the hash. It hides ``A`` only as far as ``A``'s key is secret and
    unguessable: anyone holding a candidate key can confirm it against the hash.
    """
    _check_mapping("A", A)
    h = hashlib.sha256(_HASH_DOMAIN)

    def put(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for p in sorted(A):
        arr = np.asarray(jax.device_get(A[p]))
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        put(p.encode("utf-8"))
        put(arr.dtype.name.encode("ascii"))
        put(repr(tuple(int(d) for d in arr.shape)).encode("ascii"))
        put(arr.tobytes())
    return h.hexdigest()
