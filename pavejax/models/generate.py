"""Batched greedy and sampled decoding of a :class:`~pavejax.models.llama.LlamaLM` with a
key/value cache and static shapes.

The cache (:class:`KVCache`) is a pytree of fixed shape: every layer's rotated keys and values for
``S`` slots, which slots hold real tokens, the next slot to write and each row's next rotary
position. :meth:`LlamaLM.forward_cached <pavejax.models.llama.LlamaLM.forward_cached>` runs new
tokens against it and writes their slots. :func:`generate` fills it with the prompt once (prefill)
and then decodes one token per step inside a ``jax.lax.while_loop`` that stops as soon as every
row has produced a stop token, so the whole of it jits, and a jitted generation compiles once per
(batch, prompt length, ``max_new_tokens``) whatever the prompts and the outputs.

Padding. Prompts are normally LEFT-padded (every row's last slot is a real token), the layout of
batched generation. Positions are counted over real tokens and padded slots are never attended
to, and each row continues from its last real token, so a right-padded row generates exactly what
it would generate unpadded too; only a row without any real token is an error.

Tokens only: turning text into ids and back is the tokenizer's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax.lora import LoraAdapters
from pavejax.models.llama import LlamaConfig, LlamaLM

Array = jax.Array

__all__ = ["Generation", "KVCache", "generate", "init_cache"]


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far (a pytree of static shape).

    Attributes:
      k, v: (num_layers, B, S, kv_heads, head_dim) rotated keys and values, weights' dtype.
      valid: (B, S) bool, the slot holds a real token (written and not padding).
      length: int32 scalar, the next slot to write (the same for every row).
      next_position: (B,) int32, the rotary position of each row's next real token.
    """

    k: Array
    v: Array
    valid: Array
    length: Array
    next_position: Array


class Generation(NamedTuple):
    """Output of :func:`generate`.

    Attributes:
      tokens: (B, max_new_tokens) int32 generated ids; after a row's stop token the rest of the
        row is ``pad_id``.
      lengths: (B,) int32 number of generated tokens of each row, its stop token included
        (``max_new_tokens`` for a row that never stopped); ``tokens[b, :lengths[b]]`` is the
        output of row ``b``.
      finished: (B,) bool, the row ended with one of the stop tokens.
    """

    tokens: Array
    lengths: Array
    finished: Array


def init_cache(model_or_config: LlamaLM | LlamaConfig, batch: int, max_length: int,
               dtype: Any = None) -> KVCache:
    """An empty cache with ``max_length`` slots for ``batch`` rows.

    Args:
      model_or_config: the :class:`LlamaLM` (or its :class:`LlamaConfig`) that will use it.
      batch: number of rows ``B``.
      max_length: slots ``S``: the prompt length plus the tokens to decode after it. At most the
        config's ``max_position``.
      dtype: dtype of keys and values; default the model's weights' dtype (float32 for a config).

    Returns:
      A :class:`KVCache` of zeros with no valid slot, ``length`` 0 and ``next_position`` 0.
    """
    if isinstance(model_or_config, LlamaLM):
        cfg = model_or_config.config
        default = model_or_config.embed.embedding[...].dtype
    elif isinstance(model_or_config, LlamaConfig):
        cfg, default = model_or_config, jnp.float32
    else:
        raise TypeError(f"init_cache takes a LlamaLM or a LlamaConfig, got "
                        f"{type(model_or_config).__name__}")
    for name, value in (("batch", batch), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_length > cfg.max_position:
        raise ValueError(f"max_length {max_length} exceeds the model's max_position "
                         f"{cfg.max_position}; shorten the prompt or decode fewer tokens")
    dtype = default if dtype is None else dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    shape = (cfg.num_layers, batch, max_length, cfg.num_kv_heads, cfg.dim_per_head)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, max_length), bool),
                   length=jnp.zeros((), jnp.int32),
                   next_position=jnp.zeros((batch,), jnp.int32))


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low or (
            high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _check_generate(model: Any, input_ids: Any, attention_mask: Any, max_new_tokens: int,
                    stop_tokens: Sequence[int], pad_id: int, temperature: float,
                    top_k: int | None, key: Any) -> None:
    if not isinstance(model, LlamaLM):
        raise TypeError(f"generate takes a LlamaLM, got {type(model).__name__}")
    cfg = model.config
    dtype = getattr(input_ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or input_ids.ndim != 2:
        raise TypeError(f"input_ids must be a (B, T) integer array, got "
                        f"{getattr(input_ids, 'shape', None)} of dtype {dtype}")
    if tuple(jnp.shape(attention_mask)) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {tuple(jnp.shape(attention_mask))}")
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("pad_id", pad_id, 0, cfg.vocab_size - 1)
    if not isinstance(stop_tokens, tuple):
        raise TypeError(f"stop_tokens must be a tuple of ids (hashable, so that it can be a "
                        f"static argument of jax.jit), got {type(stop_tokens).__name__}")
    for tok in stop_tokens:
        _check_int("every stop token", tok, 0, cfg.vocab_size - 1)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite Python number >= 0 (0 = greedy), got "
                         f"{temperature!r}; under jax.jit make it a static argument")
    if top_k is not None:
        _check_int("top_k", top_k, 1, cfg.vocab_size)
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass key=jax.random.key(0)"
                         " or use temperature=0 for greedy decoding")
    total = input_ids.shape[1] + max_new_tokens - 1
    if total > cfg.max_position:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens "
                         f"{max_new_tokens} - 1 = {total} exceeds max_position "
                         f"{cfg.max_position}; shorten the prompt or decode fewer tokens")
    if not isinstance(attention_mask, jax.core.Tracer):
        empty = np.flatnonzero(~np.any(np.asarray(attention_mask) != 0, axis=1))
        if empty.size:
            raise ValueError(f"rows {empty.tolist()} of attention_mask have no real token; "
                             "every row needs a prompt of at least one token")


def _chooser(temperature: float, top_k: int | None, key: Any):
    """``choose(logits (B, V) float32, step) -> (B,) int32``: argmax, or a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest, keyed by ``step``."""
    if temperature == 0:
        return lambda logits, step: jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def choose(logits, step):
        scaled = logits / jnp.float32(temperature)
        if top_k is not None:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
        draw = jax.random.categorical(jax.random.fold_in(key, step), scaled, axis=-1)
        return draw.astype(jnp.int32)

    return choose


def generate(model: LlamaLM, input_ids: Array, attention_mask: Array, *, max_new_tokens: int,
             stop_tokens: tuple[int, ...] = (), pad_id: int, temperature: float = 0.0,
             top_k: int | None = None, key: Array | None = None,
             lora: LoraAdapters | None = None) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens, greedily or by sampling.

    One prefill of the prompts into a :class:`KVCache` of ``T + max_new_tokens - 1`` slots, then
    one-token steps in a ``jax.lax.while_loop`` that ends early once every row has emitted a stop
    token. Shapes are static, so it jits (``max_new_tokens``, ``stop_tokens``, ``pad_id``,
    ``temperature`` and ``top_k`` static) and runs inside the caller's own jitted function.

    Args:
      model: the :class:`LlamaLM`.
      input_ids: (B, T) integer prompt ids, normally left-padded (see the module docstring).
      attention_mask: (B, T), nonzero on real tokens; every row needs at least one.
      max_new_tokens: number of tokens to generate at most (``N``).
      stop_tokens: tuple of ids that end a row (e.g. the end-of-sequence id); the stop token is
        part of the output. Empty: every row runs ``N`` tokens.
      pad_id: id written after a row's stop token (a valid vocabulary id).
      temperature: 0 (default) decodes greedily (argmax); ``> 0`` samples from
        ``softmax(logits / temperature)``.
      top_k: when sampling, draw only among the ``top_k`` most likely tokens (ties at the
        ``top_k``-th logit are kept). None: the whole vocabulary.
      key: PRNG key, required when sampling; step ``i`` draws with ``fold_in(key, i)``, every row
        independently. Ignored by greedy decoding.
      lora: optional factored adapters (:class:`pavejax.lora.LoraAdapters`), as in the forward.

    Returns:
      :class:`Generation`: tokens (B, N) int32, lengths (B,) int32 (stop token included),
      finished (B,) bool.

    Jitted on its own: ``jax.jit(generate, static_argnames=("max_new_tokens", "stop_tokens",
    "pad_id", "temperature", "top_k"))`` (an NNX module is a pytree, so ``model`` and ``lora``
    are ordinary arguments). Inside one's own jitted function, e.g. with the model held as graph
    and state the way training code holds it (a tiny random model, so the tokens mean nothing):

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from pavejax.models import LlamaConfig, LlamaLM, generate
    >>> graphdef, state = nnx.split(LlamaLM(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    >>> @jax.jit
    ... def sample(state, ids, mask, key):
    ...     model = nnx.merge(graphdef, state)
    ...     return generate(model, ids, mask, max_new_tokens=3, stop_tokens=(2,), pad_id=0,
    ...                     temperature=0.7, top_k=20, key=key)
    >>> ids = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]], jnp.int32)   # row 0 left-padded
    >>> mask = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1]], jnp.int32)
    >>> out = sample(state, ids, mask, jax.random.key(1))
    >>> out.tokens.shape, out.lengths.shape, out.finished.dtype
    ((2, 3), (2,), dtype('bool'))
    """
    _check_generate(model, input_ids, attention_mask, max_new_tokens, stop_tokens, pad_id,
                    temperature, top_k, key)
    b, t = input_ids.shape
    n = max_new_tokens
    graphdef, state = nnx.split(model)

    def forward(ids, mask, cache):
        return nnx.merge(graphdef, state).forward_cached(ids, mask, cache, lora=lora)

    choose = _chooser(temperature, top_k, key)
    stops = jnp.asarray(stop_tokens, jnp.int32)

    def stopped(tok):
        return jnp.any(tok[:, None] == stops[None, :], axis=1) if stop_tokens else \
            jnp.zeros(tok.shape, bool)

    real = jnp.asarray(attention_mask) != 0
    logits, cache = forward(input_ids, real.astype(jnp.int32), init_cache(model, b, t + n - 1))
    last = t - 1 - jnp.argmax(real[:, ::-1], axis=1)  # each row's last real token
    first = choose(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], 0)
    tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(first)
    carry = (jnp.ones((), jnp.int32), tokens, jnp.ones((b,), jnp.int32), stopped(first), cache)

    def running(carry):
        step, _, _, finished, _ = carry
        return (step < n) & ~jnp.all(finished)

    def decode(carry):
        step, tokens, lengths, finished, cache = carry
        prev = jax.lax.dynamic_slice_in_dim(tokens, step - 1, 1, axis=1)
        logits, cache = forward(prev, (~finished)[:, None].astype(jnp.int32), cache)
        tok = jnp.where(finished, jnp.int32(pad_id), choose(logits[:, 0], step))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, tok[:, None], step, axis=1)
        lengths = jnp.where(finished, lengths, step + 1)
        return step + 1, tokens, lengths, finished | stopped(tok), cache

    _, tokens, lengths, finished, _ = jax.lax.while_loop(running, decode, carry)
    return Generation(tokens=tokens, lengths=lengths, finished=finished)
