"""Intrinsic RDP of the compact Gaussian sketch (Theorem 3.5), its (ε, δ) conversion, the γ
bounds, the conditions that must hold to claim it, and Proposition 3.7 (a public A is not DP)."""

import json
import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.special import logsumexp

from pavejax.accounting.sketch import (
    SketchConditionError,
    SketchConditions,
    SketchGuarantee,
    average_query_sensitivity,
    gamma_from_bounds,
    intrinsic_guarantee,
    sketch_epsilon,
    sketch_rdp,
)
from pavejax.audit import epsilon_lower_bound
from tests._renyi import logdet_renyi

DELTA = 1e-5


# ---------------------------------------------------------------- helpers (independent of the code)


def _random_spd(rng, k):
    x = rng.normal(size=(k, k))
    return x @ x.T + k * np.eye(k)


def _sqrtm(s):
    w, v = np.linalg.eigh(s)
    return (v * np.sqrt(w)) @ v.T


def _pair(rng, k, lams):
    """(Σ_D, Σ_D') with generalised eigenvalues ``lams``: Σ_D = Σ'^½ V diag(λ) Vᵀ Σ'^½."""
    s_q = _random_spd(rng, k)
    root = _sqrtm(s_q)
    v, _ = np.linalg.qr(rng.normal(size=(k, k)))
    s_p = root @ (v * lams) @ v.T @ root
    return (s_p + s_p.T) / 2, s_q


def _factor(rng, sigma, m):
    """H (k×m) with H Hᵀ = Σ."""
    q, _ = np.linalg.qr(rng.normal(size=(m, sigma.shape[0])))
    return np.linalg.cholesky(sigma) @ q.T


def _mc_sketch_renyi(s_p, s_q, alpha, rank, m, n, rng):
    """Monte Carlo of D_α(sketch under D ‖ sketch under D'): the sketch C = H(D') Aᵀ is sampled
    with a fresh A ~ N(0, 1/r) each time, and E_Q[(p/q)^α] is averaged in log space."""
    a = rng.normal(scale=1 / np.sqrt(rank), size=(n, rank, m))
    cols = np.einsum("km,nrm->nrk", _factor(rng, s_q, m), a)  # the r columns of each sketch
    prec = rank * (np.linalg.inv(s_p) - np.linalg.inv(s_q))
    quad = np.einsum("nrk,kl,nrl->n", cols, prec, cols)
    log_ratio = -0.5 * quad - 0.5 * rank * (np.linalg.slogdet(s_p)[1] - np.linalg.slogdet(s_q)[1])
    return (logsumexp(alpha * log_ratio) - math.log(n)) / (alpha - 1)


def _conditions(**overrides):
    kw = dict(a_secret=True, a_fresh_per_release=True, common_subspace_dim=4,
              covariance_stability=0.01, trajectory_independent_of_A=True)
    kw.update(overrides)
    return SketchConditions(**kw)


# ---------------------------------------------------------------- the RDP curve


@pytest.mark.parametrize("rank,k,gamma", [(1, 1, 0.5), (4, 2, 0.1), (16, 8, 0.01), (8, 1, 0.9)])
def test_alpha_two_closed_form(rank, k, gamma):
    rho = sketch_rdp(2.0, rank=rank, k=k, gamma=gamma)
    assert rho == pytest.approx(rank * k / 2 * math.log(1 / (1 - gamma**2)), rel=1e-12)
    assert rho <= rank * k * gamma**2 / (2 * (1 - gamma**2))  # the reference's upper bound


def test_hand_computed_order_one_and_a_half():
    # α = 1.5, γ = 0.5, r = k = 1:
    # f(0.5) = -log 1.25 + 0.5 log 2 = -0.2231436 + 0.3465736 = 0.1234300,
    # f(1.5) = log(4/3) - 0.5 log 1.5 = 0.0849; ρ = 1/(2 · 0.5) · max = 0.1234300.
    assert sketch_rdp(1.5, rank=1, k=1, gamma=0.5) == pytest.approx(0.1234300, abs=1e-7)
    assert sketch_rdp(1.5, rank=3, k=2, gamma=0.5) == pytest.approx(6 * 0.1234300, abs=1e-6)


def test_infinite_outside_the_valid_range():
    gamma = 0.25  # valid for 1 < α < 5
    assert math.isfinite(sketch_rdp(4.999, rank=2, k=2, gamma=gamma))
    assert sketch_rdp(5.0, rank=2, k=2, gamma=gamma) == math.inf
    assert sketch_rdp(7.0, rank=2, k=2, gamma=gamma) == math.inf
    assert sketch_rdp(math.inf, rank=2, k=2, gamma=gamma) == math.inf


@pytest.mark.parametrize("alpha,gamma", [(1.5, 0.3), (2.0, 0.2), (3.0, 0.1)])
def test_rho_matches_monte_carlo_renyi_of_the_sketch(alpha, gamma):
    rank, k, m = 2, 2, 3
    rho = sketch_rdp(alpha, rank=rank, k=k, gamma=gamma)
    rng = np.random.default_rng(7)
    mc, exact = [], []
    for lam in (1 - gamma, 1 + gamma):  # the two candidate worst cases
        s_p, s_q = _pair(rng, k, np.full(k, lam))
        exact.append(rank * logdet_renyi(s_p, s_q, alpha))
        mc.append(_mc_sketch_renyi(s_p, s_q, alpha, rank, m, 600_000, rng))
        assert mc[-1] == pytest.approx(exact[-1], rel=0.05)
    assert max(exact) == pytest.approx(rho, rel=1e-9)  # the bound is attained
    assert max(mc) == pytest.approx(rho, rel=0.05)
    assert max(mc) <= rho * 1.05


def test_sketch_columns_have_covariance_sigma_over_r():
    rng = np.random.default_rng(3)
    rank, m, n = 4, 5, 200_000
    sigma = _random_spd(rng, 3)
    a = rng.normal(scale=1 / np.sqrt(rank), size=(n, rank, m))
    cols = np.einsum("km,nrm->nrk", _factor(rng, sigma, m), a).reshape(-1, 3)
    np.testing.assert_allclose(np.cov(cols.T), sigma / rank, rtol=0.03, atol=0.01)


def test_random_stable_pairs_never_exceed_the_bound():
    rng = np.random.default_rng(11)
    for _ in range(300):
        k, rank = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        gamma = float(rng.uniform(0.01, 0.9))
        alpha = 1 + float(rng.uniform(0.01, 0.999)) / gamma  # inside (1, (1+γ)/γ)
        s_p, s_q = _pair(rng, k, rng.uniform(1 - gamma, 1 + gamma, size=k))
        assert rank * logdet_renyi(s_p, s_q, alpha) <= (
            sketch_rdp(alpha, rank=rank, k=k, gamma=gamma) * (1 + 1e-9) + 1e-12)


# ---------------------------------------------------------------- (ε, δ) conversion


@pytest.mark.parametrize("gamma,rk,expected", [(0.01, 64, 0.355), (0.05, 16, 1.12),
                                               (0.001, 1024, 0.117)])
def test_reference_numbers(gamma, rk, expected):
    eps, alpha = sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma)
    assert eps == pytest.approx(expected, rel=0.01)
    # the same number for any split of rk into r and k
    assert sketch_epsilon(DELTA, rank=rk // 4, k=4, gamma=gamma)[0] == pytest.approx(eps, 1e-9)
    at_two, _ = sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma, orders=[2.0])
    assert at_two == pytest.approx(math.log(1 / DELTA), abs=0.03)  # ≈ 11.5 whatever γ
    assert eps < at_two / 10
    # self-consistency: ε is ρ at the returned order plus the conversion term
    rho = sketch_rdp(alpha, rank=rk, k=1, gamma=gamma)
    assert eps == pytest.approx(rho + math.log(1 / DELTA) / (alpha - 1), rel=1e-9)


@pytest.mark.parametrize("gamma,rk", [(0.9, 1), (0.3, 8), (0.02, 500)])
def test_optimiser_beats_a_dense_scan(gamma, rk):
    eps, _ = sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma)
    alphas = 1 + np.linspace(1e-4, 1 - 1e-6, 20_001) / gamma
    brute = min(sketch_rdp(float(a), rank=rk, k=1, gamma=gamma) + math.log(1 / DELTA) / (a - 1)
                for a in alphas[::50])
    assert eps <= brute + 1e-12
    assert eps >= brute * 0.98  # and the scan is close to it: no spurious minimum


def test_improved_conversion_matches_dp_accounting():
    orders = [1.5, 2.0, 3.0, 5.0, 8.0, 16.0, 32.0, 64.0]
    gamma, rk = 0.01, 64
    rdp = [sketch_rdp(a, rank=rk, k=1, gamma=gamma) for a in orders]
    ref_eps, ref_order = rdp_privacy_accountant.compute_epsilon(orders, rdp, DELTA)
    eps, order = sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma, orders=orders,
                                conversion="improved")
    assert eps == pytest.approx(ref_eps, rel=1e-9) and order == ref_order
    assert sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma, conversion="improved")[0] < (
        sketch_epsilon(DELTA, rank=rk, k=1, gamma=gamma)[0])


def test_orders_outside_the_range_are_refused():
    with pytest.raises(ValueError, match="valid range"):
        sketch_epsilon(DELTA, rank=2, k=2, gamma=0.5, orders=[3.0, 10.0])
    with pytest.raises(ValueError, match="orders > 1"):
        sketch_epsilon(DELTA, rank=2, k=2, gamma=0.5, orders=[1.0, 2.0])


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(gamma=0.0), ValueError, "gamma"),
    (dict(gamma=1.0), ValueError, "DP-S-PAVE"),
    (dict(rank=0), ValueError, "rank must be >= 1"),
    (dict(k=0), ValueError, "k must be >= 1"),
    (dict(rank=2.0), TypeError, "rank must be an integer"),
    (dict(alpha=1.0), ValueError, "order > 1"),
    (dict(alpha=float("nan")), ValueError, "NaN"),
])
def test_bad_rdp_arguments(kwargs, exc, match):
    args = dict(alpha=2.0, rank=2, k=2, gamma=0.1) | kwargs
    with pytest.raises(exc, match=match):
        sketch_rdp(args.pop("alpha"), **args)


def test_bad_delta_and_conversion():
    with pytest.raises(ValueError, match="delta must be in"):
        sketch_epsilon(0.0, rank=2, k=2, gamma=0.1)
    with pytest.raises(ValueError, match="unknown conversion"):
        sketch_epsilon(DELTA, rank=2, k=2, gamma=0.1, conversion="tight")


# ---------------------------------------------------------------- γ from (L, μ, Δ)


def test_gamma_from_bounds_closed_form_and_refusals():
    assert gamma_from_bounds(lipschitz=2.0, mu=1.0, delta_h=0.1) == pytest.approx(0.4)
    with pytest.raises(SketchConditionError, match="no privacy guarantee.*DP-S-PAVE"):
        gamma_from_bounds(lipschitz=2.0, mu=1.0, delta_h=0.25)
    with pytest.raises(ValueError, match="cannot exceed lipschitz"):
        gamma_from_bounds(lipschitz=1.0, mu=2.0, delta_h=0.01)
    with pytest.raises(ValueError, match="delta_h must be a finite number > 0"):
        gamma_from_bounds(lipschitz=1.0, mu=1.0, delta_h=-0.1)


def test_gamma_from_bounds_really_bounds_covariance_stability():
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(300):
        k, m = int(rng.integers(1, 5)), 6
        u, _ = np.linalg.qr(rng.normal(size=(k, k)))
        v, _ = np.linalg.qr(rng.normal(size=(m, k)))
        h = u @ np.diag(rng.uniform(1.0, 3.0, size=k)) @ v.T
        e = rng.normal(size=(k, m))
        delta_h = float(rng.uniform(0.001, 0.2))
        h2 = h + e * (delta_h / np.linalg.norm(e, 2))
        svals = np.concatenate([np.linalg.svd(h, compute_uv=False),
                                np.linalg.svd(h2, compute_uv=False)])
        lip, mu = float(svals.max()), float(svals.min())
        if 2 * lip * delta_h / mu**2 >= 1:
            continue
        gamma = gamma_from_bounds(lipschitz=lip, mu=mu, delta_h=delta_h)
        s_p, s_q = h @ h.T, h2 @ h2.T
        root_inv = np.linalg.inv(_sqrtm(s_q))
        lams = np.linalg.eigvalsh(root_inv @ s_p @ root_inv)
        assert lams.min() >= 1 - gamma - 1e-9 and lams.max() <= 1 + gamma + 1e-9
        checked += 1
    assert checked > 100


def test_average_query_sensitivity():
    assert average_query_sensitivity(3.0, 100) == pytest.approx(0.06)
    assert average_query_sensitivity(3.0, 100, "add_remove") == pytest.approx(0.03)
    # replace-one is attained: swap Ψ = G e for Ψ = -G e in a mean of n terms
    n, g = 10, 3.0
    psi = np.zeros((n, 2, 4))
    psi[:, 0, 0] = g
    swapped = psi.copy()
    swapped[0] *= -1
    diff = np.linalg.norm(psi.mean(0) - swapped.mean(0), 2)
    assert diff == pytest.approx(average_query_sensitivity(g, n))
    with pytest.raises(ValueError, match="unknown neighbouring relation"):
        average_query_sensitivity(1.0, 10, "swap")
    with pytest.raises(ValueError, match="n must be >= 1"):
        average_query_sensitivity(1.0, 0)


# ---------------------------------------------------------------- conditions and the guarantee


def test_intrinsic_guarantee_numbers_and_record():
    cond = _conditions(a_fresh_per_release=False, notes="gamma from L, mu, Delta")
    g = intrinsic_guarantee(DELTA, rank=16, conditions=cond)
    eps, alpha = sketch_epsilon(DELTA, rank=16, k=4, gamma=0.01)
    assert (g.epsilon, g.best_alpha, g.k, g.gamma) == (eps, alpha, 4, 0.01)
    assert g.epsilon == pytest.approx(0.355, rel=0.01)  # r k = 64
    record = json.loads(json.dumps(g.to_dict(), allow_nan=False))
    assert record["kind"] == "conditional"
    assert record["conditions"]["a_secret"] is True
    assert any("shared" in c for c in record["caveats"])  # A reused across releases
    assert "key" in record["holds_against"]
    assert SketchGuarantee.from_dict(record) == g
    record["epsilon"] = 0.01
    with pytest.raises(ValueError, match="disagrees with the recomputed"):
        SketchGuarantee.from_dict(record)


def test_public_a_is_refused():
    with pytest.raises(SketchConditionError, match="Proposition 3.7.*DP-S-PAVE"):
        intrinsic_guarantee(DELTA, rank=8, conditions=_conditions(a_secret=False))


def test_adaptive_trajectory_is_refused():
    cond = _conditions(trajectory_independent_of_A=False)
    with pytest.raises(SketchConditionError, match="adaptive.*DP-S-PAVE"):
        intrinsic_guarantee(DELTA, rank=8, conditions=cond)
    assert issubclass(SketchConditionError, ValueError)


def test_guarantee_cannot_be_built_around_the_check():
    with pytest.raises(SketchConditionError, match="Proposition 3.7"):
        SketchGuarantee(epsilon=0.1, delta=DELTA, best_alpha=50.0, rank=8, k=4, gamma=0.01,
                        conditions=_conditions(a_secret=False))
    record = intrinsic_guarantee(DELTA, rank=8, conditions=_conditions()).to_dict()
    record["conditions"]["trajectory_independent_of_A"] = False
    with pytest.raises(SketchConditionError, match="adaptive"):
        SketchGuarantee.from_dict(record)


def test_conditions_validate_themselves():
    with pytest.raises(TypeError, match="a_secret must be True or False"):
        _conditions(a_secret="yes")
    with pytest.raises(ValueError, match="gamma"):
        _conditions(covariance_stability=1.5)
    with pytest.raises(ValueError, match="common_subspace_dim must be >= 1"):
        _conditions(common_subspace_dim=0)
    with pytest.raises(ValueError, match="disagrees with conditions.common_subspace_dim"):
        intrinsic_guarantee(DELTA, rank=8, k=3, conditions=_conditions())
    with pytest.raises(ValueError, match="disagrees with conditions.covariance_stability"):
        intrinsic_guarantee(DELTA, rank=8, gamma=0.02, conditions=_conditions())


# ---------------------------------------------------------------- Proposition 3.7, empirically


def _sketch_game(n, public_a, rng):
    """Releases under D (Σ = 1.2 I) and D' (Σ' = I); returns the attack scores of both."""
    rank, m, gamma = 8, 6, 0.2
    h_out = np.linalg.qr(rng.normal(size=(m, 2)))[0].T  # k = 2 orthonormal rows
    h_in = math.sqrt(1 + gamma) * h_out

    def releases(h):
        a = rng.normal(scale=1 / math.sqrt(rank), size=(n, rank, m))
        return a, np.einsum("km,nrm->nkr", h, a)

    def score(a, b):
        if public_a:  # with A known, B = F(D') Aᵀ is checked exactly
            return np.linalg.norm(b - np.einsum("km,nrm->nkr", h_out, a), axis=(1, 2))
        return (b**2).sum(axis=(1, 2))  # the likelihood-ratio statistic without A

    return score(*releases(h_in)), score(*releases(h_out))


def test_public_a_is_distinguishable_and_secret_a_is_not():
    claimed, _ = sketch_epsilon(DELTA, rank=8, k=2, gamma=0.2)
    assert 4.0 < claimed < 5.0
    s_in, s_out = _sketch_game(4000, public_a=False, rng=np.random.default_rng(0))
    secret = epsilon_lower_bound(s_in, s_out, delta=DELTA, alpha=0.05)
    assert 0.3 < secret <= claimed  # the attack has power, and stays below the claim
    s_in, s_out = _sketch_game(4000, public_a=True, rng=np.random.default_rng(0))
    assert np.all(s_out < 1e-9) and np.all(s_in > 1e-3)  # D identified exactly, every time
    public = epsilon_lower_bound(s_in, s_out, delta=DELTA, alpha=0.05)
    assert public > claimed  # the same claim is violated once A is published
