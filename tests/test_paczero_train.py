"""The zeroth-order training loop: secret independence of ZPL, budgets and MI charges, where
the secrets come from, DP-ZO's clip and replace-one accounting, resume through the Orbax
TrainCheckpointer (bit-exact, ledger never lower, budgets and run records binding), selection,
and no ZOState secret in a release."""

import dataclasses
import math
import re
import secrets

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import stats

from pavejax.accounting import BudgetExceededError, Ledger, dpzo_step_event
from pavejax.checkpointing import LedgerRollbackError, RunMismatchError, TrainCheckpointer
from pavejax.paczero import (
    ZOConfig,
    ZOState,
    init_state,
    learning_rate,
    mechanisms as mech,
    membership_matrix,
    restore_state,
    save_state,
    train,
)
from pavejax.privacy import SamplingConfig
from pavejax.release import ReleaseError, ReleaseMetadata, save_release
from tests.test_pac_accounting import mpmath_mi

N, D = 32, 4
# Every run shares one direction count, subset count and DP setting, so the loop's device
# functions and the DP noise calibration are compiled/solved once for the whole module.
K, M = 2, 8
DP = {"target_epsilon": 2.0, "dp_batch_size": 8}


def make_pool():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 1.0], np.float32) > 0).astype(np.int32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def loss(tr, fr, ex):
    logit = jnp.dot(ex["x"], tr["w"]) + tr["b"]
    return jax.nn.softplus(logit) - ex["y"].astype(jnp.float32) * logit


def start():
    return {"w": jnp.zeros((D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def pool_loss(tr, pool):
    return float(jnp.mean(jax.vmap(lambda ex: loss(tr, None, ex))(pool)))


def same_tree(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_zpl_trajectory_ignores_secret_and_posterior_stays_uniform():
    cfg = ZOConfig("zpl", steps=12, learning_rate=0.05, l2_clip=5.0, num_subsets=M,
                   num_directions=K)
    pool = make_pool()
    s0 = init_state(cfg, start(), N, public_seed=1, mechanism_seed=2)
    a = train(cfg, loss, s0, None, pool)
    b = train(cfg, loss, dataclasses.replace(s0, secret=(s0.secret + 3) % 8), None, pool)
    assert same_tree(a.trainable, b.trainable)
    assert a.mechanism.rng_state == b.mechanism.rng_state
    assert a.mechanism.coin_state == b.mechanism.coin_state != s0.mechanism.coin_state
    np.testing.assert_array_equal(a.mechanism.log_posterior, np.full(8, -math.log(8)))
    assert a.mi_used == 0.0 and a.ledger(cfg, N).mutual_information() == 0.0
    assert a.releases == 12 * K and 0 <= a.unanimous <= 12 * K


def test_mi_spends_at_most_its_budget():
    cfg = ZOConfig("mi", steps=10, learning_rate=0.05, l2_clip=5.0, num_subsets=M, mi_budget=0.05,
                   num_directions=K)
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=1, mechanism_seed=3), None,
               make_pool())
    assert sum(st.charges) <= 0.05 and len(st.charges) == st.step
    assert st.ledger(cfg, N).mutual_information() == pytest.approx(math.fsum(st.charges))
    assert st.mi_used <= 0.05


def spy_on(monkeypatch, owner, name):
    """Records every return value of ``owner.name`` (and its arguments) as the loop calls it."""
    calls, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_faithful_mi_run_is_charged_what_it_leaks(monkeypatch):
    # The reference σ solver overspends small per-step budgets (|I − β| < 1e-6 absolute): the
    # ledger must hold what the releases leak, and the run's budget must still bind.
    calls = spy_on(monkeypatch, mech, "mi_release")
    cfg = ZOConfig("mi", steps=10, learning_rate=0.05, l2_clip=5.0, num_subsets=M, mi_budget=1e-6,
                   num_directions=K, faithful=True)
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=1, mechanism_seed=3), None,
               make_pool())
    released = [out[0] for _, _, out in calls]
    noisy = [(r, args[3]) for args, _, (r, _) in calls if r.sigma is not None]
    assert len(noisy) >= 4
    for r, _ in noisy[:4]:  # against the 30-digit reference
        assert r.charged >= mpmath_mi(r.q_plus, r.sigma)
    assert max(r.charged / beta for r, beta in noisy) > 3  # the overspend is on the ledger
    assert all(r.charged >= r.realised for r in released)
    spent = st.ledger(cfg, N).mutual_information()
    assert spent == pytest.approx(math.fsum(r.charged for r in released), rel=1e-12)
    assert spent <= cfg.mi_budget * (1 + 1e-12)


def test_secret_index_comes_from_the_os_not_the_mechanism_seed(monkeypatch):
    cfg = ZOConfig("zpl", steps=1, learning_rate=0.05, num_subsets=16)
    states = [init_state(cfg, start(), N, public_seed=0, mechanism_seed=3) for _ in range(20)]
    assert len({st.secret for st in states}) >= 2  # not a function of the mechanism seed
    # That seed fixes the public membership and the whole coin stream in every state, so
    # neither determines the secret; the noise generator is seeded from the OS as well.
    public = np.random.default_rng(3)
    membership = membership_matrix(public, N, 16)
    assert all(np.array_equal(st.membership, membership) for st in states)
    assert all(st.mechanism.coin_state == public.bit_generator.state for st in states)
    assert len({str(st.mechanism.rng_state) for st in states}) == 20
    # The secret is the operating system's draw, and drawing it consumes no public stream.
    monkeypatch.setattr(secrets, "randbelow", lambda m: 11 % m)
    fixed = init_state(cfg, start(), N, public_seed=0, mechanism_seed=3)
    assert fixed.secret == 11 and fixed.mechanism.coin_state == states[0].mechanism.coin_state


def test_secret_seed_replays_a_run_for_tests():
    cfg = resumable("mi", eval_every=0)
    a, b = (init_state(cfg, start(), N, public_seed=0, mechanism_seed=3, secret_seed=9)
            for _ in range(2))
    assert a.secret == b.secret and a.mechanism.rng_state == b.mechanism.rng_state
    assert_same_state(train(cfg, loss, a, None, make_pool(), until=3),
                      train(cfg, loss, b, None, make_pool(), until=3))


def test_dpzo_sampling_key_is_full_width_and_drives_the_samples(monkeypatch):
    cfg = resumable("dpzo", eval_every=0)
    states = [init_state(cfg, start(), N, public_seed=0, mechanism_seed=1) for _ in range(6)]
    st = states[0]
    assert jax.dtypes.issubdtype(st.sampling_key.dtype, jax.dtypes.prng_key)
    data = np.stack([np.asarray(jax.random.key_data(s.sampling_key)) for s in states])
    assert data.shape[1:] == jax.random.key_data(jax.random.key(0)).shape
    # every word is random (a key from a 32-bit seed has all but one word fixed), and none
    # comes from the mechanism seed
    assert (data != data[0]).any(axis=0).all()
    calls = spy_on(monkeypatch, SamplingConfig, "sample")
    train(cfg, loss, st, None, make_pool(), until=3)
    for step, (args, _, _) in enumerate(calls):
        want = jax.random.key_data(jax.random.fold_in(st.sampling_key, step))
        np.testing.assert_array_equal(jax.random.key_data(args[1]), want)


RESUMABLE = {"zpl": {"num_subsets": M}, "mi": {"mi_budget": 0.2, "num_subsets": M}, "dpzo": DP}


def resumable(mechanism, **kw):
    return ZOConfig(mechanism, **({"steps": 8, "learning_rate": 0.05, "l2_clip": 5.0,
                                   "eval_every": 3, "num_directions": K}
                                  | RESUMABLE[mechanism] | kw))


def other_seed(cfg, state):
    """A template drawn from another mechanism seed, as an OS-seeded restart would draw it: a
    resumed run can only match ``state``'s run if it takes the checkpoint's secrets."""
    fresh = init_state(cfg, start(), N, public_seed=state.public_seed, mechanism_seed=77)
    assert fresh.mechanism.rng_state != state.mechanism.rng_state
    assert cfg.mechanism == "dpzo" or not np.array_equal(fresh.membership, state.membership)
    return fresh


def assert_same_state(a, b):
    assert a.step == b.step
    assert same_tree(a.trainable, b.trainable)
    assert (a.best is None) == (b.best is None) and (a.best is None or same_tree(a.best, b.best))
    assert (a.best_step, a.best_dev) == (b.best_step, b.best_dev)
    assert a.mechanism.log_posterior.dtype == b.mechanism.log_posterior.dtype == np.float64
    assert a.mechanism.log_posterior.tobytes() == b.mechanism.log_posterior.tobytes()
    assert a.mechanism.mi_used == b.mechanism.mi_used and a.charges == b.charges
    assert a.mechanism.rng_state == b.mechanism.rng_state
    assert a.mechanism.coin_state == b.mechanism.coin_state
    assert (a.sampling_key is None) == (b.sampling_key is None)
    assert a.sampling_key is None or np.array_equal(jax.random.key_data(a.sampling_key),
                                                    jax.random.key_data(b.sampling_key))
    assert a.secret == b.secret and (a.membership is None) == (b.membership is None)
    assert a.membership is None or np.array_equal(a.membership, b.membership)
    assert (a.unanimous, a.releases, a.stopped) == (b.unanimous, b.releases, b.stopped)
    assert a.noise_multiplier == b.noise_multiplier


@pytest.mark.parametrize("mechanism", ["zpl", "mi", "dpzo"])
def test_interrupted_run_resumes_bit_identical(tmp_path, mechanism):
    cfg, pool = resumable(mechanism), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    dev = lambda tr: pool_loss(tr, pool)  # noqa: E731
    whole = train(cfg, loss, s0, None, pool, dev_fn=dev)
    with TrainCheckpointer(tmp_path, every=2) as ckpt:
        train(cfg, loss, s0, None, pool, dev_fn=dev, until=5, checkpointer=ckpt)
        assert ckpt.latest_step() == 5  # every 2 steps and when train returns
        done = train(cfg, loss, other_seed(cfg, s0), None, pool, dev_fn=dev, checkpointer=ckpt)
        assert ckpt.latest_step() == 8
    assert_same_state(done, whole)
    assert done.best_step in (3, 6, 8) and done.ledger(cfg, N) == whole.ledger(cfg, N)
    assert len(done.ledger(cfg, N).entries if mechanism == "dpzo" else
               done.ledger(cfg, N).mi_entries) >= 1


def test_restored_mi_state_is_the_saved_one_bit_for_bit(tmp_path):
    cfg, pool = resumable("mi"), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    with TrainCheckpointer(tmp_path) as ckpt:
        assert restore_state(ckpt, cfg, s0, N) is None
        mid = train(cfg, loss, s0, None, pool, dev_fn=lambda tr: pool_loss(tr, pool), until=4,
                    checkpointer=ckpt)
        back = restore_state(ckpt, cfg, other_seed(cfg, s0), N)
    assert mid.mi_used > 0 and mid.best is not None
    assert not np.allclose(mid.mechanism.log_posterior, s0.mechanism.log_posterior)
    assert_same_state(back, mid)
    assert back.origin == mid.origin is not None


def test_a_lower_ledger_is_refused(tmp_path):
    cfg, pool = resumable("mi", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    ahead = train(cfg, loss, s0, None, pool, until=4)
    with TrainCheckpointer(tmp_path) as ckpt:
        behind = train(cfg, loss, s0, None, pool, until=2, checkpointer=ckpt)
        # resuming the checkpoint at step 2 would forget the releases of steps 3 and 4
        with pytest.raises(LedgerRollbackError, match="forget privacy already spent"):
            train(cfg, loss, ahead, None, pool, checkpointer=ckpt)
        save_state(ckpt, ahead, cfg, N)
        with pytest.raises(LedgerRollbackError, match="can only grow"):
            save_state(ckpt, dataclasses.replace(behind, step=5), cfg, N)
        assert ckpt.latest_step() == 4
        with pytest.raises(LedgerRollbackError, match="forget privacy already spent"):
            train(cfg, loss, train(cfg, loss, ahead, None, pool, until=5), None, pool,
                  checkpointer=ckpt)


def test_dpzo_budget_binds_before_the_first_step(tmp_path):
    cfg, pool = resumable("dpzo", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    spent = train(cfg, loss, s0, None, pool).ledger(cfg, N).epsilon(1e-5)
    assert 1.5 < spent <= 2.0 * 1.001  # calibrated to target_epsilon = 2 over the 8 steps
    with TrainCheckpointer(tmp_path / "low", budget=(spent * 0.9, 1e-5)) as ckpt:
        with pytest.raises(BudgetExceededError, match="would exceed"):
            train(cfg, loss, s0, None, pool, checkpointer=ckpt)
        assert ckpt.latest_step() is None  # refused before any release
    with TrainCheckpointer(tmp_path / "run", budget=(spent * 1.01, 1e-5)) as ckpt:
        train(cfg, loss, s0, None, pool, until=3, checkpointer=ckpt)
    with TrainCheckpointer(tmp_path / "run", budget=(9.0, 1e-5)) as ckpt, \
            pytest.raises(RunMismatchError, match="keeps its budget"):
        train(cfg, loss, s0, None, pool, checkpointer=ckpt)
    with TrainCheckpointer(tmp_path / "run") as ckpt:  # the stored budget still binds: it fits
        assert train(cfg, loss, s0, None, pool, checkpointer=ckpt).step == 8
    pac = resumable("zpl")
    with TrainCheckpointer(tmp_path / "pac", budget=(1.0, 1e-5)) as ckpt, \
            pytest.raises(ValueError, match="binds DP-ZO runs only"):
        train(pac, loss, init_state(pac, start(), N, public_seed=0, mechanism_seed=1), None,
              pool, checkpointer=ckpt)


def test_mi_run_never_continues_past_its_budget(tmp_path):
    cfg, pool = resumable("mi", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    with TrainCheckpointer(tmp_path) as ckpt:
        mid = train(cfg, loss, s0, None, pool, until=3, checkpointer=ckpt)
        # a checkpoint whose charges (consistent with its ledger) exceed mi_budget = 0.2 nats
        save_state(ckpt, dataclasses.replace(mid, step=4, charges=(*mid.charges, 0.2)), cfg, N)
        with pytest.raises(BudgetExceededError, match="mi_budget is 0.2"):
            train(cfg, loss, s0, None, pool, checkpointer=ckpt)
        assert ckpt.latest_step() == 4
    with TrainCheckpointer(tmp_path / "more") as ckpt:  # and the budget cannot be raised
        train(cfg, loss, s0, None, pool, until=2, checkpointer=ckpt)
        with pytest.raises(RunMismatchError, match=r"config\.mi_budget"):
            train(dataclasses.replace(cfg, mi_budget=1.0), loss, s0, None, pool,
                  checkpointer=ckpt)


def test_a_checkpoint_whose_ledger_disagrees_with_its_state_is_refused(tmp_path, monkeypatch):
    cfg, pool = resumable("zpl", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    with TrainCheckpointer(tmp_path) as ckpt:
        two = train(cfg, loss, s0, None, pool, until=2)
        ledger3 = train(cfg, loss, two, None, pool, until=3).ledger(cfg, N)
        with monkeypatch.context() as m:  # the step-2 state saved with a step-3 ledger
            m.setattr(ZOState, "ledger", lambda self, *a, **k: ledger3)
            save_state(ckpt, two, cfg, N)
        with pytest.raises(ValueError, match="does not match its own charges"):
            train(cfg, loss, s0, None, pool, checkpointer=ckpt)


def test_checkpoints_accounted_add_remove(tmp_path, monkeypatch):
    # Before DP-ZO moved to replace-one, ledgers were add/remove (RDP). An MI-only ledger is
    # relation-free and still resumes; a DP-ZO one was calibrated for add/remove: refused.
    def add_remove(self, config, pool_size, **kw):
        led = Ledger("add_remove", "rdp")
        for e in real(self, config, pool_size, **kw).mi_entries:
            led.record_mi(e.nats, count=e.count, label=e.label)
        if config.mechanism == "dpzo" and self.step:
            led.record(dpzo_step_event(self.noise_multiplier, q=8 / N,
                                       num_directions=K), count=self.step)
        return led

    real = ZOState.ledger
    for mechanism in ("mi", "dpzo"):
        cfg, pool = resumable(mechanism, eval_every=0), make_pool()
        s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
        with TrainCheckpointer(tmp_path / mechanism) as ckpt:
            with monkeypatch.context() as m:
                m.setattr(ZOState, "ledger", add_remove)
                train(cfg, loss, s0, None, pool, until=2, checkpointer=ckpt)
            if mechanism == "mi":
                assert train(cfg, loss, s0, None, pool, checkpointer=ckpt).step == cfg.steps
            else:
                with pytest.raises(RunMismatchError, match="under add_remove neighbouring"):
                    train(cfg, loss, s0, None, pool, checkpointer=ckpt)


@pytest.mark.parametrize("change, field", [
    (lambda cfg, s: (dataclasses.replace(cfg, learning_rate=0.1), s), "config.learning_rate"),
    (lambda cfg, s: (dataclasses.replace(cfg, steps=9), s), "config.steps"),
    (lambda cfg, s: (cfg, dataclasses.replace(s, public_seed=5)), "public_seed"),
    (lambda cfg, s: (cfg, dataclasses.replace(
        s, trainable=jax.tree.map(lambda x: x + jnp.float32(1.0), s.trainable))), "origin"),
])
def test_another_run_is_refused_by_name(tmp_path, change, field):
    cfg, pool = resumable("zpl", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    with TrainCheckpointer(tmp_path) as ckpt:
        train(cfg, loss, s0, None, pool, until=2, checkpointer=ckpt)
        other_cfg, other = change(cfg, s0)
        with pytest.raises(RunMismatchError, match=re.escape(f"['{field}']")):
            train(other_cfg, loss, other, None, pool, checkpointer=ckpt)


def test_a_state_of_another_run_is_refused(tmp_path):
    cfg, pool = resumable("zpl", eval_every=0), make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    other = train(cfg, loss, other_seed(cfg, s0), None, pool, until=1)
    with TrainCheckpointer(tmp_path) as ckpt:
        train(cfg, loss, s0, None, pool, until=2, checkpointer=ckpt)
        with pytest.raises(RunMismatchError, match="another secret subset"):
            train(cfg, loss, other, None, pool, checkpointer=ckpt)


def test_a_release_refuses_the_secrets_of_a_zo_state(tmp_path):
    cfg = resumable("mi")
    st = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    meta = ReleaseMetadata(kind="model", backbone_id="logreg", backbone_hash="ab" * 32,
                           mechanism="paczero-mi", ledger=None, guarantee={"kind": "none"})
    with pytest.raises(ReleaseError, match="named like a secret"):
        save_release(tmp_path / "a", {**st.trainable, "secret": np.asarray(st.secret)}, meta)
    with pytest.raises(ReleaseError, match="every leaf must be an array"):
        save_release(tmp_path / "b", {"state": st}, meta)
    with pytest.raises(ReleaseError, match="'rng_state'"):
        save_release(tmp_path / "c", st.trainable, dataclasses.replace(
            meta, extra={"mechanism": {"rng_state": st.mechanism.rng_state}}))
    assert not any(tmp_path.iterdir())


def identical_pool(labels):
    """N copies of one input with the given labels: every example's two-point difference is
    (expit(x·w) − y) x·z, about ±0.5 |x·z| at w = 0, far beyond a clip of 1e-3."""
    x = np.tile(np.array([[1.0, -0.5, 0.25, 2.0]], np.float32), (N, 1))
    return {"x": jnp.asarray(x), "y": jnp.asarray(np.asarray(labels, np.int32))}


def test_dpzo_clip_binds_in_the_trainer(monkeypatch):
    # Identical examples whose differences dwarf the clip: every sampled example contributes
    # exactly ±C with one sign, so the clipped sum the noise is added to is ±C × (sampled
    # count). Doubling the clip or dropping it in the trainer changes that sum.
    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3)
    sums = spy_on(monkeypatch, mech, "dpzo_release")
    samples = spy_on(monkeypatch, SamplingConfig, "sample")
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=0, mechanism_seed=1), None,
               identical_pool(np.ones(N)))
    counts = [int(np.sum(out[1])) for _, _, out in samples]
    assert len(counts) == cfg.steps and sum(counts) > 0
    assert len(sums) == cfg.steps * K
    for i, (args, kwargs, _) in enumerate(sums):
        assert abs(args[0]) == pytest.approx(counts[i // K] * cfg.l2_clip, rel=1e-5, abs=1e-9)
        assert kwargs == {"noise_multiplier": st.noise_multiplier, "l2_clip": cfg.l2_clip,
                          "expected_batch_size": cfg.dp_batch_size}
    # The ledger holds that Gaussian: std σC on a sum of sensitivity C√K per example.
    (entry,) = st.ledger(cfg, N).entries
    want = dp_event.PoissonSampledDpEvent(
        cfg.dp_batch_size / N, dp_event.GaussianDpEvent(st.noise_multiplier / math.sqrt(K)))
    assert entry.event == want and entry.count == cfg.steps


def test_dpzo_is_accounted_replace_one_with_pld():
    cfg = resumable("dpzo", eval_every=0)
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=0, mechanism_seed=1), None,
               make_pool())
    ledger = st.ledger(cfg, N)
    assert (ledger.relation.value, ledger.accountant) == ("replace_one", "pld")
    # dp-accounting directly: the run's steps meet ε = 2 under replace-one (and tightly); the
    # same σ under add/remove claims far less, which a release stating N must not report.
    step = dp_event.PoissonSampledDpEvent(
        8 / N, dp_event.GaussianDpEvent(st.noise_multiplier / math.sqrt(K)))
    eps = {}
    for rel in (dpa.NeighboringRelation.REPLACE_ONE, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        acc = dpa.pld.PLDAccountant(rel)
        acc.compose(step, cfg.steps)
        eps[rel] = acc.get_epsilon(1e-5)
    assert 0.97 * 2.0 <= eps[dpa.NeighboringRelation.REPLACE_ONE] <= 2.0
    assert eps[dpa.NeighboringRelation.ADD_OR_REMOVE_ONE] < 0.75 * 2.0
    assert ledger.epsilon(1e-5) <= 2.0


def gaussian_delta(epsilon, mu):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/std = μ (Balle & Wang 2018)."""
    return (stats.norm.cdf(mu / 2 - epsilon / mu)
            - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu))


def test_dpzo_full_batch_replace_one_sensitivity_and_exact_gaussian(monkeypatch):
    # Full batch (q = 1): T steps of K noisy clipped sums are one Gaussian mechanism. Measure
    # the trainer's sensitivity between two pools of the same size that differ in one example
    # (same state: same samples and noise), then check the ledger's ε against the exact
    # Gaussian of that sensitivity.
    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3, dp_batch_size=N, steps=4)
    s0 = init_state(cfg, start(), N, public_seed=0, mechanism_seed=1)
    labels = np.ones(N)
    sums = []
    for flip in (False, True):
        calls = spy_on(monkeypatch, mech, "dpzo_release")
        labels[5] = 0.0 if flip else 1.0
        train(cfg, loss, s0, None, identical_pool(labels), until=1)
        sums.append(np.array([args[0] for args, _, _ in calls]))
        monkeypatch.undo()
    sensitivity = float(np.linalg.norm(sums[0] - sums[1]))
    assert sensitivity == pytest.approx(2 * cfg.l2_clip * math.sqrt(K), rel=1e-4)  # replace-one
    mu = sensitivity * math.sqrt(cfg.steps) / (s0.noise_multiplier * cfg.l2_clip)
    spent = train(cfg, loss, s0, None, make_pool()).ledger(cfg, N).epsilon(1e-5)
    assert spent <= 2.0
    assert gaussian_delta(spent, mu) <= 1e-5 * (1 + 1e-9)  # the ledger covers the exact δ
    assert gaussian_delta(2.0, mu) == pytest.approx(1e-5, rel=0.02)  # σ calibrated tightly


def test_mezo_and_zpl_reduce_the_loss():
    pool = make_pool()
    before = pool_loss(start(), pool)
    for mechanism in ("mezo", "zpl"):
        cfg = ZOConfig(mechanism, steps=60, learning_rate=0.1, l2_clip=10.0, num_subsets=M,
                       num_directions=K, eval_every=20)
        st = train(cfg, loss, init_state(cfg, start(), N, public_seed=0, mechanism_seed=1),
                   None, pool, dev_fn=lambda tr: pool_loss(tr, pool))
        assert pool_loss(st.trainable, pool) < before - 0.05, mechanism
        assert st.best_step in (20, 40, 60) and st.best_dev <= pool_loss(st.trainable, pool)


def test_dpzo_ledger_and_schedule():
    cfg = ZOConfig("dpzo", steps=8, learning_rate=1e-2, num_directions=K, **DP)
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=0, mechanism_seed=1), None,
               make_pool())
    assert st.ledger(cfg, N).epsilon(1e-5) <= 2.0 * 1.001
    assert learning_rate(cfg, 0) == pytest.approx(1e-2)
    assert learning_rate(cfg, 4) == pytest.approx((1e-2 - 1e-7) / 2 + 1e-7)
    assert learning_rate(cfg, 8) == pytest.approx(1e-7)


@pytest.mark.parametrize("kwargs, match", [
    ({"mechanism": "sgd"}, "mechanism must be one of"),
    ({"mechanism": "mi"}, "needs mi_budget"),
    ({"mechanism": "dpzo"}, "needs target_epsilon"),
    ({"mechanism": "zpl", "num_subsets": 7}, "even integer"),
    ({"mechanism": "zpl", "steps": 0}, "steps must be"),
    ({"mechanism": "zpl", "perturbation_scale": -1.0}, "perturbation_scale must be"),
])
def test_config_validation(kwargs, match):
    base = {"steps": 3, "learning_rate": 0.1}
    with pytest.raises(ValueError, match=match):
        ZOConfig(**{**base, **kwargs})


@pytest.mark.parametrize("variant", ["correct", "too_little_noise"])
def test_dpzo_audit_holds_the_replace_one_claim_and_flags_too_little_noise(monkeypatch, variant):
    """Empirical audit of one full-batch DP-ZO step between two pools of the same size that
    differ in one example: the trainer's own clipped sums, its sigma and the real release rule,
    20000 releases per pool, scored by projection on the sums' difference. The audit's epsilon
    lower bound stays under the ledger's replace-one claim, and exceeds it for a release that
    adds a quarter of the noise (a deliberately broken variant claiming the same epsilon)."""
    from pavejax.audit import epsilon_lower_bound

    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3, dp_batch_size=N, steps=1,
                    target_epsilon=4.0)
    s0 = init_state(cfg, start(), N, public_seed=0, mechanism_seed=1)
    labels, sums = np.ones(N), []
    for flip in (False, True):
        calls = spy_on(monkeypatch, mech, "dpzo_release")
        labels[5] = 0.0 if flip else 1.0
        ran = train(cfg, loss, s0, None, identical_pool(labels))
        sums.append(np.array([args[0] for args, _, _ in calls]))
        monkeypatch.undo()
    claimed = ran.ledger(cfg, N).epsilon(1e-5)
    assert 3.9 < claimed <= 4.0 + 1e-6
    sigma = s0.noise_multiplier * (1.0 if variant == "correct" else 0.25)
    rng = np.random.default_rng(11)

    def releases(s, runs=20_000):
        return np.array([[mech.dpzo_release(v, rng, noise_multiplier=sigma, l2_clip=cfg.l2_clip,
                                            expected_batch_size=N).value for v in s]
                         for _ in range(runs)])

    d = sums[0] - sums[1]
    lower = epsilon_lower_bound(releases(sums[0]) @ d, releases(sums[1]) @ d, delta=1e-5)
    print(f"DP-ZO audit ({variant}): epsilon >= {lower:.3f}, claimed {claimed:.3f}")
    if variant == "correct":
        assert 0.5 < lower <= claimed  # the audit sees the example, within the claim
    else:
        assert lower > claimed, f"audit missed a quarter of the noise ({lower} <= {claimed})"
