"""The intrinsic sketch guarantee (Theorem 3.5) evaluated on a concrete, data-dependent spec.

`pavejax.accounting.sketch` states the guarantee of the compact Gaussian-sketch release
``C(D) = H(D) Aᵀ`` for a *given* covariance stability γ. This module measures the quantities
that γ is built from on an actual data set, for the one-step recipe whose spec does not depend
on ``A``:

* `clipped_average_query` forms ``H(D) = (1/n) Σ_i clip_G(Uᵀ g_iᵀ)`` per layer from per-example
  full-weight gradients ``g_i`` (shape ``(d_in, d_out)``, pavejax's storage convention, so the
  reference's ``m`` is ``d_in`` and its ``d`` is ``d_out``) and a public subspace ``U``
  (``(d_out, k)``, orthonormal columns); the clip is joint over all layers, so
  ``‖Ψ(z)‖₂ <= ‖Ψ(z)‖_F <= G`` and a replace-one neighbour moves each ``H`` by ``Δ <= 2G/n`` in
  spectral norm. With ``ΔW = A B`` (``A: (d_in, r)``, ``B: (r, d_out)``) one step from ``B = 0``
  gives ``B U = −η Aᵀ Σ_i g_i U``, i.e. the coordinate spec ``(B U)ᵀ`` is ``−η n H(D) A``: the
  sketch of ``H`` up to a public scale.
* `query_bounds` returns ``(L, μ)``, the largest and smallest singular values of ``H(D)``.
* `intrinsic_record` turns them into ``γ_l = 2 L_l Δ / μ_l²`` per layer and an (ε, δ) number,
  plus ``γ_local = (2 L + Δ) Δ / (μ − Δ)²``, which also covers how far a neighbour can move
  ``L`` and ``μ`` and so bounds every neighbour of this data set.
* `renyi_gaussian` and `sketch_pair_rdp` give the *exact* Rényi divergence of the sketch for one
  neighbouring pair, against which the bound can be checked.

**Scope.** ``L`` and ``μ`` are measured on this data set, so the result is a stability statement
around it (a local, smooth-sensitivity-style quantity), **not** a worst-case differential-privacy
guarantee: ``μ`` is 0 for some data sets (e.g. when every example's projected gradient lies in a
proper subspace of the ``k`` directions), and then a neighbour that adds signal in the missing
direction is perfectly distinguishable, so no data-independent (ε, δ) with δ < 1 exists without
assumptions on the data. Every record says so. Like Theorem 3.5 itself it is also conditional on
a secret ``A`` (with its key), a trajectory that does not depend on ``A``, and ``A`` being drawn
afresh for the release.

Host-side float64 numpy/scipy; nothing here touches JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

import numpy as np
from scipy import linalg

from pavejax.accounting.sketch import (
    _conversion,
    _count,
    _delta,
    _positive,
    average_query_sensitivity,
    sketch_epsilon,
)

__all__ = [
    "clipped_average_query", "intrinsic_record", "query_bounds", "renyi_gaussian",
    "sketch_pair_rdp",
]

SCOPE = (
    "data-dependent: L and mu are the singular values of H(D) measured on this dataset, so "
    "gamma and epsilon describe the stability of the sketch around this dataset (a local, "
    "smooth-sensitivity-style statement); this is NOT a worst-case differential-privacy "
    "guarantee. gamma = 2 L Delta / mu^2 plugs this dataset's L and mu into Remark 3.6 as if "
    "they held for its neighbours too; gamma_local = (2 L + Delta) Delta / (mu - Delta)^2 allows "
    "for how far a neighbour can move them (Weyl) and bounds the pair divergence for every "
    "replace-one neighbour of this dataset, in both directions")
CONDITIONS = (
    "conditional on: A (and the key that generates it) secret from the adversary; a spec "
    "trajectory that does not depend on A (one gradient step from B = 0 with per-example "
    "clipping of the projected full-weight gradient); A treated as drawn afresh for this release "
    "(composition over releases that share A is not analysed)")
COMPOSITION = (
    "layers have independent sketches A_l, so Renyi divergences add over layers; the bound uses "
    "gamma_max = max_l gamma_l with rk_total = rank * sum_l k_l, which is valid because the "
    "per-layer RDP grows with gamma, and conservative (summing the per-layer curves is tighter)")
WORST_CASE = (
    "no data-independent bound: mu can be 0 for some datasets (all projected gradients in a "
    "proper subspace of the k directions); a neighbour that adds signal in the missing direction "
    "changes the support of the sketch's distribution and is distinguished with certainty, so "
    "epsilon is infinite for every delta < 1 unless the data are assumed to keep mu away from 0. "
    "Since L <= clip always, gamma < 1 holds for every dataset whose mu exceeds 2 clip / sqrt(n)")


# ---------------------------------------------------------------- validation


def _matrix(name: str, value: Any) -> np.ndarray:
    try:
        h = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a real 2-D array, got {type(value).__name__}") from exc
    if h.ndim != 2 or 0 in h.shape:
        raise ValueError(f"{name} must be a non-empty 2-D (k, m) array, got shape {h.shape}")
    if not np.all(np.isfinite(h)):
        raise ValueError(f"{name} has non-finite entries (NaN or inf); check the gradients "
                         "that produced it")
    return h


def _singular_values(name: str, h: np.ndarray) -> np.ndarray:
    k, m = h.shape
    if k > m:
        raise ValueError(f"{name} has k = {k} rows but only m = {m} columns: H H^T (k x k) is "
                         f"then singular; choose a subspace dimension k <= {m}")
    return np.linalg.svd(h, compute_uv=False)


def _rank_tolerance(s: np.ndarray, shape: tuple[int, int]) -> float:
    # numpy.linalg.matrix_rank's default: below it a singular value is rounding noise.
    return float(s[0]) * max(shape) * np.finfo(np.float64).eps


# ---------------------------------------------------------------- query bounds


def query_bounds(H: Any) -> tuple[float, float]:
    """Largest and smallest singular values ``(L, μ)`` of a query matrix ``H`` (k × m).

    ``μ² I ⪯ H Hᵀ ⪯ L² I``: the bounds that enter ``γ = 2 L Δ / μ²`` (Remark 3.6).

    Args:
      H: a (k, m) real array with k <= m (converted to float64).

    Returns:
      ``(L, mu)`` as Python floats, ``L >= mu > 0``.

    Raises:
      ValueError: if ``H`` is not a non-empty 2-D array, has non-finite entries, has more rows
        than columns, or has ``mu == 0`` (up to rounding: below numpy's matrix-rank tolerance).

    Example:
        >>> L, mu = query_bounds([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
        >>> round(L, 12), round(mu, 12)
        (3.0, 2.0)
    """
    h = _matrix("H", H)
    s = _singular_values("H", h)
    L, mu = float(s[0]), float(s[-1])
    if L == 0.0 or mu <= _rank_tolerance(s, h.shape):
        raise ValueError(
            f"H has smallest singular value mu = {mu:.3g} (largest {L:.3g}): the subspace has a "
            "direction with no signal, so the sketch's covariance is singular and no gamma "
            "exists; choose a smaller subspace dimension k (e.g. the directions whose singular "
            "values are well above 0)")
    return L, mu


# ---------------------------------------------------------------- the clipped average query


def _orthonormal(path: str, u: np.ndarray) -> None:
    k = u.shape[1]
    err = float(np.max(np.abs(u.T @ u - np.eye(k))))
    if err > 1e-5:
        raise ValueError(f"U[{path!r}] must have orthonormal columns (U^T U = I), but U^T U "
                         f"differs from I by {err:.3g}; orthonormalise it, e.g. with "
                         "numpy.linalg.qr")


def clipped_average_query(per_example: Mapping[str, Any], U: Mapping[str, Any],
                          clip: float) -> dict[str, np.ndarray]:
    """The one-step query ``H_l(D) = (1/n) Σ_i clip_G(U_lᵀ g_{i,l}ᵀ)`` of every layer ``l``.

    Each example's projected gradients ``U_lᵀ g_{i,l}ᵀ`` (k_l × d_in) are scaled together by
    ``min(1, clip / ‖·‖)``, where ``‖·‖`` is their joint Frobenius norm over all layers, so each
    example contributes at most ``clip`` in that norm and a replace-one neighbour moves every
    ``H_l`` by at most ``2 clip / n`` in spectral norm.

    Args:
      per_example: ``{path: (n, d_in, d_out)}`` per-example full-weight gradients (pavejax's
        ``ΔW = A B`` convention: ``d_in`` rows, ``d_out`` columns); the same ``n`` for every
        layer.
      U: ``{path: (d_out, k)}`` public subspaces with orthonormal columns, one per path of
        ``per_example`` (the same keys).
      clip: the joint clipping norm ``G > 0``.

    Returns:
      ``{path: H}`` with ``H`` of shape ``(k, d_in)``, float64, in the order of ``per_example``.

    Raises:
      ValueError: on mismatched paths or shapes, different ``n`` across layers, non-finite
        values, a ``U`` without orthonormal columns or with more columns than rows, or a
        non-positive ``clip``.
    """
    clip = _positive("clip", clip)
    if not isinstance(per_example, Mapping) or not isinstance(U, Mapping):
        raise TypeError("per_example and U must be mappings {layer path: array}")
    if not per_example:
        raise ValueError("per_example is empty: pass at least one layer's gradients")
    if set(per_example) != set(U):
        raise ValueError(f"per_example and U must have the same layer paths; only in "
                         f"per_example: {sorted(set(per_example) - set(U))}, only in U: "
                         f"{sorted(set(U) - set(per_example))}")
    projected, n = {}, None
    for path, g in per_example.items():
        g = np.asarray(g, dtype=np.float64)
        u = np.asarray(U[path], dtype=np.float64)
        if g.ndim != 3 or 0 in g.shape:
            raise ValueError(f"per_example[{path!r}] must be a non-empty (n, d_in, d_out) "
                             f"array, got shape {g.shape}")
        if u.ndim != 2 or u.shape[0] != g.shape[2]:
            raise ValueError(f"U[{path!r}] must have shape (d_out, k) = ({g.shape[2]}, k), got "
                             f"{u.shape}")
        if not 1 <= u.shape[1] <= u.shape[0]:
            raise ValueError(f"U[{path!r}] has k = {u.shape[1]} columns; need 1 <= k <= d_out "
                             f"= {u.shape[0]}")
        if not (np.all(np.isfinite(g)) and np.all(np.isfinite(u))):
            raise ValueError(f"per_example[{path!r}] or U[{path!r}] has non-finite entries")
        _orthonormal(path, u)
        if n is None:
            n = g.shape[0]
        elif g.shape[0] != n:
            raise ValueError(f"per_example[{path!r}] has {g.shape[0]} examples but an earlier "
                             f"layer has {n}: every layer needs the same examples")
        projected[path] = np.einsum("dk,nid->nki", u, g)  # U^T g_i^T, (n, k, d_in)
    sq = sum(np.sum(p * p, axis=(1, 2)) for p in projected.values())
    norms = np.sqrt(sq)
    scale = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
    return {path: np.einsum("n,nki->ki", scale, p) / n for path, p in projected.items()}


# ---------------------------------------------------------------- the record


def _layer(path: str, h: Any, delta_h: float, clip: float) -> dict[str, Any]:
    h = _matrix(f"per_layer_H[{path!r}]", h)
    s = _singular_values(f"per_layer_H[{path!r}]", h)
    k, m = h.shape
    L = float(s[0])
    if L > clip * (1.0 + 1e-9):
        raise ValueError(f"per_layer_H[{path!r}] has spectral norm {L:.6g} > clip = {clip:.6g}: "
                         "it cannot be an average of examples clipped at clip; pass the clip "
                         "used to build it (see clipped_average_query)")
    out: dict[str, Any] = {"k": k, "m": m, "L": L, "delta_h": delta_h,
                           "mu_needed": math.sqrt(2.0 * L * delta_h)}
    if L == 0.0 or float(s[-1]) <= _rank_tolerance(s, h.shape):
        reason = (f"layer {path!r}: mu = 0, the subspace has a direction with no signal; "
                  "choose a smaller k")
        out.update(mu=0.0, gamma=math.inf, gamma_local=math.inf, n_for_gamma_one=math.inf,
                   reason=reason, reason_local=reason)
        return out
    mu = float(s[-1])
    gamma = 2.0 * L * delta_h / mu**2
    # Every neighbour D' has ||H' - H||_2 <= Delta, so ||H'||_2 <= L + Delta, sigma_min(H') >=
    # mu - Delta and ||H H^T - H' H'^T||_2 <= (2 L + Delta) Delta: condition (21) holds for
    # (D, D') and (D', D) with this gamma whenever mu > Delta.
    gamma_local = ((2.0 * L + delta_h) * delta_h / (mu - delta_h) ** 2 if mu > delta_h
                   else math.inf)
    out.update(mu=mu, gamma=gamma, gamma_local=gamma_local,
               # n for which 2 L (2 clip / n) / mu^2 = 1 at this dataset's L and mu
               n_for_gamma_one=4.0 * L * clip / mu**2)
    if gamma >= 1.0:
        out["reason"] = (f"layer {path!r}: gamma = 2 L Delta / mu^2 = {gamma:.4g} >= 1 (needs "
                         f"mu > {out['mu_needed']:.4g}, has {mu:.4g})")
    if gamma_local >= 1.0:
        out["reason_local"] = (f"layer {path!r}: gamma_local = (2 L + Delta) Delta / "
                               f"(mu - Delta)^2 = {gamma_local:.4g} >= 1")
    return out


def intrinsic_record(per_layer_H: Mapping[str, Any], *, n: int, clip: float, rank: int,
                     delta: float, conversion: str = "standard") -> dict[str, Any]:
    """Data-dependent evaluation of Theorem 3.5 for the clipped one-step query of every layer.

    Per layer ``l``: ``(L_l, μ_l)`` from `query_bounds`, ``Δ = 2 clip / n`` (replace-one, from
    `average_query_sensitivity`) and ``γ_l = 2 L_l Δ / μ_l²``. Combined over layers (independent
    sketches ``A_l``): ``γ_max = max_l γ_l`` and ``rk_total = rank · Σ_l k_l``, a valid and
    conservative bound, and ``(ε, best α) = sketch_epsilon(delta, rank=rank, k=Σ_l k_l,
    gamma=γ_max)``.

    ``γ_l`` uses this dataset's ``L`` and ``μ`` as if they also held for its neighbours (Remark
    3.6 with measured values). ``γ_local,l = (2 L_l + Δ) Δ / (μ_l − Δ)²`` does not: a neighbour
    moves ``H`` by at most Δ, hence its singular values by at most Δ (Weyl), and condition (21)
    then holds with ``γ_local`` for every replace-one neighbour of this dataset, in both
    directions; ``epsilon_local`` is the corresponding number. Neither is a worst-case DP
    guarantee (see ``worst_case`` in the record).

    Args:
      per_layer_H: ``{path: H_l}`` with ``H_l`` of shape ``(k_l, m_l)``, ``k_l <= m_l``, e.g.
        from `clipped_average_query`; the spectral norm of each must be <= ``clip``.
      n: number of examples averaged (the normaliser of the query), >= 1.
      clip: the joint clipping norm G used to build ``H``, > 0.
      rank: LoRA rank r of the sketch, >= 1.
      delta: target δ ∈ (0, 1).
      conversion: RDP → (ε, δ) conversion, ``"standard"`` or ``"improved"`` (see
        `sketch_epsilon`).

    Returns:
      A JSON-able dict: ``kind`` (``"data-dependent"``, never ``"dp"``), ``scope``,
      ``conditions``, ``composition``, ``worst_case`` (why no data-independent bound exists and
      the ``mu`` that would be needed), the inputs, ``delta_h``, ``layers`` (per path: ``k``,
      ``m``, ``L``, ``mu``, ``gamma``, ``gamma_local``, ``mu_needed`` = sqrt(2 L Δ), the ``mu``
      below which ``gamma >= 1``, and ``n_for_gamma_one`` = 4 L clip / mu², the dataset size at
      which γ would reach 1 for this L and mu), ``gamma_max``, ``k_total``, ``rk_total``,
      ``epsilon``, ``best_alpha``, ``reason`` and their local counterparts
      ``gamma_local_max``, ``epsilon_local``, ``best_alpha_local``, ``reason_local``. When
      some layer has ``γ >= 1`` (or ``μ = 0``), ``epsilon`` is ``math.inf``, ``best_alpha`` is
      None and ``reason`` says which layer and why; otherwise ``reason`` is None (likewise for
      the local fields). Non-finite numbers are Python ``inf`` (``json.dumps`` writes
      ``Infinity``).

    Raises:
      ValueError / TypeError: on invalid input: an empty mapping, a non-2-D or non-finite
        ``H``, ``k > m``, ``H`` with spectral norm above ``clip``, or bad ``n``, ``clip``,
        ``rank``, ``delta`` or ``conversion``.
    """
    n, rank = _count("n", n), _count("rank", rank)
    clip, delta = _positive("clip", clip), _delta(delta)
    conversion = _conversion(conversion)
    if not isinstance(per_layer_H, Mapping) or not per_layer_H:
        raise ValueError("per_layer_H must be a non-empty mapping {layer path: (k, m) array}")
    delta_h = average_query_sensitivity(clip, n, "replace_one")
    layers = {str(path): _layer(str(path), h, delta_h, clip) for path, h in per_layer_H.items()}
    k_total = sum(layer["k"] for layer in layers.values())

    def combine(key: str, why: str) -> tuple[float, float, float | None, str | None]:
        gamma_max = max(layer[key] for layer in layers.values())
        reasons = [layer[why] for layer in layers.values() if why in layer]
        if reasons:
            return gamma_max, math.inf, None, (
                "the intrinsic sketch gives no guarantee around this dataset: "
                + "; ".join(reasons))
        eps, alpha = sketch_epsilon(delta, rank=rank, k=k_total, gamma=gamma_max,
                                    conversion=conversion)
        return gamma_max, eps, alpha, None

    gamma_max, epsilon, best_alpha, reason = combine("gamma", "reason")
    gamma_local_max, epsilon_local, best_alpha_local, reason_local = combine(
        "gamma_local", "reason_local")
    return {
        "kind": "data-dependent",
        "mechanism": "compact Gaussian sketch (Theorem 3.5) of a clipped one-step average query",
        "scope": SCOPE,
        "conditions": CONDITIONS,
        "composition": COMPOSITION,
        "worst_case": {"epsilon": math.inf, "reason": WORST_CASE,
                       "mu_sufficient_any_dataset": 2.0 * clip / math.sqrt(n)},
        "n": n, "clip": clip, "rank": rank, "delta": delta, "conversion": conversion,
        "relation": "replace_one", "delta_h": delta_h,
        "layers": layers,
        "gamma_max": gamma_max, "k_total": k_total, "rk_total": rank * k_total,
        "epsilon": epsilon, "best_alpha": best_alpha, "reason": reason,
        "gamma_local_max": gamma_local_max, "epsilon_local": epsilon_local,
        "best_alpha_local": best_alpha_local, "reason_local": reason_local,
    }


# ---------------------------------------------------------------- exact divergence of one pair


def _spd(name: str, value: Any) -> np.ndarray:
    s = _matrix(name, value)
    if s.shape[0] != s.shape[1]:
        raise ValueError(f"{name} must be a square covariance matrix, got shape {s.shape}")
    if not np.allclose(s, s.T, rtol=1e-10, atol=1e-12 * float(np.max(np.abs(s)))):
        raise ValueError(f"{name} must be symmetric")
    s = (s + s.T) / 2.0
    w = np.linalg.eigvalsh(s)
    if w[0] <= w[-1] * s.shape[0] * np.finfo(np.float64).eps:
        raise ValueError(f"{name} must be positive definite (smallest eigenvalue {w[0]:.3g}); a "
                         "singular covariance means a direction with no signal, where the "
                         "divergence of a neighbour with signal there is infinite")
    return s


def renyi_gaussian(Sigma_p: Any, Sigma_q: Any, alpha: float) -> float:
    """Exact Rényi divergence ``D_α(N(0, Σ_p) ‖ N(0, Σ_q))`` in nats.

    With ``λ_i`` the generalised eigenvalues of ``Σ_p`` relative to ``Σ_q``
    (``Σ_p v = λ Σ_q v``),

        D_α = −1/(2(α − 1)) Σ_i [log(α − (α − 1) λ_i) + (α − 1) log λ_i],

    finite when every ``α − (α − 1) λ_i > 0``; at α = 1 it is the KL divergence
    ``½ Σ_i (λ_i − 1 − log λ_i)``.

    Args:
      Sigma_p, Sigma_q: symmetric positive-definite (k, k) covariance matrices.
      alpha: order, a finite number > 0.

    Returns:
      The divergence, ``math.inf`` when ``α Σ_q + (1 − α) Σ_p`` is not positive definite.

    Raises:
      ValueError: if a matrix is not square, symmetric, finite and positive definite, the two
        differ in size, or ``alpha`` is not a finite number > 0.

    Example:
        >>> round(renyi_gaussian([[0.5]], [[1.0]], 2.0), 6)  # -(log 1.5 + log 0.5) / 2
        0.143841
        >>> renyi_gaussian([[2.0]], [[1.0]], 2.0)  # alpha - (alpha - 1) lambda = 0
        inf
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (Real, np.floating)):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    alpha = float(alpha)
    if not (math.isfinite(alpha) and alpha > 0.0):
        raise ValueError(f"alpha must be a finite Rényi order > 0, got {alpha!r}")
    s_p, s_q = _spd("Sigma_p", Sigma_p), _spd("Sigma_q", Sigma_q)
    if s_p.shape != s_q.shape:
        raise ValueError(f"Sigma_p {s_p.shape} and Sigma_q {s_q.shape} must have the same size")
    lam = linalg.eigh(s_p, s_q, eigvals_only=True)
    if alpha == 1.0:
        return float(0.5 * np.sum(lam - 1.0 - np.log(lam)))
    u = alpha - 1.0
    arg = -u * (lam - 1.0)  # α − (α − 1) λ = 1 + arg
    if np.any(arg <= -1.0):
        return math.inf
    terms = np.log1p(arg) + u * np.log(lam)
    return float(max(-np.sum(terms) / (2.0 * u), 0.0))


def sketch_pair_rdp(H: Any, H_prime: Any, rank: int, alpha: float) -> float:
    """Exact Rényi divergence of the sketch ``C = H Aᵀ`` for one pair of neighbours.

    ``C(D)`` has ``rank`` iid columns ``N(0, H(D) H(D)ᵀ / r)``, so
    ``D_α(C(D) ‖ C(D')) = rank · renyi_gaussian(H Hᵀ, H' H'ᵀ, α)`` (the 1/r scale cancels).
    Theorem 3.5's ``sketch_rdp(α, rank=r, k=k, gamma=γ)`` bounds it whenever the pair satisfies
    the covariance stability γ.

    Args:
      H: ``H(D)``, shape (k, m), full row rank.
      H_prime: ``H(D')``, the same shape.
      rank: sketch rank r >= 1.
      alpha: order > 0 (see `renyi_gaussian`).

    Returns:
      The divergence in nats, ``math.inf`` outside the order's valid range.

    Raises:
      ValueError: on non-finite or mismatched matrices, or a rank-deficient ``H`` or
        ``H_prime`` (singular covariance).
    """
    rank = _count("rank", rank)
    h, hp = _matrix("H", H), _matrix("H_prime", H_prime)
    if h.shape != hp.shape:
        raise ValueError(f"H {h.shape} and H_prime {hp.shape} must have the same shape")
    return rank * renyi_gaussian(h @ h.T, hp @ hp.T, alpha)
