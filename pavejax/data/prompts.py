"""Prompted classification for causal language models, and fixed-shape prompt batches.

A causal LM classifies a sentence by scoring a few *candidate continuations* of a prompt: with
the MeZO / PACZero template, ``"<sentence> It was"`` followed by ``" terrible"`` (label 0) or
``" great"`` (label 1); the predicted label is the best-scoring candidate, and the per-example
loss is the cross-entropy over the candidate scores at the gold label. Candidates carry their
leading space and the prompt ends without one, so the candidate's first token is a
space-prefixed word, as in ordinary text.

Everything here is tokenizer-agnostic: a tokenizer is any object with
``encode(text: str) -> list[int]`` that adds no special tokens (no BOS/EOS). Batches are numpy
int32 arrays of one fixed length ``max_length`` (one compiled shape under ``jax.jit``).
Nothing here loads a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from pavejax.data.tasks import Split, Task, stratified_subsample
from pavejax.data.text import SENTIMENT_LABELS, load_sentiment

_SPLITS = ("train", "dev", "test")


class TextEncoder(Protocol):
    """What the functions here need from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A prompt with one ``{sentence}`` slot and the candidate continuations, one per label.

    ``candidates[i]`` is the continuation of label ``i``; each carries its own leading space,
    so the template should end without one (``"{sentence} It was"``).
    """

    template: str = "{sentence} It was"
    candidates: tuple[str, ...] = (" terrible", " great")

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or "{sentence}" not in self.template:
            raise ValueError(f"template must be a str containing '{{sentence}}', got "
                             f"{self.template!r}")
        if isinstance(self.candidates, str):
            raise ValueError("candidates must be a sequence of strings, not one string")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if len(self.candidates) < 2:
            raise ValueError(f"need at least 2 candidates, got {self.candidates!r}")
        if not all(isinstance(c, str) and c for c in self.candidates):
            raise ValueError(f"every candidate must be a non-empty str, got {self.candidates!r}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates must be distinct, got {self.candidates!r}")

    def format(self, sentence: str) -> str:
        """The prompt for ``sentence`` (stripped of surrounding whitespace), put in the slot."""
        return self.template.replace("{sentence}", sentence.strip())


@dataclasses.dataclass(frozen=True)
class PromptedTask:
    """A labelled :class:`~pavejax.data.tasks.Task` of sentences and the template that turns
    each sentence into a prompt; label ``i`` is ``template.candidates[i]``."""

    task: Task
    template: PromptTemplate

    def __post_init__(self) -> None:
        if self.task.modality != "text":
            raise ValueError(f"task {self.task.name!r} holds images; a prompted task needs text")
        if self.task.num_classes != len(self.template.candidates):
            raise ValueError(f"task {self.task.name!r} has {self.task.num_classes} classes but "
                             f"the template has {len(self.template.candidates)} candidates")

    def _split(self, split: str) -> Split:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {', '.join(_SPLITS)}, got {split!r}")
        return getattr(self.task, split)

    def sentences(self, split: str) -> list[str]:
        """The sentences of ``split`` ("train", "dev" or "test")."""
        return list(self._split(split).inputs)

    def labels(self, split: str) -> np.ndarray:
        """Labels of ``split``, read-only int32 ``(n,)``: index of the gold candidate."""
        return self._split(split).labels

    def prompts(self, split: str) -> list[str]:
        """The prompts of ``split``: ``template.format(sentence)`` for each sentence."""
        return [self.template.format(s) for s in self._split(split).inputs]


def _disjoint_stratified(labels: np.ndarray, sizes: Sequence[int], seed: int
                         ) -> list[np.ndarray]:
    """Disjoint index sets of the given sizes, each keeping the pool's class proportions
    (:func:`stratified_subsample` on what earlier sets left), each shuffled."""
    rest = np.arange(labels.shape[0])
    out = []
    for k, n in enumerate(sizes):
        pick = stratified_subsample(labels[rest], n, seed=seed + k)
        chosen = rest[pick]
        out.append(chosen[np.random.default_rng([seed, k]).permutation(n)])
        rest = np.delete(rest, pick)
    return out


def load_prompted_sentiment(domain: str = "movie", *, n_train: int, n_dev: int, n_test: int,
                            seed: int = 0, template: PromptTemplate | None = None,
                            min_abs_rating: float = 0.5) -> PromptedTask:
    """Binary sentiment of a VADER domain (:func:`~pavejax.data.text.load_sentiment`) as a
    prompted task: label 0 (negative) is the template's first candidate (" terrible"), label 1
    (positive) its second (" great"). The ``movie`` domain holds Rotten Tomatoes snippets, the
    source of SST-2, so it stands in for the SST-2 task of MeZO and PACZero.

    A sentence that occurs more than once in the domain is kept once. The three splits are
    disjoint, have exactly the requested sizes, keep the pool's class proportions (largest
    remainder) and are shuffled. Test is drawn first, then dev, then train, so the test set
    depends only on ``(domain, seed, n_test)``: changing ``n_train`` never moves an example into
    or out of it. Deterministic for a given ``seed >= 0``.
    """
    template = PromptTemplate() if template is None else template
    if len(template.candidates) != 2:
        raise ValueError("binary sentiment needs a template with exactly 2 candidates "
                         f"(negative, positive), got {template.candidates!r}")
    for name, n in {"n_train": n_train, "n_dev": n_dev, "n_test": n_test, "seed": seed}.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    texts, labels, meta = load_sentiment(domain, min_abs_rating)
    first: dict[str, int] = {}
    unique = [i for i, t in enumerate(texts) if first.setdefault(t, i) == i]
    texts, labels = [texts[i] for i in unique], labels[unique]
    if n_train + n_dev + n_test > len(texts):
        raise ValueError(f"n_train + n_dev + n_test = {n_train + n_dev + n_test} exceeds the "
                         f"{len(texts)} sentences of domain {domain!r}; ask for fewer")
    test, dev, train = _disjoint_stratified(labels, (n_test, n_dev, n_train), seed)
    pool = Split(texts, labels)
    meta = {**meta, "n_unique": len(texts), "seed": seed, "template": template.template,
            "candidates": list(template.candidates)}
    task = Task(f"{domain}_prompted", SENTIMENT_LABELS, pool.take(train), pool.take(dev),
                pool.take(test), meta)
    return PromptedTask(task, template)


# --- fixed-shape token batches ----------------------------------------------------------------


class CandidateBatch(NamedTuple):
    """Every (prompt, candidate) pair as one right-padded sequence; all int32 ``(N, C, T)``.

    ``input_ids``: prompt tokens then candidate tokens, then ``pad_id``. ``attention_mask``: 1 on
    real tokens. ``option_mask``: 1 exactly on the candidate's tokens.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    option_mask: np.ndarray


def _encode(tokenizer: TextEncoder, text: str, what: str) -> list[int]:
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:
        raise ValueError(f"{what} {text!r} encodes to no tokens")
    if not all(0 <= i < 2**31 for i in ids):
        raise ValueError(f"{what} {text!r} encodes to ids outside [0, 2**31): {ids}")
    return ids


def _check_length(max_length: int) -> None:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")


def encode_candidates(tokenizer: TextEncoder, prompts: Sequence[str], template: PromptTemplate,
                      *, max_length: int, pad_id: int) -> CandidateBatch:
    """Token arrays ``(N, C, T = max_length)`` for scoring each of the ``C`` candidates of
    ``template`` after each of the ``N`` ``prompts`` (already formatted).

    Each sequence is ``encode(prompt) + encode(candidate)``, right-padded with ``pad_id``. When
    it exceeds ``max_length``, the PROMPT loses tokens from its left (its end, which the
    candidate follows, is kept) and the candidate stays whole.

    Scoring: the log-probability of the token at position ``t`` is read from the logits at
    position ``t - 1``, so with ``lp[n, c, t] = log_softmax(logits[n, c, t - 1])[input_ids[n, c,
    t]]`` a candidate's mean log-probability (the MeZO / PACZero candidate score) is
    ``sum_t option_mask * lp / sum_t option_mask`` over ``t >= 1``. ``option_mask[..., 0]`` is
    always 0, because every sequence keeps at least one prompt token.

    Raises ``ValueError`` when a prompt or candidate encodes to no tokens, or when a candidate
    leaves no room for a prompt token (``len(candidate tokens) >= max_length``).
    """
    _check_length(max_length)
    cands = [_encode(tokenizer, c, "candidate") for c in template.candidates]
    longest = max(len(c) for c in cands)
    if longest >= max_length:
        raise ValueError(f"a candidate has {longest} tokens, which leaves no room for the prompt "
                         f"in max_length={max_length}; raise max_length")
    shape = (len(prompts), len(cands), max_length)
    ids = np.full(shape, pad_id, np.int32)
    attention = np.zeros(shape, np.int32)
    option = np.zeros(shape, np.int32)
    for n, prompt in enumerate(prompts):
        p = _encode(tokenizer, prompt, "prompt")
        for c, cand in enumerate(cands):
            kept = p[max(0, len(p) + len(cand) - max_length):]
            seq = kept + cand
            ids[n, c, :len(seq)] = seq
            attention[n, c, :len(seq)] = 1
            option[n, c, len(kept):len(seq)] = 1
    return CandidateBatch(ids, attention, option)


def encode_prompts(tokenizer: TextEncoder, texts: Sequence[str], *, max_length: int,
                   pad_id: int, padding_side: str = "left") -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int32 ``(N, T = max_length)``, for generation.

    A text longer than ``max_length`` tokens keeps its LAST ``max_length`` tokens (the end of a
    prompt is what the next token depends on). Shorter ones are padded with ``pad_id`` on
    ``padding_side``: "left" (the default; every prompt then ends at position ``T - 1``, where
    generation continues) or "right" (the last real token is at ``attention_mask.sum(-1) - 1``).
    Raises ``ValueError`` for a text that encodes to no tokens.
    """
    _check_length(max_length)
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    ids = np.full((len(texts), max_length), pad_id, np.int32)
    mask = np.zeros((len(texts), max_length), np.int32)
    for n, text in enumerate(texts):
        seq = _encode(tokenizer, text, "prompt")[-max_length:]
        start = max_length - len(seq) if padding_side == "left" else 0
        cols = slice(start, start + len(seq))
        ids[n, cols] = seq
        mask[n, cols] = 1
    return ids, mask
