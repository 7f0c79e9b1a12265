"""Data-parallel private gradients on 8 virtual CPU devices equal one device, clipping active."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pavejax import privacy as pv
from tests.test_privacy import FROZEN, _data, _loss, _mlp_params

TIGHT = 0.01  # far below typical gradient norms: every example is clipped


def _close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def mesh8():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    return pv.data_mesh(8)


def test_eight_devices_equal_one_with_tight_clipping(mesh8):
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(1), 32)
    mask = jnp.arange(32) < 29
    cfg = pv.ClipConfig(TIGHT)
    one = jax.jit(lambda p, b, m: pv.clipped_sum(_loss, p, FROZEN, b, m, cfg))(params, data, mask)
    assert int(one.num_clipped) == 29
    many = jax.jit(lambda p, b, m: pv.data_parallel_clipped_sum(_loss, p, FROZEN, b, m, cfg,
                                                                mesh8))(params, data, mask)
    np.testing.assert_allclose(np.asarray(many.norms), np.asarray(one.norms), rtol=1e-5)
    _close(many.grad_sum, one.grad_sum)
    assert int(many.num_clipped) == 29


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_data_parallel_with_microbatches_and_ghost_equals_one_device(mesh8, method):
    """Microbatches inside shard_map (the scan's counters are per-device values) and ghost
    clipping under the data-parallel path both give the one-device clipped sum."""
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(5), 32)
    mask = jnp.arange(32) < 30
    one = jax.jit(lambda p, b, m: pv.clipped_sum(_loss, p, FROZEN, b, m,
                                                 pv.ClipConfig(TIGHT)))(params, data, mask)
    cfg = pv.ClipConfig(TIGHT, method=method)
    many = jax.jit(lambda p, b, m: pv.data_parallel_clipped_sum(
        _loss, p, FROZEN, b, m, cfg, mesh8, microbatch_size=2))(params, data, mask)
    np.testing.assert_allclose(np.asarray(many.norms), np.asarray(one.norms), rtol=1e-5)
    _close(many.grad_sum, one.grad_sum)
    assert int(many.num_clipped) == int(one.num_clipped) == 30


def test_gspmd_jit_over_sharded_batch_equals_one_device(mesh8):
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(2), 32)
    cfg = pv.ClipConfig(TIGHT)
    one = jax.jit(lambda p, b: pv.clipped_sum(_loss, p, FROZEN, b, None, cfg,
                                              microbatch_size=8))(params, data)
    sharded = pv.shard_batch(data, mesh8)
    many = jax.jit(lambda p, b: pv.clipped_sum(_loss, p, FROZEN, b, None, cfg,
                                               microbatch_size=8))(
        pv.replicate(params, mesh8), sharded)
    _close(many.grad_sum, one.grad_sum)


def test_the_equivalence_check_catches_the_shard_map_pitfall(mesh8):
    """Without pcast, per-example gradients are summed across shards before clipping."""
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(3), 32)
    cfg = pv.ClipConfig(TIGHT)
    one = jax.jit(lambda p, b: pv.clipped_sum(_loss, p, FROZEN, b, None, cfg))(params, data)

    def naive_local(p, b):
        r = pv.clipped_sum(_loss, p, FROZEN, b, None, cfg)
        return jax.lax.psum(r.grad_sum, "data"), r.norms

    naive = jax.shard_map(naive_local, mesh=mesh8, in_specs=(P(), P("data")),
                          out_specs=(P(), P("data")))
    grad_sum, norms = jax.jit(naive)(params, data)
    assert not np.allclose(np.asarray(norms), np.asarray(one.norms), rtol=1e-3)
    with pytest.raises(AssertionError):
        _close(grad_sum, one.grad_sum, rtol=1e-3)


def test_dp_gradient_on_mesh_adds_noise_once(mesh8):
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(4), 40)
    cfg = pv.DPConfig(l2_clip=TIGHT, noise_multiplier=1.0,
                      sampling=pv.SamplingConfig("poisson", dataset_size=40, batch_size=20))
    key = jax.random.key(7)
    g1, _, _ = pv.DPGradient(_loss, cfg)(params, FROZEN, data, key)
    g8, info, _ = pv.DPGradient(_loss, cfg, mesh=mesh8)(params, FROZEN, data, key)
    assert info.mask.shape[0] % 8 == 0
    _close(g8, g1, rtol=1e-4, atol=1e-6)


def test_batch_not_divisible_by_devices_is_refused(mesh8):
    params = _mlp_params(jax.random.key(0))
    data = _data(jax.random.key(5), 12)
    with pytest.raises(ValueError, match="not divisible"):
        pv.data_parallel_clipped_sum(_loss, params, FROZEN, data, None, pv.ClipConfig(1.0),
                                     mesh8)
