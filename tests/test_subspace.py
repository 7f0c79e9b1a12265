"""Coordinate specs (a public common subspace U, the seed paper's Eq. 18): U = I gives today's
specs bit for bit, coordinates are projections of the whole spec, U is orthonormal and
deterministic from public inputs, specs of different subspaces are refused, and DP-S-PAVE on
coordinates keeps its accounting (ledger = dp-accounting) and survives an empirical audit that
flags a broken variant."""

import dataclasses
import math

import dp_accounting as dpa
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax import audit, lora
from pavejax.pave import spec as S, subspace as sub_lib
from pavejax.spec_types import SpecMismatchError
from tests import _toy

D_IN, HIDDEN, K = _toy.D_IN, _toy.HIDDEN, _toy.K
DELTA = 1e-5
_logits, _kernels = _toy.logits, _toy.kernels


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    bb = _toy.tanh_mlp(rng)
    x = rng.normal(size=(24, D_IN)).astype(np.float32)
    t = S.hard_targets((x[:, 0] > 0).astype(np.int32), K)
    return {"bb": bb, "inputs": {"x": x}, "targets": t, "a_key": jax.random.key(5)}


def _spec(toy, config, **kw):
    return S.generate_spec(_logits, toy["bb"], _kernels, toy["inputs"], toy["targets"],
                           toy["a_key"], config, **kw)


def _one_step(**kw):
    return S.SpecConfig.preset("one_step", rank=2, progress=False, **kw)


def test_identity_subspace_gives_todays_spec_exactly(toy):
    everything = sub_lib.layer_selection(toy["bb"].params, _kernels, lambda p: True)
    quick = S.SpecConfig.preset("quick", rank=2, steps=5, progress=False)
    dp = _one_step(privacy=S.PrivacyConfig(l2_clip=0.5, noise_multiplier=2.0, sampling="full"))
    for cfg, kw in ((quick, {}), (dp, {"noise_key": jax.random.key(3)})):
        old = _spec(toy, cfg, **kw).spec
        new = _spec(toy, dataclasses.replace(cfg, subspace=everything), **kw).spec
        np.testing.assert_array_equal(new.vector, old.vector)
        diff = old.signature.mismatches(new.signature)
        assert len(diff) == 1 and diff[0].startswith("subspace"), diff
        with pytest.raises(SpecMismatchError, match="subspace"):
            old.cosine(new)
    assert old.signature.to_dict().get("subspace") is None  # whole-block records unchanged
    assert new.signature.to_dict()["subspace"] == everything.hash
    assert new.info["subspace"]["kind"] == "layers"


def test_random_projection_is_orthonormal_deterministic_and_stored(toy, tmp_path):
    params = toy["bb"].params
    u1 = sub_lib.random_projection(params, _kernels, 2, seed=4)
    u2 = sub_lib.random_projection(params, _kernels, 2, seed=4)
    u3 = sub_lib.random_projection(params, _kernels, 2, seed=5)
    for p in u1.paths:
        b = u1.basis(p).astype(np.float64)
        np.testing.assert_allclose(b.T @ b, np.eye(2), atol=1e-6)
        np.testing.assert_array_equal(u1.basis(p), u2.basis(p))
    assert u1 == u2 and u1.hash == u2.hash and u1.hash != u3.hash
    loaded = sub_lib.Subspace.load(u1.save(tmp_path / "u"))
    assert loaded == u1 and loaded.kind == "random" and loaded.info == {"k": 2, "seed": 4}
    # a tampered basis is refused on load
    z = dict(np.load(tmp_path / "u" / "subspace.npz"))
    z["u0"] = z["u0"][:, ::-1].copy()  # still orthonormal, another coordinate order
    with open(tmp_path / "u" / "subspace.npz", "wb") as f:
        np.savez(f, **z)
    with pytest.raises(ValueError, match="recorded hash"):
        sub_lib.Subspace.load(tmp_path / "u")


def test_one_step_coordinates_are_the_projected_whole_spec(toy):
    """At B = 0 one SGD step on C = B U moves C by the B-gradient projected on U: the
    coordinate spec is the whole one-step spec times U, and the returned B is C U^T."""
    u = sub_lib.random_projection(toy["bb"].params, _kernels, 2, seed=1)
    whole = _spec(toy, _one_step())
    coord = _spec(toy, _one_step(subspace=u))
    for p in u.paths:
        expected = np.asarray(whole.B[p], np.float64) @ u.basis(p).astype(np.float64)
        got = coord.spec.blocks()[p].reshape(2, 2)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(coord.B[p]), got @ u.basis(p).T, rtol=1e-5,
                                   atol=1e-8)
    assert coord.spec.dim == 2 * u.total_k == 8
    assert coord.trajectory_independent_of_A  # one full-batch unclipped SGD step


def test_clipped_coordinate_spec_clips_the_projected_gradient(toy):
    """example_clip on coordinates: -(1/n) sum_i clip(g_i U), g_i the per-example B gradient
    (computed here one example at a time, without the library's clipping code)."""
    params = toy["bb"].params
    u = sub_lib.random_projection(params, _kernels, 2, seed=2)
    lcfg = lora.LoraConfig(2)
    b0, a = lora.init_lora(toy["a_key"], params, _kernels, lcfg)

    def loss(b, x, t):
        merged = lora.apply_lora(params, b, a, lcfg)
        return -jnp.sum(t * jax.nn.log_softmax(_logits(merged, {"x": x[None]}, None)[0]))

    grad = jax.jit(jax.grad(loss))
    projected = []
    for x, t in zip(toy["inputs"]["x"], toy["targets"], strict=True):
        g = grad(b0, jnp.asarray(x), jnp.asarray(t))
        projected.append({p: np.asarray(g[p], np.float64) @ u.basis(p).astype(np.float64)
                          for p in u.paths})
    norms = [math.sqrt(sum(float(np.sum(v ** 2)) for v in gc.values())) for gc in projected]
    clip = float(np.median(norms))  # the clip bites for half of the examples
    total = {p: sum(gc[p] * min(1.0, clip / nm) for gc, nm in zip(projected, norms, strict=True))
             for p in u.paths}
    n = len(toy["targets"])
    expected = np.concatenate([-(total[p] / n).ravel() for p in sorted(u.paths)])
    got = _spec(toy, S.SpecConfig.preset("one_step_clipped", rank=2, example_clip=clip,
                                         progress=False, subspace=u)).spec.vector
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)


def test_coordinate_dp_ledger_equals_dp_accounting(toy):
    u = sub_lib.random_projection(toy["bb"].params, _kernels, 1, seed=0)
    sigma, steps = 1.1, 4
    cfg = S.SpecConfig.preset("quick", rank=2, steps=steps, batch_size=6, progress=False,
                              subspace=u, privacy=S.PrivacyConfig(l2_clip=0.5,
                                                                  noise_multiplier=sigma))
    res = _spec(toy, cfg)
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(6 / 24, dpa.GaussianDpEvent(sigma)), steps)
    g = res.spec.info["guarantee"]
    assert g["kind"] == "dp" and g["relation"] == "replace_one"
    assert g["epsilon"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    assert res.spec.info["subspace"]["hash"] == u.hash
    assert res.spec.dim == 2 * u.total_k == 4
    assert res.spec.info["config"]["subspace"] == u.hash


def test_coordinate_dp_noise_scale(toy):
    """The one-step coordinate release is -(S + N(0, (sigma C)^2 I_{rk})) / n: its spread over
    noise seeds is sigma C / n per coordinate (chi-square bounds over 2000 x 8 values)."""
    u = sub_lib.random_projection(toy["bb"].params, _kernels, 2, seed=0)
    sigma, clip, n = 3.0, 0.5, len(toy["targets"])
    cfg = _one_step(subspace=u, privacy=S.PrivacyConfig(l2_clip=clip, noise_multiplier=sigma,
                                                         sampling="full"))
    sampler = audit.spec_sampler(_logits, toy["bb"], _kernels, cfg)
    rel = sampler(toy["inputs"], toy["targets"], np.arange(2000), toy["a_key"])
    replay = _spec(toy, cfg, noise_key=jax.random.key(7)).spec.vector
    np.testing.assert_allclose(sampler(toy["inputs"], toy["targets"], [7], toy["a_key"])[0],
                               replay, rtol=1e-4, atol=1e-6)
    std = float(np.sqrt(np.mean((rel - rel.mean(0)) ** 2)))
    assert std == pytest.approx(sigma * clip / n, rel=0.05)


@pytest.fixture(scope="module")
def canary():
    rng = np.random.default_rng(0)
    n = 12
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, K)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    bb = S.Backbone("toy-tanh-mlp", params, S.backbone_hash(params))
    x = (0.5 * rng.normal(size=(n, D_IN))).astype(np.float32)
    x[-1] = 4.0 * np.abs(rng.normal(size=D_IN)) + 2.0
    t_in = S.hard_targets(rng.integers(0, K, n), K)
    t_in[-1] = [1.0, 0.0]
    t_out = t_in.copy()
    t_out[-1] = [0.0, 1.0]
    u = sub_lib.random_projection(params, _kernels, 2, seed=3)
    return bb, {"x": x}, t_in, t_out, u


def _coordinate_game(canary, privacy, claimed):
    bb, inputs, t_in, t_out, u = canary
    cfg = _one_step(subspace=u, privacy=privacy)
    sampler = audit.spec_sampler(_logits, bb, _kernels, cfg)
    return audit.spec_game(sampler, (inputs, t_in), (inputs, t_out), jax.random.key(7),
                           runs=6000, shadow_runs=3000, delta=DELTA, claimed_epsilon=claimed)


def test_coordinate_release_audit_stays_under_claim_and_flags_broken_variant(canary):
    bb, inputs, t_in, _, u = canary
    priv = S.PrivacyConfig(l2_clip=1.0, noise_multiplier=4.0, sampling="full")
    claimed = S.generate_spec(_logits, bb, _kernels, inputs, t_in, jax.random.key(7),
                              _one_step(subspace=u, privacy=priv)).spec.info["guarantee"]["epsilon"]
    honest = _coordinate_game(canary, priv, claimed)
    assert honest.epsilon_lower <= claimed
    assert honest.epsilon_lower > 0.1, "the audit has no power: the canary should be visible"
    broken = _coordinate_game(canary, dataclasses.replace(priv, noise_multiplier=0.4), claimed)
    assert broken.epsilon_lower > claimed, f"audit missed the broken variant ({broken})"


def test_calibrated_subspace_captures_calibration_gradients(toy):
    params = toy["bb"].params
    rng = np.random.default_rng(9)
    public = {"x": rng.normal(size=(40, D_IN)).astype(np.float32)}
    targets = sub_lib.random_targets(40, K, seed=1)
    first = lambda path, leaf: path == "l1/kernel"  # noqa: E731
    u = sub_lib.calibrated(_logits, params, first, public, targets, 2, microbatch=16,
                           info={"data": "synthetic public"})
    again = sub_lib.calibrated(_logits, params, first, public, targets, 2, microbatch=7)
    assert u.kind == "calibrated" and u.info["num_examples"] == 40
    for p in u.paths:  # the padding of another microbatch size changes nothing
        np.testing.assert_allclose(u.basis(p), again.basis(p), atol=1e-5)
    # the top-2 output directions hold more of the calibration gradient energy than random ones
    leaves = lora.named_leaves(params)

    def example_loss(w, x, t):
        merged = {"l1": {"kernel": w["l1/kernel"]}, "l2": {"kernel": w["l2/kernel"]}}
        return -jnp.sum(t * jax.nn.log_softmax(_logits(merged, {"x": x[None]}, None)[0]))

    w = {p: leaves[p] for p in ("l1/kernel", "l2/kernel")}
    g = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(w, public["x"], targets)
    rand = sub_lib.random_projection(params, first, 2, seed=0)
    p = "l1/kernel"
    gp = np.asarray(g[p], np.float64)
    energy = [float(np.sum((gp @ s.basis(p).astype(np.float64)) ** 2)) for s in (u, rand)]
    assert energy[0] > energy[1]
    # and exactly the top-2 eigenvectors of sum_i g_i^T g_i
    m = np.einsum("bio,bip->op", gp, gp)
    top = np.linalg.eigh(m)[1][:, -2:]
    proj = u.basis(p).astype(np.float64)
    np.testing.assert_allclose(proj @ proj.T, top @ top.T, atol=1e-5)


def test_bad_subspaces_are_refused(toy):
    params = toy["bb"].params
    with pytest.raises(ValueError, match="orthonormal"):
        sub_lib.Subspace({"l1/kernel": np.ones((HIDDEN, 2))}, {"l1/kernel": HIDDEN})
    with pytest.raises(ValueError, match="d_out"):
        sub_lib.Subspace({"l1/kernel": np.eye(3)[:, :2]}, {"l1/kernel": HIDDEN})
    with pytest.raises(ValueError, match="exceeds d_out"):
        sub_lib.random_projection(params, _kernels, 3)  # l2 has d_out = 2
    with pytest.raises(ValueError, match="not adapted"):
        sub_lib.layer_selection(params, _kernels, ["l3/kernel"])
    other = sub_lib.Subspace({"l1/kernel": np.eye(7)[:, :2]}, {"l1/kernel": 7})
    with pytest.raises(ValueError, match="another backbone"):
        _spec(toy, _one_step(subspace=other))
    with pytest.raises(TypeError, match="Subspace"):
        S.SpecConfig(subspace={"l1/kernel": np.eye(HIDDEN)})
    with pytest.raises(ValueError, match="fewer than k"):
        # the output-side gradient of the last kernel is h (p - y)^T, and p - y sums to zero
        # over the K = 2 classes: one direction, whatever the data
        x = {"x": np.random.default_rng(0).normal(size=(8, D_IN)).astype(np.float32)}
        sub_lib.calibrated(_logits, params, _kernels, x, sub_lib.random_targets(8, K), 2)


def test_dock_stores_the_subspace_and_refuses_specs_of_another(toy, tmp_path):
    from pavejax.pave.dock import Dock, DockError

    params = toy["bb"].params
    u = sub_lib.random_projection(params, _kernels, 2, seed=11)
    dock = Dock.create(tmp_path / "dock", subspace=u)
    assert dock.subspace == u
    cfg = S.SpecConfig.preset("quick", rank=2, steps=3, progress=False, subspace=dock.subspace)
    spec = S.generate_spec(_logits, toy["bb"], _kernels, toy["inputs"], toy["targets"],
                           dock.a_key(), cfg).spec
    dock.submit(spec, name="dev")
    reopened = Dock.open(tmp_path / "dock")
    assert reopened.subspace == u and reopened.search(spec, k=1).names == ("dev",)
    whole = S.generate_spec(_logits, toy["bb"], _kernels, toy["inputs"], toy["targets"],
                            dock.a_key(), dataclasses.replace(cfg, subspace=None)).spec
    other = S.generate_spec(_logits, toy["bb"], _kernels, toy["inputs"], toy["targets"],
                            dock.a_key(), dataclasses.replace(
                                cfg, subspace=sub_lib.random_projection(params, _kernels, 2,
                                                                        seed=12))).spec
    for bad in (whole, other):
        with pytest.raises(SpecMismatchError, match="subspace"):
            reopened.submit(bad, name="intruder")
        with pytest.raises(SpecMismatchError, match="subspace"):
            reopened.search(bad, k=1)
    assert len(reopened) == 1  # nothing was lost or added
    with pytest.raises(DockError, match="another coordinate subspace"):
        Dock.create(tmp_path / "dock", subspace=None, exist_ok=True)
    # a dock without a subspace refuses coordinate specs on the first submit
    plain = Dock.create(tmp_path / "plain")
    with pytest.raises(SpecMismatchError, match="no coordinate subspace"):
        plain.submit(spec, name="dev")
    # altered subspace files are detected
    (tmp_path / "dock" / "subspace" / "subspace.json").write_text("{}")
    with pytest.raises(DockError, match="subspace"):
        _ = Dock.open(tmp_path / "dock").subspace
