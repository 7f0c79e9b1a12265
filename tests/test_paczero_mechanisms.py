"""Candidate subsets and the release rules (ZPL, MI, MeZO, DP-ZO), plus a ZPL membership audit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pavejax.accounting import dpzo_step_event
from pavejax.accounting.pac import biawgn_mi_upper_bound, calibrate_biawgn_sigma
from pavejax.paczero import (
    dpzo_release,
    draw_secret,
    host_generator,
    membership_matrix,
    mi_init_host,
    mi_release,
    per_step_budget,
    positive_mass,
    subset_means,
    subset_signs,
    unanimous,
    zpl_release,
)
from tests.test_pac_accounting import mpmath_mi


def test_membership_matrix_half_of_subsets_each():
    b = np.asarray(membership_matrix(jax.random.key(0), 300, 16))
    assert b.shape == (300, 16) and b.dtype == bool
    assert np.all(b.sum(axis=1) == 8)
    # Each column holds each example with probability 1/2: sizes near 150.
    assert np.all(np.abs(b.sum(axis=0) - 150) < 5 * math.sqrt(75))
    # every one of the C(4, 2) = 6 memberships of a row is equally likely
    rows = np.asarray(membership_matrix(jax.random.key(1), 3000, 4))
    _, counts = np.unique(rows, axis=0, return_counts=True)
    assert len(counts) == 6 and stats.chisquare(counts).pvalue > 1e-3
    # a function of the (public) key alone
    np.testing.assert_array_equal(membership_matrix(jax.random.key(0), 300, 16), b)
    assert not np.array_equal(membership_matrix(jax.random.key(2), 300, 16), b)
    with pytest.raises(ValueError, match="even integer"):
        membership_matrix(jax.random.key(0), 10, 7)
    with pytest.raises(TypeError, match="typed PRNG key"):
        membership_matrix(0, 10, 4)


def test_secret_is_uniform():
    draws = [int(draw_secret(jax.random.key(i), 8)) for i in range(2000)]
    counts = np.bincount(draws, minlength=8)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_subset_means_signs_unanimity_match_a_loop():
    rng = np.random.default_rng(2)
    b = np.asarray(membership_matrix(jax.random.key(2), 20, 6))
    g = rng.normal(size=(3, 20)).astype(np.float32)
    means = np.asarray(subset_means(jnp.asarray(g), jnp.asarray(b)))
    want = np.array([[g[k, b[:, m]].mean() for m in range(6)] for k in range(3)])
    np.testing.assert_allclose(means, want, rtol=1e-5, atol=1e-6)
    signs = subset_signs(jnp.array([[0.0, -1e-9, 2.0]], jnp.float32))
    np.testing.assert_array_equal(signs, [[1, -1, 1]])  # a tie goes to +1
    assert list(np.asarray(unanimous(jnp.array([[1, 1], [1, -1], [-1, -1]], jnp.int8)))) == [
        True, False, True]


@pytest.mark.parametrize("budget", [1e-4, 0.33, 0.68, 5.0])
@pytest.mark.parametrize("total", [1, 7, 1000])
def test_adaptive_budget_never_exceeds_total(budget, total):
    rng = np.random.default_rng(3)
    used = 0.0
    for t in range(total):
        beta = per_step_budget(budget, used, t, total)
        assert beta >= 0.0
        used += beta * rng.choice([1.0, 1.0, 0.5, 0.0])  # caps and unanimous steps spend less
        assert used <= budget
    assert per_step_budget(budget, 0.0, total, total) == 0.0
    assert per_step_budget(budget, 0.0, 0, total) == pytest.approx(budget / total)


def test_zpl_unanimous_and_coin():
    signs = jnp.asarray([[-1] * 8, [1] * 8, [1, -1] * 4], jnp.int8)
    y, agree = zpl_release(signs, jax.random.key(4))
    assert list(np.asarray(agree)) == [True, True, False]
    assert float(y[0]) == -1.0 and float(y[1]) == 1.0 and abs(float(y[2])) == 1.0
    mixed = jnp.asarray([[1, -1] * 4] * 2000, jnp.int8)
    values, agree = jax.jit(zpl_release)(mixed, jax.random.key(5))
    assert not np.any(agree) and set(np.unique(np.asarray(values))) == {-1.0, 1.0}
    assert stats.binomtest(int(np.sum(np.asarray(values) > 0)), 2000).pvalue > 1e-3
    # the coins are a function of the key alone
    again, _ = zpl_release(mixed, jax.random.key(5))
    np.testing.assert_array_equal(again, values)
    other, _ = zpl_release(mixed, jax.random.key(6))
    assert not np.array_equal(other, values)


def test_positive_mass():
    logp = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    assert positive_mass(logp, np.array([1, -1, 1, -1])) == pytest.approx(0.4)
    assert positive_mass(logp, np.array([1, 1, 1, 1])) == 1.0


@pytest.mark.parametrize("budget, steps", [(1e-4, 50), (1e-4, 2000), (0.33, 100), (0.68, 40)])
def test_mi_release_realised_never_exceeds_charged(budget, steps):
    rng = np.random.default_rng(5)
    m = 16
    logp = mi_init_host(m).log_posterior
    secret, used = 3, 0.0
    for t in range(min(steps, 60)):
        signs = rng.choice(np.array([-1, 1], np.int8), size=m)
        beta = per_step_budget(budget, used, t, steps)
        rel, logp = mi_release(signs, secret, logp, beta, rng)
        assert rel.realised <= rel.charged <= beta
        if rel.sigma is not None:
            assert rel.realised == biawgn_mi_upper_bound(rel.q_plus, rel.sigma)
        assert np.exp(logp).sum() == pytest.approx(1.0)
        used += rel.charged
    assert used <= budget


@pytest.mark.parametrize("q", [0.5, 0.9])
def test_faithful_sigma_is_charged_what_it_leaks(q):
    # The reference solver stops at |I − β| < 1e-6 nats: at β = 1e-8 its σ leaks ~50 β. The
    # charge must be what the release leaks (30-digit reference), whatever the solver.
    beta, rng = 1e-8, np.random.default_rng(10)
    logp = np.log([q, 1 - q])
    rel, _ = mi_release(np.array([1, -1], np.int8), 0, logp, beta, rng, faithful=True)
    leak = mpmath_mi(q, rel.sigma)
    assert leak > 10 * beta  # the reference's σ overspends here...
    assert rel.charged >= leak and rel.charged >= rel.realised >= leak  # ...and it is charged
    assert rel.sigma == calibrate_biawgn_sigma(q, beta, faithful=True)  # same σ as the reference
    # With less budget left than that leak, the conservative σ is used: the budget binds.
    rel, _ = mi_release(np.array([1, -1], np.int8), 0, logp, beta, rng, faithful=True,
                        limit=2 * beta)
    assert mpmath_mi(q, rel.sigma) <= rel.charged <= beta


def test_mi_unanimous_is_free_and_keeps_posterior():
    rng = np.random.default_rng(6)
    logp = mi_init_host(8).log_posterior
    rel, out = mi_release(np.full(8, -1, np.int8), 2, logp, 1e-3, rng)
    assert rel.value == -1.0 and rel.unanimous and rel.charged == 0.0
    np.testing.assert_array_equal(out, logp)
    with pytest.raises(ValueError, match="budget is spent"):
        mi_release(np.array([1, -1] * 4, np.int8), 2, logp, 0.0, rng)


def test_mi_large_budget_moves_posterior_towards_secret():
    rng = np.random.default_rng(7)
    m, secret = 8, 5
    logp = mi_init_host(m).log_posterior
    for _ in range(40):
        signs = rng.choice(np.array([-1, 1], np.int8), size=m)
        rel, logp = mi_release(signs, secret, logp, 0.3, rng)
    assert int(np.argmax(logp)) == secret


def test_dpzo_release_noise_scale_and_event():
    values = jax.jit(lambda k: dpzo_release(jnp.zeros((4000,), jnp.float32), k,
                                            noise_multiplier=2.0, l2_clip=3.0,
                                            expected_batch_size=10.0))(jax.random.key(8))
    assert np.std(np.asarray(values)) == pytest.approx(0.6, rel=0.05)
    assert abs(float(np.mean(np.asarray(values)))) < 0.05
    shifted = dpzo_release(jnp.full((4000,), 5.0, jnp.float32), jax.random.key(8),
                           noise_multiplier=2.0, l2_clip=3.0, expected_batch_size=10.0)
    np.testing.assert_allclose(np.asarray(shifted) - np.asarray(values), 0.5, atol=1e-5)
    ev = dpzo_step_event(2.0, q=0.1, num_directions=4)
    assert ev.event.noise_multiplier == pytest.approx(1.0) and ev.sampling_probability == 0.1


def test_host_generator_is_a_function_of_the_key():
    a, b = host_generator(jax.random.key(3)), host_generator(jax.random.key(3))
    assert a.standard_normal() == b.standard_normal()
    assert host_generator(jax.random.key(4)).standard_normal() != \
        host_generator(jax.random.key(3)).standard_normal()


def _membership_attack(releases, trials, rng):
    """Adversary knowing the public signs and membership guesses example 0's membership from
    the candidate most consistent with the releases. ``releases(signs (steps, M), secrets
    (trials,))`` -> Y (trials, steps)."""
    m, steps = 16, 40
    b = np.asarray(membership_matrix(jax.random.key(int(rng.integers(2**31))), 30, m))
    signs = np.where(rng.normal(size=(steps, 30)) @ b / 15 + 0.1 * rng.normal(size=(steps, 1))
                     >= 0, 1, -1).astype(np.int8)
    secrets = rng.integers(m, size=trials)
    y = np.asarray(releases(signs, secrets), np.float64)
    wins = 0
    for trial, secret in enumerate(secrets):
        score = y[trial] @ signs
        guess = int(rng.choice(np.flatnonzero(score == score.max())))
        wins += b[0, guess] == b[0, secret]
    return wins


def test_zpl_membership_attack_is_at_chance():
    rng = np.random.default_rng(9)
    trials = 600

    def zpl(signs, secrets):  # one fresh coin key per trial; the secret is never read
        tiled = jnp.asarray(np.tile(signs, (len(secrets), 1)))
        y, _ = jax.jit(zpl_release)(tiled, jax.random.key(9))
        return np.asarray(y).reshape(len(secrets), -1)

    wins = _membership_attack(zpl, trials, rng)
    ci = stats.binomtest(wins, trials).proportion_ci(0.999)
    assert ci.low <= 0.5 <= ci.high
    # Deliberately broken variant: release the secret's own sign on disagreement.
    broken = _membership_attack(lambda s, js: s[:, js].T, trials, rng)
    assert stats.binomtest(broken, trials).proportion_ci(0.999).low > 0.8
