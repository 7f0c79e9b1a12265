"""Noise-aware ranking (pavejax.pave.noise_aware): the noise level a spec's record states is the
spread of the mechanism's actual releases (joint and per-layer clipping, one step and several
Poisson steps), adaptive optimisers and uneven scalings are refused, A_d(kappa) matches closed
forms and known asymptotics over its whole range, and the scores are the documented formulas,
reduce to the cosine without noise, and do what they claim on data drawn from their model."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from pavejax import audit
from pavejax.pave import noise_aware as na, spec as S
from pavejax.spec_types import PaveSpec
from tests import _toy

_logits, _kernels = _toy.logits, _toy.kernels


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(1)
    bb = _toy.tanh_mlp(rng)
    x = rng.normal(size=(24, _toy.D_IN)).astype(np.float32)
    t = S.hard_targets((x[:, 0] > 0).astype(np.int32), _toy.K)
    return {"bb": bb, "inputs": {"x": x}, "targets": t, "a_key": jax.random.key(5)}


def _spec(toy, config):
    kw = {} if config.privacy is None else {"noise_key": jax.random.key(3)}
    return S.generate_spec(_logits, toy["bb"], _kernels, toy["inputs"], toy["targets"],
                           toy["a_key"], config, **kw).spec


def _spread(toy, config, draws=2000):
    """Per-coordinate std of the releases over noise seeds (pooled over coordinates)."""
    sampler = audit.spec_sampler(_logits, toy["bb"], _kernels, config)
    rel = np.asarray(sampler(toy["inputs"], toy["targets"], np.arange(draws), toy["a_key"]),
                     np.float64)
    return float(np.sqrt(np.mean((rel - rel.mean(0)) ** 2)))


# --------------------------------------------------------------------------- spec_noise_std


def test_noise_std_is_the_spread_of_one_step_releases_joint_and_per_layer(toy):
    """One full-batch SGD step: only the noise varies across seeds, so the spread over 2000
    seeds is the injected std: lr sigma C / n (joint) and lr sigma C sqrt(L) / n (per layer,
    L = 2 adapted layers). The stated value is checked against these closed forms directly."""
    n, lr, sigma, clip = 24, 0.7, 3.0, 0.5
    for clipping, delta in (("joint", clip), ("per_layer", clip * math.sqrt(2))):
        cfg = S.SpecConfig.preset("one_step", rank=2, progress=False, learning_rate=lr,
                                  privacy=S.PrivacyConfig(l2_clip=clip, noise_multiplier=sigma,
                                                          sampling="full", clipping=clipping))
        stated = na.spec_noise_std(_spec(toy, cfg))
        assert stated == pytest.approx(lr * sigma * delta / n, rel=1e-12)
        assert _spread(toy, cfg) == pytest.approx(stated, rel=0.05)


def test_noise_std_of_several_poisson_steps(toy):
    """T = 3 Poisson steps of expected batch 8: std lr sigma C sqrt(T) / (q n). With a tiny clip
    the clipped signal (norm <= lr T C in all) is negligible against the noise, so the spread
    over seeds is the injected noise. A formula without sqrt(T), or dividing by n instead of
    q n, would be off by a factor >= 1.7."""
    lr, sigma, clip, steps, batch = 0.5, 20.0, 1e-3, 3, 8
    cfg = S.SpecConfig(rank=2, steps=steps, batch_size=batch, optimizer="sgd", learning_rate=lr,
                       progress=False,
                       privacy=S.PrivacyConfig(l2_clip=clip, noise_multiplier=sigma,
                                               sampling="poisson"))
    stated = na.spec_noise_std(_spec(toy, cfg))
    assert stated == pytest.approx(lr * sigma * clip * math.sqrt(steps) / batch, rel=1e-12)
    assert _spread(toy, cfg, draws=1000) == pytest.approx(stated, rel=0.06)


def test_non_private_spec_has_no_noise_and_unsupported_specs_are_refused(toy):
    base = S.SpecConfig.preset("one_step", rank=2, progress=False)
    assert na.spec_noise_std(_spec(toy, base)) == 0.0
    dp = S.PrivacyConfig(l2_clip=0.5, noise_multiplier=2.0, sampling="full")
    good = _spec(toy, dataclasses.replace(base, privacy=dp))
    for change, words in ((dict(optimizer="adam"), "adaptive optimiser"),
                          (dict(l1=1e-3), "L1 penalty"),
                          (dict(layer_scaling="fan_in"), "not uniform across coordinates")):
        bad = _spec(toy, dataclasses.replace(base, privacy=dp, **change))
        with pytest.raises(ValueError, match=words):
            na.spec_noise_std(bad)
    info = dict(good.info, mechanism="laplace")
    with pytest.raises(ValueError, match="unknown spec mechanism"):
        na.spec_noise_std(PaveSpec(good.vector, good.signature, kind="model", info=info))
    info = {k: v for k, v in good.info.items() if k != "noise_multiplier"}
    with pytest.raises(ValueError, match="lacks 'noise_multiplier'"):
        na.spec_noise_std(PaveSpec(good.vector, good.signature, kind="model", info=info))
    info = dict(good.info, sampling_rate=0.5)
    with pytest.raises(ValueError, match="inconsistent"):
        na.spec_noise_std(PaveSpec(good.vector, good.signature, kind="model", info=info))
    with pytest.raises(TypeError, match="PaveSpec"):
        na.spec_noise_std(good.vector)


# --------------------------------------------------------------------------- A_d(kappa)


def test_mean_resultant_length_closed_forms():
    """d = 1: tanh(kappa); d = 3: coth(kappa) - 1/kappa; d = 5: the ratio of modified
    spherical Bessel functions i_2 / i_1 with i_1 = (k cosh k - sinh k) / k^2 and
    i_2 = ((k^2 + 3) sinh k - 3 k cosh k) / k^3; over kappa in [1e-3, 600] (the ive branch and
    the continued-fraction branch)."""
    k = np.geomspace(1e-3, 600, 400)
    np.testing.assert_allclose(na.vmf_mean_resultant_length(k, 1), np.tanh(k), rtol=1e-10)
    np.testing.assert_allclose(na.vmf_mean_resultant_length(k, 3), 1 / np.tanh(k) - 1 / k,
                               rtol=1e-7, atol=1e-12)
    kk = np.geomspace(0.05, 600, 200)  # away from kappa -> 0 where the closed form cancels
    coth = 1 / np.tanh(kk)
    i1 = coth / kk - 1 / kk ** 2  # i_1 / sinh
    i2 = (3 / kk ** 2 + 1) / kk - 3 * coth / kk ** 2  # i_2 / sinh
    np.testing.assert_allclose(na.vmf_mean_resultant_length(kk, 5), i2 / i1, rtol=1e-6)


def test_mean_resultant_length_limits_and_asymptotics():
    """A_d(0) = 0, A_d(inf) = 1; small kappa: kappa / d; large kappa: 1 - (d - 1) / (2 kappa);
    monotone increasing; and no jump where the evaluation switches branch (kappa = 1e8,
    order 50, the small-kappa region), for d from 2 to 10^6."""
    for d in (2, 7, 99, 100, 101, 102, 1000, 10 ** 6):
        assert na.vmf_mean_resultant_length(0.0, d) == 0.0
        assert na.vmf_mean_resultant_length(np.inf, d) == 1.0
        small = 1e-6 * d
        assert float(na.vmf_mean_resultant_length(small, d)) == pytest.approx(small / d,
                                                                              rel=1e-5)
        big = 1e4 * d ** 2
        assert 1 - float(na.vmf_mean_resultant_length(big, d)) == pytest.approx(
            (d - 1) / (2 * big), rel=1e-3)
        k = np.geomspace(1e-8, 1e14, 2000)
        a = na.vmf_mean_resultant_length(k, d)
        assert np.all(np.isfinite(a)) and np.all((a >= 0) & (a <= 1))
        assert np.all(np.diff(a) >= -1e-12)
    # continuity across the 1e8 switch and the order-50 switch (d = 102 is order 50)
    for d in (3, 20, 99):
        left, right = na.vmf_mean_resultant_length([1e8 * (1 - 1e-9), 1e8], d)
        assert right - left == pytest.approx(0.0, abs=1e-12)
    k = np.geomspace(1e-2, 1e6, 50)
    a100, a102, a104 = (na.vmf_mean_resultant_length(k, d) for d in (100, 102, 104))
    # A_d is decreasing in d for fixed kappa; the Debye branch (d >= 102) must not jump
    assert np.all(a100 >= a102) and np.all(a102 >= a104)
    np.testing.assert_allclose(a102, (a100 + a104) / 2, rtol=2e-2)


def test_mean_resultant_length_is_the_mean_cosine_of_vmf_draws():
    """A_d(kappa) = E[<x, mu>] for x ~ vMF(mu, kappa) on S^{d-1}. Draw from vMF with Wood's
    rejection sampler (d = 10, kappa = 4, 20000 draws) and compare the mean cosine."""
    rng = np.random.default_rng(0)
    d, kappa, n = 10, 4.0, 20000
    b = (-2 * kappa + math.sqrt(4 * kappa ** 2 + (d - 1) ** 2)) / (d - 1)
    x0 = (1 - b) / (1 + b)
    c = kappa * x0 + (d - 1) * math.log(1 - x0 ** 2)
    w = []
    while len(w) < n:
        z = rng.beta((d - 1) / 2, (d - 1) / 2)
        ww = (1 - (1 + b) * z) / (1 - (1 - b) * z)
        if kappa * ww + (d - 1) * math.log(1 - x0 * ww) - c >= math.log(rng.uniform()):
            w.append(ww)
    w = np.asarray(w)
    want = float(na.vmf_mean_resultant_length(kappa, d))
    assert w.mean() == pytest.approx(want, abs=4 * w.std() / math.sqrt(n))


def test_mean_resultant_length_refuses_bad_input():
    for d in (0, 2.0, True):
        with pytest.raises(ValueError, match="d must be an int"):
            na.vmf_mean_resultant_length(1.0, d)
    for k in (-1.0, np.nan):
        with pytest.raises(ValueError, match="kappa must be >= 0"):
            na.vmf_mean_resultant_length(k, 4)


# --------------------------------------------------------------------------- scores


def test_scores_are_the_documented_formulas():
    """A 2-query, 3-spec, d = 4 example computed by hand from the docstring's formulas."""
    u = np.array([[1.0, 0, 0, 0], [0, 3.0, 0, 4.0]])
    b = np.array([[2.0, 1, 0, 0], [0, 0.5, 0, 0.5], [1.0, 1, 1, 1]])
    s = np.array([0.5, 0.0, 0.4])
    d = 4
    un = u / np.linalg.norm(u, axis=1, keepdims=True)
    dots = un @ b.T
    norms = np.linalg.norm(b, axis=1)
    cos = dots / norms
    np.testing.assert_allclose(na.noise_aware_scores(u, b, s, "cosine"), cos, rtol=1e-12)
    denom = np.sqrt(np.maximum(norms ** 2 - d * s ** 2, s ** 2 * math.sqrt(2 * d)))
    np.testing.assert_allclose(na.noise_aware_scores(u, b, s, "debiased"), dots / denom,
                               rtol=1e-12)
    # spec 2: ||b||^2 = 4, d s^2 = 0.64 -> 3.36; spec 0: 5 - 1 = 4; spec 1 exact
    assert denom.tolist() == pytest.approx([2.0, math.sqrt(0.5), math.sqrt(3.36)])
    a = math.sqrt(np.mean(norms ** 2 - d * s ** 2))
    kappa = np.array([a * norms[0] / 0.25, np.inf, a * norms[2] / 0.16])
    # d = 4: A_4(k) = I_2(k) / I_1(k), from scipy's unscaled Bessel functions
    from scipy.special import iv
    a4 = np.array([iv(2, kappa[0]) / iv(1, kappa[0]), 1.0, iv(2, kappa[2]) / iv(1, kappa[2])])
    np.testing.assert_allclose(na.noise_aware_scores(u, b, s, "posterior"), a4 * cos,
                               rtol=1e-9)


def test_without_noise_every_method_is_the_cosine():
    rng = np.random.default_rng(0)
    u, b = rng.normal(size=(3, 50)), rng.normal(size=(7, 50))
    b[2] = 0.0  # a zero spec scores 0
    cos = na.noise_aware_scores(u, b, 0.0, "cosine")
    assert np.all(cos[:, 2] == 0.0)
    for m in ("debiased", "posterior"):
        np.testing.assert_array_equal(na.noise_aware_scores(u, b, np.zeros(7), m), cos)
    # one query as a vector: one row
    np.testing.assert_allclose(na.noise_aware_scores(u[0], b, 0.0), cos[:1])


def _market(rng, d, n_specs, a, s, true_cos):
    """Specs b_j = a v_j + s_j z_j with <u, v_j> = true_cos[j] for the unit query u = e_0."""
    v = rng.normal(size=(n_specs, d))
    v[:, 0] = 0.0
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    v = true_cos[:, None] * np.eye(d)[0] + np.sqrt(1 - true_cos[:, None] ** 2) * v
    return a * v + s[:, None] * rng.normal(size=(n_specs, d))


def test_debiased_score_removes_the_shrinkage_of_noisy_candidates():
    """Data drawn from the scores' model: d = 2000, signal a = 1, noise energy d s^2 from 0 to
    about 4 times the signal, true cosines spread over [-0.6, 0.9]. The cosine shrinks a noisy
    candidate's true cosine by about a / ||b|| (slope against the truth < 0.6 where
    d s^2 > 2); the debiased score removes the shrinkage (slope within 0.06 of 1 for every
    candidate), over 400 markets of 12 candidates."""
    rng = np.random.default_rng(0)
    d, n_specs, a = 2000, 12, 1.0
    s = np.linspace(0.0, 0.045, n_specs)  # d s^2 up to 4.05
    true_cos = rng.uniform(-0.6, 0.9, size=(400, n_specs))
    u = np.eye(d)[:1]
    got = {m: [] for m in ("cosine", "debiased")}
    for row in true_cos:
        b = _market(rng, d, n_specs, a, s, row)
        for m in got:
            got[m].append(na.noise_aware_scores(u, b, s, m)[0])
    got = {m: np.asarray(v) for m, v in got.items()}
    noisy = s ** 2 * d > 2.0
    slope = {m: np.array([np.polyfit(true_cos[:, j], got[m][:, j], 1)[0]
                          for j in range(n_specs)]) for m in got}
    assert np.all(np.abs(slope["debiased"] - 1) < 0.06), slope["debiased"]
    assert noisy.sum() >= 4 and np.all(slope["cosine"][noisy] < 0.6), slope["cosine"]


def test_posterior_score_beats_the_cosine_under_its_prior():
    """The posterior score is E[<u, v> | b] under b ~ N(a v, s^2 I) and v uniform on the sphere,
    so under that prior it has a lower mean squared error against the true cosine than the
    plain cosine (with a pooled from 12 candidates, not known). d = 10, d s^2 from 0 to 4,
    1500 markets. (Under a prior of large true cosines, as in a market of related tasks, it
    can shrink too much and lose to the cosine; the benchmark measures which wins there.)"""
    rng = np.random.default_rng(0)
    d, n_specs = 10, 12
    s = np.linspace(0.0, 2.0 / math.sqrt(d), n_specs)
    err = {m: [] for m in ("cosine", "posterior")}
    for _ in range(1500):
        v = rng.normal(size=(n_specs, d))
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        b = v + s[:, None] * rng.normal(size=(n_specs, d))
        u = rng.normal(size=(1, d))
        truth = (u / np.linalg.norm(u)) @ v.T
        for m in err:
            err[m].append((na.noise_aware_scores(u, b, s, m) - truth) ** 2)
    mse = {m: float(np.mean(e)) for m, e in err.items()}
    assert mse["posterior"] < 0.9 * mse["cosine"], mse


def test_scores_refuse_bad_input():
    u, b = np.ones((2, 4)), np.ones((3, 4))
    cases = [((u, b, 0.0, "l2"), ValueError, "method must be one of"),
             ((np.ones((2, 5)), b, 0.0, "cosine"), ValueError, "dimension 5 but specs have 4"),
             ((u, b, np.ones(2), "debiased"), ValueError, r"shape \(3,\)"),
             ((u, b, -1.0, "debiased"), ValueError, "finite and >= 0"),
             ((u, b, np.nan, "debiased"), ValueError, "finite and >= 0"),
             ((np.zeros((1, 4)), b, 0.0, "cosine"), ValueError, "all zeros"),
             ((u, np.full((3, 4), np.inf), 0.0, "cosine"), ValueError, "NaN/inf"),
             ((u, np.ones((0, 4)), 0.0, "cosine"), ValueError, "non-empty 2-D"),
             ((u, b.astype(bool), 0.0, "cosine"), TypeError, "real array"),
             ((np.array(["a", "b"]), b, 0.0, "cosine"), TypeError, "real array")]
    for args, exc, words in cases:
        with pytest.raises(exc, match=words):
            na.noise_aware_scores(*args)


def test_mean_resultant_length_matches_arbitrary_precision_bessel_ratios():
    """Every branch (scipy's ive, the continued fraction, Hankel, Debye) against mpmath's
    besseli at 40 digits, from d = 2 to a MiniLM-sized spec (d = 36,864)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    for d in (2, 9, 60, 101, 102, 150, 1000, 36_864):
        for kappa in (1e-3, 0.5, 7.0, 100.0, 3e3, 1e5, 1e6, 2e8):
            if d > 1000 and kappa in (1e5, 1e6):
                continue  # mpmath's series does not converge there (order ~ argument)
            nu = mpmath.mpf(d) / 2 - 1
            want = float(mpmath.besseli(nu + 1, kappa) / mpmath.besseli(nu, kappa))
            got = float(na.vmf_mean_resultant_length(kappa, d))
            assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (d, kappa)
