"""Merge operators under jax.jit and jax.vmap: traced multipliers, static shape parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.merging import operators as ops
from pavejax.merging.spectral import tsv_m

T = 3


def _problem():
    rng = np.random.default_rng(0)
    base = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
    tvs = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=(T, *x.shape)) * 0.1, jnp.float32),
                       base)
    fishers = jax.tree.map(lambda x: jnp.asarray(rng.uniform(size=x.shape), jnp.float32), tvs)
    x = rng.normal(size=(T, 10, 6))
    grams = {"w": jnp.asarray(np.einsum("tni,tnj->tij", x, x) / 10, jnp.float32), "b": None}
    return base, tvs, fishers, grams


BASE, TVS, FISHERS, GRAMS = _problem()

# op, Python-valued hyper-parameters, array-valued ones (passed through jit as arguments).
CASES = {
    "wa": (ops.weight_average, {}, {}),
    "ta": (ops.task_arithmetic, {}, {"scaling": 0.5}),
    "ties": (ops.ties, {"density": 0.2}, {"scaling": 0.4}),
    "ties_tensor": (ops.ties, {"density": 0.5, "merge": "mean", "scope": "tensor"},
                    {"scaling": 0.4, "weights": jnp.array([1.0, 2.0, 0.5])}),
    "dare": (ops.dare, {}, {"key": jax.random.key(3), "drop_rate": 0.3, "scaling": 0.5}),
    "pcb": (ops.pcb, {"ratio": 0.2, "clamp": 0.05}, {"scaling": 1.2}),
    "wudi": (ops.wudi, {"iters": 5}, {"lr": 1e-2}),
    "iso_c": (ops.iso_c, {}, {"scaling": 0.7}),
    "fisher": (ops.fisher, {"normalize": True},
               {"fishers": FISHERS, "weights": jnp.array([0.2, 0.3, 0.5]), "min_fisher": 1e-3}),
    "regmean": (ops.regmean, {}, {"grams": GRAMS, "reduce_non_diagonal": 0.9}),
    "tsv_m": (tsv_m, {}, {"scaling": 0.8}),
}


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_equals_eager_with_traced_inputs(name):
    op, static, dynamic = CASES[name]
    eager = op(BASE, TVS, **static, **dynamic)
    jitted = jax.jit(lambda b, t, kw: op(b, t, **static, **kw))(BASE, TVS, dynamic)
    _close(jitted, eager)
    # The jitted merge is a real merge: it moved the parameters.
    assert not np.allclose(jitted["w"], BASE["w"])


# Every hyper-parameter that may be traced, swept with vmap and compared with a Python loop.
SWEEPS = [
    ("ta", "scaling", np.linspace(0.1, 1.0, 4)),
    ("ties", "scaling", np.linspace(0.1, 1.0, 4)),
    ("ties_tensor", "weights", np.array([[1.0, 1, 1], [2, 1, 0.5], [0.1, 3, 1]])),
    ("dare", "scaling", np.array([0.2, 0.9])),
    ("dare", "drop_rate", np.array([0.0, 0.3, 0.7])),
    ("pcb", "scaling", np.array([0.5, 1.2])),
    ("wudi", "lr", np.array([1e-3, 1e-2])),
    ("iso_c", "scaling", np.array([0.5, 1.5])),
    ("fisher", "min_fisher", np.array([1e-6, 0.5])),
    ("fisher", "weights", np.array([[1.0, 1, 1], [0.1, 0.2, 0.7]])),
    ("regmean", "reduce_non_diagonal", np.array([0.0, 0.5, 1.0])),
    ("tsv_m", "scaling", np.array([0.5, 2.0])),
]


@pytest.mark.parametrize("name,arg,values", SWEEPS, ids=[f"{n}-{a}" for n, a, _ in SWEEPS])
def test_vmap_over_traced_hyper_parameter_equals_python_loop(name, arg, values):
    op, static, dynamic = CASES[name]
    values = np.asarray(values, np.float32)
    swept = jax.jit(jax.vmap(lambda v: op(BASE, TVS, **static, **{**dynamic, arg: v})))(
        jnp.asarray(values))
    for i, v in enumerate(values):
        v = v.tolist()  # Python float (or list of floats): the untraced path
        _close(jax.tree.map(lambda x, i=i: x[i], swept),
               op(BASE, TVS, **static, **{**dynamic, arg: v}))
    assert not np.allclose(swept["w"][0], swept["w"][-1])  # the sweep changes the merge


def test_scaling_sweep_is_linear_in_lambda():
    # Independent check: TA is w0 + lambda * sum_t tau_t.
    lams = jnp.linspace(0.1, 1.0, 10)
    swept = jax.jit(jax.vmap(lambda lam: ops.task_arithmetic(BASE, TVS, scaling=lam)))(lams)
    want = np.asarray(BASE["w"])[None] + np.asarray(lams)[:, None, None] * np.asarray(
        TVS["w"]).sum(0)[None]
    np.testing.assert_allclose(swept["w"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,arg,value", [
    ("ties", "density", 0.2),
    ("pcb", "ratio", 0.2),
    ("pcb", "clamp", 0.05),
    ("wudi", "iters", 5),
    ("fisher", "normalize", True),
])
def test_traced_static_argument_raises_clear_type_error(name, arg, value):
    op, static, dynamic = CASES[name]
    rest = {k: v for k, v in static.items() if k != arg}
    f = lambda v: op(BASE, TVS, **rest, **dynamic, **{arg: v})  # noqa: E731
    with pytest.raises(TypeError, match=f"{arg} must be a Python value, not a traced array"):
        jax.jit(f)(value)
    with pytest.raises(TypeError, match=f"{arg} must be a Python value"):
        jax.vmap(f)(jnp.asarray([value, value]))


def test_range_checks_still_run_on_concrete_values():
    with pytest.raises(ValueError, match="drop_rate must be in"):
        ops.dare(BASE, TVS, key=jax.random.key(0), drop_rate=1.0)
    with pytest.raises(ValueError, match="reduce_non_diagonal must be in"):
        ops.regmean(BASE, TVS, grams=GRAMS, reduce_non_diagonal=1.5)
