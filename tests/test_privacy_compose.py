"""The DP engine as composable pieces: the optax privatiser, traced noise multipliers, flags
checked on the host, and meshes with Explicit axes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pavejax import privacy as pv
from pavejax.accounting import Ledger, gaussian_step_event
from tests.test_privacy import FROZEN, _data, _loss, _mlp_params

D = 4096  # noise coordinates per release: enough for tight statistical checks


def _plan(z=1.3, clip=0.7, n=100, b=20):
    return pv.DPConfig(clip, z, pv.SamplingConfig("poisson", dataset_size=n, batch_size=b))


def test_privatizer_update_is_privatize_sum_with_its_own_key_per_release():
    plan, key = _plan(), jax.random.key(7)
    tx = plan.privatizer(key)
    sums = {"w": jnp.ones((D,)), "b": jnp.full((3,), 2.0)}
    state = tx.init(sums)
    outs = []
    for t in range(3):
        out, state = jax.jit(tx.update)(sums, state)
        ref = pv.privatize_sum(sums, jax.random.fold_in(key, t), noise_multiplier=1.3,
                               sensitivity=0.7, expected_batch_size=20.0)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)  # jit vs eager rounding
        outs.append(np.asarray(out["w"]))
    assert int(state.count) == 3
    # the release is (S + N(0, (z C)^2)) / b: check the noise std against the closed form
    noise = (outs[0] - 1.0 / 20.0) * 20.0
    assert abs(noise.std() / (1.3 * 0.7) - 1) < 5 / math.sqrt(2 * D)


def _fresh_noise_audit(tx, sums):
    """|correlation| of the noise of two consecutive releases, and whether it is plausible for
    independent draws (5 standard errors)."""
    state = tx.init(sums)
    a, state = tx.update(sums, state)
    b, _ = tx.update(sums, state)
    corr = np.corrcoef(np.asarray(a["w"]), np.asarray(b["w"]))[0, 1]
    return abs(corr) < 5 / math.sqrt(D)


def test_audit_flags_a_privatizer_that_reuses_its_noise():
    sums = {"w": jnp.zeros((D,))}
    good = _plan().privatizer(jax.random.key(1))
    assert _fresh_noise_audit(good, sums)

    # Deliberately broken: the count is never advanced, so every release repeats the noise
    # and the difference of two releases reveals the difference of the clipped sums exactly.
    def broken_update(updates, state, params=None):
        out, _ = good.update(updates, state, params)
        return out, state

    broken = optax.GradientTransformation(good.init, broken_update)
    assert not _fresh_noise_audit(broken, sums)


def test_privatizer_in_an_optax_chain_under_scan_equals_the_loop():
    plan = _plan(z=0.8)
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(1), 100)
    tx = optax.chain(plan.privatizer(jax.random.key(5)), optax.sgd(0.1))

    def step(carry, key):
        p, s = carry
        draw = plan.sampling.sample(key)
        r = pv.clipped_sum(_loss, p, FROZEN, pv.take_batch(data, draw.indices), draw.mask,
                           plan.clip)
        u, s = tx.update(r.grad_sum, s, p)
        return (optax.apply_updates(p, u), s), draw.overflow

    keys = jax.random.split(jax.random.key(9), 6)
    (scanned, _), flags = jax.jit(lambda c: jax.lax.scan(step, c, keys))((params, tx.init(params)))
    pv.check_step({"overflow": flags})
    carry = (params, tx.init(params))
    for k in keys:
        carry, _ = jax.jit(step)(carry, k)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(carry[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_noise_multiplier_may_be_traced_for_a_vmapped_sweep():
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(3), 16)
    cfg = pv.DPConfig(0.5, 1.0, pv.SamplingConfig("full", dataset_size=16))
    zs = jnp.asarray([0.0, 0.5, 2.0])
    key = jax.random.key(4)

    def one(z):
        return pv.private_gradient(_loss, params, FROZEN, data, key, cfg, noise_multiplier=z)[0]

    swept = jax.jit(jax.vmap(one))(zs)
    for i, z in enumerate([0.0, 0.5, 2.0]):
        ref, _ = pv.private_gradient(_loss, params, FROZEN, data, key,
                                     pv.DPConfig(0.5, z, cfg.sampling))
        for a, b in zip(jax.tree.leaves(swept), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-7)
    # the noise is linear in z: (g(2) - g(0)) = 4 (g(0.5) - g(0)) with the same key
    for leaf in jax.tree.leaves(swept):
        np.testing.assert_allclose(leaf[2] - leaf[0], 4 * (leaf[1] - leaf[0]), rtol=1e-4,
                                   atol=1e-6)


def test_concrete_bad_noise_arguments_still_raise():
    g = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match="noise_multiplier"):
        pv.privatize_sum(g, jax.random.key(0), noise_multiplier=-1.0, sensitivity=1.0,
                         expected_batch_size=4.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        pv.gaussian_privatizer(jax.random.key(0), noise_multiplier=1.0, sensitivity=1.0,
                               expected_batch_size=0.0)


def test_private_gradient_jits_and_returns_flags_the_host_check_reads():
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(5), 8)
    data["x"] = data["x"].at[3, 0].set(jnp.nan)
    cfg = pv.DPConfig(1.0, 1.0, pv.SamplingConfig("full", dataset_size=8))
    grad, info = jax.jit(lambda k: pv.private_gradient(_loss, params, FROZEN, data, k, cfg))(
        jax.random.key(0))
    assert int(info.num_nonfinite) == 1 and not bool(info.overflow)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grad))  # row zeroed
    with pytest.raises(pv.NonFiniteError, match="NaN/Inf"):
        pv.check_step(info)
    with pytest.raises(pv.NonFiniteError):  # stacked flags of a scanned chunk
        pv.check_step({"num_nonfinite": jnp.asarray([0, 0, 2])})
    pv.check_step({"num_nonfinite": jnp.zeros(3, jnp.int32), "overflow": jnp.zeros(3, bool)})


def test_plan_event_is_the_accounting_builder_event():
    plan = _plan(z=1.1, n=1000, b=50)
    assert plan.step_event() == gaussian_step_event(1.1, q=0.05, sampling="poisson")
    led = Ledger("add_remove")
    led.record(plan.step_event(), count=10)
    assert 0 < led.epsilon(1e-5) < math.inf


@pytest.fixture(scope="module")
def explicit_mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def test_explicit_axis_mesh_equals_one_device_with_tight_clipping(explicit_mesh):
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(1), 32)
    mask = jnp.arange(32) < 29
    cfg = pv.ClipConfig(0.01)
    one = pv.clipped_sum(_loss, params, FROZEN, data, mask, cfg)
    rows = NamedSharding(explicit_mesh, P("data"))
    many = jax.jit(lambda p, b, m: pv.data_parallel_clipped_sum(_loss, p, FROZEN, b, m, cfg,
                                                                explicit_mesh))(
        params, jax.device_put(data, rows), jax.device_put(mask, rows))
    assert int(many.num_clipped) == int(one.num_clipped) == 29
    for a, b in zip(jax.tree.leaves(many.grad_sum), jax.tree.leaves(one.grad_sum)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # and the whole private step (sampling inside, padding to the device count) on that mesh
    sampling = pv.SamplingConfig("poisson", dataset_size=32, batch_size=8)
    dp_cfg = pv.DPConfig(0.01, 1.0, sampling)
    g1, _, _ = pv.DPGradient(_loss, dp_cfg)(params, FROZEN, data, jax.random.key(2))
    g8, _, _ = pv.DPGradient(_loss, dp_cfg, mesh=explicit_mesh)(params, FROZEN, data,
                                                                jax.random.key(2))
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
