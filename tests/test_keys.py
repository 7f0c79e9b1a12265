"""Key independence, tested on outputs: the batch draw and the noise draw of a private step come
from unrelated random streams, and both are fresh at every step.

No test here replays a key schedule (which split feeds which draw): each observes what the
public functions return and checks a statistical property that any correct schedule has and the
usual schedule bugs break. The observable model: a trainable ``w`` of dimension D whose loss
gradient is exactly zero, so the released gradient is pure noise (``noise * b / (z C)`` is a
standard normal vector), and a loss equal to the example's id, so the per-example losses a step
reports name the examples it drew.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax import privacy as pv
from pavejax.merging import train as mt

N, B, D, Z, C = 4000, 200, 10_000, 1.0, 1.0
Q = B / N
DATA = {"id": jnp.arange(N, dtype=jnp.float32)}
W0 = {"w": jnp.zeros(D, jnp.float32)}


def _id_loss(trainable, frozen, example):
    # Loss = the example's id (so the step's losses name its batch); gradient exactly 0.
    return example["id"] + 0.0 * jnp.sum(trainable["w"])


def _dp_config():
    return pv.DPConfig(C, Z, pv.SamplingConfig("poisson", dataset_size=N, batch_size=B))


def _observe(grad, info):
    """(standard-normal noise vector (D,), sorted ids of the examples the step drew)."""
    noise = np.asarray(grad["w"], np.float64) * B / (Z * C)
    ids = np.asarray(info.losses)[np.asarray(info.mask)].astype(np.int64)
    return noise, np.sort(ids)


def _assert_fresh_every_step(noises, batches):
    # Consecutive noise vectors: sample correlation of two independent N(0, I_D) has sd 1/sqrt(D).
    for a, b in zip(noises, noises[1:]):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(D)
    # Consecutive batches: independent Poisson draws share ~ Binomial(N, q^2) examples (10 here);
    # one batch drawn twice shares all ~200.
    overlap = sum(len(np.intersect1d(s, t)) for s, t in zip(batches, batches[1:]))
    pairs = len(batches) - 1
    mean, sd = pairs * N * Q**2, math.sqrt(pairs * N * Q**2 * (1 - Q**2))
    assert abs(overlap - mean) < 5 * sd


def _run_dp_gradient(keys):
    dp = pv.DPGradient(_id_loss, _dp_config())
    return [_observe(*dp(W0, None, DATA, k)[:2]) for k in keys]


def test_dp_gradient_noise_is_standard_and_batch_is_poisson(key):
    # Checks the observation model itself, so the tests below measure what they claim.
    (noise, ids), = _run_dp_gradient([key])
    assert abs(noise.std() - 1) < 5 / math.sqrt(2 * D) and abs(noise.mean()) < 5 / math.sqrt(D)
    assert abs(len(ids) - B) < 5 * math.sqrt(B) and len(np.unique(ids)) == len(ids)


def test_no_batch_draw_is_aligned_with_any_noise_draw(key):
    # If the sampler and the noise read one random stream (the same key, or one draw's key reused
    # by another), example i's inclusion and noise coordinate i are both monotone functions of
    # the same stream word: the noise at the drawn ids sits in the far left tail (mean ~ -2 at
    # q = 0.05). Checked for every pair of (noise of call s, batch of call t), s = t included.
    obs = _run_dp_gradient(jax.random.split(key, 4))
    for noise, _ in obs:
        for _, ids in obs:
            assert abs(noise[ids].mean()) < 5 / math.sqrt(len(ids))


def test_dp_gradient_does_not_feed_the_callers_key_to_either_draw(key):
    # JAX's discipline: a key handed in is consumed by splitting, never drawn from directly.
    # Drawing the batch or the noise straight from the caller's key is how both draws end up on
    # one key (``k_sample = k_noise = key``). This is a tripwire for that refactor, not a proof of
    # independence (the statistical tests above and below carry that).
    (noise, ids), = _run_dp_gradient([key])
    idx, mask, _ = _dp_config().sampling.sample(key)
    assert not np.array_equal(ids, np.sort(np.asarray(idx)[np.asarray(mask)]))
    raw = pv.gaussian_noise_like(key, W0, 1.0)["w"]
    assert abs(np.corrcoef(noise, np.asarray(raw, np.float64))[0, 1]) < 5 / math.sqrt(D)


class _Recording(pv.DPGradient):
    """A DPGradient that keeps what each call released (observation only, nothing altered)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def __call__(self, trainable, frozen, data, key):
        out = super().__call__(trainable, frozen, data, key)
        self.seen.append(_observe(*out[:2]))
        return out


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_driver_draws_fresh_batch_and_noise_every_step(key, steps_per_call):
    # The one driver (pavejax.training.run) behind DP-S-PAVE, DP-SAM and PACZero hands every
    # step its own key, also when several steps run in one lax.scan.
    from pavejax.accounting import Ledger
    from pavejax.training import Charge, run

    cfg = _dp_config()

    def step(w, data, k):
        grad, info = pv.private_gradient(_id_loss, w, None, data, k, cfg)
        return w, Charge(cfg.step_event()), (grad, info)

    chunks = []

    def check(stats):  # the driver shows every call's stacked statistics to its check
        pv.check_step(stats[1])
        chunks.append(jax.tree.map(np.asarray, stats))

    steps = 4
    out = run(step, W0, key, steps, batch=DATA, ledger=Ledger("add_remove"),
              steps_per_call=steps_per_call, progress=False, check=check)
    seen = [_observe(*jax.tree.map(lambda x, i=i: x[i], c))
            for c in chunks for i in range(c[1].losses.shape[0])]
    assert out.steps == steps and len(seen) == steps
    assert sum(e.count for e in out.ledger.entries) == steps
    noises, batches = zip(*seen)
    _assert_fresh_every_step(noises, batches)


def test_merging_trainer_draws_fresh_batch_and_noise_every_step(key):
    # The released descent gradient of each step is state.prev_grad; the loss of a step is the
    # mean id of its batch, which a repeated batch repeats exactly.
    cfg = mt.MergeTrainConfig(dataset_size=N, steps=3, mode="none", noise_multiplier=Z,
                              batch_size=B, l2_clip=C, anchor=0.0, optimizer="sgd",
                              learning_rate=1.0)
    noises = []
    res = mt.train_task(_id_loss, W0, None, DATA, key, cfg,
                        callback=lambda k, st: noises.append(
                            np.asarray(st.prev_grad["w"], np.float64) * B / (Z * C)))
    assert len(noises) == cfg.steps
    for a, b in zip(noises, noises[1:]):
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(D)
    # Mean id of a Poisson batch: sd ~ N / sqrt(12 B) ~ 82, so equal losses mean equal batches.
    assert len(set(res.losses)) == cfg.steps
