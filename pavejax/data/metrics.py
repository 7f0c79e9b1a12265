"""Scoring predictions against labelled tasks: accuracy by class identity and ranking metrics.

:func:`class_identity_accuracy` scores a model on a task whose label space may differ from the
model's. Identification methods (PAVE, RKME, random) produce a score matrix (users x models);
:func:`ranking_metrics` compares it with a measured accuracy matrix (e.g. the one of
:func:`pavejax.experiments.evaluate_market`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def class_identity_accuracy(logits: np.ndarray, model_classes: Sequence[str],
                            labels: np.ndarray, user_classes: Sequence[str]) -> float:
    """Accuracy of a model on a user's labelled examples, matching classes by name.

    The user knows its label space, so the model's prediction is the argmax of its logits
    (n, len(model_classes)) restricted to the classes it shares with the user (ties: first in
    model order). A model sharing no class scores 0; one sharing some can only be right on those.
    ``labels`` (n,) index ``user_classes``.
    """
    logits, labels = np.asarray(logits), np.asarray(labels)
    if logits.ndim != 2 or logits.shape != (labels.shape[0], len(model_classes)):
        raise ValueError(f"logits must have shape (n, {len(model_classes)}) with n = "
                         f"{labels.shape[0]} labels, got {logits.shape}")
    if labels.shape[0] == 0:
        raise ValueError("cannot score a model on an empty test set")
    shared = [i for i, c in enumerate(model_classes) if c in user_classes]
    if not shared:
        return 0.0
    predicted = np.asarray(shared)[np.argmax(logits[:, shared], axis=1)]
    predicted_names = np.asarray(model_classes, dtype=object)[predicted]
    true_names = np.asarray(user_classes, dtype=object)[labels]
    return float(np.mean(predicted_names == true_names))


def oracle_best(accuracy: np.ndarray) -> np.ndarray:
    """Index (n_users,) int64 of the most accurate developer per user (first one if tied)."""
    return np.argmax(np.asarray(accuracy), axis=1).astype(np.int64)


class RankingMetrics(NamedTuple):
    """Means over users, and the per-user values (n_users,) they average."""

    top1_hit_rate: float
    regret: float
    mrr: float
    hits: np.ndarray
    regrets: np.ndarray
    reciprocal_ranks: np.ndarray


def ranking_metrics(scores: np.ndarray, accuracy: np.ndarray, *,
                    atol: float = 0.0) -> RankingMetrics:
    """Score an identification method: ``scores`` (n_users, n_dev), higher = more relevant.

    Oracle models of user u: accuracy within ``atol`` of the row maximum (ties allowed). Ties in
    ``scores`` count against the method: among the top-scored models the least accurate is the
    one chosen. Per user: hit = the chosen model is an oracle model; regret = oracle accuracy -
    chosen accuracy; reciprocal rank = 1 / (1 + number of non-oracle models scored at least as
    high as the best-scored oracle model).
    """
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol!r}")
    s, a = np.asarray(scores, np.float64), np.asarray(accuracy, np.float64)
    if s.ndim != 2 or s.shape != a.shape or 0 in s.shape:
        raise ValueError(f"scores and accuracy must be non-empty (n_users, n_developers) arrays "
                         f"of one shape, got {s.shape} and {a.shape}")
    if not (np.isfinite(s).all() and np.isfinite(a).all()):
        raise ValueError("scores and accuracy must be finite (no NaN or inf)")
    best = a.max(axis=1)
    oracle = a >= (best - atol)[:, None]
    top = s == s.max(axis=1)[:, None]
    chosen = np.where(top, a, np.inf).min(axis=1)
    best_oracle_score = np.where(oracle, s, -np.inf).max(axis=1)
    ahead = (~oracle & (s >= best_oracle_score[:, None])).sum(axis=1)
    hits = chosen >= best - atol
    regrets, rr = best - chosen, 1.0 / (1.0 + ahead)
    return RankingMetrics(float(hits.mean()), float(regrets.mean()), float(rr.mean()),
                          hits, regrets, rr)
