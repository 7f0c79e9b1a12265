"""PACZero's functional core: the pytree state under jit and scan, ZPL under lax.scan equal to
the step-by-step loop, ZPL's coins as a function of the key only, MI's two phases against a
reference built from the lower-level pieces, the pseudo-gradient with optax equal to the SGD
mirror path, and DP-ZO's static event."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import special

from pavejax.accounting import dpzo_step_event
from pavejax.optim import promotion_safe
from pavejax.paczero import (
    ZOConfig,
    apply_directions,
    clip_differences,
    direction_keys,
    dpzo_noise_multiplier,
    host_generator,
    init,
    mi_apply,
    mi_device_phase,
    mi_host_release,
    mi_init_host,
    mi_release,
    per_step_budget,
    schedule,
    step,
    step_key,
    subset_means,
    subset_signs,
    two_point_differences,
)
from pavejax.training import Charge
from tests.test_paczero_train import loss, make_pool, start

N, D, M = 32, 4, 8


def state_of(cfg, **kw):
    return init(cfg, start(), N, key=jax.random.key(11), public_key=jax.random.key(12), **kw)


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_state_is_a_pytree_through_jit_and_scan():
    cfg = ZOConfig("zpl", steps=5, learning_rate=0.1, num_subsets=M)
    adam = promotion_safe(optax.adam(1e-2))  # optax's bias correction needs standard promotion
    s = state_of(cfg, optimizer=adam)
    assert s.membership.shape == (N, M) and s.membership.dtype == jnp.bool_
    assert s.secret.dtype == jnp.int32 and 0 <= int(s.secret) < M
    leaves_equal(jax.jit(lambda x: x)(s), s)
    carried, _ = jax.lax.scan(lambda c, _: (c, None), s, length=3)
    leaves_equal(carried, s)
    out = jax.jit(lambda x: step(cfg, loss, x, make_pool(), step_key(x), optimizer=adam)[0])(s)
    assert jax.tree.structure(out) == jax.tree.structure(s) and int(out.step) == 1
    # public things come from the public key only, secret ones from the secret key only
    other_secret = init(cfg, start(), N, key=jax.random.key(99), public_key=jax.random.key(12))
    np.testing.assert_array_equal(other_secret.membership, s.membership)
    other_public = init(cfg, start(), N, key=jax.random.key(11), public_key=jax.random.key(98))
    assert int(other_public.secret) == int(s.secret)
    assert not np.array_equal(other_public.membership, s.membership)
    with pytest.raises(ValueError, match="must differ"):
        init(cfg, start(), N, key=jax.random.key(3), public_key=jax.random.key(3))
    with pytest.raises(TypeError, match="typed PRNG key"):
        init(cfg, start(), N, key=3, public_key=jax.random.key(3))


def test_zpl_under_scan_equals_the_step_by_step_loop():
    cfg = ZOConfig("zpl", steps=20, learning_rate=0.1, l2_clip=5.0, num_subsets=M,
                   num_directions=2)
    pool = make_pool()

    def one(s):
        s, charge, stats = step(cfg, loss, s, pool, step_key(s))
        return s, (charge, stats)

    scanned, (charges, stats) = jax.jit(lambda s: jax.lax.scan(
        lambda c, _: one(c), s, length=cfg.steps))(state_of(cfg))
    looped, releases = state_of(cfg), []
    jitted = jax.jit(one)
    for _ in range(cfg.steps):
        looped, (charge, st) = jitted(looped)
        releases.append(np.asarray(st["release"]))
        assert isinstance(charge, Charge) and charge.event is None and float(charge.nats) == 0.0
    np.testing.assert_array_equal(np.asarray(stats["release"]), np.stack(releases))
    np.testing.assert_allclose(scanned.trainable["w"], looped.trainable["w"], rtol=1e-6)
    assert int(scanned.step) == int(looped.step) == 20 and int(scanned.releases) == 40
    assert int(scanned.unanimous) == int(looped.unanimous) == int(jnp.sum(stats["unanimous"]))
    assert charges.label == "paczero/zpl" and np.all(np.asarray(charges.nats) == 0.0)


def _disagreeing_pool():
    """Labels drawn at random: the subsets' mean differences disagree in sign at w = 0."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, D)).astype(np.float32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(rng.integers(0, 2, N), jnp.int32)}


def test_zpl_release_is_a_function_of_the_key_only():
    cfg = ZOConfig("zpl", steps=4, learning_rate=0.1, l2_clip=5.0, num_subsets=M,
                   num_directions=16)
    pool, s = _disagreeing_pool(), state_of(cfg)
    run = jax.jit(lambda s, k: step(cfg, loss, s, pool, k)[2])
    a, b = run(s, jax.random.key(1)), run(s, jax.random.key(1))
    assert int(a["unanimous"]) <= 12  # at least 4 of the 16 releases are coins
    np.testing.assert_array_equal(a["release"], b["release"])
    other = run(s, jax.random.key(2))
    assert not np.array_equal(a["release"], other["release"])  # P(equal) <= 2^-4 per draw...
    assert int(a["unanimous"]) == int(other["unanimous"])  # ...and the unanimous ones agree
    agree = np.asarray(a["release"]) == np.asarray(other["release"])
    assert agree.sum() >= int(a["unanimous"])
    # the secret index does not enter: another secret, same key, same release
    moved = s._replace(secret=(s.secret + 3) % M)
    np.testing.assert_array_equal(run(moved, jax.random.key(1))["release"], a["release"])


def test_mi_two_phase_equals_the_reference_composition():
    # The two phases against MI written out from the lower-level pieces: the two-point
    # differences at the public direction keys, the subset signs, the per-step budget split
    # over K, `mi_release` with the generator of the signals' noise key, then θ − η_t (1/K)
    # Σ Y_k z_k with the regenerated directions.
    cfg = ZOConfig("mi", steps=6, learning_rate=0.1, l2_clip=5.0, num_subsets=M,
                   num_directions=2, mi_budget=0.3)
    pool, s = make_pool(), state_of(cfg)
    host = mi_init_host(M)
    device = jax.jit(lambda s, k: mi_device_phase(cfg, loss, s, pool, k))
    update = jax.jit(lambda s, r: mi_apply(cfg, s, r))
    theta, logp, used = start(), np.full(M, -math.log(M)), 0.0
    membership, secret = np.asarray(s.membership), int(s.secret)
    differences = jax.jit(lambda th, k: two_point_differences(loss, th, None, pool, k, 1e-3))
    regenerate = jax.jit(apply_directions)
    for t in range(cfg.steps):
        signals = device(s, step_key(s))
        host, release, nats = mi_host_release(cfg, host, signals)
        s = update(s, release)
        keys = direction_keys(jax.random.key(12), t, 2)
        g = jnp.stack([differences(theta, k) for k in keys])
        signs = np.asarray(subset_signs(subset_means(clip_differences(g, 5.0),
                                                     jnp.asarray(membership))))
        np.testing.assert_array_equal(np.asarray(signals.signs), signs)
        rng, beta = host_generator(signals.noise_key), per_step_budget(0.3, used, t, 6) / 2
        values = []
        for j in range(2):
            rel, logp = mi_release(signs[j], secret, logp, beta, rng, limit=0.3 - used)
            values.append(rel.value)
            used += rel.charged
        np.testing.assert_array_equal(release.values, values)
        assert host.log_posterior.tobytes() == logp.tobytes()
        assert nats == pytest.approx(sum(release.charged), rel=1e-15)
        theta = regenerate(theta, keys, jnp.asarray(values, jnp.float32),
                           schedule(cfg)(t))
        np.testing.assert_allclose(s.trainable["w"], theta["w"], rtol=1e-6, atol=1e-7)
    assert host.mi_used == pytest.approx(used) and 0 < used <= 0.3
    assert not np.allclose(special.softmax(logp), 1 / M)  # the posterior moved


@pytest.mark.parametrize("k", [1, 2])
def test_pseudo_gradient_with_optax_sgd_equals_the_mirror_fast_path(k):
    # MeZO releases the mean difference itself, so the two paths see the same Y up to the
    # rounding of θ; K = 1 takes the mirror update, K = 2 the regenerated directions.
    cfg = ZOConfig("mezo", steps=10, learning_rate=0.1, l2_clip=5.0, num_directions=k)
    pool = make_pool()
    sgd = optax.sgd(schedule(cfg))
    fast = jax.jit(lambda s: step(cfg, loss, s, pool, step_key(s))[0])
    opt = jax.jit(lambda s: step(cfg, loss, s, pool, step_key(s), optimizer=sgd)[0])
    a, b = state_of(cfg), state_of(cfg, optimizer=sgd)
    for _ in range(cfg.steps):
        a, b = fast(a), opt(b)
    for x, y in zip(jax.tree.leaves(a.trainable), jax.tree.leaves(b.trainable), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(a.trainable["w"]).max()) > 1e-2  # the runs moved
    # Adam is just another optimiser on the same pseudo-gradient
    adam = promotion_safe(optax.adam(0.05))
    c = state_of(cfg, optimizer=adam)
    adam_step = jax.jit(lambda c: step(cfg, loss, c, pool, step_key(c), optimizer=adam)[0])
    for _ in range(3):
        c = adam_step(c)
    assert int(c.opt_state[0].count) == 3 and not np.allclose(c.trainable["w"], 0.0)
    with pytest.raises(ValueError, match="no optimiser state"):
        step(cfg, loss, state_of(cfg), pool, jax.random.key(0), optimizer=adam)


def test_dpzo_step_charges_its_static_event_and_reports_overflow():
    cfg = ZOConfig("dpzo", steps=8, learning_rate=0.05, l2_clip=5.0, num_directions=2,
                   target_epsilon=2.0, dp_batch_size=8)
    sigma = dpzo_noise_multiplier(cfg, N)
    pool = make_pool()
    s = state_of(cfg)
    run = jax.jit(lambda s, k: step(cfg, loss, s, pool, k, noise_multiplier=sigma))
    out, charge, stats = run(s, jax.random.key(4))
    assert charge.event == dpzo_step_event(sigma, num_directions=2, q=8 / N)
    assert charge.label == "paczero/dpzo" and not bool(stats["overflow"])
    np.testing.assert_array_equal(run(s, jax.random.key(4))[2]["release"], stats["release"])
    other = run(s, jax.random.key(5))[2]
    assert not np.allclose(other["release"], stats["release"])
    with pytest.raises(ValueError, match="needs noise_multiplier"):
        step(cfg, loss, s, pool, jax.random.key(4))
    with pytest.raises(ValueError, match="mi_device_phase"):
        step(ZOConfig("mi", steps=2, learning_rate=0.1, mi_budget=0.1, num_subsets=M), loss,
             s, pool, jax.random.key(4))
