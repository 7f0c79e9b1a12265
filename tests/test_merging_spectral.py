"""TSV-M on hand-computed cases and a reference built from numpy SVD + scipy's polar factor."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from pavejax.merging import spectral


def _reference(taus):
    t, m, n = taus.shape
    r = min(m, n)
    k = r // t
    u_cat, s_cat, v_cat = np.zeros((m, r)), np.zeros(r), np.zeros((r, n))
    for i, tau in enumerate(np.asarray(taus, np.float64)):
        u, s, vt = np.linalg.svd(tau, full_matrices=False)
        u_cat[:, i * k:(i + 1) * k], s_cat[i * k:(i + 1) * k] = u[:, :k], s[:k]
        v_cat[i * k:(i + 1) * k] = vt[:k]
    return scipy.linalg.polar(u_cat)[0] @ np.diag(s_cat) @ scipy.linalg.polar(v_cat)[0]


def test_tsv_m_orthogonal_tasks_sum_and_other_leaves_mean():
    # Tasks on orthogonal rank-1 directions: the factors are already orthonormal -> plain sum.
    t1 = 3.0 * np.outer([1.0, 0, 0], [1.0, 0])
    t2 = 2.0 * np.outer([0, 1.0, 0], [0, 1.0])
    tv = {"k": jnp.asarray(np.stack([t1, t2]), jnp.float32), "b": jnp.array([[1.0], [3.0]])}
    base = {"k": jnp.ones((3, 2)), "b": jnp.zeros(1)}
    out = spectral.tsv_m(base, tv)
    np.testing.assert_allclose(out["k"], 1.0 + t1 + t2, atol=1e-6)
    np.testing.assert_allclose(out["b"], [2.0])
    half = spectral.tsv_m(base, tv, scaling=0.5)
    np.testing.assert_allclose(half["k"], 1.0 + 0.5 * (t1 + t2), atol=1e-6)


def test_tsv_m_single_task_is_identity_and_too_many_tasks_keep_nothing():
    tau = np.random.default_rng(0).normal(size=(1, 4, 3)).astype(np.float32)
    out = spectral.tsv_m({"k": jnp.zeros((4, 3))}, {"k": jnp.asarray(tau)})
    np.testing.assert_allclose(out["k"], tau[0], rtol=1e-5, atol=1e-5)
    three = jnp.ones((3, 2, 2))  # r = 2 < T = 3: k = 0 components per task
    np.testing.assert_array_equal(spectral.tsv_m({"k": jnp.zeros((2, 2))}, {"k": three})["k"],
                                  np.zeros((2, 2)))


@pytest.mark.parametrize("shape", [(2, 6, 4), (3, 5, 9)])
def test_tsv_m_matches_polar_reference(shape):
    taus = np.random.default_rng(shape[0]).normal(size=shape).astype(np.float32)
    out = spectral.tsv_m({"k": jnp.zeros(shape[1:])}, {"k": jnp.asarray(taus)})
    np.testing.assert_allclose(out["k"], _reference(taus), rtol=1e-4, atol=1e-4)
