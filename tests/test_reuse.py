"""Reuse strategies: class mapping by name, ensemble, merge, fine-tune, and Dock.reuse."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax.pave.dock import Dock
from pavejax.pave.reuse import (
    class_probabilities,
    ensemble_topk,
    few_shot_loss,
    finetune_top1,
    merge_topk,
    predict_top1,
    reuse_models,
    user_accuracy,
)
from pavejax.spec_types import PaveSpec, SpecSignature


def logits_model(p, x):
    """A 'model' whose params are its logits: lets tests pick probabilities by hand."""
    return jnp.broadcast_to(p["logits"], (np.shape(x)[0], p["logits"].shape[0]))


def linear(p, x):
    return jnp.asarray(x, jnp.float32) @ p["w"] + p["b"][None, :]


def test_class_probabilities_map_by_name_by_hand():
    logits = np.array([[0.0, math.log(3.0)]])                  # softmax = (1/4, 3/4)
    got = class_probabilities(logits, ("neg", "pos"), ("pos", "neutral", "neg"))
    np.testing.assert_allclose(got, [[0.75, 0.0, 0.25]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"shape \(n, 3\)"):
        class_probabilities(logits, ("a", "b", "c"), ("a",))


def test_ensemble_averages_and_renormalises_by_hand():
    x = np.zeros((2, 1))
    a = {"logits": jnp.array([0.0, math.log(3.0)])}           # (neg, pos) = (1/4, 3/4)
    b = {"logits": jnp.array([0.0, 0.0])}                     # (pos, other) = (1/2, 1/2)
    got = ensemble_topk([a, b], logits_model, x, [("neg", "pos"), ("pos", "other")],
                        ("neg", "pos"))
    # mean of (1/4, 3/4) and (0, 1/2) = (1/8, 5/8); renormalised by 3/4 -> (1/6, 5/6)
    np.testing.assert_allclose(got, [[1 / 6, 5 / 6]] * 2, rtol=1e-6)
    with pytest.raises(ValueError, match="none of the models predicts"):
        ensemble_topk([a], logits_model, x, [("x", "y")], ("neg", "pos"))


def test_top1_renormalises_over_shared_classes_and_accuracy():
    p = {"logits": jnp.array([0.0, math.log(3.0), math.log(4.0)])}   # (1/8, 3/8, 4/8)
    got = predict_top1(p, logits_model, np.zeros((1, 1)), ("neg", "pos", "other"), ("pos", "neg"))
    np.testing.assert_allclose(got, [[0.75, 0.25]], rtol=1e-6)
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    assert user_accuracy(probs, np.array([0, 1, 1]), ("a", "b")) == pytest.approx(2 / 3)


def test_merge_weight_average_is_the_mean_and_structure_is_checked(getkey):
    base = {"w": jax.random.normal(getkey(), (3, 2)), "b": jnp.zeros(2)}
    ms = [jax.tree.map(lambda x: x + jax.random.normal(getkey(), x.shape), base) for _ in range(3)]
    wa = merge_topk(base, ms, "wa")
    for name in ("w", "b"):
        np.testing.assert_allclose(wa[name], np.mean([m[name] for m in ms], axis=0), atol=1e-6)
    ties = merge_topk(base, ms, "ties", density=0.5)
    assert jax.tree.structure(ties) == jax.tree.structure(base)
    assert ties["w"].shape == (3, 2) and np.isfinite(np.asarray(ties["w"])).all()
    with pytest.raises(ValueError, match="structure and leaf shapes"):
        merge_topk(base, [{"w": base["w"]}], "wa")
    with pytest.raises(ValueError, match="structure and leaf shapes"):
        merge_topk(base, [{"w": base["w"], "b": jnp.zeros(3)}], "wa")
    with pytest.raises(ValueError, match="unknown merge operator"):
        merge_topk(base, ms, "median")


def two_class_data(rng, n, flip=False):
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return x, (1 - y) if flip else y


def test_finetune_improves_few_shot_loss_and_ignores_unshared_classes(getkey):
    rng = np.random.default_rng(0)
    x, y = two_class_data(rng, 24)
    params = {"w": 0.1 * jax.random.normal(getkey(), (4, 2)), "b": jnp.zeros(2)}
    classes, user = ("neg", "pos"), ("neg", "pos")
    before = few_shot_loss(params, linear, x, y, classes, user)
    tuned = finetune_top1(params, linear, x, y, classes, user, steps=60, learning_rate=0.05)
    after = few_shot_loss(tuned, linear, x, y, classes, user)
    assert after < 0.5 * before
    # a third user class the model lacks: its examples are dropped from the loss
    y3 = np.where(np.arange(24) % 4 == 0, 2, y)
    logits = np.asarray(linear(params, x), np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    keep = y3 != 2
    want = -np.mean(logp[keep, y3[keep]])
    got = few_shot_loss(params, linear, x, y3, classes, ("neg", "pos", "neutral"))
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="no few-shot example"):
        finetune_top1(params, linear, x, np.full(24, 2), classes, ("a", "b", "c"), steps=1)


def test_reuse_models_refuses_missing_inputs():
    p = {"logits": jnp.zeros(2)}
    with pytest.raises(ValueError, match="strategy must be one of"):
        reuse_models("vote", [p], [("a", "b")], logits_model, ("a", "b"))
    with pytest.raises(ValueError, match="needs base"):
        reuse_models("topk_merge", [p, p], [("a", "b")] * 2, logits_model, ("a", "b"))
    with pytest.raises(ValueError, match="same classes"):
        reuse_models("topk_merge", [p, p], [("a", "b"), ("b", "a")], logits_model, ("a", "b"),
                     base=p)
    with pytest.raises(ValueError, match="needs few_shot"):
        reuse_models("top1_finetune", [p], [("a", "b")], logits_model, ("a", "b"))


def test_dock_reuse_end_to_end(tmp_path, getkey):
    sig = SpecSignature("lin", "h" * 8, 1, ("w",), (16,), "a" * 8, "gaussian")
    rng = np.random.default_rng(1)
    dirs = rng.standard_normal((3, 16))
    good = {"w": np.stack([-3 * np.eye(4)[0], 3 * np.eye(4)[0]], 1).astype(np.float32),
            "b": np.zeros(2, np.float32)}
    weak = {"w": np.asarray(0.2 * good["w"] + 0.3 * rng.standard_normal((4, 2)), np.float32),
            "b": np.zeros(2, np.float32)}
    other = {"w": rng.standard_normal((4, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    models = [("good", good, ["neg", "pos"]), ("weak", weak, ["neg", "pos"]),
              ("news", other, ["sports", "tech"])]
    with Dock.create(tmp_path / "dock") as dock:
        for (name, params, classes), d in zip(models, (dirs[0], dirs[0] + 0.5 * dirs[1], dirs[2]),
                                              strict=True):
            dock.submit(PaveSpec(d.astype(np.float32), sig), name=name, model=params,
                        metadata={"classes": classes})
        query = PaveSpec((dirs[0] + 0.1 * dirs[2]).astype(np.float32), sig, kind="user")
        user = ("pos", "neg")                                 # order differs from the models'
        x, y_np = two_class_data(rng, 40)
        y = 1 - y_np                                          # index into ("pos", "neg")
        top1 = dock.reuse(query, "top1", apply_fn=linear, user_classes=user)
        assert top1.names == ("good",) and top1.classes == ("neg", "pos")
        assert user_accuracy(top1.predict(x), y, user) == 1.0
        tuned = dock.reuse(query, "top1_finetune", apply_fn=linear, user_classes=user,
                           few_shot=(x[:8], y[:8]), finetune_steps=5, learning_rate=1e-2)
        assert not np.allclose(tuned.params["w"], good["w"])
        assert user_accuracy(tuned.predict(x), y, user) >= 0.9
        ens = dock.reuse(query, "topk_ensemble", k=2, apply_fn=linear, user_classes=user)
        assert ens.names == ("good", "weak") and len(ens.params) == 2
        want = ensemble_topk([good, weak], linear, x, [("neg", "pos")] * 2, user)
        np.testing.assert_allclose(ens.predict(x), want, rtol=1e-6)
        base = jax.tree.map(np.zeros_like, good)
        merged = dock.reuse(query, "topk_merge", k=2, apply_fn=linear, user_classes=user,
                            base=base, merge_op="wa")
        np.testing.assert_allclose(merged.params["w"], (good["w"] + weak["w"]) / 2, atol=1e-6)
        with pytest.raises(ValueError, match="same classes"):
            dock.reuse(query, "topk_merge", k=3, apply_fn=linear, user_classes=user, base=base)
        dock.submit(PaveSpec(query.vector * 2, sig), name="spec-only")   # the best match
        with pytest.raises(ValueError, match="cannot be reused"):
            dock.reuse(query, "top1", apply_fn=linear, user_classes=user)
