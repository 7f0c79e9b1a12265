"""Empirical audit of the private gradient: the accountant's epsilon is never beaten, and a
deliberately under-noised variant is caught."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax import privacy as pv
from pavejax.accounting import Ledger
from pavejax.audit import epsilon_lower_bound

DELTA = 1e-5
CLIP = 1.0
SIGMA = 2.0
RUNS = 3000


def _loss(trainable, frozen, example):
    # Gradient w.r.t. w is example["x"]: the canary's gradient is a chosen vector.
    return jnp.dot(trainable["w"], example["x"])


def _datasets():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(15, 6)).astype(np.float32) * 0.1
    canary = np.zeros((1, 6), np.float32)
    canary[0, 0] = 50.0  # clipped to norm CLIP along e_0
    with_canary = {"x": jnp.asarray(np.concatenate([base, canary]))}
    without = {"x": jnp.asarray(np.concatenate([base, np.zeros_like(canary)]))}
    mask_in = jnp.ones(16, bool)
    mask_out = jnp.arange(16) < 15  # the canary row is absent (add/remove neighbour)
    return with_canary, mask_in, without, mask_out


def _release(noise_fn, batch, mask, keys):
    params = {"w": jnp.zeros(6)}
    clip = pv.ClipConfig(CLIP)

    def one(key):
        s = pv.clipped_sum(_loss, params, None, batch, mask, clip).grad_sum
        return noise_fn(s, key)["w"][0]  # score: coordinate along the canary direction

    return np.asarray(jax.jit(jax.vmap(one))(keys))


def _correct_noise(s, key):
    return pv.privatize_sum(s, key, noise_multiplier=SIGMA, sensitivity=CLIP,
                            expected_batch_size=16.0)


def _broken_noise(s, key):
    # A classic bug: the noise std meant for the *mean* is added to the *sum*.
    return pv.privatize_sum(s, key, noise_multiplier=SIGMA / 16.0, sensitivity=CLIP,
                            expected_batch_size=16.0)


@functools.cache
def _claimed_epsilon():
    ledger = Ledger("add_remove")
    cfg = pv.DPConfig(CLIP, SIGMA, pv.SamplingConfig("full", dataset_size=16))
    ledger.record(cfg.step_event())
    return ledger.epsilon(DELTA)


@pytest.mark.parametrize("variant", ["correct", "broken"])
def test_audit_epsilon_vs_accountant(variant):
    noise = _correct_noise if variant == "correct" else _broken_noise
    d_in, m_in, d_out, m_out = _datasets()
    keys = jax.random.split(jax.random.key(42), 2 * RUNS)
    s_in = _release(noise, d_in, m_in, keys[:RUNS])
    s_out = _release(noise, d_out, m_out, keys[RUNS:])
    lower = epsilon_lower_bound(s_in, s_out, delta=DELTA, alpha=0.05)
    claimed = _claimed_epsilon()
    assert 1.5 < claimed < 2.5  # one Gaussian release with sigma = 2 (PLD, delta = 1e-5)
    if variant == "correct":
        assert lower <= claimed
        assert lower > 0.1  # the audit has power: it does detect the canary's real effect
    else:
        assert lower > claimed, f"audit missed the under-noised mechanism ({lower} <= {claimed})"
