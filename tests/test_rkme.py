"""RKME baseline: kernel, simplex QP, fitting, MMD distances, identification, bad inputs.

Expected values come from hand-written loops over the textbook formulas, a scipy SLSQP solve
of the same QP, and closed forms (projection onto the simplex, the exact embedding Z = X).
All fits share one data shape so each jitted piece compiles once.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from pavejax.pave.rkme import (
    RKMEConfig,
    RKMESpec,
    _top_eigenvalue_bound as top_eigenvalue_bound,
    fit_rkme,
    mmd2,
    mmd2_matrix,
    mmd2_to_data,
    project_simplex,
    rbf_kernel,
    similarity_scores,
    solve_simplex_qp,
)

CFG = RKMEConfig(reduced_size=20)
N, D = 200, 5
_project = jax.jit(project_simplex)


def hand_kernel(a, b, gamma):
    return np.array([[math.exp(-gamma * sum((float(p) - float(q)) ** 2 for p, q in zip(u, v)))
                      for v in b] for u in a])


def hand_mmd2(za, ba, zb, bb, gamma):
    """<Phi_a, Phi_a> - 2 <Phi_a, Phi_b> + <Phi_b, Phi_b> with explicit double sums."""
    def inner(z1, b1, z2, b2):
        return sum(b1[i] * b2[j] * math.exp(-gamma * float(np.sum((np.float64(z1[i])
                                                                   - np.float64(z2[j])) ** 2)))
                   for i in range(len(b1)) for j in range(len(b2)))
    return inner(za, ba, za, ba) - 2 * inner(za, ba, zb, bb) + inner(zb, bb, zb, bb)


def kkt_violation(k, c, x):
    """Max violation of the simplex-QP KKT conditions at x (float64): feasibility, dual
    feasibility g_i >= nu and complementary slackness x_i (g_i - nu) = 0."""
    g = k @ x - c
    support = x > 1e-7
    nu = float(np.mean(g[support]))
    return max(abs(float(x.sum()) - 1), float(-x.min()), float(np.max(nu - g)),
               float(np.max(np.abs(x * (g - nu)))), float(np.max(np.abs(g[support] - nu))))


@pytest.fixture(scope="module")
def data():
    return np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)


@pytest.fixture(scope="module")
def spec(data):
    return fit_rkme(data, CFG)


def test_config_defaults_are_the_learnware_package_defaults():
    c = RKMEConfig()
    assert (c.gamma, c.reduced_size, c.steps, c.step_size, c.nonnegative_beta) == \
        (0.1, 100, 3, 0.1, True)


def test_rbf_kernel_matches_loop():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(4, 3)), rng.normal(size=(6, 3))
    got = rbf_kernel(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 0.3)
    assert got.shape == (4, 6) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), hand_kernel(a, b, 0.3), rtol=1e-5)


@pytest.mark.parametrize("y, expected", [
    ([0.5, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]),
    ([2.0, 0.0, 0.0], [1.0, 0.0, 0.0]),
    ([0.6, 0.6, -1.0], [0.5, 0.5, 0.0]),
    ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),
])
def test_project_simplex_hand_cases(y, expected):
    np.testing.assert_allclose(np.asarray(_project(jnp.asarray(y, jnp.float32))),
                               expected, atol=1e-6)


def test_project_simplex_is_the_euclidean_projection():
    # x = P(y) iff x is feasible and <y - x, v - x> <= 0 for every vertex v of the simplex
    rng = np.random.default_rng(2)
    for _ in range(20):
        y = (rng.normal(size=7) * rng.choice([0.1, 1.0, 10.0])).astype(np.float32)
        x = np.asarray(_project(jnp.asarray(y)), np.float64)
        assert x.min() >= 0 and abs(x.sum() - 1) < 1e-5
        assert np.max((y - x) @ (np.eye(7) - x[None, :]).T) <= 1e-5 * max(1, np.abs(y).max())


def test_qp_with_identity_kernel_is_the_projection_of_c():
    # 1/2 x^T x - c^T x = 1/2 ||x - c||^2 + const, so the minimiser is P(c)
    for c, expected in (([1.0, 0.0, -1.0], [1.0, 0.0, 0.0]), ([0.5, 0.4, 0.1], [0.5, 0.4, 0.1])):
        res = solve_simplex_qp(jnp.eye(3, dtype=jnp.float32), jnp.asarray(c, jnp.float32))
        np.testing.assert_allclose(np.asarray(res.x), expected, atol=1e-6)


@pytest.mark.parametrize("m", [3, 100])
def test_qp_step_bound_is_above_the_top_eigenvalue_and_tight(m):
    # the QP's step 1/L is safe only if L >= lambda_max; the docstring promises within 8%
    z = np.random.default_rng(m).normal(size=(m, 4))
    a = hand_kernel(z, z, 0.3)
    top = np.linalg.eigvalsh(a)[-1]
    with jax.enable_x64(True):
        bound = float(top_eigenvalue_bound(jnp.asarray(a)))
    assert top * (1 - 1e-12) <= bound <= 1.08 * top


def _kernel_qp_instance(seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(10, 3))
    x = rng.normal(size=(60, 3)) + np.array([1.5, 0.0, 0.0])  # shifted: some weights hit 0
    return hand_kernel(z, z, 0.5), hand_kernel(z, x, 0.5).mean(axis=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_qp_satisfies_kkt_and_matches_scipy(seed):
    k, c = _kernel_qp_instance(seed)
    with jax.enable_x64(True):
        res = solve_simplex_qp(jnp.asarray(k), jnp.asarray(c), tol=1e-11)
        x = np.asarray(res.x)
    assert x.dtype == np.float64 and float(res.residual) <= 1e-11
    assert kkt_violation(k, c, x) < 1e-8

    obj = lambda b: 0.5 * b @ k @ b - c @ b  # noqa: E731
    ref = optimize.minimize(obj, np.full(10, 0.1), jac=lambda b: k @ b - c, method="SLSQP",
                            bounds=[(0, None)] * 10, options={"ftol": 1e-15, "maxiter": 1000},
                            constraints=[{"type": "eq", "fun": lambda b: b.sum() - 1,
                                          "jac": lambda b: np.ones_like(b)}])
    assert ref.success
    assert obj(x) <= ref.fun + 1e-12
    np.testing.assert_allclose(x, ref.x, atol=1e-5)
    assert abs(float(res.objective) - obj(x)) < 1e-12

    res32 = solve_simplex_qp(jnp.asarray(k, jnp.float32), jnp.asarray(c, jnp.float32), tol=1e-6)
    assert abs(obj(np.asarray(res32.x, np.float64)) - ref.fun) < 1e-5


def test_fit_gives_simplex_weights_deterministically(data, spec):
    assert spec.z.shape == (20, D) and spec.z.dtype == np.float32
    assert spec.beta.shape == (20,) and spec.num_points == N and spec.gamma == CFG.gamma
    assert spec.beta.min() >= 0 and abs(float(spec.beta.sum()) - 1) < 1e-5
    again = fit_rkme(data, CFG)
    np.testing.assert_array_equal(again.z, spec.z)
    np.testing.assert_array_equal(again.beta, spec.beta)
    other = fit_rkme(data, RKMEConfig(reduced_size=20, seed=1))
    assert not np.array_equal(other.z, spec.z)


def test_fitted_beta_is_the_qp_optimum_for_the_final_points(data, spec):
    k = hand_kernel(spec.z, spec.z, CFG.gamma)
    c = hand_kernel(spec.z, data, CFG.gamma).mean(axis=1)
    assert kkt_violation(k, c, spec.beta.astype(np.float64)) < 1e-5


def test_closed_form_beta_when_not_nonnegative(data):
    s = fit_rkme(data, RKMEConfig(reduced_size=20, nonnegative_beta=False))
    k = hand_kernel(s.z, s.z, 0.1)
    c = hand_kernel(s.z, data, 0.1).mean(axis=1)
    expected = np.linalg.solve(k + 1e-5 * np.eye(20), c)
    np.testing.assert_allclose(s.beta, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())


def test_spec_is_closer_to_its_own_data_than_to_a_shifted_distribution(data, spec):
    own = mmd2_to_data(spec, data)
    fresh = np.random.default_rng(5).normal(size=(N, D)).astype(np.float32)
    shifted = fresh + np.float32(1.0)
    assert own < 0.2 * mmd2_to_data(spec, shifted)
    assert mmd2_to_data(spec, fresh) < 0.2 * mmd2_to_data(spec, shifted)


def test_alternating_z_steps_lower_the_objective(data):
    fits = [fit_rkme(data, RKMEConfig(reduced_size=20, steps=s, step_size=10.0))
            for s in (0, 1, 3)]
    dists = [mmd2_to_data(f, data) for f in fits]
    assert dists[0] > dists[1] > dists[2]


def test_exact_embedding_has_zero_mmd_to_its_data(data):
    exact = RKMESpec(data, np.full(N, 1 / N, np.float32), 0.1, N)
    assert abs(mmd2_to_data(exact, data)) < 1e-6
    assert mmd2_to_data(exact, data + np.float32(0.5)) > 1e-3


def test_reduced_size_is_clipped_to_n_with_the_exact_embedding(data):
    few = data[:15]
    s = fit_rkme(few, CFG)
    np.testing.assert_array_equal(s.z, few)
    np.testing.assert_allclose(s.beta, np.full(15, 1 / 15), rtol=1e-6)
    assert s.reduced_size == s.num_points == 15


def test_mmd2_equals_hand_formula_on_three_points():
    a = RKMESpec(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), np.array([0.5, 0.3, 0.2]),
                 0.7, 3)
    b = RKMESpec(np.array([[0.5, 0.5], [2.0, -1.0]]), np.array([0.6, 0.4]), 0.7, 4)
    # by hand: the three Gram sums of the definition, one exp per pair
    e = math.exp
    aa = (0.25 + 0.09 + 0.04 + 2 * (0.5 * 0.3 * e(-0.7) + 0.5 * 0.2 * e(-0.7)
                                    + 0.3 * 0.2 * e(-1.4)))
    bb = 0.36 + 0.16 + 2 * 0.6 * 0.4 * e(-0.7 * 4.5)
    ab = (0.5 * (0.6 * e(-0.35) + 0.4 * e(-3.5)) + 0.3 * (0.6 * e(-0.35) + 0.4 * e(-1.4))
          + 0.2 * (0.6 * e(-0.35) + 0.4 * e(-5.6)))
    expected = aa - 2 * ab + bb
    assert expected == pytest.approx(hand_mmd2(a.z, a.beta, b.z, b.beta, 0.7), rel=1e-6)
    assert mmd2(a, b) == pytest.approx(expected, rel=1e-5)
    assert mmd2(b, a) == pytest.approx(mmd2(a, b), rel=1e-6)
    assert abs(mmd2(a, a)) < 1e-6


def test_mmd2_matrix_matches_pairs_with_different_sizes():
    rng = np.random.default_rng(3)

    def random_spec(m):
        w = rng.uniform(size=m)
        return RKMESpec(rng.normal(size=(m, 2)), w / w.sum(), 0.2, 50)

    users, devs = [random_spec(m) for m in (2, 9)], [random_spec(m) for m in (3, 1, 6)]
    got = np.asarray(mmd2_matrix(users, devs))
    assert got.shape == (2, 3)
    expected = [[hand_mmd2(u.z, u.beta, v.z, v.beta, 0.2) for v in devs] for u in users]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert got.min() >= -1e-6
    np.testing.assert_allclose(np.asarray(similarity_scores(users[1], devs)), -got[1], rtol=1e-6)


def test_mmd2_to_data_matches_hand_formula():
    rng = np.random.default_rng(4)
    s = RKMESpec(rng.normal(size=(3, 2)), np.array([0.2, 0.5, 0.3]), 0.4, 9)
    x = rng.normal(size=(9, 2)).astype(np.float32)
    expected = hand_mmd2(s.z, s.beta, x, np.full(9, 1 / 9), 0.4)
    assert mmd2_to_data(s, x) == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("unit_norm", [False, True])
def test_identification_picks_the_matching_domain(unit_norm):
    # two developer domains (two developers each); users bring 10 points of one domain.
    # unit_norm mimics L2-normalised sentence embeddings under the default wide kernel.
    rng = np.random.default_rng(6)
    means = 1.5 * np.eye(D)[:2]

    def sample(domain, n):
        v = means[domain] + (0.8 if unit_norm else 1.0) * rng.normal(size=(n, D))
        if unit_norm:
            v /= np.linalg.norm(v, axis=1, keepdims=True)
        return v.astype(np.float32)

    devs = [fit_rkme(sample(dom, N), CFG) for dom in (0, 1, 0, 1)]
    users = [fit_rkme(sample(i % 2, 10), CFG) for i in range(8)]
    picked = np.argmin(np.asarray(mmd2_matrix(users, devs)), axis=1) % 2
    np.testing.assert_array_equal(picked, np.arange(8) % 2)


def test_json_round_trip_is_exact(spec):
    back = RKMESpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    np.testing.assert_array_equal(back.z, spec.z)
    np.testing.assert_array_equal(back.beta, spec.beta)
    assert (back.gamma, back.num_points) == (spec.gamma, spec.num_points)
    assert mmd2(back, spec) == pytest.approx(0.0, abs=1e-6)


def test_bad_data_is_refused(data):
    bad = data.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN/inf entries .*row 3"):
        fit_rkme(bad, CFG)
    with pytest.raises(ValueError, match="empty"):
        fit_rkme(np.zeros((0, D), np.float32), CFG)
    with pytest.raises(ValueError, match="must be 2-D"):
        fit_rkme(data[0], CFG)
    with pytest.raises(ValueError, match="must be 2-D.*reshape"):
        fit_rkme(data.reshape(N, D, 1), CFG)
    with pytest.raises(TypeError, match="real numbers"):
        fit_rkme(np.array([["a", "b"]]), CFG)
    with pytest.raises(TypeError, match="RKMEConfig"):
        fit_rkme(data, {"gamma": 0.1})


@pytest.mark.parametrize("kwargs, match", [
    ({"gamma": 0.0}, "gamma must be a finite number > 0"),
    ({"gamma": float("nan")}, "gamma"),
    ({"reduced_size": 0}, "reduced_size must be an int >= 1"),
    ({"steps": -1}, "steps must be an int >= 0"),
    ({"step_size": -0.1}, "step_size"),
    ({"nonnegative_beta": "yes"}, "nonnegative_beta must be a bool"),
    ({"qp_max_iter": 0}, "qp_max_iter"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RKMEConfig(**kwargs)


def test_bad_specs_are_refused(spec):
    z = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"beta must have shape \(3,\)"):
        RKMESpec(z, np.ones(2), 0.1, 3)
    with pytest.raises(ValueError, match="NaN/inf"):
        RKMESpec(np.full((3, 2), np.inf), np.ones(3), 0.1, 3)
    with pytest.raises(ValueError, match="beta has NaN"):
        RKMESpec(z, np.array([0.5, np.nan, 0.5]), 0.1, 3)
    with pytest.raises(ValueError, match="num_points must be an int >= 3"):
        RKMESpec(z, np.ones(3) / 3, 0.1, 2)
    with pytest.raises(ValueError, match="not an RKME record"):
        RKMESpec.from_dict({"format": "other", "z": [[0.0]], "beta": [1.0]})
    with pytest.raises(ValueError, match="lacks fields"):
        RKMESpec.from_dict({"format": "pavejax.rkme/1", "z": [[0.0]], "beta": [1.0]})
    other_gamma = RKMESpec(spec.z, spec.beta, 0.5, spec.num_points)
    with pytest.raises(ValueError, match="different gamma"):
        mmd2(spec, other_gamma)
    with pytest.raises(ValueError, match="different feature dimensions"):
        mmd2(spec, RKMESpec(np.zeros((1, D + 1)), np.ones(1), 0.1, 1))
    with pytest.raises(ValueError, match="x has 4 features but the spec has 5"):
        mmd2_to_data(spec, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="non-empty sequence"):
        mmd2_matrix([spec], [])
    with pytest.raises(TypeError, match="must hold RKMESpec"):
        similarity_scores(spec, [spec.to_dict()])
    with pytest.raises(ValueError, match=r"K must be \(3, 3\)"):
        solve_simplex_qp(jnp.eye(2), jnp.ones(3))
