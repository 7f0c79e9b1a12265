"""PAC-Privacy accounting of binary releases: mutual information, σ calibration, MIA bounds.

The PAC-Privacy setting of PACZero: the secret is one of M equally likely candidate subsets of a
public pool, every pool example is in exactly half of them (membership prior 1/2), and each step
releases one bit that depends on the secret only through the sign s* ∈ {±1} of the secret
subset. If the adversary's posterior puts mass q₊ on s* = +1, then

* a noiseless release leaks ``H_b(q₊)`` nats (`binary_entropy`);
* a release ``s* + N(0, σ²)`` leaks ``I_BIAWGN(q₊, σ)`` (`biawgn_mutual_information`), the
  capacity expression of the binary-input additive white Gaussian noise channel;
* a randomised-response release (flip with probability ρ) leaks `bsc_mutual_information`.

Per-step leaks add up by the chain rule, and the total mutual information I bounds every
membership-inference attack: its posterior success p satisfies KL(Bern(p) ‖ Bern(1/2)) <= I
(`mia_posterior_bound`). An (ε, δ)-DP mechanism gives p <= 1 − (1 − δ)/(1 + e^ε), which is how a
DP baseline and a PAC budget are matched "at the MIA level" (`epsilon_to_mi`, `mi_to_epsilon`).

All functions are host-side float64 (numpy/scipy); units are nats throughout.
"""

from __future__ import annotations

import functools
import math
from numbers import Real
from typing import Any

import numpy as np
from scipy import special

__all__ = [
    "bernoulli_kl", "binary_entropy", "biawgn_mutual_information", "bsc_mutual_information",
    "calibrate_biawgn_sigma", "dp_mia_success_bound", "epsilon_to_mi", "mi_to_epsilon",
    "mia_posterior_bound",
]

_SIGMA_LO, _SIGMA_HI = 1e-4, 1e4  # the reference bracket for σ


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _probability(name: str, value: Any) -> float:
    value = _real(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return value


def _nats(name: str, value: Any) -> float:
    value = _real(name, value)
    if value < 0.0:
        raise ValueError(f"{name} must be >= 0 nats, got {value!r}")
    return value


def binary_entropy(q: float) -> float:
    """H_b(q) = −q ln q − (1−q) ln(1−q) in nats (0 at q ∈ {0, 1}, ln 2 at q = 1/2)."""
    q = _probability("q", q)
    return float(special.entr(q) + special.entr(1.0 - q))


def bernoulli_kl(p: float, prior: float) -> float:
    """KL(Bern(p) ‖ Bern(prior)) in nats; ``prior`` must be in (0, 1)."""
    p, prior = _probability("p", p), _probability("prior", prior)
    if not 0.0 < prior < 1.0:
        raise ValueError(f"prior must be in (0, 1), got {prior!r}")
    return float(special.rel_entr(p, prior) + special.rel_entr(1.0 - p, 1.0 - prior))


@functools.lru_cache(maxsize=8)
def _hermite_rule(nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilists' Gauss–Hermite rule: E[f(x)], x ~ N(0, 1) ≈ Σ w_k f(x_k)."""
    x, w = special.roots_hermitenorm(nodes)
    return x, w / math.sqrt(2.0 * math.pi)


def biawgn_mutual_information(q: float, sigma: float, *, nodes: int = 60) -> float:
    """I(s; s + N(0, σ²)) in nats for s ∈ {±1} with P(s = +1) = q.

    Uses I = −q E[ln(q + (1−q) e^{a})] − (1−q) E[ln((1−q) + q e^{a})], a = −2(1 + σx)/σ²,
    x ~ N(0, 1), with ``nodes``-point probabilists' Gauss–Hermite quadrature and log-sum-exp
    (agrees with adaptive quadrature to ~1e-7 relative). Decreasing in σ; 0 when q ∈ {0, 1}.
    """
    q, sigma = _probability("q", q), _real("sigma", sigma)
    if sigma <= 0.0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    if q in (0.0, 1.0):
        return 0.0
    x, w = _hermite_rule(int(nodes))
    a = -2.0 * (1.0 + sigma * x) / sigma**2
    lq, lr = math.log(q), math.log1p(-q)
    plus = np.logaddexp(lq, lr + a)       # ln(q + (1−q) e^a)
    minus = np.logaddexp(lr, lq + a)      # ln((1−q) + q e^a)
    value = -q * float(w @ plus) - (1.0 - q) * float(w @ minus)
    return min(max(value, 0.0), binary_entropy(q))


def bsc_mutual_information(q: float, rho: float) -> float:
    """I(s; s flipped w.p. ρ) = H_b(q(1−ρ) + (1−q)ρ) − H_b(ρ) in nats (randomised response)."""
    q, rho = _probability("q", q), _probability("rho", rho)
    return max(binary_entropy(q * (1.0 - rho) + (1.0 - q) * rho) - binary_entropy(rho), 0.0)


def calibrate_biawgn_sigma(q: float, beta: float, *, faithful: bool = False,
                           rel_tol: float = 1e-9, max_iter: int = 400) -> float:
    """Noise σ with I_BIAWGN(q, σ) = β (nats), for 0 < q < 1 and 0 < β < H_b(q).

    Default (conservative): bisection on ln σ that keeps an upper end ``hi`` with
    I(q, hi) <= β, stops once I(q, lo) − I(q, hi) <= rel_tol·β, and returns ``hi``; so the
    realised mutual information never exceeds β and is within a relative ``rel_tol`` of it. The
    bracket starts at [1e-4, 1e4] and widens upward when β is tinier than I(q, 1e4).

    ``faithful=True`` reproduces the reference routine: 64 bisection steps on ln σ over
    [1e-4, 1e4] stopping when |I − β| < 1e-6 (absolute), returning the midpoint. For β below about
    1e-5 that σ can leak several times β; use it only to reproduce published numbers.

    Raises ValueError when q ∉ (0, 1) (the release is deterministic: nothing to calibrate) or
    β ∉ (0, H_b(q)) (no finite noise level is needed, or none can reach β).
    """
    q, beta = _probability("q", q), _nats("beta", beta)
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1) to calibrate noise, got {q!r}; with q in {{0, 1}} "
                         "the sign is known and the release leaks nothing")
    cap = binary_entropy(q)
    if not 0.0 < beta < cap:
        raise ValueError(f"beta must be in (0, H_b(q) = {cap:.6g}) nats, got {beta!r}; cap the "
                         "per-step budget below the entropy of the sign")
    info = functools.partial(biawgn_mutual_information, q)
    lo, hi = math.log(_SIGMA_LO), math.log(_SIGMA_HI)
    if faithful:
        mid = 0.5 * (lo + hi)
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            value = info(math.exp(mid))
            if abs(value - beta) < 1e-6:
                break
            lo, hi = (mid, hi) if value > beta else (lo, mid)
        return math.exp(mid)
    while info(math.exp(hi)) > beta:  # widen: β is below the bracket's smallest leak
        lo, hi = hi, hi + math.log(10.0)
    while info(math.exp(lo)) <= beta and lo > math.log(1e-12):
        lo -= math.log(10.0)
    for _ in range(int(max_iter)):
        if info(math.exp(lo)) - info(math.exp(hi)) <= rel_tol * beta:
            break
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if info(math.exp(mid)) > beta else (lo, mid)
    return math.exp(hi)


def mia_posterior_bound(mi: float, prior: float = 0.5) -> float:
    """Largest membership-inference posterior success p with KL(Bern(p) ‖ Bern(prior)) <= mi.

    ``mi`` is the mutual information (nats) between the secret and everything released. At
    mi = 0 the bound is the prior; it reaches 1 once mi >= −ln(prior). Bisection to 1e-15.
    """
    mi, prior = _nats("mi", mi), _probability("prior", prior)
    if not 0.0 < prior < 1.0:
        raise ValueError(f"prior must be in (0, 1), got {prior!r}")
    if mi >= -math.log(prior):
        return 1.0
    lo, hi = prior, 1.0
    while hi - lo > 1e-15:
        mid = 0.5 * (lo + hi)
        if bernoulli_kl(mid, prior) <= mi:
            lo = mid
        else:
            hi = mid
    return lo


def dp_mia_success_bound(epsilon: float, delta: float) -> float:
    """Posterior success bound of a membership-inference attack (prior 1/2) under (ε, δ)-DP:
    p <= 1 − (1 − δ)/(1 + e^ε)."""
    epsilon, delta = _real("epsilon", epsilon), _probability("delta", delta)
    if epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    return 1.0 - (1.0 - delta) * float(special.expit(-epsilon))  # no overflow at large ε


def epsilon_to_mi(epsilon: float, delta: float) -> float:
    """Mutual information (nats) whose MIA posterior bound equals that of (ε, δ)-DP
    (e.g. ε = 2, δ = 1e-5 ↔ 0.328 nats; ε = 6 ↔ 0.676)."""
    return bernoulli_kl(dp_mia_success_bound(epsilon, delta), 0.5)


def mi_to_epsilon(mi: float, delta: float) -> float:
    """The ε at ``delta`` whose MIA posterior bound matches a mutual information of ``mi`` nats:
    ε = ln((1 − δ)/(1 − p) − 1) with p = `mia_posterior_bound`; 0 when that is negative and
    inf when p = 1."""
    delta = _probability("delta", delta)
    p = mia_posterior_bound(mi)
    if p >= 1.0:
        return math.inf
    ratio = (1.0 - delta) / (1.0 - p) - 1.0
    return max(math.log(ratio), 0.0) if ratio > 0.0 else 0.0
