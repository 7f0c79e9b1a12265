"""Diagnostics of mergeability: sharpness, reference drift, merge gap, interpolation paths.

All functions take a scalar loss ``loss(params) -> float32`` (close over the evaluation data)
and pytrees; they read data only for evaluation and release nothing private by themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
Loss = Callable[[PyTree], jax.Array]


def _dot(a: PyTree, b: PyTree) -> jax.Array:
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _norm(a: PyTree) -> jax.Array:
    return jnp.sqrt(_dot(a, a))


def _scale(a: PyTree, s: jax.Array) -> PyTree:
    return jax.tree.map(lambda x: (x.astype(jnp.float32) * s).astype(x.dtype), a)


def _random_unit(key: jax.Array, like: PyTree) -> PyTree:
    leaves, treedef = jax.tree.flatten(like)
    z = jax.tree.unflatten(treedef, [jax.random.normal(jax.random.fold_in(key, i), x.shape,
                                                       jnp.float32).astype(x.dtype)
                                     for i, x in enumerate(leaves)])
    return _scale(z, 1.0 / _norm(z))


@functools.lru_cache(maxsize=64)
def _jitted(loss: Callable) -> Callable:
    # Keyed by the loss object: repeated diagnostics of one loss (with different ``args``)
    # compile once instead of once per call.
    return jax.jit(loss)


@functools.lru_cache(maxsize=64)
def _jitted_hvp(loss: Callable) -> Callable:
    return jax.jit(lambda p, v, args: hessian_vector_product(
        lambda q: loss(q, *args), p, v))


def hessian_vector_product(loss: Loss, params: PyTree, v: PyTree) -> PyTree:
    """``H v`` with H the Hessian of ``loss`` at ``params`` (forward-over-reverse)."""
    return jax.jvp(jax.grad(loss), (params,), (v,))[1]


def top_hessian_eigenvalue(loss: Loss, params: PyTree, key: jax.Array, *,
                           iters: int = 20, args: tuple = ()) -> float:
    """Largest-magnitude Hessian eigenvalue by power iteration on Hessian-vector products.

    Returns the Rayleigh quotient ``v^T H v`` of the final unit iterate (exact for the
    dominant eigenvector; converges geometrically in the eigen-gap ratio). The loss is
    ``loss(params, *args)``; passing data or frozen parts through ``args`` (instead of a new
    closure per call) lets repeated calls share one compilation.
    """
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}.")
    hvp = functools.partial(_jitted_hvp(loss), params, args=tuple(args))
    v = _random_unit(key, params)
    for _ in range(iters):
        hv = hvp(v)
        n = _norm(hv)
        if float(n) == 0.0:
            return 0.0
        v = _scale(hv, 1.0 / n)
    return float(_dot(v, hvp(v)))


def perturbed_loss_increase(loss: Loss, params: PyTree, key: jax.Array, *, rho: float = 0.05,
                            samples: int = 16, args: tuple = ()) -> float:
    """``E_u[loss(w + rho u)] - loss(w)`` over ``samples`` directions u uniform on the sphere.

    For a quadratic loss this is ``rho^2 tr(H) / (2 d)`` in expectation (d = #parameters).
    The loss is ``loss(params, *args)`` (``args`` as in :func:`top_hessian_eigenvalue`).
    """
    if not rho > 0 or samples < 1:
        raise ValueError(f"need rho > 0 and samples >= 1, got rho={rho!r}, samples={samples!r}.")
    g = _jitted(loss)
    f = lambda p: g(p, *args)  # noqa: E731
    base = float(f(params))
    vals = []
    for i in range(samples):
        u = _random_unit(jax.random.fold_in(key, i), params)
        w = jax.tree.map(lambda p, d: p + d, params, _scale(u, jnp.float32(rho)))
        vals.append(float(f(w)))
    return sum(vals) / len(vals) - base


def reference_drift(params: PyTree, reference: PyTree) -> float:
    """``||w - w0||_2`` over all leaves (float)."""
    return float(_norm(jax.tree.map(lambda a, b: a - b, params, reference)))


def merge_gap(task_losses: Sequence[Loss], merged: PyTree,
              individual: Sequence[PyTree]) -> list[float]:
    """Per task t: ``loss_t(merged) - loss_t(individual[t])`` (>= 0 when merging costs)."""
    if len(task_losses) != len(individual):
        raise ValueError(f"{len(task_losses)} losses but {len(individual)} individual models; "
                         "pass one of each per task.")
    return [float(f(merged)) - float(f(w)) for f, w in zip(task_losses, individual, strict=True)]


def interpolation_path(loss: Loss, start: PyTree, end: PyTree, *,
                       num: int = 11) -> tuple[list[float], list[float]]:
    """Losses along ``(1 - a) start + a end`` for ``num`` evenly spaced a in [0, 1]."""
    if not isinstance(num, int) or num < 2:
        raise ValueError(f"num must be an int >= 2, got {num!r}.")
    f = _jitted(loss)
    alphas = [i / (num - 1) for i in range(num)]
    vals = []
    for a in alphas:
        w = jax.tree.map(lambda s, e, a=a: s + (e - s) * jnp.asarray(a, s.dtype), start, end)
        vals.append(float(f(w)))
    return alphas, vals
