"""Merge operators on hand-computed cases, invariants and slow reference loops."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.merging import operators as ops

F = np.float32


def _base(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _np(tree):
    return jax.tree.map(np.asarray, tree)


# ------------------------------------------------------------------ WA / TA / helpers


def test_task_vectors_and_invariants():
    base = {"w": jnp.array([[1.0, 2.0]]), "b": jnp.array([0.5])}
    ft = [{"w": jnp.array([[2.0, 2.0]]), "b": jnp.array([1.5])},
          {"w": jnp.array([[1.0, 0.0]]), "b": jnp.array([-0.5])}]
    tv = ops.task_vectors(base, ft)
    np.testing.assert_allclose(tv["w"], [[[1.0, 0.0]], [[0.0, -2.0]]])
    np.testing.assert_allclose(tv["b"], [[1.0], [-1.0]])
    wa = ops.weight_average(base, tv)
    np.testing.assert_allclose(wa["w"], [[1.5, 1.0]])
    np.testing.assert_allclose(wa["b"], [0.5])
    ta = ops.task_arithmetic(base, tv)  # default scaling 0.3
    np.testing.assert_allclose(ta["w"], [[1.3, 1.4]], rtol=1e-6)
    one = ops.task_arithmetic(base, ops.task_vectors(base, ft[:1]), scaling=1.0)
    np.testing.assert_allclose(one["w"], ft[0]["w"])
    same = ops.weight_average(base, ops.task_vectors(base, [ft[1]] * 3))
    np.testing.assert_allclose(same["b"], ft[1]["b"])
    # A list of task vectors is the same as the stacked form.
    listed = [jax.tree.map(lambda x, i=i: x[i], tv) for i in range(2)]
    np.testing.assert_allclose(ops.weight_average(base, listed)["w"], wa["w"])


def test_structure_errors():
    base = {"w": jnp.zeros(3)}
    with pytest.raises(ValueError, match="structure of base"):
        ops.weight_average(base, {"v": jnp.zeros((2, 3))})
    with pytest.raises(ValueError, match="expected \\(T,"):
        ops.weight_average(base, {"w": jnp.zeros((2, 4))})
    with pytest.raises(TypeError, match="non-empty list"):
        ops.task_vectors(base, [])


# ------------------------------------------------------------------ TIES

TIES_TV = np.array([[4, -1, 0.5, 2, -3],
                    [-4, 1, 1, 1, 5],      # every |x| >= the threshold 1: ties all kept
                    [0, 0, -6, 0, 0]], F)  # column 0 sums to 0 -> global majority sign (+)


def _split(mat):
    return {"a": jnp.asarray(mat[:, :2]), "b": jnp.asarray(mat[:, 2:])}


@pytest.mark.parametrize("merge,expected", [("sum", [4, 1, -6, 3, 5]),
                                            ("mean", [4, 1, -6, 1.5, 5]),
                                            ("max", [4, 1, -6, 2, 5])])
def test_ties_global_hand_computed(merge, expected):
    tv = _split(TIES_TV)
    out = ops.ties(_base({"a": jnp.zeros(2), "b": jnp.zeros(3)}), tv, density=0.4, merge=merge,
                   scaling=1.0)
    got = np.concatenate([out["a"], out["b"]])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_ties_global_keeps_int_dk_plus_one_and_zero_vectors():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 1000)).astype(F)
    out = ops.ties({"w": jnp.zeros(1000)}, {"w": jnp.asarray(x)}, density=0.2, scaling=1.0)
    assert int(np.count_nonzero(out["w"])) == 201  # reference keeps int(d*K)+1
    zero = ops.ties({"w": jnp.ones(4)}, {"w": jnp.zeros((3, 4))}, scaling=1.0)
    np.testing.assert_array_equal(zero["w"], np.ones(4))


@pytest.mark.parametrize("merge,weights,expected", [
    ("mean", None, [2, -4, 2, 0]),
    ("sum", None, [4, -4, 4, 0]),
    ("mean", [2.0, 1.0, 1.0], [7 / 3, -4, 2, 0]),
])
def test_ties_tensor_scope_mergekit_semantics(merge, weights, expected):
    tv = {"w": jnp.array([[3, -1, 2, 0.5], [-1, -4, 2, 1], [1, 1, 1, 0]], jnp.float32)}
    out = ops.ties({"w": jnp.zeros(4)}, tv, density=0.5, merge=merge, scaling=1.0,
                   scope="tensor", weights=weights)
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)


def test_ties_validation():
    base = {"w": jnp.zeros(2)}
    tv = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="density must be in"):
        ops.ties(base, tv, density=0.0)
    with pytest.raises(ValueError, match="scope must be"):
        ops.ties(base, tv, scope="layer")
    with pytest.raises(ValueError, match="merge must be one of"):
        ops.ties(base, tv, merge="median")


# ------------------------------------------------------------------ DARE


def test_dare_explicit_masks_hand_computed():
    tv = {"w": jnp.array([[2.0, 4.0], [6.0, 8.0]])}
    masks = {"w": jnp.array([[True, False], [False, True]])}
    out = ops.dare({"w": jnp.zeros(2)}, tv, masks=masks, drop_rate=0.5, scaling=0.3)
    np.testing.assert_allclose(out["w"], [1.2, 4.8], rtol=1e-6)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        ops.dare({"w": jnp.zeros(2)}, tv)


def test_dare_random_masks_keep_fraction_and_unbiased():
    tv = {"w": jnp.ones((2, 20000))}
    m = ops.dare_masks(jax.random.key(0), tv, 0.3)
    assert abs(float(jnp.mean(m["w"])) - 0.7) < 0.01
    out = ops.dare({"w": jnp.zeros(20000)}, tv, key=jax.random.key(1), drop_rate=0.3,
                   scaling=1.0)
    assert float(jnp.mean(out["w"])) == pytest.approx(2.0, abs=0.03)  # E = sum of tau = 2
    again = ops.dare({"w": jnp.zeros(20000)}, tv, key=jax.random.key(1), drop_rate=0.3,
                     scaling=1.0)
    np.testing.assert_array_equal(out["w"], again["w"])


# ------------------------------------------------------------------ PCB


def _pcb_reference(tau, ratio, clamp, variant="official"):
    """Slow per-row transcription of the official PCB_merge (loops, Python sorting)."""
    t, d = tau.shape

    def clamp_q(row, lo, hi):
        s = sorted(row)
        return [min(max(v, s[int(d * lo)]), s[int(d * (1 - hi)) - 1]) for v in row]

    def minmax(row):
        lo_, hi_ = min(row), max(row)
        return [(v - lo_) / (hi_ - lo_) if hi_ > lo_ else 0.0 for v in row]

    a = [clamp_q([abs(float(v)) for v in tau[i]], clamp, clamp) for i in range(t)]
    tc = [[np.sign(tau[i, j]) * a[i][j] for j in range(d)] for i in range(t)]
    col = [sum(float(tau[i, j]) for i in range(t)) for j in range(d)]
    mm = [minmax(a[i]) for i in range(t)]
    vis = [sum(np.sign(tau[i, j]) * mm[i][j] for i in range(t)) for j in range(d)]
    scale = []
    for i in range(t):
        intra = [np.exp(t * v * v) for v in mm[i]]
        other = col if variant == "official" else vis
        inter = [np.tanh(float(tau[i, j]) * other[j]) for j in range(d)]
        scale.append(minmax(clamp_q([x * y for x, y in zip(intra, inter)], 1 - ratio, 0.0)))
    num = [sum(tc[i][j] * scale[i][j] for i in range(t)) for j in range(d)]
    den = [max(sum(scale[i][j] for i in range(t)), 1e-12) for j in range(d)]
    return np.array([n / m for n, m in zip(num, den)])


@pytest.mark.parametrize("variant", ["official", "vision"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pcb_matches_slow_reference(variant, seed):
    rng = np.random.default_rng(seed)
    tau = (rng.normal(size=(3, 40)) * 0.5).astype(F)
    tv = {"a": jnp.asarray(tau[:, :15].reshape(3, 3, 5)), "b": jnp.asarray(tau[:, 15:])}
    base = {"a": jnp.zeros((3, 5)), "b": jnp.zeros(25)}
    out = ops.pcb(base, tv, ratio=0.2, clamp=0.05, scaling=1.0, variant=variant)
    got = np.concatenate([np.asarray(out["a"]).ravel(), np.asarray(out["b"])])
    np.testing.assert_allclose(got, _pcb_reference(tau, 0.2, 0.05, variant), rtol=2e-5,
                               atol=1e-7)


def test_pcb_hand_single_task_and_zero_vectors():
    # One task, no clamping, ratio 0.5 on d = 4: scale is nonzero on the top d-int(d/2)-1 = 1
    # entry of beta, so only the largest |tau| survives, at its own value (scale/scale = 1).
    tv = {"w": jnp.array([[0.1, -0.4, 0.2, 0.3]])}
    out = ops.pcb({"w": jnp.zeros(4)}, tv, ratio=0.5, clamp=0.0, scaling=1.0)
    np.testing.assert_allclose(out["w"], [0.0, -0.4, 0.0, 0.0], rtol=1e-6)
    zero = ops.pcb({"w": jnp.ones(4)}, {"w": jnp.zeros((2, 4))})
    np.testing.assert_array_equal(zero["w"], np.ones(4))


# ------------------------------------------------------------------ WUDI


def _wudi_reference(tau_flax, iters, lr):
    """Adam on sum_t ||(M - K_t)^T K_t||^2/||K_t||^2 with the closed-form gradient
    2 K_t K_t^T (M - K_t) / ||K_t||^2, in float64."""
    taus = np.asarray(tau_flax, np.float64)
    m = taus.sum(0)
    mu, nu = np.zeros_like(m), np.zeros_like(m)
    for k in range(1, iters + 1):
        g = sum(2 * t @ t.T @ (m - t) / np.sum(t * t) for t in taus)
        mu = 0.9 * mu + 0.1 * g
        nu = 0.999 * nu + 0.001 * g * g
        m = m - lr * (mu / (1 - 0.9**k)) / (np.sqrt(nu / (1 - 0.999**k)) + 1e-8)
    return m


def test_wudi_matches_closed_form_adam_and_layouts_agree():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(2, 4, 3)).astype(F)
    bias = rng.normal(size=(2, 3)).astype(F)
    base = {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)}
    tv = {"kernel": jnp.asarray(k), "bias": jnp.asarray(bias)}
    out = ops.wudi(base, tv, iters=25, lr=1e-2)
    np.testing.assert_allclose(out["kernel"], _wudi_reference(k, 25, 1e-2), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(out["bias"], bias.mean(0), rtol=1e-6)
    torch_tv = {"kernel": jnp.asarray(k.transpose(0, 2, 1)), "bias": jnp.asarray(bias)}
    torch_out = ops.wudi({"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(3)}, torch_tv,
                         iters=25, lr=1e-2, layout="torch", others="zero")
    np.testing.assert_allclose(np.asarray(torch_out["kernel"]).T, out["kernel"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(torch_out["bias"], np.zeros(3))


def test_wudi_single_task_is_stationary_and_zero_task_is_safe():
    k = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, 2)).astype(F))
    out = ops.wudi({"k": jnp.zeros((3, 2))}, {"k": k}, iters=10, lr=1e-2)
    np.testing.assert_allclose(out["k"], k[0], rtol=1e-6, atol=1e-7)
    z = ops.wudi({"k": jnp.zeros((3, 2))}, {"k": jnp.concatenate([k, 0 * k])}, iters=5, lr=1e-2)
    assert np.all(np.isfinite(z["k"]))
    with pytest.raises(ValueError, match="layout must be"):
        ops.wudi({"k": jnp.zeros((3, 2))}, {"k": k}, layout="tf")


# ------------------------------------------------------------------ Iso-C, Fisher, RegMean


def test_iso_c_hand_computed():
    tv = {"w": jnp.array([[[3.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 1.0]]]),
          "b": jnp.array([[1.0], [3.0]])}
    out = ops.iso_c({"w": jnp.zeros((2, 2)), "b": jnp.zeros(1)}, tv)
    np.testing.assert_allclose(out["w"], 2.0 * np.eye(2), atol=1e-6)  # spectrum (3, 1) -> 2
    np.testing.assert_allclose(out["b"], [2.0])


def test_fisher_hand_computed():
    base = {"w": jnp.zeros(())}
    tv = {"w": jnp.array([1.0, 3.0])}
    fis = {"w": jnp.array([1.0, 3.0])}
    plain = ops.fisher(base, tv, fishers=fis, normalize=False, min_fisher=0.0)
    assert float(plain["w"]) == pytest.approx(2.5)
    normed = ops.fisher(base, tv, fishers=fis, normalize=True, min_fisher=0.0)
    assert float(normed["w"]) == pytest.approx(2.0)
    # Per-task weights c = (3, 1): c F = (3, 3), so the two models count equally.
    weighted = ops.fisher(base, tv, fishers=fis, weights=[3.0, 1.0], normalize=False,
                          min_fisher=0.0)
    assert float(weighted["w"]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="one entry per task"):
        ops.fisher(base, tv, fishers=fis, weights=[1.0, 1.0, 1.0])


def test_regmean_hand_computed_and_errors():
    base = {"k": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    k1 = np.arange(6, dtype=F).reshape(2, 3)
    k2 = -np.arange(6, dtype=F).reshape(2, 3) - 1
    tv = {"k": jnp.asarray(np.stack([k1, k2])), "b": jnp.array([[1.0, 1, 1], [3, 3, 3]])}
    g1, g2 = np.diag([1.0, 0]).astype(F), np.diag([0, 1.0]).astype(F)
    grams = {"k": jnp.asarray(np.stack([g1, g2])), "b": None}
    out = ops.regmean(base, tv, grams=grams)
    # Input 0 is only seen by task 1, input 1 only by task 2: rows come from each model.
    np.testing.assert_allclose(out["k"], np.stack([k1[0], k2[1]]), atol=1e-6)
    np.testing.assert_allclose(out["b"], [2.0, 2.0, 2.0])
    # A list of per-task Gram pytrees is the same as the stacked form.
    listed = ops.regmean(base, tv, grams=[{"k": jnp.asarray(g1), "b": None},
                                          {"k": jnp.asarray(g2), "b": None}])
    np.testing.assert_array_equal(listed["k"], out["k"])
    with pytest.raises(ValueError, match="structure of base"):
        ops.regmean(base, tv, grams={"nope": grams["k"]})
    with pytest.raises(ValueError, match="expected \\(T, in, in\\)"):
        ops.regmean(base, tv, grams={"k": jnp.zeros((2, 3, 3)), "b": None})


# ------------------------------------------------------------------ imports

_HEAVY = ("orbax", "dp_accounting", "flax", "pavejax.models", "pavejax.data")


@pytest.mark.parametrize("module", ["pavejax.merging", "pavejax.merging.operators"])
def test_importing_the_operators_loads_no_accountant_checkpointer_or_model(module):
    code = (f"import sys, {module}\n"
            f"heavy = sorted(m for m in sys.modules if m.startswith({_HEAVY!r}))\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_training_names_load_on_first_access():
    import pavejax.merging as merging
    from pavejax.merging import train

    for name in merging._TRAIN_NAMES:
        assert getattr(merging, name) is getattr(train, name)
    assert set(merging._TRAIN_NAMES) <= set(dir(merging))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        merging.nope  # noqa: B018
