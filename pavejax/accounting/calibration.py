"""Noise and length calibration: the smallest noise multiplier (`calibrate`) or the largest
number of steps (`calibrate_steps`) whose run meets an (ε, δ) target.

Both take the events from :mod:`pavejax.accounting.events` (or any ``DpEvent``) and analyse
them exactly as a :class:`~pavejax.accounting.Ledger` of the same relation, accountant and PLD
grid does, so a calibrated run never exceeds its target in that ledger.

All numbers are host-side Python floats (float64); nothing here touches JAX.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from numbers import Real
from typing import Any

from dp_accounting import dp_event

from pavejax.accounting.ledger import (
    Relation,
    _check_accountant,
    _check_count,
    _check_delta,
    _check_epsilon,
    _ensure_supported,
    _epsilon_of_runs,
    _for_accountant,
    _fresh_accountant,
)

__all__ = ["calibrate", "calibrate_steps"]

_MAX_NOISE = 1e4  # no multiplier above this is searched: such a run learns nothing
_MIN_NOISE = 1e-6
_COARSE_PLD = 1e-3

MakeEvent = Callable[[float], dp_event.DpEvent]


@contextlib.contextmanager
def _quiet_rdp_warnings():
    """The search probes tiny noise levels where RDP's series does not converge; those orders
    are dropped (the bound stays valid), and the warnings would only alarm the user."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _epsilon(event: dp_event.DpEvent, delta: float, relation: Relation, accountant: str,
             pld_discretization: float) -> float:
    """ε at ``delta`` of ``event`` as a `Ledger` would report it (memoised with the ledgers'
    figures: a calibration repeated for another config with the same run replays its
    evaluations for free, and the ledger of the calibrated run finds its ε computed)."""
    with _quiet_rdp_warnings():
        return _epsilon_of_runs([(event, 1)], delta, relation, accountant, pld_discretization)


def _gaussian_mu(event: dp_event.DpEvent) -> float | None:
    """mu^2 = sum of s^-2 over the Gaussian queries of a composition without sampling (the
    composition is then exactly the Gaussian mechanism of sensitivity/std mu); None when
    ``event`` holds anything else."""
    if isinstance(event, dp_event.GaussianDpEvent):
        return float(event.noise_multiplier) ** -2
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = _gaussian_mu(event.event)
        return None if inner is None else inner * event.count
    if isinstance(event, dp_event.ComposedDpEvent) and event.events:
        parts = [_gaussian_mu(e) for e in event.events]
        return None if any(p is None for p in parts) else math.fsum(parts)
    return None


def _gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact delta(epsilon) of a Gaussian mechanism with sensitivity / std = ``mu``."""
    from scipy.stats import norm

    return float(norm.cdf(mu / 2 - epsilon / mu)
                 - math.exp(epsilon) * norm.cdf(-mu / 2 - epsilon / mu))


def _exact_gaussian_noise(make_event: MakeEvent, epsilon: float, delta: float,
                          relation: Relation) -> float | None:
    """For a run of unsampled Gaussian queries: the multiplier at which the run, as the exact
    Gaussian mechanism, has exactly (epsilon, delta); None for any other run."""
    from scipy import optimize

    scale = 2.0 if relation is Relation.REPLACE_ONE else 1.0

    def gap(log_z: float) -> float:
        mu2 = _gaussian_mu(make_event(math.exp(log_z)))
        if mu2 is None:
            raise _NotGaussian
        return _gaussian_delta(epsilon, scale * math.sqrt(mu2)) - delta

    try:
        lo, hi = math.log(_MIN_NOISE), math.log(_MAX_NOISE)
        if not gap(lo) > 0 >= gap(hi):
            return None
        return math.exp(optimize.brentq(gap, lo, hi, xtol=1e-12, rtol=4 * 2.0**-52))
    except (_NotGaussian, ArithmeticError, ValueError):
        return None  # not a plain Gaussian run (or beyond float range): the general search


class _NotGaussian(Exception):
    pass


def _check_epsilon_target(epsilon: Any) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, Real) or math.isnan(epsilon):
        raise ValueError(f"epsilon must be a number > 0 (math.inf for no noise), got {epsilon!r}")
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0 (math.inf for no noise), got {epsilon!r}")
    return float(epsilon)


def _check_bracket(lo: Any, hi: Any, rtol: Any) -> tuple[float, float, float]:
    for name, v in (("lo", lo), ("hi", hi)):
        if isinstance(v, bool) or not isinstance(v, Real) or not 0 < v < math.inf:
            raise ValueError(f"{name} must be a finite noise multiplier > 0, got {v!r}")
    if not lo < hi:
        raise ValueError(f"the initial bracket needs lo < hi, got lo={lo!r}, hi={hi!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, Real) or not 0 < rtol <= 0.1:
        raise ValueError(f"rtol must be in (0, 0.1], got {rtol!r}")
    return float(lo), float(hi), float(rtol)


def calibrate(make_event: MakeEvent, epsilon: float, delta: float, *,
              relation: Relation | str = "add_remove", accountant: str = "rdp",
              lo: float = 0.5, hi: float = 1.0, rtol: float = 1e-3,
              pld_discretization: float = 1e-4) -> float:
    """Smallest noise multiplier z whose run ``make_event(z)`` meets (``epsilon``, ``delta``).

    Args:
      make_event: z -> the ``DpEvent`` of the WHOLE run at noise multiplier z (std / C), e.g.
        ``lambda z: run_event(gaussian_step_event(z, q=q), steps)``; more noise must never
        cost more privacy.
      epsilon: the target ε > 0; ``math.inf`` returns 0.0 (no noise).
      delta: the δ in (0, 1) of the guarantee.
      relation, accountant, pld_discretization: as in :class:`~pavejax.accounting.Ledger`; the
        returned z meets the target in a ledger built with these.
      lo, hi: initial guesses around the answer (widened as needed: hi doubles up to 1e4, lo
        halves).
      rtol: relative tolerance: the result z is feasible and ``z * (1 - rtol)`` is not.

    Returns z as a float. Raises ``ValueError`` for a bad target, an event the accountant cannot
    analyse under ``relation`` (the message says what to use instead), or when even z = 1e4
    does not meet the target.

    Method: Brent's method on log ε(z) = log epsilon over log z (few accountant calls); the
    answer is the smallest feasible z it evaluated. Every accountant call is memoised. Under
    PLD, a run of
    unsampled Gaussian queries first tries the exact Gaussian mechanism's z (pessimistic PLD
    never needs less noise; if a hair above it is feasible, it is the answer to within rtol),
    and a finer grid than 1e-3 is searched around the answer on the 1e-3 grid (a tenth of the
    cost per call, and PLD's pessimistic rounding only overstates ε on a coarser grid).

    Example:
        >>> from pavejax.accounting import gaussian_step_event, run_event
        >>> z = calibrate(lambda z: run_event(gaussian_step_event(z, q=0.01), 1000), 2.0, 1e-5)
        >>> round(z, 2)
        1.02
    """
    epsilon = _check_epsilon_target(epsilon)
    delta = _check_delta(delta)
    rel, name = Relation.parse(relation), _check_accountant(accountant)
    disc = _check_epsilon("pld_discretization", pld_discretization)
    lo, hi, rtol = _check_bracket(lo, hi, rtol)
    if math.isinf(epsilon):
        return 0.0
    probe = make_event(hi)
    if not isinstance(probe, dp_event.DpEvent):
        raise TypeError(f"make_event must return a dp_accounting.DpEvent, got "
                        f"{type(probe).__name__}")
    _ensure_supported(_fresh_accountant(name, rel, disc),
                      _for_accountant(probe, rel, name))  # fails fast, with the reason

    def eps(z: float) -> float:
        return _epsilon(make_event(z), delta, rel, name, disc)

    if name == "pld":
        exact = _exact_gaussian_noise(make_event, epsilon, delta, rel)
        if exact is not None:
            z = exact * (1.0 + rtol / 4)
            if eps(z) <= epsilon:
                return z  # the answer lies in [exact, z]
            lo, hi = z, max(hi, 2 * z)
        elif disc < _COARSE_PLD:
            coarse = calibrate(make_event, epsilon, delta, relation=rel, accountant=name, lo=lo,
                               hi=hi, rtol=rtol, pld_discretization=_COARSE_PLD)
            below = coarse * (1.0 - rtol / 2)
            if eps(coarse) <= epsilon and eps(below) > epsilon:
                return coarse
            lo, hi = below * (1 - 4 * rtol), coarse
    return _search(eps, epsilon, lo, hi, rtol)


def _search(eps: Callable[[float], float], epsilon: float, lo: float, hi: float,
            rtol: float) -> float:
    """Brent on log z between an infeasible ``lo`` and a feasible ``hi`` (both widened until
    they are). Brent stops with an infeasible and a feasible evaluated point within rtol/3 of
    each other in log z, so the smallest feasible z evaluated is within rtol of the boundary
    and needs no further accountant call."""
    from scipy import optimize

    while eps(hi) > epsilon:
        if hi >= _MAX_NOISE:
            raise ValueError(f"no noise multiplier <= {_MAX_NOISE:g} meets epsilon={epsilon:g} "
                             "at this delta: raise the budget, or take fewer steps or a lower "
                             "sampling rate")
        lo, hi = hi, min(2 * hi, _MAX_NOISE)
    while eps(lo) <= epsilon:
        if lo <= _MIN_NOISE:
            return lo  # (almost) no noise is needed
        lo, hi = max(lo / 2, _MIN_NOISE), lo
    log_t, feasible = math.log(epsilon), [hi]

    def gap(log_z: float) -> float:
        z = math.exp(log_z)
        e = eps(z)
        if e <= epsilon:
            feasible.append(z)
        # eps may be inf (tiny z) or 0 (huge z) at a bracket end: clamp so the log is finite.
        return math.log(min(max(e, 1e-300), 1e300)) - log_t

    optimize.brentq(gap, math.log(lo), math.log(hi), xtol=rtol / 3, rtol=4 * 2.0**-52)
    return float(min(feasible))


def calibrate_steps(step_event: dp_event.DpEvent, epsilon: float, delta: float, *,
                    relation: Relation | str = "add_remove", accountant: str = "rdp",
                    pld_discretization: float = 1e-4, max_steps: int = 2**30) -> int:
    """Largest number of steps (0 if none, at most ``max_steps``) whose run of ``step_event``
    (`run_event`) meets (``epsilon``, ``delta``) in a ledger of this relation and accountant.

    Example:
        >>> from pavejax.accounting import gaussian_step_event
        >>> calibrate_steps(gaussian_step_event(1.0, q=0.01), 2.0, 1e-5)
        881
    """
    epsilon = _check_epsilon("epsilon", epsilon)
    delta = _check_delta(delta)
    rel, name = Relation.parse(relation), _check_accountant(accountant)
    disc = _check_epsilon("pld_discretization", pld_discretization)
    max_steps = _check_count("max_steps", max_steps)
    if not isinstance(step_event, dp_event.DpEvent):
        raise TypeError(f"step_event must be a dp_accounting.DpEvent, got "
                        f"{type(step_event).__name__}")

    def eps(n: int) -> float:
        return _epsilon(dp_event.SelfComposedDpEvent(step_event, n), delta, rel, name, disc)

    if eps(1) > epsilon:
        return 0
    lo, hi = 1, min(2, max_steps)  # invariant: eps(lo) <= target; double, then bisect
    while eps(hi) <= epsilon:
        if hi == max_steps:
            return max_steps
        lo, hi = hi, min(2 * hi, max_steps)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= epsilon else (lo, mid)
    return lo
