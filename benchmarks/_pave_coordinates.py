"""Coordinate specs and the intrinsic sketch guarantee on the PAVE privacy benchmark's market.

A public subspace ``U`` per adapted kernel (:mod:`pavejax.pave.subspace`), calibrated on PUBLIC
text that is not in the market (SQuAD v1.1 development contexts, Wikipedia paragraphs: the
optional ``squad`` asset, ``pavejax assets --with squad``) under the heads of the market's
public label sets, with public random labels; the top-``k`` output-side directions of the
per-example full-weight gradients, for ``k`` in :data:`KS` (nested: the top-4 directions are the
first four of the top-32).

One pass of per-example full-weight gradients ``g_i`` (d_in, d_out) per spec data set gives,
for every ``k`` and every prefix length ``n`` (:class:`CoordinateSums`):

* the clipped sum of the coordinate gradients ``scale * A^T g_i U`` (r, k) of DP-S-PAVE on
  coordinates (clipped jointly to ``C`` over the kernels; exact as :func:`generate_spec` with
  ``SpecConfig(subspace=U)``, whose one-step gradient with respect to ``C`` is this), from which
  the coordinate identification rows release ``-(S + N(0, (sigma C)^2 I)) / n``;
* the clipped average query ``H = (1/n) sum_i clip_G(U^T g_i^T)`` (k, d_in) of the
  A-independent one-step release ``C = -H A`` (full-weight clipping, so the trajectory does not
  see ``A``), on which :func:`pavejax.accounting.intrinsic.intrinsic_record` evaluates the
  intrinsic guarantee of Theorem 3.5: ``(L, mu)`` of ``H``, ``Delta = 2 G / n``,
  ``gamma = 2 L Delta / mu^2`` per kernel, and the alpha-optimised epsilon over ``r sum_l k_l``
  coordinates. These numbers are data-dependent (stability around this data set, not a
  worst case); the rows say so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _spec_sums
import _stats
import jax
import jax.numpy as jnp
import numpy as np

from pavejax import lora
from pavejax.accounting.intrinsic import intrinsic_record
from pavejax.pave import subspace as sub_lib
from pavejax.pave.text import TextSpecBackbone
from pavejax.privacy import clip_coefficients, per_example_norms

KS = (4, 8, 16, 32)
SENTIMENT = ("negative", "positive")
TOPICS = ("business", "entertainment", "politics", "sport", "tech")


def public_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct SQuAD v1.1 development contexts (Wikipedia paragraphs), a public corpus
    outside the market. Raises the asset error (naming ``pavejax assets --with squad``) when
    the optional asset is missing."""
    from pavejax.data.squad import load_squad

    seen, out = set(), []
    for ex in load_squad(seed=seed, max_examples=min(10_000, 40 * n)):
        if ex.context not in seen:
            seen.add(ex.context)
            out.append(ex.context)
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} distinct contexts; ask for fewer than {n}")


def public_subspaces(tb: TextSpecBackbone, ks: Sequence[int] = KS, *, n_public: int = 256,
                     seed: int = 0, label_sets: Sequence[Sequence[str]] = (SENTIMENT, TOPICS)
                     ) -> dict[int, sub_lib.Subspace]:
    """{k: calibrated Subspace} for every k of ``ks``, nested (the first k columns of the
    top-max(ks) basis, which are the top-k eigenvectors)."""
    top = tb.calibrated_subspace(public_texts(n_public, seed), label_sets, max(ks), seed=seed,
                                 info={"data": "SQuAD v1.1 dev contexts (Wikipedia)"})
    out = {}
    for k in ks:
        bases = {p: top.basis(p)[:, :k] for p in top.paths}
        info = {**top.info, "k": k, "nested_in": top.hash}
        out[k] = sub_lib.Subspace(bases, {p: top.out_dim(p) for p in top.paths},
                                  kind="calibrated", info=info)
    return out


class CoordinateSums:
    """Per k: prefix sums of the clipped coordinate gradients (rank ``r``, one secret ``A``) and
    of the clipped projected full-weight gradients, from one pass of per-example gradients.

    ``A``: ``{path: (d_in, r)}``; ``subspaces``: ``{k: Subspace}`` over the same paths; ``clip``:
    C of the coordinate release; ``query_clip``: G of the intrinsic query."""

    def __init__(self, tb: TextSpecBackbone, A: Mapping[str, Any],
                 subspaces: Mapping[int, sub_lib.Subspace], *, clip: float = 1.0,
                 query_clip: float = 1.0, microbatch: int = 16, scale: float = 1.0):
        self.tb, self.microbatch = tb, microbatch
        self.paths = sorted(A)
        self.ks = tuple(sorted(subspaces))
        for k in self.ks:
            if subspaces[k].paths != tuple(self.paths):
                raise ValueError("every subspace must cover the adapted kernels of A")
        grads = _spec_sums.weight_grads_fn(tb, self.paths)
        U = {k: {p: jnp.asarray(subspaces[k].basis(p)) for p in self.paths} for k in self.ks}
        hp = jax.lax.Precision.HIGHEST

        def clipped_rows(parts: dict, mask, c):
            norms = per_example_norms(parts)
            coef = jnp.where(mask & jnp.isfinite(norms), clip_coefficients(norms, c), 0.0)
            flat = jnp.concatenate([parts[p].reshape(parts[p].shape[0], -1)
                                    for p in self.paths], 1)
            return coef[:, None] * flat

        @jax.jit
        def rows(head, batch, mask):
            g = grads(head, batch)
            out = {}
            for k in self.ks:
                gu = {p: jnp.einsum("bio,ok->bki", g[p], U[k][p], precision=hp)
                      for p in self.paths}  # U^T g_i^T: (b, k, d_in)
                gc = {p: scale * jnp.einsum("ir,bki->brk", A[p], gu[p], precision=hp)
                      for p in self.paths}  # scale A^T g_i U: (b, r, k)
                out[k] = (clipped_rows(gc, mask, clip), clipped_rows(gu, mask, query_clip))
            return out

        self._rows = rows
        self.shapes = {k: {p: (np.shape(A[p])[1], subspaces[k].k(p), np.shape(A[p])[0])
                           for p in self.paths} for k in self.ks}  # (r, k, d_in)

    def __call__(self, texts: Sequence[str], targets: np.ndarray, classes: Sequence[str],
                 ns: Sequence[int] | None = None) -> dict[int, dict[int, tuple[np.ndarray, dict]]]:
        """``{n: {k: (coordinate clipped sum (r * sum k,) float64, {path: H (k, d_in)})}}`` for
        every prefix length of ``ns`` (default: the whole set) that the data set reaches."""
        wanted = sorted({len(texts)} if ns is None else {int(n) for n in ns
                                                          if int(n) <= len(texts)})
        head, out, seen = self.tb.head(classes), {}, 0
        total = None
        for batch, mask, real in _spec_sums.microbatches(self.tb, texts, targets,
                                                         self.microbatch):
            part = {k: tuple(np.asarray(v, np.float64)[:real] for v in pair)
                    for k, pair in self._rows(head, batch, mask).items()}
            if total is None:
                total = {k: tuple(np.zeros(v.shape[1]) for v in pair) for k, pair in part.items()}
            for n in wanted:
                if seen < n <= seen + real:
                    out[n] = {k: self._split(k, n, *(t + v[:n - seen].sum(0) for t, v in
                                                      zip(total[k], part[k], strict=True)))
                              for k in self.ks}
            total = {k: tuple(t + v.sum(0) for t, v in zip(total[k], part[k], strict=True))
                     for k in self.ks}
            seen += real
        return out

    def _split(self, k: int, n: int, coord: np.ndarray, query: np.ndarray):
        H, at = {}, 0
        for p in self.paths:
            _, kk, d_in = self.shapes[k][p]
            H[p] = query[at:at + kk * d_in].reshape(kk, d_in) / n
            at += kk * d_in
        return coord, H


def coordinate_identification_rows(
        dev_sums: Sequence[Mapping[int, tuple[np.ndarray, dict]]],
        user_sums: Sequence[Mapping[int, tuple[np.ndarray, dict]]],
        dev_n: Sequence[int], user_n: Sequence[int], acc: np.ndarray, sigma: float,
        claimed: float, *, rank: int, l2_clip: float, repeats: int, seed: int,
        top1: Callable[[np.ndarray, np.ndarray], float],
        scores: Callable[[np.ndarray, np.ndarray, np.ndarray, str], np.ndarray] | None,
        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Identification with coordinate specs, per k: non-private (clipped one-step coordinates,
    both sides) and the developer setting at the eps of ``sigma`` (developers release
    ``-(S + N(0, (sigma C)^2 I)) / n`` over ``repeats`` draws; users keep the non-private query),
    ranked by the cosine and (``scores`` given) the noise-aware scores on the same draws."""
    rows, summary = [], {}
    ks = sorted(dev_sums[0])
    dn = np.asarray(dev_n, np.float64)
    for k in ks:
        devs = np.stack([-d[k][0] / n for d, n in zip(dev_sums, dev_n, strict=True)])
        users = np.stack([-u[k][0] / n for u, n in zip(user_sums, user_n, strict=True)])
        cos = _cosine(users, devs)
        nonprivate = top1(cos, acc)
        rng = np.random.default_rng(seed + k)
        std = sigma * l2_clip / dn
        by_method: dict[str, list[float]] = {"cosine": []}
        if scores is not None:
            by_method |= {"debiased": [], "posterior": []}
        for _ in range(repeats):
            noisy = devs + rng.standard_normal(devs.shape) * std[:, None]
            for method in by_method:
                s = _cosine(users, noisy) if method == "cosine" else scores(users, noisy, std,
                                                                              method)
                by_method[method].append(top1(s, acc))
        row = {"part": "coordinates", "setting": "dev", "k": k, "epsilon": 4.0,
               "claimed_epsilon": claimed, "rank": rank, "noise_multiplier": sigma,
               "spec_dim": int(devs.shape[1]), "top1_nonprivate": nonprivate}
        for method, vals in by_method.items():
            name = "top1_acc" if method == "cosine" else f"top1_acc_{method}"
            row |= _stats.stat_fields(name, vals)
        rows.append(row)
        summary[f"coord_top1_nonprivate_k{k}"] = nonprivate
        summary[f"coord_top1_eps4_k{k}"] = row["top1_acc"]
    return rows, summary


def intrinsic_rows(dev_sums: Sequence[Mapping[int, tuple[np.ndarray, dict]]],
                   dev_n: Sequence[int], *,
                   rank: int, query_clip: float, delta: float, label: str = "main market"
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``dev_sums``: per developer, ``{k: (coordinate sum, {path: H})}`` (one n of
    :class:`CoordinateSums`). Per k: the intrinsic guarantee of every developer's noise-free
    coordinate release
    (:func:`intrinsic_record`), summarised over developers (median epsilon, the fraction with
    a finite epsilon, median gamma, and the data size at which the worst kernel's gamma would
    reach 1 if L and mu stayed as measured)."""
    rows, summary = [], {}
    for k in sorted(dev_sums[0]):
        recs = [intrinsic_record(q[k][1], n=int(n), clip=query_clip, rank=rank, delta=delta)
                for q, n in zip(dev_sums, dev_n, strict=True)]
        eps = np.array([r["epsilon"] for r in recs], np.float64)
        eps_local = np.array([r["epsilon_local"] for r in recs], np.float64)
        gammas = np.array([r["gamma_max"] for r in recs], np.float64)
        n_needed = np.array([max(v["n_for_gamma_one"] for v in r["layers"].values())
                             for r in recs], np.float64)
        row = {"part": "intrinsic", "setting": label, "k": k, "rank": rank, "delta": delta,
               "query_clip": query_clip, "developers": len(recs),
               "median_n": float(np.median(dev_n)),
               "epsilon_median": float(np.median(eps)),
               "epsilon_min": float(np.min(eps)),
               "finite_fraction": float(np.mean(np.isfinite(eps))),
               "epsilon_local_median": float(np.median(eps_local)),
               "gamma_median": float(np.median(gammas)),
               "gamma_min": float(np.min(gammas)),
               "n_for_gamma_one_median": float(np.median(n_needed)),
               "scope": recs[0]["scope"]}
        rows.append(row)
        summary[f"intrinsic_eps_median_k{k}"] = row["epsilon_median"]
        summary[f"intrinsic_gamma_median_k{k}"] = row["gamma_median"]
    return rows, summary


def _cosine(users: np.ndarray, devs: np.ndarray) -> np.ndarray:
    u = users / np.linalg.norm(users, axis=1, keepdims=True)
    d = devs / np.linalg.norm(devs, axis=1, keepdims=True)
    return u @ d.T


def a_factors(tb: TextSpecBackbone, a_key: jax.Array, rank: int) -> dict:
    """The secret ``A`` of rank ``rank`` from ``a_key`` (what generate_spec draws)."""
    return lora.init_lora(a_key, tb.backbone.params, tb.predicate, lora.LoraConfig(rank))[1]
