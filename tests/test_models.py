"""BERT encoder, loader, tokenizer and heads: tiny random models plus real all-MiniLM-L6-v2."""

import hashlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from pavejax.models import (
    BERT_IGNORED_TENSORS,
    BertConfig,
    BertEncoder,
    ClassifierHead,
    TextClassifier,
    Tokenizer,
    apply_head,
    bert_torch_names,
    embed as embed_mod,
    embed_texts,
    example_loss,
    gelu,
    head0,
    l2_normalize,
    label_space_head,
    load_bert,
    load_state_from_torch_names,
    mean_pool,
    public_random_head,
    public_random_projection,
    sentence_embedding,
)

TINY = BertConfig.tiny()


@nnx.jit
def run(model, *args):
    """Jitted forward pass: eager op-by-op dispatch of even a tiny BERT is slow on CPU."""
    return model(*args)


def tiny_model(seed=0, scale=None):
    """A tiny random BERT; ``scale`` re-draws every parameter as N(0, scale^2) so activations are
    O(1) (the default 0.02 init keeps GELU inputs too small to tell erf from tanh)."""
    model = BertEncoder(TINY, rngs=nnx.Rngs(seed))
    if scale is not None:
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        rng = np.random.default_rng(seed)
        leaves = [jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32) for x in leaves]
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(scale=0.3)


# Most tests share one (B, T) so that the jitted forward pass compiles once.
LENGTHS, T = [12, 3, 7], 12


def torch_state(model, config):
    """The HF/torch-named state dict of ``model`` (Linear weights back in (out, in) layout)."""
    pure = nnx.to_pure_dict(nnx.state(model))
    out = {}
    for name, (path, transpose) in bert_torch_names(config).items():
        leaf = pure
        for k in path:
            leaf = leaf[k]
        arr = np.asarray(leaf)
        out[name] = np.ascontiguousarray(arr.T if transpose else arr)
    out["embeddings.position_ids"] = np.arange(config.max_position, dtype=np.int64)[None]
    return out


def random_batch(rng, lengths, t, vocab=TINY.vocab_size):
    ids = rng.integers(1, vocab, size=(len(lengths), t)).astype(np.int32)
    mask = (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    return jnp.asarray(ids * mask), jnp.asarray(mask)


# --- numpy float64 reference forward pass (independent of the NNX code) -----------------------

def _ln(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["weight"] + p["bias"]


def reference_forward(sd, cfg, ids, mask, erf_gelu=True):
    """BERT from the torch-named state dict, written from the HF definition, float64."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    def ln(x, name):
        return _ln(x, {"weight": sd[name + ".weight"], "bias": sd[name + ".bias"]},
                   cfg.layer_norm_eps)

    ids, mask = np.asarray(ids), np.asarray(mask)
    b, t = ids.shape
    h = (sd["embeddings.word_embeddings.weight"][ids]
         + sd["embeddings.position_embeddings.weight"][np.arange(t)][None]
         + sd["embeddings.token_type_embeddings.weight"][np.zeros_like(ids)])
    h = ln(h, "embeddings.LayerNorm")
    nh, dh = cfg.num_heads, cfg.head_dim
    bias = np.where(mask[:, None, None, :] > 0, 0.0, -1e30)
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        q, k, v = (lin(h, f"{p}.attention.self.{n}").reshape(b, t, nh, dh).transpose(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh) + bias
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, nh * dh)
        h = ln(h + lin(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
        a = lin(h, f"{p}.intermediate.dense")
        if erf_gelu:
            a = 0.5 * a * (1.0 + scipy.special.erf(a / math.sqrt(2.0)))
        else:
            a = 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
        h = ln(h + lin(a, f"{p}.output.dense"), f"{p}.output.LayerNorm")
    return h


# --- config -------------------------------------------------------------------------------------

def test_config_validation_messages():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        BertConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        BertConfig(num_layers=0)
    with pytest.raises(ValueError, match="only hidden_act='gelu'"):
        BertConfig.from_dict({"hidden_act": "relu"})
    with pytest.raises(ValueError, match="missing the field 'vocab_size'"):
        BertConfig.from_dict({"hidden_size": 32})


def test_config_from_json(tmp_path):
    raw = {"model_type": "bert", "hidden_act": "gelu", "vocab_size": 100, "hidden_size": 16,
           "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 40,
           "max_position_embeddings": 20, "type_vocab_size": 2, "layer_norm_eps": 1e-7}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = BertConfig.from_json(tmp_path / "config.json")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (100, 16, 3, 2)
    assert (cfg.intermediate_size, cfg.max_position, cfg.layer_norm_eps) == (40, 20, 1e-7)
    assert cfg.head_dim == 8


# --- forward pass on the tiny config ----------------------------------------------------------

def test_gelu_is_exact_erf():
    x = jnp.linspace(-5.0, 5.0, 101, dtype=jnp.float32)
    erf_form = 0.5 * x * (1.0 + jax.scipy.special.erf(x / math.sqrt(2.0)))
    tanh_form = jax.nn.gelu(x, approximate=True)
    np.testing.assert_allclose(gelu(x), erf_form, rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(gelu(x) - tanh_form))) > 1e-4  # the check can tell them apart


def test_forward_matches_numpy_reference_with_erf_gelu(tiny):
    model = tiny
    ids, mask = random_batch(np.random.default_rng(0), LENGTHS, T)
    out = np.asarray(run(model, ids, mask))
    sd = torch_state(model, TINY)
    exact = reference_forward(sd, TINY, ids, mask)
    approx = reference_forward(sd, TINY, ids, mask, erf_gelu=False)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(out[real], exact[real], atol=2e-4, rtol=0)
    assert np.abs(out[real] - approx[real]).max() > 10 * np.abs(out[real] - exact[real]).max()


def test_padding_does_not_change_real_tokens(tiny):
    model = tiny
    ids, mask = random_batch(np.random.default_rng(1), LENGTHS, T)
    short = run(model, ids, mask)
    # 8 more padding positions, plus nonzero ids on every padded position: masked keys must
    # have no influence on real tokens.
    pad_ids = jnp.concatenate([ids, jnp.full((3, 8), 7, jnp.int32)], axis=1)
    pad_ids = jnp.where(pad_ids == 0, 5, pad_ids)
    pad_mask = jnp.concatenate([mask, jnp.zeros((3, 8), jnp.int32)], axis=1)
    long = run(model, pad_ids, pad_mask)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(long)[:, :T][real], np.asarray(short)[real], atol=1e-5,
                               rtol=0)
    np.testing.assert_allclose(mean_pool(long, pad_mask), mean_pool(short, mask), atol=1e-5)


def test_batch_vmap_and_single_examples_agree(tiny):
    model = tiny
    ids, mask = random_batch(np.random.default_rng(2), LENGTHS, T)
    batched = run(model, ids, mask)
    vmapped = nnx.jit(nnx.vmap(run, in_axes=(None, 0, 0)))(model, ids, mask)
    singles = jnp.stack([run(model, ids[j], mask[j]) for j in range(ids.shape[0])])
    assert batched.shape == (3, T, TINY.hidden_size) and batched.dtype == jnp.float32
    assert singles.shape == batched.shape
    np.testing.assert_allclose(vmapped, batched, atol=1e-5, rtol=0)
    np.testing.assert_allclose(singles, batched, atol=1e-5, rtol=0)


def test_per_example_gradients_by_vmap_match_a_loop():
    # One layer keeps the two backward-pass compilations short.
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                     intermediate_size=32, max_position=8)
    graphdef, params = nnx.split(BertEncoder(cfg, rngs=nnx.Rngs(0)))
    ids, mask = random_batch(np.random.default_rng(3), [8, 2], 8, vocab=64)

    def loss(p, i, m):
        pooled = mean_pool(nnx.merge(graphdef, p)(i, m), m)
        return jnp.sum(jnp.square(pooled))

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, ids, mask)
    grad_one = jax.jit(jax.grad(loss))
    for j in range(ids.shape[0]):
        one = grad_one(params, ids[j:j + 1], mask[j:j + 1])
        got = jax.tree_util.tree_map(lambda g, j=j: g[j], per_example)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(one)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_mean_pool_and_l2_normalize_by_hand():
    hidden = jnp.asarray([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]], jnp.float32)
    mask = jnp.asarray([[1, 1, 0]], jnp.int32)
    np.testing.assert_allclose(mean_pool(hidden, mask), [[2.0, 4.0]])
    np.testing.assert_allclose(mean_pool(hidden[0], mask[0]), [2.0, 4.0])  # one example
    np.testing.assert_allclose(mean_pool(hidden, jnp.zeros((1, 3), jnp.int32)), [[0.0, 0.0]])
    np.testing.assert_allclose(l2_normalize(jnp.asarray([3.0, 4.0])), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(l2_normalize(jnp.zeros(3, jnp.float32)), np.zeros(3))
    with pytest.raises(ValueError, match="must equal hidden.shape"):
        mean_pool(hidden, jnp.ones((1, 2), jnp.int32))


def test_bad_inputs_are_refused():
    model = tiny_model()
    ids = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(TypeError, match="input_ids must be an integer array"):
        model(ids.astype(jnp.float32), jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(B, T\) or \(T,\)"):
        model(jnp.ones((2, 2, 5), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        model(ids, jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="exceeds max_position 64"):
        model(jnp.ones((1, 65), jnp.int32))
    with pytest.raises(TypeError, match="token_type_ids must be an integer array"):
        model(ids, jnp.ones((2, 5), jnp.int32), jnp.zeros((2, 5), jnp.float32))


# --- strict loading ---------------------------------------------------------------------------

def test_state_dict_round_trip_is_exact():
    source = tiny_model(seed=3, scale=0.1)
    sd = torch_state(source, TINY)
    abstract = nnx.eval_shape(lambda: BertEncoder(TINY, rngs=nnx.Rngs(0)))
    loaded = load_state_from_torch_names(abstract, sd, bert_torch_names(TINY),
                                         ignore=BERT_IGNORED_TENSORS)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(source)),
                    jax.tree_util.tree_leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(a, b)
    # A (out, in) torch weight lands transposed: one non-square dense layer by hand.
    w = sd["encoder.layer.1.intermediate.dense.weight"]
    assert w.shape == (TINY.intermediate_size, TINY.hidden_size)
    x = np.random.default_rng(0).standard_normal((3, TINY.hidden_size)).astype(np.float32)
    expected = x @ w.T + sd["encoder.layer.1.intermediate.dense.bias"]
    np.testing.assert_allclose(loaded.layers[1].intermediate(jnp.asarray(x)), expected,
                               atol=1e-6)


def test_corrupted_state_dict_lists_every_problem():
    sd = torch_state(tiny_model(), TINY)
    mapping = bert_torch_names(TINY)
    abstract = nnx.eval_shape(lambda: BertEncoder(TINY, rngs=nnx.Rngs(0)))
    bad = dict(sd)
    bad["encoder.layer.0.attention.self.key.weight"] = np.zeros((32, 31), np.float32)
    bad["encoder.layer.1.output.dense.weight"] = np.zeros((64, 32), np.float32)  # untransposed
    bad["cls.predictions.bias"] = np.zeros(4, np.float32)
    del bad["pooler.dense.bias"]
    with pytest.raises(ValueError) as info:
        load_state_from_torch_names(abstract, bad, mapping, ignore=BERT_IGNORED_TENSORS)
    msg = str(info.value)
    assert "used by no parameter (1)" in msg and "cls.predictions.bias" in msg
    assert "the file lacks (1)" in msg and "pooler.dense.bias" in msg
    assert "encoder.layer.0.attention.self.key.weight: shape (31, 32)" in msg
    assert "encoder.layer.1.output.dense.weight: shape (32, 64)" in msg
    assert "layers/1/output/kernel expects (64, 32)" in msg
    # The position_ids buffer is the only tensor that may stay unused, and only when ignored.
    with pytest.raises(ValueError, match="embeddings.position_ids"):
        load_state_from_torch_names(abstract, sd, mapping)
    partial = {k: v for k, v in mapping.items() if "pooler" not in k}
    with pytest.raises(ValueError, match=r"no tensor fills \(2\):\n    pooler/bias"):
        load_state_from_torch_names(abstract, {k: sd[k] for k in partial}, partial)


def _write_tiny_checkpoint(directory, model, vocab_size=TINY.vocab_size):
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, processors

    words = [f"w{i}" for i in range(vocab_size - 5)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"model_type": "bert", "hidden_act": "gelu", "vocab_size": TINY.vocab_size,
           "hidden_size": TINY.hidden_size, "num_hidden_layers": TINY.num_layers,
           "num_attention_heads": TINY.num_heads, "intermediate_size": TINY.intermediate_size,
           "max_position_embeddings": TINY.max_position, "type_vocab_size": 2,
           "layer_norm_eps": 1e-12, "pad_token_id": 0}
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(torch_state(model, TINY), str(directory / "model.safetensors"))


def test_load_bert_folder_end_to_end(tmp_path):
    source = tiny_model(seed=5, scale=0.2)
    _write_tiny_checkpoint(tmp_path, source)
    model, tok = load_bert(tmp_path, max_length=8)
    batch = tok(["w1 w2 w3", "w4"])
    np.testing.assert_array_equal(batch.input_ids, [[2, 6, 7, 8, 3, 0, 0, 0],
                                                    [2, 9, 3, 0, 0, 0, 0, 0]])
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    np.testing.assert_array_equal(run(model, ids, mask), run(source, ids, mask))
    half, _ = load_bert(tmp_path, dtype=jnp.bfloat16)
    assert half.layers[0].attention.query.kernel[...].dtype == jnp.bfloat16
    assert run(half, ids, mask).dtype == jnp.float32
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        load_bert(tmp_path)


def test_load_bert_refuses_a_tokenizer_of_another_vocabulary(tmp_path):
    _write_tiny_checkpoint(tmp_path, tiny_model(), vocab_size=100)
    with pytest.raises(ValueError, match=r"tokenizer vocabulary \(100\) differs"):
        load_bert(tmp_path)


# --- heads ------------------------------------------------------------------------------------

def test_text_classifier_poolings(tiny):
    encoder = tiny
    ids, mask = random_batch(np.random.default_rng(4), LENGTHS, T)
    hidden = run(encoder, ids, mask)
    expected = {"mean": mean_pool(hidden, mask), "cls": hidden[:, 0],
                "pooler": encoder.pooled_cls(hidden)}
    clfs = [TextClassifier(encoder, 3, rngs=nnx.Rngs(1), pooling=p) for p in expected]
    # One compilation for the three classifiers (they share the encoder).
    all_logits = nnx.jit(lambda cs, i, m: [c(i, m) for c in cs])(clfs, ids, mask)
    for clf, logits, pooled in zip(clfs, all_logits, expected.values()):
        assert logits.shape == (3, 3) and logits.dtype == jnp.float32
        w, b = clf.head.dense.kernel[...], clf.head.dense.bias[...]
        np.testing.assert_allclose(logits, pooled @ w + b[None, :], atol=1e-5)
    with pytest.raises(ValueError, match="pooling must be one of"):
        TextClassifier(encoder, 3, rngs=nnx.Rngs(1), pooling="max")
    with pytest.raises(ValueError, match="num_labels must be a positive int"):
        ClassifierHead(32, 0, rngs=nnx.Rngs(0))


def test_public_random_head_is_a_function_of_its_seed():
    a, b, c = (public_random_head(384, 6, s) for s in (7, 7, 8))
    wa, wb, wc = (h.dense.kernel[...] for h in (a, b, c))
    assert wa.shape == (384, 6) and wa.dtype == jnp.float32
    np.testing.assert_array_equal(wa, wb)
    assert not np.allclose(wa, wc)
    bound = math.sqrt(3.0 / 384)
    assert float(jnp.max(jnp.abs(wa))) <= bound
    assert abs(float(jnp.var(wa)) * 384 - 1.0) < 0.1  # U(-b, b) has variance b^2/3 = 1/hidden
    x = jnp.ones((2, 384), jnp.float32)
    np.testing.assert_allclose(a(x), x @ wa, rtol=1e-6)  # bias is zero
    np.testing.assert_array_equal(public_random_projection(384, 6, 7), np.asarray(wa))
    with pytest.raises(ValueError, match="seed must be an int"):
        public_random_head(8, 2, -1)


def test_label_space_head_is_keyed_by_name():
    ab = label_space_head(16, ("a", "b"))
    ba = label_space_head(16, ("b", "a"))
    np.testing.assert_array_equal(ab[:, 0], ba[:, 1])
    assert not np.allclose(ab[:, 0], label_space_head(16, ("a",), seed=1)[:, 0])
    with pytest.raises(ValueError, match="distinct"):
        label_space_head(16, ("a", "a"))
    # one column is public_random_projection at the seed sha256("pavejax.label.v1|0|a")[:8] >> 1
    seed = int.from_bytes(hashlib.sha256(b"pavejax.label.v1|0|a").digest()[:8], "big") >> 1
    np.testing.assert_array_equal(ab[:, :1], public_random_projection(16, 1, seed))


def test_plain_head_logits_and_loss_match_numpy():
    classes = ("negative", "positive", "neutral")
    head = head0(8, classes)
    assert head["kernel"].shape == (8, 3) and head["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(head["kernel"], label_space_head(8, classes, seed=1))
    np.testing.assert_array_equal(head["bias"], np.zeros(3, np.float32))
    # developers sharing a class share its column, whatever the order of their label space
    np.testing.assert_array_equal(head0(8, ("positive", "negative"))["kernel"][:, 1],
                                  head["kernel"][:, 0])
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32),
              "bias": jnp.asarray(rng.normal(size=3), jnp.float32)}
    x = rng.normal(size=(5, 8)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0])
    z = x.astype(np.float64) @ np.asarray(params["kernel"], np.float64) + np.asarray(
        params["bias"], np.float64)
    np.testing.assert_allclose(apply_head(params, jnp.asarray(x)), z, rtol=1e-5, atol=1e-5)
    nll = np.log(np.exp(z).sum(axis=1)) - z[np.arange(5), y]
    for i in range(5):
        loss = example_loss(params, None, {"x": jnp.asarray(x[i]), "y": jnp.asarray(y[i])})
        np.testing.assert_allclose(float(loss), nll[i], rtol=1e-5)


# --- real all-MiniLM-L6-v2 --------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    from pavejax.models import load_minilm

    return load_minilm(max_length=16)


@pytest.fixture(scope="module")
def minilm_tensors():
    from safetensors.numpy import load_file

    from pavejax import assets

    return load_file(str(assets.require("minilm") / "model.safetensors"))


@pytest.mark.assets
def test_minilm_every_tensor_loaded_exactly(minilm, minilm_tensors):
    model, _ = minilm
    assert len(minilm_tensors) == 104
    mapping = bert_torch_names(model.config)
    assert set(mapping) == set(minilm_tensors) - {"embeddings.position_ids"}
    pure = nnx.to_pure_dict(nnx.state(model))
    n_params = 0
    for name, (path, transpose) in mapping.items():
        leaf = pure
        for k in path:
            leaf = leaf[k]
        raw = minilm_tensors[name]
        linear_weight = name.endswith(".weight") and raw.ndim == 2 and "embeddings" not in name
        assert transpose == linear_weight, name
        np.testing.assert_array_equal(np.asarray(leaf), raw.T if transpose else raw)
        n_params += raw.size
    assert n_params == 22_713_216


@pytest.mark.assets
def test_minilm_dense_layer_uses_torch_layout(minilm, minilm_tensors):
    model, _ = minilm
    x = np.random.default_rng(0).standard_normal((4, 384)).astype(np.float32)
    for layer, name in [(model.layers[2].attention.query, "encoder.layer.2.attention.self.query"),
                        (model.layers[0].intermediate, "encoder.layer.0.intermediate.dense")]:
        w = minilm_tensors[name + ".weight"].astype(np.float64)
        expected = x.astype(np.float64) @ w.T + minilm_tensors[name + ".bias"]
        np.testing.assert_allclose(layer(jnp.asarray(x)), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.assets
def test_minilm_sentence_similarity(minilm):
    model, tok = minilm
    batch = tok(["A man is eating food.", "A man is eating a piece of bread."])
    emb = np.asarray(nnx.jit(sentence_embedding)(
        model, jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert abs(float(emb[0] @ emb[1]) - 0.755) < 0.005


@pytest.mark.assets
def test_minilm_padding_does_not_change_the_embedding(minilm):
    model, tok = minilm
    text = "A man is eating food."
    short = tok(text)  # 8 real tokens in 16
    long = tok.with_max_length(40)(text)
    assert int(short.attention_mask.sum()) == int(long.attention_mask.sum()) == 8
    embed = nnx.jit(sentence_embedding)
    a = embed(model, jnp.asarray(short.input_ids), jnp.asarray(short.attention_mask))
    b = embed(model, jnp.asarray(long.input_ids), jnp.asarray(long.attention_mask))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.assets
def test_minilm_tokenizer_fixed_shapes(minilm):
    _, tok = minilm
    long_text = " ".join(["wonderful"] * 50)
    batch = tok(["This movie was absolutely wonderful!", long_text, ""])
    for arr in batch:
        assert arr.shape == (3, 16) and arr.dtype == np.int32
    # Ids published for this vocabulary; the rest of the row is padding with mask 0.
    np.testing.assert_array_equal(batch.input_ids[0, :8],
                                  [101, 2023, 3185, 2001, 7078, 6919, 999, 102])
    np.testing.assert_array_equal(batch.input_ids[0, 8:], 0)
    np.testing.assert_array_equal(batch.attention_mask[0], [1] * 8 + [0] * 8)
    # Truncation keeps [CLS] ... [SEP] inside max_length.
    assert batch.input_ids[1, 0] == 101 and batch.input_ids[1, -1] == 102
    np.testing.assert_array_equal(batch.input_ids[1, 1:-1], 6919)
    np.testing.assert_array_equal(batch.attention_mask[1], 1)
    np.testing.assert_array_equal(batch.input_ids[2, :2], [101, 102])
    np.testing.assert_array_equal(batch.token_type_ids, 0)
    again = tok(["This movie was absolutely wonderful!", long_text, ""])
    np.testing.assert_array_equal(again.input_ids, batch.input_ids)
    assert tok("one text").input_ids.shape == (1, 16)
    assert tok([]).input_ids.shape == (0, 16)
    with pytest.raises(TypeError, match="texts must be a str or a sequence of str"):
        tok([1, 2])
    with pytest.raises(ValueError, match="max_length must be an int >= 2"):
        tok.with_max_length(1)


@pytest.mark.assets
def test_minilm_tokenizer_ignores_the_file_padding_settings():
    import tokenizers

    from pavejax import assets

    raw = tokenizers.Tokenizer.from_file(str(assets.require("minilm") / "tokenizer.json"))
    assert raw.padding["length"] == 128  # the file ships fixed padding ...
    tok = Tokenizer(raw, max_length=24)
    assert tok("hello").input_ids.shape == (1, 24)  # ... which the wrapper replaces
    assert raw.padding["length"] == 128  # without touching the caller's tokenizer


@pytest.mark.assets
def test_text_embedding_cache(monkeypatch, tmp_path):
    texts = ["A great, moving film.", "Terrible service, never again.",
             "Shares fell sharply on Monday.", "A great, moving film.", "The match ended 2-1."]
    before = len(embed_mod._EMBEDDINGS)
    emb = embed_texts(texts, max_length=16, batch_size=4)
    assert emb.shape == (5, 384) and emb.dtype == np.float32
    assert len(embed_mod._EMBEDDINGS) - before <= 4  # the repeated sentence is encoded once
    np.testing.assert_array_equal(emb[0], emb[3])
    # Independent path: the encoder inside a TextClassifier with mean pooling.
    graphdef, state, tokenizer, _ = embed_mod._encoder(None, 16)
    model = TextClassifier(nnx.merge(graphdef, state), 2, rngs=nnx.Rngs(0), pooling="mean")
    tokens = tokenizer(texts)
    ref = nnx.jit(lambda m, ids, mask: m.features(ids, mask))(model, tokens.input_ids,
                                                                tokens.attention_mask)
    np.testing.assert_allclose(emb, ref, rtol=1e-4, atol=1e-5)
    # A second call is served from the cache: the encoder is not touched.
    # A BERT folder of one's own: its own features, cached under its own key.
    source = tiny_model(seed=7, scale=0.2)
    _write_tiny_checkpoint(tmp_path, source)
    words = ["w1 w2 w3", "w4", "w1 w2 w3"]
    mine = embed_texts(words, max_length=8, backbone=str(tmp_path))
    model, tok = load_bert(tmp_path, max_length=8)
    batch = tok(words)
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    np.testing.assert_allclose(mine, mean_pool(run(model, ids, mask), mask), rtol=1e-5,
                               atol=1e-6)
    assert mine.shape == (3, TINY.hidden_size)
    cls = embed_texts(words, max_length=8, backbone=str(tmp_path), pooling="cls")
    np.testing.assert_allclose(cls, run(model, ids, mask)[:, 0], rtol=1e-5, atol=1e-6)
    # the spec backbone pools the same way (its centring features are these)
    from pavejax.pave.text import TextSpecBackbone
    for how, want in (("mean", mine), ("cls", cls)):
        tb = TextSpecBackbone(model, tok, max_length=8, layers=(0,), pooling=how)
        np.testing.assert_allclose(tb.encode(words)["base_pooled"], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pooling must be one of"):
        TextSpecBackbone(model, tok, max_length=8, pooling="max")
    assert embed_texts([], max_length=8, backbone=str(tmp_path)).shape == (0, TINY.hidden_size)
    # A second call is served from the cache: the encoder is not touched.
    monkeypatch.setattr(embed_mod, "_encoder",
                        lambda *a: pytest.fail("encoder called on a cache hit"))
    np.testing.assert_array_equal(embed_texts(texts[::-1], max_length=16), emb[::-1])
    np.testing.assert_array_equal(embed_texts(words, max_length=8, backbone=str(tmp_path)),
                                  mine)
