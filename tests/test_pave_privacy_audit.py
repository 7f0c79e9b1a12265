"""Empirical privacy audits of PAVE specs: DP-S-PAVE never beats its accountant, deliberately
broken variants are caught, the white-box Dirac canary measures how tight the accounting is, and
the disclosure / amplification advantages respect the risk bounds (non-private PAVE does not).

The toy backbone is a two-layer ReLU network with both kernels adapted (rank 2). The canary is an
input with a large norm (its per-example gradient is clipped to exactly C) labelled 0; its
replace-one neighbour is the same input labelled 1, whose gradient points the other way, so the
two data sets differ by almost the full sensitivity 2C.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pavejax import audit
from pavejax.accounting import Ledger, risk
from pavejax.pave import spec as S
from pavejax.privacy import DPConfig, SamplingConfig, gaussian_noise_like

DELTA = 1e-5
N, D_IN, HIDDEN, K = 16, 5, 6, 2
RUNS = 10_000
SIGMA = 4.0


def _logits(params, batch, aux):
    return jax.nn.relu(batch["x"] @ params["l1"]["kernel"]) @ params["l2"]["kernel"]


def _predicate(path, leaf):
    return path.endswith("kernel")


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, K)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    backbone = S.Backbone("toy-relu-mlp", params, S.backbone_hash(params))
    x = (0.5 * rng.normal(size=(N, D_IN))).astype(np.float32)
    x[-1] = 4.0 * np.abs(rng.normal(size=D_IN)) + 2.0  # the canary: large input
    t_in = S.hard_targets(rng.integers(0, K, N), K)
    t_in[-1] = [1.0, 0.0]
    t_out = t_in.copy()
    t_out[-1] = [0.0, 1.0]
    absent = np.zeros(N, bool)
    absent[-1] = True
    return {"backbone": backbone, "inputs": {"x": x}, "t_in": t_in, "t_out": t_out,
            "absent": absent, "a_key": jax.random.key(7)}


def _one_step(privacy=None, **kw):
    return S.SpecConfig.preset("one_step", rank=2, privacy=privacy, progress=False, **kw)


DP_ONE_STEP = _one_step(S.PrivacyConfig(l2_clip=1.0, noise_multiplier=SIGMA, sampling="full"))


def _sampler(toy, config):
    return audit.spec_sampler(_logits, toy["backbone"], _predicate, config)


@pytest.fixture(scope="module")
def dp_sampler(toy):
    return _sampler(toy, DP_ONE_STEP)


@pytest.fixture(scope="module")
def plain_sampler(toy):
    return _sampler(toy, _one_step())


@pytest.fixture(scope="module")
def dp_release(toy):
    """The generate_spec release replayed with noise key 3 (the sampler's seed 3)."""
    return S.generate_spec(_logits, toy["backbone"], _predicate, toy["inputs"], toy["t_in"],
                           toy["a_key"], DP_ONE_STEP, noise_key=jax.random.key(3))


@pytest.fixture(scope="module")
def real_release(toy):
    """A release as a developer makes it: no noise key given (fresh from the OS)."""
    return S.generate_spec(_logits, toy["backbone"], _predicate, toy["inputs"], toy["t_in"],
                           toy["a_key"], DP_ONE_STEP)


def _game(toy, sampler, *, claimed, world_out=None, **kw):
    world_out = world_out or (toy["inputs"], toy["t_out"])
    return audit.spec_game(sampler, (toy["inputs"], toy["t_in"]), world_out, toy["a_key"],
                           runs=RUNS, shadow_runs=RUNS // 2, delta=DELTA,
                           claimed_epsilon=claimed, **kw)


# --- the sampler is the mechanism ------------------------------------------------------------


def test_sampler_reproduces_generate_spec_dp(toy, dp_sampler, dp_release):
    v = dp_sampler(toy["inputs"], toy["t_in"], [2, 3, 4], toy["a_key"])
    np.testing.assert_allclose(v[1], dp_release.spec.vector, rtol=0, atol=1e-6)
    assert np.abs(v[0] - v[1]).max() > 1e-3  # another seed: other noise
    ledger, ledger_ar = dp_sampler.ledgers(N)
    assert ledger == dp_release.ledger and ledger_ar.relation.value == "add_remove"
    assert ledger_ar.entries == ledger.entries  # the same releases, the game's other relation
    assert dp_sampler.noise_multiplier(N) == SIGMA


@pytest.mark.slow  # a MiniLM-free but multi-step DP-S-PAVE compile, twice (~20 s)
def test_sampler_reproduces_multistep_fixed_sampling_adam(toy):
    cfg = S.SpecConfig(rank=2, steps=3, batch_size=8, learning_rate=0.05, layer_scaling="fan_in",
                       progress=False, privacy=S.PrivacyConfig(
                           l2_clip=1.0, noise_multiplier=1.5, sampling="fixed", accountant="rdp"))
    res = S.generate_spec(_logits, toy["backbone"], _predicate, toy["inputs"], toy["t_in"],
                          toy["a_key"], cfg, noise_key=jax.random.key(5))
    sampler = _sampler(toy, cfg)
    np.testing.assert_allclose(sampler(toy["inputs"], toy["t_in"], [5], toy["a_key"])[0],
                               res.spec.vector, rtol=0, atol=1e-6)
    claimed = res.spec.info["guarantee"]["epsilon"]
    ledger, ledger_ar = sampler.ledgers(N)
    assert ledger == res.ledger and ledger_ar is None
    g = audit.spec_game(sampler, (toy["inputs"], toy["t_in"]), (toy["inputs"], toy["t_out"]),
                        toy["a_key"], runs=RUNS // 2, shadow_runs=RUNS // 4, delta=DELTA,
                        claimed_epsilon=claimed)
    assert g.epsilon_lower <= claimed
    assert g.advantage_lower > 0.02  # the attack still sees the canary through 3 Adam steps


def test_sampler_nonprivate_one_step_and_fresh_A(toy, plain_sampler):
    sampler = plain_sampler
    res = S.generate_spec(_logits, toy["backbone"], _predicate, toy["inputs"], toy["t_in"],
                          toy["a_key"], _one_step())
    v = sampler(toy["inputs"], toy["t_in"], [0, 1], toy["a_key"])
    np.testing.assert_allclose(v[0], res.spec.vector, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(v[0], v[1])  # no noise: the seed does not matter
    keys = jax.random.split(jax.random.key(1), 2)
    fresh = sampler(toy["inputs"], toy["t_in"], [0, 0], keys)
    np.testing.assert_allclose(fresh[1], sampler(toy["inputs"], toy["t_in"], [0], keys[1])[0],
                               rtol=1e-6, atol=1e-7)
    assert np.abs(fresh[0] - fresh[1]).max() > 1e-3
    with pytest.raises(ValueError, match="no noise and no ledger"):
        sampler.ledgers(N)


# --- black-box distinguishing games ----------------------------------------------------------


def test_audit_dp_s_pave_replace_one(toy, dp_sampler, dp_release):
    claimed = dp_release.spec.info["guarantee"]["epsilon"]
    assert 1.5 < claimed < 2.5  # one Gaussian step, sensitivity 2C, noise 4C (PLD)
    g = _game(toy, dp_sampler, claimed=claimed)
    assert g.epsilon_lower <= claimed
    assert g.epsilon_lower > 0.2, "the audit has no power: the canary should be visible"
    # disclosure risk of the spec alone: measured advantage within the per-pair TV bound
    assert g.advantage_lower <= risk.tv_bound(claimed, DELTA)
    assert g.advantage <= risk.tv_bound(claimed, DELTA)


def test_audit_dp_s_pave_add_remove_with_fixed_normaliser(toy, dp_sampler, dp_release):
    # The add/remove game of the fixed-size mechanism (the normaliser stays n): what the absent
    # game plays. No release states this figure (see the next test for why).
    assert "epsilon_add_remove" not in dp_release.spec.info["guarantee"]
    claimed = dp_sampler.ledgers(N)[1].epsilon(DELTA)
    g = _game(toy, dp_sampler, claimed=claimed, world_out=(toy["inputs"], toy["t_in"]),
              absent_out=toy["absent"])
    assert g.epsilon_lower <= claimed
    assert g.epsilon_lower > 0.1


def _gaussian_lr_scores(shadow_in, shadow_out, scored):
    """Log-likelihood ratio of isotropic Gaussians fitted to the shadow releases of each world
    (mean and one variance each): the test that sees both a mean and a noise-scale change."""
    def loglik(x, shadow):
        mu, var = shadow.mean(0), shadow.var(0).mean()
        return -0.5 * ((x - mu) ** 2).sum(1) / var - 0.5 * x.shape[1] * np.log(var)
    return loglik(scored, shadow_in) - loglik(scored, shadow_out)


def test_full_batch_spec_reveals_its_size_so_no_add_remove_figure(toy):
    """A full-batch spec divides by the real n, so add/remove neighbours (n = 5 vs 4) differ in
    the noise scale and the mean of the released vector: a likelihood-ratio test on the vector
    alone beats the add/remove epsilon that the fixed-normaliser analysis gives (what earlier
    versions stored as ``epsilon_add_remove``). The release therefore states replace-one only,
    names n as public, and every release path refuses an add/remove figure."""
    cfg = _one_step(S.PrivacyConfig(l2_clip=1.0, noise_multiplier=2.0, sampling="full"))
    rng = np.random.default_rng(1)  # a wider toy (spec dim 2 * 64 + 2 * 2) than the module's
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, 64)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(64, K)) / 8.0, jnp.float32)}}
    wide = S.Backbone("toy-relu-mlp-64", params, S.backbone_hash(params))
    sampler = audit.spec_sampler(_logits, wide, _predicate, cfg)
    x, t = toy["inputs"]["x"], toy["t_in"]
    d5, d4 = ({"x": x[:5]}, t[:5]), ({"x": x[:4]}, t[:4])
    runs = 1000
    shadow = [sampler(*d, np.arange(s, s + runs), toy["a_key"])
              for d, s in ((d5, 0), (d4, 10**6))]
    scored = [sampler(*d, np.arange(s, s + runs), toy["a_key"])
              for d, s in ((d5, 2 * 10**6), (d4, 3 * 10**6))]
    s_in, s_out = (_gaussian_lr_scores(shadow[0], shadow[1], v) for v in scored)
    old_claim = sampler.ledgers(5)[1].epsilon(DELTA)  # the former epsilon_add_remove
    assert 1.5 < old_claim < 3.0
    lower = audit.epsilon_lower_bound(s_in, s_out, delta=DELTA)
    print(f"add/remove n=5 vs 4: empirical epsilon >= {lower:.3f}, former claim {old_claim:.3f}")
    assert lower > old_claim, f"the size leak went unseen: {lower} vs {old_claim}"
    # what the release states instead
    res = S.generate_spec(_logits, wide, _predicate, *d5, toy["a_key"], cfg)
    g = res.spec.info["guarantee"]
    assert g["relation"] == "replace_one" and "epsilon_add_remove" not in g
    assert "n = 5" in g["public"] and res.spec.info["num_examples"] == 5
    assert g["epsilon"] == pytest.approx(sampler.ledgers(5)[0].epsilon(DELTA))


def _too_little_noise(priv):
    return dataclasses.replace(priv, noise_multiplier=priv.noise_multiplier / 10)


def _no_clipping(priv):
    # same noise std sigma * C, but a clip norm no gradient reaches
    return dataclasses.replace(priv, l2_clip=1e4, noise_multiplier=priv.noise_multiplier / 1e4)


@pytest.mark.parametrize("break_it", [_too_little_noise, _no_clipping])
def test_audit_catches_broken_variant(toy, dp_release, break_it):
    claimed = dp_release.spec.info["guarantee"]["epsilon"]  # what the broken code would claim
    broken = dataclasses.replace(DP_ONE_STEP, privacy=break_it(DP_ONE_STEP.privacy))
    g = _game(toy, _sampler(toy, broken), claimed=claimed)
    assert g.epsilon_lower > claimed, f"audit missed the broken variant ({g})"


_H = np.random.default_rng(3).normal(size=(D_IN, K)).astype(np.float32)


def _model_world(x):
    # the developer's model h(x) = x @ _H is fixed and public; the spec data are its inputs with
    # targets softmax(h(x))
    return {"x": x}, S.soft_targets(x @ _H)


def test_amplification_model_plus_spec(toy, dp_sampler, plain_sampler, dp_release):
    x_in = toy["inputs"]["x"]
    x_out = x_in.copy()
    x_out[-1] = -x_in[-1]  # the canary input replaced by its mirror image
    w_in, w_out = _model_world(x_in), _model_world(x_out)
    assert np.abs(w_in[1][-1] - w_out[1][-1]).max() > 0.5  # h labels the two differently
    # the model alone: the same h under D and D', so every attack on it has advantage 0
    model_only = audit.attack_advantage(np.zeros(RUNS), np.zeros(RUNS))
    assert model_only.estimate == 0.0 and model_only.lower == 0.0
    claimed = dp_release.spec.info["guarantee"]["epsilon"]
    dp = audit.spec_game(dp_sampler, w_in, w_out, toy["a_key"], runs=RUNS, delta=DELTA,
                         claimed_epsilon=claimed)
    amp_dp = dp.advantage_lower - model_only.lower
    assert dp.epsilon_lower <= claimed
    assert 0.03 < amp_dp <= risk.tv_bound(claimed, DELTA) <= risk.amplification_bound(claimed,
                                                                                        DELTA)
    nonpriv = audit.spec_game(plain_sampler, w_in, w_out, toy["a_key"], runs=2000)
    assert nonpriv.advantage_lower - model_only.lower > 0.99  # a key holder sees the canary


def test_disclosure_nonprivate_vs_dp(toy, plain_sampler, dp_release):
    claimed = dp_release.spec.info["guarantee"]["epsilon"]
    sampler = plain_sampler
    known_a = _game(toy, sampler, claimed=None)
    assert known_a.advantage_lower > 0.99  # deterministic given A: Proposition 3.7
    # A secret and fresh per run (the intrinsic-sketch setting): only the row covariance of B
    # carries the data, and one dominant example moves it far (gamma >= 1): no protection.
    secret_a = _game(toy, sampler, claimed=None, attack="sketch")
    assert secret_a.advantage_lower > risk.tv_bound(claimed, DELTA)


def _denoised(release, vector, seed):
    """The adversary's guess of the noise-free one-step spec, -(clipped sum) / n: the spec plus
    the noise regenerated from ``jax.random.key(seed)`` (public metadata gives sigma, n, C)."""
    info = release.spec.info
    sigma, n = info["noise_multiplier"], info["num_examples"]
    k_noise = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0))[1]
    zeros = {p: jnp.zeros_like(b) for p, b in release.B.items()}
    noise = gaussian_noise_like(k_noise, zeros, sigma * info["config"]["privacy"]["l2_clip"])
    return vector + np.concatenate([np.asarray(noise[p]).ravel() for p in sorted(noise)]) / n


def test_release_does_not_reveal_its_noise(toy, dp_sampler, real_release):
    """An adversary regenerates the noise from the key of any public seed (the recorded
    config seed, or the default 0) and subtracts it: with a fresh secret key it must fail."""
    info = real_release.spec.info
    assert info["noise_key"].startswith("fresh")
    assert not any("key" in k.lower() for k in info["config"])  # no key material recorded
    # the truth: the same mechanism replayed with a known key (4) and denoised with it
    truth = _denoised(real_release, dp_sampler(toy["inputs"], toy["t_in"], [4],
                                               toy["a_key"])[0], 4)
    for seed in {info["config"].get("seed", 0), 0, 1}:
        guess = _denoised(real_release, real_release.spec.vector, seed)
        assert np.abs(guess - truth).max() > 1e-3, "the release's noise was regenerated"


def test_the_denoising_attack_works_on_a_replayable_key(toy, dp_sampler, dp_release):
    """The attack above is real: with the key known, denoising two releases gives the same
    noise-free vector (a mechanism keyed by a public seed would fail the test above)."""
    assert dp_release.spec.info["noise_key"].startswith("supplied")
    truth = _denoised(dp_release, dp_sampler(toy["inputs"], toy["t_in"], [4], toy["a_key"])[0], 4)
    np.testing.assert_allclose(_denoised(dp_release, dp_release.spec.vector, 3), truth,
                               atol=1e-5)


def test_releases_without_a_key_draw_fresh_noise(toy, real_release):
    again = S.generate_spec(_logits, toy["backbone"], _predicate, toy["inputs"], toy["t_in"],
                            toy["a_key"], DP_ONE_STEP)
    assert np.abs(again.spec.vector - real_release.spec.vector).max() > 1e-3
    assert again.ledger == real_release.ledger


# --- white-box: every step seen, Dirac canary ------------------------------------------------


def test_whitebox_dirac_canary_is_tight_but_never_beats_the_claim():
    sigma, steps = 3.0, 4
    s_in, s_out = audit.dirac_whitebox_scores(jax.random.key(5), l2_clip=1.0,
                                              noise_multiplier=sigma, steps=steps, runs=150_000)
    ledger = Ledger("replace_one")
    event = DPConfig(1.0, sigma, SamplingConfig("full", dataset_size=8)).step_event()
    for _ in range(steps):
        ledger.record(event)
    claimed = ledger.epsilon(DELTA)
    # q = 1 composes exactly: T steps are one Gaussian with mu = 2 sqrt(T) / sigma
    mu = 2.0 * math.sqrt(steps) / sigma
    z = (np.mean(s_in) - np.mean(s_out)) / np.std(s_out)
    assert z == pytest.approx(mu, rel=0.05)
    g = audit.evaluate_game(s_in, s_out, delta=DELTA, claimed_epsilon=claimed)
    assert g.epsilon_lower <= claimed
    assert g.over_claimed > 0.45, f"white-box audit should be tight at q = 1 ({g})"


# --- the statistics ---------------------------------------------------------------------------


def test_attack_advantage_matches_gaussian_total_variation():
    rng = np.random.default_rng(1)
    a, b = rng.normal(1.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000)
    tv = 2 * stats.norm.cdf(0.5) - 1  # TV(N(1, 1), N(0, 1))
    adv = audit.attack_advantage(a, b)
    assert adv.direction == 1 and abs(adv.estimate - tv) < 0.03
    assert tv - 0.05 < adv.lower <= tv
    flipped = audit.attack_advantage(-a, -b)  # "in" now means a low score
    assert flipped.direction == -1 and abs(flipped.estimate - tv) < 0.03
    same = audit.attack_advantage(rng.normal(size=5000), rng.normal(size=5000))
    assert same.lower == 0.0 and abs(same.estimate) < 0.05


def test_sketch_covariance_scores_are_the_gaussian_log_likelihood_ratio():
    rng = np.random.default_rng(2)
    blocks = ((2, 3), (2, 2))
    sh_in, sh_out, x = (rng.normal(size=(n, 10)) * s for n, s in ((400, 1.0), (300, 2.0),
                                                                   (5, 1.5)))
    ridge = 1e-3
    got = audit.sketch_covariance_scores(x, sh_in, sh_out, blocks, ridge=ridge)
    want = np.zeros(5)
    start = 0
    for r, d in blocks:
        rows = [s[:, start:start + r * d].reshape(len(s), r, d) for s in (sh_in, sh_out, x)]
        covs = [np.einsum("sri,srj->ij", s, s) / (s.shape[0] * r) for s in rows[:2]]
        lam = ridge * max(np.trace(c) for c in covs) / d
        for c, sign in zip(covs, (1, -1), strict=True):
            mvn = stats.multivariate_normal(np.zeros(d), c + lam * np.eye(d))
            want += sign * mvn.logpdf(rows[2].reshape(-1, d)).reshape(5, r).sum(axis=1)
        start += r * d
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_messages(toy, dp_sampler):
    x, t = toy["inputs"], toy["t_in"]
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        audit.spec_sampler(_logits, toy["backbone"], _predicate, DP_ONE_STEP, chunk=0)
    with pytest.raises(TypeError, match="config must be"):
        audit.spec_sampler(_logits, toy["backbone"], _predicate, {"rank": 2})
    with pytest.raises(ValueError, match="microbatch_size=None"):
        audit.spec_sampler(_logits, toy["backbone"], _predicate, dataclasses.replace(
            DP_ONE_STEP, microbatch_size=4))
    minibatch = audit.spec_sampler(_logits, toy["backbone"], _predicate,
                                   S.SpecConfig(rank=2, batch_size=4, progress=False))
    with pytest.raises(ValueError, match="full-batch non-private specs only"):
        minibatch(x, t, [0], toy["a_key"])
    with pytest.raises(ValueError, match="absent rows are for the add/remove game"):
        _sampler(toy, _one_step())(x, t, [0], toy["a_key"], absent=toy["absent"])
    with pytest.raises(ValueError, match="absent must be a bool array"):
        dp_sampler(x, t, [0], toy["a_key"], absent=np.zeros(3, bool))
    with pytest.raises(ValueError, match="seeds must be a non-empty 1-D int array"):
        dp_sampler(x, t, [0.5], toy["a_key"])
    with pytest.raises(ValueError, match="one key per seed"):
        dp_sampler(x, t, [0, 1, 2], jax.random.split(toy["a_key"], 2))
    with pytest.raises(TypeError, match="typed PRNG key"):
        dp_sampler(x, t, [0], 7)
    with pytest.raises(ValueError, match="targets must be"):
        dp_sampler(x, t[:, :1] * 2, [0], toy["a_key"])
    with pytest.raises(ValueError, match="attack must be"):
        audit.spec_game(dp_sampler, (x, t), (x, t), toy["a_key"], runs=8, attack="guess")
    with pytest.raises(ValueError, match="runs must be an int"):
        audit.spec_game(dp_sampler, (x, t), (x, t), toy["a_key"], runs=2)
    with pytest.raises(ValueError, match="at least 4 scores"):
        audit.attack_advantage([1.0, 2.0], [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="NaN/inf"):
        audit.attack_advantage([1.0, np.nan, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="alpha must be in"):
        audit.attack_advantage(np.ones(8), np.ones(8), alpha=1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        audit.evaluate_game(np.ones(8), np.ones(8), delta=1.0)
    with pytest.raises(ValueError, match="identical"):
        audit.mean_difference(np.ones((4, 3)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="direction"):
        audit.projection_scores(np.ones((4, 3)), np.ones(2))
    with pytest.raises(ValueError, match="do not match the blocks"):
        audit.sketch_covariance_scores(np.ones((4, 3)), np.ones((4, 3)), np.ones((4, 3)),
                                       ((2, 2),))
    with pytest.raises(ValueError, match="relation must be"):
        audit.dirac_whitebox_scores(jax.random.key(0), l2_clip=1.0, noise_multiplier=1.0,
                                    steps=1, runs=8, relation="swap")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        audit.dirac_whitebox_scores(jax.random.key(0), l2_clip=1.0, noise_multiplier=1.0,
                                    steps=0, runs=8)
