"""Llama loaders: GGUF files written here with gguf.GGUFWriter (q/k rows permuted the way
llama.cpp's converter does), the Hugging Face layout against a float64 numpy forward written here,
and the errors (SmolLM2's real file: test_smollm2.py)."""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import pre_tokenizers

from pavejax.models import (
    LlamaConfig,
    LlamaLM,
    LlamaTokenizer,
    load_gguf,
    load_hf_llama,
    save_hf_llama,
)

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
          *sorted(pre_tokenizers.ByteLevel.alphabet()), "he", "Ġt", "Ġthe"]
MERGES = ["h e", "Ġ t", "Ġt he"]
CFG = LlamaConfig.tiny(vocab_size=len(TOKENS), rope_theta=500.0, rms_norm_eps=1e-5,
                       max_position=64)
IDS = np.random.default_rng(7).integers(0, len(TOKENS), size=(2, 11)).astype(np.int32)
MASK = np.array([[1] * 11, [0] * 3 + [1] * 8], np.int32)


def _random_model(config, seed=0):
    """A LlamaLM whose weights are N(0, 0.3^2) and norm scales 1 + N(0, 0.1^2), so every piece
    (and every row order) shows in the logits."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def redraw(x):
        noise = rng.standard_normal(x.shape)
        return jnp.asarray(1.0 + 0.1 * noise if x.ndim == 1 else 0.3 * noise, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map(redraw, state))


def _params(model):
    return jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _interleave(w, n_heads):
    """llama.cpp's ``convert_hf_to_gguf.py`` permutation of (out, in) q/k rows: per head, the
    half-split pairs (i, i + d/2) become adjacent rows (2i, 2i + 1)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(model):
    """GGUF name -> (out, in) float32 array, q/k stored interleaved as llama.cpp does."""
    p, cfg = _params(model), model.config
    out = {"token_embd.weight": p["embed"]["embedding"], "output_norm.weight": p["norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["output.weight"] = p["lm_head"]["kernel"].T
    for i, layer in p["layers"].items():
        a, m = layer["attn"], layer["mlp"]
        out |= {f"blk.{i}.attn_norm.weight": layer["attn_norm"]["scale"],
                f"blk.{i}.attn_q.weight": _interleave(a["q"]["kernel"].T, cfg.num_heads),
                f"blk.{i}.attn_k.weight": _interleave(a["k"]["kernel"].T, cfg.num_kv_heads),
                f"blk.{i}.attn_v.weight": a["v"]["kernel"].T,
                f"blk.{i}.attn_output.weight": a["o"]["kernel"].T,
                f"blk.{i}.ffn_norm.weight": layer["mlp_norm"]["scale"],
                f"blk.{i}.ffn_gate.weight": m["gate"]["kernel"].T,
                f"blk.{i}.ffn_up.weight": m["up"]["kernel"].T,
                f"blk.{i}.ffn_down.weight": m["down"]["kernel"].T}
    return out


def _write_gguf(path, model, *, arch="llama", edit=lambda tensors: tensors):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    for name, arr in edit(_gguf_tensors(model)).items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@nnx.jit
def _forward(model, ids, mask):
    return model(ids, mask)


def _logits(model):
    return np.asarray(_forward(model, jnp.asarray(IDS), jnp.asarray(MASK)))


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip_gives_the_original_logits(tmp_path, tied):
    """Fails if the (out, in) matrices were not transposed or q/k rows not un-permuted."""
    original = _random_model(LlamaConfig.tiny(**{**CFG.to_dict(), "tie_embeddings": tied}))
    path = _write_gguf(tmp_path / "m.gguf", original)
    model, tok = load_gguf(path)
    assert model.config == original.config
    np.testing.assert_allclose(_logits(model), _logits(original), atol=1e-5, rtol=0)
    assert tok.vocab_size == len(TOKENS) and (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 2, 1)
    assert tok.encode(" the") == [TOKENS.index("Ġthe")]
    assert LlamaTokenizer.from_gguf(path).encode("<|im_start|> the") == [1, TOKENS.index("Ġthe")]


def test_skipping_the_unpermute_would_change_the_logits():
    """The interleaved rows used as if half-split (what a loader without the un-permute builds)
    give other logits, so the round trip above can fail."""
    original = _random_model(CFG)
    graphdef, state = nnx.split(original)
    pure = nnx.to_pure_dict(state)
    for layer in pure["layers"].values():
        for name, heads in (("q", CFG.num_heads), ("k", CFG.num_kv_heads)):
            kernel = np.asarray(layer["attn"][name]["kernel"])
            layer["attn"][name]["kernel"] = jnp.asarray(_interleave(kernel.T, heads).T)
    nnx.replace_by_pure_dict(state, pure)
    skipped = nnx.merge(graphdef, state)
    assert np.abs(_logits(skipped) - _logits(original)).max() > 1e-2


def _rotate(x, positions, theta, interleaved):
    """Rotary embedding in float64 of x (T, H, D): pairs (2i, 2i+1) when interleaved (llama.cpp's
    layout), else (i, i + D/2); frequency i rotates by angle p * theta^(-2i/D)."""
    d = x.shape[-1]
    ang = positions[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def test_interleaved_rope_on_file_rows_equals_half_split_on_loaded_kernels(tmp_path):
    """The attention scores llama.cpp computes (interleaved RoPE on the stored rows) equal those
    of the loaded model (half-split RoPE on its kernels), for queries and GQA keys."""
    original = _random_model(CFG)
    path = _write_gguf(tmp_path / "m.gguf", original)
    stored = {t.name: np.asarray(t.data, np.float64) for t in gguf.GGUFReader(path).tensors}
    loaded = _params(load_gguf(path)[0])["layers"][1]["attn"]
    x = np.random.default_rng(3).standard_normal((9, CFG.hidden_size))
    pos = np.arange(9, dtype=np.float64)
    hd, group = CFG.dim_per_head, CFG.num_heads // CFG.num_kv_heads

    def scores(wq, wk, interleaved):
        q = _rotate((x @ wq).reshape(9, CFG.num_heads, hd), pos, CFG.rope_theta, interleaved)
        k = _rotate((x @ wk).reshape(9, CFG.num_kv_heads, hd), pos, CFG.rope_theta, interleaved)
        return np.einsum("qhd,khd->hqk", q, np.repeat(k, group, axis=1))

    ref = scores(stored["blk.1.attn_q.weight"].T, stored["blk.1.attn_k.weight"].T, True)
    got = scores(loaded["q"]["kernel"].astype(np.float64),
                 loaded["k"]["kernel"].astype(np.float64), False)
    np.testing.assert_allclose(got, ref, atol=1e-10)
    wrong = scores(stored["blk.1.attn_q.weight"].T, stored["blk.1.attn_k.weight"].T, False)
    assert np.abs(wrong - ref).max() > 1e-2


def test_gguf_errors_name_the_problem(tmp_path):
    model = _random_model(CFG)

    def drop(tensors):
        return {k: v for k, v in tensors.items() if k != "blk.1.attn_v.weight"}

    with pytest.raises(ValueError, match=r"lacks \(1\):\n\s+blk\.1\.attn_v\.weight"):
        load_gguf(_write_gguf(tmp_path / "a.gguf", model, edit=drop))

    def widen(tensors):
        return tensors | {"blk.0.ffn_up.weight": np.zeros((CFG.intermediate_size + 1,
                                                          CFG.hidden_size), np.float32)}

    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight: shape \(32, 49\)"):
        load_gguf(_write_gguf(tmp_path / "b.gguf", model, edit=widen))

    def extra(tensors):
        return tensors | {"blk.0.attn_q.bias": np.zeros(CFG.hidden_size, np.float32)}

    with pytest.raises(ValueError, match=r"used by no parameter \(1\):\n\s+blk\.0\.attn_q\.bias"):
        load_gguf(_write_gguf(tmp_path / "c.gguf", model, edit=extra))
    with pytest.raises(ValueError, match="general.architecture is 'gpt2'"):
        load_gguf(_write_gguf(tmp_path / "d.gguf", model, arch="gpt2"))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "absent.gguf")


# --- Hugging Face layout -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hf_save_then_load_round_trips(tmp_path, dtype):
    original = _random_model(LlamaConfig.tiny(tie_embeddings=False))
    graphdef, params, rest = nnx.split(original, nnx.Param, ...)
    original = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params),
                         rest)
    loaded = load_hf_llama(save_hf_llama(original, tmp_path / "ckpt"), param_dtype=dtype)
    assert loaded.config == original.config
    for a, b in zip(jax.tree_util.tree_leaves(_params(loaded)),
                    jax.tree_util.tree_leaves(_params(original))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_logits(loaded), _logits(original))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 2


def test_tied_model_saves_without_lm_head_and_ignores_a_stray_one(tmp_path):
    original = _random_model(LlamaConfig.tiny())
    folder = save_hf_llama(original, tmp_path / "tied")
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    stray = np.zeros((original.config.vocab_size, original.config.hidden_size), np.float32)
    save_file(tensors | {"lm_head.weight": stray}, folder / "model.safetensors")
    np.testing.assert_array_equal(_logits(load_hf_llama(folder)), _logits(original))


HF_CONFIG = {"model_type": "llama", "vocab_size": 50, "hidden_size": 24,
             "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 1000.0,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "max_position_embeddings": 32, "rope_scaling": None, "attention_bias": False}


def _hf_checkpoint(seed=0):
    """HF-named (out, in) float32 arrays for HF_CONFIG (head_dim * heads != hidden_size)."""
    c, rng = HF_CONFIG, np.random.default_rng(seed)
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(c["vocab_size"], d), "model.norm.weight": 1 + w(d),
         "lm_head.weight": w(c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(d, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + w(d, scale=0.1),
              p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.k_proj.weight": w(kv, d),
              p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, q),
              p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
              p + "mlp.down_proj.weight": w(d, f)}
    return t


def _hf_forward64(t, ids):
    """Hugging Face LlamaForCausalLM in float64 numpy (rotate_half RoPE, repeat_kv GQA)."""
    c = HF_CONFIG
    t = {k: v.astype(np.float64) for k, v in t.items()}
    hq, hkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
        c["rms_norm_eps"]
    n = len(ids)
    ang = np.arange(n)[:, None] * c["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.tile(np.cos(ang), 2)[:, None], np.tile(np.sin(ang), 2)[:, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    h = t["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = rope((x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, hq, hd))
        k = rope((x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, hd))
        v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, hd)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        prob = np.exp(s - s.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", prob, v).reshape(n, hq * hd)
        h = h + o @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        g = x @ t[p + "mlp.gate_proj.weight"].T
        h = h + (g / (1 + np.exp(-g)) * (x @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
    return rms(h, t["model.norm.weight"]) @ t["lm_head.weight"].T


def _write_hf(folder, tensors, config=HF_CONFIG, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return folder
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        save_file(part, folder / shard)
        weight_map |= dict.fromkeys(part, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("shards", [1, 2])
def test_hand_written_hf_checkpoint_matches_a_float64_forward(tmp_path, shards):
    tensors = _hf_checkpoint()
    buffers = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    model = load_hf_llama(_write_hf(tmp_path / "hf", tensors | buffers, shards=shards))
    assert model.config.dim_per_head == 8 and model.config.num_kv_heads == 2
    ids = np.array([3, 17, 42, 0, 9, 9, 31, 5], np.int32)
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(ids), None)),
                               _hf_forward64(tensors, ids), atol=1e-4, rtol=0)


def test_hf_errors_name_the_problem(tmp_path):
    tensors = _hf_checkpoint()
    for i, (change, message) in enumerate([
            ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
            ({"attention_bias": True}, "attention_bias=true is not supported"),
            ({"model_type": "gpt2"}, "model_type 'gpt2' is not a Llama-family")]):
        folder = _write_hf(tmp_path / f"c{i}", tensors, {**HF_CONFIG, **change})
        with pytest.raises(ValueError, match=message):
            load_hf_llama(folder)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks \(1\):\n\s+model\.layers\.1\.mlp\.up_proj"):
        load_hf_llama(_write_hf(tmp_path / "m", missing))
    bad = tensors | {"model.layers.0.self_attn.k_proj.weight": np.zeros((24, 24), np.float32)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: shape"):
        load_hf_llama(_write_hf(tmp_path / "s", bad))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_hf_llama(tmp_path / "empty")

