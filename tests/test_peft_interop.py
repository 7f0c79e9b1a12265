"""PEFT / torch-named safetensors interop: names, shapes, orientation, exact round trips."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from pavejax import lora
from pavejax.interop import (
    export_lora_peft,
    export_merged_safetensors,
    import_lora_peft,
    import_merged_safetensors,
    minilm_flax_path,
    minilm_torch_name,
    minilm_torch_tensor_name,
)
from pavejax.models import BertConfig, BertEncoder, load_bert

TINY = BertConfig.tiny()
QV = ("attention/query/kernel", "attention/value/kernel")


@functools.cache  # one random init per seed: eager NNX init dominates these tests on CPU
def _tiny_params(seed=0):
    graphdef, state = nnx.split(BertEncoder(TINY, rngs=nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


def _trained_factors(key, params, cfg):
    B, A = lora.init_lora(key, params, lambda p, _: p.endswith(QV), cfg)
    B = {p: jax.random.normal(jax.random.fold_in(key, 7 + i), b.shape, b.dtype)
         for i, (p, b) in enumerate(sorted(B.items()))}
    return B, A


@pytest.mark.parametrize("flax_path, torch_module", [
    ("layers/0/attention/query/kernel", "encoder.layer.0.attention.self.query"),
    ("encoder/layers/1/attention/value/kernel", "encoder.layer.1.attention.self.value"),
    ("layers/5/attention/output/kernel", "encoder.layer.5.attention.output.dense"),
    ("layers/3/intermediate/kernel", "encoder.layer.3.intermediate.dense"),
    ("layers/12/output/kernel", "encoder.layer.12.output.dense"),
    ("pooler/kernel", "pooler.dense"),
])
def test_module_names_follow_hugging_face_bert(flax_path, torch_module):
    assert minilm_torch_name(flax_path) == torch_module
    plain = flax_path.removeprefix("encoder/")
    assert minilm_flax_path(torch_module) == plain
    assert minilm_flax_path(torch_module, prefix="encoder/") == "encoder/" + plain


@pytest.mark.parametrize("flax_path, tensor", [
    ("embeddings/word/embedding", "embeddings.word_embeddings.weight"),
    ("embeddings/position/embedding", "embeddings.position_embeddings.weight"),
    ("embeddings/token_type/embedding", "embeddings.token_type_embeddings.weight"),
    ("encoder/embeddings/norm/scale", "embeddings.LayerNorm.weight"),
    ("layers/2/attention/norm/bias", "encoder.layer.2.attention.output.LayerNorm.bias"),
    ("layers/4/norm/scale", "encoder.layer.4.output.LayerNorm.weight"),
    ("layers/0/attention/key/bias", "encoder.layer.0.attention.self.key.bias"),
    ("pooler/kernel", "pooler.dense.weight"),
])
def test_tensor_names_follow_hugging_face_bert(flax_path, tensor):
    assert minilm_torch_tensor_name(flax_path) == tensor


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="not a Linear kernel"):
        minilm_torch_name("layers/0/norm/scale")
    with pytest.raises(ValueError, match="not a BERT parameter path"):
        minilm_torch_tensor_name("head/kernel")
    with pytest.raises(ValueError, match="not a BERT Linear module"):
        minilm_flax_path("classifier")


@pytest.mark.parametrize("cfg", [lora.LoraConfig(rank=4),
                                 lora.LoraConfig(rank=2, alpha=3.5, init="kaiming_uniform")])
def test_adapter_round_trip_is_exact(tmp_path, key, cfg):
    _, params = _tiny_params()
    B, A = _trained_factors(key, params, cfg)
    export_lora_peft(tmp_path, B, A, cfg, name_map=minilm_torch_name, include_secret_A=True)
    B2, A2, cfg2 = import_lora_peft(tmp_path, name_map_inverse=minilm_flax_path)
    assert cfg2 == cfg
    assert set(B2) == set(B) and set(A2) == set(A)
    for p in B:
        np.testing.assert_array_equal(np.asarray(B2[p]), np.asarray(B[p]))
        np.testing.assert_array_equal(np.asarray(A2[p]), np.asarray(A[p]))
        assert B2[p].dtype == jnp.float32


def test_peft_layout_names_shapes_and_config(tmp_path, key):
    _, params = _tiny_params()
    cfg = lora.LoraConfig(rank=4, alpha=8)
    B, A = _trained_factors(key, params, cfg)
    export_lora_peft(tmp_path, B, A, cfg, name_map=minilm_torch_name, include_secret_A=True,
                     task_type="FEATURE_EXTRACTION")
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    expected = {f"base_model.model.encoder.layer.{i}.attention.self.{m}.lora_{f}.weight"
                for i in range(TINY.num_layers) for m in ("query", "value") for f in "AB"}
    assert set(tensors) == expected
    h = TINY.hidden_size
    for name, arr in tensors.items():
        assert arr.shape == ((4, h) if ".lora_A." in name else (h, 4)), name
        assert arr.dtype == np.float32
    q0 = "encoder.layer.0.attention.self.query"
    np.testing.assert_array_equal(tensors[f"base_model.model.{q0}.lora_A.weight"],
                                  np.asarray(A["layers/0/attention/query/kernel"]).T)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert isinstance(config["lora_alpha"], int)
    assert config["target_modules"] == ["query", "value"]
    assert config["fan_in_fan_out"] is False and config["bias"] == "none"
    assert config["task_type"] == "FEATURE_EXTRACTION" and config["init_lora_weights"] is True
    assert config["base_model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert config["use_rslora"] is False  # PEFT scale is then lora_alpha / r, as ours


def test_orientation_on_a_hand_computed_case(tmp_path):
    # y = x @ (W + s A B) with s = alpha / r = 2 / 1:  x @ W = [2, 2], x @ A = 3,
    # s * 3 * B = [6, -6], so y = [8, -4].
    W = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    A = {"proj/kernel": jnp.asarray([[1.0], [2.0], [0.0]])}
    B = {"proj/kernel": jnp.asarray([[1.0, -1.0]])}
    cfg = lora.LoraConfig(rank=1, alpha=2.0)
    x = jnp.asarray([[1.0, 1.0, 1.0]])
    params = {"proj": {"kernel": W}}
    y_flax = x @ lora.apply_lora(params, B, A, cfg)["proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(y_flax), [[8.0, -4.0]])
    export_lora_peft(tmp_path, B, A, cfg, name_map={"proj/kernel": "proj"},
                     target_modules=("proj",), include_secret_A=True)
    export_merged_safetensors(tmp_path / "base.safetensors", params,
                              to_torch_name=lambda p: "proj.weight")
    base = load_file(str(tmp_path / "base.safetensors"))["proj.weight"]
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    lora_a = adapter["base_model.model.proj.lora_A.weight"]
    lora_b = adapter["base_model.model.proj.lora_B.weight"]
    assert base.shape == (2, 3) and lora_a.shape == (1, 3) and lora_b.shape == (2, 1)
    xn = np.asarray(x)
    y_torch = xn @ base.T + 2.0 * (xn @ lora_a.T) @ lora_b.T  # PEFT's LoRA Linear forward
    np.testing.assert_array_equal(y_torch, [[8.0, -4.0]])


def test_adapter_export_requires_consent_and_consistent_names(tmp_path, key):
    _, params = _tiny_params()
    cfg = lora.LoraConfig(rank=2)
    B, A = _trained_factors(key, params, cfg)
    with pytest.raises(ValueError, match="include_secret_A=True"):
        export_lora_peft(tmp_path / "a", B, A, cfg, name_map=minilm_torch_name)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="target_modules"):
        export_lora_peft(tmp_path / "b", B, A, cfg, name_map=minilm_torch_name,
                         target_modules=("query",), include_secret_A=True)
    with pytest.raises(ValueError, match="both map to"):
        export_lora_peft(tmp_path / "c", B, A, cfg, name_map=lambda p: "x.query",
                         target_modules=("query",), include_secret_A=True)
    export_lora_peft(tmp_path / "d", B, A, cfg, name_map=minilm_torch_name, include_secret_A=True)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_lora_peft(tmp_path / "d", B, A, cfg, name_map=minilm_torch_name,
                         include_secret_A=True)


def test_import_refuses_adapters_it_cannot_represent(tmp_path, key):
    _, params = _tiny_params()
    cfg = lora.LoraConfig(rank=2)
    B, A = _trained_factors(key, params, cfg)
    export_lora_peft(tmp_path, B, A, cfg, name_map=minilm_torch_name, include_secret_A=True)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora=True"):
        import_lora_peft(tmp_path, name_map_inverse=minilm_flax_path)
    path.write_text(json.dumps(config | {"r": 3}))
    with pytest.raises(ValueError, match="do not fit r=3"):
        import_lora_peft(tmp_path, name_map_inverse=minilm_flax_path)


def _write_tokenizer_and_config(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = [f"w{i}" for i in range(TINY.vocab_size - 5)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"model_type": "bert", "hidden_act": "gelu", "vocab_size": TINY.vocab_size,
              "hidden_size": TINY.hidden_size, "num_hidden_layers": TINY.num_layers,
              "num_attention_heads": TINY.num_heads, "intermediate_size": TINY.intermediate_size,
              "max_position_embeddings": TINY.max_position, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "pad_token_id": 0}
    (directory / "config.json").write_text(json.dumps(config))


def test_merged_model_round_trip_and_our_loader_reads_it(tmp_path, key):
    graphdef, params = _tiny_params()
    cfg = lora.LoraConfig(rank=2)
    B, A = _trained_factors(key, params, cfg)
    merged = lora.apply_lora(params, B, A, cfg)
    names = export_merged_safetensors(tmp_path / "model.safetensors", merged)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert names == sorted(tensors) and "embeddings.position_ids" not in tensors
    q = "layers/1/attention/query/kernel"
    np.testing.assert_array_equal(tensors["encoder.layer.1.attention.self.query.weight"],
                                  np.asarray(merged["layers"][1]["attention"]["query"]["kernel"]).T)
    back = import_merged_safetensors(tmp_path / "model.safetensors", params)
    for (p1, a), (p2, b) in zip(jax.tree_util.tree_flatten_with_path(merged)[0],
                                jax.tree_util.tree_flatten_with_path(back)[0], strict=True):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(lora.named_leaves(back)[q]),
                              np.asarray(lora.named_leaves(params)[q]))  # the merge is in it
    _write_tokenizer_and_config(tmp_path)
    loaded, tok = load_bert(tmp_path, max_length=8)
    batch = tok(["w1 w2 w3", "w4 w9"])
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    expected = nnx.merge(graphdef, merged)(ids, mask)
    np.testing.assert_array_equal(np.asarray(loaded(ids, mask)), np.asarray(expected))


def test_merged_export_can_leave_out_a_head_and_import_checks_shapes(tmp_path):
    _, enc = _tiny_params()
    params = {"encoder": enc, "head": {"kernel": jnp.ones((TINY.hidden_size, 3))}}

    def name(p):
        return None if p.startswith("head/") else minilm_torch_tensor_name(p)

    names = export_merged_safetensors(tmp_path / "m.safetensors", params, to_torch_name=name)
    assert not any("head" in n for n in names)
    back = import_merged_safetensors(tmp_path / "m.safetensors", params, to_torch_name=name)
    assert back["head"]["kernel"] is params["head"]["kernel"]
    wrong = jax.tree.map(lambda x: x, enc)
    wrong["pooler"]["kernel"] = jnp.zeros((TINY.hidden_size, TINY.hidden_size + 1))
    del wrong["layers"][0]["norm"]
    with pytest.raises(ValueError, match=r"(?s)unused tensor 'encoder.layer.0.output.LayerNorm"
                                         r".*'pooler.dense.weight': shape"):
        import_merged_safetensors(tmp_path / "m.safetensors", wrong)
