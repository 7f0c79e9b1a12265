"""Intrinsic Rényi DP of the compact Gaussian-sketch release of PAVE (Theorem 3.5).

The compact PAVE release is ``B = F(D) Aᵀ`` with a **secret** sketch ``A ∈ R^{r×m}``,
``A_ij ~ N(0, 1/r)``, and ``F(D) = U H(D)`` living in a fixed public ``k``-dimensional subspace.
The columns of ``C = H(D) Aᵀ`` are iid ``N(0, Σ_D / r)`` with ``Σ_D = H(D) H(D)ᵀ``, so only the
covariance depends on the data. If every neighbouring pair satisfies the covariance stability

    (1 − γ) Σ_{D'} ⪯ Σ_D ⪯ (1 + γ) Σ_{D'},    0 < γ < 1,

the release is (α, ρ_α)-RDP for ``1 < α < (1 + γ)/γ`` with

    ρ_α = r k / (2(α − 1)) · max(f_α(1 − γ), f_α(1 + γ)),
    f_α(λ) = −log(α − (α − 1) λ) − (α − 1) log λ,

which at α = 2 is ``r k/2 · log(1/(1 − γ²))``; the bound is attained when all generalised
eigenvalues sit at the worse end point. `sketch_epsilon` converts it to (ε, δ) by optimising
over α (α = 2 alone gives ε >= log(1/δ) ≈ 11.5 at δ = 1e-5 whatever γ).

This is a **conditional** guarantee, never a certified one. It holds only against an adversary
who knows neither ``A`` nor the key that generates it, and only if ``F(D)`` does not depend on
``A`` (no adaptive optimiser whose trajectory sees ``A``). With ``A`` public, ``B = F(D) Aᵀ``
identifies ``F(D)`` and no finite ε holds (Proposition 3.7). `intrinsic_guarantee` and
`SketchGuarantee` refuse to state a number when those conditions fail; DP-S-PAVE is the
certified alternative. The analysis treats ``A`` as drawn afresh for the release; composition
over releases that share one ``A`` is not analysed (the guarantee says so when it applies).

Host-side float64 numpy/scipy; nothing here touches JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np
from scipy import optimize

from pavejax.accounting.ledger import Relation

__all__ = [
    "CONVERSIONS", "SketchConditionError", "SketchConditions", "SketchGuarantee",
    "average_query_sensitivity", "gamma_from_bounds", "intrinsic_guarantee", "sketch_epsilon",
    "sketch_rdp",
]

CONVERSIONS = ("standard", "improved")
_DP_S_PAVE = ("release the spec with DP-S-PAVE (Algorithm 1, noisy clipped gradients on B) for a "
              "certified guarantee")


class SketchConditionError(ValueError):
    """The conditions of the intrinsic sketch guarantee (Theorem 3.5) do not hold."""


# ---------------------------------------------------------------- validation


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def _positive(name: str, value: Any) -> float:
    value = _real(name, value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (Integral, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return int(value)


def _gamma(value: Any) -> float:
    value = _real("gamma", value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"gamma (covariance stability) must be in (0, 1), got {value!r}; "
                         f"with gamma >= 1 the sketch gives no guarantee: {_DP_S_PAVE}")
    return value


def _delta(value: Any) -> float:
    value = _real("delta", value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {value!r}; typical values are below "
                         "1/dataset_size, e.g. 1e-5")
    return value


def _conversion(value: Any) -> str:
    if value not in CONVERSIONS:
        raise ValueError(f"unknown conversion {value!r}; use 'standard' (rho + log(1/delta)/"
                         "(alpha - 1)) or 'improved' (Balle et al. 2020)")
    return value


# ---------------------------------------------------------------- RDP curve and conversion


def _rho(u: np.ndarray, rk: int, gamma: float) -> np.ndarray:
    """ρ at orders α = 1 + u (u > 0, vectorised); +inf where u γ >= 1."""
    u = np.asarray(u, np.float64)
    ok = u * gamma < 1.0
    us = np.where(ok, u, 0.5 / gamma)  # keep the logs finite; masked out below
    # α − (α − 1) λ = 1 + u (1 − λ); log1p keeps f accurate as α → 1.
    f_lo = -np.log1p(us * gamma) - us * np.log1p(-gamma)
    f_hi = -np.log1p(-us * gamma) - us * np.log1p(gamma)
    rho = rk / (2.0 * us) * np.maximum(f_lo, f_hi)
    return np.where(ok, np.maximum(rho, 0.0), np.inf)


def _convert(u: np.ndarray, rho: np.ndarray, delta: float, conversion: str) -> np.ndarray:
    u = np.asarray(u, np.float64)
    if conversion == "standard":
        return rho + math.log(1.0 / delta) / u
    alpha = 1.0 + u
    # Balle et al. 2020 (Prop. 12 of arXiv:2004.00010), as in dp-accounting's RDP accountant.
    return np.maximum(rho + np.log1p(-1.0 / alpha) - np.log(delta * alpha) / u, 0.0)


def sketch_rdp(alpha: float, *, rank: int, k: int, gamma: float) -> float:
    """RDP ρ_α (nats) of one compact Gaussian-sketch release (Theorem 3.5).

    Args:
      alpha: Rényi order, > 1.
      rank: LoRA rank r (number of sketch columns).
      k: dimension of the common subspace U (rows of H(D)).
      gamma: covariance stability γ ∈ (0, 1) of condition (21).

    Returns:
      ``r k/(2(α−1)) · max(f_α(1−γ), f_α(1+γ))``; ``+inf`` for α >= (1+γ)/γ, where the Rényi
      divergence of the worst-case pair is infinite. Valid only under the conditions listed in
      the module docstring (secret A, A-independent trajectory).

    Example:
        >>> round(sketch_rdp(2.0, rank=4, k=1, gamma=0.1), 6)  # 2 log(1/0.99)
        0.020101
    """
    alpha = _real("alpha", alpha)
    if alpha <= 1.0:
        raise ValueError(f"alpha must be a Rényi order > 1, got {alpha!r}")
    rk = _count("rank", rank) * _count("k", k)
    gamma = _gamma(gamma)
    if math.isinf(alpha):
        return math.inf
    return float(_rho(np.array([alpha - 1.0]), rk, gamma)[0])


def _dense_grid(gamma: float) -> np.ndarray:
    """Values of u = α − 1 covering (0, 1/γ): log-spaced from below and towards the top end."""
    u_max = 1.0 / gamma
    low = np.geomspace(1e-7, 1.0, 3000, endpoint=False)
    high = 1.0 - np.geomspace(1e-10, 0.5, 500)
    return u_max * np.unique(np.concatenate([low, high]))


def sketch_epsilon(delta: float, *, rank: int, k: int, gamma: float,
                   orders: Iterable[float] | None = None,
                   conversion: str = "standard") -> tuple[float, float]:
    """(ε, best α) of one compact Gaussian-sketch release at ``delta``, optimised over α.

    Args:
      delta: target δ ∈ (0, 1).
      rank, k, gamma: as in `sketch_rdp`.
      orders: Rényi orders to try. ``None`` (default) searches the whole valid range
        1 < α < (1+γ)/γ: a dense log-spaced grid, then a bounded scalar minimisation around the
        best grid point.
      conversion: ``"standard"`` (default): ε = ρ_α + log(1/δ)/(α − 1), the conversion of the
        reference analysis; ``"improved"``: ε = ρ_α + log(1 − 1/α) − log(δ α)/(α − 1)
        (Balle et al. 2020, also used by dp-accounting), never larger.

    Returns:
      ``(epsilon, alpha)``. Example numbers at δ = 1e-5 (standard): γ = 0.01, r k = 64 → 0.355
      (11.52 at α = 2 alone); γ = 0.05, r k = 16 → 1.12; γ = 0.001, r k = 1024 → 0.117.
    """
    delta = _delta(delta)
    rk = _count("rank", rank) * _count("k", k)
    gamma, conversion = _gamma(gamma), _conversion(conversion)

    def eps(u: np.ndarray) -> np.ndarray:
        return _convert(u, _rho(u, rk, gamma), delta, conversion)

    if orders is not None:
        alphas = np.array([_real("order", a) for a in orders], np.float64)
        if alphas.size == 0 or np.any(alphas <= 1.0):
            raise ValueError("orders must be a non-empty list of Rényi orders > 1")
        values = eps(alphas - 1.0)
        best = int(np.argmin(values))
        if not math.isfinite(values[best]):
            raise ValueError(f"no order in {sorted(alphas.tolist())} lies in the valid range "
                             f"1 < alpha < (1 + gamma)/gamma = {(1.0 + gamma) / gamma:.6g}")
        return float(values[best]), float(alphas[best])

    grid = _dense_grid(gamma)
    values = eps(grid)
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    best_u, best_eps = float(grid[i]), float(values[i])
    if hi > lo:
        res = optimize.minimize_scalar(lambda u: float(eps(np.array([u]))[0]),
                                       bounds=(lo, hi), method="bounded",
                                       options={"xatol": 1e-12 * max(1.0, hi)})
        if res.success and res.fun < best_eps:
            best_u, best_eps = float(res.x), float(res.fun)
    return best_eps, 1.0 + best_u


# ---------------------------------------------------------------- gamma from query bounds


def gamma_from_bounds(*, lipschitz: float, mu: float, delta_h: float) -> float:
    """Covariance stability γ = 2 L Δ / μ² (Remark 3.6).

    Args:
      lipschitz: L, an upper bound on the singular values of H(D) for every data set
        (μ² I ⪯ H Hᵀ ⪯ L² I).
      mu: μ, a lower bound on those singular values (0 < μ <= L).
      delta_h: Δ, the spectral-norm sensitivity sup ‖H(D) − H(D')‖₂ over neighbours (see
        `average_query_sensitivity`).

    Returns:
      γ with (1 − γ) Σ_{D'} ⪯ Σ_D ⪯ (1 + γ) Σ_{D'} for all neighbours, since
      ‖Σ_D − Σ_{D'}‖₂ <= 2 L Δ and Σ_{D'} ⪰ μ² I.

    Raises:
      SketchConditionError: if γ >= 1: the intrinsic sketch then gives no guarantee.
    """
    lipschitz, mu = _positive("lipschitz", lipschitz), _positive("mu", mu)
    delta_h = _positive("delta_h", delta_h)
    if mu > lipschitz:
        raise ValueError(f"mu ({mu!r}) cannot exceed lipschitz ({lipschitz!r}): they bound the "
                         "smallest and largest singular values of H(D)")
    gamma = 2.0 * lipschitz * delta_h / mu**2
    if gamma >= 1.0:
        raise SketchConditionError(
            f"gamma = 2 L Delta / mu^2 = {gamma:.4g} >= 1: the covariance of the sketch is not "
            f"stable enough and the intrinsic sketch gives no privacy guarantee; {_DP_S_PAVE}")
    return gamma


def average_query_sensitivity(G: float, n: int, relation: Relation | str = "replace_one") -> float:
    """Spectral-norm sensitivity Δ of an average-type query H(D) = (1/n) Σ_i Ψ(z_i).

    Args:
      G: bound on ‖Ψ(z)‖₂ (spectral norm; a Frobenius-norm clip at G also bounds it).
      n: the normaliser (number of records), >= 1.
      relation: ``"replace_one"`` (default): Δ = 2G/n, one Ψ swapped for another.
        ``"add_remove"``: Δ = G/n, which assumes the normaliser ``n`` is fixed and public (a sum
        divided by an expected size, as in DP-S-PAVE). A mean over the actual record count moves
        by up to 2G/(n + 1) when a record is added; use the replace-one value for it.
    """
    G, n = _positive("G", G), _count("n", n)
    rel = Relation.parse(relation)
    return (2.0 if rel is Relation.REPLACE_ONE else 1.0) * G / n


# ---------------------------------------------------------------- the guarantee and its conditions


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True)
class SketchConditions:
    """What a release asserts about itself when it claims the intrinsic sketch guarantee.

    Attributes:
      a_secret: A (and the key that generates it) is never released nor known to the adversary.
      a_fresh_per_release: A is drawn afresh for this release. False when one A is shared by all
        releases of a dock (needed for comparability); the bound then covers this release alone.
      common_subspace_dim: k, the dimension of the public subspace U that holds F(D) (18).
      covariance_stability: γ ∈ (0, 1) of condition (21), e.g. from `gamma_from_bounds`.
      trajectory_independent_of_A: F(D) does not depend on A. False for any adaptive optimiser
        (Adam, multi-step training whose gradients see A); then only DP-S-PAVE applies.
      notes: free text: how k and γ were obtained, who holds the key.
    """

    a_secret: bool
    a_fresh_per_release: bool
    common_subspace_dim: int
    covariance_stability: float
    trajectory_independent_of_A: bool
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("a_secret", "a_fresh_per_release", "trajectory_independent_of_A"):
            object.__setattr__(self, name, _bool(name, getattr(self, name)))
        object.__setattr__(self, "common_subspace_dim",
                           _count("common_subspace_dim", self.common_subspace_dim))
        object.__setattr__(self, "covariance_stability", _gamma(self.covariance_stability))
        if not isinstance(self.notes, str):
            raise TypeError(f"notes must be a string, got {type(self.notes).__name__}")

    def require_claimable(self) -> None:
        """Raise `SketchConditionError` unless Theorem 3.5 may be claimed under these conditions."""
        reasons = []
        if not self.a_secret:
            reasons.append("A is public: B = F(D) A^T then identifies F(D), so no finite epsilon "
                           "holds for any delta < 1 (Proposition 3.7)")
        if not self.trajectory_independent_of_A:
            reasons.append("the spec was trained with an A-dependent (adaptive) trajectory, e.g. "
                           "Adam or multi-step training; Theorem 3.5 needs F(D) independent of A "
                           "(the adaptive-training remark after Proposition 3.7)")
        if reasons:
            raise SketchConditionError(
                "the intrinsic sketch guarantee (Theorem 3.5) cannot be claimed: "
                + "; ".join(reasons) + f". {_DP_S_PAVE[0].upper()}{_DP_S_PAVE[1:]}.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SketchConditions:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(obj) - {"notes"}
        if missing:
            raise ValueError(f"sketch conditions lack fields {sorted(missing)}")
        return cls(**{k: v for k, v in obj.items() if k in names})


_HOLDS_AGAINST = (
    "adversaries who know neither A nor the key that generates it; whoever holds the key (the "
    "dock, and any party able to run spec generation with it) is outside this guarantee")


@dataclasses.dataclass(frozen=True)
class SketchGuarantee:
    """A conditional (ε, δ) statement for one compact Gaussian-sketch release (Theorem 3.5).

    Construct it with `intrinsic_guarantee`; the constructor re-checks the conditions, so a
    guarantee whose A is public or whose spec was trained adaptively cannot exist.
    ``epsilon`` is at ``delta`` and holds only under ``conditions``; it is never certified.
    """

    epsilon: float
    delta: float
    best_alpha: float
    rank: int
    k: int
    gamma: float
    conditions: SketchConditions
    conversion: str = "standard"

    def __post_init__(self) -> None:
        if not isinstance(self.conditions, SketchConditions):
            raise TypeError(f"conditions must be SketchConditions, got "
                            f"{type(self.conditions).__name__}")
        self.conditions.require_claimable()
        _check_consistent(self.k, self.gamma, self.conditions)
        if not (math.isfinite(_real("epsilon", self.epsilon)) and self.epsilon >= 0.0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}")
        _delta(self.delta)
        _count("rank", self.rank)
        _conversion(self.conversion)

    def caveats(self) -> list[str]:
        """Limits of the statement that hold even when it may be claimed."""
        out = ["conditional guarantee: valid only if A stays secret, F(D) lies in the stated "
               "k-dimensional subspace and the covariance stability gamma holds for every "
               "neighbouring pair"]
        if not self.conditions.a_fresh_per_release:
            out.append("A is shared with other releases: the bound covers this release alone; "
                       "composition over releases that share A is not analysed, and anyone who "
                       "knows another release's F(D) learns part of A")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe record for release metadata (never contains A or its key)."""
        return {
            "kind": "conditional",
            "mechanism": "compact Gaussian sketch (Theorem 3.5)",
            "epsilon": self.epsilon, "delta": self.delta, "best_alpha": self.best_alpha,
            "rank": self.rank, "k": self.k, "gamma": self.gamma, "conversion": self.conversion,
            "conditions": self.conditions.to_dict(),
            "holds_against": _HOLDS_AGAINST,
            "caveats": self.caveats(),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SketchGuarantee:
        """Rebuilds a guarantee, recomputing ε to refuse a record whose number was altered."""
        if obj.get("kind") != "conditional":
            raise ValueError(f"not a sketch guarantee record (kind={obj.get('kind')!r})")
        rebuilt = intrinsic_guarantee(
            obj["delta"], rank=obj["rank"], k=obj["k"], gamma=obj["gamma"],
            conditions=SketchConditions.from_dict(obj["conditions"]),
            conversion=obj.get("conversion", "standard"))
        if not math.isclose(rebuilt.epsilon, float(obj["epsilon"]), rel_tol=1e-9):
            raise ValueError(f"stored epsilon {obj['epsilon']!r} disagrees with the recomputed "
                             f"{rebuilt.epsilon!r} for the stored rank, k, gamma and delta")
        return rebuilt


def _check_consistent(k: Any, gamma: Any, conditions: SketchConditions) -> None:
    if _count("k", k) != conditions.common_subspace_dim:
        raise ValueError(f"k={k!r} disagrees with conditions.common_subspace_dim="
                         f"{conditions.common_subspace_dim}")
    if _gamma(gamma) != conditions.covariance_stability:
        raise ValueError(f"gamma={gamma!r} disagrees with conditions.covariance_stability="
                         f"{conditions.covariance_stability}")


def intrinsic_guarantee(delta: float, *, rank: int, conditions: SketchConditions,
                        k: int | None = None, gamma: float | None = None,
                        conversion: str = "standard") -> SketchGuarantee:
    """The conditional (ε, δ) guarantee of one compact Gaussian-sketch release (Theorem 3.5).

    Args:
      delta: target δ ∈ (0, 1).
      rank: LoRA rank r.
      conditions: what the release asserts; ``k`` and ``gamma`` default to
        ``conditions.common_subspace_dim`` and ``conditions.covariance_stability`` and must agree
        with them when given.
      conversion: RDP → (ε, δ) conversion, see `sketch_epsilon`.

    Raises:
      SketchConditionError: when ``conditions.a_secret`` or
        ``conditions.trajectory_independent_of_A`` is False (Proposition 3.7 and the
        adaptive-training remark): such a release must not claim the intrinsic guarantee.
    """
    if not isinstance(conditions, SketchConditions):
        raise TypeError(f"conditions must be SketchConditions, got {type(conditions).__name__}")
    conditions.require_claimable()
    k = conditions.common_subspace_dim if k is None else k
    gamma = conditions.covariance_stability if gamma is None else gamma
    _check_consistent(k, gamma, conditions)
    eps, alpha = sketch_epsilon(delta, rank=rank, k=k, gamma=gamma, conversion=conversion)
    return SketchGuarantee(epsilon=eps, delta=float(delta), best_alpha=alpha, rank=int(rank),
                           k=int(k), gamma=float(gamma), conditions=conditions,
                           conversion=conversion)
