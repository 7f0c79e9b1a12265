"""Load Llama-family causal LMs from GGUF files and from the Hugging Face safetensors layout.

GGUF (llama.cpp's format). The configuration comes from the ``llama.*`` metadata, the tokenizer
from ``tokenizer.*`` (:class:`~pavejax.models.LlamaTokenizer`). Tensors of any type ``gguf``
can dequantise (F32, F16, BF16, Q4_1, Q8_0, ...) become float32 and then ``param_dtype``. Two
layout facts matter:

* ``gguf`` returns each matrix as (out, in) (the metadata lists the dimensions the other way
  round); :class:`~pavejax.models.LlamaLM` computes ``x @ W`` with (in, out) kernels, so every
  matrix is transposed.
* llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that rotary pairs are
  adjacent (interleaved rotary embeddings). The model uses the half-split layout, so each head's
  rows are un-permuted: per head, row ``2 i + j`` of the file is row ``j * head_dim / 2 + i`` of
  the model. Skipping this still gives fluent text, but about twice the perplexity.

Hugging Face (``config.json`` + ``model.safetensors``, or shards listed in
``model.safetensors.index.json``): weights are (out, in) and already half-split, so they are only
transposed. :func:`save_hf_llama` writes the same layout.

Loading is strict (the rules of :func:`~pavejax.models.load_state_from_torch_names`): a tensor
that fills no parameter, a parameter no tensor fills, or a shape mismatch raises one
``ValueError`` naming every offending tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax.models.llama import LlamaConfig, LlamaLM
from pavejax.models.llama_tokenizer import LlamaTokenizer, _open_gguf, gguf_metadata
from pavejax.models.loading import TorchTarget, _flatten, load_state_from_torch_names

__all__ = [
    "SMOLLM2_FILE",
    "gguf_llama_names",
    "hf_llama_names",
    "load_gguf",
    "load_hf_llama",
    "load_smollm2",
    "save_hf_llama",
]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HF_BLOCK = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn/q": "self_attn.q_proj", "attn/k": "self_attn.k_proj",
             "attn/v": "self_attn.v_proj", "attn/o": "self_attn.o_proj",
             "mlp/gate": "mlp.gate_proj", "mlp/up": "mlp.up_proj", "mlp/down": "mlp.down_proj"}
_GGUF_BLOCK = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "attn/q": "attn_q",
               "attn/k": "attn_k", "attn/v": "attn_v", "attn/o": "attn_output",
               "mlp/gate": "ffn_gate", "mlp/up": "ffn_up", "mlp/down": "ffn_down"}


def _names(config: LlamaConfig, embed: str, norm: str, head: str, block: str,
           block_names: Mapping[str, str]) -> dict[str, TorchTarget]:
    """Tensor name -> ``LlamaLM`` state path; norms are ``scale`` vectors, the rest (out, in)."""
    table = {f"{embed}.weight": TorchTarget(("embed", "embedding")),
             f"{norm}.weight": TorchTarget(("norm", "scale"))}
    if not config.tie_embeddings:
        table[f"{head}.weight"] = TorchTarget(("lm_head", "kernel"), True)
    for i in range(config.num_layers):
        for ours, theirs in block_names.items():
            is_norm = ours.endswith("norm")
            path = ("layers", i, *ours.split("/"), "scale" if is_norm else "kernel")
            table[f"{block.format(i)}.{theirs}.weight"] = TorchTarget(path, not is_norm)
    return table


def hf_llama_names(config: LlamaConfig) -> dict[str, TorchTarget]:
    """Hugging Face ``LlamaForCausalLM`` tensor name -> ``LlamaLM`` state path (``lm_head.weight``
    only when the output is untied)."""
    return _names(config, "model.embed_tokens", "model.norm", "lm_head", "model.layers.{}",
                  _HF_BLOCK)


def gguf_llama_names(config: LlamaConfig) -> dict[str, TorchTarget]:
    """GGUF tensor name (``blk.N.attn_q.weight``, ...) -> ``LlamaLM`` state path
    (``output.weight`` only when the output is untied)."""
    return _names(config, "token_embd", "output_norm", "output", "blk.{}", _GGUF_BLOCK)


def _load(config: LlamaConfig, tensors: Mapping[str, np.ndarray],
          mapping: Mapping[str, TorchTarget], param_dtype: Any, source: Any,
          ignore: tuple[str, ...] = ()) -> LlamaLM:
    abstract = nnx.eval_shape(lambda: LlamaLM(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    try:
        return load_state_from_torch_names(abstract, tensors, mapping, ignore=ignore)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


# --- GGUF --------------------------------------------------------------------------------------


def _float32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not
    9.9999997e-06), which is the value the file's writer meant."""
    return float(str(np.float32(value)))


def _config_from_gguf(meta: Mapping[str, Any], *, tied: bool) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; only 'llama' GGUF files (Llama, "
                         "SmolLM, Mistral without sliding windows) can be loaded")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF metadata lacks llama.{key}")
        return value

    if get("expert_count", 0):
        raise ValueError("mixture-of-experts GGUF files (llama.expert_count > 0) are not "
                         "supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"llama.rope.scaling.type {scaling!r} is not supported (plain RoPE "
                         "only)")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
    heads = int(get("attention.head_count"))
    config = LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=meta.get("llama.attention.key_length"),
        rope_theta=_float32_value(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=tied, max_position=int(get("context_length")))
    rotary = meta.get("llama.rope.dimension_count", config.dim_per_head)
    if rotary != config.dim_per_head:
        raise ValueError(f"llama.rope.dimension_count {rotary} differs from the head width "
                         f"{config.dim_per_head}; partial rotary embeddings are not supported")
    return config


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
    except NotImplementedError as err:
        raise ValueError(f"tensor {tensor.name}: {err}; re-quantise the file to Q8_0, Q4_1 or "
                         "F16") from None


def _unpermute_rows(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """(n_heads * head_dim, d_in) rows in llama.cpp's interleaved order -> half-split order.
    Any other shape is returned unchanged (the strict loader then reports the mismatch)."""
    if w.ndim != 2 or w.shape[0] != n_heads * head_dim:
        return w
    d_in = w.shape[1]
    return w.reshape(n_heads, head_dim // 2, 2, d_in).swapaxes(1, 2).reshape(-1, d_in)


def load_gguf(path: str | os.PathLike[str], *,
              param_dtype: Any = jnp.float32) -> tuple[LlamaLM, LlamaTokenizer]:
    """A ``general.architecture = llama`` GGUF file as a model and its tokenizer.

    Args:
      path: the ``.gguf`` file.
      param_dtype: parameter dtype (float32 or bfloat16); tensors are dequantised to float32
        first, so quantised files load as their dequantised values.

    Returns:
      ``(model, tokenizer)``; the output is tied to the embedding when the file has no
      ``output.weight``.

    Raises:
      ValueError: another architecture, missing metadata, a tensor type ``gguf`` cannot
        dequantise, or (listing every one) missing, unexpected or mis-shaped tensors.
    """
    reader = _open_gguf(path)
    meta = gguf_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    config = _config_from_gguf(meta, tied="output.weight" not in by_name)
    tokenizer = LlamaTokenizer.from_gguf_metadata(meta)
    tensors = {name: _dequantize(t) for name, t in by_name.items()}
    hd = config.dim_per_head
    for i in range(config.num_layers):
        for name, heads in (("attn_q", config.num_heads), ("attn_k", config.num_kv_heads)):
            key = f"blk.{i}.{name}.weight"
            if key in tensors:
                tensors[key] = _unpermute_rows(tensors[key], heads, hd)
    model = _load(config, tensors, gguf_llama_names(config), param_dtype, os.fspath(path))
    return model, tokenizer


def load_smollm2(*, param_dtype: Any = jnp.float32) -> tuple[LlamaLM, LlamaTokenizer]:
    """SmolLM2-135M-Instruct (30 layers, hidden 576, 9 query / 3 key-value heads, vocabulary
    49152, tied output; GGUF Q4_1 dequantised) and its tokenizer, from the installed ``smollm2``
    asset (sha256-checked; ``AssetMissingError`` names the install command when absent)."""
    from pavejax import assets

    return load_gguf(assets.require("smollm2") / SMOLLM2_FILE, param_dtype=param_dtype)


# --- Hugging Face layout -----------------------------------------------------------------------


def _config_from_hf(cfg: Mapping[str, Any]) -> LlamaConfig:
    kind = cfg.get("model_type", "llama")
    if kind not in ("llama", "mistral"):
        raise ValueError(f"model_type {kind!r} is not a Llama-family model ('llama' or "
                         "'mistral')")
    if cfg.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling {cfg['rope_scaling']!r} is not supported; only plain "
                         "RoPE (rope_scaling null) loads")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"{flag}=true is not supported: LlamaLM has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU uses silu)")
    max_position = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    if kind == "mistral" and window is not None and window < max_position:
        raise ValueError(f"sliding_window {window} < max_position_embeddings {max_position}: "
                         "sliding-window attention is not supported")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    heads = cfg["num_attention_heads"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim"), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), max_position=max_position)


def _config_to_hf(config: LlamaConfig, dtype: Any) -> dict[str, Any]:
    explicit = {} if config.head_dim is None else {"head_dim": config.head_dim}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **explicit,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "max_position_embeddings": config.max_position, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
            "torch_dtype": jnp.dtype(dtype).name}


def _read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file  # the ``text`` extra

    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if not index.is_file():
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor "
                                "model.safetensors.index.json (sharded weights)")
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        if not (directory / shard).is_file():
            raise FileNotFoundError(f"shard {shard} listed in {index.name} is missing from "
                                    f"{directory}")
        tensors |= load_file(directory / shard)
    return tensors


def load_hf_llama(directory: str | os.PathLike[str], *, param_dtype: Any = jnp.float32) -> LlamaLM:
    """A Hugging Face Llama checkpoint folder (``config.json`` and ``model.safetensors`` or its
    shards) as a :class:`~pavejax.models.LlamaLM`; load its tokenizer with
    ``LlamaTokenizer.from_file(directory / "tokenizer.json")``.

    ``param_dtype`` is the parameter dtype (the file's values are cast). Rotary ``inv_freq``
    buffers, and ``lm_head.weight`` of a tied model, are ignored.

    Raises:
      ValueError: an unsupported configuration (``rope_scaling``, attention or MLP biases, an
        activation other than silu, sliding windows) or missing, unexpected or mis-shaped
        tensors (all listed).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in {directory}")
    config = _config_from_hf(json.loads(config_path.read_text()))
    tensors = _read_safetensors(directory)
    ignore = tuple(n for n in tensors if n.endswith("rotary_emb.inv_freq"))
    if config.tie_embeddings:
        ignore += ("lm_head.weight",)
    return _load(config, tensors, hf_llama_names(config), param_dtype, directory, ignore)


def save_hf_llama(model: LlamaLM, directory: str | os.PathLike[str]) -> Path:
    """Write ``model`` as a Hugging Face Llama folder: ``config.json`` and ``model.safetensors``
    with (out, in) weights in the parameters' dtype (a tied model has no ``lm_head.weight``).
    Returns the folder; :func:`load_hf_llama` reads it back."""
    from safetensors.numpy import save_file  # the ``text`` extra

    if not isinstance(model, LlamaLM):
        raise TypeError(f"save_hf_llama needs a LlamaLM, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    flat = _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tensors = {}
    for name, (path, transpose) in hf_llama_names(model.config).items():
        arr = np.asarray(flat[path])
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    dtype = flat[("embed", "embedding")].dtype
    (directory / "config.json").write_text(json.dumps(_config_to_hf(model.config, dtype),
                                                      indent=2) + "\n")
    return directory
