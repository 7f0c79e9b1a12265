"""The zeroth-order training loop: secret independence of ZPL, budgets, resume, selection."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.paczero import (
    ZOConfig,
    init_state,
    learning_rate,
    load_checkpoint,
    train,
)

N, D = 32, 4
# Every run shares one direction count, subset count and DP setting, so the loop's device
# functions and the DP noise calibration are compiled/solved once for the whole module.
K, M = 2, 8
DP = {"dp_epsilon": 2.0, "dp_batch_size": 8}


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
    cfg = ZOConfig("zpl", steps=12, learning_rate=0.05, clip=5.0, num_subsets=M,
                   num_directions=K)
    pool = make_pool()
    s0 = init_state(cfg, start(), N, public_seed=1, mechanism_seed=2)
    a = train(cfg, loss, s0, None, pool)
    b = train(cfg, loss, dataclasses.replace(s0, secret=(s0.secret + 3) % 8), None, pool)
    assert same_tree(a.trainable, b.trainable)
    assert a.mechanism.rng_state == b.mechanism.rng_state
    np.testing.assert_array_equal(a.mechanism.log_posterior, np.full(8, -math.log(8)))
    assert a.mi_used == 0.0 and a.ledger(cfg, N).mutual_information() == 0.0
    assert a.releases == 12 * K and 0 <= a.unanimous <= 12 * K


def test_mi_spends_at_most_its_budget():
    cfg = ZOConfig("mi", steps=10, learning_rate=0.05, clip=5.0, num_subsets=M, mi_budget=0.05,
                   num_directions=K)
    st = train(cfg, loss, init_state(cfg, start(), N, public_seed=1, mechanism_seed=3), None,
               make_pool())
    assert sum(st.charges) <= 0.05 and len(st.charges) == st.step
    assert st.ledger(cfg, N).mutual_information() == pytest.approx(math.fsum(st.charges))
    assert st.mi_used <= 0.05


@pytest.mark.parametrize("mechanism, extra", [
    ("mi", {"mi_budget": 0.2, "num_subsets": M}),
    ("dpzo", DP),
])
def test_resume_equals_uninterrupted(tmp_path, mechanism, extra):
    cfg = ZOConfig(mechanism, steps=8, learning_rate=0.05, clip=5.0, eval_every=3,
                   num_directions=K, **extra)
    pool = make_pool()
    s0 = init_state(cfg, start(), N, public_seed=4, mechanism_seed=5)
    dev = lambda tr: pool_loss(tr, pool)  # noqa: E731
    whole = train(cfg, loss, s0, None, pool, dev_fn=dev)
    train(cfg, loss, s0, None, pool, dev_fn=dev, until=5, checkpoint_dir=tmp_path / "ck")
    resumed = load_checkpoint(tmp_path / "ck", start(), cfg)
    assert resumed.step == 5
    done = train(cfg, loss, resumed, None, pool, dev_fn=dev)
    assert same_tree(whole.trainable, done.trainable)
    assert same_tree(whole.best, done.best) and whole.best_step == done.best_step
    assert whole.charges == done.charges and whole.mechanism.rng_state == done.mechanism.rng_state
    np.testing.assert_array_equal(whole.mechanism.log_posterior, done.mechanism.log_posterior)
    assert whole.ledger(cfg, N) == done.ledger(cfg, N)
    with pytest.raises(ValueError, match="different config"):
        load_checkpoint(tmp_path / "ck", start(), dataclasses.replace(cfg, steps=9))


def test_mezo_and_zpl_reduce_the_loss():
    pool = make_pool()
    before = pool_loss(start(), pool)
    for mechanism in ("mezo", "zpl"):
        cfg = ZOConfig(mechanism, steps=60, learning_rate=0.1, clip=10.0, num_subsets=M,
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
    ({"mechanism": "dpzo"}, "needs dp_epsilon"),
    ({"mechanism": "zpl", "num_subsets": 7}, "even integer"),
    ({"mechanism": "zpl", "steps": 0}, "steps must be"),
    ({"mechanism": "zpl", "eps": -1.0}, "eps must be"),
])
def test_config_validation(kwargs, match):
    base = {"steps": 3, "learning_rate": 0.1}
    with pytest.raises(ValueError, match=match):
        ZOConfig(**{**base, **kwargs})
