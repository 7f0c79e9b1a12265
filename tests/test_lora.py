"""Tests for pavejax.lora: selection, factor init, apply, flatten, hashing, Flax NNX round trip."""

import hashlib
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings, strategies as st

from pavejax.lora import (
    LoraConfig,
    a_hash,
    apply_lora,
    flatten_B,
    init_lora,
    lora_delta,
    named_leaves,
    num_parameters,
    path_string,
    select_paths,
    unflatten_B,
)


def kernels(path, leaf):
    return path.endswith("kernel")


def toy_params():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return {
        "encoder": {
            "layers": [
                {"query": {"kernel": f(6, 5), "bias": f(5)}},
                {"query": {"kernel": f(5, 4), "bias": f(4)}},
            ],
            "conv": {"kernel": f(3, 3, 2, 4)},
        },
        "head": {"kernel": f(4, 3), "step": jnp.array(7, jnp.int32)},
    }


def random_b(b, getkey):
    return {p: jax.random.normal(getkey(), v.shape, v.dtype) for p, v in b.items()}


# ---------------------------------------------------------------- config


def test_config_defaults_and_scale():
    cfg = LoraConfig(rank=8)
    assert cfg.alpha == 8.0 and cfg.scale == 1.0
    assert cfg.init == "gaussian" and cfg.dtype == np.dtype("float32")
    assert LoraConfig(rank=8, alpha=32).scale == 4.0
    assert LoraConfig(rank=4, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    hash(LoraConfig(rank=2))  # usable as a static jit argument


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(rank=0), ValueError, "rank must be >= 1"),
    (dict(rank=-3), ValueError, "rank must be >= 1"),
    (dict(rank=2.0), TypeError, "rank must be an int"),
    (dict(rank=True), TypeError, "rank must be an int"),
    (dict(rank=4, alpha=0.0), ValueError, "alpha must be a finite number > 0"),
    (dict(rank=4, alpha=-1.0), ValueError, "alpha must be a finite number > 0"),
    (dict(rank=4, alpha=float("nan")), ValueError, "alpha must be a finite number > 0"),
    (dict(rank=4, alpha="8"), TypeError, "alpha must be a real number"),
    (dict(rank=4, init="normal"), ValueError, "init must be one of"),
    (dict(rank=4, dtype=jnp.int32), TypeError, "floating dtype"),
])
def test_config_rejects_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LoraConfig(**kwargs)


# ---------------------------------------------------------------- selection


def test_path_strings_and_selection_order():
    params = toy_params()
    names = named_leaves(params)
    assert "encoder/layers/1/query/kernel" in names
    assert "head/step" in names
    assert select_paths(params, kernels) == (
        "encoder/conv/kernel",
        "encoder/layers/0/query/kernel",
        "encoder/layers/1/query/kernel",
        "head/kernel",
    )
    assert select_paths(params, lambda p, x: p.startswith("head") and x.ndim == 2) == (
        "head/kernel",)
    assert path_string((jax.tree_util.GetAttrKey("w"), jax.tree_util.SequenceKey(3))) == "w/3"


def test_predicate_matching_nothing_lists_paths():
    with pytest.raises(ValueError, match=r"matched no leaf.*'encoder/layers/0/query/kernel'"):
        select_paths(toy_params(), lambda p, x: "value" in p)


def test_selecting_non_float_or_1d_leaf_is_refused():
    params = toy_params()
    with pytest.raises(TypeError, match=r"'head/step' has dtype int32.*Narrow the predicate"):
        select_paths(params, lambda p, x: p.startswith("head"))
    with pytest.raises(ValueError, match=r"'encoder/layers/0/query/bias' has shape \(5,\)"):
        select_paths(params, lambda p, x: p.startswith("encoder/layers/0"))


def test_ambiguous_path_strings_are_refused():
    with pytest.raises(ValueError, match="share the path string 'a/b'"):
        named_leaves({"a/b": jnp.ones((2, 2)), "a": {"b": jnp.ones((2, 2))}})


# ---------------------------------------------------------------- init


def test_init_shapes_dtypes_and_zero_b(key):
    params = toy_params()
    cfg = LoraConfig(rank=2, dtype=jnp.bfloat16)
    b, a = init_lora(key, params, kernels, cfg)
    expected = {  # path: (d_in, d_out), conv kernel read as (3*3*2, 4)
        "encoder/conv/kernel": (18, 4),
        "encoder/layers/0/query/kernel": (6, 5),
        "encoder/layers/1/query/kernel": (5, 4),
        "head/kernel": (4, 3),
    }
    assert list(b) == list(a) == sorted(expected)
    for p, (d_in, d_out) in expected.items():
        assert a[p].shape == (d_in, 2) and b[p].shape == (2, d_out)
        assert a[p].dtype == b[p].dtype == jnp.bfloat16
        assert not np.any(np.asarray(b[p], np.float32))
        assert np.any(np.asarray(a[p], np.float32))


def test_rank_larger_than_leaf_is_refused(key):
    with pytest.raises(ValueError, match=r"rank 4 exceeds min\(d_in, d_out\) of 'head/kernel' "
                                         r"\(4, 3\); lower the rank"):
        init_lora(key, toy_params(), kernels, LoraConfig(rank=4))


def test_init_rejects_non_config(key):
    with pytest.raises(TypeError, match="config must be a LoraConfig"):
        init_lora(key, toy_params(), kernels, {"rank": 2})


def test_gaussian_a_statistics(key):
    r, d_in = 16, 2048
    _, a = init_lora(key, {"w": jnp.zeros((d_in, 64))}, kernels_or_all, LoraConfig(rank=r))
    x = np.asarray(a["w"], np.float64).ravel()
    n = x.size
    var = 1.0 / r
    # sample variance has std var*sqrt(2/n) ~ 0.8% here; 5 sigma
    assert abs(x.var() - var) < 5 * var * math.sqrt(2.0 / n)
    assert abs(x.mean()) < 5 * math.sqrt(var / n)
    assert scipy.stats.kstest(x, scipy.stats.norm(scale=math.sqrt(var)).cdf).pvalue > 1e-3


def kernels_or_all(path, leaf):
    return True


def test_kaiming_uniform_a_statistics(key):
    r, d_in = 16, 2048
    cfg = LoraConfig(rank=r, init="kaiming_uniform")
    _, a = init_lora(key, {"w": jnp.zeros((d_in, 64))}, kernels_or_all, cfg)
    x = np.asarray(a["w"], np.float64).ravel()
    bound = math.sqrt(6.0 / ((1 + 5) * d_in))  # kaiming_uniform(a=sqrt(5)) over fan_in
    var = bound**2 / 3.0
    assert np.all(np.abs(x) <= bound)
    assert np.abs(x).max() > 0.99 * bound
    # variance of U(-b, b) samples: var(x^2)=b^4/5 - b^4/9 = 4 b^4 / 45
    assert abs(x.var() - var) < 5 * math.sqrt(4 * bound**4 / 45 / x.size)
    assert scipy.stats.kstest(x, scipy.stats.uniform(-bound, 2 * bound).cdf).pvalue > 1e-3


def test_determinism_fold_in_per_leaf(key):
    params = {"a": jnp.zeros((8, 8)), "b": jnp.zeros((8, 8))}
    cfg = LoraConfig(rank=2)
    _, a1 = init_lora(key, params, kernels_or_all, cfg)
    _, a2 = init_lora(jax.random.key(0), params, kernels_or_all, cfg)
    _, a3 = init_lora(jax.random.key(1), params, kernels_or_all, cfg)
    for p in params:
        np.testing.assert_array_equal(a1[p], a2[p])
        assert not np.allclose(a1[p], a3[p])
    assert not np.allclose(a1["a"], a1["b"])  # same shape, distinct fold_in index
    np.testing.assert_array_equal(
        a1["b"], jax.random.normal(jax.random.fold_in(key, 1), (8, 2)) / math.sqrt(2.0))


# ---------------------------------------------------------------- apply


def test_apply_with_zero_b_is_identity(key):
    params = toy_params()
    b, a = init_lora(key, params, kernels, LoraConfig(rank=2, alpha=5.0))
    out = apply_lora(params, b, a, LoraConfig(rank=2, alpha=5.0))
    for p, leaf in named_leaves(params).items():
        np.testing.assert_array_equal(named_leaves(out)[p], leaf)


def test_apply_matches_hand_computed(key, getkey):
    params = toy_params()
    cfg = LoraConfig(rank=3, alpha=7.5)
    sel = lambda p, x: p.endswith("kernel") and "head" not in p  # noqa: E731
    b, a = init_lora(key, params, sel, cfg)
    b = random_b(b, getkey)
    out = named_leaves(apply_lora(params, b, a, cfg))
    before = named_leaves(params)
    for p in b:
        w = np.asarray(before[p], np.float64)
        d = (7.5 / 3) * np.asarray(a[p], np.float64) @ np.asarray(b[p], np.float64)
        np.testing.assert_allclose(out[p], w + d.reshape(w.shape), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lora_delta(b, a, cfg)[p], d, rtol=1e-5, atol=1e-5)
    for p in set(before) - set(b):
        assert out[p] is before[p]  # untouched leaves are passed through


def test_apply_jits_and_keeps_leaf_dtype(key, getkey):
    params = {"w": jnp.ones((6, 4), jnp.bfloat16), "v": jnp.ones((4, 4))}
    cfg = LoraConfig(rank=2)
    b, a = init_lora(key, params, kernels_or_all, cfg)
    b = random_b(b, getkey)
    eager = apply_lora(params, b, a, cfg)
    jitted = jax.jit(apply_lora, static_argnums=3)(params, b, a, cfg)
    assert jitted["w"].dtype == jnp.bfloat16 and jitted["v"].dtype == jnp.float32
    for p in params:
        np.testing.assert_array_equal(eager[p], jitted[p])


def test_grad_is_wrt_b_only_and_a_stays_out(key, getkey):
    params = toy_params()
    cfg = LoraConfig(rank=2, alpha=4.0)
    b, a = init_lora(key, params, kernels, cfg)
    x = jax.random.normal(getkey(), (7, 4))

    def loss(b_):
        w = apply_lora(params, b_, a, cfg)["head"]["kernel"]
        return jnp.sum(x @ w)

    g = jax.grad(loss)(b)
    assert set(g) == set(b)
    # d/dW sum(x W) = x^T 1; chain rule through W + s A B gives s A^T x^T 1
    want = 2.0 * np.asarray(a["head/kernel"]).T @ np.asarray(x).sum(0)[:, None] @ np.ones((1, 3))
    np.testing.assert_allclose(g["head/kernel"], want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(g["encoder/layers/0/query/kernel"]))
    b_leaves = jax.tree.leaves(b)
    assert len(b_leaves) == len(a)
    for leaf in b_leaves:
        assert leaf.shape[0] == cfg.rank  # (r, d_out): never an A of shape (d_in, r)
        assert not any(leaf is v for v in a.values())


def test_nan_in_b_reaches_only_its_leaf(key):
    params = toy_params()
    cfg = LoraConfig(rank=2)
    b, a = init_lora(key, params, kernels, cfg)
    b["head/kernel"] = b["head/kernel"].at[0, 0].set(jnp.nan)
    out = named_leaves(apply_lora(params, b, a, cfg))
    assert np.isnan(np.asarray(out["head/kernel"])[:, 0]).all()
    for p in b:
        if p != "head/kernel":
            assert np.isfinite(np.asarray(out[p])).all()


def test_apply_rejects_mismatched_factors(key):
    params = toy_params()
    cfg = LoraConfig(rank=2)
    b, a = init_lora(key, params, kernels, cfg)
    with pytest.raises(ValueError, match=r"same paths; only in B: \[\], only in A: \['head"):
        apply_lora(params, {k: v for k, v in b.items() if k != "head/kernel"}, a, cfg)
    with pytest.raises(ValueError, match="expected A \\(d_in, 3\\)"):
        apply_lora(params, b, a, LoraConfig(rank=3))
    with pytest.raises(ValueError, match=r"not leaves of params"):
        apply_lora({"head": params["head"]}, b, a, cfg)
    other = {"head": {"kernel": jnp.ones((5, 3))}}
    with pytest.raises(ValueError, match=r"needs A \(5, r\)"):
        apply_lora(other, {"head/kernel": b["head/kernel"]}, {"head/kernel": a["head/kernel"]},
                   cfg)
    with pytest.raises(TypeError, match="B must be a dict"):
        apply_lora(params, list(b.values()), a, cfg)


# ---------------------------------------------------------------- flatten and hash


def test_flatten_order_and_count():
    b = {"z": jnp.array([[1.0, 2.0]]), "a/x": jnp.array([[3.0], [4.0]])}
    assert num_parameters(b) == 4
    np.testing.assert_array_equal(flatten_B(b), [3.0, 4.0, 1.0, 2.0])
    assert flatten_B(b).dtype == jnp.float32


def test_flatten_round_trip_exact(key, getkey):
    params = toy_params()
    b, _ = init_lora(key, params, kernels, LoraConfig(rank=2))
    b = random_b(b, getkey)
    b["head/kernel"] = b["head/kernel"].astype(jnp.bfloat16)
    vec = flatten_B(b)
    assert vec.shape == (num_parameters(b),) == (2 * (4 + 5 + 4 + 3),)
    back = unflatten_B(vec, like=b)
    assert list(back) == sorted(b)
    for p in b:
        assert back[p].dtype == b[p].dtype
        np.testing.assert_array_equal(back[p], b[p])
    back_jit = jax.jit(unflatten_B)(vec, b)
    np.testing.assert_array_equal(flatten_B(back_jit), vec)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=4))
def test_flatten_round_trip_property(shapes):
    rng = np.random.default_rng(len(shapes))
    b = {f"l{i}": jnp.asarray(rng.standard_normal(s), jnp.float32) for i, s in enumerate(shapes)}
    np.testing.assert_array_equal(flatten_B(unflatten_B(flatten_B(b), b)), flatten_B(b))


def test_unflatten_rejects_bad_vectors():
    b = {"w": jnp.zeros((2, 3))}
    with pytest.raises(ValueError, match="vec has 5 entries but like holds 6"):
        unflatten_B(jnp.zeros(5), b)
    with pytest.raises(ValueError, match="vec must be 1-D"):
        unflatten_B(jnp.zeros((2, 3)), b)
    with pytest.raises(ValueError, match="B is empty"):
        flatten_B({})


def test_a_hash_matches_reference_and_is_sensitive(key):
    a = {"w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2)}
    # independent re-implementation of the documented byte layout
    h = hashlib.sha256(b"pavejax.lora.A.v1")
    for part in (b"w", b"float32", b"(3, 2)", np.arange(6, dtype="<f4").tobytes()):
        h.update(len(part).to_bytes(8, "little") + part)
    assert a_hash(a) == h.hexdigest()

    _, a1 = init_lora(key, toy_params(), kernels, LoraConfig(rank=2))
    _, a2 = init_lora(jax.random.key(0), toy_params(), kernels, LoraConfig(rank=2))
    assert a_hash(a1) == a_hash(a2) and len(a_hash(a1)) == 64
    changed = dict(a1, **{"head/kernel": a1["head/kernel"].at[1, 1].add(1e-3)})
    variants = [
        changed,
        {"v": a["w"]},                                   # other path
        {"w": a["w"].reshape(2, 3)},                     # same bytes, other shape
        {"w": a["w"].astype(jnp.bfloat16)},              # other dtype
    ]
    hashes = {a_hash(v) for v in variants} | {a_hash(a1), a_hash(a)}
    assert len(hashes) == len(variants) + 2


# ---------------------------------------------------------------- Flax NNX


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 6, rngs=rngs)
        self.l3 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.l3(jnp.tanh(self.l2(jnp.tanh(self.l1(x)))))


def test_nnx_split_apply_merge(key, getkey):
    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    pure = nnx.to_pure_dict(state)
    cfg = LoraConfig(rank=2, alpha=3.0)
    sel = lambda p, x: p in ("l1/kernel", "l3/kernel")  # noqa: E731
    b, a = init_lora(key, pure, sel, cfg)
    b = random_b(b, getkey)
    x = jax.random.normal(getkey(), (4, 5))

    new_state = jax.tree.map(lambda v: v, state)  # a copy; replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(new_state, apply_lora(pure, b, a, cfg))
    got = nnx.merge(graphdef, new_state)(x)

    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    w1 = f64(pure["l1"]["kernel"]) + 1.5 * f64(a["l1/kernel"]) @ f64(b["l1/kernel"])
    w3 = f64(pure["l3"]["kernel"]) + 1.5 * f64(a["l3/kernel"]) @ f64(b["l3/kernel"])
    h = np.tanh(f64(x) @ w1 + f64(pure["l1"]["bias"]))
    h = np.tanh(h @ f64(pure["l2"]["kernel"]) + f64(pure["l2"]["bias"]))
    want = h @ w3 + f64(pure["l3"]["bias"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_nnx_grad_through_merge(key, getkey):
    graphdef, state = nnx.split(MLP(nnx.Rngs(1)))
    pure = nnx.to_pure_dict(state)
    cfg = LoraConfig(rank=2)
    b0, a = init_lora(key, pure, lambda p, x: p in ("l1/kernel", "l2/kernel"), cfg)
    x = jax.random.normal(getkey(), (16, 5))
    y = jax.random.normal(getkey(), (16, 3))

    @jax.jit
    def loss(b, a_):
        model = nnx.merge(graphdef, apply_lora(pure, b, a_, cfg))
        return jnp.mean((model(x) - y) ** 2)

    def loss_ref(b, a_):  # the same network written out by hand, no nnx, no apply_lora
        def dense(h, name, lora):
            w = pure[name]["kernel"]
            if lora:
                w = w + a_[f"{name}/kernel"] @ b[f"{name}/kernel"]
            return h @ w + pure[name]["bias"][None, :]

        h = jnp.tanh(dense(jnp.tanh(dense(x, "l1", True)), "l2", True))
        return jnp.mean((dense(h, "l3", False) - y) ** 2)

    g_b, g_a = jax.grad(loss, argnums=(0, 1))(b0, a)
    for p in b0:
        assert not np.any(np.asarray(g_a[p]))  # B = 0 zeroes the gradient w.r.t. A
        assert np.linalg.norm(g_b[p]) > 1e-4
    ref_b = jax.grad(loss_ref)(b0, a)
    for p in b0:
        np.testing.assert_allclose(g_b[p], ref_b[p], rtol=1e-4, atol=1e-6)

    b1 = jax.tree.map(lambda v, g: v - 0.1 * g, b0, g_b)
    assert loss(b1, a) < loss(b0, a)
    g_b1, g_a1 = jax.grad(loss, argnums=(0, 1))(b1, a)
    for p in b0:
        assert np.linalg.norm(g_b1[p]) > 1e-4 and np.linalg.norm(g_a1[p]) > 1e-6
