"""A Llama-family causal language model in Flax NNX.

Architecture (Llama 2/3, SmolLM, Mistral without sliding windows): token embedding, ``L`` pre-norm
blocks of grouped-query self-attention with rotary position embeddings and a SwiGLU feed-forward
network, a final RMSNorm and an output layer that is tied to the embedding or separate. No biases.

Layout of the parameters (paths as :func:`pavejax.lora.select_paths` prints them)::

    embed/embedding                       (vocab, hidden)
    layers/{i}/attn_norm/scale            (hidden,)
    layers/{i}/attn/{q,k,v,o}/kernel      (hidden, heads*head_dim) ... (heads*head_dim, hidden)
    layers/{i}/mlp_norm/scale             (hidden,)
    layers/{i}/mlp/{gate,up,down}/kernel  (hidden, ffn), (hidden, ffn), (ffn, hidden)
    norm/scale                            (hidden,)
    lm_head/kernel                        (hidden, vocab), only when the output is untied

Kernels are ``(d_in, d_out)`` and a layer computes ``x @ W`` (Hugging Face and GGUF store
``(d_out, d_in)``; the loaders transpose). Rotary embeddings use the half-split layout of the
Hugging Face Llama code (``rotate_half``); the GGUF loader un-permutes q/k, which GGUF stores for
the interleaved layout.

Padding. ``attention_mask`` marks real tokens. Positions are counted over real tokens only
(``cumsum(mask) - 1``), so left padding (what batched generation uses) and right padding (what
scoring uses) both give every sequence the positions it would have alone; padded keys are masked.

Precision. Weights may be bfloat16: matmuls run in the weights' dtype, while RMSNorm statistics,
attention softmax and the logits are float32.

Decoding. :meth:`LlamaLM.forward_cached` runs new tokens against a static-shape key/value cache
(:class:`pavejax.models.KVCache`); :func:`pavejax.models.generate` builds greedy and sampled
generation on it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pavejax.lora import LoraAdapters
from pavejax.models import _init

Array = jax.Array

__all__ = [
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLM",
    "LlamaMLP",
    "RMSNorm",
    "apply_rope",
    "causal_mask",
    "positions_from_mask",
    "rope_tables",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of a Llama-family decoder.

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes (FFN width is
        ``intermediate_size``).
      num_heads: query heads; num_kv_heads: key/value heads (grouped-query attention; it must
        divide ``num_heads``; equal to it for plain multi-head attention).
      head_dim: per-head width; default ``hidden_size // num_heads``.
      rope_theta: rotary base frequency; rms_norm_eps: RMSNorm epsilon.
      tie_embeddings: output layer = embedding transposed (no ``lm_head`` parameter).
      max_position: longest sequence the model accepts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position: int = 2048

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                             f"({self.num_heads}) for grouped-query attention")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_heads "
                             f"({self.num_heads}); pass head_dim explicitly")
        if self.dim_per_head % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got "
                             f"{self.dim_per_head}")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ValueError("rope_theta and rms_norm_eps must be positive, got "
                             f"{self.rope_theta} and {self.rms_norm_eps}")

    @property
    def dim_per_head(self) -> int:
        """``head_dim``, or ``hidden_size // num_heads`` when unset."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A small random-weights configuration for tests (GQA with 2 query heads per key/value
        head, 2 layers, vocabulary 97); keyword arguments override fields."""
        fields = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, rope_theta=10000.0, max_position=128)
        fields.update(overrides)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (for release metadata)."""
        return dataclasses.asdict(self)


# --- building blocks ---------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale``, statistics in float32; returns ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * inv * scale).astype(x.dtype)


def rope_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """cos and sin of the rotary angles: (...,) int positions -> two (..., head_dim // 2) float32.

    Angle ``p * theta ** (-2 i / head_dim)`` for frequency ``i`` (the Llama convention)."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    positions = jnp.asarray(positions)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.reshape(
        (1,) * positions.ndim + (-1,))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate ``x`` (B, T, H, D) by the half-split rotary embedding; ``cos``/``sin`` (B, T, D/2).

    Pairs are ``(x[..., i], x[..., i + D/2])`` (Hugging Face ``rotate_half``). Computed in float32,
    returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def positions_from_mask(attention_mask: Array) -> Array:
    """Per-token positions counted over real tokens: (B, T) mask -> (B, T) int32 (padded slots get
    the position of the previous real token, or 0)."""
    m = (jnp.asarray(attention_mask) != 0).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def causal_mask(attention_mask: Array) -> Array:
    """(B, T) real-token mask -> (B, T, T) bool: query ``i`` sees key ``j`` iff ``j <= i`` and ``j``
    is real. A padded query row still sees its earlier real keys (finite outputs, ignored)."""
    m = jnp.asarray(attention_mask) != 0
    t = m.shape[-1]
    tri = jnp.tril(jnp.ones((t, t), bool))
    return tri[None] & m[:, None, :]


def _linear(d_in: int, d_out: int, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=None, param_dtype=param_dtype,
                      kernel_init=_init.normal(0.02), rngs=rngs)


def _project(layer: nnx.Linear, x: Array, lora: LoraAdapters | None, name: str) -> Array:
    """``x @ kernel`` in the kernel's dtype, plus the factored LoRA term at ``name/kernel``."""
    kernel = layer.kernel[...]
    y = jnp.matmul(x.astype(kernel.dtype), kernel)
    path = f"{name}/kernel"
    if lora is None or path not in lora:
        return y
    return y + lora.update(path, x.astype(y.dtype))


def _attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Grouped-query attention. q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D), mask (B, Tq, Tk) bool ->
    (B, Tq, Hq * D). Scores and softmax in float32; a fully masked row gives a uniform average
    (finite), never NaN."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores / math.sqrt(d)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32))
    return out.reshape(b, tq, hq * d).astype(q.dtype)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings (projections ``q, k, v, o``)."""

    def __init__(self, cfg: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.dim_per_head
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.rope_theta = cfg.rope_theta
        self.q = _linear(d, cfg.num_heads * hd, param_dtype, rngs)
        self.k = _linear(d, cfg.num_kv_heads * hd, param_dtype, rngs)
        self.v = _linear(d, cfg.num_kv_heads * hd, param_dtype, rngs)
        self.o = _linear(cfg.num_heads * hd, d, param_dtype, rngs)

    def queries(self, x: Array, positions: Array, lora: LoraAdapters | None = None) -> Array:
        """Rotated queries: x (B, T, hidden), positions (B, T) -> (B, T, heads, head_dim)."""
        b, t, _ = x.shape
        q = _project(self.q, x, lora, "q").reshape(b, t, self.num_heads, self.head_dim)
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta)
        return apply_rope(q, cos, sin)

    def keys_values(self, x: Array, positions: Array,
                    lora: LoraAdapters | None = None) -> tuple[Array, Array]:
        """Rotated keys and values: x (B, T, hidden) -> two (B, T, kv_heads, head_dim)."""
        b, t, _ = x.shape
        k = _project(self.k, x, lora, "k").reshape(b, t, self.num_kv_heads, self.head_dim)
        v = _project(self.v, x, lora, "v").reshape(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta)
        return apply_rope(k, cos, sin), v

    def output(self, context: Array, lora: LoraAdapters | None = None) -> Array:
        """Output projection: (B, T, heads * head_dim) -> (B, T, hidden)."""
        return _project(self.o, context, lora, "o")


class LlamaMLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = _linear(d, f, param_dtype, rngs)
        self.up = _linear(d, f, param_dtype, rngs)
        self.down = _linear(f, d, param_dtype, rngs)

    def __call__(self, x: Array, lora: LoraAdapters | None = None) -> Array:
        """(..., hidden) -> (..., hidden)."""
        g = _project(self.gate, x, lora, "gate")
        u = _project(self.up, x, lora, "up")
        return _project(self.down, jax.nn.silu(g) * u, lora, "down")


class LlamaBlock(nnx.Module):
    """One pre-norm decoder block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = LlamaAttention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = LlamaMLP(cfg, param_dtype=param_dtype, rngs=rngs)

    def attention(self, h: Array, positions: Array, mask: Array, *,
                  lora: LoraAdapters | None = None, query_index: Array | None = None) -> Array:
        """The attention half, residual included: ``h + attn(norm(h))`` (arguments as
        :meth:`__call__`; ``lora`` paths relative to this block). Returns (B, Tq, hidden)."""
        attn_lora = None if lora is None else lora.under("attn")
        x = self.attn_norm(h)
        k, v = self.attn.keys_values(x, positions, attn_lora)
        if query_index is None:
            hq, xq, pq = h, x, positions
        else:
            idx = query_index[..., None]
            hq = jnp.take_along_axis(h, idx, axis=1)
            xq = jnp.take_along_axis(x, idx, axis=1)
            pq = jnp.take_along_axis(positions, query_index, axis=1)
        q = self.attn.queries(xq, pq, attn_lora)
        return hq + self.attn.output(_attend(q, k, v, mask), attn_lora)

    def feed_forward(self, h: Array, *, lora: LoraAdapters | None = None) -> Array:
        """The feed-forward half, residual included: ``h + mlp(norm(h))``; (..., hidden)."""
        return h + self.mlp(self.mlp_norm(h), None if lora is None else lora.under("mlp"))

    def __call__(self, h: Array, positions: Array, mask: Array, *,
                 lora: LoraAdapters | None = None, query_index: Array | None = None) -> Array:
        """One block: :meth:`attention` then :meth:`feed_forward`.

        Args:
          h: (B, T, hidden) input hidden states.
          positions: (B, T) int rotary positions.
          mask: (B, Tq, T) bool, query ``i`` may attend key ``j`` (:func:`causal_mask`).
          lora: factored adapters with paths relative to this block (``"attn/q/kernel"``).
          query_index: optional (B, Tq) int; compute the outputs only at these positions
            (keys and values still come from all ``T``). Default: every position (Tq = T).

        Returns:
          (B, Tq, hidden) output hidden states.
        """
        h = self.attention(h, positions, mask, lora=lora, query_index=query_index)
        return self.feed_forward(h, lora=lora)


_BLOCK_DENSES = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")


def _check_ids(ids: Any, cfg: LlamaConfig) -> None:
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"input_ids must be an integer array (token ids), got dtype {dtype}; "
                        "convert with .astype(jnp.int32) after tokenization")
    if ids.ndim not in (1, 2):
        raise ValueError(f"input_ids must have shape (B, T) or (T,), got {tuple(ids.shape)}")
    if ids.shape[-1] > cfg.max_position:
        raise ValueError(f"sequence length {ids.shape[-1]} exceeds max_position "
                         f"{cfg.max_position}; truncate the prompt")


class LlamaLM(nnx.Module):
    """Llama-family causal LM returning float32 next-token logits.

    ``model(input_ids, attention_mask)`` with (B, T) or (T,) ids gives (B, T, vocab) or
    (T, vocab) logits; the single-example form makes it ``jax.vmap``-able over examples
    (per-example gradients). The pieces (:meth:`embed_tokens`, :meth:`run_layers`,
    :meth:`logits`) let a caller cache the frozen lower layers and run only the top ones.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
        if not jnp.issubdtype(param_dtype, jnp.floating):
            raise TypeError(f"param_dtype must be a floating dtype, got {param_dtype}")
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, param_dtype=param_dtype,
                               embedding_init=_init.normal(0.02), rngs=rngs)
        self.layers = nnx.List([LlamaBlock(config, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        if not config.tie_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, param_dtype, rngs)

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """Paths (relative to the model) of the kernels factored LoRA can adapt, each with its
        ``(d_in, d_out)``: q/k/v/o and gate/up/down of every block."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name in _BLOCK_DENSES:
                module = layer
                for part in name.split("/"):
                    module = getattr(module, part)
                d_in, d_out = module.kernel.shape
                out[f"layers/{i}/{name}/kernel"] = (int(d_in), int(d_out))
        return out

    def embed_tokens(self, input_ids: Array) -> Array:
        """(B, T) ids -> (B, T, hidden) embeddings in the weights' dtype."""
        return jnp.take(self.embed.embedding[...], input_ids, axis=0)

    def run_layers(self, h: Array, positions: Array, mask: Array, *, start: int = 0,
                   stop: int | None = None, lora: LoraAdapters | None = None,
                   query_index: Array | None = None) -> Array:
        """Blocks ``start .. stop - 1`` on hidden states ``h`` (B, T, hidden).

        ``mask`` is the (B, T, T) :func:`causal_mask`. ``lora`` paths are relative to the model
        (``"layers/3/attn/q/kernel"``). ``query_index`` (B, Tq) restricts the LAST block run to
        those positions (see :meth:`LlamaBlock.__call__`; its mask rows are taken from ``mask``);
        then the output is (B, Tq, hidden)."""
        stop = self.config.num_layers if stop is None else stop
        if not 0 <= start <= stop <= self.config.num_layers:
            raise ValueError(f"need 0 <= start <= stop <= {self.config.num_layers}, got "
                             f"start={start}, stop={stop}")
        t = h.shape[1]
        if tuple(mask.shape[1:]) != (t, t):
            raise ValueError(f"mask must be the (B, T, T) causal_mask of the {t} positions of h, "
                             f"got shape {tuple(mask.shape)}")
        for i in range(start, stop):
            layer_lora = None if lora is None else lora.under(f"layers/{i}")
            if i == stop - 1 and query_index is not None:
                rows = jnp.take_along_axis(mask, query_index[..., None], axis=1)
                return self.layers[i](h, positions, rows, lora=layer_lora,
                                      query_index=query_index)
            h = self.layers[i](h, positions, mask, lora=layer_lora)
        return h

    def output_matrix(self) -> Array:
        """The (hidden, vocab) output matrix: the embedding transposed when tied."""
        if self.config.tie_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, h: Array, *, rows: Array | None = None) -> Array:
        """Final RMSNorm and output layer: (..., hidden) -> (..., vocab) float32 logits, or only
        the vocabulary ``rows`` (K,) ids -> (..., K) (e.g. the candidate tokens of a prompt)."""
        w = self.output_matrix()
        if rows is not None:
            w = jnp.take(w, rows, axis=1)
        x = self.norm(h)
        return jnp.matmul(x.astype(w.dtype), w).astype(jnp.float32)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 positions: Array | None = None, lora: LoraAdapters | None = None) -> Array:
        """Next-token logits.

        Args:
          input_ids: (B, T) or (T,) integer ids.
          attention_mask: same shape, nonzero on real tokens (left or right padding). Default:
            all real.
          positions: optional (B, T) rotary positions; default :func:`positions_from_mask`.
          lora: optional :class:`pavejax.lora.LoraAdapters` applied factored (paths from
            :meth:`lora_targets`); equal to running the ``apply_lora``-merged params.

        Returns:
          (B, T, vocab) or (T, vocab) float32 logits; row ``t`` scores token ``t + 1``. Padded
          positions hold finite values that callers must mask.
        """
        _check_ids(input_ids, self.config)
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if tuple(jnp.shape(attention_mask)) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}, got {tuple(jnp.shape(attention_mask))}")
        single = input_ids.ndim == 1
        if single:
            input_ids, attention_mask = input_ids[None], jnp.asarray(attention_mask)[None]
            positions = None if positions is None else jnp.asarray(positions)[None]
        if lora is not None:
            lora.check_targets(self.lora_targets(), "LlamaLM")
        if positions is None:
            positions = positions_from_mask(attention_mask)
        h = self.embed_tokens(input_ids)
        h = self.run_layers(h, positions, causal_mask(attention_mask), lora=lora)
        out = self.logits(h)
        return out[0] if single else out

    def forward_cached(self, input_ids: Array, attention_mask: Array, cache: Any, *,
                       lora: LoraAdapters | None = None) -> tuple[Array, Any]:
        """Next-token logits of ``T`` new tokens that attend to a key/value cache.

        The new tokens go into cache slots ``cache.length .. cache.length + T - 1`` of every row
        (one slot index for the whole batch; static shapes). A real token's rotary position is
        ``cache.next_position`` plus its rank among the row's new real tokens, so padding (left
        or right, in the prompt or later) never shifts positions. Query slot ``s`` attends to the
        valid slots ``<= s``. Used for the prompt (prefill, ``T`` = prompt length) and for
        one-token decoding (``T = 1``); jit it with the cache donated so the update is in place.

        Args:
          input_ids: (B, T) integer ids.
          attention_mask: (B, T), nonzero on real tokens; a padded slot is never attended to.
          cache: a :class:`pavejax.models.KVCache` of this model's shape (from
            :func:`pavejax.models.init_cache`) with room for ``T`` more slots.
          lora: optional factored adapters, as in :meth:`__call__`.

        Returns:
          ``(logits, cache)``: (B, T, vocab) float32 logits (row ``t`` scores the token after
          ``t``; padded rows hold finite values to ignore) and the cache with the ``T`` slots
          written, ``length`` advanced by ``T`` and ``next_position`` by each row's real count.

        Sharp edge: ``cache.length`` is traced, so writing past the cache's capacity cannot be
        detected; ``jax.lax.dynamic_update_slice`` would then clamp the write onto the last
        slots. Size the cache for the prompt plus every decoding step.
        """
        _check_ids(input_ids, self.config)
        if input_ids.ndim != 2:
            raise ValueError(f"forward_cached takes (B, T) input_ids, got shape "
                             f"{tuple(input_ids.shape)}; add a batch axis with ids[None]")
        if tuple(jnp.shape(attention_mask)) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}, got {tuple(jnp.shape(attention_mask))}")
        cfg = self.config
        b, t = input_ids.shape
        size = cache.k.shape[2]
        want = (cfg.num_layers, b, size, cfg.num_kv_heads, cfg.dim_per_head)
        if tuple(cache.k.shape) != want or tuple(cache.v.shape) != want:
            raise ValueError(f"cache keys/values must have shape (layers, batch, slots, kv_heads, "
                             f"head_dim) = {want}, got {tuple(cache.k.shape)}; build the cache "
                             f"with init_cache(model, batch={b}, ...)")
        if t > size:
            raise ValueError(f"{t} new tokens do not fit a cache of {size} slots; build a larger "
                             f"cache with init_cache")
        if lora is not None:
            lora.check_targets(self.lora_targets(), "LlamaLM")
        real = jnp.asarray(attention_mask) != 0
        counts = jnp.cumsum(real.astype(jnp.int32), axis=1)
        positions = jnp.maximum(cache.next_position[:, None] + counts - 1, 0)
        start = jnp.asarray(cache.length, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        valid = jax.lax.dynamic_update_slice(cache.valid, real, (zero, start))
        query_slot = start + jnp.arange(t, dtype=jnp.int32)
        mask = valid[:, None, :] & (jnp.arange(size, dtype=jnp.int32)[None, :]
                                    <= query_slot[:, None])[None]
        keys, values = cache.k, cache.v
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            layer_lora = None if lora is None else lora.under(f"layers/{i}")
            attn_lora = None if layer_lora is None else layer_lora.under("attn")
            x = layer.attn_norm(h)
            k, v = layer.attn.keys_values(x, positions, attn_lora)
            at = (jnp.asarray(i, jnp.int32), zero, start, zero, zero)
            keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), at)
            values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), at)
            q = layer.attn.queries(x, positions, attn_lora)
            h = h + layer.attn.output(_attend(q, keys[i], values[i], mask), attn_lora)
            h = layer.feed_forward(h, lora=layer_lora)
        new_cache = cache._replace(k=keys, v=values, valid=valid, length=start + t,
                                   next_position=cache.next_position + counts[:, -1])
        return self.logits(h), new_cache
