"""Reusing the learnwares a search found: top-1, top-1 + fine-tune, top-K ensemble, top-K merge.

A model here is a params pytree plus ``apply_fn(params, inputs) -> logits (n, len(classes))``
and its class names ``classes`` (output order). The user's task has its own class names
``user_classes``; models and user are matched **by class name**, so a model trained on
("neg", "pos") serves a user with ("pos", "neg", "neutral") on the two classes they share.

Strategies (reference notes, choice C6): (a) top-1 zero-shot and (b) top-1 fine-tuned on the
user's few shots (PAVE's own protocol); (c) top-K averaging of class probabilities (the
learnware package's ``AveragingReuser``, ``vote_by_prob``); (d) top-K merge with a model-merging
operator (an extension: needs models that share one base and one head layout).

Privacy: reuse runs on the user's side; fine-tuning reads the user's few shots without noise,
so the fine-tuned model is not private with respect to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pavejax.data.metrics import class_identity_accuracy
from pavejax.merging.operators import OPERATORS, task_vectors
from pavejax.optim import promotion_safe

__all__ = ["STRATEGIES", "Reused", "class_probabilities", "ensemble_topk", "few_shot_loss",
           "finetune_top1", "merge_topk", "predict_top1", "reuse_models", "user_accuracy"]

STRATEGIES = ("top1", "top1_finetune", "topk_ensemble", "topk_merge")
PyTree = Any
ApplyFn = Callable[[PyTree, Any], Any]


class Reused(NamedTuple):
    """The reused model(s). ``predict(inputs)`` gives (n, len(user_classes)) float32
    probabilities over the user's classes. ``params`` is one pytree (top-1, fine-tuned,
    merged) or a tuple of pytrees (ensemble); ``classes`` likewise."""

    strategy: str
    ids: tuple[int, ...]
    names: tuple[str, ...]
    params: Any
    classes: Any
    predict: Callable[[Any], np.ndarray]


def class_probabilities(logits: Any, classes: Sequence[str],
                        user_classes: Sequence[str]) -> np.ndarray:
    """Softmax of ``logits`` (n, len(classes)) over the model's classes, read out at the user's
    classes by name: (n, len(user_classes)) float32, 0 for classes the model lacks (rows are
    not renormalised)."""
    logits = np.asarray(jax.device_get(logits), np.float64)
    if logits.ndim != 2 or logits.shape[1] != len(classes):
        raise ValueError(f"logits must have shape (n, {len(classes)}) for classes {classes}, "
                         f"got {logits.shape}")
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    out = np.zeros((logits.shape[0], len(user_classes)))
    position = {c: i for i, c in enumerate(classes)}
    for j, c in enumerate(user_classes):
        if c in position:
            out[:, j] = p[:, position[c]]
    return out.astype(np.float32)


def _shared(classes_list: Sequence[Sequence[str]], user_classes: Sequence[str]) -> None:
    if not any(set(c) & set(user_classes) for c in classes_list):
        raise ValueError(f"none of the models predicts any of the user's classes "
                         f"{tuple(user_classes)} (models have {[tuple(c) for c in classes_list]}); "
                         f"they cannot be reused for this task")


def ensemble_topk(params_list: Sequence[PyTree], apply_fn: ApplyFn | Sequence[ApplyFn],
                  inputs: Any, classes_list: Sequence[Sequence[str]],
                  user_classes: Sequence[str]) -> np.ndarray:
    """Average of the models' :func:`class_probabilities`, rows renormalised to sum to 1:
    (n, len(user_classes)) float32. A model contributes 0 to classes it lacks."""
    if len(params_list) == 0 or len(params_list) != len(classes_list):
        raise ValueError(f"need one classes list per model, got {len(params_list)} models and "
                         f"{len(classes_list)} class lists")
    fns = list(apply_fn) if isinstance(apply_fn, Sequence) else [apply_fn] * len(params_list)
    _shared(classes_list, user_classes)
    probs = np.mean([class_probabilities(f(p, inputs), c, user_classes)
                     for f, p, c in zip(fns, params_list, classes_list, strict=True)], axis=0)
    return (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)


def predict_top1(params: PyTree, apply_fn: ApplyFn, inputs: Any, classes: Sequence[str],
                 user_classes: Sequence[str]) -> np.ndarray:
    """One model's probabilities over the user's classes (renormalised over those it shares)."""
    return ensemble_topk([params], apply_fn, inputs, [classes], user_classes)


def user_accuracy(probs: np.ndarray, labels: np.ndarray, user_classes: Sequence[str]) -> float:
    """Accuracy of probabilities (n, len(user_classes)) on ``labels`` (n,) indexing
    ``user_classes`` (class-identity scoring of :func:`pavejax.data.class_identity_accuracy`)."""
    return class_identity_accuracy(probs, tuple(user_classes), np.asarray(labels),
                                   tuple(user_classes))


def _shared_examples(inputs: Any, labels: Any, classes: Sequence[str],
                     user_classes: Sequence[str]) -> tuple[Any, np.ndarray]:
    labels = np.asarray(labels)
    position = {c: i for i, c in enumerate(classes)}
    target = np.array([position.get(user_classes[y], -1) for y in labels], np.int32)
    keep = target >= 0
    if not keep.any():
        raise ValueError(f"no few-shot example has a class the model predicts (model classes "
                         f"{tuple(classes)}, user classes {tuple(user_classes)})")
    return jax.tree.map(lambda x: np.asarray(x)[keep], inputs), target[keep]


def _ce(apply_fn: ApplyFn, params: PyTree, inputs: Any, target: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(jnp.asarray(apply_fn(params, inputs), jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, target[:, None], axis=1))


def few_shot_loss(params: PyTree, apply_fn: ApplyFn, inputs: Any, labels: Any,
                  classes: Sequence[str], user_classes: Sequence[str]) -> float:
    """Mean cross-entropy (nats) of the model on the few-shot examples whose class it has."""
    x, t = _shared_examples(inputs, labels, classes, user_classes)
    return float(_ce(apply_fn, params, x, jnp.asarray(t)))


def finetune_top1(params: PyTree, apply_fn: ApplyFn, few_shot_inputs: Any, labels: Any,
                  classes: Sequence[str], user_classes: Sequence[str], *, steps: int = 50,
                  learning_rate: float = 1e-3) -> PyTree:
    """Fine-tune all (floating) params with full-batch Adam on the cross-entropy of the
    few-shot examples of classes the model shares with the user (labels mapped by name);
    returns the new params (JAX arrays). Non-private in the few shots."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    x, t = _shared_examples(few_shot_inputs, labels, classes, user_classes)
    params = jax.tree.map(jnp.asarray, params)
    tx = promotion_safe(optax.adam(learning_rate))

    @jax.jit
    def step(p, state):
        grads = jax.grad(lambda q: _ce(apply_fn, q, x, jnp.asarray(t)))(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    state = tx.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params


def merge_topk(base: PyTree, params_list: Sequence[PyTree], op: str = "ties",
               **hyper: Any) -> PyTree:
    """Merge fine-tuned ``params_list`` (all of ``base``'s structure) with the merging operator
    ``op`` (a key of :data:`pavejax.merging.operators.OPERATORS`) on task vectors relative to
    ``base``; ``hyper`` goes to the operator (e.g. ``density`` for TIES)."""
    if op not in OPERATORS:
        raise ValueError(f"unknown merge operator {op!r}; choose one of {sorted(OPERATORS)}")
    if len(params_list) == 0:
        raise ValueError("params_list is empty; pass at least one model")
    want = jax.tree.structure(base)
    shapes = [np.shape(x) for x in jax.tree.leaves(base)]
    for i, p in enumerate(params_list):
        if jax.tree.structure(p) != want or [np.shape(x) for x in jax.tree.leaves(p)] != shapes:
            raise ValueError(f"model {i} does not have the structure and leaf shapes of base "
                             f"({want}); only models fine-tuned from the same base with the "
                             f"same head can be merged")
    base = jax.tree.map(jnp.asarray, base)
    tvs = task_vectors(base, [jax.tree.map(jnp.asarray, p) for p in params_list])
    return OPERATORS[op](base, tvs, **hyper)


def reuse_models(strategy: str, params_list: Sequence[PyTree],
                 classes_list: Sequence[Sequence[str]], apply_fn: ApplyFn,
                 user_classes: Sequence[str], *, ids: Sequence[int] = (),
                 names: Sequence[str] = (), few_shot: tuple[Any, Any] | None = None,
                 base: PyTree = None, finetune_steps: int = 50, learning_rate: float = 1e-3,
                 merge_op: str = "ties", merge_hyper: dict[str, Any] | None = None) -> Reused:
    """Apply ``strategy`` (one of :data:`STRATEGIES`) to ranked models (best first).

    ``top1_finetune`` needs ``few_shot = (inputs, labels)``; ``topk_merge`` needs ``base`` and
    models with identical ``classes``.
    """
    user_classes = tuple(user_classes)
    ids, names = tuple(ids), tuple(names)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "topk_ensemble":
        ps, cs = tuple(params_list), tuple(tuple(c) for c in classes_list)
        return Reused(strategy, ids, names, ps, cs,
                      lambda x: ensemble_topk(ps, apply_fn, x, cs, user_classes))
    if strategy == "topk_merge":
        if base is None:
            raise ValueError("topk_merge needs base= (the shared pretrained params)")
        if len({tuple(c) for c in classes_list}) != 1:
            raise ValueError(f"topk_merge needs models with the same classes in the same order, "
                             f"got {[tuple(c) for c in classes_list]}; use topk_ensemble")
        params = merge_topk(base, params_list, merge_op, **(merge_hyper or {}))
    elif strategy == "top1_finetune":
        if few_shot is None:
            raise ValueError("top1_finetune needs few_shot=(inputs, labels)")
        params = finetune_top1(params_list[0], apply_fn, few_shot[0], few_shot[1],
                               classes_list[0], user_classes, steps=finetune_steps,
                               learning_rate=learning_rate)
    else:
        params = params_list[0]
    classes = tuple(classes_list[0])
    _shared([classes], user_classes)
    return Reused(strategy, ids, names, params, classes,
                  lambda x: predict_top1(params, apply_fn, x, classes, user_classes))
