"""The intrinsic sketch guarantee (Theorem 3.5) on data-dependent specs: the clipped one-step
query, its singular-value bounds, the record, and the exact Rényi divergence of one neighbouring
pair checked against Monte Carlo and against the theorem's bound."""

import json
import math

import numpy as np
import pytest
from scipy.special import logsumexp

from pavejax.accounting import (
    clipped_average_query,
    intrinsic_record,
    query_bounds,
    renyi_gaussian,
    sketch_pair_rdp,
    sketch_rdp,
)
from tests._renyi import logdet_renyi

DELTA = 1e-5


# ---------------------------------------------------------------- helpers (independent of the code)


def _subspace(rng, d_out, k):
    u, _ = np.linalg.qr(rng.normal(size=(d_out, k)))
    return u


def _mean_of_clipped(per_example, U, clip):
    """The query written example by example, with plain loops."""
    paths = list(per_example)
    n = per_example[paths[0]].shape[0]
    out = {p: np.zeros((U[p].shape[1], per_example[p].shape[1])) for p in paths}
    for i in range(n):
        proj = {p: U[p].T @ per_example[p][i].T for p in paths}
        norm = math.sqrt(sum(float(np.sum(v**2)) for v in proj.values()))
        factor = 1.0 if norm <= clip else clip / norm
        for p in paths:
            out[p] += factor * proj[p] / n
    return out


def _neighbours(rng, n=30, d_in=5, d_out=4, k=3, clip=1.0):
    """A dataset whose projected gradients share a well-conditioned mean, and a replace-one
    neighbour whose replaced example points the other way (large, so it is clipped)."""
    U = _subspace(rng, d_out, k)
    p0 = np.zeros((k, d_in))
    p0[:, :k] = np.eye(k)
    base = (U @ p0).T  # (d_in, d_out), U^T base^T = p0
    g = 0.6 * base[None] + 0.15 * rng.normal(size=(n, d_in, d_out))
    g_adv = g.copy()
    g_adv[0] = -5.0 * base
    h = clipped_average_query({"w": g}, {"w": U}, clip)["w"]
    h_adv = clipped_average_query({"w": g_adv}, {"w": U}, clip)["w"]
    return h_adv, h  # H(D) with the adversarial example, H(D')


def _mc_pair_renyi(h_p, h_q, rank, alpha, samples, rng):
    """Monte Carlo of D_α(C(D) ‖ C(D')): sketches C = H(D') Aᵀ with fresh A ~ N(0, 1/r), and
    E_Q[(p/q)^α] averaged in log space from the Gaussian densities of the r columns."""
    m = h_q.shape[1]
    a = rng.normal(scale=1 / math.sqrt(rank), size=(samples, rank, m))
    cols = np.einsum("km,nrm->nrk", h_q, a)
    s_p, s_q = h_p @ h_p.T / rank, h_q @ h_q.T / rank
    prec = np.linalg.inv(s_p) - np.linalg.inv(s_q)
    log_ratio = (-0.5 * np.einsum("nrk,kl,nrl->n", cols, prec, cols)
                 - 0.5 * rank * (np.linalg.slogdet(s_p)[1] - np.linalg.slogdet(s_q)[1]))
    return (logsumexp(alpha * log_ratio) - math.log(samples)) / (alpha - 1)


# ---------------------------------------------------------------- query bounds and gamma


def test_query_bounds_of_a_diagonal_matrix():
    L, mu = query_bounds(np.array([[0.0, -4.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    assert L == pytest.approx(4.0, rel=1e-12) and mu == pytest.approx(0.5, rel=1e-12)


def test_gamma_by_hand_on_a_diagonal_H():
    # H = [diag(3, 2) | 0], n = 100, clip = 5: L = 3, mu = 2, Delta = 2 * 5 / 100 = 0.1,
    # gamma = 2 * 3 * 0.1 / 2^2 = 0.15; gamma_local = (6 + 0.1) * 0.1 / 1.9^2 = 0.168975...
    h = np.zeros((2, 4))
    h[0, 0], h[1, 1] = 3.0, 2.0
    rec = intrinsic_record({"layer": h}, n=100, clip=5.0, rank=4, delta=DELTA)
    layer = rec["layers"]["layer"]
    assert layer["L"] == pytest.approx(3.0) and layer["mu"] == pytest.approx(2.0)
    assert rec["delta_h"] == pytest.approx(0.1)
    assert layer["gamma"] == pytest.approx(0.15, rel=1e-12)
    assert layer["gamma_local"] == pytest.approx(0.61 / 3.61, rel=1e-12)
    assert layer["mu_needed"] == pytest.approx(math.sqrt(0.6))
    assert layer["n_for_gamma_one"] == pytest.approx(4 * 3 * 5 / 4)  # 15
    assert rec["gamma_max"] == pytest.approx(0.15) and rec["rk_total"] == 8


def test_alpha_two_of_the_record_matches_the_closed_form():
    rng = np.random.default_rng(1)
    h1, h2 = rng.normal(size=(2, 6)) + 3 * np.eye(2, 6), rng.normal(size=(3, 5)) + 3 * np.eye(3, 5)
    clip = 1.1 * max(np.linalg.norm(h1, 2), np.linalg.norm(h2, 2))
    rec = intrinsic_record({"a": h1, "b": h2}, n=5000, clip=clip, rank=4, delta=DELTA)
    assert rec["rk_total"] == 4 * (2 + 3)
    gamma = rec["gamma_max"]
    assert gamma == max(rec["layers"]["a"]["gamma"], rec["layers"]["b"]["gamma"])
    assert 0 < gamma < 1
    closed = rec["rk_total"] / 2 * math.log(1 / (1 - gamma**2))
    assert sketch_rdp(2.0, rank=4, k=5, gamma=gamma) == pytest.approx(closed, rel=1e-12)
    # the record's epsilon is at most the alpha = 2 conversion of that closed form
    assert rec["epsilon"] <= closed + math.log(1 / DELTA)


def test_more_layers_never_lower_epsilon():
    rng = np.random.default_rng(2)
    h = rng.normal(size=(2, 4)) + 4 * np.eye(2, 4)
    one = intrinsic_record({"a": h}, n=10_000, clip=10.0, rank=2, delta=DELTA)
    two = intrinsic_record({"a": h, "b": 0.5 * h}, n=10_000, clip=10.0, rank=2, delta=DELTA)
    # L and mu both halve, so gamma = 2 L Delta / mu^2 doubles
    assert two["layers"]["b"]["gamma"] == pytest.approx(2 * two["layers"]["a"]["gamma"])
    assert two["gamma_max"] == two["layers"]["b"]["gamma"]
    assert two["epsilon"] > one["epsilon"]


# ---------------------------------------------------------------- exact pair divergence


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0])
def test_renyi_gaussian_matches_the_determinant_form(alpha):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 3))
    s_q = x @ x.T + 3 * np.eye(3)
    y = rng.normal(size=(3, 3))
    s_p = s_q + 0.1 * (y @ y.T)
    assert renyi_gaussian(s_p, s_q, alpha) == pytest.approx(logdet_renyi(s_p, s_q, alpha),
                                                            rel=1e-9)


def test_renyi_gaussian_closed_forms():
    # one dimension, lambda = 0.5, alpha = 2: -(log 1.5 + log 0.5) / 2 = log(4/3) / 2
    assert renyi_gaussian([[0.5]], [[1.0]], 2.0) == pytest.approx(0.5 * math.log(4 / 3))
    assert renyi_gaussian(np.eye(3), np.eye(3), 2.0) == pytest.approx(0.0, abs=1e-15)
    # KL at alpha = 1: (lambda - 1 - log lambda) / 2 with lambda = 2
    assert renyi_gaussian([[2.0]], [[1.0]], 1.0) == pytest.approx((1 - math.log(2)) / 2)
    # alpha - (alpha - 1) lambda <= 0: infinite (lambda = 2, alpha = 2 and 3)
    assert renyi_gaussian([[2.0]], [[1.0]], 2.0) == math.inf
    assert renyi_gaussian(np.diag([1.0, 1.6]), np.eye(2), 3.0) == math.inf
    assert math.isfinite(renyi_gaussian(np.diag([1.0, 1.4]), np.eye(2), 3.0))


@pytest.mark.parametrize("alpha", [2.0, 3.0])
def test_pair_rdp_matches_monte_carlo_and_obeys_the_bound(alpha):
    rank = 2
    h_d, h_n = _neighbours(np.random.default_rng(4))
    exact = sketch_pair_rdp(h_d, h_n, rank, alpha)
    mc = _mc_pair_renyi(h_d, h_n, rank, alpha, 400_000, np.random.default_rng(5))
    assert exact > 0.05  # a pair far enough apart for the bound check to mean something
    assert mc == pytest.approx(exact, rel=0.05)

    rec = intrinsic_record({"w": h_d}, n=30, clip=1.0, rank=rank, delta=DELTA)
    k = rec["k_total"]
    bound = sketch_rdp(alpha, rank=rank, k=k, gamma=rec["gamma_max"])
    bound_local = sketch_rdp(alpha, rank=rank, k=k, gamma=rec["gamma_local_max"])
    assert exact <= bound and exact <= bound_local
    assert sketch_pair_rdp(h_n, h_d, rank, alpha) <= bound_local  # the other direction too

    # A deliberately broken gamma (Delta = clip / (10 n) instead of 2 clip / n, i.e. 20 times
    # smaller) gives a "bound" that both the exact pair divergence and its Monte-Carlo
    # estimate exceed: the check can fail.
    layer = rec["layers"]["w"]
    broken_gamma = 2 * layer["L"] * (1.0 / (10 * 30)) / layer["mu"] ** 2
    broken = sketch_rdp(alpha, rank=rank, k=k, gamma=broken_gamma)
    assert exact > broken and mc > 1.5 * broken


def test_local_gamma_holds_for_random_and_adversarial_neighbours():
    rng = np.random.default_rng(6)
    n, d_in, d_out, k, clip, rank = 30, 5, 4, 3, 1.0, 2
    U = _subspace(rng, d_out, k)
    p0 = np.zeros((k, d_in))
    p0[:, :k] = np.eye(k)
    base = (U @ p0).T
    g = 0.6 * base[None] + 0.15 * rng.normal(size=(n, d_in, d_out))
    h = clipped_average_query({"w": g}, {"w": U}, clip)["w"]
    rec = intrinsic_record({"w": h}, n=n, clip=clip, rank=rank, delta=DELTA)
    gamma_loc = rec["layers"]["w"]["gamma_local"]
    assert 0 < gamma_loc < 1
    worst = 0.0
    for trial in range(200):
        g2 = g.copy()
        replacement = (-5.0 * base if trial % 4 == 0 else
                       rng.normal(scale=float(rng.choice([0.1, 10.0])), size=(d_in, d_out)))
        g2[int(rng.integers(n))] = replacement
        h2 = clipped_average_query({"w": g2}, {"w": U}, clip)["w"]
        s, s2 = h @ h.T, h2 @ h2.T
        # condition (21) with gamma_local, both directions, via generalised eigenvalues
        for a, b in ((s, s2), (s2, s)):
            lam = np.linalg.eigvals(np.linalg.solve(b, a)).real
            assert np.all(lam >= 1 - gamma_loc) and np.all(lam <= 1 + gamma_loc)
            worst = max(worst, float(np.max(np.abs(lam - 1))))
    assert worst > gamma_loc / 3  # the neighbours came close enough for the check to bite


# ---------------------------------------------------------------- the clipped query


def test_query_matches_a_loop_and_clips_jointly():
    rng = np.random.default_rng(7)
    n, clip = 6, 2.0
    per_example = {"q": rng.normal(size=(n, 5, 4)), "v": rng.normal(size=(n, 3, 6))}
    per_example["q"][2] *= 100.0  # one example far above the clip
    U = {"q": _subspace(rng, 4, 2), "v": _subspace(rng, 6, 3)}
    h = clipped_average_query(per_example, U, clip)
    ref = _mean_of_clipped(per_example, U, clip)
    assert list(h) == ["q", "v"]
    assert h["q"].shape == (2, 5) and h["v"].shape == (3, 3)
    assert h["q"].dtype == np.float64
    for p in h:
        np.testing.assert_allclose(h[p], ref[p], rtol=1e-12, atol=1e-14)


def test_a_huge_example_contributes_exactly_the_clip():
    rng = np.random.default_rng(8)
    n, clip = 5, 0.7
    U = {"a": _subspace(rng, 4, 2), "b": _subspace(rng, 3, 3)}
    per_example = {"a": np.zeros((n, 6, 4)), "b": np.zeros((n, 2, 3))}
    per_example["a"][3] = 1e6 * rng.normal(size=(6, 4))
    per_example["b"][3] = 1e6 * rng.normal(size=(2, 3))
    h = clipped_average_query(per_example, U, clip)
    joint = math.sqrt(sum(float(np.sum(v**2)) for v in h.values()))
    assert joint * n == pytest.approx(clip, rel=1e-12)
    # an example below the clip is left alone: the query is then the plain mean
    small = {p: 1e-3 * rng.normal(size=v.shape) for p, v in per_example.items()}
    h_small = clipped_average_query(small, U, clip)
    for p in small:
        np.testing.assert_allclose(h_small[p], np.mean(U[p].T @ small[p].transpose(0, 2, 1),
                                                       axis=0), rtol=1e-12)


def test_replace_one_sensitivity_holds_and_is_nearly_attained():
    rng = np.random.default_rng(9)
    n, clip = 8, 1.5
    U = {"a": _subspace(rng, 4, 2), "b": _subspace(rng, 5, 2)}
    worst = 0.0
    for _ in range(300):
        scale = float(rng.choice([0.01, 1.0, 100.0]))
        g = {"a": scale * rng.normal(size=(n, 3, 4)), "b": scale * rng.normal(size=(n, 6, 5))}
        g2 = {p: v.copy() for p, v in g.items()}
        i = int(rng.integers(n))
        for p in g2:
            g2[p][i] = float(rng.choice([0.01, 1.0, 100.0])) * rng.normal(size=g2[p][i].shape)
        h, h2 = clipped_average_query(g, U, clip), clipped_average_query(g2, U, clip)
        for p in h:
            diff = float(np.linalg.norm(h[p] - h2[p], 2))
            assert diff <= 2 * clip / n * (1 + 1e-12)
            worst = max(worst, diff)
    # replacing x by -x, both huge and rank one in a single layer, reaches 2 clip / n
    g = {"a": np.zeros((n, 3, 4))}
    x = np.outer(rng.normal(size=3), U["a"][:, 0])
    g["a"][0] = 1e3 * x
    g2 = {"a": g["a"].copy()}
    g2["a"][0] = -1e3 * x
    h, h2 = (clipped_average_query(v, {"a": U["a"]}, clip)["a"] for v in (g, g2))
    assert np.linalg.norm(h - h2, 2) == pytest.approx(2 * clip / n, rel=1e-12)
    assert worst > 0.5 * 2 * clip / n  # the random draws were not all trivially small


# ---------------------------------------------------------------- records


def test_record_scope_and_finite_epsilon():
    h_d, _ = _neighbours(np.random.default_rng(10))
    rec = intrinsic_record({"w": h_d}, n=30, clip=1.0, rank=2, delta=DELTA)
    assert rec["kind"] != "dp" and rec["kind"] == "data-dependent"
    assert rec["scope"].startswith("data-dependent")
    assert "NOT a worst-case" in rec["scope"]
    assert "secret" in rec["conditions"] and "afresh" in rec["conditions"]
    assert rec["worst_case"]["epsilon"] == math.inf
    assert rec["worst_case"]["mu_sufficient_any_dataset"] == pytest.approx(2 / math.sqrt(30))
    assert 0 < rec["gamma_max"] < 1 and rec["reason"] is None
    assert math.isfinite(rec["epsilon"]) and rec["epsilon"] > 0
    assert 1 < rec["best_alpha"] < (1 + rec["gamma_max"]) / rec["gamma_max"]
    assert rec["epsilon_local"] >= rec["epsilon"]  # gamma_local >= gamma
    json.loads(json.dumps(rec))


def test_record_with_gamma_at_least_one_is_infinite_with_a_reason():
    h = np.zeros((2, 3))
    h[0, 0], h[1, 1] = 1.0, 0.1  # mu = 0.1: gamma = 2 * 1 * 0.2 / 0.01 = 40 at n = 10, clip = 1
    rec = intrinsic_record({"a": np.eye(2, 3), "b": h}, n=10, clip=1.0, rank=2, delta=DELTA)
    assert rec["layers"]["b"]["gamma"] == pytest.approx(40.0)
    assert rec["layers"]["a"]["gamma"] < rec["layers"]["b"]["gamma"]
    assert rec["epsilon"] == math.inf and rec["best_alpha"] is None
    assert "'b'" in rec["reason"] and "gamma" in rec["reason"] and "'a'" not in rec["reason"]
    assert rec["epsilon_local"] == math.inf and rec["reason_local"]
    assert rec["scope"].startswith("data-dependent")


def test_a_direction_without_signal_is_reported_not_raised_in_a_record():
    h = np.zeros((2, 3))
    h[0, 0] = 0.5
    with pytest.raises(ValueError, match="no signal"):
        query_bounds(h)
    rec = intrinsic_record({"a": h}, n=100, clip=1.0, rank=2, delta=DELTA)
    assert rec["layers"]["a"]["mu"] == 0.0 and rec["layers"]["a"]["gamma"] == math.inf
    assert rec["epsilon"] == math.inf and "no signal" in rec["reason"]


def test_mu_zero_dataset_has_a_perfectly_distinguishable_neighbour():
    """Why there is no worst-case bound: when every example lies in one direction of a k = 2
    subspace, a neighbour with signal in the other direction puts the sketch where it never is
    under the first dataset."""
    rng = np.random.default_rng(11)
    n, U = 10, {"w": np.eye(3)[:, :2]}
    g = np.zeros((n, 4, 3))
    g[:, :, 0] = rng.normal(size=(n, 4))  # projected gradients all in U's first column
    g2 = g.copy()
    g2[0, :, 1] = rng.normal(size=4)
    h, h2 = (clipped_average_query({"w": v}, U, 10.0)["w"] for v in (g, g2))
    with pytest.raises(ValueError, match="no signal"):
        query_bounds(h)
    assert query_bounds(h2)[1] > 0
    # under D every sketch column lies in span(H(D) H(D)^T) = e_1; under D' almost never
    a = rng.normal(size=(1000, 4, 2))
    cols_d, cols_n = np.einsum("km,nmr->nkr", h, a), np.einsum("km,nmr->nkr", h2, a)
    assert np.max(np.abs(cols_d[:, 1])) < 1e-12
    assert np.min(np.max(np.abs(cols_n[:, 1]), axis=1)) > 1e-9


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("h,match", [
    (np.ones((3, 2)), "k <= 2"),
    (np.array([[1.0, np.nan]]), "non-finite"),
    (np.ones(3), "2-D"),
    (np.zeros((0, 3)), "2-D"),
])
def test_query_bounds_refuses_bad_matrices(h, match):
    with pytest.raises(ValueError, match=match):
        query_bounds(h)


def test_record_refuses_bad_input():
    h = np.eye(2, 4)
    ok = dict(n=10, clip=1.0, rank=2, delta=DELTA)
    with pytest.raises(ValueError, match="non-empty mapping"):
        intrinsic_record({}, **ok)
    with pytest.raises(ValueError, match="k <= 2"):
        intrinsic_record({"a": np.ones((3, 2))}, **ok)
    with pytest.raises(ValueError, match="cannot be an average"):
        intrinsic_record({"a": 3 * h}, **ok)
    with pytest.raises(ValueError, match="non-finite"):
        intrinsic_record({"a": np.full((2, 4), np.inf)}, **ok)
    for key, value, exc in (("n", 0, ValueError), ("n", 2.5, TypeError),
                            ("clip", -1.0, ValueError), ("rank", 0, ValueError),
                            ("delta", 1.0, ValueError), ("conversion", "fast", ValueError)):
        with pytest.raises(exc):
            intrinsic_record({"a": h}, **{**ok, key: value})


def test_query_refuses_bad_input():
    rng = np.random.default_rng(12)
    g, U = {"a": rng.normal(size=(4, 3, 5))}, {"a": _subspace(rng, 5, 2)}
    with pytest.raises(ValueError, match="same layer paths"):
        clipped_average_query(g, {"b": U["a"]}, 1.0)
    with pytest.raises(ValueError, match="orthonormal"):
        clipped_average_query(g, {"a": 2 * U["a"]}, 1.0)
    with pytest.raises(ValueError, match=r"shape \(d_out, k\)"):
        clipped_average_query(g, {"a": _subspace(rng, 4, 2)}, 1.0)
    with pytest.raises(ValueError, match="same examples"):
        clipped_average_query({**g, "b": rng.normal(size=(3, 3, 5))}, {**U, "b": U["a"]}, 1.0)
    with pytest.raises(ValueError, match="clip"):
        clipped_average_query(g, U, 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        clipped_average_query({"a": g["a"] * np.nan}, U, 1.0)


def test_divergence_refuses_bad_input():
    with pytest.raises(ValueError, match="positive definite"):
        renyi_gaussian(np.diag([1.0, 0.0]), np.eye(2), 2.0)
    with pytest.raises(ValueError, match="symmetric"):
        renyi_gaussian(np.array([[1.0, 0.5], [0.0, 1.0]]), np.eye(2), 2.0)
    with pytest.raises(ValueError, match="same size"):
        renyi_gaussian(np.eye(2), np.eye(3), 2.0)
    with pytest.raises(ValueError, match="order > 0"):
        renyi_gaussian(np.eye(2), np.eye(2), 0.0)
    with pytest.raises(ValueError, match="same shape"):
        sketch_pair_rdp(np.eye(2, 3), np.eye(2, 4), 2, 2.0)
    with pytest.raises(ValueError, match="positive definite"):
        sketch_pair_rdp(np.eye(2, 3) * [[1.0], [0.0]], np.eye(2, 3), 2, 2.0)
