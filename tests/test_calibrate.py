"""Tests for pavejax.accounting.calibrate and calibrate_steps.

Feasibility and tightness are checked with direct dp_accounting calls (never through the code
under test), and the full-batch Gaussian against its exact privacy profile (Balle-Wang 2018):
delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), mu = sensitivity sqrt(k) / z.
"""

import logging
import math

import dp_accounting as dpa
import pytest
from scipy import optimize, stats

from pavejax.accounting import (
    Ledger,
    calibrate,
    calibrate_steps,
    calibration as cal,
    dp_sam_step_event,
    gaussian_step_event,
    ledger as led,
    run_event,
)

DELTA = 1e-5
RTOL = 1e-3
AR, RO = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, dpa.NeighboringRelation.REPLACE_ONE


def direct_epsilon(event, relation, accountant, disc=1e-4, delta=DELTA):
    """dp_accounting's own ε of ``event``, with no pavejax translation."""
    if accountant == "rdp":
        acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    else:
        acc = dpa.pld.PLDAccountant(relation, value_discretization_interval=disc)
    return acc.compose(event).get_epsilon(delta)


def gaussian_delta(eps, mu):
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def exact_gaussian_noise(epsilon, delta, steps, sensitivity):
    """The z at which k full-batch Gaussian steps have exactly (epsilon, delta)."""
    return optimize.brentq(
        lambda z: gaussian_delta(epsilon, sensitivity * math.sqrt(steps) / z) - delta,
        1e-3, 1e3, xtol=1e-14, rtol=1e-14)


def poisson_run(q, steps):
    return lambda z: run_event(gaussian_step_event(z, q=q), steps)


def self_composed(inner, steps):
    return dpa.SelfComposedDpEvent(inner, steps)


# ------------------------------------------------------------------ feasible and tight

# name: (make_event, relation, accountant, PLD grid, z -> the event dp_accounting must see)
CASES = {
    "rdp_add_remove_poisson": (
        poisson_run(256 / 50_000, 2_000), "add_remove", "rdp", 1e-4,
        lambda z: self_composed(dpa.PoissonSampledDpEvent(256 / 50_000, dpa.GaussianDpEvent(z)),
                                2_000)),
    "rdp_replace_one_fixed": (  # RDP reads a fixed-size multiplier relative to 2C: halved
        lambda z: run_event(gaussian_step_event(z, sampling="fixed", dataset_size=1000,
                                                batch_size=100), 10),
        "replace_one", "rdp", 1e-4,
        lambda z: self_composed(dpa.SampledWithoutReplacementDpEvent(
            1000, 100, dpa.GaussianDpEvent(z / 2)), 10)),
    "pld_replace_one_poisson": (
        poisson_run(0.05, 10), "replace_one", "pld", 1e-3,
        lambda z: self_composed(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(z)), 10)),
    "pld_fine_grid_poisson": (  # below the 1e-3 grid: searched around the coarse answer
        poisson_run(0.05, 4), "add_remove", "pld", 4e-4,
        lambda z: self_composed(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(z)), 4)),
    "pld_same_mode_poisson": (  # PLD of G(z) twice on one sample = one G(z / sqrt 2)
        lambda z: run_event(dp_sam_step_event("same", z, q=0.1), 5), "add_remove", "pld", 1e-3,
        lambda z: self_composed(dpa.PoissonSampledDpEvent(
            0.1, dpa.GaussianDpEvent(z / math.sqrt(2))), 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_calibrate_is_feasible_and_tight(name):
    make_event, relation, accountant, disc, direct = CASES[name]
    rel = RO if relation == "replace_one" else AR
    target = 2.0
    z = calibrate(make_event, target, DELTA, relation=relation, accountant=accountant,
                  pld_discretization=disc)

    def eps(s):
        return direct_epsilon(direct(s), rel, accountant, disc)
    assert eps(z) <= target
    assert eps(z * (1 - 2 * RTOL)) > target


@pytest.mark.parametrize("relation,sensitivity", [("add_remove", 1.0), ("replace_one", 2.0)])
def test_full_batch_pld_agrees_with_the_exact_gaussian(relation, sensitivity, monkeypatch):
    steps, target, kw = 10, 2.0, dict(relation=relation, accountant="pld")
    exact = exact_gaussian_noise(target, DELTA, steps, sensitivity)
    z = calibrate(poisson_run(1.0, steps), target, DELTA, **kw)
    # PLD (pessimistic) never needs less noise than the exact mechanism, and is tight to rtol
    assert exact <= z <= exact * (1 + RTOL)
    # the exact-Gaussian shortcut only saves accountant calls: the general search agrees (on a
    # 1e-3 grid, which is cheaper and as tight here)
    coarse = calibrate(poisson_run(1.0, steps), target, DELTA, pld_discretization=1e-3, **kw)
    assert exact <= coarse <= exact * (1 + RTOL)
    monkeypatch.setattr(cal, "_exact_gaussian_noise", lambda *a, **k: None)
    general = calibrate(poisson_run(1.0, steps), target, DELTA, pld_discretization=1e-3, **kw)
    assert general == pytest.approx(coarse, rel=RTOL)
    assert exact <= general


def test_dp_sam_same_mode_needs_sqrt2_more_noise_than_none():
    # Two Gaussian queries of multiplier z on one Poisson sample are exactly one query of
    # multiplier z / sqrt(2) (RDP's effective multiplier): "same" needs sqrt(2) times the noise.
    q, steps = 0.05, 200
    z = {mode: calibrate(lambda s, m=mode: run_event(dp_sam_step_event(m, s, q=q), steps),
                         3.0, DELTA) for mode in ("none", "same")}
    assert z["same"] / z["none"] == pytest.approx(math.sqrt(2), rel=2 * RTOL)


def test_replace_one_needs_more_noise_than_add_remove():
    full_ar = calibrate(poisson_run(1.0, 20), 1.0, DELTA, relation="add_remove")
    full_ro = calibrate(poisson_run(1.0, 20), 1.0, DELTA, relation="replace_one")
    assert full_ro / full_ar == pytest.approx(2.0, rel=2 * RTOL)  # sensitivity 2C: twice
    # (the replace-one figure is that of the feasibility test's case: memoised)
    sub_ar = calibrate(poisson_run(0.05, 10), 2.0, DELTA, relation="add_remove",
                       accountant="pld", pld_discretization=1e-3)
    sub_ro = calibrate(poisson_run(0.05, 10), 2.0, DELTA, relation="replace_one",
                       accountant="pld", pld_discretization=1e-3)
    assert sub_ro > sub_ar * (1 + 4 * RTOL)


def test_the_initial_bracket_only_changes_the_speed():
    make_event = poisson_run(1.0, 100)
    default = calibrate(make_event, 2.0, DELTA)
    for lo, hi in ((50.0, 60.0), (1e-3, 2e-3), (0.1, 1e3)):
        assert calibrate(make_event, 2.0, DELTA, lo=lo, hi=hi) == pytest.approx(
            default, rel=RTOL)


def test_looser_rtol_is_still_feasible_and_within_it():
    make_event = poisson_run(1.0, 100)
    z = calibrate(make_event, 2.0, DELTA, rtol=0.05)

    def eps(s):
        return direct_epsilon(make_event(s), AR, "rdp")
    assert eps(z) <= 2.0 < eps(z * (1 - 2 * 0.05))


# ------------------------------------------------------------------ edges and errors


def test_infinite_epsilon_means_no_noise():
    def never(z):
        raise AssertionError("no event is needed for an infinite budget")
    assert calibrate(never, math.inf, DELTA) == 0.0


def test_infeasible_target_says_so():
    with pytest.raises(ValueError, match=r"no noise multiplier <= 10000 meets epsilon=0\.0001"):
        calibrate(poisson_run(1.0, 1000), 1e-4, DELTA)


def test_unsupported_combination_fails_fast_with_advice():
    with pytest.raises(ValueError, match=r"add_remove.*fixed-size sampling.*pld"):
        calibrate(poisson_run(0.01, 5), 2.0, DELTA, relation="replace_one", accountant="rdp")
    fixed = lambda z: gaussian_step_event(z, sampling="fixed", dataset_size=100,  # noqa: E731
                                          batch_size=10)
    with pytest.raises(ValueError, match=r"replace_one.*poisson"):
        calibrate(fixed, 2.0, DELTA)
    with pytest.raises(TypeError, match="must return a dp_accounting.DpEvent"):
        calibrate(lambda z: z, 2.0, DELTA)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0), "epsilon must be > 0"),
    (dict(epsilon=-1.0), "epsilon must be > 0"),
    (dict(epsilon=math.nan), "epsilon must be a number > 0"),
    (dict(delta=0.0), "delta must be in"),
    (dict(delta=1.0), "delta must be in"),
    (dict(rtol=0.0), r"rtol must be in \(0, 0.1\]"),
    (dict(rtol=0.5), r"rtol must be in \(0, 0.1\]"),
    (dict(lo=2.0, hi=1.0), "lo < hi"),
    (dict(lo=0.0), "lo must be a finite noise multiplier > 0"),
    (dict(accountant="moments"), "use 'pld' or 'rdp'"),
    (dict(relation="swap"), "unknown neighbouring relation"),
])
def test_bad_arguments(kwargs, match):
    args = dict(epsilon=2.0, delta=DELTA) | kwargs
    with pytest.raises(ValueError, match=match):
        calibrate(poisson_run(0.1, 10), args.pop("epsilon"), args.pop("delta"), **args)


def test_repeated_calibration_is_memoised(monkeypatch):
    make_event = poisson_run(1.0, 50)
    first = calibrate(make_event, 1.5, DELTA)
    built = []
    for module in (cal, led):
        monkeypatch.setattr(module, "_fresh_accountant", lambda *a, fresh=module._fresh_accountant,
                            **k: built.append(1) or fresh(*a, **k))
    again = calibrate(poisson_run(1.0, 50), 1.5, DELTA)  # another callable, the same run
    assert again == first
    assert len(built) == 1  # the up-front support check; every epsilon came from the memo
    # the ledger of the calibrated run, recorded step by step, finds its epsilon in the memo
    ledger = Ledger("add_remove", "rdp")
    for _ in range(50):
        ledger.record(gaussian_step_event(first, q=1.0), coalesce=True)
    assert len(built) == 2  # record's support check
    assert ledger.epsilon(DELTA) == direct_epsilon(make_event(first), AR, "rdp") <= 1.5
    assert len(built) == 2


def test_rdp_warnings_are_silenced_and_the_level_restored():
    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    logger, seen = logging.getLogger("absl"), Collect()
    before = logger.level
    logger.addHandler(seen)
    try:
        # tiny noise at a high order: RDP drops orders whose series does not converge
        calibrate(poisson_run(0.5, 3), 50.0, DELTA, lo=1e-3, hi=2e-3)
        silenced = [r for r in seen.records if r.levelno < logging.ERROR]
        led._EPSILON_MEMO.clear()
        logger.setLevel(logging.WARNING)
        calibrate(poisson_run(0.5, 3), 50.0, DELTA, lo=1e-3, hi=2e-3)
        assert logger.level == logging.WARNING  # restored, whatever it was
    finally:
        logger.removeHandler(seen)
        logger.setLevel(before)
    assert not silenced


# ------------------------------------------------------------------ calibrate_steps


def test_calibrate_steps_is_largest_within_target():
    z = 10.0
    n = calibrate_steps(gaussian_step_event(z), 2.0, DELTA, relation="replace_one")

    def eps(k):  # replace-one RDP of a full-batch Gaussian: the multiplier relative to 2C
        return direct_epsilon(self_composed(dpa.GaussianDpEvent(z / 2), k), AR, "rdp")
    assert eps(n) <= 2.0 < eps(n + 1)
    assert calibrate_steps(gaussian_step_event(0.5), 0.01, DELTA) == 0
    assert calibrate_steps(gaussian_step_event(1e3), 50.0, DELTA, max_steps=7) == 7
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        calibrate_steps(gaussian_step_event(1.0), 1.0, DELTA, max_steps=0)
    with pytest.raises(TypeError, match="step_event must be a dp_accounting.DpEvent"):
        calibrate_steps(1.0, 1.0, DELTA)
