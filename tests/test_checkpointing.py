"""TrainCheckpointer: bit-exact round trips, a ledger that never rewinds, binding budgets, run
records, atomic steps; the budget and run guards inside the DP-SAM and DP-S-PAVE trainers."""

from __future__ import annotations

import math
import shutil

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import dp_event
from jax.sharding import NamedSharding, PartitionSpec as P

from pavejax.accounting import BudgetExceededError, Ledger
from pavejax.checkpointing import (
    Budget,
    Checkpoint,
    LedgerRollbackError,
    RunMismatchError,
    TrainCheckpointer,
    enforce_budget,
    ledger_releases,
    resolve_budget,
    run_record,
)
from pavejax.optim import promotion_safe
from pavejax.privacy import data_mesh
from tests import _scale_problems as PR

EVENT = dp_event.PoissonSampledDpEvent(0.25, dp_event.GaussianDpEvent(1.0))
RUN = {"trainer": "toy", "config": {"lr": 0.1, "mode": "same"}}


def _rdp_epsilon(count: int, delta: float = 1e-5) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(EVENT, count)
    return acc.get_epsilon(delta)


def _ledger(count: int = 0, mi: tuple[float, ...] = ()) -> Ledger:
    led = Ledger("add_remove", "rdp")
    if count:
        led.record(EVENT, count=count, label="toy")
    for nats in mi:
        led.record_mi(nats, label="toy")
    return led


def _state():
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 7, "b": jnp.zeros(2)}
    tx = promotion_safe(optax.adamw(1e-2))
    opt = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
    _, opt = tx.update(grads, opt, params)  # non-trivial moments and count
    return {"params": params, "opt": opt}


def _bits(tree):
    return [(np.asarray(x).dtype.str, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _save(directory, step, ledger, mechanism=None, budget=None, state=None, **kw):
    with TrainCheckpointer(directory, **kw) as ckpt:
        ckpt.save(Checkpoint(step, _state() if state is None else state, jax.random.key(step),
                             ledger, RUN, mechanism or {}, budget))


def test_round_trip_is_bit_exact(tmp_path):
    state, key = _state(), jax.random.fold_in(jax.random.key(7), 3)
    ledger = _ledger(4, mi=(0.125,))
    mech = {"losses": [0.1, 1 / 3, 2.0 ** -30], "rng_state": {"state": 2**70 + 1}}
    with TrainCheckpointer(tmp_path, budget=(3.0, 1e-5)) as ckpt:
        assert ckpt.restore_latest(state, run=RUN) is None
        ckpt.save(Checkpoint(4, state, key, ledger, RUN, mech, ckpt.budget))
    with TrainCheckpointer(tmp_path) as ckpt:
        got = ckpt.restore_latest(jax.tree.map(jnp.zeros_like, state), run=RUN,
                                  key_like=jax.random.key(0))
    assert got.step == 4 and _bits(got.arrays) == _bits(state)
    assert type(got.arrays["opt"][0]) is type(state["opt"][0])  # optax NamedTuples come back
    np.testing.assert_array_equal(jax.random.key_data(got.key), jax.random.key_data(key))
    assert got.ledger == ledger and got.mechanism == mech
    assert got.budget == Budget(3.0, 1e-5)


def test_restores_onto_the_template_sharding(tmp_path):
    mesh = data_mesh(8)
    _save(tmp_path, 1, _ledger(1))
    like = jax.device_put(_state(), NamedSharding(mesh, P()))
    with TrainCheckpointer(tmp_path) as ckpt:
        got = ckpt.restore_latest(like, run=RUN, key_like=jax.random.key(0))
    w = got.arrays["params"]["w"]
    assert w.sharding.is_equivalent_to(NamedSharding(mesh, P()), w.ndim)
    assert len(w.sharding.device_set) == 8


def test_ledger_releases_counts_events_and_charges():
    assert ledger_releases(_ledger()) == 0
    assert ledger_releases(_ledger(5, mi=(0.1, 0.2))) == 7


def test_restoring_an_older_ledger_is_refused(tmp_path):
    _save(tmp_path, 2, _ledger(2))
    with TrainCheckpointer(tmp_path) as ckpt:
        assert ckpt.restore_latest(_state(), run=RUN, ledger=_ledger(2),
                                   key_like=jax.random.key(0)).step == 2
        with pytest.raises(LedgerRollbackError, match="forget privacy already spent"):
            ckpt.restore_latest(_state(), run=RUN, ledger=_ledger(2, mi=(0.01,)),
                                key_like=jax.random.key(0))


def test_saving_a_lower_ledger_than_the_latest_step_is_refused(tmp_path):
    _save(tmp_path, 2, _ledger(2, mi=(0.1,)))
    with pytest.raises(LedgerRollbackError, match="records 2 releases but step 2 already saved "
                                                  "records 3; a saved ledger can only grow"):
        _save(tmp_path, 5, _ledger(2))  # a later step that forgot the MI charge
    _save(tmp_path, 3, _ledger(3, mi=(0.1,)))  # more releases: fine
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]


def test_template_can_depend_on_the_saved_mechanism_record(tmp_path):
    state = _state()
    with_extra = {**state, "extra": jnp.arange(3, dtype=jnp.int32)}
    _save(tmp_path, 1, _ledger(1), mechanism={"has_extra": True}, state=with_extra)
    seen = []

    def like(record):
        seen.append(record)
        return {**state, "extra": jnp.zeros(3, jnp.int32)} if record["has_extra"] else state

    with TrainCheckpointer(tmp_path) as ckpt:
        got = ckpt.restore_latest(like, run=RUN, key_like=jax.random.key(0))
    assert seen == [{"has_extra": True}]
    assert _bits(got.arrays) == _bits(with_extra)


def test_another_run_is_refused_and_named(tmp_path):
    _save(tmp_path, 1, _ledger(1))
    other = {"trainer": "toy", "config": {"lr": 0.2, "mode": "same"}}
    with TrainCheckpointer(tmp_path) as ckpt, \
            pytest.raises(RunMismatchError, match=r"\['config\.lr'\] differ"):
        ckpt.restore_latest(_state(), run=other, key_like=jax.random.key(0))


def test_a_step_killed_mid_save_is_ignored(tmp_path):
    _save(tmp_path, 1, _ledger(1))
    # What a SIGKILL during Orbax's write leaves behind: an uncommitted temporary directory.
    partial = tmp_path / "2.orbax-checkpoint-tmp-1234567"
    shutil.copytree(tmp_path / "1", partial)
    shutil.rmtree(partial / "arrays")
    with TrainCheckpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.restore_latest(_state(), run=RUN, key_like=jax.random.key(0)).step == 1


def test_budget_is_binding_across_resumes():
    b = Budget(2.0, 1e-5)
    assert resolve_budget(None, b) == b and resolve_budget(b, None) == b
    assert resolve_budget(None, None) is None
    with pytest.raises(RunMismatchError, match="keeps its budget"):
        resolve_budget(b, Budget(4.0, 1e-5))


def test_enforce_budget_checks_the_whole_remaining_run():
    e3, e6 = _rdp_epsilon(3), _rdp_epsilon(6)
    budget = Budget((e3 + e6) / 2, 1e-5)
    assert enforce_budget(_ledger(), budget, EVENT, 3) == pytest.approx(e3, rel=1e-9)
    assert enforce_budget(_ledger(2), budget, EVENT, 1) == pytest.approx(e3, rel=1e-9)
    with pytest.raises(BudgetExceededError, match="would exceed"):
        enforce_budget(_ledger(3), budget, EVENT, 3)
    assert enforce_budget(_ledger(), None, EVENT, 100) is None


def test_validation_messages(tmp_path):
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        TrainCheckpointer(tmp_path, every=0)
    with pytest.raises(ValueError, match="budget epsilon must be"):
        Budget(-1.0, 1e-5)
    with pytest.raises(ValueError, match=r"budget delta must be in \(0, 1\)"):
        Budget(1.0, 1.0)
    with TrainCheckpointer(tmp_path) as ckpt, pytest.raises(TypeError, match="JSON-safe"):
        ckpt.save(Checkpoint(1, _state(), None, _ledger(), RUN, {"x": math.nan}))
    rec = run_record("toy", Budget(math.inf, 0.5))
    assert rec == {"trainer": "toy", "config": {"epsilon": "inf", "delta": 0.5}}


# ------------------------------------------------------------------ guards inside the trainers


def _sam_epsilon(steps: int) -> float:
    return _rdp_epsilon(steps)  # reuse mode: one Poisson(16/64)-sampled Gaussian(z=1) per step


def test_dp_sam_refuses_to_run_past_its_budget(tmp_path):
    budget = Budget((_sam_epsilon(3) + _sam_epsilon(6)) / 2, 1e-5)
    with TrainCheckpointer(tmp_path / "low", budget=(_sam_epsilon(3) * 0.99, 1e-5)) as ckpt:
        with pytest.raises(BudgetExceededError):
            PR.run_sam(ckpt, steps=3)
        assert ckpt.latest_step() is None  # refused before the first step
    with TrainCheckpointer(tmp_path / "run", budget=budget) as ckpt:
        first = PR.run_sam(ckpt, steps=3)
        assert first.ledger.epsilon(1e-5) == pytest.approx(_sam_epsilon(3), rel=1e-9)
    with TrainCheckpointer(tmp_path / "run") as ckpt:  # the stored budget still binds
        with pytest.raises(BudgetExceededError, match="would exceed"):
            PR.run_sam(ckpt, steps=6)
        assert ckpt.latest_step() == 3
        again = PR.run_sam(ckpt, steps=3)  # a finished run is not run (or charged) twice
    assert _bits(again.params) == _bits(first.params) and again.ledger == first.ledger
    with TrainCheckpointer(tmp_path / "run", budget=(9.0, 1e-5)) as ckpt, \
            pytest.raises(RunMismatchError, match="keeps its budget"):
        PR.run_sam(ckpt, steps=3)
    with TrainCheckpointer(tmp_path / "run") as ckpt, \
            pytest.raises(RunMismatchError, match="learning_rate"):
        PR.run_sam(ckpt, steps=3, learning_rate=0.01)


def test_dp_s_pave_budget_and_run_guards(tmp_path):
    with TrainCheckpointer(tmp_path / "low", budget=(0.5, 1e-5)) as ckpt, \
            pytest.raises(BudgetExceededError):
        PR.run_spec(ckpt, steps=2)
    with TrainCheckpointer(tmp_path / "run") as ckpt:
        PR.run_spec(ckpt, steps=2)
        with pytest.raises(RunMismatchError, match="l2_clip"):
            PR.run_spec(ckpt, steps=2, l2_clip=1.0)


def test_dp_s_pave_resume_takes_the_checkpoint_noise_key(tmp_path):
    whole = PR.run_spec(steps=3)  # noise key PR.SPEC_NOISE_KEY throughout
    with TrainCheckpointer(tmp_path / "run") as ckpt:
        PR.run_spec(ckpt, steps=2)  # the same key, stopped after step 2
        with pytest.raises(ValueError, match="key differs from the key of the run"):
            PR.run_spec(ckpt, steps=3, noise_key=jax.random.key(0))
        resumed = PR.run_spec(ckpt, steps=3, noise_key=None)  # a fresh key would differ
    assert resumed.spec.vector.tobytes() == whole.spec.vector.tobytes()
    assert resumed.ledger == whole.ledger
