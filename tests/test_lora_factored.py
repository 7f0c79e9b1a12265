"""Factored LoRA (``LoraAdapters``): the same function and gradients as the merged weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from pavejax.lora import LoraAdapters, LoraConfig, apply_lora, init_lora, lora_update
from pavejax.models import BertConfig, BertEncoder, TextClassifier
from pavejax.privacy import ClipConfig, clipped_sum

TINY = BertConfig.tiny()
QV = ("attention/query/kernel", "attention/value/kernel")
B_SIZE, T = 4, 10


def _rescaled(model, seed, scale=0.3):
    """Every parameter re-drawn as N(0, scale^2): O(1) activations, so differences show."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32) for x in leaves]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def classifier():
    """(graphdef, params, B, A, config): a tiny classifier with nonzero B on query/value."""
    model = _rescaled(TextClassifier(BertEncoder(TINY, rngs=nnx.Rngs(0)), 3,
                                     rngs=nnx.Rngs(1)), seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    cfg = LoraConfig(rank=2, alpha=3.0)  # scale 1.5: the scaled branch is exercised
    b, a = init_lora(jax.random.key(1), params, lambda p, _: p.endswith(QV), cfg)
    rng = np.random.default_rng(2)
    b = {p: jnp.asarray(0.5 * rng.standard_normal(v.shape), jnp.float32) for p, v in b.items()}
    return graphdef, params, b, a, cfg


def _batch(seed=3):
    rng = np.random.default_rng(seed)
    lengths = np.array([T, 3, 7, 1])
    ids = rng.integers(1, TINY.vocab_size, size=(B_SIZE, T)).astype(np.int32)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    return {"input_ids": jnp.asarray(ids * mask), "attention_mask": jnp.asarray(mask),
            "label": jnp.asarray(rng.integers(0, 3, size=B_SIZE).astype(np.int32))}


def _losses(graphdef, cfg):
    """(merged, factored) per-example losses ``(trainable, frozen, example) -> scalar``."""

    def ce(logits, label):
        return -jax.nn.log_softmax(logits)[label]

    def merged(trainable, frozen, ex):
        params = apply_lora({**frozen["params"], "head": trainable["head"]},
                            trainable["B"], frozen["A"], cfg)
        return ce(nnx.merge(graphdef, params)(ex["input_ids"], ex["attention_mask"]), ex["label"])

    def factored(trainable, frozen, ex):
        model = nnx.merge(graphdef, {**frozen["params"], "head": trainable["head"]})
        lora = LoraAdapters(trainable["B"], frozen["A"], cfg)
        return ce(model(ex["input_ids"], ex["attention_mask"], lora=lora), ex["label"])

    return merged, factored


def test_lora_update_matches_float64_by_hand(getkey):
    x = jax.random.normal(getkey(), (2, 5, 6))
    a, b = jax.random.normal(getkey(), (6, 3)), jax.random.normal(getkey(), (3, 4))
    for alpha, scale in ((None, 1.0), (6.0, 2.0)):
        got = lora_update(x, a, b, LoraConfig(rank=3, alpha=alpha))
        f64 = [np.asarray(v, np.float64) for v in (x, a, b)]
        want = scale * np.einsum("bti,ir,ro->bto", *f64)
        assert got.shape == (2, 5, 4) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


CLIP = ClipConfig(0.5)  # a small clip norm: clipping is active


@pytest.fixture(scope="module")
def computed(classifier):
    """Everything the comparisons need, from one jitted function (one compilation)."""
    graphdef, params, b, a, cfg = classifier
    merged, factored = _losses(graphdef, cfg)
    trainable = {"B": b, "head": params["head"]}
    frozen = {"params": {k: v for k, v in params.items() if k != "head"}, "A": a}
    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]

    @jax.jit
    def run(trainable, lora):  # LoraAdapters is a pytree: it crosses the jit boundary
        model = nnx.merge(graphdef, params)
        merged_model = nnx.merge(graphdef, apply_lora(params, lora.B, lora.A, cfg))
        out = {
            "logits_merged": merged_model(ids, mask),
            "logits_factored": model(ids, mask, lora=lora),
            "logits_plain": model(ids, mask),
            "logits_vmapped": jax.vmap(lambda i, m: model(i, m, lora=lora))(ids, mask),
        }
        for name, fn in (("merged", merged), ("factored", factored)):
            out[f"grads_{name}"] = jax.vmap(jax.grad(fn), in_axes=(None, None, 0))(
                trainable, frozen, batch)
        # Compiling is the slow part of this file: the DP engine runs the factored path only
        # and is checked against the merged path's per-example gradients below.
        out["clipped"] = clipped_sum(factored, trainable, frozen, batch, None, CLIP,
                                     microbatch_size=2)
        return out

    return jax.device_get(run(trainable, LoraAdapters(b, a, cfg)))


def test_classifier_logits_equal_merged_under_jit(computed):
    np.testing.assert_allclose(computed["logits_factored"], computed["logits_merged"],
                               rtol=1e-5, atol=1e-5)
    # The adapters matter: without them the logits differ clearly.
    assert np.max(np.abs(computed["logits_plain"] - computed["logits_merged"])) > 1e-2
    # One example at a time (the per-example form of DP) gives the batch's logits.
    assert computed["logits_vmapped"].shape == (B_SIZE, 3)
    np.testing.assert_allclose(computed["logits_vmapped"], computed["logits_factored"],
                               rtol=1e-5, atol=1e-6)


def test_per_example_gradients_equal_merged_under_vmap(computed):
    g_m, g_f = computed["grads_merged"], computed["grads_factored"]
    assert jax.tree.structure(g_m) == jax.tree.structure(g_f)
    for leaf_m, leaf_f in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_f)):
        assert leaf_m.shape[0] == B_SIZE
        np.testing.assert_allclose(leaf_f, leaf_m, rtol=1e-4, atol=1e-6)
    b_norms = np.sqrt(sum(np.sum(np.asarray(v).reshape(B_SIZE, -1) ** 2, axis=1)
                          for v in g_f["B"].values()))
    assert b_norms.min() > 1e-4  # B really receives gradient for every example


def test_dp_clipped_sum_equals_merged_reference(computed, classifier):
    """The DP engine on the factored path (microbatched) against the merged path's per-example
    gradients, joint-clipped and summed by hand in float64."""
    graphdef, params, b, a, cfg = classifier
    r = computed["clipped"]
    grads = [np.asarray(x, np.float64) for x in jax.tree.leaves(computed["grads_merged"])]
    norms = np.sqrt(sum(np.sum(g.reshape(B_SIZE, -1) ** 2, axis=1) for g in grads))
    np.testing.assert_allclose(r.norms, norms, rtol=1e-5)
    coef = np.minimum(1.0, CLIP.l2_clip / norms)
    assert int(r.num_clipped) == int(np.sum(coef < 1.0)) >= 1
    assert jax.tree.structure(r.grad_sum) == jax.tree.structure(computed["grads_merged"])
    for g, leaf in zip(grads, jax.tree.leaves(r.grad_sum)):
        np.testing.assert_allclose(leaf, np.tensordot(coef, g, axes=1), rtol=1e-4, atol=1e-6)
    # The per-example losses are those of the merged model.
    logits = np.asarray(computed["logits_merged"], np.float64)
    logp = logits - scipy.special.logsumexp(logits, axis=1, keepdims=True)
    want = -logp[np.arange(B_SIZE), np.asarray(_batch()["label"])]
    np.testing.assert_allclose(r.losses, want, rtol=1e-5)


def test_every_layer_dense_kernel_can_be_adapted_on_the_encoder(getkey):
    encoder = _rescaled(BertEncoder(TINY, rngs=nnx.Rngs(5)), seed=5)
    graphdef, state = nnx.split(encoder)
    params = nnx.to_pure_dict(state)
    targets = encoder.lora_targets()
    assert len(targets) == TINY.num_layers * 6
    assert targets["layers/1/intermediate/kernel"] == (TINY.hidden_size, TINY.intermediate_size)
    assert targets["layers/0/output/kernel"] == (TINY.intermediate_size, TINY.hidden_size)
    cfg = LoraConfig(rank=3)
    b, a = init_lora(getkey(), params, lambda p, _: p in targets, cfg)
    assert set(b) == set(targets)
    b = {p: 0.3 * jax.random.normal(getkey(), v.shape) for p, v in b.items()}
    batch = _batch()

    @jax.jit
    def both(b, a):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        merged = nnx.merge(graphdef, apply_lora(params, b, a, cfg))(ids, mask)
        return merged, nnx.merge(graphdef, params)(ids, mask, lora=LoraAdapters(b, a, cfg))

    merged, factored = both(b, a)
    np.testing.assert_allclose(factored, merged, rtol=1e-5, atol=1e-5)


def test_adapters_are_a_pytree_with_static_config(classifier):
    _, _, b, a, cfg = classifier
    lora = LoraAdapters(b, a, cfg)
    doubled = jax.tree.map(lambda x: 2 * x, lora)
    assert isinstance(doubled, LoraAdapters) and doubled.config == cfg
    p = lora.paths[0]
    np.testing.assert_array_equal(doubled.B[p], 2 * b[p])
    assert len(jax.tree.leaves(lora)) == 2 * len(b)
    assert lora.paths == tuple(sorted(b)) and p in lora
    sub = lora.under("encoder/layers/0")
    assert sub.paths == QV
    assert "encoder" in repr(lora)


def test_wrong_paths_and_shapes_are_refused(classifier):
    graphdef, params, b, a, cfg = classifier
    model = nnx.merge(graphdef, params)
    batch = _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]

    # Factors made on the encoder's own params: paths lack the "encoder/" root.
    rel_b = {p.removeprefix("encoder/"): v for p, v in b.items()}
    rel_a = {p.removeprefix("encoder/"): v for p, v in a.items()}
    with pytest.raises(ValueError, match="TextClassifier cannot apply factored LoRA"):
        model(ids, mask, lora=LoraAdapters(rel_b, rel_a, cfg))
    # ... which is exactly what the encoder itself accepts (traced only: no compile).
    out = jax.eval_shape(lambda: model.encoder(ids, mask, lora=LoraAdapters(rel_b, rel_a, cfg)))
    assert out.shape == (B_SIZE, T, TINY.hidden_size)

    # The embeddings and the pooler are not dense layers inside ``layers``.
    bp, ap = init_lora(jax.random.key(0), params, lambda p, _: p.endswith("pooler/kernel"), cfg)
    with pytest.raises(ValueError, match="cannot apply factored LoRA.*merge them with apply_lora"):
        model(ids, mask, lora=LoraAdapters(bp, ap, cfg))

    p = sorted(b)[0]
    bad_a = {**a, p: jnp.zeros((TINY.hidden_size + 1, cfg.rank))}
    with pytest.raises(ValueError, match="needs A"):
        model(ids, mask, lora=LoraAdapters(b, bad_a, cfg))
    with pytest.raises(ValueError, match="same paths"):
        LoraAdapters(b, {q: v for q, v in a.items() if q != p}, cfg)
    with pytest.raises(ValueError, match="made with this config"):
        LoraAdapters(b, a, LoraConfig(rank=cfg.rank + 1))
    with pytest.raises(TypeError, match="config must be a LoraConfig"):
        LoraAdapters(b, a, {"rank": 2})
