"""Disclosure and amplification risk of an (ε, δ)-DP release (Theorems 4.2 and 4.3).

The adversary plays a binary game: tell a neighbouring pair D, D' apart from its view. Its best
advantage is the total variation between the two view distributions, and its best balanced
success probability is ``(1 + advantage)/2`` (`balanced_attack_success`).

* **Disclosure** (Theorem 4.2): publishing an (ε, δ)-DP release R next to any prior view H₀ raises
  the adversary's advantage by at most ``η = (e^ε − 1) + δ`` (`disclosure_bound`).
* **Amplification** (Theorem 4.3): publishing R next to a model H raises the advantage over the
  model alone by at most the same ``η`` (`amplification_bound`). Both need R to be (ε, δ)-DP
  conditionally on the other view (Lemma 4.1).
* **Per-pair TV** (`tv_bound`): the advantage on R alone is at most
  ``(e^ε − 1 + 2δ)/(e^ε + 1)``, tighter than η and attained by randomised response with a
  δ-probability leak; report it next to η.

η exceeds 1 (vacuous) from ε = log(2 − δ) ≈ 0.69 on, and it is informative only for ε ≲ 0.5; the
functions cap it at 1 and `risk_report` flags the vacuous case. Host-side float64 only.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

__all__ = [
    "amplification_bound", "balanced_attack_success", "disclosure_bound", "risk_report",
    "tv_bound",
]


def _check(epsilon: Any, delta: Any) -> tuple[float, float]:
    for name, value in (("epsilon", epsilon), ("delta", delta)):
        if isinstance(value, bool) or not isinstance(value, (Real, np.floating)):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    epsilon, delta = float(epsilon), float(delta)
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}; a release "
                         "without a finite epsilon has no risk bound (every bound is 1)")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    return epsilon, delta


def _eta(epsilon: float, delta: float) -> float:
    # expm1(min(ε, 1)) >= 1.7 once ε >= 1, so the cap is unchanged and exp never overflows.
    return math.expm1(min(epsilon, 1.0)) + delta


def disclosure_bound(epsilon: float, delta: float) -> float:
    """Bound on the disclosure risk of an (ε, δ)-DP release (Theorem 4.2).

    Returns ``min(1, (e^ε − 1) + δ)``: the largest increase in distinguishing advantage that the
    release can give over any prior view. Informative only for ε ≲ 0.5; it reaches the trivial
    value 1 at ε = log(2 − δ) ≈ 0.69 (e.g. ε = 1 gives 1.72 before capping).
    """
    epsilon, delta = _check(epsilon, delta)
    return min(1.0, _eta(epsilon, delta))


def amplification_bound(epsilon: float, delta: float) -> float:
    """Bound on the amplification risk of releasing an (ε, δ)-DP spec with a model (Theorem 4.3).

    Returns ``min(1, (e^ε − 1) + δ)``: the largest gain in distinguishing advantage of the view
    (model, spec) over the model alone, when the spec is (ε, δ)-DP given the model. Same
    vacuity as `disclosure_bound`.
    """
    epsilon, delta = _check(epsilon, delta)
    return min(1.0, _eta(epsilon, delta))


def tv_bound(epsilon: float, delta: float) -> float:
    """Largest total variation between an (ε, δ)-DP mechanism's outputs on neighbours.

    Returns ``(e^ε − 1 + 2δ)/(e^ε + 1)`` (< 1 for δ < 1, never above `disclosure_bound`): the best
    distinguishing advantage on the release alone. Tight: randomised response that leaks the
    input with probability δ attains it.
    """
    epsilon, delta = _check(epsilon, delta)
    x = math.expm1(min(epsilon, 700.0))  # the ratio is 1.0 in float64 long before ε = 700
    # min(): the bound is below η in exact arithmetic; keep that order after rounding too.
    return min((x + 2.0 * delta) / (x + 2.0), _eta(epsilon, delta))


def balanced_attack_success(adv: float) -> float:
    """Best balanced success probability ``(1 + adv)/2`` of an attack with advantage ``adv``."""
    if isinstance(adv, bool) or not isinstance(adv, (Real, np.floating)):
        raise TypeError(f"adv must be a real number, got {type(adv).__name__}")
    adv = float(adv)
    if not 0.0 <= adv <= 1.0:
        raise ValueError(f"adv (an advantage, a total variation) must be in [0, 1], got {adv!r}")
    return 0.5 * (1.0 + adv)


def risk_report(epsilon: float, delta: float) -> dict[str, Any]:
    """JSON-safe risk record for release metadata.

    Keys: ``epsilon``, ``delta``, ``disclosure_bound`` (Theorem 4.2), ``amplification_bound``
    (Theorem 4.3), ``tv_bound`` (per-pair total variation), ``balanced_success_bound``
    (``(1 + tv_bound)/2``), ``disclosure_vacuous`` (True when ``(e^ε − 1) + δ >= 1``, so the two
    theorem bounds say nothing), and ``note``.
    """
    epsilon, delta = _check(epsilon, delta)
    tv = tv_bound(epsilon, delta)
    return {
        "epsilon": epsilon,
        "delta": delta,
        "disclosure_bound": disclosure_bound(epsilon, delta),
        "amplification_bound": amplification_bound(epsilon, delta),
        "tv_bound": tv,
        "balanced_success_bound": balanced_attack_success(tv),
        "disclosure_vacuous": _eta(epsilon, delta) >= 1.0,
        "note": ("advantages are total-variation distances between the adversary's views on "
                 "neighbouring data sets; the disclosure and amplification bounds "
                 "(e^eps - 1) + delta are informative only for eps <~ 0.5"),
    }
