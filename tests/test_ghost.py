"""Ghost clipping (pavejax.privacy.ghost) against the materialised vmap path.

Parity is the guard (per-sample hooks and ghost clipping silently differing is a known failure of
other libraries): per-example norms, the clipped sum and the noised gradient with the same key
must equal the vmap path, with a clip norm tight enough that almost every example is clipped,
with padding rows, Poisson-sampled batches, NaN rows, and on BERT, Llama (tied embeddings) and
factored LoRA.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax import lm, lora
from pavejax.models import BertConfig, BertEncoder, LlamaConfig, LlamaLM, TextClassifier
from pavejax.privacy import (
    ClipConfig,
    DPConfig,
    SamplingConfig,
    clipped_sum,
    ghost,
    noisy_gradient,
    pad_batch,
    take_batch,
)
from pavejax.privacy.clipping import leaf_paths

METHODS = ("ghost", "ghost_two_pass")


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol)


def _run(loss_fn, trainable, frozen, batch, mask, method, clip, microbatch_size=None):
    cfg = ClipConfig(clip, method=method)
    fn = jax.jit(lambda t, f, b, m: clipped_sum(loss_fn, t, f, b, m, cfg,
                                                microbatch_size=microbatch_size))
    return fn(trainable, frozen, batch, mask)


def _check_parity(loss_fn, trainable, frozen, batch, mask, clip, *, min_clipped=1,
                  microbatch_size=None):
    ref = _run(loss_fn, trainable, frozen, batch, mask, "vmap", clip)
    assert int(ref.num_clipped) >= min_clipped, "the clip norm must be active for this test"
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref.grad_sum))
    for method in METHODS:
        got = _run(loss_fn, trainable, frozen, batch, mask, method, clip, microbatch_size)
        _close(got.norms, ref.norms, rtol=2e-5, atol=1e-6)
        _close(got.losses, ref.losses)
        assert int(got.num_clipped) == int(ref.num_clipped)
        assert int(got.num_nonfinite) == int(ref.num_nonfinite)
        _close(got.grad_sum, ref.grad_sum, rtol=1e-4, atol=2e-6 * scale)
    return ref


# --- a small network that exercises every rule ----------------------------------------------


def _mlp(seed=0, vocab=11, d=5, h=7):
    rng = np.random.default_rng(seed)
    params = {"emb": rng.normal(size=(vocab, d)), "w1": rng.normal(size=(d, h)) / 2,
              "b1": rng.normal(size=(h,)), "scale": 1 + rng.normal(size=(h,)) / 10,
              "w2": rng.normal(size=(h, 3))}
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def _mlp_loss(p, frozen, ex):
    h = jnp.take(p["emb"], ex["ids"], axis=0) + ex["x"]           # embedding rows (T, d)
    h = jnp.tanh(h @ p["w1"] + p["b1"][None]) * p["scale"][None]  # dense + bias + scale
    logits = h @ p["w2"] + h[:, :3] @ p["w2"][:3]                  # w2 used twice: materialised
    return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])


def _mlp_batch(bsz=8, t=6, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(bsz, t, 5)), jnp.float32),
            "ids": jnp.asarray(rng.integers(0, 11, size=(bsz, t)), jnp.int32)}


def test_rules_pick_ghost_dense_embedding_elementwise_and_materialise_the_rest():
    params = _mlp()
    plan = ghost.build_plan(_mlp_loss, params, None,
                            jax.tree.map(lambda x: x[0], _mlp_batch()))
    names = sorted(params)                       # dict leaves flatten in sorted key order
    kinds = {names[i]: r[0] for i, r in plan.rules.items()}
    assert kinds == {"emb": "embed", "w1": "dot", "b1": "ew", "scale": "ew", "w2": "mat"}


def test_parity_small_network_with_padding_and_tight_clip():
    batch = _mlp_batch()
    mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
    ref = _check_parity(_mlp_loss, _mlp(), None, batch, mask, 0.05, min_clipped=6)
    assert float(ref.norms[2]) == 0.0


def _max_contribution(loss_fn, params, batch, clip, method="ghost"):
    """max_i ||clipped sum of the batch with only row i kept||: the per-example sensitivity
    that the clip norm must bound (an empirical audit of the norm computation)."""
    cfg = ClipConfig(clip, method=method)
    fn = jax.jit(lambda p, b, m: clipped_sum(loss_fn, p, None, b, m, cfg).grad_sum)
    bsz = jax.tree.leaves(batch)[0].shape[0]
    worst = 0.0
    for i in range(bsz):
        g = fn(params, batch, jnp.arange(bsz) == i)
        worst = max(worst, float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))))
    return worst


def test_audit_each_example_is_bounded_by_the_clip_norm_and_broken_rules_are_caught(
        monkeypatch):
    """Every example's contribution to the ghost-clipped sum has norm <= C (the sensitivity
    the accountant is told). A ghost rule that under-counts a leaf's norm (biases and scales
    dropped, or the embedding table dropped) lets contributions exceed C: the audit flags it."""
    clip = 0.05
    params, batch = _mlp(), _mlp_batch()
    assert _max_contribution(_mlp_loss, params, batch, clip) <= clip * (1 + 1e-5)
    with monkeypatch.context() as m:
        m.setattr(ghost, "_ew_norms", lambda plan, rule, saved, grads: jnp.zeros(
            grads[rule[1]][0].shape[0], jnp.float32))
        assert _max_contribution(_mlp_loss, params, batch, clip) > clip * 1.05
    with monkeypatch.context() as m:
        m.setattr(ghost, "_embed_norms", lambda node, rows, ids, g: jnp.zeros(
            g.shape[0], jnp.float32))
        assert _max_contribution(_mlp_loss, params, batch, clip) > clip * 1.05


def test_parity_with_microbatches():
    _check_parity(_mlp_loss, _mlp(), None, _mlp_batch(), None, 0.05, microbatch_size=4)


def test_nonfinite_rows_contribute_nothing():
    batch = _mlp_batch()
    batch["x"] = batch["x"].at[3, 1, 0].set(jnp.nan)
    for method in METHODS:
        got = _run(_mlp_loss, _mlp(), None, batch, None, method, 0.05)
        assert int(got.num_nonfinite) == 1
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got.grad_sum))
    clean = jax.tree.map(lambda x: jnp.delete(x, 3, axis=0), batch)
    ref = _run(_mlp_loss, _mlp(), None, clean, None, "vmap", 0.05)
    for method in METHODS:
        got = _run(_mlp_loss, _mlp(), None, batch, None, method, 0.05)
        _close(got.grad_sum, ref.grad_sum, rtol=1e-4, atol=1e-6)


def test_out_of_range_ids_follow_the_lookup_mode():
    batch = _mlp_batch()
    batch["ids"] = batch["ids"].at[0, 0].set(40)        # jnp.take's default mode fills (drops)

    def clip_loss(p, frozen, ex):
        h = jnp.take(p["emb"], ex["ids"], axis=0, mode="clip") + ex["x"]
        return jnp.sum(jnp.tanh(h @ p["w1"]))

    _check_parity(_mlp_loss, _mlp(), None, batch, None, 0.05)
    params = {k: _mlp()[k] for k in ("emb", "w1")}
    _check_parity(clip_loss, params, None, batch, None, 0.05)


def test_rejects_per_layer_clipping_and_unknown_methods():
    with pytest.raises(ValueError, match="joint clipping only"):
        ClipConfig(1.0, clipping="per_layer", method="ghost")
    with pytest.raises(ValueError, match="method must be one of"):
        ClipConfig(1.0, method="hooks")
    with pytest.raises(ValueError, match="does not depend on the example"):
        ghost.build_plan(lambda p, f, ex: jnp.sum(p["w"]), {"w": jnp.ones(3)}, None,
                         {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})


# --- BERT ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert():
    cfg = dataclasses.replace(BertConfig.tiny(), num_layers=1)
    model = TextClassifier(BertEncoder(cfg, rngs=nnx.Rngs(0)), 2, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    bsz, t = 8, 12
    ids = rng.integers(1, cfg.vocab_size, size=(bsz, t))
    lengths = rng.integers(4, t + 1, size=bsz)
    am = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    data = {"input_ids": jnp.asarray(ids * am, jnp.int32), "attention_mask": jnp.asarray(am),
            "label": jnp.asarray(rng.integers(0, 2, size=bsz), jnp.int32)}
    return graphdef, params, data


def _bert_loss(graphdef):
    def loss(trainable, frozen, ex):
        p = dict(frozen) | dict(trainable) if frozen else trainable
        logits = nnx.merge(graphdef, p)(ex["input_ids"], ex["attention_mask"])
        return -jax.nn.log_softmax(logits)[ex["label"]]
    return loss


def test_parity_bert_full_fine_tuning_with_padding_mask(bert):
    graphdef, params, data = bert
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 1], bool)
    _check_parity(_bert_loss(graphdef), params, None, data, mask, 0.1, min_clipped=7)


def test_parity_bert_factored_lora_and_noised_gradient_with_same_key(bert):
    graphdef, params, data = bert
    cfg = lora.LoraConfig(4)
    pred = lambda path, leaf: path.endswith(("query/kernel", "value/kernel"))  # noqa: E731
    B, A = lora.init_lora(jax.random.key(1), params, pred, cfg)
    B = jax.tree.map(lambda b: b + 0.05, B)
    model_def = graphdef

    def loss(trainable, frozen, ex):
        p = dict(frozen["params"])
        p["head"] = trainable["head"]
        model = nnx.merge(model_def, p)
        adapters = lora.LoraAdapters(trainable["B"], frozen["A"], cfg)
        logits = model(ex["input_ids"], ex["attention_mask"], lora=adapters)
        return -jax.nn.log_softmax(logits)[ex["label"]]

    trainable = {"B": B, "head": params["head"]}
    frozen = {"params": params, "A": A}
    plan = ghost.build_plan(loss, trainable, frozen, jax.tree.map(lambda x: x[0], data))
    paths = leaf_paths(trainable)
    assert {plan.rules[i][0] for i, p in enumerate(paths) if p.startswith("B/")} == {"dot"}
    _check_parity(loss, trainable, frozen, data, None, 0.01, min_clipped=6)
    # The noised gradient (same key) through the DP layer.
    sampling = SamplingConfig("poisson", dataset_size=64, batch_size=6, max_batch=8)
    key = jax.random.key(7)
    draw = sampling.sample(key)
    pool = jax.tree.map(lambda x: jnp.concatenate([x] * 8), data)
    batch, pmask = pad_batch(take_batch(pool, draw.indices), draw.mask, 1)
    outs = {}
    for method in ("vmap",) + METHODS:
        dp = DPConfig(0.01, 1.0, sampling, clip_method=method)
        g, info = jax.jit(lambda t, f, b, m, k: noisy_gradient(loss, t, f, b, m, k, dp))(
            trainable, frozen, batch, pmask, jax.random.key(3))
        outs[method] = (g, info)
    for method in METHODS:
        _close(outs[method][0], outs["vmap"][0], rtol=1e-4, atol=1e-6)
        _close(outs[method][1].norms, outs["vmap"][1].norms)


# --- Llama ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    cfg = LlamaConfig.tiny()
    assert cfg.tie_embeddings
    model = LlamaLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    bsz, t = 6, 10
    lengths = rng.integers(3, t + 1, size=bsz)
    am = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    data = {"input_ids": jnp.asarray(rng.integers(1, cfg.vocab_size, size=(bsz, t)) * am,
                                     jnp.int32),
            "attention_mask": jnp.asarray(am)}
    return model, data


def test_parity_llama_full_fine_tuning_tied_embeddings(llama):
    model, data = llama
    split, trainable, frozen = lm.split_full(model, lambda p, _: True)
    loss = lm.token_loss_fn(split)
    plan = ghost.build_plan(loss, trainable, frozen, jax.tree.map(lambda x: x[0], data))
    paths = sorted(trainable)
    kinds = {paths[i]: r[0] for i, r in plan.rules.items()}
    assert kinds["embed/embedding"] == "multi"           # tied: lookup and output matrix
    assert kinds["layers/0/attn/q/kernel"] == "dot"
    mask = jnp.array([1, 1, 0, 1, 1, 1], bool)
    _check_parity(loss, trainable, frozen, data, mask, 0.5, min_clipped=4)


def test_parity_llama_lora(llama):
    model, data = llama
    split, B, frozen = lm.split_lora(model, jax.random.key(2), lora.LoraConfig(4))
    B = jax.tree.map(lambda b: b + 0.05, B)
    loss = lm.token_loss_fn(split)
    plan = ghost.build_plan(loss, B, frozen, jax.tree.map(lambda x: x[0], data))
    assert {r[0] for r in plan.rules.values()} == {"dot"}
    _check_parity(loss, B, frozen, data, None, 0.05, min_clipped=5)
    # A Poisson batch drawn from a pool, padded and masked, through the whole DP step.
    sampling = SamplingConfig("poisson", dataset_size=48, batch_size=4, max_batch=8)
    draw = sampling.sample(jax.random.key(11))
    pool = jax.tree.map(lambda x: jnp.concatenate([x] * 8), data)
    batch, pmask = pad_batch(take_batch(pool, draw.indices), draw.mask, 1)
    assert 0 < int(pmask.sum()) < 8
    outs = {}
    for method in ("vmap",) + METHODS:
        dp = DPConfig(0.05, 1.0, sampling, clip_method=method)
        outs[method] = jax.jit(lambda t, f, b, m, k: noisy_gradient(loss, t, f, b, m, k, dp))(
            B, frozen, batch, pmask, jax.random.key(5))
    for method in METHODS:
        _close(outs[method][0], outs["vmap"][0], rtol=1e-4, atol=1e-6)
        _close(outs[method][1].norms, outs["vmap"][1].norms)
