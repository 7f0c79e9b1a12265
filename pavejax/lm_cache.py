"""Prompted classification with only the top block adapted: cached frozen features, exact scores.

Adapting only the top block's feed-forward down-projection of a
:class:`~pavejax.models.llama.LlamaLM` (LoRA, ``layers/{L-1}/mlp/down/kernel``) leaves
everything below that kernel frozen. For a prompt whose candidates are single tokens, the
candidate score then needs, at the prompt's last position only:

* ``act`` (ffn,): the top block's SwiGLU activation ``silu(x W_gate) * (x W_up)``, the input of
  the down-projection (``x`` the normalised output of the top block's attention half);
* ``h_base`` (hidden,): the top block's output without the adapter;

and the candidate logits are ``rmsnorm(h_base + (alpha/r) (act A) B) @ W_out[:, candidates]``.
:func:`top_features` runs the frozen model once per prompt to get both; a zeroth-order step
then costs a rank-r product and ``C`` output rows per example instead of a whole forward pass.

Exactness. With single-token candidates the cross-entropy over the ``C`` candidate logits is
:func:`pavejax.lm.candidate_loss` of :func:`pavejax.lm.candidate_scores` (the full-vocabulary
normaliser is the same for every candidate of a prompt and cancels), and the LoRA factors are
those of ``pavejax.lm.split_lora(model, key, config, targets=("down",), layers=(L-1,))``, so
the cached path computes the whole model's loss up to float rounding (the tests check it).
A candidate of more than one token has no such shortcut: :func:`candidate_token_ids` refuses
it, and the whole-model path (:func:`pavejax.lm.candidate_loss_fn`) scores it.

Prompts are right-padded (the last real token at ``attention_mask.sum(-1) - 1``), as
:func:`pavejax.data.prompts.encode_prompts` makes them with ``padding_side="right"``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax import lora as lora_lib
from pavejax.models.llama import LlamaLM, causal_mask, positions_from_mask

__all__ = ["TopDownLora", "TopMLP", "candidate_token_ids", "top_down_path", "top_features"]


def top_down_path(model: LlamaLM) -> str:
    """Path of the top block's feed-forward down-projection kernel, e.g.
    ``"layers/29/mlp/down/kernel"`` (the kernel this module adapts)."""
    return f"layers/{model.config.num_layers - 1}/mlp/down/kernel"


def candidate_token_ids(tokenizer: Any, candidates: Sequence[str]) -> np.ndarray:
    """The token id of each candidate: (C,) int32.

    ``tokenizer.encode(candidate)`` must be exactly one token (with its leading space, as the
    candidate follows the prompt in ordinary text: ``" great"``). Raises ``ValueError`` naming
    a candidate of several tokens and what to do instead.
    """
    out = []
    for c in candidates:
        ids = [int(i) for i in tokenizer.encode(c)]
        if len(ids) != 1:
            raise ValueError(
                f"candidate {c!r} is {len(ids)} tokens {ids} for this tokenizer; the cached "
                f"top-layer path scores single-token candidates. Choose a one-token word "
                f"(keep its leading space, e.g. ' bad', ' good'), or score on the whole model "
                f"(pavejax.lm.candidate_loss_fn; on the command line: --lm-path whole)")
        out.append(ids[0])
    return np.asarray(out, np.int32)


def _check_right_padded(mask: np.ndarray) -> None:
    real = mask != 0
    counts = real.sum(-1)
    if np.any(counts == 0):
        raise ValueError(f"prompt {int(np.argmin(counts))} has no real token")
    expected = np.arange(mask.shape[1])[None, :] < counts[:, None]
    if not np.array_equal(real, expected):
        bad = int(np.flatnonzero(np.any(real != expected, axis=-1))[0])
        raise ValueError(f"prompt {bad} is not right-padded: the cached path reads the last "
                         f"prompt position at attention_mask.sum(-1) - 1; encode with "
                         f"padding_side='right'")


@functools.lru_cache(maxsize=8)
def _features_program(graphdef: Any) -> Callable:
    def features(params, input_ids, attention_mask):
        m = nnx.merge(graphdef, params)
        top = m.config.num_layers - 1
        pos, mask = positions_from_mask(attention_mask), causal_mask(attention_mask)
        h = m.run_layers(m.embed_tokens(input_ids), pos, mask, stop=top)
        last = (jnp.sum(attention_mask != 0, axis=-1) - 1)[:, None]
        rows = jnp.take_along_axis(mask, last[..., None], axis=1)
        block = m.layers[top]
        h_att = block.attention(h, pos, rows, query_index=last)[:, 0]
        mlp = block.mlp
        x = block.mlp_norm(h_att)
        g = jnp.matmul(x.astype(mlp.gate.kernel.dtype), mlp.gate.kernel[...])
        u = jnp.matmul(x.astype(mlp.up.kernel.dtype), mlp.up.kernel[...])
        act = jax.nn.silu(g) * u
        down = mlp.down.kernel[...]
        h_base = h_att + jnp.matmul(act.astype(down.dtype), down)
        return {"act": act.astype(jnp.float32), "h_base": h_base.astype(jnp.float32),
                "h_att": h_att.astype(jnp.float32)}

    return jax.jit(features)


def top_features(model: LlamaLM, input_ids: Any, attention_mask: Any, *,
                 batch_size: int = 32) -> dict[str, np.ndarray]:
    """Frozen features of right-padded prompts at their last real position (see the module
    docstring): ``{"act": (N, ffn), "h_base": (N, hidden), "h_att": (N, hidden)}``, float32
    numpy; ``h_att`` is the top block's hidden state after its attention half (the input of
    its feed-forward half, what :class:`TopMLP` needs).

    ``input_ids`` and ``attention_mask`` are (N, T). Runs the model (as it is: fold any earlier
    adaptation into its weights first) in chunks of ``batch_size`` prompts, one compilation; the
    last chunk is padded by repeating rows. Raises ``ValueError`` for an empty batch, a prompt
    without a real token, or a prompt that is not right-padded.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be (N, T), got {ids.shape} "
                         f"and {mask.shape}")
    if ids.shape[0] == 0:
        raise ValueError("no prompts to encode (N = 0)")
    _check_right_padded(mask)
    graphdef, state = nnx.split(model)
    program, params = _features_program(graphdef), nnx.to_pure_dict(state)
    n, parts = ids.shape[0], []
    for i in range(0, n, batch_size):
        idx = np.arange(i, i + batch_size) % n
        out = program(params, ids[idx].astype(np.int32), mask[idx].astype(np.int32))
        parts.append({k: np.asarray(v)[:min(batch_size, n - i)] for k, v in out.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in ("act", "h_base", "h_att")}


@dataclasses.dataclass(frozen=True)
class TopDownLora:
    """LoRA on the top down-projection, scored from :func:`top_features` (static, hashable).

    Build it with :meth:`of`. The trainable pytree is ``B`` ``{path: (r, hidden)}`` and the
    frozen one ``{"A": {path: (ffn, r)}, "norm": (hidden,), "rows": (hidden, C)}``
    (:meth:`frozen`): the same ``B`` and ``A`` as ``pavejax.lm.split_lora(model, key, config,
    targets=("down",), layers=(L-1,))``, so a trained ``B`` merges into the model with that
    split (:meth:`pavejax.lm.LMSplit.merged`) or :func:`pavejax.lora.apply_lora`.

    An example is ``{"act": (ffn,), "h_base": (hidden,), "label": ()}`` (a row of
    :func:`top_features` plus the gold candidate index).

    Attributes:
      path: the adapted kernel (:func:`top_down_path`).
      config: the :class:`~pavejax.lora.LoraConfig`.
      eps: the final RMSNorm's epsilon.
    """

    path: str
    config: lora_lib.LoraConfig
    eps: float

    @classmethod
    def of(cls, model: LlamaLM, config: lora_lib.LoraConfig) -> TopDownLora:
        """The adapter of ``model``'s top down-projection with ``config``."""
        if not isinstance(model, LlamaLM):
            raise TypeError(f"model must be a LlamaLM, got {type(model).__name__}")
        return cls(top_down_path(model), config, float(model.config.rms_norm_eps))

    def frozen(self, model: LlamaLM, A: Mapping[str, Any], candidate_ids: Any
               ) -> dict[str, Any]:
        """The frozen pytree: ``A`` (a dict holding exactly :attr:`path`), the final norm's
        scale and the output-layer columns of the (C,) ``candidate_ids``, float32."""
        if set(A) != {self.path}:
            raise ValueError(f"A must hold exactly {self.path!r} (from split_lora with "
                             f"targets=('down',) and the top layer), got {sorted(A)}")
        ids = np.asarray(candidate_ids, np.int32)
        if ids.ndim != 1 or ids.size < 2:
            raise ValueError(f"candidate_ids must be (C,) with C >= 2, got shape {ids.shape}")
        rows = jnp.take(model.output_matrix(), jnp.asarray(ids), axis=1)
        return {"A": {self.path: jnp.asarray(A[self.path], jnp.float32)},
                "norm": jnp.asarray(model.norm.scale[...], jnp.float32),
                "rows": rows.astype(jnp.float32)}

    def logits(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
               example: Mapping[str, jax.Array]) -> jax.Array:
        """Candidate logits of one example: (C,) float32. Pure and jittable."""
        act = jnp.asarray(example["act"], jnp.float32)
        h = jnp.asarray(example["h_base"], jnp.float32) + lora_lib.lora_update(
            act, frozen["A"][self.path], trainable[self.path].astype(jnp.float32), self.config)
        inv = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + jnp.float32(self.eps))
        return jnp.matmul(h * inv * frozen["norm"], frozen["rows"])

    def loss(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
             example: Mapping[str, jax.Array]) -> jax.Array:
        """The per-example loss ``loss_fn(trainable, frozen, example)``: cross-entropy of the
        candidate logits at ``example["label"]``, () float32."""
        z = self.logits(trainable, frozen, example)
        return -jax.nn.log_softmax(z)[example["label"]]

    def batch_logits(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
                     examples: Mapping[str, jax.Array]) -> jax.Array:
        """:meth:`logits` of every example (leading axis N): (N, C) float32."""
        return jax.vmap(self.logits, in_axes=(None, None, 0))(trainable, frozen, examples)


def _rms_rows(h: jax.Array, norm: jax.Array, rows: jax.Array, eps: float) -> jax.Array:
    inv = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + jnp.float32(eps))
    return jnp.matmul(h * inv * norm, rows)


@dataclasses.dataclass(frozen=True)
class TopMLP:
    """Full weights of the top block's feed-forward half, scored from :func:`top_features`.

    The full-weights counterpart of :class:`TopDownLora` (the zeroth-order papers' "FT" setting,
    restricted to the top feed-forward block): the trainable pytree is ``{"gate": (hidden,
    ffn), "up": (hidden, ffn), "down": (ffn, hidden)}`` (:meth:`trainable`), the frozen one
    ``{"mlp_norm": (hidden,), "norm": (hidden,), "rows": (hidden, C)}`` (:meth:`frozen`). An
    example is ``{"h_att": (hidden,), "label": ()}``. Nothing below the feed-forward half
    depends on these weights, so the candidate logits equal the whole model's with the trained
    kernels put back (:meth:`merged`).

    Attributes:
      top: index of the top block.
      eps: RMSNorm epsilon (the model's).
    """

    top: int
    eps: float

    @classmethod
    def of(cls, model: LlamaLM) -> TopMLP:
        """The top feed-forward block of ``model``."""
        if not isinstance(model, LlamaLM):
            raise TypeError(f"model must be a LlamaLM, got {type(model).__name__}")
        return cls(model.config.num_layers - 1, float(model.config.rms_norm_eps))

    def trainable(self, model: LlamaLM) -> dict[str, jax.Array]:
        """The block's current kernels (float32 copies)."""
        mlp = model.layers[self.top].mlp
        return {k: jnp.asarray(getattr(mlp, k).kernel[...], jnp.float32)
                for k in ("gate", "up", "down")}

    def frozen(self, model: LlamaLM, candidate_ids: Any) -> dict[str, jax.Array]:
        """The frozen pytree: the block's feed-forward norm, the final norm and the output
        columns of the (C,) ``candidate_ids``, float32."""
        ids = np.asarray(candidate_ids, np.int32)
        if ids.ndim != 1 or ids.size < 2:
            raise ValueError(f"candidate_ids must be (C,) with C >= 2, got shape {ids.shape}")
        rows = jnp.take(model.output_matrix(), jnp.asarray(ids), axis=1)
        return {"mlp_norm": jnp.asarray(model.layers[self.top].mlp_norm.scale[...], jnp.float32),
                "norm": jnp.asarray(model.norm.scale[...], jnp.float32),
                "rows": rows.astype(jnp.float32)}

    def logits(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
               example: Mapping[str, jax.Array]) -> jax.Array:
        """Candidate logits of one example: (C,) float32. Pure and jittable."""
        h = jnp.asarray(example["h_att"], jnp.float32)
        x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True)
                              + jnp.float32(self.eps)) * frozen["mlp_norm"]
        ff = (jax.nn.silu(x @ trainable["gate"]) * (x @ trainable["up"])) @ trainable["down"]
        return _rms_rows(h + ff, frozen["norm"], frozen["rows"], self.eps)

    def loss(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
             example: Mapping[str, jax.Array]) -> jax.Array:
        """Cross-entropy of the candidate logits at ``example["label"]``, () float32."""
        return -jax.nn.log_softmax(self.logits(trainable, frozen, example))[example["label"]]

    def batch_logits(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any],
                     examples: Mapping[str, jax.Array]) -> jax.Array:
        """:meth:`logits` of every example (leading axis N): (N, C) float32."""
        return jax.vmap(self.logits, in_axes=(None, None, 0))(trainable, frozen, examples)

    def merged(self, model: LlamaLM, trainable: Mapping[str, jax.Array]) -> LlamaLM:
        """A copy of ``model`` with the trained kernels in its top block."""
        graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        for k in ("gate", "up", "down"):
            old = params["layers"][self.top]["mlp"][k]["kernel"]
            params["layers"][self.top]["mlp"][k]["kernel"] = jnp.asarray(trainable[k],
                                                                        old.dtype)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)
