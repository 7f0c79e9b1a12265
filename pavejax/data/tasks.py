"""Labelled tasks with deterministic, stratified train/dev/test splits.

A :class:`Task` holds three :class:`Split` s (text inputs as ``list[str]``, image inputs as
float32 arrays; labels always int32 in ``[0, num_classes)``) and a metadata mapping. Every
random choice here is a ``numpy.random.default_rng(seed)`` permutation taken class by class in
sorted class order, so the same seed gives the same split in every run and every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

Inputs = list[str] | np.ndarray


def _frozen_array(x: np.ndarray) -> np.ndarray:
    x = np.array(x, copy=True)
    x.flags.writeable = False
    return x


@dataclasses.dataclass(frozen=True)
class Split:
    """One split: ``inputs`` (``list[str]`` of length n, or a float32 array ``(n, d)``) and
    ``labels`` (int32, shape ``(n,)``). Arrays are stored read-only."""

    inputs: Inputs
    labels: np.ndarray

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels)
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise TypeError(f"labels must be a 1-D integer array, got {labels.dtype}{labels.shape}")
        if isinstance(self.inputs, np.ndarray):
            if self.inputs.dtype != np.float32 or self.inputs.ndim < 2:
                raise TypeError("array inputs must be float32 with shape (n, ...), got "
                                f"{self.inputs.dtype}{self.inputs.shape}; convert with "
                                ".astype(np.float32)")
            object.__setattr__(self, "inputs", _frozen_array(self.inputs))
        elif isinstance(self.inputs, list):
            if not all(isinstance(s, str) for s in self.inputs):
                raise TypeError("text inputs must be a list of str")
        else:
            raise TypeError(f"inputs must be list[str] or a float32 array, got "
                            f"{type(self.inputs).__name__}")
        if len(self.inputs) != labels.shape[0]:
            raise ValueError(f"{len(self.inputs)} inputs but {labels.shape[0]} labels")
        object.__setattr__(self, "labels", _frozen_array(labels.astype(np.int32)))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, indices: Sequence[int] | np.ndarray) -> Split:
        """The examples at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        if isinstance(self.inputs, np.ndarray):
            return Split(self.inputs[idx], self.labels[idx])
        return Split([self.inputs[i] for i in idx.tolist()], self.labels[idx])

    def counts(self, num_classes: int) -> tuple[int, ...]:
        """Examples per class, ``num_classes`` entries."""
        return tuple(int(c) for c in np.bincount(self.labels, minlength=num_classes))


@dataclasses.dataclass(frozen=True)
class Task:
    """A classification task: ``label_names[i]`` names label ``i``; ``train``/``dev``/``test``
    splits; ``metadata`` (read-only) records domain, source, seed and per-split class counts."""

    name: str
    label_names: tuple[str, ...]
    train: Split
    dev: Split
    test: Split
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "label_names", tuple(self.label_names))
        k = len(self.label_names)
        if k < 2:
            raise ValueError(f"task {self.name!r} needs at least 2 classes, got {k}")
        for split_name in ("train", "dev", "test"):
            split = getattr(self, split_name)
            if len(split) and (split.labels.min() < 0 or split.labels.max() >= k):
                raise ValueError(f"task {self.name!r}: {split_name} labels must lie in [0, {k})")
        meta = dict(self.metadata)
        meta["n_per_class"] = {s: dict(zip(self.label_names, getattr(self, s).counts(k)))
                               for s in ("train", "dev", "test")}
        object.__setattr__(self, "metadata", MappingProxyType(meta))

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    @property
    def modality(self) -> str:
        """``"text"`` or ``"image"``."""
        return "text" if isinstance(self.train.inputs, list) else "image"

    def replace(self, **changes: Any) -> Task:
        """A copy with fields replaced (metadata is merged, not overwritten)."""
        if "metadata" in changes:
            changes["metadata"] = {**self.metadata, **changes["metadata"]}
        return dataclasses.replace(self, **changes)


def _round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def stratified_split(labels: np.ndarray, *, dev_fraction: float = 0.1,
                     test_fraction: float = 0.2, seed: int = 0
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint, covering train/dev/test index arrays (int64), stratified by label.

    For each class in sorted order, its indices are permuted by one ``default_rng(seed)`` stream;
    the first ``test_fraction * n_c`` (rounded half up) go to test, the next
    ``dev_fraction * n_c`` (rounded half up) to dev, the rest to train. Each split is then
    shuffled by the same stream.
    """
    if not (0 <= dev_fraction < 1 and 0 <= test_fraction < 1 and dev_fraction + test_fraction < 1):
        raise ValueError("dev_fraction and test_fraction must be in [0, 1) with sum < 1, got "
                         f"{dev_fraction} and {test_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    parts: tuple[list, list, list] = ([], [], [])
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(idx.shape[0])]
        n_test = _round_half_up(test_fraction * idx.shape[0])
        n_dev = _round_half_up(dev_fraction * idx.shape[0])
        parts[2].append(idx[:n_test])
        parts[1].append(idx[n_test:n_test + n_dev])
        parts[0].append(idx[n_test + n_dev:])
    out = []
    for chunks in parts:
        idx = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        out.append(idx[rng.permutation(idx.shape[0])].astype(np.int64))
    return out[0], out[1], out[2]


def stratified_subsample(labels: np.ndarray, n: int, *, seed: int = 0) -> np.ndarray:
    """Indices (sorted, int64) of ``n`` examples keeping class proportions.

    Quotas are ``n * n_c / N`` rounded by largest remainder (ties to the smaller class id); the
    members of each class are a ``default_rng(seed)`` permutation prefix.
    """
    labels = np.asarray(labels)
    if not 0 <= n <= labels.shape[0]:
        raise ValueError(f"cannot keep {n} of {labels.shape[0]} examples")
    classes, counts = np.unique(labels, return_counts=True)
    exact = n * counts / labels.shape[0]
    quota = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - quota), kind="stable")
    quota[order[: n - int(quota.sum())]] += 1
    rng = np.random.default_rng(seed)
    keep = []
    for c, q in zip(classes, quota):
        idx = np.flatnonzero(labels == c)
        keep.append(idx[rng.permutation(idx.shape[0])[:q]])
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, np.int64)


def split_task(name: str, inputs: Inputs, labels: np.ndarray, label_names: Sequence[str], *,
               seed: int = 0, dev_fraction: float = 0.1, test_fraction: float = 0.2,
               metadata: Mapping[str, Any] | None = None) -> Task:
    """Build a :class:`Task` from a labelled pool with :func:`stratified_split`."""
    pool = Split(inputs, np.asarray(labels))
    train, dev, test = stratified_split(pool.labels, dev_fraction=dev_fraction,
                                        test_fraction=test_fraction, seed=seed)
    meta = {**(metadata or {}), "seed": seed, "dev_fraction": dev_fraction,
            "test_fraction": test_fraction}
    return Task(name, tuple(label_names), pool.take(train), pool.take(dev), pool.take(test), meta)


def limit_task(task: Task, *, max_train: int | None = None, max_dev: int | None = None,
               max_test: int | None = None, seed: int = 0) -> Task:
    """Cap each split's size with :func:`stratified_subsample` (order within a split kept)."""
    changes: dict[str, Any] = {}
    for split_name, cap in (("train", max_train), ("dev", max_dev), ("test", max_test)):
        split = getattr(task, split_name)
        if cap is not None and cap < 0:
            raise ValueError(f"max_{split_name} must be >= 0, got {cap}")
        if cap is not None and cap < len(split):
            changes[split_name] = split.take(stratified_subsample(split.labels, cap, seed=seed))
    return task.replace(**changes) if changes else task


def group_classes_task(base: Task, groups: Sequence[Sequence[int]], *, name: str,
                       label_names: Sequence[str] | None = None) -> Task:
    """Keep the examples whose label is in one of ``groups``; new label ``i`` = group ``i``.

    Splits stay those of ``base`` (so a derived task never tests on another derived task's
    training examples). Groups must be disjoint, non-empty, and hold valid labels of ``base``.
    """
    flat = [int(c) for g in groups for c in g]
    if len(groups) < 2 or any(len(g) == 0 for g in groups):
        raise ValueError(f"need at least 2 non-empty class groups, got {groups!r}")
    if len(set(flat)) != len(flat) or not all(0 <= c < base.num_classes for c in flat):
        raise ValueError(f"class groups {groups!r} must be disjoint labels of task "
                         f"{base.name!r} (0..{base.num_classes - 1})")
    if label_names is None:
        label_names = ["+".join(base.label_names[c] for c in g) for g in groups]
    if len(label_names) != len(groups):
        raise ValueError(f"{len(label_names)} label names for {len(groups)} groups")
    lut = np.full(base.num_classes, -1, np.int32)
    for i, g in enumerate(groups):
        lut[list(g)] = i
    splits = {}
    for split_name in ("train", "dev", "test"):
        split = getattr(base, split_name)
        keep = np.flatnonzero(lut[split.labels] >= 0)
        kept = split.take(keep)
        splits[split_name] = Split(kept.inputs, lut[kept.labels])
    meta = {**base.metadata, "base_task": base.name,
            "class_groups": [[base.label_names[c] for c in g] for g in groups]}
    return Task(name, tuple(label_names), metadata=meta, **splits)


def class_subset_task(base: Task, classes: Sequence[int], *, name: str) -> Task:
    """Keep only labels ``classes`` of ``base`` and relabel ``classes[i] -> i``."""
    return group_classes_task(base, [[c] for c in classes], name=name)


def few_shot(task: Task, shots_per_class: int, seed: int = 0) -> Task:
    """``task`` with its train split cut to ``shots_per_class`` examples of every class
    (a ``default_rng(seed)`` choice per class, then shuffled); dev and test unchanged."""
    if shots_per_class < 1:
        raise ValueError(f"shots_per_class must be >= 1, got {shots_per_class}")
    counts = task.train.counts(task.num_classes)
    short = {task.label_names[c]: n for c, n in enumerate(counts) if n < shots_per_class}
    if short:
        raise ValueError(f"task {task.name!r} has too few training examples for "
                         f"{shots_per_class} shots per class: {short}; lower shots_per_class")
    rng = np.random.default_rng(seed)
    keep = []
    for c in range(task.num_classes):
        idx = np.flatnonzero(task.train.labels == c)
        keep.append(idx[rng.permutation(idx.shape[0])[:shots_per_class]])
    idx = np.concatenate(keep)
    train = task.train.take(idx[rng.permutation(idx.shape[0])])
    return task.replace(train=train, metadata={"shots_per_class": shots_per_class,
                                               "few_shot_seed": seed})


def task_fingerprint(task: Task) -> str:
    """sha256 hex over the name, label names and every split's inputs and labels."""
    h = hashlib.sha256(task.name.encode() + b"\0" + "\0".join(task.label_names).encode())
    for split_name in ("train", "dev", "test"):
        split = getattr(task, split_name)
        h.update(split_name.encode())
        if isinstance(split.inputs, np.ndarray):
            h.update(str(split.inputs.shape).encode())
            h.update(np.ascontiguousarray(split.inputs).tobytes())
        else:
            for s in split.inputs:
                h.update(s.encode("utf-8") + b"\0")
        h.update(np.ascontiguousarray(split.labels, dtype="<i4").tobytes())
    return h.hexdigest()
