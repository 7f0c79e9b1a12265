"""Tests for pavejax.accounting: Ledger, event builders, JSON round trip (calibration:
test_calibrate.py).

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
    DP_SAM_MODES,
    BudgetExceededError,
    Ledger,
    Relation,
    dp_sam_step_event,
    dpzo_step_event,
    event_from_json,
    event_to_json,
    gaussian_step_event,
    run_event,
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
    ledger.record(run_event(gaussian_step_event(1.0, q=ANCHOR_Q), ANCHOR_STEPS), label="train")
    assert ledger.epsilon(DELTA) == pytest.approx(direct_epsilon(ANCHOR_EVENT, "rdp"), rel=1e-12)
    assert ledger.epsilon(DELTA) == pytest.approx(1.486, abs=5e-3)


def test_anchor_pld_matches_direct_dp_accounting():
    ledger = Ledger("add_remove", "pld")
    ledger.record(run_event(gaussian_step_event(1.0, q=ANCHOR_Q), ANCHOR_STEPS), label="train")
    assert ledger.epsilon(DELTA) == pytest.approx(1.240, abs=5e-3)  # default discretisation
    coarse = Ledger("add_remove", "pld", pld_discretization=1e-3).merge(ledger)
    direct = direct_epsilon(ANCHOR_EVENT, "pld", pld_discretization=1e-3)
    assert coarse.epsilon(DELTA) == pytest.approx(direct, rel=1e-12)


def test_entries_compose_like_one_long_run():
    step = gaussian_step_event(1.0, q=ANCHOR_Q)
    split = Ledger("add_remove", "rdp")
    split.record(step, 1_500, label="a")
    split.record(run_event(gaussian_step_event(1.0, q=ANCHOR_Q), 500), label="b")
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
    ledger.record(run_event(gaussian_step_event(SIGMA), T))
    eps = ledger.epsilon(DELTA)
    closed = 2 * T / SIGMA**2 + 2 * math.sqrt(2 * T * math.log(1 / DELTA)) / SIGMA
    # The closed form uses the classic RDP conversion; dp-accounting's improved one is ~7% lower.
    assert 0.9 * closed <= eps <= closed
    assert eps == pytest.approx(gaussian_rdp_epsilon(2 * T / SIGMA**2, DELTA), rel=1e-9)


def test_rdp_add_remove_full_batch_closed_form():
    ledger = Ledger("add_remove", "rdp")
    ledger.record(run_event(gaussian_step_event(SIGMA), T))
    eps = ledger.epsilon(DELTA)
    closed = T / (2 * SIGMA**2) + math.sqrt(2 * T * math.log(1 / DELTA)) / SIGMA
    assert 0.85 * closed <= eps <= closed
    assert eps == pytest.approx(gaussian_rdp_epsilon(T / (2 * SIGMA**2), DELTA), rel=1e-9)


@pytest.mark.parametrize("relation,mu", [("replace_one", 2.0), ("add_remove", 1.0)])
def test_pld_full_batch_matches_exact_gaussian(relation, mu):
    # T Gaussian steps with sensitivity Δ and std σ are one Gaussian with Δ√T/σ = mu.
    ledger = Ledger(relation, "pld", pld_discretization=1e-3)
    ledger.record(run_event(gaussian_step_event(SIGMA), T))
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
    sub.record(run_event(gaussian_step_event(4.0, sampling="fixed", dataset_size=1000,
                                             batch_size=100), 10))
    eps = sub.epsilon(DELTA)
    assert 0.0 < eps < gaussian_rdp_epsilon(2 * 10 / 4.0**2, DELTA)  # below full batch
    halved = dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(1000, 100, dpa.GaussianDpEvent(2.0)), 10)
    assert eps == pytest.approx(direct_epsilon(halved, "rdp", RO), rel=1e-12)


def test_rdp_replace_one_refuses_poisson():
    ledger = Ledger("replace_one", "rdp")
    poisson = run_event(gaussian_step_event(1.0, q=0.01), 5)
    with pytest.raises(ValueError, match=r"add_remove.*fixed-size sampling.*pld"):
        ledger.record(poisson)
    with pytest.raises(ValueError, match="Poisson sampling under replace-one"):
        ledger.record(dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.0), poisson]))
    pld_ledger = Ledger("replace_one", "pld")  # PLD analyses it, so the same event is fine there
    pld_ledger.record(poisson)
    with pytest.raises(ValueError, match="add_remove"):
        pld_ledger.epsilon(DELTA, accountant="rdp")


def test_unsupported_sampling_refused_with_advice():
    fixed = run_event(gaussian_step_event(2.0, sampling="fixed", dataset_size=100,
                                          batch_size=10), 3)
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
    ledger.record(run_event(gaussian_step_event(SIGMA), T), label="spec")
    s = ledger.summary(DELTA)
    assert s["relation"] == "replace_one" and s["num_entries"] == 1 and s["delta"] == DELTA
    assert s["epsilon"]["pld"] < s["epsilon"]["rdp"]
    fixed = Ledger("replace_one", "rdp")
    fixed.record(run_event(gaussian_step_event(4.0, sampling="fixed", dataset_size=100,
                                               batch_size=10), 2))
    s = fixed.summary(DELTA)
    assert s["epsilon"]["pld"] is None and "PLD" in s["unsupported"]["pld"]
    assert s["epsilon"]["rdp"] > 0


def test_empty_and_non_private_ledgers():
    for acc in ("rdp", "pld"):
        empty = Ledger("add_remove", acc)
        assert empty.epsilon(DELTA) == 0.0 and empty.delta(1.0) == 0.0
    leaky = Ledger("add_remove", "rdp")
    leaky.record(run_event(gaussian_step_event(0.0, q=0.5), 3))
    assert leaky.entries[0].event == dpa.SelfComposedDpEvent(dpa.NonPrivateDpEvent(), 3)
    assert math.isinf(leaky.epsilon(DELTA)) and math.isinf(leaky.epsilon(DELTA, "pld"))


def test_delta_inverts_epsilon():
    ledger = Ledger("add_remove", "pld")
    ledger.record(run_event(gaussian_step_event(SIGMA), T))
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
    assert run_event(gaussian_step_event(2.0, q=1.0), 7) == dpa.SelfComposedDpEvent(
        dpa.GaussianDpEvent(2.0), 7)


def test_dp_sam_and_dpzo_step_events_structure():
    g = dpa.GaussianDpEvent(2.0)
    poisson = dict(q=0.25)
    expected = {
        "none": dpa.PoissonSampledDpEvent(0.25, g),
        "reuse": dpa.PoissonSampledDpEvent(0.25, g),
        "random": dpa.PoissonSampledDpEvent(0.25, g),
        "fresh": dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.25, g), 2),
        "same": dpa.PoissonSampledDpEvent(0.25, dpa.ComposedDpEvent([g, g])),
    }
    assert set(expected) == set(DP_SAM_MODES)
    for mode, event in expected.items():
        assert dp_sam_step_event(mode, 2.0, **poisson) == event
        assert dp_sam_step_event(mode, 0.0, **poisson) == dpa.NonPrivateDpEvent()
    assert dp_sam_step_event("same", 2.0) == dpa.ComposedDpEvent([g, g])  # q = 1: no sampling
    assert dp_sam_step_event("same", 2.0, sampling="fixed", dataset_size=40, batch_size=10) == (
        dpa.SampledWithoutReplacementDpEvent(40, 10, dpa.ComposedDpEvent([g, g])))
    # K directions of per-coordinate noise sigma C on an L2 bound C sqrt(K):
    # multiplier sigma / sqrt(K)
    assert dpzo_step_event(2.0, num_directions=4, q=0.1) == dpa.PoissonSampledDpEvent(
        0.1, dpa.GaussianDpEvent(1.0))
    with pytest.raises(ValueError, match="mode must be one of"):
        dp_sam_step_event("sam", 1.0)
    with pytest.raises(ValueError, match="num_directions must be an integer >= 1"):
        dpzo_step_event(1.0, num_directions=0)
    with pytest.raises(TypeError, match="must be a dp_accounting.DpEvent"):
        run_event(2.0, 3)


BUILDERS = {
    "gaussian": gaussian_step_event,
    "dp_sam_same": lambda z, **kw: dp_sam_step_event("same", z, **kw),
    "dp_sam_fresh": lambda z, **kw: dp_sam_step_event("fresh", z, **kw),
    "dpzo": lambda z, **kw: dpzo_step_event(z, num_directions=3, **kw),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_builder_gets_the_same_sampling_and_relation_guards(name):
    build = BUILDERS[name]
    fixed = build(2.0, sampling="fixed", dataset_size=100, batch_size=10)
    poisson = build(2.0, q=0.1)
    with pytest.raises(ValueError, match=r"replace_one.*poisson"):
        Ledger("add_remove", "rdp").record(fixed)  # fixed size: replace-one only
    with pytest.raises(ValueError, match=r"PLD.*accountant='rdp'"):
        Ledger("replace_one", "pld").record(fixed)  # PLD has no fixed-size analysis
    with pytest.raises(ValueError, match="Poisson sampling under replace-one"):
        Ledger("replace_one", "rdp").record(poisson)
    Ledger("replace_one", "rdp").record(fixed)
    Ledger("add_remove", "rdp").record(poisson)
    Ledger("replace_one", "pld").record(poisson)
    with pytest.raises(ValueError, match="needs dataset_size and batch_size"):
        build(1.0, q=0.1, sampling="fixed")
    with pytest.raises(ValueError, match=r"q \(sampling probability\) must be in \(0, 1\]"):
        build(1.0, q=1.5)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        build(-1.0, q=0.1)


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
    ledger.record(run_event(gaussian_step_event(1 / 3), 7), label="spec")
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
    a.record(run_event(gaussian_step_event(1.0, q=0.01), 100), label="a")
    b.record(run_event(gaussian_step_event(1.0, q=0.01), 300), label="b")
    merged = a.merge(b)
    assert len(a) == 1 and len(b) == 1 and len(merged) == 2
    assert merged.epsilon(DELTA) == pytest.approx(
        direct_epsilon(run_event(gaussian_step_event(1.0, q=0.01), 400), "rdp"), rel=1e-12)
    with pytest.raises(ValueError, match="different neighbouring relations"):
        a.compose(Ledger("replace_one", "rdp"))


def test_budget_check_raises_when_spent():
    ledger = Ledger("add_remove", "rdp")
    ledger.record(run_event(gaussian_step_event(SIGMA), T))
    spent = ledger.check_budget(10.0, DELTA)
    assert spent == pytest.approx(gaussian_rdp_epsilon(T / (2 * SIGMA**2), DELTA), rel=1e-9)
    with pytest.raises(BudgetExceededError, match=r"budget already spent: ε=4\.7\d* > target 1"):
        ledger.check_budget(1.0, DELTA)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta must be"):
        Ledger().epsilon(delta)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_bad_q(q):
    with pytest.raises(ValueError, match=r"q \(sampling probability\) must be in \(0, 1\]"):
        gaussian_step_event(1.0, q=q)


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_bad_steps(steps):
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        run_event(gaussian_step_event(1.0, q=0.1), steps)


def test_bad_noise_and_events_and_counts():
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        gaussian_step_event(-1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number"):
        run_event(gaussian_step_event(math.inf), 2)
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
    with pytest.raises(ValueError, match="epsilon must be > 0"):
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


def test_coalesce_extends_the_last_equal_entry_and_keeps_the_composition():
    from pavejax.accounting import gaussian_step_event

    a = gaussian_step_event(1.0, q=0.01, sampling="poisson")
    b = gaussian_step_event(2.0, q=0.01, sampling="poisson")
    led = Ledger("add_remove")
    for event in (a, a, a, b, a):
        led.record(event, label="x", coalesce=True)
    led.record(a, label="y", coalesce=True)  # another label: a new entry
    assert [(e.count, e.label) for e in led.entries] == [(3, "x"), (1, "x"), (1, "x"), (1, "y")]
    plain = Ledger("add_remove")
    for event in (a, a, a, b, a, a):
        plain.record(event)
    assert led.epsilon(1e-5) == pytest.approx(plain.epsilon(1e-5), rel=1e-9)
