"""Every private trainer on 8 virtual devices (batch sharded, params replicated) equals one device
with tight clipping active, up to float summation order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax import lora
from pavejax.paczero import train as zo_train, two_point_differences
from pavejax.privacy import ClipConfig, clipped_sum, data_mesh, pad_batch, replicate, shard_batch
from tests import _scale_problems as P


@pytest.fixture(scope="module")
def mesh8():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices; tests/conftest.py sets them")
    return data_mesh(8)


def _close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_pad_batch_to_a_device_multiple():
    batch = {"x": jnp.arange(5, dtype=jnp.float32)}
    out, mask = pad_batch(batch, jnp.asarray([True, True, False, True, True]), 8)
    np.testing.assert_array_equal(out["x"], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(mask, [1, 1, 0, 1, 1, 0, 0, 0])
    out, mask = pad_batch({"x": jnp.ones(2)}, jnp.ones(2, bool), 8)  # more padding than rows
    assert out["x"].shape == (8,) and int(mask.sum()) == 2
    same, _ = pad_batch(batch, jnp.ones(5, bool), 5)
    assert same is batch


def test_dp_sam_eight_devices_equal_one(mesh8):
    clip = clipped_sum(P.sam_loss, P.sam_params(), None, P.sam_data(), None,
                       ClipConfig(P.TIGHT))
    assert int(clip.num_clipped) == 64  # every example's gradient is longer than C
    one, many = P.run_sam(), P.run_sam(mesh=mesh8)
    _close(many.params, one.params)
    np.testing.assert_allclose(many.losses, one.losses, rtol=1e-5)
    assert many.ledger == one.ledger
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), one.params,
                         P.sam_params())
    assert max(jax.tree.leaves(moved)) > 1e-3  # the comparison is not between two no-ops


def test_dp_s_pave_eight_devices_equal_one(mesh8):
    bb, cfg = P.spec_backbone(), P.spec_config()
    inputs, targets = P.spec_task()
    B, A = lora.init_lora(jax.random.key(5), bb.params, P._kernels, cfg.lora)

    def example_loss(b, frozen, ex):
        merged = lora.apply_lora(bb.params, b, A, cfg.lora)
        logits = P.spec_logits(merged, {"x": ex["x"][None]}, None)[0]
        return -jnp.sum(ex["t"] * jax.nn.log_softmax(logits))

    data = {"x": jnp.asarray(inputs["x"]), "t": jnp.asarray(targets)}
    assert int(clipped_sum(example_loss, B, None, data, None,
                           ClipConfig(P.TIGHT)).num_clipped) > 0
    one, many = P.run_spec(), P.run_spec(mesh=mesh8)
    np.testing.assert_allclose(many.spec.vector, one.spec.vector, rtol=1e-4, atol=1e-6)
    assert np.abs(one.spec.vector).max() > 1e-3
    assert many.ledger == one.ledger


def test_dp_s_pave_microbatch_larger_than_the_data(mesh8):
    # 12 rows, microbatch 32, 8 devices: the microbatch shrinks to the batch (no padding past
    # the device multiple), and the release equals one device's
    inputs, targets = P.spec_task(n=12)
    cfg = P.spec_config(1, microbatch_size=32)
    runs = [P.generate_spec(P.spec_logits, P.spec_backbone(), P._kernels, inputs, targets,
                            jax.random.key(5), cfg, kind="user", mesh=mesh,
                            noise_key=jax.random.key(1)) for mesh in (None, mesh8)]
    np.testing.assert_allclose(runs[1].spec.vector, runs[0].spec.vector, rtol=1e-4, atol=1e-6)
    assert runs[0].spec.info["num_examples"] == 12


@pytest.mark.parametrize("mechanism", ["dpzo", "mi"])
def test_paczero_on_a_sharded_pool_equals_one_device(mesh8, mechanism):
    cfg = P.zo_config(mechanism, eval_every=0)
    pool, start = P.zo_pool(), P.zo_start()
    g = two_point_differences(P.zo_loss, start, None, pool, jax.random.key(0),
                              cfg.perturbation_scale)
    assert int(jnp.sum(jnp.abs(g) > P.TIGHT)) > 0  # clipping is active
    pool8, start8 = shard_batch(pool, mesh8), replicate(start, mesh8)
    g8 = jax.jit(two_point_differences, static_argnums=0)(
        P.zo_loss, start8, None, pool8, jax.random.key(0), cfg.perturbation_scale)
    assert len(g8.sharding.device_set) == 8 and not g8.sharding.is_fully_replicated
    np.testing.assert_allclose(g8, g, rtol=1e-5, atol=1e-6)  # the forward passes split 8 ways
    one = zo_train(cfg, P.zo_loss, P.zo_init(cfg), None, pool)
    many = zo_train(cfg, P.zo_loss, P.zo_init(cfg)._replace(trainable=start8), None, pool8)
    _close(many.trainable, one.trainable)
    assert [e.nats for e in many.ledger.mi_entries] == pytest.approx(
        [e.nats for e in one.ledger.mi_entries], rel=1e-9)
    assert many.ledger.entries == one.ledger.entries
    assert int(many.state.releases) == int(one.state.releases)
    assert int(many.state.unanimous) == int(one.state.unanimous)
