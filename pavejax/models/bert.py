"""A BERT encoder in Flax NNX that runs the Hugging Face BERT checkpoints (e.g. all-MiniLM-L6-v2).

The module is deterministic (no dropout) and post-LN, exactly like the original BERT.

Parameter naming. Attribute paths mirror the Hugging Face names so that a state dict maps onto
the module one to one (``pavejax.models.loading.bert_torch_names`` builds the table). With
``L = encoder.layer.i`` on the torch side and ``l = layers/i`` on the NNX side:

    embeddings.word_embeddings.weight        -> embeddings/word/embedding
    embeddings.position_embeddings.weight    -> embeddings/position/embedding
    embeddings.token_type_embeddings.weight  -> embeddings/token_type/embedding
    embeddings.LayerNorm.{weight,bias}       -> embeddings/norm/{scale,bias}
    L.attention.self.query.{weight,bias}     -> l/attention/query/{kernel (T),bias}
        (the same for key and value)
    L.attention.output.dense.{weight,bias}   -> l/attention/output/{kernel (T),bias}
    L.attention.output.LayerNorm.*           -> l/attention/norm/{scale,bias}
    L.intermediate.dense.*                   -> l/intermediate/{kernel (T),bias}
    L.output.dense.*                         -> l/output/{kernel (T),bias}
    L.output.LayerNorm.*                     -> l/norm/{scale,bias}
    pooler.dense.*                           -> pooler/{kernel (T),bias}

(T): torch ``Linear`` stores ``weight`` as (out, in); Flax kernels are (in, out), so these are
transposed on load. LoRA selects e.g. ``layers/*/attention/query/kernel`` by these paths.

LoRA, two ways. Merged: run the module with ``pavejax.lora.apply_lora`` params. Factored: pass
``lora=pavejax.lora.LoraAdapters(B, A, config)`` to the call (paths relative to the encoder,
any dense kernel inside ``layers``); each adapted projection then adds ``(x A) B`` to its
output. Same function; the factored form makes per-example gradients of ``B`` rank-r products
(see ``LoraAdapters``), which is what DP-SGD with LoRA wants.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pavejax.lora import LoraAdapters
from pavejax.models import _init

__all__ = ["BertConfig", "BertEncoder", "gelu", "l2_normalize", "mean_pool", "sentence_embedding"]

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture of a BERT encoder; defaults are all-MiniLM-L6-v2 (6 x 384, 12 heads)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BertConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}); change one of them"
            )
        if not self.layer_norm_eps > 0:
            raise ValueError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"BertConfig.pad_token_id ({self.pad_token_id}) must lie in [0, vocab_size)"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, hidden_size // num_heads."""
        return self.hidden_size // self.num_heads

    @classmethod
    def tiny(cls) -> BertConfig:
        """A 2-layer, hidden-32 configuration for fast tests (random init only)."""
        return cls(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                   intermediate_size=64, max_position=64)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BertConfig:
        """Build from a Hugging Face ``config.json`` dictionary; refuses unsupported variants."""
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"expected model_type 'bert' in the config, got {raw['model_type']!r}")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(
                f"only hidden_act='gelu' (exact erf GELU) is supported, got {raw['hidden_act']!r}"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only position_embedding_type='absolute' is supported, got "
                             f"{raw['position_embedding_type']!r}")
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=raw["num_attention_heads"],
                intermediate_size=raw["intermediate_size"],
                max_position=raw["max_position_embeddings"],
                type_vocab_size=raw.get("type_vocab_size", 2),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                pad_token_id=raw.get("pad_token_id", 0),
            )
        except KeyError as err:
            raise ValueError(f"BERT config is missing the field {err.args[0]!r}") from err

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> BertConfig:
        """Read a Hugging Face ``config.json`` file."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


def gelu(x: Array) -> Array:
    """Exact GELU, ``0.5 x (1 + erf(x / sqrt(2)))`` (BERT's "gelu"; not the tanh approximation)."""
    return jax.nn.gelu(x, approximate=False)


def _layer_norm(cfg: BertConfig, param_dtype: Any, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Two-pass variance: with eps=1e-12 the fast E[x^2]-E[x]^2 form loses digits vs. torch.
    return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, dtype=jnp.float32,
                         param_dtype=param_dtype, use_fast_variance=False, rngs=rngs)


def _dense(d_in: int, d_out: int, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, dtype=jnp.float32, param_dtype=param_dtype,
                      kernel_init=_init.normal(0.02), rngs=rngs)  # BERT's initializer_range


def _project(layer: nnx.Linear, x: Array, lora: LoraAdapters | None, name: str) -> Array:
    """``layer(x)``, plus the factored LoRA term when ``lora`` adapts ``name + "/kernel"``."""
    y = layer(x)
    path = f"{name}/kernel"
    if lora is None or path not in lora:
        return y
    return y + lora.update(path, x.astype(y.dtype))


_LAYER_DENSES = ("attention/query", "attention/key", "attention/value", "attention/output",
                 "intermediate", "output")


class BertEmbeddings(nnx.Module):
    """Word + position + token-type embeddings followed by LayerNorm."""

    def __init__(self, cfg: BertConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        def embed(n: int) -> nnx.Embed:
            return nnx.Embed(n, cfg.hidden_size, dtype=jnp.float32, param_dtype=param_dtype,
                             embedding_init=_init.normal(0.02), rngs=rngs)

        self.word = embed(cfg.vocab_size)
        self.position = embed(cfg.max_position)
        self.token_type = embed(cfg.type_vocab_size)
        self.norm = _layer_norm(cfg, param_dtype, rngs)

    def __call__(self, input_ids: Array, token_type_ids: Array) -> Array:
        """(B, T) int ids -> (B, T, H) float32."""
        positions = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)
        h = self.word(input_ids) + self.token_type(token_type_ids)
        return self.norm(h + self.position(positions)[None, :, :])


class BertSelfAttention(nnx.Module):
    """Multi-head self-attention with its output projection and post-LayerNorm."""

    def __init__(self, cfg: BertConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.query = _dense(h, h, param_dtype, rngs)
        self.key = _dense(h, h, param_dtype, rngs)
        self.value = _dense(h, h, param_dtype, rngs)
        self.output = _dense(h, h, param_dtype, rngs)
        self.norm = _layer_norm(cfg, param_dtype, rngs)

    def _heads(self, x: Array) -> Array:
        b, t, d = x.shape
        return x.reshape(b, t, self.num_heads, d // self.num_heads)

    def __call__(self, h: Array, key_mask: Array, lora: LoraAdapters | None = None) -> Array:
        """``h``: (B, T, H) float32; ``key_mask``: (B, T) bool, False on padded keys; ``lora``:
        factored adapters with paths relative to this module (e.g. ``"query/kernel"``)."""
        q, k, v = (self._heads(_project(getattr(self, n), h, lora, n))
                   for n in ("query", "key", "value"))
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * scale
        # Finite fill (not -inf): a fully padded row stays a uniform softmax instead of NaN.
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        context = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(h.shape)
        return self.norm(h + _project(self.output, context, lora, "output"))


class BertLayer(nnx.Module):
    """One post-LN transformer block: attention, then erf-GELU feed-forward."""

    def __init__(self, cfg: BertConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        self.attention = BertSelfAttention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.intermediate = _dense(cfg.hidden_size, cfg.intermediate_size, param_dtype, rngs)
        self.output = _dense(cfg.intermediate_size, cfg.hidden_size, param_dtype, rngs)
        self.norm = _layer_norm(cfg, param_dtype, rngs)

    def __call__(self, h: Array, key_mask: Array, lora: LoraAdapters | None = None) -> Array:
        """(B, T, H) float32, (B, T) bool key mask -> (B, T, H) float32; ``lora``: factored
        adapters with paths relative to this layer (e.g. ``"attention/query/kernel"``)."""
        h = self.attention(h, key_mask, None if lora is None else lora.under("attention"))
        ff = gelu(_project(self.intermediate, h, lora, "intermediate"))
        return self.norm(h + _project(self.output, ff, lora, "output"))


def _check_ids(name: str, ids: Any) -> None:
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{name} must be an integer array (token ids), got dtype {dtype}; "
            "convert with .astype(jnp.int32) after tokenization"
        )


class BertEncoder(nnx.Module):
    """BERT encoder returning the last hidden state.

    Call with ``input_ids`` of shape (B, T) or a single example (T,); the output is (B, T, H) or
    (T, H) float32. The single-example form makes the model ``jax.vmap``-able over examples
    (per-example gradients). Computation runs in float32 whatever ``param_dtype`` is.
    """

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
        if not jnp.issubdtype(param_dtype, jnp.floating):
            raise TypeError(f"param_dtype must be a floating dtype, got {param_dtype}")
        self.config = config
        self.embeddings = BertEmbeddings(config, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([BertLayer(config, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.pooler = _dense(config.hidden_size, config.hidden_size, param_dtype, rngs)

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """Paths (relative to the encoder) of the kernels that factored LoRA can adapt, each
        with its ``(d_in, d_out)``: every dense kernel inside ``layers`` (not the embeddings,
        not the pooler)."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name in _LAYER_DENSES:
                module = layer
                for part in name.split("/"):
                    module = getattr(module, part)
                d_in, d_out = module.kernel.shape
                out[f"layers/{i}/{name}/kernel"] = (int(d_in), int(d_out))
        return out

    def __call__(self, input_ids: Array, attention_mask: Array | None = None,
                 token_type_ids: Array | None = None, *,
                 lora: LoraAdapters | None = None) -> Array:
        """Last hidden state.

        Args:
          input_ids: (B, T) or (T,) integer token ids, T <= ``config.max_position``.
          attention_mask: same shape; nonzero/True for real tokens, 0 for padding. Default: all 1.
          token_type_ids: same shape, integer segment ids. Default: all 0.
          lora: optional :class:`pavejax.lora.LoraAdapters` applied factored at its paths
            (relative to the encoder, e.g. ``"layers/0/attention/query/kernel"``; see
            :meth:`lora_targets`). Equal to running the ``apply_lora``-merged params.

        Returns:
          (B, T, H) or (T, H) float32 hidden states. Padded positions hold finite values that
          callers must mask (``mean_pool`` does).
        """
        _check_ids("input_ids", input_ids)
        if input_ids.ndim not in (1, 2):
            raise ValueError(
                f"input_ids must have shape (B, T) or (T,), got {tuple(input_ids.shape)}"
            )
        if input_ids.shape[-1] > self.config.max_position:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds max_position "
                f"{self.config.max_position}; tokenize with a smaller max_length"
            )
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if token_type_ids is None:
            token_type_ids = jnp.zeros(input_ids.shape, jnp.int32)
        _check_ids("token_type_ids", token_type_ids)
        for name, arr in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if tuple(arr.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(arr.shape)}"
                )
        single = input_ids.ndim == 1
        if single:
            input_ids, attention_mask, token_type_ids = (
                input_ids[None], attention_mask[None], token_type_ids[None])
        if lora is not None:
            lora.check_targets(self.lora_targets(), "BertEncoder")
        key_mask = jnp.asarray(attention_mask) != 0
        h = self.embeddings(input_ids, token_type_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, key_mask, None if lora is None else lora.under(f"layers/{i}"))
        return h[0] if single else h

    def pooled_cls(self, hidden: Array) -> Array:
        """BERT's pooler: tanh(dense(hidden[..., 0, :])); (..., T, H) -> (..., H) float32."""
        return jnp.tanh(self.pooler(hidden[..., 0, :]))


def mean_pool(hidden: Array, mask: Array) -> Array:
    """Masked mean over tokens: (..., T, H), (..., T) -> (..., H) float32.

    Matches sentence-transformers' mean pooling (token count clamped at 1e-9, so an all-padding
    row gives zeros rather than NaN).
    """
    if tuple(mask.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    weights = (jnp.asarray(mask) != 0).astype(jnp.float32)
    total = jnp.sum(hidden.astype(jnp.float32) * weights[..., None], axis=-2)
    count = jnp.maximum(jnp.sum(weights, axis=-1), 1e-9)
    return total / count[..., None]


def l2_normalize(x: Array, axis: int = -1, eps: float = 1e-12) -> Array:
    """``x / max(||x||_2, eps)`` along ``axis`` (torch ``F.normalize`` semantics)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, eps)


def sentence_embedding(model: BertEncoder, input_ids: Array, attention_mask: Array,
                       token_type_ids: Array | None = None) -> Array:
    """Mean-pooled, L2-normalised sentence embedding (all-MiniLM-L6-v2 recipe): (B, T) -> (B, H)."""
    hidden = model(input_ids, attention_mask, token_type_ids)
    return l2_normalize(mean_pool(hidden, attention_mask))
