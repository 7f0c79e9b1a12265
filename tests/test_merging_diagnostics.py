"""Diagnostics on quadratics with closed-form answers."""

import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.merging import diagnostics as dg

A = np.diag([5.0, 2.0, 1.0, 0.5]).astype(np.float32)


def _quad(params):
    w = jnp.concatenate([params["a"], params["b"]])
    return 0.5 * w @ (jnp.asarray(A) @ w)


P0 = {"a": jnp.zeros(2), "b": jnp.zeros(2)}


def test_top_hessian_eigenvalue_and_hvp(key):
    rot = np.linalg.qr(np.random.default_rng(0).normal(size=(4, 4)))[0].astype(np.float32)
    h = rot @ A @ rot.T

    def loss(p):
        w = jnp.concatenate([p["a"], p["b"]])
        return 0.5 * w @ (jnp.asarray(h) @ w)

    assert dg.top_hessian_eigenvalue(loss, P0, key, iters=60) == pytest.approx(5.0, rel=1e-3)
    scaled = lambda p, c: c * loss(p)  # noqa: E731
    assert dg.top_hessian_eigenvalue(scaled, P0, key, iters=60, args=(jnp.float32(3.0),)) == (
        pytest.approx(15.0, rel=1e-3))
    v = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([0.0, 2.0])}
    hv = dg.hessian_vector_product(_quad, P0, v)
    np.testing.assert_allclose(np.concatenate([hv["a"], hv["b"]]), [5.0, 0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="iters must be"):
        dg.top_hessian_eigenvalue(loss, P0, key, iters=0)


def test_perturbed_loss_increase_matches_closed_form(key):
    # E[0.5 rho^2 u^T A u] = rho^2 tr(A) / (2 d) for u uniform on the unit sphere.
    got = dg.perturbed_loss_increase(_quad, P0, key, rho=0.1, samples=400)
    expected = 0.01 * np.trace(A) / (2 * 4)
    assert got == pytest.approx(expected, rel=0.15)
    # Data passed through ``args`` is the same as closing over it.
    scaled = lambda p, c: c * _quad(p)  # noqa: E731
    two = dg.perturbed_loss_increase(scaled, P0, key, rho=0.1, samples=400, args=(2.0,))
    assert two == pytest.approx(2 * got, rel=1e-5)


def test_drift_gap_and_path():
    w = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([0.0, 4.0])}
    assert dg.reference_drift(w, P0) == pytest.approx(5.0)
    gaps = dg.merge_gap([_quad, _quad], P0, [w, P0])
    assert gaps == pytest.approx([-(0.5 * (5 * 9 + 0.5 * 16)), 0.0])
    alphas, vals = dg.interpolation_path(_quad, P0, w, num=3)
    full = 0.5 * (5 * 9 + 0.5 * 16)
    assert alphas == [0.0, 0.5, 1.0]
    assert vals == pytest.approx([0.0, 0.25 * full, full], rel=1e-6)
    with pytest.raises(ValueError, match="one of each per task"):
        dg.merge_gap([_quad], P0, [w, P0])
