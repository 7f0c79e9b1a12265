"""Causal language models under every pavejax mechanism: the LM objectives and the adapters.

Objectives (pure, jittable, float32 whatever the weights' dtype):

* :func:`token_logprobs` / :func:`token_loss`: the causal-LM token loss with padding masks (left
  or right padding; an optional ``loss_mask`` keeps only e.g. the answer tokens);
* :func:`candidate_scores` / :func:`candidate_loss` / :func:`candidate_predict`: prompted
  classification as in MeZO and PACZero (``"<sentence> It was {terrible|great}"``): a
  candidate's score is the mean log-probability of its option tokens, the per-example loss the
  cross-entropy of the C scores at the gold label;
* :func:`generation_f1_losses`: ``-F1`` of greedy generations against gold answers (SQuAD),
  a non-differentiable loss for the zeroth-order mechanisms; it runs host code on every call.

Adapters. The mechanisms take a per-example loss ``loss_fn(trainable, frozen, example)``. An
:class:`LMSplit` says how a :class:`~pavejax.models.llama.LlamaLM`'s parameters split into those
two pytrees: :func:`split_lora` (trainable = the ``B`` factors of factored LoRA on any of
q/k/v/o/gate/up/down, selected by :func:`lora_predicate`; frozen = the weights and the secret
``A``) or :func:`split_full` (trainable = a selected subset of the weights; frozen = the rest).
:func:`token_loss_fn`, :func:`candidate_loss_fn` and :func:`generation_f1_loss_fn` turn a split
into such a loss, and then:

* DP-SGD: ``pavejax.privacy.private_gradient`` / ``DPGradient`` (an example is one sequence or
  one group of C candidate sequences), DP-SAM: ``pavejax.merging.train.make_step``;
* zeroth order: ``pavejax.paczero.init`` / ``step`` / ``train`` (MeZO, DP-ZO, PACZero-ZPL and
  PACZero-MI) with the candidate loss or ``-F1``;
* PAVE: :class:`LMSpecBackbone` makes model-side specs (on the LM's own candidate predictions)
  and user-side specs (on few shots), so a ``pavejax.pave.dock.Dock`` holds LM learnwares.

Example (not run here)::

    split, B, frozen = split_lora(model, a_key, LoraConfig(8), targets=("q", "v"))
    loss_fn = candidate_loss_fn(split)
    state = paczero.init(cfg, B, pool_size, key=fresh_key(), public_key=public_key)
    state, charge, stats = paczero.step(cfg, loss_fn, state, pool, paczero.step_key(state),
                                        frozen=frozen)

where ``pool = candidate_examples(encode_candidates(...), labels)``.
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
from pavejax._tree import path_string
from pavejax.lora import LoraAdapters, LoraConfig
from pavejax.models.generate import generate
from pavejax.models.llama import LlamaLM
from pavejax.pave.spec import (
    Backbone,
    SpecConfig,
    SpecResult,
    backbone_hash,
    model_spec,
    user_spec,
)

__all__ = [
    "LORA_TARGETS",
    "AnswerTable",
    "LMSpecBackbone",
    "LMSplit",
    "candidate_examples",
    "candidate_loss",
    "candidate_loss_fn",
    "candidate_predict",
    "candidate_scores",
    "generation_f1_loss_fn",
    "generation_f1_losses",
    "lora_predicate",
    "score_candidates",
    "split_full",
    "split_lora",
    "token_logprobs",
    "token_loss",
    "token_loss_fn",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_BLOCK = {"q": "attn", "k": "attn", "v": "attn", "o": "attn",
          "gate": "mlp", "up": "mlp", "down": "mlp"}


# --- objectives ---------------------------------------------------------------------------------


def _ids_and_mask(input_ids: Any, attention_mask: Any, ndim: int, what: str):
    ids, mask = jnp.asarray(input_ids), jnp.asarray(attention_mask)
    if ids.ndim != ndim:
        raise ValueError(f"{what}: input_ids must have {ndim} axes, got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise ValueError(f"{what}: attention_mask must have the shape of input_ids {ids.shape}, "
                         f"got {mask.shape}")
    return ids, mask


def _scored(mask: jax.Array) -> jax.Array:
    """(B, T) bool: token t has a log-probability (t >= 1, token t and token t - 1 are real)."""
    real = mask != 0
    return jnp.pad(real[:, 1:] & real[:, :-1], ((0, 0), (1, 0)))


def token_logprobs(model: LlamaLM, input_ids: jax.Array, attention_mask: jax.Array, *,
                   lora: LoraAdapters | None = None) -> jax.Array:
    """Log-probability of each token given its prefix: (B, T) ids and mask -> (B, T) float32.

    Entry ``t`` is ``log p(x_t | x_<t)``, read from the logits at ``t - 1``. A token without a
    real predecessor (position 0, the first real token after left padding) and a padded token
    get 0. ``attention_mask`` is nonzero on real tokens (left or right padding); ``lora`` is
    applied factored (:class:`pavejax.lora.LoraAdapters` with paths from
    ``model.lora_targets()``). Pure and jittable.
    """
    ids, mask = _ids_and_mask(input_ids, attention_mask, 2, "token_logprobs")
    logits = model(ids, mask, lora=lora)[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    lp = jnp.pad(picked - jax.nn.logsumexp(logits, axis=-1), ((0, 0), (1, 0)))
    return jnp.where(_scored(mask), lp, jnp.float32(0.0))


def token_loss(model: LlamaLM, input_ids: jax.Array, attention_mask: jax.Array, *,
               loss_mask: jax.Array | None = None,
               lora: LoraAdapters | None = None) -> jax.Array:
    """Per-example mean next-token negative log-likelihood: (B, T) -> (B,) float32.

    The mean runs over the tokens that have a real predecessor (see :func:`token_logprobs`)
    and, with ``loss_mask`` (B, T), only over those where it is nonzero: mark the tokens whose
    prediction counts (e.g. an answer's tokens, as ``option_mask`` marks candidates). A row
    with no such token has loss 0. Pure and jittable.
    """
    ids, mask = _ids_and_mask(input_ids, attention_mask, 2, "token_loss")
    weight = _scored(mask)
    if loss_mask is not None:
        loss_mask = jnp.asarray(loss_mask)
        if loss_mask.shape != ids.shape:
            raise ValueError(f"loss_mask must have the shape of input_ids {ids.shape}, got "
                             f"{loss_mask.shape}")
        weight = weight & (loss_mask != 0)
    w = weight.astype(jnp.float32)
    lp = token_logprobs(model, ids, mask, lora=lora)
    return -jnp.sum(lp * w, axis=-1) / jnp.maximum(jnp.sum(w, axis=-1), jnp.float32(1.0))


def _field(batch: Any, name: str) -> jax.Array:
    if isinstance(batch, Mapping):
        if name not in batch:
            raise KeyError(f"the candidate batch has no {name!r}; build it with "
                           f"pavejax.data.prompts.encode_candidates (fields input_ids, "
                           f"attention_mask, option_mask)")
        return jnp.asarray(batch[name])
    return jnp.asarray(getattr(batch, name))


def candidate_scores(model: LlamaLM, batch: Any, *, lora: LoraAdapters | None = None
                     ) -> jax.Array:
    """Mean log-probability of each candidate's option tokens: -> (N, C) float32.

    ``batch`` holds ``input_ids``, ``attention_mask`` and ``option_mask``, each (N, C, T)
    (a ``CandidateBatch`` of :func:`pavejax.data.prompts.encode_candidates` or a dict): row
    ``(n, c)`` is prompt ``n`` followed by candidate ``c``, and ``option_mask`` is 1 at the
    candidate's tokens. The score is MeZO's and PACZero's: the mean over those tokens of
    :func:`token_logprobs`. A candidate with no marked token scores 0. Pure and jittable.
    """
    ids = _field(batch, "input_ids")
    mask, option = _field(batch, "attention_mask"), _field(batch, "option_mask")
    if ids.ndim != 3 or mask.shape != ids.shape or option.shape != ids.shape:
        raise ValueError(f"candidate_scores needs input_ids, attention_mask and option_mask of "
                         f"one shape (N, C, T), got {ids.shape}, {mask.shape}, {option.shape}")
    n, c, t = ids.shape
    lp = token_logprobs(model, ids.reshape(n * c, t), mask.reshape(n * c, t), lora=lora)
    w = (option != 0).astype(jnp.float32)
    total = jnp.sum(lp.reshape(n, c, t) * w, axis=-1)
    return total / jnp.maximum(jnp.sum(w, axis=-1), jnp.float32(1.0))


def candidate_loss(scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross-entropy over the C candidate scores at the gold label: (N, C), (N,) -> (N,) float32
    (PACZero's per-sample SST-2 loss: softmax over the mean log-probabilities)."""
    scores = jnp.asarray(scores, jnp.float32)
    labels = jnp.asarray(labels)
    if scores.ndim != 2 or labels.shape != scores.shape[:1]:
        raise ValueError(f"candidate_loss needs scores (N, C) and labels (N,), got "
                         f"{scores.shape} and {labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer candidate indices, got dtype {labels.dtype}")
    logp = jax.nn.log_softmax(scores, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]


def candidate_predict(scores: jax.Array) -> jax.Array:
    """The predicted candidate, the one with the highest score: (N, C) -> (N,) int32."""
    return jnp.argmax(jnp.asarray(scores), axis=-1).astype(jnp.int32)


def candidate_examples(batch: Any, labels: Any) -> dict[str, jax.Array]:
    """The per-example pool of the candidate loss: a dict with ``input_ids``,
    ``attention_mask``, ``option_mask`` (N, C, T) from ``batch`` and ``label`` (N,) int32 (what
    :func:`candidate_loss_fn` reads; leading axis N, ready for sampling and ``vmap``)."""
    ids = _field(batch, "input_ids")
    labels = jnp.asarray(labels)
    if labels.shape != ids.shape[:1]:
        raise ValueError(f"labels must have shape ({ids.shape[0]},) (one per prompt), got "
                         f"{labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer candidate indices, got dtype {labels.dtype}")
    return {"input_ids": ids.astype(jnp.int32),
            "attention_mask": _field(batch, "attention_mask").astype(jnp.int32),
            "option_mask": _field(batch, "option_mask").astype(jnp.int32),
            "label": labels.astype(jnp.int32)}


@functools.lru_cache(maxsize=16)
def _scores_program(graphdef: Any) -> Callable:
    return jax.jit(lambda params, batch, lora: candidate_scores(nnx.merge(graphdef, params),
                                                                batch, lora=lora))


def score_candidates(model: LlamaLM, batch: Any, *, batch_size: int = 32,
                     lora: LoraAdapters | None = None) -> np.ndarray:
    """:func:`candidate_scores` of a whole data set in chunks of ``batch_size`` prompts (host
    loop, one compilation; the last chunk is padded by repeating rows): (N, C) float32 numpy."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    fields = {k: np.asarray(_field(batch, k))
              for k in ("input_ids", "attention_mask", "option_mask")}
    n = fields["input_ids"].shape[0]
    if n == 0:
        raise ValueError("the candidate batch is empty")
    graphdef, state = nnx.split(model)
    program, params = _scores_program(graphdef), nnx.to_pure_dict(state)
    out = []
    for i in range(0, n, batch_size):
        idx = np.arange(i, i + batch_size) % n
        chunk = {k: v[idx] for k, v in fields.items()}
        out.append(np.asarray(program(params, chunk, lora))[:min(batch_size, n - i)])
    return np.concatenate(out).astype(np.float32)


# --- -F1 of greedy generations ------------------------------------------------------------------


class AnswerTable:
    """Gold answers of a generation task, held on the host and indexed by example id.

    Args:
      answers: one sequence of acceptable answer strings per example (id = position).
      decode: token ids -> text (e.g. ``LlamaTokenizer.decode``).
      metric: ``(prediction, answers) -> score`` in [0, 1]; default
        :func:`pavejax.data.squad.squad_f1` (the official SQuAD v1.1 token F1).

    :meth:`scores` decodes a generation, keeps its text up to the first line break
    (:func:`pavejax.data.squad.answer_text`) and scores it. The table never enters a traced
    computation: :func:`generation_f1_losses` reaches it through ``jax.pure_callback``.
    """

    def __init__(self, answers: Sequence[Sequence[str]], decode: Callable[[Sequence[int]], str],
                 *, metric: Callable[[str, Sequence[str]], float] | None = None):
        from pavejax.data.squad import squad_f1

        table = []
        for i, a in enumerate(answers):
            if isinstance(a, str) or not all(isinstance(s, str) for s in a) or not len(a):
                raise ValueError(f"answers[{i}] must be a non-empty sequence of strings (the "
                                 f"gold answers of example {i}), got {a!r}")
            table.append(tuple(a))
        if not table:
            raise ValueError("the answer table is empty")
        if not callable(decode):
            raise TypeError("decode must be a callable from token ids to text, e.g. "
                            "tokenizer.decode")
        self.answers, self.decode = tuple(table), decode
        self.metric = squad_f1 if metric is None else metric

    def __len__(self) -> int:
        return len(self.answers)

    def scores(self, tokens: np.ndarray, lengths: np.ndarray, example_ids: np.ndarray
               ) -> np.ndarray:
        """Host-side scores of generations: tokens (..., L) ints, lengths (...) (how many of
        the L tokens are generated), example_ids (...) -> (...) float32 in [0, 1]. A negative
        id marks a padding row (a sampled batch's fill) and scores 0; an id past the table
        raises ``ValueError``."""
        from pavejax.data.squad import answer_text

        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        ids = np.asarray(example_ids)
        shape = ids.shape
        flat_tokens = tokens.reshape(-1, tokens.shape[-1])
        flat_len, flat_ids = lengths.reshape(-1), ids.reshape(-1)
        bad = flat_ids[flat_ids >= len(self.answers)]
        if bad.size:
            raise ValueError(f"example id {int(bad[0])} is past the answer table of "
                             f"{len(self.answers)} examples; the batch's example_id must index "
                             f"the table the loss was built with")
        out = np.zeros(flat_ids.shape, np.float32)
        for j, (row, n, i) in enumerate(zip(flat_tokens, flat_len, flat_ids, strict=True)):
            if i >= 0:
                text = answer_text(self.decode([int(t) for t in row[:max(int(n), 0)]]))
                out[j] = self.metric(text, self.answers[int(i)])
        return out.reshape(shape)


def generation_f1_losses(model: LlamaLM, input_ids: jax.Array, attention_mask: jax.Array,
                         example_ids: jax.Array, table: AnswerTable, *, max_new_tokens: int,
                         pad_id: int, stop_tokens: Sequence[int] = (),
                         lora: LoraAdapters | None = None) -> jax.Array:
    """Per-example ``-F1`` of greedy generations: (B, T) left-padded prompts -> (B,) float32
    in [-1, 0].

    The generation runs in JAX (:func:`pavejax.models.generate.generate`, greedy, a static
    ``max_new_tokens``, stopping at ``stop_tokens``); the tokens then go to the host through
    ``jax.pure_callback``, where :meth:`AnswerTable.scores` decodes them and scores them
    against the gold answers of ``example_ids`` (B,). So it jits, vmaps (the callback receives
    the whole batch) and runs inside ``lax.scan`` and PACZero's compiled step, but **every call
    runs host Python** (decoding and F1 for each example: a device-host round trip per call) and
    it has no gradient (``jax.grad`` through it raises): it is for the zeroth-order mechanisms.
    """
    ids, mask = _ids_and_mask(input_ids, attention_mask, 2, "generation_f1_losses")
    example_ids = jnp.asarray(example_ids)
    if example_ids.shape != ids.shape[:1] or not jnp.issubdtype(example_ids.dtype, jnp.integer):
        raise ValueError(f"example_ids must be ({ids.shape[0]},) integers indexing the answer "
                         f"table, got shape {example_ids.shape} dtype {example_ids.dtype}")
    if not isinstance(table, AnswerTable):
        raise TypeError(f"table must be an AnswerTable, got {type(table).__name__}")
    gen = generate(model, ids, mask, max_new_tokens=max_new_tokens, pad_id=pad_id,
                   stop_tokens=tuple(int(t) for t in stop_tokens), lora=lora)
    f1 = jax.pure_callback(table.scores, jax.ShapeDtypeStruct(example_ids.shape, jnp.float32),
                           gen.tokens, gen.lengths, example_ids.astype(jnp.int32),
                           vmap_method="broadcast_all")
    return -f1


# --- splitting an LM into trainable and frozen parameters --------------------------------------


def lora_predicate(targets: Sequence[str] = ("q", "v"), layers: Sequence[int] | None = None
                   ) -> lora_lib.Predicate:
    """Select the dense kernels ``layers/{i}/{attn|mlp}/{target}/kernel`` of a
    :class:`~pavejax.models.llama.LlamaLM`: ``targets`` among :data:`LORA_TARGETS`
    (q, k, v, o, gate, up, down), ``layers`` the block indices (None: every block). For
    :func:`split_lora`, :func:`split_full` and :class:`LMSpecBackbone`."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {LORA_TARGETS}, got "
                         f"{list(targets)}")
    suffixes = tuple(f"{_BLOCK[t]}/{t}/kernel" for t in targets)
    if layers is not None:
        layers = tuple(layers)
        if not layers or not all(isinstance(i, int | np.integer) and not isinstance(i, bool)
                                 and i >= 0 for i in layers):
            raise ValueError(f"layers must be a non-empty sequence of block indices >= 0 (or "
                             f"None for every block), got {layers!r}")
    wanted = None if layers is None else {int(i) for i in layers}

    def predicate(path: str, leaf: Any) -> bool:
        parts = path.split("/")
        if len(parts) != 5 or parts[0] != "layers" or not path.endswith(suffixes):
            return False
        return wanted is None or int(parts[1]) in wanted

    return predicate


@dataclasses.dataclass(frozen=True)
class LMSplit:
    """How a :class:`~pavejax.models.llama.LlamaLM`'s parameters split into the ``trainable``
    and ``frozen`` pytrees of a per-example loss (static: hashable, holds no arrays).

    Parameter pytrees are flat dicts keyed by path strings (``"layers/0/attn/q/kernel"``).
    LoRA (:func:`split_lora`): ``trainable`` is the dict of ``B`` factors, ``frozen`` is
    ``{"params": every weight, "A": the A factors}`` and the model applies ``B`` factored.
    Full weights (:func:`split_full`): ``trainable`` is the selected weights, ``frozen`` is
    ``{"params": the other weights}``.

    Attributes:
      graphdef: the model's ``nnx`` graph definition.
      treedef: the tree structure of ``nnx.to_pure_dict`` of its state.
      paths: every parameter path, in the order of ``treedef``'s leaves.
      trainable_paths: the adapted (LoRA) or trained (full) paths, sorted.
      lora_config: the :class:`~pavejax.lora.LoraConfig` (LoRA), or None (full weights).
    """

    graphdef: Any
    treedef: Any
    paths: tuple[str, ...]
    trainable_paths: tuple[str, ...]
    lora_config: LoraConfig | None = None

    @property
    def kind(self) -> str:
        """``"lora"`` or ``"full"``."""
        return "full" if self.lora_config is None else "lora"

    def _check(self, trainable: Any, frozen: Any) -> None:
        if not isinstance(trainable, Mapping) or not isinstance(frozen, Mapping) \
                or "params" not in frozen:
            raise TypeError("trainable must be a dict {path: array} and frozen a dict with "
                            "'params' (as split_lora / split_full return them)")
        if tuple(sorted(trainable)) != self.trainable_paths:
            raise ValueError(f"trainable has paths {sorted(trainable)[:4]}..., this split "
                             f"trains {list(self.trainable_paths[:4])}...; pass the trainable "
                             f"pytree returned with this split")

    def params(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any]) -> PyTree:
        """The nested parameter dict of the model (``nnx.merge``-able): the frozen weights,
        with the trained ones in place for a full-weights split (LoRA stays factored)."""
        self._check(trainable, frozen)
        weights = frozen["params"]
        if self.lora_config is None:
            weights = {**weights, **trainable}
        missing = [p for p in self.paths if p not in weights]
        if missing:
            raise ValueError(f"frozen['params'] lacks {missing[:4]}: it is not this model's")
        return jax.tree.unflatten(self.treedef, [weights[p] for p in self.paths])

    def model(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any]
              ) -> tuple[LlamaLM, LoraAdapters | None]:
        """The model and its factored adapters (None for a full-weights split), for the
        objectives' ``model`` and ``lora`` arguments. Pure: call it inside the loss."""
        model = nnx.merge(self.graphdef, self.params(trainable, frozen))
        if self.lora_config is None:
            return model, None
        return model, LoraAdapters(trainable, frozen["A"], self.lora_config)

    def merged(self, trainable: Mapping[str, jax.Array], frozen: Mapping[str, Any]) -> LlamaLM:
        """One model with everything merged in (LoRA: ``W + (alpha / r) A B`` at the adapted
        kernels, :func:`pavejax.lora.apply_lora`), e.g. for generation or export."""
        params = self.params(trainable, frozen)
        if self.lora_config is not None:
            params = lora_lib.apply_lora(params, trainable, frozen["A"], self.lora_config)
        return nnx.merge(self.graphdef, params)


def _flat_params(model: LlamaLM):
    if not isinstance(model, LlamaLM):
        raise TypeError(f"model must be a pavejax.models.llama.LlamaLM, got "
                        f"{type(model).__name__}")
    graphdef, state = nnx.split(model)
    nested = nnx.to_pure_dict(state)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(nested)
    paths = tuple(path_string(kp) for kp, _ in with_path)
    return graphdef, treedef, nested, dict(zip(paths, (x for _, x in with_path), strict=True))


def split_lora(model: LlamaLM, key: jax.Array, config: LoraConfig = LoraConfig(8), *,
               targets: Sequence[str] = ("q", "v"), layers: Sequence[int] | None = None,
               predicate: lora_lib.Predicate | None = None
               ) -> tuple[LMSplit, dict[str, jax.Array], dict[str, Any]]:
    """Factored LoRA on a Llama LM: ``(split, B, frozen)``.

    ``B`` (zeros, the trainable pytree) and ``A`` (from ``key``: secret; keep it in ``frozen``)
    come from :func:`pavejax.lora.init_lora` on the model's parameter dict with
    ``predicate`` (default ``lora_predicate(targets, layers)``), so the paths are those of
    ``model.lora_targets()`` and a PAVE spec made with the same key and predicate uses the
    same ``A``. ``frozen = {"params": every weight, "A": A}``.
    """
    graphdef, treedef, nested, flat = _flat_params(model)
    pred = lora_predicate(targets, layers) if predicate is None else predicate
    B, A = lora_lib.init_lora(key, nested, pred, config)
    LoraAdapters(B, A, config).check_targets(model.lora_targets(), "LlamaLM")
    split = LMSplit(graphdef, treedef, tuple(flat), tuple(sorted(B)), config)
    return split, B, {"params": flat, "A": A}


def split_full(model: LlamaLM, predicate: lora_lib.Predicate
               ) -> tuple[LMSplit, dict[str, jax.Array], dict[str, Any]]:
    """Full-weights training of a selected subset: ``(split, trainable, frozen)``.

    ``predicate(path, leaf)`` picks the trained weights (e.g. :func:`lora_predicate` for some
    dense kernels, or ``lambda p, _: p.startswith("layers/29/")`` for a whole block);
    ``trainable`` is ``{path: weight}`` of those, ``frozen = {"params": the others}`` (no
    weight is held twice)."""
    graphdef, treedef, _, flat = _flat_params(model)
    chosen = sorted(p for p, x in flat.items() if predicate(p, x))
    if not chosen:
        raise ValueError(f"the predicate selected none of the model's weights, e.g. "
                         f"{list(flat)[:4]}; see lora_predicate")
    trainable = {p: flat[p] for p in chosen}
    frozen = {"params": {p: x for p, x in flat.items() if p not in trainable}}
    return LMSplit(graphdef, treedef, tuple(flat), tuple(chosen), None), trainable, frozen


# --- per-example losses of the mechanisms -------------------------------------------------------


def _one(example: Mapping[str, Any], name: str, ndim: int, what: str) -> jax.Array:
    if name not in example:
        raise KeyError(f"{what}: the example has no {name!r} (fields: {sorted(example)})")
    x = jnp.asarray(example[name])
    if x.ndim != ndim:
        raise ValueError(f"{what}: {name!r} of one example must have {ndim} axes, got shape "
                         f"{x.shape}; the mechanisms vmap the example axis away, so pass the "
                         f"whole pool with a leading example axis")
    return x


def token_loss_fn(split: LMSplit) -> LossFn:
    """The per-example causal-LM token loss ``loss_fn(trainable, frozen, example)`` of
    :func:`token_loss`: an example holds ``input_ids`` and ``attention_mask`` (T,) and
    optionally ``loss_mask`` (T,). Build it once and reuse it (compilations are cached per
    function object)."""
    def loss_fn(trainable, frozen, example):
        ids = _one(example, "input_ids", 1, "token_loss_fn")
        mask = _one(example, "attention_mask", 1, "token_loss_fn")
        loss_mask = example.get("loss_mask")
        model, lora = split.model(trainable, frozen)
        return token_loss(model, ids[None], mask[None], lora=lora,
                          loss_mask=None if loss_mask is None else jnp.asarray(loss_mask)[None])[0]

    return loss_fn


def candidate_loss_fn(split: LMSplit) -> LossFn:
    """The per-example prompted-classification loss (:func:`candidate_loss` of
    :func:`candidate_scores`): an example holds ``input_ids``, ``attention_mask``,
    ``option_mask`` (C, T) and ``label`` () (one row of :func:`candidate_examples`)."""
    def loss_fn(trainable, frozen, example):
        fields = {k: _one(example, k, 2, "candidate_loss_fn")[None]
                  for k in ("input_ids", "attention_mask", "option_mask")}
        label = _one(example, "label", 0, "candidate_loss_fn")
        model, lora = split.model(trainable, frozen)
        return candidate_loss(candidate_scores(model, fields, lora=lora), label[None])[0]

    return loss_fn


def generation_f1_loss_fn(split: LMSplit, table: AnswerTable, *, max_new_tokens: int,
                          pad_id: int, stop_tokens: Sequence[int] = ()) -> LossFn:
    """The per-example ``-F1`` loss of :func:`generation_f1_losses`: an example holds a
    left-padded prompt ``input_ids``, ``attention_mask`` (T,) and ``example_id`` () indexing
    ``table``. Non-differentiable and host-bound on every call (see
    :func:`generation_f1_losses`): for MeZO, DP-ZO and PACZero."""
    def loss_fn(trainable, frozen, example):
        ids = _one(example, "input_ids", 1, "generation_f1_loss_fn")
        mask = _one(example, "attention_mask", 1, "generation_f1_loss_fn")
        eid = _one(example, "example_id", 0, "generation_f1_loss_fn")
        model, lora = split.model(trainable, frozen)
        return generation_f1_losses(model, ids[None], mask[None], eid[None], table,
                                    max_new_tokens=max_new_tokens, pad_id=pad_id,
                                    stop_tokens=stop_tokens, lora=lora)[0]

    return loss_fn


# --- PAVE specs of a language model -------------------------------------------------------------


class LMSpecBackbone:
    """A Llama LM as the shared PAVE backbone of prompted classification tasks.

    ``g o f`` maps a prompt with its C candidates to the (n, C) :func:`candidate_scores` of the
    LoRA-adapted backbone (LoRA on :func:`lora_predicate` ``(targets, layers)``): the label
    space is the candidates themselves, so no head is needed. Centring (default), as in
    :class:`pavejax.pave.text.TextSpecBackbone`: the logits are the adapted scores minus the
    frozen backbone's scores of the same rows, so every spec starts from uniform predictions
    and a pretrained LM's bias (e.g. always " great") is not a component shared by all specs.

    Model side (:meth:`model_spec`): fit the developer LM's own predictions, its
    :func:`score_candidates` on the developer's prompts. User side (:meth:`user_spec`): fit the
    user's few-shot labels. The specs go to a :class:`pavejax.pave.dock.Dock` as any other.

    Args:
      model: the shared backbone LM (every party of one dock uses the same weights).
      backbone_id: public name recorded in the signature.
      targets, layers: the adapted kernels (see :func:`lora_predicate`).
      centered: subtract the frozen backbone's scores.
      batch_size: prompts per chunk when scoring with the frozen backbone.
    """

    def __init__(self, model: LlamaLM, backbone_id: str, *,
                 targets: Sequence[str] = ("q", "v"), layers: Sequence[int] | None = None,
                 centered: bool = True, batch_size: int = 32):
        if not isinstance(backbone_id, str) or not backbone_id:
            raise ValueError("backbone_id must be a non-empty public name of the backbone")
        graphdef, _, nested, _ = _flat_params(model)
        self.model = model
        self.backbone = Backbone(backbone_id, nested, backbone_hash(nested))
        self.predicate = lora_predicate(targets, layers)
        self.centered, self.batch_size = bool(centered), batch_size

        def logits_fn(params, batch, aux):
            scores = candidate_scores(nnx.merge(graphdef, params), batch)
            return scores - batch["base_scores"] if "base_scores" in batch else scores

        self.logits_fn = logits_fn

    def encode(self, batch: Any) -> dict[str, np.ndarray]:
        """The spec inputs of a candidate batch: ``input_ids``, ``attention_mask``,
        ``option_mask`` (n, C, T) int32 and, centred, ``base_scores`` (n, C) float32."""
        out = {k: np.asarray(_field(batch, k), np.int32)
               for k in ("input_ids", "attention_mask", "option_mask")}
        if out["input_ids"].ndim != 3 or out["input_ids"].shape[0] == 0:
            raise ValueError(f"a spec needs a non-empty (n, C, T) candidate batch, got shape "
                             f"{out['input_ids'].shape}")
        if self.centered:
            out["base_scores"] = score_candidates(self.model, out, batch_size=self.batch_size)
        return out

    def model_spec(self, batch: Any, model_scores: np.ndarray, a_key: jax.Array,
                   config: SpecConfig = SpecConfig(), *, noise_key: jax.Array | None = None,
                   **info: Any) -> SpecResult:
        """Developer side: fit ``model_scores`` (n, C), the developer LM's
        :func:`score_candidates` on ``batch`` (soft targets at ``config.temperature``, or the
        argmax with ``fit_target="hard"``). ``noise_key`` as in
        :func:`pavejax.pave.spec.generate_spec` (None: fresh and secret)."""
        inputs = self.encode(batch)
        scores = np.asarray(model_scores, np.float32)
        if scores.shape != inputs["input_ids"].shape[:2]:
            raise ValueError(f"model_scores must have shape {inputs['input_ids'].shape[:2]} "
                             f"(prompts x candidates), got {scores.shape}")
        return model_spec(self.logits_fn, self.backbone, self.predicate, inputs, scores, a_key,
                          config, info=info or None, noise_key=noise_key)

    def user_spec(self, batch: Any, labels: np.ndarray, a_key: jax.Array,
                  config: SpecConfig = SpecConfig(), *, noise_key: jax.Array | None = None,
                  **info: Any) -> SpecResult:
        """User side: fit few-shot ``labels`` (n,) candidate indices."""
        inputs = self.encode(batch)
        num = inputs["input_ids"].shape[1]
        return user_spec(self.logits_fn, self.backbone, self.predicate, inputs,
                         np.asarray(labels), num, a_key, config, info=info or None,
                         noise_key=noise_key)
