"""The in-memory spec matrix of a dock and its top-k search, shared by the local
:class:`~pavejax.pave.dock.Dock` and the client of an HTTP dock
(:class:`~pavejax.pave.remote.RemoteDock`), so a remote search ranks exactly as a local one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pavejax.pave import search as search_lib
from pavejax.pave.search import SearchResult, scores_from_cosines
from pavejax.spec_types import PaveSpec, SpecSignature

# Scores this close (relative to the largest) are ties: equal vectors can score a last bit apart
# when BLAS reduces different rows of one matrix product in different orders.
_TIE_RTOL = 1e-12


def rank_with_ties(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Indices by score descending; runs of scores within ``_TIE_RTOL`` (of the largest
    magnitude) of their neighbour are one tie, ordered by lower id."""
    order = np.argsort(-scores, kind="stable")
    s = scores[order]
    tol = _TIE_RTOL * max(float(np.max(np.abs(s))), np.finfo(np.float64).tiny)
    group = np.concatenate([[0], np.cumsum(-np.diff(s) > tol)])
    return order[np.lexsort((ids[order], group))]


def check_query(user_spec: PaveSpec | Sequence[PaveSpec], k: Any, score: str,
                signature: SpecSignature | None) -> list[PaveSpec]:
    """The query specs as a list, after the checks every search makes."""
    from pavejax.pave import noise_aware  # light: NumPy and SciPy only

    specs = [user_spec] if isinstance(user_spec, PaveSpec) else list(user_spec)
    if not specs or not all(isinstance(s, PaveSpec) for s in specs):
        raise TypeError("user_spec must be a PaveSpec or a non-empty list of PaveSpecs")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if score not in noise_aware.SCORE_METHODS:
        raise ValueError(f"score must be one of {noise_aware.SCORE_METHODS}, got {score!r}")
    for s in specs:
        if not np.isfinite(s.vector).all():
            raise ValueError("a query spec has NaN/inf entries; regenerate it")
    if signature is not None:
        for s in specs:
            signature.require_compatible(s.signature, what="query spec")
    return specs


class SpecTable:
    """The dock's specs in id order, with cached search indexes and noise levels."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.names: list[str] = []
        self.vectors: dict[int, np.ndarray] = {}
        self.infos: dict[int, Mapping[str, Any]] = {}
        self._stds: dict[int, float] = {}
        self._indexes: dict[tuple, search_lib.CosineIndex] = {}

    def replace(self, ids: Sequence[int], names: Sequence[str],
                vectors: Mapping[int, np.ndarray], infos: Mapping[int, Mapping[str, Any]]) -> None:
        """Set the rows (``vectors`` and ``infos`` keyed by id, holding at least ``ids``)."""
        self.ids, self.names = [int(i) for i in ids], list(names)
        self.vectors = {i: vectors[i] for i in self.ids}
        self.infos = {i: infos[i] for i in self.ids}
        self._stds = {i: v for i, v in self._stds.items() if i in self.vectors}
        self._indexes = {}

    def _index(self, dtype: str, chunk_size: int | None, mesh: Any) -> search_lib.CosineIndex:
        key = (dtype, chunk_size, mesh)
        if key not in self._indexes:
            matrix = np.stack([self.vectors[i] for i in self.ids])
            self._indexes[key] = search_lib.build_index(matrix, dtype=dtype, chunk_size=chunk_size,
                                                        mesh=mesh, pad_to=256)
        return self._indexes[key]

    def search(self, specs: list[PaveSpec], k: int, *, signature: SpecSignature | None,
               chunk_size: int | None = None, dtype: str = "float32", mesh: Any = None,
               score: str = "cosine") -> list[SearchResult]:
        """One :class:`SearchResult` per query (already checked by :func:`check_query`)."""
        if not self.ids:
            empty = SearchResult((), (), np.zeros(0, np.float32), np.zeros(0, np.float32))
            return [empty] * len(specs)
        queries = np.stack([s.vector for s in specs])
        if score != "cosine":
            return self._search_noise_aware(queries, int(k), score, signature)
        index = self._index(dtype, chunk_size, mesh)
        cos, idx = search_lib.search_index(index, queries, int(k))
        return [SearchResult(tuple(self.ids[j] for j in row), tuple(self.names[j] for j in row),
                             c, scores_from_cosines(c)) for c, row in zip(cos, idx, strict=True)]

    def _noise_stds(self, signature: SpecSignature | None) -> np.ndarray:
        """Each stored spec's per-coordinate noise std (in id order), cached by id."""
        from pavejax.pave.noise_aware import spec_noise_std

        for i, name in zip(self.ids, self.names, strict=True):
            if i in self._stds:
                continue
            spec = PaveSpec(self.vectors[i], signature, kind="model", info=self.infos[i])
            try:
                self._stds[i] = spec_noise_std(spec)
            except ValueError as e:
                raise ValueError(f"learnware {name!r} (id {i}) cannot be ranked by a "
                                 f"noise-aware score: {e}; search with score='cosine'") from None
        return np.array([self._stds[i] for i in self.ids], np.float64)

    def _search_noise_aware(self, queries: np.ndarray, k: int, method: str,
                            signature: SpecSignature | None) -> list[SearchResult]:
        from pavejax.pave.noise_aware import noise_aware_scores

        matrix = np.stack([self.vectors[i] for i in self.ids])
        stds = self._noise_stds(signature)
        ranking = noise_aware_scores(queries, matrix, stds, method)
        cosines = noise_aware_scores(queries, matrix, stds, "cosine")
        k = min(k, len(self.ids))
        ids = np.asarray(self.ids)
        out = []
        for r, c in zip(ranking, cosines, strict=True):
            order = rank_with_ties(r, ids)[:k]
            cos = c[order].astype(np.float32)
            out.append(SearchResult(tuple(int(ids[j]) for j in order),
                                    tuple(self.names[j] for j in order), cos,
                                    scores_from_cosines(cos), method, r[order]))
        return out
