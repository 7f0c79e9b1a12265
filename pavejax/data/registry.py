"""Named task suites: ``load_task(name)`` and ``list_tasks()``.

Text: ``movie``, ``amazon``, ``nyt``, ``tweets`` (binary sentiment, same label space, different
domains) and ``bbc`` (5-way news topics). Images, for ``digits`` and ``mnist5k``: the 10-way
base task, ``*_pretrain`` (classes 0-4), ``*_5to9`` (classes 5-9 relabelled 0-4),
``*_even_odd`` (all digits, even = 0, odd = 1) and the pairs ``*_pair_5_6``, ``*_pair_7_9``,
``*_pair_8_9``. Derived image tasks are cut from the base task's splits, so no derived task
tests on examples that another one of the same seed trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pavejax.data import text, vision
from pavejax.data.files import task_from_rows
from pavejax.data.tasks import Task, group_classes_task, limit_task, split_task


@dataclass(frozen=True)
class TaskInfo:
    """A registered task: ``build(seed, dev_fraction, test_fraction, options) -> Task``."""

    name: str
    modality: str
    description: str
    build: Callable[[int, float, float, dict[str, Any]], Task]


_REGISTRY: dict[str, TaskInfo] = {}


def _register(name: str, modality: str, description: str,
              build: Callable[[int, float, float, dict[str, Any]], Task]) -> None:
    _REGISTRY[name] = TaskInfo(name, modality, description, build)


# The text tasks are named instances of the loader of the user's own files
# (pavejax.data.files.task_from_rows: the same checks, class encoding and split).

def _sentiment_builder(domain: str) -> Callable[[int, float, float, dict[str, Any]], Task]:
    def build(seed: int, dev: float, test: float, options: dict[str, Any]) -> Task:
        texts, labels, meta = text.load_sentiment(domain, options.pop("min_abs_rating", 0.5))
        return task_from_rows(domain, list(texts), np.asarray(labels).tolist(),
                              classes=text.SENTIMENT_LABELS, seed=seed, dev_fraction=dev,
                              test_fraction=test, metadata=meta)
    return build


def _bbc(seed: int, dev: float, test: float, options: dict[str, Any]) -> Task:
    texts, labels, classes, meta = text.load_bbc()
    return task_from_rows("bbc", list(texts), np.asarray(labels).tolist(), classes=classes,
                          seed=seed, dev_fraction=dev, test_fraction=test, metadata=meta)


_IMAGE_LOADERS = {"digits": vision.load_digits, "mnist5k": vision.load_mnist5k}


def _image_builder(base: str, groups: list[list[int]] | None, name: str,
                   label_names: tuple[str, ...] | None = None
                   ) -> Callable[[int, float, float, dict[str, Any]], Task]:
    def build(seed: int, dev: float, test: float, options: dict[str, Any]) -> Task:
        x, y, meta = _IMAGE_LOADERS[base]()
        full = split_task(base, x, y, vision.DIGIT_LABELS, seed=seed, dev_fraction=dev,
                          test_fraction=test, metadata=meta)
        if groups is None:
            return full
        return group_classes_task(full, groups, name=name, label_names=label_names)
    return build


for _d, _spec in text.SENTIMENT_DOMAINS.items():
    _register(_d, "text", f"binary sentiment, {_spec.description} (VADER/ICWSM-2014)",
              _sentiment_builder(_d))
_register("bbc", "text", "5-way topic, BBC News articles", _bbc)

_DERIVED = {
    "pretrain": ([[c] for c in range(5)], None, "digits 0-4"),
    "5to9": ([[c] for c in range(5, 10)], None, "digits 5-9 relabelled 0-4"),
    "even_odd": ([[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]], ("even", "odd"), "even (0) vs odd (1)"),
    "pair_5_6": ([[5], [6]], None, "5 vs 6"),
    "pair_7_9": ([[7], [9]], None, "7 vs 9"),
    "pair_8_9": ([[8], [9]], None, "8 vs 9"),
}
for _base in _IMAGE_LOADERS:
    _register(_base, "image", f"10-way {_base}", _image_builder(_base, None, _base))
    for _suffix, (_groups, _names, _desc) in _DERIVED.items():
        _n = f"{_base}_{_suffix}"
        _register(_n, "image", f"{_base}: {_desc}", _image_builder(_base, _groups, _n, _names))


def list_tasks(modality: str | None = None) -> tuple[str, ...]:
    """Names accepted by :func:`load_task`, optionally only ``"text"`` or ``"image"`` ones."""
    if modality not in (None, "text", "image"):
        raise ValueError(f"modality must be None, 'text' or 'image', got {modality!r}")
    return tuple(n for n, info in _REGISTRY.items() if modality in (None, info.modality))


def task_info(name: str) -> TaskInfo:
    """Registry entry of ``name`` (``ValueError`` listing the known names if unknown)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def load_task(name: str, *, seed: int = 0, max_train: int | None = None,
              max_dev: int | None = None, max_test: int | None = None,
              dev_fraction: float = 0.1, test_fraction: float = 0.2,
              min_abs_rating: float | None = None) -> Task:
    """Load registered task ``name`` with deterministic stratified splits.

    Args:
      seed: split seed; the same seed gives identical splits in every run and process.
      max_train, max_dev, max_test: optional caps, applied by stratified subsampling.
      dev_fraction, test_fraction: share of each class put in dev / test (rounded per class).
      min_abs_rating: sentiment tasks only; sentences with ``|rating| < min_abs_rating`` (and
        rating 0) are dropped before splitting. Default 0.5.

    Raises ``ValueError`` for an unknown name or an option the task does not take, and
    :class:`pavejax.assets.AssetMissingError` when the task's data is not installed.
    """
    info = task_info(name)
    options: dict[str, Any] = {}
    if min_abs_rating is not None:
        if name not in text.SENTIMENT_DOMAINS:
            raise ValueError(f"min_abs_rating applies to the sentiment tasks "
                             f"({', '.join(text.SENTIMENT_DOMAINS)}), not to {name!r}")
        options["min_abs_rating"] = float(min_abs_rating)
    task = info.build(seed, dev_fraction, test_fraction, options)
    return limit_task(task, max_train=max_train, max_dev=max_dev, max_test=max_test, seed=seed)
