"""Tests for pavejax.accounting: Ledger, event builders, calibration, JSON round trip.

Reference values come from direct dp_accounting calls, published anchors, closed forms for the
Gaussian mechanism (RDP of Mironov 2017 with the RDP->DP conversion of Canonne-Kamath-Steinke 2020;
the exact privacy profile of Balle-Wang 2018), never from the code under test.
"""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import optimize, stats

from pavejax.accounting import (
    BudgetExceededError,
    Ledger,
    Relation,
    calibrate_noise,
    calibrate_steps,
    dp_sgd_event,
    event_from_json,
    event_to_json,
    gaussian_step_event,
)

DELTA = 1e-5
ANCHOR_Q, ANCHOR_STEPS = 256 / 50_000, 2_000
RO = dpa.NeighboringRelation.REPLACE_ONE
# dp-accounting 0.6's documented default RDP orders.
ORDERS = np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 64), [128, 256, 512, 1024]])


def gaussian_rdp_epsilon(rho: float, delta: float) -> float:
    """ε of a Gaussian with RDP(α) = α·ρ, ρ = Σ Δ²/(2σ²), via the improved RDP->DP conversion."""
    a = ORDERS.astype(np.float64)
    eps = a * rho + np.log1p(-1.0 / a) - np.log(delta * a) / (a - 1.0)
    return float(max(0.0, eps.min()))


def gaussian_exact_epsilon(mu: float, delta: float) -> float:
    """Exact ε(δ) of a Gaussian mechanism with sensitivity/std ratio ``mu`` (Balle-Wang 2018)."""
    def gap(e):
        return (stats.norm.cdf(-e / mu + mu / 2)
                - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta)
    return optimize.brentq(gap, 0.0, 100.0, xtol=1e-12)


def direct_epsilon(event, accountant, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                   pld_discretization=1e-4):
    if accountant == "rdp":
        acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    else:
        acc = dpa.pld.PLDAccountant(relation, value_discretization_interval=pld_discretization)
    return acc.compose(event).get_epsilon(DELTA)


# ---------------------------------------------------------------- anchors


ANCHOR_EVENT = dpa.SelfComposedDpEvent(
    dpa.PoissonSampledDpEvent(ANCHOR_Q, dpa.GaussianDpEvent(1.0)), ANCHOR_STEPS)


def test_anchor_rdp_matches_direct_dp_accounting():
    ledger = Ledger("add_remove", "rdp")
    ledger.record(dp_sgd_event(1.0, q=ANCHOR_Q, steps=ANCHOR_STEPS), label="train")
    assert ledger.epsilon(DELTA) == pytest.approx(direct_epsilon(ANCHOR_EVENT, "rdp"), rel=1e-12)
    assert ledger.epsilon(DELTA) == pytest.approx(1.486, abs=5e-3)


def test_anchor_pld_matches_direct_dp_accounting():
    ledger = Ledger("add_remove", "pld")
    ledger.record(dp_sgd_event(1.0, q=ANCHOR_Q, steps=ANCHOR_STEPS), label="train")
    assert ledger.epsilon(DELTA) == pytest.approx(1.240, abs=5e-3)  # default discretisation
    coarse = Ledger("add_remove", "pld", pld_discretization=1e-3).merge(ledger)
    direct = direct_epsilon(ANCHOR_EVENT, "pld", pld_discretization=1e-3)
    assert coarse.epsilon(DELTA) == pytest.approx(direct, rel=1e-12)


def test_entries_compose_like_one_long_run():
    step = gaussian_step_event(1.0, q=ANCHOR_Q)
    split = Ledger("add_remove", "rdp")
    split.record(step, 1_500, label="a")
    split.record(dp_sgd_event(1.0, q=ANCHOR_Q, steps=500), label="b")
    whole = direct_epsilon(dpa.SelfComposedDpEvent(step, ANCHOR_STEPS), "rdp")
    assert split.epsilon(DELTA) == pytest.approx(whole, rel=1e-12)
    by_label = split.epsilon_by_label(DELTA)
    assert by_label["a"] == pytest.approx(
        direct_epsilon(dpa.SelfComposedDpEvent(step, 1_500), "rdp"), rel=1e-12)
    assert by_label["b"] < by_label["a"] < split.epsilon(DELTA)


def test_per_step_entries_give_the_accountants_self_composition(monkeypatch):
    """A training records one entry per step. The ledger hands a run of equal events to the
    accountant as one (event, count): dp-accounting's own answer for ``compose(event, T)``, and
    one privacy-loss distribution built instead of T."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    step = gaussian_step_event(1.3, q=0.25)
    other = gaussian_step_event(2.0, q=0.25)
    per_step = Ledger("replace_one", "pld", pld_discretization=1e-3)
    for _ in range(6):
        per_step.record(step, label="train")
    per_step.record(other, 2, label="spec")
    direct = dpa.pld.PLDAccountant(RO, value_discretization_interval=1e-3)
    direct.compose(step, 6)
    direct.compose(other, 2)
    builds = []
    init = plm.GaussianPrivacyLoss.__init__
    monkeypatch.setattr(plm.GaussianPrivacyLoss, "__init__",
                        lambda self, *a, **k: builds.append(1) or init(self, *a, **k))
    assert per_step.epsilon(DELTA) == direct.get_epsilon(DELTA)
    assert len(builds) == 2  # one per distinct event, not one per step
    # a different event in between breaks the run: still the composition of all eight steps
    mixed = Ledger("replace_one", "pld", pld_discretization=1e-3)
    for event in (step, step, other, step, step, step, step, other):
        mixed.record(event)
    assert mixed.epsilon(DELTA) == pytest.approx(direct.get_epsilon(DELTA), rel=1e-6)


# ---------------------------------------------------------------- relations and closed forms

T, SIGMA = 100, 10.0


def test_rdp_replace_one_full_batch_uses_doubled_sensitivity():
    ledger = Ledger("replace_one", "rdp")
    ledger.record(dp_sgd_event(SIGMA, steps=T))
    eps = ledger.epsilon(DELTA)
    closed = 2 * T / SIGMA**2 + 2 * math.sqrt(2 * T * math.log(1 / DELTA)) / SIGMA
    # The closed form uses the classic RDP conversion; dp-accounting's improved one is ~7% lower.
    assert 0.9 * closed <= eps <= closed
    assert eps == pytest.approx(gaussian_rdp_epsilon(2 * T / SIGMA**2, DELTA), rel=1e-9)


def test_rdp_add_remove_full_batch_closed_form():
    ledger = Ledger("add_remove", "rdp")
    ledger.record(dp_sgd_event(SIGMA, steps=T))
    eps = ledger.epsilon(DELTA)
    closed = T / (2 * SIGMA**2) + math.sqrt(2 * T * math.log(1 / DELTA)) / SIGMA
    assert 0.85 * closed <= eps <= closed
    assert eps == pytest.approx(gaussian_rdp_epsilon(T / (2 * SIGMA**2), DELTA), rel=1e-9)


@pytest.mark.parametrize("relation,mu", [("replace_one", 2.0), ("add_remove", 1.0)])
def test_pld_full_batch_matches_exact_gaussian(relation, mu):
    # T Gaussian steps with sensitivity Δ and std σ are one Gaussian with Δ√T/σ = mu.
    ledger = Ledger(relation, "pld", pld_discretization=1e-3)
    ledger.record(dp_sgd_event(SIGMA, steps=T))
    pld = ledger.epsilon(DELTA)
    assert pld == pytest.approx(gaussian_exact_epsilon(mu, DELTA), rel=1e-3)
    assert pld <= ledger.epsilon(DELTA, accountant="rdp")


def test_replace_one_fixed_size_full_sample_equals_bare_gaussian():
    ledger = Ledger("replace_one", "rdp")
    ledger.record(dpa.SampledWithoutReplacementDpEvent(100, 100, dpa.GaussianDpEvent(4.0)))
    assert ledger.epsilon(DELTA) == pytest.approx(gaussian_rdp_epsilon(2 / 4.0**2, DELTA),
                                                  rel=1e-9)


def test_replace_one_fixed_size_subsampling_amplifies():
    sub = Ledger("replace_one", "rdp")
    sub.record(dp_sgd_event(4.0, steps=10, sampling="fixed", dataset_size=1000, batch_size=100))
    eps = sub.epsilon(DELTA)
    assert 0.0 < eps < gaussian_rdp_epsilon(2 * 10 / 4.0**2, DELTA)  # below full batch
    halved = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(1000, 100, dpa.GaussianDpEvent(2.0)), 10)
    assert eps == pytest.approx(direct_epsilon(halved, "rdp", RO), rel=1e-12)


def test_rdp_replace_one_refuses_poisson():
    ledger = Ledger("replace_one", "rdp")
    poisson = dp_sgd_event(1.0, q=0.01, steps=5)
    with pytest.raises(ValueError, match=r"add_remove.*fixed-size sampling.*pld"):
        ledger.record(poisson)
    with pytest.raises(ValueError, match="Poisson sampling under replace-one"):
        ledger.record(dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.0), poisson]))
    with pytest.raises(ValueError, match="add_remove"):
        calibrate_noise(2.0, DELTA, q=0.01, steps=5, relation="replace_one", accountant="rdp")
    pld_ledger = Ledger("replace_one", "pld")  # PLD analyses it, so the same event is fine there
    pld_ledger.record(poisson)
    with pytest.raises(ValueError, match="add_remove"):
        pld_ledger.epsilon(DELTA, accountant="rdp")


def test_unsupported_sampling_refused_with_advice():
    fixed = dp_sgd_event(2.0, steps=3, sampling="fixed", dataset_size=100, batch_size=10)
    with pytest.raises(ValueError, match=r"replace_one.*poisson"):
        Ledger("add_remove", "rdp").record(fixed)
    with pytest.raises(ValueError, match=r"PLD.*accountant='rdp'"):
        Ledger("replace_one", "pld").record(fixed)
    with_repl = dpa.SampledWithReplacementDpEvent(100, 10, dpa.GaussianDpEvent(2.0))
    for rel, acc in [("add_remove", "rdp"), ("add_remove", "pld"), ("replace_one", "pld")]:
        with pytest.raises(ValueError, match="sampling with replacement"):
            Ledger(rel, acc).record(with_repl)


def test_summary_reports_both_accountants_and_reasons():
    ledger = Ledger("replace_one", "rdp", pld_discretization=1e-3)
    ledger.record(dp_sgd_event(SIGMA, steps=T), label="spec")
    s = ledger.summary(DELTA)
    assert s["relation"] == "replace_one" and s["num_entries"] == 1 and s["delta"] == DELTA
    assert s["epsilon"]["pld"] < s["epsilon"]["rdp"]
    fixed = Ledger("replace_one", "rdp")
    fixed.record(dp_sgd_event(4.0, steps=2, sampling="fixed", dataset_size=100, batch_size=10))
    s = fixed.summary(DELTA)
    assert s["epsilon"]["pld"] is None and "PLD" in s["unsupported"]["pld"]
    assert s["epsilon"]["rdp"] > 0


def test_empty_and_non_private_ledgers():
    for acc in ("rdp", "pld"):
        empty = Ledger("add_remove", acc)
        assert empty.epsilon(DELTA) == 0.0 and empty.delta(1.0) == 0.0
    leaky = Ledger("add_remove", "rdp")
    leaky.record(dp_sgd_event(0.0, q=0.5, steps=3))
    assert leaky.entries[0].event == dpa.SelfComposedDpEvent(dpa.NonPrivateDpEvent(), 3)
    assert math.isinf(leaky.epsilon(DELTA)) and math.isinf(leaky.epsilon(DELTA, "pld"))


def test_delta_inverts_epsilon():
    ledger = Ledger("add_remove", "pld")
    ledger.record(dp_sgd_event(SIGMA, steps=T))
    eps = gaussian_exact_epsilon(1.0, DELTA)
    assert ledger.delta(eps) == pytest.approx(DELTA, rel=1e-2)


# ---------------------------------------------------------------- builders and relation


def test_event_builders_structure():
    assert gaussian_step_event(2.0) == dpa.GaussianDpEvent(2.0)
    assert gaussian_step_event(2.0, q=0.25) == dpa.PoissonSampledDpEvent(
        0.25, dpa.GaussianDpEvent(2.0))
    assert gaussian_step_event(2.0, sampling="fixed", dataset_size=40, batch_size=10) == (
        dpa.SampledWithoutReplacementDpEvent(40, 10, dpa.GaussianDpEvent(2.0)))
    assert gaussian_step_event(2.0, dataset_size=40, batch_size=10) == (
        dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(2.0)))
    assert gaussian_step_event(0) == dpa.NonPrivateDpEvent()
    assert dp_sgd_event(2.0, q=1.0, steps=7) == dpa.SelfComposedDpEvent(
        dpa.GaussianDpEvent(2.0), 7)


def test_relation_parsing():
    assert Relation.parse("add_remove") is Relation.ADD_REMOVE
    assert Relation.parse("REPLACE_ONE") is Relation.REPLACE_ONE
    assert Relation.parse(RO) is Relation.REPLACE_ONE
    assert Relation.REPLACE_ONE.neighboring_relation is RO
    assert Ledger(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE).relation is Relation.ADD_REMOVE
    with pytest.raises(ValueError, match="'add_remove' or 'replace_one'"):
        Relation.parse(dpa.NeighboringRelation.REPLACE_SPECIAL)
    with pytest.raises(ValueError, match="unknown neighbouring relation"):
        Ledger("swap")


# ---------------------------------------------------------------- calibration


def test_calibrate_noise_rdp_anchor():
    sigma = calibrate_noise(8.0, DELTA, q=ANCHOR_Q, steps=ANCHOR_STEPS)
    assert sigma == pytest.approx(0.5632, abs=5e-4)

    def eps(s):
        return direct_epsilon(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(ANCHOR_Q, dpa.GaussianDpEvent(s)), ANCHOR_STEPS), "rdp")
    assert eps(sigma) <= 8.0 < eps(0.99 * sigma)


def test_calibrate_noise_replace_one_full_batch_closed_form():
    sigma = calibrate_noise(2.0, DELTA, q=1.0, steps=10, relation="replace_one")
    assert gaussian_rdp_epsilon(2 * 10 / sigma**2, DELTA) <= 2.0 + 1e-12
    assert gaussian_rdp_epsilon(2 * 10 / (0.99 * sigma) ** 2, DELTA) > 2.0


def test_calibrate_noise_pld_poisson():
    kw = dict(q=0.01, steps=20)  # coarse discretisation keeps this cheap
    sigma = calibrate_noise(3.0, DELTA, **kw, accountant="pld", pld_discretization=1e-2)

    def eps(s):
        return direct_epsilon(dp_sgd_event(s, **kw), "pld", pld_discretization=1e-2)
    assert eps(sigma) <= 3.0 < eps(0.99 * sigma)


@pytest.mark.parametrize("relation,sensitivity", [("add_remove", 1.0), ("replace_one", 2.0)])
def test_calibrate_noise_pld_full_batch_exact_gaussian(relation, sensitivity):
    sigma = calibrate_noise(2.0, DELTA, q=1.0, steps=10, relation=relation, accountant="pld",
                            pld_discretization=1e-3)
    mu = sensitivity * math.sqrt(10) / sigma
    assert gaussian_exact_epsilon(mu, DELTA) == pytest.approx(2.0, rel=2e-3)
    rdp_sigma = calibrate_noise(2.0, DELTA, q=1.0, steps=10, relation=relation)
    assert sigma < rdp_sigma  # PLD is tighter than RDP


def _unbracketed_pld(target, delta, relation, disc=1e-3, **kw):
    """dp-accounting's own search from (0, 1) at discretisation ``disc``, without pavejax's
    bracket."""
    rel = Relation.parse(relation).neighboring_relation
    return dpa.calibrate_dp_mechanism(
        lambda: dpa.pld.PLDAccountant(rel, value_discretization_interval=disc),
        lambda s: dp_sgd_event(s, **kw), target, delta)


def test_pld_fine_grid_calibration_from_the_coarse_bracket(monkeypatch):
    """Below a 1e-3 grid, a subsampled calibration searches below the coarse grid's answer: the
    result is dp-accounting's own search at the fine grid, it meets the target on that grid and
    is tight; a coarse bracket without the root falls back to the full search."""
    from dp_accounting import mechanism_calibration as mc

    from pavejax.accounting import ledger as ledger_mod

    kw, relation, target = dict(q=0.05, steps=10), "replace_one", 1.0
    sigma = calibrate_noise(target, DELTA, relation=relation, accountant="pld",
                            pld_discretization=4e-4, **kw)
    assert sigma == pytest.approx(_unbracketed_pld(target, DELTA, relation, disc=4e-4, **kw),
                                  abs=5e-6)
    for s, ok in ((sigma, True), (sigma - 1e-4, False)):
        ledger = Ledger(relation, "pld", pld_discretization=4e-4)
        ledger.record(dp_sgd_event(s, **kw))
        assert (ledger.epsilon(DELTA) <= target) is ok
    monkeypatch.setattr(ledger_mod, "_coarse_pld_bracket",
                        lambda *a, **k: mc.ExplicitBracketInterval(50.0, 60.0))  # no root inside
    assert calibrate_noise(target, DELTA, relation=relation, accountant="pld",
                           pld_discretization=4e-4, **kw) == pytest.approx(sigma, abs=5e-6)


@pytest.mark.parametrize("relation,kw", [
    ("replace_one", dict(q=1.0, steps=1)),
    ("add_remove", dict(q=1.0, steps=7)),
    ("add_remove", dict(q=0.05, steps=10)),
])
def test_pld_calibration_bracket_gives_the_unbracketed_answer(relation, kw):
    # the bracket only speeds the search: the result is dp-accounting's own within its tolerance
    sigma = calibrate_noise(4.0, DELTA, relation=relation, accountant="pld",
                            pld_discretization=1e-3, **kw)
    assert sigma == pytest.approx(_unbracketed_pld(4.0, DELTA, relation, **kw), abs=5e-6)


def test_pld_calibration_survives_a_bad_bracket(monkeypatch):
    from dp_accounting import mechanism_calibration as mc

    from pavejax.accounting import ledger as ledger_mod

    kw = dict(q=0.05, steps=4, accountant="pld", pld_discretization=1e-3)
    good = calibrate_noise(2.0, DELTA, **kw)
    monkeypatch.setattr(ledger_mod, "_pld_bracket",
                        lambda *a, **k: mc.ExplicitBracketInterval(50.0, 60.0))  # no root inside
    assert calibrate_noise(2.0, DELTA, **kw) == pytest.approx(good, abs=5e-6)


def test_pld_full_batch_shortcut_survives_a_wrong_closed_form(monkeypatch):
    # if the exact-Gaussian guess were wrong (here: half the noise), the candidates fail the PLD
    # check and the bracket does not bracket: the search from scratch still finds the answer
    from pavejax.accounting import ledger as ledger_mod

    kw = dict(q=1.0, steps=3, accountant="pld", pld_discretization=1e-3)
    good = calibrate_noise(2.0, DELTA, **kw)
    exact = ledger_mod._full_batch_gaussian_sigma
    monkeypatch.setattr(ledger_mod, "_full_batch_gaussian_sigma",
                        lambda *a, **k: 0.5 * exact(*a, **k))
    assert calibrate_noise(2.0, DELTA, **kw) == pytest.approx(good, abs=5e-6)
    mu = 1.0 * math.sqrt(3) / good
    assert gaussian_exact_epsilon(mu, DELTA) <= 2.0 + 1e-12  # PLD never claims less than exact


def test_pld_full_batch_replace_one_bracket_is_narrow(monkeypatch):
    """At a small delta the three exact-Gaussian candidates fail the PLD check (discretisation
    costs more than 5e-7 of sigma), so the search runs in the bracket built around the exact
    Gaussian sigma. That bracket is only a speed-up, so only the accountant's work shows it:
    3 candidates + 5 PLD evaluations in it. Without the exact sigma (bracket [hi/2, hi] from
    RDP) the search takes 12, from a lower start 11, from scratch 19."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    kw = dict(q=1.0, steps=10, relation="replace_one", accountant="pld", pld_discretization=1e-3)
    target, delta = 1.0, 1e-10
    builds = []
    init = plm.GaussianPrivacyLoss.__init__
    monkeypatch.setattr(plm.GaussianPrivacyLoss, "__init__",
                        lambda self, *a, **k: builds.append(1) or init(self, *a, **k))
    sigma = calibrate_noise(target, delta, **kw)
    assert 3 < len(builds) <= 8  # past the shortcut, and narrow
    monkeypatch.undo()

    def eps(s):
        ledger = Ledger("replace_one", "pld", pld_discretization=1e-3)
        ledger.record(dp_sgd_event(s, steps=10, q=1.0))
        return ledger.epsilon(delta)
    assert eps(sigma) <= target < eps(0.99 * sigma)


def test_calibrated_noise_passes_budget_check():
    sigma = calibrate_noise(1.0, DELTA, q=1.0, steps=20)
    ledger = Ledger("add_remove", "rdp")
    ledger.record(dp_sgd_event(sigma, steps=20), label="model")
    assert ledger.check_budget(1.0, DELTA) <= 1.0
    with pytest.raises(BudgetExceededError, match="would exceed"):
        ledger.check_budget(1.0, DELTA, pending=gaussian_step_event(sigma))
    assert len(ledger) == 1  # the pending event was not recorded


def test_calibrate_steps_is_largest_within_target():
    n = calibrate_steps(2.0, DELTA, noise_multiplier=SIGMA, relation="replace_one")
    assert gaussian_rdp_epsilon(2 * n / SIGMA**2, DELTA) <= 2.0
    assert gaussian_rdp_epsilon(2 * (n + 1) / SIGMA**2, DELTA) > 2.0
    assert calibrate_steps(0.01, DELTA, noise_multiplier=0.5) == 0


# ---------------------------------------------------------------- JSON

NESTED = [
    dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(256 / 50_000, dpa.GaussianDpEvent(1 / 3)),
                            2_000),
    dpa.ComposedDpEvent([dpa.GaussianDpEvent(0.1 + 0.2), dpa.NonPrivateDpEvent(),
                         dpa.ComposedDpEvent([dpa.NoOpDpEvent(), dpa.LaplaceDpEvent(5e-324)])]),
    dpa.SampledWithoutReplacementDpEvent(60_000, 256, dpa.GaussianDpEvent(1.1)),
    dpa.ComposedDpEvent((dpa.GaussianDpEvent(2.0), dpa.ZCDpEvent(rho=math.inf))),
    dpa.NonPrivateDpEvent(),
]


@pytest.mark.parametrize("event", NESTED)
def test_event_json_round_trip_exact(event):
    text = event_to_json(event)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = event_from_json(text)
    assert back == event and type(back) is type(event)


def test_event_json_floats_bit_exact():
    x = 0.1 + 0.2
    back = event_from_json(event_to_json(dpa.GaussianDpEvent(x)))
    assert back.noise_multiplier.hex() == x.hex()


@pytest.mark.parametrize("text", [
    '{"__class__": "Ledger"}',
    '{"__class__": "DpEvent"}',
    '{"__class__": "os.system", "command": "true"}',
    '{"__class__": "SelfComposedDpEvent", "count": 2, "event": {"__class__": "Popen"}}',
])
def test_event_json_refuses_unknown_classes(text):
    with pytest.raises(ValueError, match="unknown event class"):
        event_from_json(text)


def test_event_json_refuses_unknown_fields_and_plain_objects():
    with pytest.raises(ValueError, match="has no field"):
        event_from_json('{"__class__": "GaussianDpEvent", "noise_multiplier": 1.0, "x": 1}')
    with pytest.raises(ValueError, match="__class__"):
        event_from_json('{"noise_multiplier": 1.0}')
    with pytest.raises(TypeError, match="DpEvent"):
        event_to_json("GaussianDpEvent(1.0)")


def test_ledger_json_round_trip():
    ledger = Ledger("replace_one", "rdp", pld_discretization=1e-3)
    ledger.record(dp_sgd_event(1 / 3, steps=7), label="spec")
    ledger.record(dpa.ComposedDpEvent([dpa.GaussianDpEvent(0.1 + 0.2), dpa.NoOpDpEvent()]),
                  count=2, label="model")
    back = Ledger.from_json(ledger.to_json())
    assert back == ledger
    assert [(e.label, e.count) for e in back.entries] == [("spec", 1), ("model", 2)]
    assert back.epsilon(DELTA) == ledger.epsilon(DELTA)
    with pytest.raises(ValueError, match="not a pavejax ledger"):
        Ledger.from_json('{"format": "pickle"}')


# ---------------------------------------------------------------- merging and budget


def test_merge_same_relation_and_refuse_different():
    a, b = Ledger("add_remove", "rdp"), Ledger("add_remove", "rdp")
    a.record(dp_sgd_event(1.0, q=0.01, steps=100), label="a")
    b.record(dp_sgd_event(1.0, q=0.01, steps=300), label="b")
    merged = a.merge(b)
    assert len(a) == 1 and len(b) == 1 and len(merged) == 2
    assert merged.epsilon(DELTA) == pytest.approx(direct_epsilon(dp_sgd_event(
        1.0, q=0.01, steps=400), "rdp"), rel=1e-12)
    with pytest.raises(ValueError, match="different neighbouring relations"):
        a.compose(Ledger("replace_one", "rdp"))


def test_budget_check_raises_when_spent():
    ledger = Ledger("add_remove", "rdp")
    ledger.record(dp_sgd_event(SIGMA, steps=T))
    spent = ledger.check_budget(10.0, DELTA)
    assert spent == pytest.approx(gaussian_rdp_epsilon(T / (2 * SIGMA**2), DELTA), rel=1e-9)
    with pytest.raises(BudgetExceededError, match=r"budget already spent: ε=4\.7\d* > target 1"):
        ledger.check_budget(1.0, DELTA)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta must be"):
        Ledger().epsilon(delta)
    with pytest.raises(ValueError, match="delta must be"):
        calibrate_noise(1.0, delta, q=0.1, steps=10)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_bad_q(q):
    with pytest.raises(ValueError, match=r"q \(sampling probability\) must be in \(0, 1\]"):
        gaussian_step_event(1.0, q=q)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        calibrate_noise(1.0, DELTA, q=q, steps=10)


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_bad_steps(steps):
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        dp_sgd_event(1.0, q=0.1, steps=steps)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        calibrate_noise(1.0, DELTA, q=0.1, steps=steps)


def test_bad_noise_and_events_and_counts():
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        gaussian_step_event(-1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number"):
        dp_sgd_event(math.inf, steps=2)
    ledger = Ledger()
    with pytest.raises(TypeError, match="event must be a dp_accounting.DpEvent"):
        ledger.record({"noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        ledger.record(gaussian_step_event(1.0), count=0)
    with pytest.raises(TypeError, match="label must be a string"):
        ledger.record(gaussian_step_event(1.0), label=3)
    assert len(ledger) == 0  # failed records leave no trace


def test_bad_epsilons_accountants_and_sampling_sizes():
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        Ledger().delta(0.0)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        calibrate_noise(-1.0, DELTA, q=0.1, steps=3)
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        Ledger().check_budget(0.0, DELTA)
    with pytest.raises(ValueError, match="use 'pld' or 'rdp'"):
        Ledger(accountant="moments")
    with pytest.raises(ValueError, match="use 'pld' or 'rdp'"):
        Ledger().epsilon(DELTA, accountant="gdp")
    with pytest.raises(ValueError, match="needs dataset_size and batch_size"):
        gaussian_step_event(1.0, q=0.1, sampling="fixed")
    with pytest.raises(ValueError, match="must not exceed dataset_size"):
        gaussian_step_event(1.0, dataset_size=10, batch_size=20)
    with pytest.raises(ValueError, match="disagrees with batch_size/dataset_size"):
        gaussian_step_event(1.0, q=0.5, dataset_size=100, batch_size=10)
    with pytest.raises(ValueError, match="use 'poisson' or 'fixed'"):
        gaussian_step_event(1.0, q=0.5, sampling="shuffle")


# --- PLD of composed Gaussian queries (DP-SAM's "same" mode) ----------------------------------


@pytest.mark.parametrize("relation, sens", [("replace_one", 2.0), ("add_remove", 1.0)])
def test_pld_composed_gaussians_equal_the_exact_gaussian_of_their_mu(relation, sens):
    """Two Gaussian queries of multipliers 1.5 and 3 on the same data are mu-GDP with
    mu^2 = sens^2 (1.5^-2 + 3^-2): PLD of the composition matches Balle-Wang's exact epsilon."""
    g1, g2 = dpa.GaussianDpEvent(1.5), dpa.GaussianDpEvent(3.0)
    ledger = Ledger(relation, "pld", pld_discretization=1e-3)
    ledger.record(dpa.ComposedDpEvent([g1, g2]), count=4)
    mu = sens * math.sqrt(4 * (1.5 ** -2 + 3.0 ** -2))
    assert ledger.epsilon(DELTA) == pytest.approx(gaussian_exact_epsilon(mu, DELTA), rel=1e-3)


def test_pld_analyses_poisson_sampled_composition_between_its_bounds():
    """dp-accounting's PLD refuses PoissonSampled(Composed[G, G]); the ledger analyses it, and
    the figure lies where it must: above one subsampled query of multiplier z (half the
    information) and at or below RDP of the same event (RDP is never tighter than PLD)."""
    z, q, steps = 2.0, 1 / 16, 300
    same = dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent([dpa.GaussianDpEvent(z)] * 2))
    plain = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert not plain.supports(same)
    ledger = Ledger("add_remove", "pld")
    ledger.record(same, count=steps)
    one = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                value_discretization_interval=1e-4)
    one.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    eps = ledger.epsilon(DELTA)
    assert one.get_epsilon(DELTA) < eps <= ledger.epsilon(DELTA, accountant="rdp")
    # replace-one is analysed too (RDP has no Poisson analysis there) and costs more
    ro = Ledger("replace_one", "pld")
    ro.record(same, count=steps)
    assert ro.epsilon(DELTA) > eps
