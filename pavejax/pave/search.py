"""Exact cosine top-k search over a matrix of specifications, on device.

The dock keeps its specs as the rows of a matrix ``M`` (N, d). A search for queries ``U``
(Q, d) is one matrix product ``U_hat @ M.T`` scaled by the rows' inverse norms, followed by
``jax.lax.top_k``: the matrix is read once per query batch (a matrix-vector product for Q = 1,
a matrix-small-matrix product for Q > 1). Rows are never rewritten per call: a
:class:`CosineIndex` holds them (device-resident, or on the host for streaming) with their
inverse norms computed once.

Three placements, one result (exact top-k; ties broken towards the lower row index):

* ``"dense"``: the whole matrix on one device.
* ``"stream"``: rows stay in host memory (a NumPy array or ``np.memmap``) and are sent to the
  device ``chunk_size`` rows at a time; a running top-k is merged after each chunk. Used when
  ``chunk_size`` is given or the matrix exceeds the memory budget.
* ``"sharded"``: rows split over the devices of a mesh; each device takes its local top-k and the
  ``devices * k`` candidates are merged.

Storage dtype ``"bfloat16"`` halves the bytes read; products accumulate in float32, the
queries are rounded to bfloat16. On GPUs and TPUs this is the fast path; XLA:CPU has no fast
bfloat16 matrix product on CPUs without AVX512-BF16, so there it saves memory, not time.

A zero row has cosine 0 with every query. NaN/inf rows or queries, and zero queries, are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["DTYPES", "SCORE_TEMPERATURE", "CosineIndex", "SearchResult", "build_index",
           "normalize_rows", "scores_from_cosines", "search_index", "sharded_top_k_cosine",
           "top_k_cosine"]

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_HOST_BLOCK = 4096  # rows per host-side pass (norms, dtype casts): bounds temporary memory
_CPU_BUDGET = 4 << 30
SCORE_TEMPERATURE = 0.1  # learnware 0.4.0.post1 LLMStatSearcher: score = sigmoid(cos / T)


class CosineIndex(NamedTuple):
    """A prepared search matrix. Build it with :func:`build_index`; search with
    :func:`search_index`.

    ``rows`` (N_pad, d) in ``dtype`` and ``inv_norms`` (N_pad,) float32 are device arrays
    (``"dense"``, ``"sharded"``) or host arrays (``"stream"``); rows past ``n`` are padding.
    """

    rows: Any
    inv_norms: Any
    n: int
    dim: int
    dtype: str
    placement: str
    chunk_size: int | None
    mesh: Any
    axis: str | None


def _check_dtype(dtype: str) -> Any:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def normalize_rows(x: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """Rows of ``x`` (N, d) divided by their L2 norm (zero rows stay zero), float32.

    NumPy in, NumPy out (norms computed in float64); JAX in, JAX out (float32).
    """
    if isinstance(x, jax.Array):
        x = x.astype(jnp.float32)
        norms = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
        return x / jnp.where(norms > 0, norms, jnp.ones_like(norms))
    x = np.asarray(x, np.float64)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _host_rows(matrix: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows in the storage dtype (no copy when already there) and float32 inverse norms of
    the stored (rounded) rows, in blocks so that a memmap is read once without a full copy."""
    m = matrix if isinstance(matrix, np.ndarray) else np.asarray(jax.device_get(matrix))
    if m.ndim != 2 or 0 in m.shape:
        raise ValueError(f"matrix must be a non-empty (N, d) array, got shape {m.shape}")
    if not np.issubdtype(m.dtype, np.floating):
        raise TypeError(f"matrix must be floating, got dtype {m.dtype}")
    target = np.dtype(DTYPES[dtype])
    rows = m if m.dtype == target else np.empty(m.shape, target)
    inv = np.empty(m.shape[0], np.float32)
    for s in range(0, m.shape[0], _HOST_BLOCK):
        block = np.asarray(m[s:s + _HOST_BLOCK])
        if rows is not m:
            rows[s:s + _HOST_BLOCK] = block.astype(target)
        stored = np.asarray(rows[s:s + _HOST_BLOCK], np.float32)
        if not np.isfinite(stored).all():
            raise ValueError(f"matrix has NaN/inf entries in rows {s}..{s + len(block) - 1} "
                             f"(or overflows {dtype}); remove or regenerate those specs")
        norms = np.sqrt(np.einsum("ij,ij->i", stored, stored, dtype=np.float64))
        inv[s:s + _HOST_BLOCK] = np.where(norms > 0, 1.0 / np.where(norms > 0, norms, 1.0), 0.0)
    return rows, inv


def _pad_rows(x: np.ndarray, n_pad: int) -> np.ndarray:
    if x.shape[0] == n_pad:
        return x
    pad = np.zeros((n_pad - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])


def _default_budget() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
        return int(limit) // 2
    try:  # CPU: the "device" is host RAM, which also holds the host copy of the matrix
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return _CPU_BUDGET


def build_index(matrix: Any, *, dtype: str = "float32", chunk_size: int | None = None,
                mesh: jax.sharding.Mesh | None = None, axis: str | None = None,
                memory_budget: int | None = None, pad_to: int = 1) -> CosineIndex:
    """Prepare ``matrix`` (N, d) (NumPy, memmap or JAX) for repeated searches.

    Rows are cast to ``dtype`` once; their inverse L2 norms are computed once (float32).
    Placement: ``mesh`` given -> rows sharded over ``axis`` (default: the mesh's first axis);
    ``chunk_size`` given, or the stored matrix larger than ``memory_budget`` bytes (default:
    half the device memory; a quarter of the RAM on CPU) -> streamed from host memory (on CPU
    each chunk is copied, which is slow: there streaming only bounds memory); otherwise one dense
    device array. ``pad_to`` rounds the padded row count up to a multiple (fewer recompiles
    for a growing store); padding rows never appear in results.
    """
    _check_dtype(dtype)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if mesh is not None and chunk_size is not None:
        raise ValueError("pass either mesh (sharded search) or chunk_size (streamed search), "
                         "not both")
    rows, inv = _host_rows(matrix, dtype)
    n, d = rows.shape
    if mesh is not None:
        axis = axis or mesh.axis_names[0]
        if axis not in mesh.axis_names:
            raise ValueError(f"axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
        mult = math.lcm(int(pad_to), mesh.shape[axis])
        n_pad = -(-n // mult) * mult
        sharding = NamedSharding(mesh, P(axis))
        return CosineIndex(jax.device_put(_pad_rows(rows, n_pad), sharding),
                           jax.device_put(_pad_rows(inv, n_pad), sharding),
                           n, d, dtype, "sharded", None, mesh, axis)
    budget = _default_budget() if memory_budget is None else int(memory_budget)
    if chunk_size is None and rows.nbytes > budget:
        chunk_size = max(1, budget // (4 * rows.itemsize * d))
    if chunk_size is not None:
        return CosineIndex(rows, inv, n, d, dtype, "stream", min(chunk_size, n), None, None)
    n_pad = -(-n // int(pad_to)) * int(pad_to)
    return CosineIndex(jax.device_put(_pad_rows(rows, n_pad)),
                       jax.device_put(_pad_rows(inv, n_pad)), n, d, dtype, "dense", None, None,
                       None)


def _normalized_queries(queries: Any, dim: int) -> np.ndarray:
    q = np.asarray(jax.device_get(queries))
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != dim or q.shape[0] == 0:
        raise ValueError(f"queries must have shape (Q, {dim}) or ({dim},), got {np.shape(queries)}")
    if not np.issubdtype(q.dtype, np.floating):
        raise TypeError(f"queries must be floating, got dtype {q.dtype}")
    if not np.isfinite(q).all():
        raise ValueError("queries contain NaN/inf entries; regenerate the query spec")
    norms = np.linalg.norm(q.astype(np.float64), axis=1)
    if (norms == 0).any():
        raise ValueError(f"query rows {np.flatnonzero(norms == 0).tolist()} are all zeros: a "
                         f"zero vector has no direction to compare")
    return normalize_rows(q)


def _scores(rows: jax.Array, inv_norms: jax.Array, q: jax.Array) -> jax.Array:
    """(Q, N) float32 cosines: one pass over ``rows``, float32 accumulation."""
    # rows as the left operand: XLA:CPU runs (N, d) x (d, Q) ~5x faster than (Q, d) x (d, N)
    dots = jax.lax.dot_general(rows, q.astype(rows.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return (dots * inv_norms[:, None]).T


def _masked(scores: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
    index = start + jnp.arange(scores.shape[1], dtype=jnp.int32)
    return jnp.where((index < n_valid)[None, :], scores, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("k",))
def _dense_top_k(rows, inv_norms, q, start, n_valid, k):
    values, idx = jax.lax.top_k(_masked(_scores(rows, inv_norms, q), start, n_valid), k)
    return values, idx + start


@functools.partial(jax.jit, static_argnames=("k",))
def _merge_top_k(values_a, idx_a, values_b, idx_b, k):
    # a holds lower row indices than b, so position order is index order among ties.
    values, pos = jax.lax.top_k(jnp.concatenate([values_a, values_b], axis=1), k)
    return values, jnp.take_along_axis(jnp.concatenate([idx_a, idx_b], axis=1), pos, axis=1)


def _search_stream(index: CosineIndex, q: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    cs = index.chunk_size
    n_valid = jnp.int32(index.n)
    # -inf placeholders lose to every real (finite) cosine, and there are at least k of those
    best = (jnp.full((q.shape[0], k), -jnp.inf, jnp.float32),
            jnp.full((q.shape[0], k), index.n, jnp.int32))
    for s in range(0, index.n, cs):
        rows = _pad_rows(np.asarray(index.rows[s:s + cs]), cs)
        inv = _pad_rows(index.inv_norms[s:s + cs], cs)
        part = _dense_top_k(jax.device_put(rows), jax.device_put(inv), q, jnp.int32(s), n_valid,
                            min(k, cs))
        best = _merge_top_k(*best, *part, k=k)
    return best


@functools.lru_cache(maxsize=64)
def _sharded_fn(mesh: jax.sharding.Mesh, axis: str, k: int, rows_per_shard: int):
    k_local = min(k, rows_per_shard)

    def local(rows, inv, q, n_valid):
        start = jax.lax.axis_index(axis).astype(jnp.int32) * rows_per_shard
        values, idx = jax.lax.top_k(_masked(_scores(rows, inv, q), start, n_valid), k_local)
        return values, idx + start

    shard = jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P(axis), P(), P()),
                          out_specs=(P(None, axis), P(None, axis)))

    @jax.jit
    def run(rows, inv, q, n_valid):
        values, idx = shard(rows, inv, q, n_valid)
        # candidates are laid out shard by shard, so position order is index order among ties
        top, pos = jax.lax.top_k(values, k)
        return top, jnp.take_along_axis(idx, pos, axis=1)

    return run


def search_index(index: CosineIndex, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` rows by cosine with each query.

    ``queries`` (Q, d) or (d,), any float dtype (L2-normalised here, in float64). Returns
    ``(cos, idx)``: cos (Q, k') float32 in descending order and idx (Q, k') int64 row indices,
    ``k' = min(k, N)``; equal cosines are ordered by lower row index. Exact (no approximation):
    the result equals a full sort of ``M_hat @ q_hat`` up to float32 rounding of the products
    (bfloat16 rounding of rows and queries with ``dtype="bfloat16"``).
    """
    if not isinstance(index, CosineIndex):
        raise TypeError(f"index must be a CosineIndex from build_index, got {type(index).__name__}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    k = int(min(k, index.n))
    q_host = _normalized_queries(queries, index.dim)
    n_queries = q_host.shape[0]
    if index.dtype == "bfloat16" and n_queries == 1:
        # XLA:CPU's bf16 matrix-vector product is ~4x slower than its (N, d) x (d, 2) product;
        # a duplicated query reads the same bytes on any backend.
        q_host = np.concatenate([q_host, q_host])
    q = jnp.asarray(q_host)
    if index.placement == "stream":
        values, idx = _search_stream(index, q, k)
    elif index.placement == "sharded":
        rows_per_shard = index.rows.shape[0] // index.mesh.shape[index.axis]
        run = _sharded_fn(index.mesh, index.axis, k, rows_per_shard)
        values, idx = run(index.rows, index.inv_norms, q, jnp.int32(index.n))
    else:
        values, idx = _dense_top_k(index.rows, index.inv_norms, q, jnp.int32(0),
                                   jnp.int32(index.n), k)
    values, idx = jax.device_get((values[:n_queries], idx[:n_queries]))
    return np.asarray(values, np.float32), np.asarray(idx, np.int64)


def top_k_cosine(matrix: Any, queries: Any, k: int, *, chunk_size: int | None = None,
                 dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """One-shot exact cosine top-k of ``queries`` (Q, d) against the rows of ``matrix`` (N, d).

    See :func:`search_index` for the result; ``chunk_size`` streams the rows from host memory
    in chunks (same result). For repeated searches build a :class:`CosineIndex` once instead.
    """
    return search_index(build_index(matrix, dtype=dtype, chunk_size=chunk_size), queries, k)


def sharded_top_k_cosine(matrix: Any, queries: Any, k: int, mesh: jax.sharding.Mesh, *,
                         axis: str | None = None,
                         dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """:func:`top_k_cosine` with rows sharded over ``axis`` of ``mesh``: per-device top-k,
    then a global merge of the candidates. Equal to the unsharded result (ties included)."""
    return search_index(build_index(matrix, dtype=dtype, mesh=mesh, axis=axis), queries, k)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Ranked matches of one query: ``cosines`` (k,) float32, ``scores`` (k,) float32 =
    sigmoid(cos / 0.1) in [0, 1] (the learnware package's heuristic, not calibrated).

    ``method`` names the score that ranked the matches (``"cosine"``, or a noise-aware score of
    :func:`pavejax.pave.noise_aware.noise_aware_scores`); ``ranking`` (k,) float64 holds that
    score, descending. For ``"cosine"`` it equals ``cosines``; otherwise ``cosines`` are the plain
    cosines of the same matches and need not be sorted."""

    ids: tuple[int, ...]
    names: tuple[str, ...]
    cosines: np.ndarray
    scores: np.ndarray
    method: str = "cosine"
    ranking: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.ranking is None:
            object.__setattr__(self, "ranking", np.asarray(self.cosines, np.float64))


def scores_from_cosines(cosines: np.ndarray) -> np.ndarray:
    """sigmoid(cos / T), T = :data:`SCORE_TEMPERATURE`, float32."""
    c = np.asarray(cosines, np.float64)
    return (1.0 / (1.0 + np.exp(-c / SCORE_TEMPERATURE))).astype(np.float32)
