"""Automatic microbatch size (pavejax.privacy.autotune): tiny models, CPU, compile-only search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.privacy import (
    DPConfig,
    DPGradient,
    MicrobatchDoesNotFitError,
    SamplingConfig,
    auto_microbatch_size,
    autotune,
    clear_autotune_cache,
    compiled_temp_bytes,
    data_mesh,
    noisy_gradient,
    private_gradient,
)

B = 16


def loss_fn(w, frozen, ex):
    h = jnp.tanh(ex["x"] @ w["a"])
    return jnp.sum((h @ w["b"] - ex["y"]) ** 2)


def _setup():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    trainable = {"a": 0.3 * jax.random.normal(k1, (32, 64)),
                 "b": 0.3 * jax.random.normal(k2, (64, 4))}
    batch = {"x": jax.random.normal(k3, (B, 32)), "y": jnp.ones((B, 4))}
    mask = jnp.arange(B) < B - 3
    # l2_clip small enough that clipping is active, so the chunked sums are really compared.
    cfg = DPConfig(0.5, 1.0, SamplingConfig("fixed", dataset_size=64, batch_size=B))
    return trainable, batch, mask, cfg


KEY = jax.eval_shape(lambda: jax.random.key(0))


def _need(mb, trainable, batch, mask, cfg, mesh=None):
    step = functools.partial(noisy_gradient, loss_fn, config=cfg, mesh=mesh, microbatch_size=mb)
    return compiled_temp_bytes(step, trainable, None, batch, mask, KEY)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_autotune_cache()
    yield
    clear_autotune_cache()


def test_chosen_is_the_largest_divisor_that_fits():
    trainable, batch, mask, cfg = _setup()
    need = {mb: _need(mb, trainable, batch, mask, cfg) for mb in (1, 2, 4, 8, 16)}
    assert need[1] < need[16], need  # the per-example gradients dominate
    budget = (need[4] + need[8]) // 2
    mb = auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                              memory_budget_bytes=budget)
    assert B % mb == 0 and mb < B
    assert need[mb] <= budget
    larger = [d for d in (1, 2, 4, 8, 16) if d > mb][0]
    assert need[larger] > budget


def test_abstract_inputs_and_cache(monkeypatch):
    trainable, batch, mask, cfg = _setup()
    budget = _need(2, trainable, batch, mask, cfg)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            (trainable, batch, mask))
    mb = auto_microbatch_size(loss_fn, abstract[0], None, abstract[1], abstract[2], cfg,
                              memory_budget_bytes=budget)
    assert mb >= 2 and _need(mb, trainable, batch, mask, cfg) <= budget

    def no_compile(*a, **k):
        raise AssertionError("a cached result must not compile")

    monkeypatch.setattr(autotune, "compiled_temp_bytes", no_compile)
    again = auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                                 memory_budget_bytes=budget)
    assert again == mb


def test_huge_budget_gives_the_whole_batch():
    trainable, batch, mask, cfg = _setup()
    assert auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                                memory_budget_bytes=1 << 40) == B


def test_too_small_budget_says_what_microbatch_1_needs():
    trainable, batch, mask, cfg = _setup()
    need1 = _need(1, trainable, batch, mask, cfg)
    with pytest.raises(MicrobatchDoesNotFitError, match=f"needs {need1} bytes"):
        auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                             memory_budget_bytes=need1 - 1)
    with pytest.raises(ValueError, match="memory_budget_bytes must be a positive int"):
        auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg, memory_budget_bytes=0)


def test_auto_size_does_not_change_the_result():
    trainable, batch, mask, cfg = _setup()
    budget = _need(2, trainable, batch, mask, cfg)
    mb = auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                              memory_budget_bytes=budget)
    assert 1 < mb < B
    key = jax.random.key(7)
    g_mb, info_mb = jax.jit(functools.partial(noisy_gradient, loss_fn, config=cfg,
                                              microbatch_size=mb))(trainable, None, batch, mask,
                                                                   key)
    g, info = jax.jit(functools.partial(noisy_gradient, loss_fn, config=cfg))(
        trainable, None, batch, mask, key)
    assert int(info.num_clipped) > 0
    for a, b in zip(jax.tree.leaves(g_mb), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info_mb.norms, info.norms, rtol=1e-5)
    assert int(info_mb.num_clipped) == int(info.num_clipped)


@pytest.mark.skipif(jax.local_devices()[0].memory_stats() is not None,
                    reason="the device reports memory_stats, so a default budget exists")
def test_no_budget_without_memory_stats_is_a_clear_error():
    trainable, batch, mask, cfg = _setup()
    with pytest.raises(ValueError, match="pass memory_budget_bytes"):
        auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg)
    dp = DPGradient(loss_fn, cfg, microbatch_size="auto")
    data = {"x": jnp.ones((64, 32)), "y": jnp.ones((64, 4))}
    with pytest.raises(ValueError, match="pass memory_budget_bytes"):
        dp(trainable, None, data, jax.random.key(0))


def test_dpgradient_auto_end_to_end():
    trainable, _, _, cfg = _setup()
    data = {"x": jax.random.normal(jax.random.key(5), (64, 32)), "y": jnp.ones((64, 4))}
    dp = DPGradient(loss_fn, cfg, microbatch_size="auto", memory_budget_bytes=1)
    assert dp.pure is None
    with pytest.raises(MicrobatchDoesNotFitError):
        dp(trainable, None, data, jax.random.key(0))
    step = functools.partial(private_gradient, loss_fn, config=cfg, microbatch_size=2)
    budget = compiled_temp_bytes(step, trainable, None, data, KEY)  # microbatch 2 fits
    dp = DPGradient(loss_fn, cfg, microbatch_size="auto", memory_budget_bytes=budget)
    key = jax.random.key(11)
    grad, info, event = dp(trainable, None, data, key)
    assert isinstance(dp.microbatch_size, int) and 2 <= dp.microbatch_size < B
    assert B % dp.microbatch_size == 0
    ref_grad, ref_info, _ = DPGradient(loss_fn, cfg)(trainable, None, data, key)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert event == cfg.step_event()
    # The size is fixed after the first call; later calls reuse the compiled step.
    chosen = dp.microbatch_size
    dp(trainable, None, data, jax.random.key(12))
    assert dp.microbatch_size == chosen


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (virtual) devices")
def test_mesh_uses_the_per_device_batch():
    trainable, batch, mask, cfg = _setup()
    mesh = data_mesh(2)
    mb = auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                              memory_budget_bytes=1 << 40, mesh=mesh)
    assert mb == B // 2


def test_default_budget_from_memory_stats(monkeypatch):
    trainable, batch, mask, cfg = _setup()
    need = {mb: _need(mb, trainable, batch, mask, cfg) for mb in (4, 8)}
    args_bytes = autotune._nbytes((trainable, None, batch, mask, KEY))
    limit = int(((need[4] + need[8]) // 2 + args_bytes) / 0.5)

    class FakeDevice:
        platform = "fake"

        def memory_stats(self):
            return {"bytes_limit": limit}

    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [FakeDevice()])
    budget = autotune.default_memory_budget(trainable, None, batch, mask, KEY,
                                            budget_fraction=0.5)
    assert abs(budget - (need[4] + need[8]) // 2) <= 1
    assert auto_microbatch_size(loss_fn, trainable, None, batch, mask, cfg,
                                budget_fraction=0.5) == 4
    with pytest.raises(ValueError, match="budget_fraction"):
        autotune.default_memory_budget(trainable, budget_fraction=1.5)
