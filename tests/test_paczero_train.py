"""The zeroth-order trainer on the one driver: secret independence of ZPL, budgets and MI
charges, runs as functions of their keys, DP-ZO's clip and replace-one accounting, resume through
the Orbax TrainCheckpointer (bit-exact, ledger never lower, budgets and run records binding),
selection, and no ZOState secret in a release."""

import dataclasses
import functools
import math
import re

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import stats

from pavejax.accounting import BudgetExceededError
from pavejax.checkpointing import LedgerRollbackError, RunMismatchError, TrainCheckpointer
from pavejax.paczero import (
    ZOConfig,
    ZORun,
    dpzo_release,
    init,
    mechanisms as mech,
    schedule,
    step,
    train,
)
from pavejax.release import ReleaseError, ReleaseMetadata, save_release
from tests.test_pac_accounting import mpmath_mi

N, D = 32, 4
# Every run shares one direction count, subset count and DP setting, so the DP noise
# calibration is solved once for the whole module.
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
    return jnp.mean(jax.vmap(lambda ex: loss(tr, None, ex))(pool))


POOL = make_pool()
DEV = jax.jit(lambda tr, fr=None: pool_loss(tr, POOL))  # one function: shared compilation


def fresh(cfg, secret=1, public=2):
    return init(cfg, start(), N, key=jax.random.key(secret), public_key=jax.random.key(public))


def same_tree(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_zpl_trajectory_ignores_secret_and_charges_nothing():
    cfg = ZOConfig("zpl", steps=12, learning_rate=0.05, l2_clip=5.0, num_subsets=M,
                   num_directions=K)
    s0 = fresh(cfg)
    a = train(cfg, loss, s0, None, POOL)
    b = train(cfg, loss, s0._replace(secret=(s0.secret + 3) % M), None, POOL)
    assert same_tree(a.trainable, b.trainable) and int(a.state.secret) != int(b.state.secret)
    assert a.mi_used == 0.0 and a.ledger.mutual_information() == 0.0 and not a.ledger.entries
    assert a.step == 12 and int(a.state.releases) == 12 * K
    assert 0 <= int(a.state.unanimous) <= 12 * K and a.unanimity_rate == a.state.unanimous / 24
    c = train(cfg, loss, fresh(cfg, secret=5), None, POOL)  # other coins: another trajectory
    assert not same_tree(a.trainable, c.trainable)


def test_mi_spends_at_most_its_budget():
    cfg = ZOConfig("mi", steps=10, learning_rate=0.05, l2_clip=5.0, num_subsets=M,
                   mi_budget=0.05, num_directions=K)
    run = train(cfg, loss, fresh(cfg), None, POOL)
    charges = [e.nats for e in run.ledger.mi_entries]
    assert 0 < math.fsum(charges) <= 0.05 * (1 + 1e-12) and run.step == 10
    assert run.mi_used == pytest.approx(math.fsum(charges), rel=1e-12)
    assert run.ledger.mutual_information() == pytest.approx(run.mi_used, rel=1e-12)
    assert run.host.log_posterior.dtype == np.float64 and not run.stopped


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
    cfg = ZOConfig("mi", steps=10, learning_rate=0.05, l2_clip=5.0, num_subsets=M,
                   mi_budget=1e-6, num_directions=K, faithful=True)
    run = train(cfg, loss, fresh(cfg, secret=3), None, POOL)
    released = [out[0] for _, _, out in calls]
    noisy = [(r, args[3]) for args, _, (r, _) in calls if r.sigma is not None]
    assert len(noisy) >= 4
    for r, _ in noisy[:4]:  # against the 30-digit reference
        assert r.charged >= mpmath_mi(r.q_plus, r.sigma)
    assert max(r.charged / beta for r, beta in noisy) > 3  # the overspend is on the ledger
    assert all(r.charged >= r.realised for r in released)
    spent = run.ledger.mutual_information()
    assert spent == pytest.approx(math.fsum(r.charged for r in released), rel=1e-12)
    assert spent <= cfg.mi_budget * (1 + 1e-12)


def test_mi_refuses_a_release_past_its_budget(monkeypatch):
    # A release rule that overspends (here: a per-step budget of 1 nat) is refused on the host
    # before the step is kept, saved or returned.
    monkeypatch.setattr(mech, "per_step_budget", lambda *a: 1.0)
    cfg = resumable("mi", eval_every=0)
    with pytest.raises(BudgetExceededError, match="mi_budget is 0.2"):
        train(cfg, loss, fresh(cfg), None, POOL)


RESUMABLE = {"zpl": {"num_subsets": M}, "mi": {"mi_budget": 0.2, "num_subsets": M}, "dpzo": DP}


def resumable(mechanism, **kw):
    return ZOConfig(mechanism, **({"steps": 8, "learning_rate": 0.05, "l2_clip": 5.0,
                                   "eval_every": 3, "num_directions": K}
                                  | RESUMABLE[mechanism] | kw))


def assert_same_run(a: ZORun, b: ZORun):
    assert a.step == b.step
    assert same_tree(a.trainable, b.trainable)
    assert (a.best is None) == (b.best is None) and (a.best is None or same_tree(a.best, b.best))
    assert (a.best_step, a.best_dev) == (b.best_step, b.best_dev)
    assert jax.tree.structure(a.state) == jax.tree.structure(b.state)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state), strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert (a.host is None) == (b.host is None)
    if a.host is not None:
        assert a.host.log_posterior.dtype == b.host.log_posterior.dtype == np.float64
        assert a.host.log_posterior.tobytes() == b.host.log_posterior.tobytes()
        assert (a.host.mi_used, a.host.stopped) == (b.host.mi_used, b.host.stopped)
    assert a.ledger == b.ledger and a.noise_multiplier == b.noise_multiplier


def test_a_run_is_a_function_of_its_keys():
    # Same keys: the same run bit for bit (so a fixed key replays the secret, every coin, noise
    # draw and sample: tests only). Continuing a returned run equals running through.
    for mechanism in ("mi", "dpzo"):
        cfg = resumable(mechanism, eval_every=0)
        whole = train(cfg, loss, fresh(cfg), None, POOL)
        assert_same_run(train(cfg, loss, fresh(cfg), None, POOL), whole)
        part = train(cfg, loss, fresh(cfg), None, POOL, until=3)
        assert part.step == 3 and sum(e.count for e in part.ledger.entries) in (0, 3)
        assert_same_run(train(cfg, loss, part, None, POOL), whole)
        other = train(cfg, loss, fresh(cfg, secret=9), None, POOL)
        assert not same_tree(other.trainable, whole.trainable)
    with pytest.raises(ValueError, match="continue a run from the ZORun"):
        train(cfg, loss, part.state, None, POOL)


@pytest.mark.parametrize("mechanism", ["zpl", "mi", "dpzo"])
def test_interrupted_run_resumes_bit_identical(tmp_path, mechanism):
    cfg = resumable(mechanism)
    whole = train(cfg, loss, fresh(cfg), None, POOL, dev_fn=DEV)
    with TrainCheckpointer(tmp_path, every=2) as ckpt:
        train(cfg, loss, fresh(cfg), None, POOL, dev_fn=DEV, until=5, checkpointer=ckpt)
        assert ckpt.latest_step() == 5  # every 2 steps and when train returns
        # A template with another secret key (as an OS-seeded restart draws): only the
        # checkpoint's secrets can lead to the uninterrupted result.
        done = train(cfg, loss, fresh(cfg, secret=77), None, POOL, dev_fn=DEV,
                     checkpointer=ckpt)
        assert ckpt.latest_step() == 8
    assert_same_run(done, whole)
    assert done.best_step in (3, 6, 8)
    assert len(done.ledger.entries if mechanism == "dpzo" else done.ledger.mi_entries) \
        >= (1 if mechanism != "zpl" else 0)


def test_a_lower_ledger_is_refused(tmp_path):
    cfg = resumable("mi", eval_every=0)
    ahead = train(cfg, loss, fresh(cfg), None, POOL, until=4)
    with TrainCheckpointer(tmp_path) as ckpt:
        train(cfg, loss, fresh(cfg), None, POOL, until=2, checkpointer=ckpt)
        # resuming the checkpoint at step 2 would forget the releases of steps 3 and 4
        with pytest.raises(LedgerRollbackError, match="forget privacy already spent"):
            train(cfg, loss, ahead, None, POOL, checkpointer=ckpt)
        assert ckpt.latest_step() == 2
    with TrainCheckpointer(tmp_path / "empty") as ckpt, \
            pytest.raises(ValueError, match="a checkpointed run starts at step 0"):
        train(cfg, loss, ahead, None, POOL, checkpointer=ckpt)


def test_dpzo_budget_binds_before_the_first_step(tmp_path):
    cfg = resumable("dpzo", eval_every=0)
    spent = train(cfg, loss, fresh(cfg), None, POOL).ledger.epsilon(1e-5)
    assert 1.5 < spent <= 2.0 * 1.001  # calibrated to target_epsilon = 2 over the 8 steps
    with TrainCheckpointer(tmp_path / "low", budget=(spent * 0.9, 1e-5)) as ckpt:
        with pytest.raises(BudgetExceededError, match="would exceed"):
            train(cfg, loss, fresh(cfg), None, POOL, until=2, checkpointer=ckpt)
        assert ckpt.latest_step() is None  # the whole run must fit: refused before any release
    with TrainCheckpointer(tmp_path / "run", budget=(spent * 1.01, 1e-5)) as ckpt:
        train(cfg, loss, fresh(cfg), None, POOL, until=3, checkpointer=ckpt)
    with TrainCheckpointer(tmp_path / "run", budget=(9.0, 1e-5)) as ckpt, \
            pytest.raises(RunMismatchError, match="keeps its budget"):
        train(cfg, loss, fresh(cfg), None, POOL, checkpointer=ckpt)
    with TrainCheckpointer(tmp_path / "run") as ckpt:  # the stored budget still binds: it fits
        assert train(cfg, loss, fresh(cfg), None, POOL, checkpointer=ckpt).step == 8
    pac = resumable("zpl")
    with TrainCheckpointer(tmp_path / "pac", budget=(1.0, 1e-5)) as ckpt, \
            pytest.raises(ValueError, match="binds DP-ZO runs only"):
        train(pac, loss, fresh(pac), None, POOL, checkpointer=ckpt)


def test_mi_budget_cannot_be_raised_mid_run(tmp_path):
    cfg = resumable("mi", eval_every=0)
    with TrainCheckpointer(tmp_path) as ckpt:
        train(cfg, loss, fresh(cfg), None, POOL, until=2, checkpointer=ckpt)
        with pytest.raises(RunMismatchError, match=r"config\.mi_budget"):
            train(dataclasses.replace(cfg, mi_budget=1.0), loss, fresh(cfg), None, POOL,
                  checkpointer=ckpt)


@pytest.mark.parametrize("change, field", [
    (lambda cfg, s: (dataclasses.replace(cfg, learning_rate=0.1), s), "config.learning_rate"),
    (lambda cfg, s: (dataclasses.replace(cfg, steps=9), s), "config.steps"),
    (lambda cfg, s: (cfg, s._replace(public_key=jax.random.key(5))), "public_key"),
    (lambda cfg, s: (cfg, s._replace(
        trainable=jax.tree.map(lambda x: x + jnp.float32(1.0), s.trainable))), "origin"),
])
def test_another_run_is_refused_by_name(tmp_path, change, field):
    cfg = resumable("zpl", eval_every=0)
    with TrainCheckpointer(tmp_path) as ckpt:
        train(cfg, loss, fresh(cfg), None, POOL, until=2, checkpointer=ckpt)
        other_cfg, other = change(cfg, fresh(cfg))
        with pytest.raises(RunMismatchError, match=re.escape(f"'{field}'")):
            train(other_cfg, loss, other, None, POOL, checkpointer=ckpt)


def test_a_release_refuses_the_secrets_of_a_zo_state(tmp_path):
    st = fresh(resumable("mi"))
    meta = ReleaseMetadata(kind="model", backbone_id="logreg", backbone_hash="ab" * 32,
                           mechanism="paczero-mi", ledger=None, guarantee={"kind": "none"})
    with pytest.raises(ReleaseError, match="named like a secret"):
        save_release(tmp_path / "a", {**st.trainable, "secret": np.asarray(st.secret)}, meta)
    with pytest.raises(ReleaseError):
        save_release(tmp_path / "b", {"state": st}, meta)
    assert not any(tmp_path.iterdir())


def identical_pool(labels):
    """N copies of one input with the given labels: every example's two-point difference is
    (expit(x·w) − y) x·z, about ±0.5 |x·z| at w = 0, far beyond a clip of 1e-3."""
    x = np.tile(np.array([[1.0, -0.5, 0.25, 2.0]], np.float32), (N, 1))
    return {"x": jnp.asarray(x), "y": jnp.asarray(np.asarray(labels, np.int32))}


@functools.lru_cache
def noiseless_step(cfg):
    return jax.jit(lambda s, p, k: step(cfg, loss, s, p, k, noise_multiplier=jnp.float32(0.0)))


def clipped_sums(cfg, pool, key):
    """The DP-ZO step's clipped sums over its Poisson sample (K,): its release with no noise
    (a traced σ of 0), times the expected batch size."""
    _, charge, stats = noiseless_step(cfg)(fresh(cfg), pool, key)
    assert charge.event is None  # a traced σ gives no event
    return np.asarray(stats["release"], np.float64) * cfg.dp_batch_size


def test_dpzo_clip_binds_in_the_step():
    # Identical examples whose differences dwarf the clip: every sampled example contributes
    # exactly ±C with one sign, so each clipped sum is ±C × (sampled count): an integer
    # multiple of C, the same count for both directions, growing with the clip.
    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3)
    counts = []
    for t in range(6):
        sums = clipped_sums(cfg, identical_pool(np.ones(N)), jax.random.key(t))
        count = np.abs(sums) / cfg.l2_clip
        np.testing.assert_allclose(count, np.round(count), atol=1e-3)
        assert count[0] == pytest.approx(count[1], abs=1e-3) and count[0] <= N
        counts.append(round(count[0]))
        doubled = clipped_sums(dataclasses.replace(cfg, l2_clip=2e-3),
                               identical_pool(np.ones(N)), jax.random.key(t))
        np.testing.assert_allclose(doubled, 2 * sums, rtol=1e-4)
    assert sum(counts) > 0 and len(set(counts)) > 1  # Poisson samples of varying size
    # The ledger holds that Gaussian: std σC on a sum of sensitivity C√K per example.
    run = train(cfg, loss, fresh(cfg), None, identical_pool(np.ones(N)))
    want = dp_event.PoissonSampledDpEvent(
        cfg.dp_batch_size / N, dp_event.GaussianDpEvent(run.noise_multiplier / math.sqrt(K)))
    assert {e.event for e in run.ledger.entries} == {want}
    assert sum(e.count for e in run.ledger.entries) == cfg.steps


def test_dpzo_is_accounted_replace_one_with_pld():
    cfg = resumable("dpzo", eval_every=0)
    run = train(cfg, loss, fresh(cfg), None, POOL)
    ledger = run.ledger
    assert (ledger.relation.value, ledger.accountant) == ("replace_one", "pld")
    # dp-accounting directly: the run's steps meet ε = 2 under replace-one (and tightly); the
    # same σ under add/remove claims far less, which a release stating N must not report.
    one = dp_event.PoissonSampledDpEvent(
        8 / N, dp_event.GaussianDpEvent(run.noise_multiplier / math.sqrt(K)))
    eps = {}
    for rel in (dpa.NeighboringRelation.REPLACE_ONE, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        acc = dpa.pld.PLDAccountant(rel)
        acc.compose(one, cfg.steps)
        eps[rel] = acc.get_epsilon(1e-5)
    assert 0.97 * 2.0 <= eps[dpa.NeighboringRelation.REPLACE_ONE] <= 2.0
    assert eps[dpa.NeighboringRelation.ADD_OR_REMOVE_ONE] < 0.75 * 2.0
    assert ledger.epsilon(1e-5) <= 2.0


def gaussian_delta(epsilon, mu):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity/std = μ (Balle & Wang 2018)."""
    return (stats.norm.cdf(mu / 2 - epsilon / mu)
            - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu))


def replace_one_sums(cfg):
    """The clipped sums of one full-batch step on two pools of the same size that differ in
    one example (same state and key: the same sample)."""
    labels, sums = np.ones(N), []
    for flip in (False, True):
        labels[5] = 0.0 if flip else 1.0
        sums.append(clipped_sums(cfg, identical_pool(labels), jax.random.key(3)))
    return sums


def test_dpzo_full_batch_replace_one_sensitivity_and_exact_gaussian():
    # Full batch (q = 1): T steps of K noisy clipped sums are one Gaussian mechanism. Measure
    # the step's sensitivity between two pools of the same size that differ in one example,
    # then check the ledger's ε against the exact Gaussian of that sensitivity.
    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3, dp_batch_size=N, steps=4)
    a, b = replace_one_sums(cfg)
    sensitivity = float(np.linalg.norm(a - b))
    assert sensitivity == pytest.approx(2 * cfg.l2_clip * math.sqrt(K), rel=1e-4)  # replace-one
    run = train(cfg, loss, fresh(cfg), None, POOL)
    mu = sensitivity * math.sqrt(cfg.steps) / (run.noise_multiplier * cfg.l2_clip)
    spent = run.ledger.epsilon(1e-5)
    assert spent <= 2.0
    assert gaussian_delta(spent, mu) <= 1e-5 * (1 + 1e-9)  # the ledger covers the exact δ
    assert gaussian_delta(2.0, mu) == pytest.approx(1e-5, rel=0.02)  # σ calibrated tightly


def test_mezo_and_zpl_reduce_the_loss():
    before = float(DEV(start()))
    for mechanism in ("mezo", "zpl"):
        cfg = ZOConfig(mechanism, steps=60, learning_rate=0.1, l2_clip=10.0, num_subsets=M,
                       num_directions=K, eval_every=20)
        run = train(cfg, loss, fresh(cfg), None, POOL, dev_fn=DEV, steps_per_call=20)
        assert float(DEV(run.trainable)) < before - 0.05, mechanism
        assert run.best_step in (20, 40, 60) and run.best_dev <= float(DEV(run.trainable))


def test_schedule_decays_linearly():
    cfg = ZOConfig("zpl", steps=8, learning_rate=1e-2)
    lr = schedule(cfg)
    assert float(lr(0)) == pytest.approx(1e-2)
    assert float(lr(4)) == pytest.approx((1e-2 - 1e-7) / 2 + 1e-7)
    assert float(lr(8)) == pytest.approx(1e-7)


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
def test_dpzo_audit_holds_the_replace_one_claim_and_flags_too_little_noise(variant):
    """Empirical audit of one full-batch DP-ZO step between two pools of the same size that
    differ in one example: the step's own clipped sums, its sigma and the real release rule,
    20000 releases per pool, scored by projection on the sums' difference. The audit's epsilon
    lower bound stays under the ledger's replace-one claim, and exceeds it for a release that
    adds a quarter of the noise (a deliberately broken variant claiming the same epsilon)."""
    from pavejax.audit import epsilon_lower_bound

    cfg = resumable("dpzo", eval_every=0, l2_clip=1e-3, dp_batch_size=N, steps=1,
                    target_epsilon=4.0)
    sums = replace_one_sums(cfg)
    ran = train(cfg, loss, fresh(cfg), None, POOL)
    claimed = ran.ledger.epsilon(1e-5)
    assert 3.9 < claimed <= 4.0 + 1e-6
    sigma = ran.noise_multiplier * (1.0 if variant == "correct" else 0.25)

    def releases(s, key, runs=20_000):
        tiled = jnp.asarray(np.tile(s, (runs, 1)), jnp.float32)
        return np.asarray(dpzo_release(tiled, key, noise_multiplier=sigma, l2_clip=cfg.l2_clip,
                                       expected_batch_size=N), np.float64)

    d = sums[0] - sums[1]
    lower = epsilon_lower_bound(releases(sums[0], jax.random.key(11)) @ d,
                                releases(sums[1], jax.random.key(12)) @ d, delta=1e-5)
    print(f"DP-ZO audit ({variant}): epsilon >= {lower:.3f}, claimed {claimed:.3f}")
    if variant == "correct":
        assert 0.5 < lower <= claimed  # the audit sees the example, within the claim
    else:
        assert lower > claimed, f"audit missed a quarter of the noise ({lower} <= {claimed})"
