"""PAVE spec generation: configs, identification on a toy market, JL tracking, DP-S-PAVE ledger."""

from __future__ import annotations

import math

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from pavejax.models import label_space_head
from pavejax.pave.spec import (
    Backbone,
    PrivacyConfig,
    SpecConfig,
    backbone_hash,
    generate_spec,
    hard_targets,
    model_spec,
    soft_targets,
    user_spec,
)
from pavejax.spec_types import PaveSpec, SpecMismatchError

D_IN, HIDDEN = 8, 24
CLASSES = ("neg", "pos")


def _backbone(seed: int = 0) -> Backbone:
    rng = np.random.default_rng(seed)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    return Backbone("toy-mlp", params, backbone_hash(params))


def _toy_logits(p, batch, head):
    h = jnp.tanh(batch["x"] @ p["l1"]["kernel"])
    return jnp.tanh(h @ p["l2"]["kernel"]) @ head


def _kernels(path, leaf):
    return path.endswith("kernel")


HEAD = jnp.asarray(label_space_head(HIDDEN, CLASSES))
QUICK = SpecConfig.preset("quick", rank=4, steps=40, progress=False)


def _task(seed: int, n: int, axis: int):
    x = np.random.default_rng(seed).normal(size=(n, D_IN)).astype(np.float32)
    return {"x": x}, (x[:, axis] > 0).astype(np.int32)


# --- configs and inputs -----------------------------------------------------------------------


def test_config_validation_messages():
    with pytest.raises(ValueError, match="rank"):
        SpecConfig(rank=0)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        PrivacyConfig()
    with pytest.raises(ValueError, match="exactly one"):
        PrivacyConfig(noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        PrivacyConfig(target_epsilon=1.0, delta=0.0)
    with pytest.raises(ValueError, match="target_epsilon must be"):
        PrivacyConfig(target_epsilon=-1.0)
    with pytest.raises(ValueError, match="RDP accountant cannot analyse Poisson"):
        PrivacyConfig(target_epsilon=1.0, accountant="rdp")
    with pytest.raises(ValueError, match="unknown preset"):
        SpecConfig.preset("nope")
    with pytest.raises(ValueError, match="fit_target"):
        SpecConfig(fit_target="labels")
    cfg = SpecConfig.preset("learnware_llm", steps=3)
    assert (cfg.rank, cfg.alpha, cfg.a_init, cfg.steps) == (16, 32.0, "kaiming_uniform", 3)


def test_targets():
    np.testing.assert_allclose(soft_targets(np.log(np.array([[1.0, 3.0]]))), [[0.25, 0.75]],
                               rtol=1e-6)
    np.testing.assert_array_equal(hard_targets(np.array([1, 0]), 2), [[0, 1], [1, 0]])
    np.testing.assert_array_equal(hard_targets(np.array([[0.1, 2.0]]), 2), [[0, 1]])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        hard_targets(np.array([2]), 2)


@pytest.mark.parametrize("bad, match", [
    ("nan", "NaN or inf"), ("empty", "empty data"), ("length", "examples but targets"),
    ("probs", "probability rows")])
def test_bad_data_refused(key, bad, match):
    inputs, y = _task(0, 16, 0)
    targets = hard_targets(y, 2)
    if bad == "nan":
        inputs["x"][3, 1] = np.nan
    elif bad == "empty":
        targets = targets[:0]
    elif bad == "length":
        targets = targets[:5]
    else:
        targets = targets * 2.0
    with pytest.raises(ValueError, match=match):
        generate_spec(_toy_logits, _backbone(), _kernels, inputs, targets, key, QUICK, aux=HEAD)


# --- identification ---------------------------------------------------------------------------


def test_two_task_market_identification(key):
    """Developers that solve task 0 / task 1 (and a corrupted copy of task 0); users of each
    task with their own few shots: the user's top cosine is its task's good model."""
    bb = _backbone()
    specs = {}
    for name, axis, flip in (("dev0", 0, False), ("dev1", 1, False), ("dev0_bad", 0, True)):
        inputs, _ = _task(10 + axis, 64, axis)
        sign = -1.0 if flip else 1.0
        logits = np.stack([-sign * 3 * inputs["x"][:, axis], sign * 3 * inputs["x"][:, axis]], 1)
        specs[name] = model_spec(_toy_logits, bb, _kernels, inputs, logits, key, QUICK,
                                 aux=HEAD).spec
    for axis, good in ((0, "dev0"), (1, "dev1")):
        inputs, y = _task(100 + axis, 24, axis)
        u = user_spec(_toy_logits, bb, _kernels, inputs, y, 2, key, QUICK, aux=HEAD).spec
        cos = {k: u.cosine(s) for k, s in specs.items()}
        assert max(cos, key=cos.get) == good, cos
    u0 = user_spec(_toy_logits, bb, _kernels, *_task(100, 24, 0), 2, key, QUICK, aux=HEAD).spec
    assert u0.cosine(specs["dev0_bad"]) < 0 < u0.cosine(specs["dev0"])


def test_spec_record_and_determinism(key):
    bb = _backbone()
    inputs, y = _task(0, 32, 0)
    r1 = user_spec(_toy_logits, bb, _kernels, inputs, y, 2, key, QUICK, aux=HEAD)
    r2 = user_spec(_toy_logits, bb, _kernels, inputs, y, 2, key, QUICK, aux=HEAD)
    np.testing.assert_array_equal(r1.spec.vector, r2.spec.vector)
    sig = r1.spec.signature
    assert sig.layers == ("l1/kernel", "l2/kernel") and sig.rank == 4
    assert sig.layer_sizes == (4 * HIDDEN, 4 * HIDDEN) and sig.dim == r1.spec.vector.size
    assert r1.spec.kind == "user" and r1.spec.info["fit_target"] == "label"
    assert r1.spec.info["guarantee"]["kind"] == "none" and r1.ledger is None
    np.testing.assert_array_equal(r1.spec.blocks()["l1/kernel"],
                                  np.asarray(r1.B["l1/kernel"]).ravel())
    # another A key: another parameter space, comparison refused
    r3 = user_spec(_toy_logits, bb, _kernels, inputs, y, 2, jax.random.key(99), QUICK, aux=HEAD)
    with pytest.raises(SpecMismatchError, match="a_hash"):
        r1.spec.cosine(r3.spec)
    other = _backbone(seed=1)
    r4 = user_spec(_toy_logits, other, _kernels, inputs, y, 2, key, QUICK, aux=HEAD)
    with pytest.raises(SpecMismatchError, match="backbone_hash"):
        r1.spec.cosine(r4.spec)
    assert r1.losses[-1] < r1.losses[0]


def test_nan_spec_never_returned(key):
    inputs, y = _task(0, 16, 0)
    cfg = SpecConfig(rank=2, steps=3, optimizer="sgd", progress=False)

    def overflowing(p, batch, head):  # logits overflow to inf: the loss and B turn NaN
        return _toy_logits(p, batch, head) * jnp.float32(3e38) * jnp.float32(10.0)

    with pytest.raises(ValueError, match="diverged"):
        user_spec(overflowing, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
    sig = user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, QUICK,
                    aux=HEAD).spec.signature
    bad = np.ones(sig.dim, np.float32)
    bad[7] = np.nan
    with pytest.raises(ValueError, match="NaN/inf"):
        PaveSpec(bad, sig)


# --- Johnson-Lindenstrauss: cos(B, B') tracks cos(A B, A B') and the full update --------------

D_BIG, D_MID, D_OUT = 1024, 256, 4


def _linear_logits(p, batch, head):
    return batch["x"] @ p["w"]["kernel"] @ head


def _linear_setup():
    rng = np.random.default_rng(5)
    params = {"w": {"kernel": jnp.asarray(rng.normal(size=(D_BIG, D_MID)) * 0.01, jnp.float32)}}
    bb = Backbone("linear", params, backbone_hash(params))
    tasks = []
    for t in range(8):
        x = rng.normal(size=(48, D_BIG)).astype(np.float32)
        w_true = rng.normal(size=(D_BIG, D_OUT))
        tasks.append(({"x": x}, np.argmax(x @ w_true, axis=1).astype(np.int32)))
    return bb, tasks


LIN_HEAD = jnp.asarray(np.random.default_rng(6).normal(size=(D_MID, D_OUT)) / 16, jnp.float32)


def _full_gradient(bb, inputs, labels):
    def loss(w):
        logits = inputs["x"] @ w @ LIN_HEAD
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
    return np.asarray(jax.grad(loss)(bb.params["w"]["kernel"])).ravel()


def _cos_matrix(v):
    v = np.asarray(v, np.float64)
    v = v / np.linalg.norm(v, axis=1, keepdims=True)
    return (v @ v.T)[np.triu_indices(len(v), 1)]


@pytest.mark.parametrize("rank", [256])
def test_one_step_spec_sketches_full_update(key, rank):
    """One full-batch step: B = -lr A^T G, so cos(B, B') ~ cos(G, G') = cos(AB, AB') up to the JL
    error O(1/sqrt(r)); the error shrinks with r (checked against r = 8)."""
    bb, tasks = _linear_setup()
    g = np.stack([_full_gradient(bb, inp, y) for inp, y in tasks])
    errs = {}
    for r in (8, rank):
        cfg = SpecConfig.preset("one_step", rank=r, progress=False)
        res = [user_spec(_linear_logits, bb, _kernels, inp, y, D_OUT, key, cfg, aux=LIN_HEAD)
               for inp, y in tasks]
        b = np.stack([x.spec.vector for x in res])
        ab = np.stack([np.asarray(x.A["w/kernel"] @ x.B["w/kernel"]).ravel() for x in res])
        assert all(x.trajectory_independent_of_A for x in res)
        errs[r] = np.abs(_cos_matrix(b) - _cos_matrix(g))
        if r == rank:
            # per-pair JL deviation of a normalised inner product: ~ sqrt(2/r); 4 sigma bound
            bound = 4 * math.sqrt(2 / r)
            assert errs[r].max() <= bound, (errs[r].max(), bound)
            assert np.abs(_cos_matrix(ab) - _cos_matrix(g)).max() <= bound
            # the full update is -lr G; A B is its projection onto A's column space
            np.testing.assert_allclose(_cos_matrix(ab), _cos_matrix(b), atol=bound)
    assert errs[rank].mean() < errs[8].mean() / 2


def test_fan_in_scaling_matches_update_cosine(key):
    """Layers of fan-in 32 and 1024 with Gaussian A: B's cosine weighs layer l by d_in/r
    relative to cos(AB); layer_scaling='fan_in' undoes it."""
    rng = np.random.default_rng(3)
    params = {"a": {"kernel": jnp.asarray(rng.normal(size=(32, 64)) * 0.1, jnp.float32)},
              "b": {"kernel": jnp.asarray(rng.normal(size=(1024, 64)) * 0.01, jnp.float32)}}
    mix = jnp.asarray(rng.normal(size=(64, 8)) / 8, jnp.float32)
    bb = Backbone("two-layer", params, backbone_hash(params))

    def logits_fn(p, batch, head):
        return (batch["xa"] @ p["a"]["kernel"] + batch["xb"] @ p["b"]["kernel"]) @ mix

    tasks = []
    for _ in range(6):
        inputs = {"xa": rng.normal(size=(40, 32)).astype(np.float32) * 4,
                  "xb": rng.normal(size=(40, 1024)).astype(np.float32) / 8}
        tasks.append((inputs, rng.integers(0, 8, 40).astype(np.int32)))
    out = {}
    for scaling in ("none", "fan_in"):
        cfg = SpecConfig.preset("one_step", rank=16, layer_scaling=scaling, progress=False)
        res = [user_spec(logits_fn, bb, _kernels, inp, y, 8, key, cfg) for inp, y in tasks]
        b = np.stack([x.spec.vector for x in res])
        ab = np.stack([np.concatenate([np.asarray(x.A[p] @ x.B[p]).ravel() for p in sorted(x.B)])
                       for x in res])
        out[scaling] = np.abs(_cos_matrix(b) - _cos_matrix(ab)).mean()
        assert res[0].spec.signature.layer_scaling == scaling
    assert out["fan_in"] < 0.7 * out["none"], out


# --- DP-S-PAVE accounting ---------------------------------------------------------------------


def test_dp_ledger_equals_dp_accounting(key):
    inputs, y = _task(0, 40, 0)
    sigma, steps, delta = 1.3, 6, 1e-5
    cfg = SpecConfig.preset("quick", rank=2, steps=steps, batch_size=10, progress=False,
                            privacy=PrivacyConfig(l2_clip=0.5, noise_multiplier=sigma,
                                                  delta=delta))
    res = user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(10 / 40, dpa.GaussianDpEvent(sigma)), steps)
    g = res.spec.info["guarantee"]
    assert g["kind"] == "dp" and g["relation"] == "replace_one"
    assert g["epsilon"] == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    # the size is public (Poisson's rate 10 / 40 reveals it anyway): no add/remove figure
    assert "epsilon_add_remove" not in g and "n = 40" in g["public"]
    assert res.spec.info["num_examples"] == 40 and res.spec.info["replayable"] is False
    assert sum(e.count for e in res.ledger.entries) == steps  # one entry of count T
    assert res.spec.info["mechanism"] == "dp-s-pave"


def _closed_form(steps: int, sigma: float, delta: float) -> float:
    return 2 * steps / sigma ** 2 + 2 * math.sqrt(2 * steps * math.log(1 / delta)) / sigma


def test_q1_closed_form(key):
    """q = 1, replace-one, noise sigma C on sensitivity 2C: RDP 2 alpha T / sigma^2, so
    eps = 2T/sigma^2 + 2 sqrt(2T log(1/delta))/sigma (Theorem 3.9) with the classical
    conversion; dp-accounting's RDP (tighter conversion) must not exceed it."""
    steps, sigma, delta = 100, 10.0, 1e-5
    numeric = minimize_scalar(lambda a: 2 * steps * a / sigma ** 2 + math.log(1 / delta) / (a - 1),
                              bounds=(1.0001, 1e4), method="bounded", options={"xatol": 1e-12})
    assert _closed_form(steps, sigma, delta) == pytest.approx(numeric.fun, rel=1e-7)
    assert _closed_form(steps, sigma, delta) == pytest.approx(11.60, abs=0.01)
    inputs, y = _task(0, 12, 0)
    cfg = SpecConfig(rank=2, steps=steps, progress=False, learning_rate=1e-3,
                     privacy=PrivacyConfig(noise_multiplier=sigma, sampling="full",
                                           accountant="rdp", delta=delta))
    res = user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
    eps = res.spec.info["guarantee"]["epsilon"]
    assert 0.85 * _closed_form(steps, sigma, delta) <= eps <= _closed_form(steps, sigma, delta)


def test_target_epsilon_calibrates_joint_and_per_layer(key):
    inputs, y = _task(0, 40, 0)
    base = dict(l2_clip=1.0, target_epsilon=2.0, delta=1e-5, sampling="full", accountant="rdp")
    out = {}
    for clipping in ("joint", "per_layer"):
        cfg = SpecConfig.preset("quick", rank=2, steps=5, batch_size=10, progress=False,
                                privacy=PrivacyConfig(clipping=clipping, **base))
        res = user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
        assert res.spec.info["guarantee"]["epsilon"] == pytest.approx(2.0, abs=1e-3)
        out[clipping] = res
    # same sigma relative to the sensitivity: per-layer clipping's sensitivity C sqrt(2)
    assert out["joint"].spec.info["noise_multiplier"] == pytest.approx(
        out["per_layer"].spec.info["noise_multiplier"])
    assert "sqrt(L)" in " ".join(out["per_layer"].spec.info["guarantee"]["conditions"])


def test_dp_noise_key_is_fresh_unless_given_and_checked(key):
    inputs, y = _task(0, 12, 0)
    cfg = SpecConfig(rank=2, steps=1, progress=False, learning_rate=1.0, optimizer="sgd",
                     privacy=PrivacyConfig(noise_multiplier=1.0, sampling="full",
                                           accountant="rdp"))
    a, b = (user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
            for _ in range(2))
    assert np.abs(a.spec.vector - b.spec.vector).max() > 1e-4  # fresh noise each release
    assert a.spec.info["noise_key"].startswith("fresh")
    c, d = (user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD,
                      noise_key=jax.random.key(4)) for _ in range(2))
    np.testing.assert_array_equal(c.spec.vector, d.spec.vector)  # a replay
    assert c.spec.info["noise_key"].startswith("supplied")
    with pytest.raises(TypeError, match="noise_key must be one typed PRNG key"):
        user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD,
                  noise_key=4)
    with pytest.raises(ValueError, match="apply to DP-S-PAVE only"):
        user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key,
                  SpecConfig(rank=2, steps=1, progress=False), aux=HEAD,
                  noise_key=jax.random.key(4))


def test_fixed_size_sampling_claims_replace_one_only(key):
    inputs, y = _task(0, 40, 0)
    cfg = SpecConfig.preset("quick", rank=2, steps=2, batch_size=10, progress=False,
                            privacy=PrivacyConfig(noise_multiplier=2.0, sampling="fixed",
                                                  accountant="rdp"))
    res = user_spec(_toy_logits, _backbone(), _kernels, inputs, y, 2, key, cfg, aux=HEAD)
    g = res.spec.info["guarantee"]
    assert "epsilon_add_remove" not in g and 0 < g["epsilon"] < math.inf
    assert g["relation"] == "replace_one"


# --- per-example clipped (non-private) specs ------------------------------------------------


def _hand_clipped_step(bb, inputs, labels, key, rank, clip):
    """-(1/n) sum_i clip_C(grad_B loss_i) at B = 0, one example at a time (no vmap, no padding)."""
    from pavejax import lora

    lcfg = lora.LoraConfig(rank)
    b0, a = lora.init_lora(key, bb.params, _kernels, lcfg)
    targets = hard_targets(labels, len(CLASSES))

    def loss(b, x, t):
        merged = lora.apply_lora(bb.params, b, a, lcfg)
        return -jnp.sum(t * jax.nn.log_softmax(_toy_logits(merged, {"x": x[None]}, HEAD)[0]))

    grad = jax.jit(jax.grad(loss))  # one example per call: no vmap, no padding
    total, norms = None, []
    for x, t in zip(inputs["x"], targets, strict=True):
        g = grad(b0, jnp.asarray(x), jnp.asarray(t))
        norm = math.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in g.values()))
        norms.append(norm)
        g = {p: np.asarray(v, np.float64) * min(1.0, clip / norm) for p, v in g.items()}
        total = g if total is None else {p: total[p] + g[p] for p in g}
    n = len(labels)
    return np.concatenate([-(total[p] / n).ravel() for p in sorted(total)]), np.asarray(norms)


def test_example_clip_spec_is_the_mean_of_clipped_gradients(key):
    """The one_step_clipped recipe equals a hand computation of the clipped mean gradient, with
    a clip norm that clips some examples and not others and n not a multiple of the microbatch
    (padding); an unreachable clip norm gives the plain one-step spec back."""
    bb = _backbone()
    inputs, labels = _task(3, 21, 0)
    _, norms = _hand_clipped_step(bb, inputs, labels, key, 4, 1e9)
    clip = float(np.median(norms))
    want, _ = _hand_clipped_step(bb, inputs, labels, key, 4, clip)
    assert 0 < np.sum(norms > clip) < len(norms)
    cfg = SpecConfig.preset("one_step_clipped", rank=4, example_clip=clip, progress=False)
    got = user_spec(_toy_logits, bb, _kernels, inputs, labels, 2, key, cfg, aux=HEAD)
    np.testing.assert_allclose(got.spec.vector, want, rtol=2e-5, atol=1e-7)
    assert got.spec.info["config"]["example_clip"] == clip
    # the clip coefficients depend on A^T g: no A-independent trajectory is claimed
    assert not got.trajectory_independent_of_A
    plain = user_spec(_toy_logits, bb, _kernels, inputs, labels, 2, key,
                      SpecConfig.preset("one_step", rank=4, progress=False), aux=HEAD)
    loose = user_spec(_toy_logits, bb, _kernels, inputs, labels, 2, key,
                      SpecConfig.preset("one_step", rank=4, example_clip=1e9, progress=False),
                      aux=HEAD)
    np.testing.assert_allclose(loose.spec.vector, plain.spec.vector, rtol=1e-5, atol=1e-7)
    # clipping changed the spec: the largest-gradient examples weigh less
    assert not np.allclose(got.spec.vector, plain.spec.vector, rtol=1e-2)


def test_example_clip_minibatch_steps_run_and_repeat(key):
    bb = _backbone()
    inputs, labels = _task(4, 40, 1)
    cfg = SpecConfig.preset("quick", rank=4, steps=5, batch_size=24, example_clip=0.5,
                            progress=False)
    a = user_spec(_toy_logits, bb, _kernels, inputs, labels, 2, key, cfg, aux=HEAD)
    b = user_spec(_toy_logits, bb, _kernels, inputs, labels, 2, key, cfg, aux=HEAD)
    assert np.isfinite(a.spec.vector).all() and np.abs(a.spec.vector).max() > 0
    np.testing.assert_array_equal(a.spec.vector, b.spec.vector)
    assert len(a.losses) == 5


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_example_clip_validation(bad):
    with pytest.raises(ValueError, match="example_clip"):
        SpecConfig(example_clip=bad)


def test_example_clip_with_privacy_must_match_the_dp_clip():
    priv = PrivacyConfig(l2_clip=1.0, target_epsilon=4.0, sampling="full")
    with pytest.raises(ValueError, match="differs from privacy.l2_clip"):
        SpecConfig.preset("one_step_clipped", example_clip=2.0, privacy=priv)
    assert SpecConfig.preset("one_step_clipped", privacy=priv).example_clip == 1.0


def test_example_clip_refuses_a_non_finite_example_gradient(key):
    """An example whose loss is NaN would silently count as zero in the clipped sum; it is
    refused instead (the inputs themselves are finite, so _check_data lets them through)."""
    bb = _backbone()
    inputs, labels = _task(5, 20, 0)
    inputs["x"][3, 0] = 7.0

    def poisoned(p, batch, head):
        logits = _toy_logits(p, batch, head)
        return jnp.where((batch["x"][:, :1] == 7.0), jnp.nan, logits)

    cfg = SpecConfig.preset("one_step_clipped", rank=4, progress=False)
    with pytest.raises(ValueError, match="1 examples gave a non-finite loss or gradient"):
        user_spec(poisoned, bb, _kernels, inputs, labels, 2, key, cfg, aux=HEAD)
    inputs["x"][3, 0] = 0.5
    assert np.isfinite(user_spec(poisoned, bb, _kernels, inputs, labels, 2, key, cfg,
                                 aux=HEAD).spec.vector).all()
