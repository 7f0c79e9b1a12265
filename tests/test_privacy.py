"""Tests of the DP engine: clipping, clipped sum, microbatching, masks, noise, sampling."""

import math
from fractions import Fraction

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pavejax import privacy as pv
from pavejax.privacy.sampling import poisson_threshold


def _mlp_params(key, d_in=5, d_h=7, d_out=3):
    k1, k2 = jax.random.split(key)
    return {
        "dense1": {"kernel": jax.random.normal(k1, (d_in, d_h)) * 0.5, "bias": jnp.zeros(d_h)},
        "dense2": {"kernel": jax.random.normal(k2, (d_h, d_out)) * 0.5, "bias": jnp.zeros(d_out)},
    }


def _loss(trainable, frozen, example):
    h = jnp.tanh(example["x"] @ trainable["dense1"]["kernel"] + trainable["dense1"]["bias"])
    logits = h @ trainable["dense2"]["kernel"] + trainable["dense2"]["bias"]
    logits = logits * frozen["temperature"]
    return -jax.nn.log_softmax(logits)[example["y"]]


def _data(key, n, d_in=5, classes=3):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (n, d_in)) * 3.0,
            "y": jax.random.randint(ky, (n,), 0, classes)}


FROZEN = {"temperature": jnp.float32(1.0)}
_clipped_sum = jax.jit(pv.clipped_sum, static_argnums=(0, 5))


def _slow_clipped_sum(trainable, data, clip, mask=None):
    """Reference: one jax.grad per example, clipping in float64 numpy."""
    n = data["x"].shape[0]
    total = jax.tree.map(lambda p: np.zeros(p.shape, np.float64), trainable)
    grad_one = jax.jit(jax.grad(_loss))
    for i in range(n):
        if mask is not None and not mask[i]:
            continue
        ex = jax.tree.map(lambda x: x[i], data)
        g = grad_one(trainable, FROZEN, ex)
        g = jax.tree.map(lambda a: np.asarray(a, np.float64), g)
        norm = math.sqrt(sum(float(np.sum(a * a)) for a in jax.tree.leaves(g)))
        s = min(1.0, clip / norm)
        total = jax.tree.map(lambda t, a: t + s * a, total, g)
    return total


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol)


@settings(max_examples=40, deadline=None)
@given(
    g1=hnp.arrays(np.float32, (6, 4, 3), elements=st.floats(-1e3, 1e3, width=32)),
    g2=hnp.arrays(np.float32, (6, 5), elements=st.floats(-1e3, 1e3, width=32)),
    clip=st.floats(1e-3, 1e2),
    clipping=st.sampled_from(["joint", "per_layer"]),
)
def test_every_clipped_gradient_has_norm_at_most_bound(g1, g2, clip, clipping):
    grads = {"a": jnp.asarray(g1), "b": jnp.asarray(g2)}
    clipped, norms, _ = pv.clip_per_example(grads, clip, clipping=clipping)
    per_ex = np.asarray(pv.per_example_norms(clipped), np.float64)
    bound = clip if clipping == "joint" else clip * math.sqrt(2)
    assert np.all(per_ex <= bound * (1 + 1e-5) + 1e-6)
    # Examples already inside the bound are untouched.
    small = np.asarray(norms) <= clip
    if clipping == "joint" and small.any():
        # atol: XLA flushes float32 subnormals to zero.
        np.testing.assert_allclose(np.asarray(clipped["b"])[small], g2[small], rtol=1e-6,
                                   atol=1e-37)


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0])
def test_clipped_sum_matches_slow_loop(key, clip):
    params = _mlp_params(key)
    data = _data(jax.random.key(1), 12)
    r = jax.jit(lambda p, b: _clipped_sum(_loss, p, FROZEN, b, None, pv.ClipConfig(clip)))(
        params, data)
    _assert_tree_close(r.grad_sum, _slow_clipped_sum(params, data, clip), rtol=2e-5, atol=1e-6)
    if clip == 0.05:
        assert int(r.num_clipped) == 12  # the tight bound is really active


def test_microbatched_equals_single_pass(key):
    params = _mlp_params(key)
    data = _data(jax.random.key(2), 16)
    mask = jnp.arange(16) < 13
    full = _clipped_sum(_loss, params, FROZEN, data, mask, pv.ClipConfig(0.3))
    micro = pv.clipped_sum(_loss, params, FROZEN, data, mask, pv.ClipConfig(0.3),
                           microbatch_size=4)
    _assert_tree_close(full.grad_sum, micro.grad_sum, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(full.norms, micro.norms, rtol=1e-6)
    assert int(full.num_clipped) == int(micro.num_clipped)


def test_padding_mask_excludes_padded_rows_exactly(key):
    params = _mlp_params(key)
    real = _data(jax.random.key(3), 6)
    junk_nan = {"x": jnp.full((4, 5), jnp.nan), "y": jnp.zeros(4, jnp.int32)}
    junk_big = _data(jax.random.key(9), 4)
    mask = jnp.arange(10) < 6
    cfg = pv.ClipConfig(0.5)
    results = []
    for junk in (junk_nan, junk_big):
        padded = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), real, junk)
        results.append(_clipped_sum(_loss, params, FROZEN, padded, mask, cfg))
    # Whatever the padded rows hold, the release is bit-for-bit the same.
    for a, b in zip(jax.tree.leaves(results[0].grad_sum), jax.tree.leaves(results[1].grad_sum)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    r_real = _clipped_sum(_loss, params, FROZEN, real, None, cfg)
    _assert_tree_close(results[0].grad_sum, r_real.grad_sum, rtol=1e-5, atol=1e-6)
    assert int(results[0].num_nonfinite) == 0  # NaN padding is not counted as a bad example
    np.testing.assert_array_equal(np.asarray(results[0].norms[6:]), 0.0)


def test_per_layer_sensitivity_reported():
    cfg = pv.ClipConfig(2.0, clipping="per_layer")
    assert cfg.sensitivity(4) == pytest.approx(4.0)
    assert cfg.sensitivity(4, "replace_one") == pytest.approx(8.0)
    assert pv.ClipConfig(2.0).sensitivity(4, "replace_one") == pytest.approx(4.0)


def _embed_loss(trainable, frozen, example):
    h = trainable["embed"][example["ids"]]  # (T, D)
    pooled = jnp.mean(h, axis=0) @ trainable["out"]
    return jnp.sum(jnp.square(pooled - frozen["target"]))


def test_sparse_rows_equal_dense_per_example_gradients(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"embed": jax.random.normal(k1, (50, 4)), "out": jax.random.normal(k2, (4, 2))}
    ids = jax.random.randint(k3, (8, 6), 0, 10)  # few distinct ids: many repeats per example
    ids = ids.at[0].set(7)  # one example repeats a single id everywhere
    frozen = {"target": jnp.ones(2)}
    dense = _clipped_sum(_embed_loss, params, frozen, {"ids": ids}, None, pv.ClipConfig(0.2))
    sparse = _clipped_sum(_embed_loss, params, frozen, {"ids": ids}, None,
                            pv.ClipConfig(0.2, sparse_rows={"embed": "ids"}))
    np.testing.assert_allclose(sparse.norms, dense.norms, rtol=1e-5)
    _assert_tree_close(sparse.grad_sum, dense.grad_sum, rtol=1e-5, atol=1e-7)
    assert int(dense.num_clipped) > 0


def test_noise_std_within_statistical_tolerance(key):
    tree = {"w": jnp.zeros((200, 50)), "b": jnp.zeros(1000)}
    out = pv.privatize_sum(tree, key, noise_multiplier=1.5, sensitivity=0.4,
                           expected_batch_size=2.0)
    flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(out)])
    n = flat.size
    expected = 1.5 * 0.4 / 2.0
    # The sample std of n normals has relative std ~ 1/sqrt(2n); allow 5 of them.
    assert abs(flat.std() / expected - 1) < 5 / math.sqrt(2 * n)
    assert abs(flat.mean()) < 5 * expected / math.sqrt(n)
    # Leaves get independent noise.
    assert abs(np.corrcoef(np.asarray(out["w"]).ravel()[:1000], np.asarray(out["b"]))[0, 1]) < 0.15


def test_poisson_sampling_static_shape_and_rate(key):
    cfg = pv.SamplingConfig("poisson", dataset_size=1000, batch_size=50)
    assert cfg.q == pytest.approx(0.05)
    counts = []
    for i in range(60):
        idx, mask, overflow = cfg.sample(jax.random.fold_in(key, i))
        assert not bool(overflow)
        assert idx.shape == (cfg.max_batch,) and mask.shape == (cfg.max_batch,)
        real = np.asarray(idx)[np.asarray(mask)]
        assert len(np.unique(real)) == len(real)
        counts.append(int(mask.sum()))
    # Binomial(1000, 0.05): mean 50, sd ~6.9; the mean of 60 draws is within 4 sd / sqrt(60).
    assert abs(np.mean(counts) - 50) < 4 * 6.9 / math.sqrt(60)


def test_poisson_overflow_is_flagged_and_refused_not_truncated(key):
    cfg = pv.SamplingConfig("poisson", dataset_size=100, batch_size=50, max_batch=10)
    draw = jax.jit(cfg.sample)(key)  # the flag is an array: sampling runs under jit
    assert bool(draw.overflow) and int(draw.mask.sum()) == 10
    with pytest.raises(pv.BatchOverflowError, match="Raise max_batch"):
        pv.check_step(draw)
    data = _data(jax.random.key(1), 100)
    dp = pv.DPGradient(_loss, pv.DPConfig(1.0, 1.0, cfg))
    with pytest.raises(pv.BatchOverflowError):
        dp(_mlp_params(key), FROZEN, data, key)


def test_fixed_size_sampling(key):
    cfg = pv.SamplingConfig("fixed", dataset_size=30, batch_size=10)
    idx, mask, overflow = cfg.sample(key)
    assert len(np.unique(np.asarray(idx))) == 10 and bool(mask.all()) and not bool(overflow)


def test_dp_gradient_end_to_end_and_event(key):
    params = _mlp_params(key)
    data = _data(jax.random.key(4), 16)
    cfg = pv.DPConfig(l2_clip=0.5, noise_multiplier=0.0,
                      sampling=pv.SamplingConfig("full", dataset_size=16))
    grad, info, event = pv.DPGradient(_loss, cfg)(params, FROZEN, data, key)
    ref = _slow_clipped_sum(params, data, 0.5)
    _assert_tree_close(grad, jax.tree.map(lambda a: a / 16.0, ref), rtol=2e-5, atol=1e-7)
    assert event is not None


def test_dp_gradient_refuses_nan_gradients(key):
    params = _mlp_params(key)
    data = _data(jax.random.key(5), 8)
    data["x"] = data["x"].at[3, 0].set(jnp.nan)
    cfg = pv.DPConfig(l2_clip=1.0, noise_multiplier=1.0,
                      sampling=pv.SamplingConfig("full", dataset_size=8))
    with pytest.raises(ValueError, match="NaN/Inf"):
        pv.DPGradient(_loss, cfg)(params, FROZEN, data, key)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_clip_norm_rejected(bad):
    with pytest.raises(ValueError, match="l2_clip"):
        pv.ClipConfig(bad)


def test_bad_configs_rejected():
    with pytest.raises(ValueError, match="noise_multiplier"):
        pv.DPConfig(1.0, -0.5, pv.SamplingConfig("full", dataset_size=4))
    with pytest.raises(ValueError, match="relation"):
        pv.DPConfig(1.0, 1.0, pv.SamplingConfig("full", dataset_size=4), relation="swap")
    with pytest.raises(ValueError, match="empty data set"):
        pv.SamplingConfig("poisson", dataset_size=0, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        pv.SamplingConfig("poisson", dataset_size=10, batch_size=11)
    with pytest.raises(ValueError, match="microbatch_size"):
        pv.DPGradient(_loss, pv.DPConfig(1.0, 1.0, pv.SamplingConfig("full", dataset_size=4)),
                      microbatch_size=0)
    with pytest.raises(ValueError, match="not a multiple of microbatch_size"):
        pv.clipped_sum(_loss, _mlp_params(jax.random.key(0)), FROZEN,
                       _data(jax.random.key(0), 10), None, pv.ClipConfig(1.0), microbatch_size=4)
    with pytest.raises(ValueError, match="dataset_size"):
        cfg = pv.DPConfig(1.0, 1.0, pv.SamplingConfig("full", dataset_size=4))
        pv.DPGradient(_loss, cfg)(_mlp_params(jax.random.key(0)), FROZEN,
                                  _data(jax.random.key(0), 5), jax.random.key(0))


def test_dp_gradient_pads_poisson_batch_to_microbatch_multiple(key):
    params = _mlp_params(key)
    data = _data(jax.random.key(6), 30)
    sampling = pv.SamplingConfig("poisson", dataset_size=30, batch_size=10, max_batch=23)
    cfg = pv.DPConfig(l2_clip=0.5, noise_multiplier=0.0, sampling=sampling)
    grad, info, _ = pv.DPGradient(_loss, cfg, microbatch_size=4)(params, FROZEN, data, key)
    assert info.mask.shape == (24,) and not bool(info.mask[23])
    idx, mask, _ = sampling.sample(jax.random.split(key)[0])
    real = jax.tree.map(lambda x: x[np.asarray(idx)[np.asarray(mask)]], data)
    ref = _slow_clipped_sum(params, real, 0.5)
    _assert_tree_close(grad, jax.tree.map(lambda a: a / 10.0, ref), rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------ Poisson rate, exactly


def _words_as_u64(key, n):
    # The sampler's documented draw: example i's 64 bits are bits[0, i] (high) and bits[1, i].
    w = np.asarray(jax.random.bits(key, (2, n), jnp.uint32)).astype(np.uint64)
    return (w[0] << np.uint64(32)) | w[1]


def _threshold(q):
    # floor(q * 2^64) from q's exact binary fraction (independent of the library's Fraction).
    num, den = float(q).as_integer_ratio()
    return num * 2**64 // den


def test_poisson_rate_is_tight_around_q(key):
    # 100 draws of n = 20000 at q = 0.05: the total is Binomial(2e6, q), sd ~308, so a 5-sigma
    # band is +-1.5% of the mean; the old check (60 draws of n = 1000) could not see 7%.
    n, b, draws = 20_000, 1_000, 100
    cfg = pv.SamplingConfig("poisson", dataset_size=n, batch_size=b)
    q, trials = cfg.q, n * draws
    total = sum(int(cfg.sample(jax.random.fold_in(key, i)).mask.sum()) for i in range(draws))
    mean, sd = trials * q, math.sqrt(trials * q * (1 - q))
    biased = 1.05 * q  # the band must be able to see a 5% excess: check its power first
    assert trials * biased - mean > 5 * sd + 5 * math.sqrt(trials * biased * (1 - biased))
    assert abs(total - mean) < 5 * sd


@pytest.mark.parametrize("q", [2e-8, 3e-7, 1.6e-5, 0.05, 1 / 3, 0.5, 1 - 2**-53, 1.0])
def test_poisson_threshold_is_exact_and_never_above_q(q):
    t = poisson_threshold(q)
    assert t == _threshold(q)
    rate = Fraction(t, 2**64)
    # One-sided, within 2^-64 (the old float32 grid realised ceil(q 2^23) / 2^23: 6q at 2e-8).
    assert Fraction(q) - Fraction(1, 2**64) < rate <= Fraction(q)


def test_poisson_threshold_rejects_rates_outside_unit_interval():
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            poisson_threshold(bad)


def test_poisson_rate_one_includes_everyone(key):
    cfg = pv.SamplingConfig("poisson", dataset_size=37, batch_size=37)
    idx, mask, _ = cfg.sample(key)
    np.testing.assert_array_equal(idx, np.arange(37))
    assert bool(mask.all())


@pytest.mark.parametrize("n, rank", [(1 << 16, 0), (4096, 1365)])
def test_poisson_sampler_resolves_q_to_one_float64_step(key, n, rank):
    # Example j has the rank-th smallest 64-bit draw u_j (rank 0: q ~ 1.5e-5, the n = 1e6,
    # b = 16 regime; rank 1365: q ~ 1/3). q_lo is the largest float64 with floor(q 2^64) <= u_j
    # and q_hi the next float64: j must go from out to in and nothing else may change. The old
    # float32 comparison resolves q only to 2^-23 and cannot tell q_lo from q_hi; comparing the
    # high words only, or with "<=", gets j wrong at one of them. (A statistical test that
    # could see the float32 grid at small q needs ~1e8 draws, ~10 s here; this one is exact.)
    u = _words_as_u64(key, n)
    j = int(np.argsort(u)[rank])
    uj = int(u[j])
    q_lo = float(Fraction(uj + 1, 2**64))
    while Fraction(q_lo) * 2**64 >= uj + 1:
        q_lo = np.nextafter(q_lo, 0.0)
    q_hi = float(np.nextafter(q_lo, 1.0))
    assert _threshold(q_lo) <= uj < _threshold(q_hi)

    def chosen(q):
        idx, mask, count = pv.poisson_indices(key, n, float(q), rank + 8)
        assert int(count) <= rank + 8
        return set(np.asarray(idx)[np.asarray(mask)].tolist())

    lo, hi = chosen(q_lo), chosen(q_hi)
    assert j not in lo and hi == lo | {j}
    assert len(lo) == rank


@pytest.mark.parametrize("seed", [0, 1])
def test_poisson_sampler_output_pinned_by_independent_reimplementation(seed):
    # Expected indices and mask from numpy on the same jax.random.bits, compared as 64-bit ints:
    # pins the documented draw, so a change of word order or layout (which changes the examples
    # a recorded key selects, invisible to the rate tests) fails here.
    n, b, max_batch = 40, 6, 20
    cfg = pv.SamplingConfig("poisson", dataset_size=n, batch_size=b, max_batch=max_batch)
    k = jax.random.key(seed)
    chosen = np.flatnonzero(_words_as_u64(k, n) < np.uint64(_threshold(b / n)))
    want_idx = np.zeros(max_batch, np.int32)
    want_idx[:len(chosen)] = chosen
    idx, mask, _ = cfg.sample(k)
    assert idx.dtype == jnp.int32 and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(mask, np.arange(max_batch) < len(chosen))
    assert 0 < len(chosen) < max_batch  # a non-trivial draw, not all padding


def test_large_leaves_draw_noise_in_blocks_with_the_right_distribution():
    """A leaf above MAX_DRAW_ELEMS is drawn in row blocks: still iid N(0, s^2) (mean, std,
    no repeated block, no correlation between blocks), and the compiled draw needs far less
    scratch memory than the whole-leaf draw (the reason for the blocks)."""
    from pavejax.privacy import noise as N

    shape = (8192, 256)                      # 2M values: 8 blocks of 1024 rows
    cap = 1 << 15
    rows = N._block_rows(shape, cap)
    nb = shape[0] // rows
    assert nb >= 2 and rows * 256 <= N.BLOCK_ELEMS
    assert N._block_rows((97, 1024), cap) is None        # prime rows: no block near the target
    assert N._block_rows((64, 64), cap) is None          # under the cap: drawn whole
    x = N.gaussian_noise_like(jax.random.key(3), {"w": jnp.zeros(shape)}, 2.0,
                              max_draw_elems=cap)["w"]
    whole = N.gaussian_noise_like(jax.random.key(3), {"w": jnp.zeros(shape)}, 2.0,
                                  max_draw_elems=None)["w"]
    v = np.asarray(x, np.float64)
    assert abs(v.mean()) < 4 * 2.0 / math.sqrt(v.size)
    assert abs(v.std() - 2.0) < 0.01

    def max_block_corr(values):
        return np.max(np.abs(np.corrcoef(values.reshape(nb, rows * 256)) - np.eye(nb)))

    assert max_block_corr(v) < 0.02
    # The audit catches a broken blocked draw: every block from the same key (the noise of one
    # block repeated, i.e. far less independent noise than accounted for).
    with pytest.MonkeyPatch.context() as m:
        m.setattr(jax.random, "fold_in", lambda k, i: k)
        broken = N.gaussian_noise_like(jax.random.key(3), {"w": jnp.zeros(shape)}, 2.0,
                                       max_draw_elems=cap)["w"]
    assert max_block_corr(np.asarray(broken, np.float64)) > 0.99
    assert not np.allclose(v, np.asarray(whole))         # a different (blocked) draw
    small = N.gaussian_noise_like(jax.random.key(3), {"w": jnp.zeros((8, 8))}, 2.0,
                                  max_draw_elems=cap)["w"]
    np.testing.assert_array_equal(
        np.asarray(small),
        np.asarray(N.gaussian_noise_like(jax.random.key(3), {"w": jnp.zeros((8, 8))}, 2.0,
                                         max_draw_elems=None)["w"]))

    def temp(cap_):
        f = jax.jit(lambda s, k: N.privatize_sum(s, k, noise_multiplier=1.0, sensitivity=1.0,
                                                 expected_batch_size=4.0,
                                                 max_draw_elems=cap_), donate_argnums=0)
        return f.lower(jnp.zeros(shape), jax.random.key(0)).compile().memory_analysis(
            ).temp_size_in_bytes

    leaf_bytes = 4 * math.prod(shape)
    assert temp(cap) <= leaf_bytes < 2 * leaf_bytes <= temp(None)
