"""Disclosure / amplification advantage bounds (Theorems 4.2, 4.3) and the per-pair TV bound."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import optimize, stats

from pavejax.accounting import calibrate, gaussian_step_event
from pavejax.accounting.pac import dp_mia_success_bound
from pavejax.accounting.risk import (
    amplification_bound,
    balanced_attack_success,
    disclosure_bound,
    risk_report,
    tv_bound,
)

# ---------------------------------------------------------------- helpers (independent of the code)


def _tv(p, q):
    return 0.5 * float(np.abs(np.asarray(p) - np.asarray(q)).sum())


def _hockey_stick(p, q, eps):
    """Smallest δ for which Pr_p[S] <= e^ε Pr_q[S] + δ for all events S."""
    return float(np.maximum(np.asarray(p) - math.exp(eps) * np.asarray(q), 0.0).sum())


def _leaky_rr(eps, delta):
    """Randomised response that leaks the input with probability δ: outcomes (leak-D, leak-D',
    say-D, say-D')."""
    keep = math.exp(eps) / (1 + math.exp(eps))
    p = np.array([delta, 0.0, (1 - delta) * keep, (1 - delta) * (1 - keep)])
    return p, p[[1, 0, 3, 2]]


def _analytic_gaussian_sigma(eps, delta):
    """σ of the exactly calibrated Gaussian mechanism, sensitivity 1 (Balle & Wang 2018)."""
    def excess(s):
        return (stats.norm.cdf(0.5 / s - eps * s)
                - math.exp(eps) * stats.norm.cdf(-0.5 / s - eps * s) - delta)
    return optimize.brentq(excess, 1e-3, 1e3, xtol=1e-12)


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("eps,delta,disclosure,tv", [
    (0.0, 0.0, 0.0, 0.0),
    (math.log(1.5), 0.1, 0.6, 0.28),  # 0.5 + 0.1; (0.5 + 0.2)/2.5
    (math.log(3.0), 0.01, 1.0, 0.505),  # 2.01 capped; (2 + 0.02)/4
    (0.1, 1e-5, 0.10518091807565, 0.10519091807565 / 2.10517091807565),
])
def test_closed_forms(eps, delta, disclosure, tv):
    assert disclosure_bound(eps, delta) == pytest.approx(disclosure, abs=1e-12)
    assert amplification_bound(eps, delta) == pytest.approx(disclosure, abs=1e-12)
    assert tv_bound(eps, delta) == pytest.approx(tv, abs=1e-12)


def test_balanced_success():
    assert balanced_attack_success(0.0) == 0.5
    assert balanced_attack_success(1.0) == 1.0
    assert balanced_attack_success(0.505) == pytest.approx(0.7525)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        balanced_attack_success(1.2)


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 0.05])
def test_balanced_tv_bound_equals_the_dp_membership_inference_bound(eps, delta):
    # two derivations of the same quantity: 1 - (1 - δ)/(1 + e^ε) from the PAC module
    assert balanced_attack_success(tv_bound(eps, delta)) == pytest.approx(
        dp_mia_success_bound(eps, delta), rel=1e-12)


def test_vacuity_and_large_epsilon():
    delta = 1e-5
    edge = math.log(2 - delta)  # where (e^ε - 1) + δ reaches 1
    assert not risk_report(edge - 1e-6, delta)["disclosure_vacuous"]
    assert risk_report(edge + 1e-6, delta)["disclosure_vacuous"]
    assert risk_report(0.5, delta)["disclosure_bound"] == pytest.approx(0.64873, abs=1e-5)
    assert disclosure_bound(1.0, delta) == 1.0  # 1.72 before capping
    assert disclosure_bound(1000.0, delta) == 1.0
    assert tv_bound(1000.0, delta) == 1.0  # no overflow; TV < 1 only by rounding


@settings(max_examples=200, deadline=None)
@given(eps=st.floats(0.0, 50.0), delta=st.floats(0.0, 0.999), bump=st.floats(0.0, 5.0))
def test_tv_bound_never_exceeds_disclosure_bound(eps, delta, bump):
    tv = tv_bound(eps, delta)
    assert 0.0 <= tv <= disclosure_bound(eps, delta) <= 1.0
    assert tv <= math.expm1(eps) + delta  # also below the uncapped η
    assert tv_bound(eps + bump, delta) >= tv - 1e-12  # monotone in ε


# ---------------------------------------------------------------- empirical checks


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0, 4.0])
def test_gaussian_mechanism_tv_is_below_the_bound(eps):
    delta = 1e-5
    for sigma in (calibrate(gaussian_step_event, eps, delta),  # RDP calibration (looser)
                  _analytic_gaussian_sigma(eps, delta)):        # exact calibration
        assert sigma > 0
        tv = 2 * stats.norm.cdf(1 / (2 * sigma)) - 1  # TV(N(0, σ²), N(1, σ²))
        assert tv <= tv_bound(eps, delta)


@pytest.mark.parametrize("eps,delta", [(0.0, 0.0), (0.5, 1e-3), (2.0, 0.05), (5.0, 0.2)])
def test_tv_bound_is_attained_by_leaky_randomised_response(eps, delta):
    p, q = _leaky_rr(eps, delta)
    assert _hockey_stick(p, q, eps) <= delta + 1e-12  # (ε, δ)-DP, both directions
    assert _hockey_stick(q, p, eps) <= delta + 1e-12
    assert _tv(p, q) == pytest.approx(tv_bound(eps, delta), abs=1e-12)


def _conditional_release(rng, n_views, eps, delta):
    """For each prior view u, a random (ε, δ)-DP pair of release distributions over 4 outcomes."""
    b_out = rng.uniform(0.05, 0.95, size=n_views)
    e = math.exp(eps)
    lo = np.maximum(b_out / e, 1 - (1 - b_out) * e)
    hi = np.minimum(b_out * e, 1 - (1 - b_out) / e)
    b_in = rng.uniform(lo, hi)
    r_in = np.stack([np.full(n_views, delta), np.zeros(n_views),
                     (1 - delta) * b_in, (1 - delta) * (1 - b_in)], axis=1)
    r_out = np.stack([np.zeros(n_views), np.full(n_views, delta),
                      (1 - delta) * b_out, (1 - delta) * (1 - b_out)], axis=1)
    return r_in, r_out


@pytest.mark.parametrize("eps,delta", [(0.05, 1e-3), (0.3, 0.01), (0.6, 0.02)])
def test_release_raises_advantage_by_at_most_eta(eps, delta):
    # Lemma 4.1 behind Theorems 4.2 (H = prior view) and 4.3 (H = the model): exact TVs of
    # random discrete (H, R) joints where R is (ε, δ)-DP given H.
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(500):
        n_views = int(rng.integers(1, 6))
        h_in, h_out = rng.dirichlet(np.ones(n_views)), rng.dirichlet(np.ones(n_views))
        r_in, r_out = _conditional_release(rng, n_views, eps, delta)
        for u in range(n_views):
            assert _hockey_stick(r_in[u], r_out[u], eps) <= delta + 1e-12
            assert _hockey_stick(r_out[u], r_in[u], eps) <= delta + 1e-12
        gain = _tv(h_in[:, None] * r_in, h_out[:, None] * r_out) - _tv(h_in, h_out)
        assert gain <= disclosure_bound(eps, delta) + 1e-12
        assert gain <= amplification_bound(eps, delta) + 1e-12
        worst = max(worst, gain)
    assert worst > 0.8 * tv_bound(eps, delta)  # the instances are not trivially slack


# ---------------------------------------------------------------- the report and validation


def test_risk_report_is_json_safe_and_consistent():
    report = risk_report(0.3, 1e-5)
    parsed = json.loads(json.dumps(report, allow_nan=False))
    assert parsed == report
    assert report["disclosure_bound"] == disclosure_bound(0.3, 1e-5)
    assert report["amplification_bound"] == amplification_bound(0.3, 1e-5)
    assert report["tv_bound"] == tv_bound(0.3, 1e-5)
    assert report["balanced_success_bound"] == pytest.approx((1 + report["tv_bound"]) / 2)
    assert report["disclosure_vacuous"] is False


@pytest.mark.parametrize("eps,delta,exc,match", [
    (-0.1, 1e-5, ValueError, "epsilon must be a finite number >= 0"),
    (math.inf, 1e-5, ValueError, "epsilon must be a finite number"),
    (math.nan, 1e-5, ValueError, "epsilon must be a finite number"),
    (1.0, 1.0, ValueError, r"delta must be in \[0, 1\)"),
    (1.0, -1e-9, ValueError, r"delta must be in \[0, 1\)"),
    (True, 1e-5, TypeError, "epsilon must be a real number"),
    (1.0, "0.1", TypeError, "delta must be a real number"),
])
def test_bad_inputs(eps, delta, exc, match):
    for fn in (disclosure_bound, amplification_bound, tv_bound, risk_report):
        with pytest.raises(exc, match=match):
            fn(eps, delta)
