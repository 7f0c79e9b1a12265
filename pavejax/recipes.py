"""Tuned non-private training recipes: the references every private result is read against.

A :class:`Recipe` says what is trained (``"lora"`` factors plus a head, ``"full"`` weights plus a
head, or the ``"head"`` alone on frozen features) and how: AdamW with decoupled weight decay,
one learning rate for the body and one for the head, linear warm-up then a cosine or linear
decay to zero, a number of epochs over shuffled minibatches.

:func:`tuned` returns the package's preset for a task family (``"sentiment"``: ``movie``,
``amazon``, ``nyt``, ``tweets``; ``"topic"``: ``bbc``). The presets were chosen by
``python benchmarks/tasks_baseline.py --sweep`` on the **dev** splits of ``movie`` and
``tweets`` (sentiment) and ``bbc`` (topic) (all-MiniLM-L6-v2, 1,024 training examples per task,
64 tokens), before any test split was read (``amazon`` and ``nyt`` were not seen by the
choice); the sweep writes its table and the chosen recipes to JSON, and :func:`load_recipes`
reads such a file back, so a
user can re-run the choice on their own data and use it in place of the presets.

A private counterpart starts from the same recipe and changes only what privacy requires:
per-example clipping, noise, Poisson batch sampling, and a learning rate re-tuned under noise
(``Recipe.replace(learning_rate=...)``). The schedule, warm-up and weight decay carry over.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optax

__all__ = ["FAMILIES", "TRAINED", "Recipe", "family_of", "load_recipes", "save_recipes",
           "schedule", "tuned"]

TRAINED: tuple[str, ...] = ("lora", "full", "head")
SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
FAMILIES: Mapping[str, str] = {"movie": "sentiment", "amazon": "sentiment", "nyt": "sentiment",
                               "tweets": "sentiment", "bbc": "topic"}
# Short names of the linear layers of a BERT-style encoder, as LoRA targets.
TARGETS: Mapping[str, str] = {"query": "attention/query/kernel", "key": "attention/key/kernel",
                              "value": "attention/value/kernel",
                              "attn_out": "attention/output/kernel",
                              "ffn_in": "intermediate/kernel", "ffn_out": "/output/kernel"}


def schedule(kind: str, peak: float, total_steps: int,
             warmup_fraction: float = 0.0) -> optax.Schedule:
    """Linear warm-up from zero over ``round(warmup_fraction * total_steps)`` steps, then
    ``kind``: ``"cosine"`` or ``"linear"`` decay to zero at ``total_steps`` or ``"constant"``.
    ``peak`` may be a traced value (a learning-rate sweep under ``vmap``)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}.")
    total = _positive_int("total_steps", total_steps)
    if not 0 <= _nonneg_float("warmup_fraction", warmup_fraction) < 1:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction!r}.")
    warmup = int(round(warmup_fraction * total))
    if kind == "constant":
        decay = optax.constant_schedule(peak)
    elif kind == "linear":
        decay = optax.linear_schedule(peak, 0.0, max(total - warmup, 1))
    else:
        decay = optax.cosine_decay_schedule(peak, max(total - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def _nonneg_float(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}.")
    return v


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A non-private training recipe (see the module docstring).

    Attributes:
      trained: ``"lora"``, ``"full"`` or ``"head"``.
      learning_rate: peak AdamW rate of the body (LoRA factors or backbone weights); unused when
        only the head is trained.
      head_learning_rate: peak AdamW rate of the classification head.
      epochs: passes over the training set (remainder minibatch dropped).
      batch_size: minibatch size.
      warmup_fraction: share of the steps spent warming up linearly from zero, in [0, 1).
      schedule: decay after warm-up: ``"cosine"`` or ``"linear"`` (to zero at the last step) or
        ``"constant"``.
      weight_decay: AdamW decoupled weight decay (both groups).
      lora_rank, lora_alpha: rank and scale numerator of the factors (update
        ``(alpha / r) A B``).
      lora_targets: short names from ``TARGETS`` (``query``, ``key``, ``value``, ``attn_out``,
        ``ffn_in``, ``ffn_out``) of the linear layers that get factors, in every layer.
      train_a: whether ``A`` is trained as well as ``B`` (standard LoRA: both; PAVE's secret
        ``A`` is frozen, which is a private-spec requirement, not a recipe choice).
      source: how the recipe was chosen (free text, kept with it).
    """

    trained: str
    learning_rate: float
    head_learning_rate: float
    epochs: int
    batch_size: int
    warmup_fraction: float = 0.1
    schedule: str = "cosine"
    weight_decay: float = 0.01
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "value")
    train_a: bool = True
    source: str = ""

    def __post_init__(self):
        if self.trained not in TRAINED:
            raise ValueError(f"trained must be one of {TRAINED}, got {self.trained!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        _nonneg_float("learning_rate", self.learning_rate, positive=True)
        _nonneg_float("head_learning_rate", self.head_learning_rate, positive=True)
        _nonneg_float("weight_decay", self.weight_decay)
        _nonneg_float("lora_alpha", self.lora_alpha, positive=True)
        if not 0 <= _nonneg_float("warmup_fraction", self.warmup_fraction) < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}.")
        for name in ("epochs", "batch_size", "lora_rank"):
            _positive_int(name, getattr(self, name))
        targets = ((self.lora_targets,) if isinstance(self.lora_targets, str)
                   else tuple(self.lora_targets))
        unknown = [t for t in targets if t not in TARGETS]
        if not targets or unknown:
            raise ValueError(f"lora_targets must be a non-empty subset of {tuple(TARGETS)}, got "
                             f"{self.lora_targets!r}.")
        object.__setattr__(self, "lora_targets", targets)
        if not isinstance(self.train_a, bool):
            raise TypeError(f"train_a must be a bool, got {self.train_a!r}.")

    def replace(self, **changes: Any) -> Recipe:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def steps(self, n_train: int) -> int:
        """Optimiser steps over ``n_train`` examples: ``epochs * (n_train // batch_size)``."""
        _positive_int("n_train", n_train)
        if self.batch_size > n_train:
            raise ValueError(f"batch_size {self.batch_size} exceeds the {n_train} training "
                             f"examples; lower batch_size.")
        return self.epochs * (n_train // self.batch_size)

    def schedule_fn(self, peak: float, total_steps: int) -> optax.Schedule:
        """The learning-rate schedule of ``total_steps`` steps peaking at ``peak``."""
        return schedule(self.schedule, peak, total_steps, self.warmup_fraction)

    def optimizer(self, total_steps: int,
                  labels: Any | Callable[[Any], Any] = None) -> optax.GradientTransformation:
        """AdamW with this recipe's schedules.

        ``labels``: a pytree (or a function of the params giving one) of ``"body"``/``"head"``
        strings matching the trained params; ``None`` means every leaf is the head (a head-only
        recipe, or a private trainer that passes one group).
        """
        head = optax.adamw(self.schedule_fn(self.head_learning_rate, total_steps),
                           weight_decay=self.weight_decay)
        if labels is None:
            return head
        body = optax.adamw(self.schedule_fn(self.learning_rate, total_steps),
                           weight_decay=self.weight_decay)
        return optax.multi_transform({"body": body, "head": head}, labels)

    def lora_predicate(self) -> Callable[[str, Any], bool]:
        """``predicate(path, leaf)`` selecting this recipe's LoRA targets in an encoder."""
        suffixes = tuple(TARGETS[t] for t in self.lora_targets)

        def predicate(path: str, _leaf: Any) -> bool:
            if "attention/output/kernel" in path and "attn_out" not in self.lora_targets:
                return False
            return "/layers/" in f"/{path}" and path.endswith(suffixes)

        return predicate

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown recipe fields {unknown}; known: {sorted(fields)}.")
        d = dict(d)
        if "lora_targets" in d:
            d["lora_targets"] = tuple(d["lora_targets"])
        return cls(**d)


_SWEEP = ("chosen by `python benchmarks/tasks_baseline.py --sweep` on the dev splits of movie "
          "and tweets (sentiment) or bbc (topic): all-MiniLM-L6-v2, 1,024 train and 512 dev "
          "examples per task, 64 tokens; ")
_ALL = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")

# The presets: (family, trained) -> recipe. See the module docstring for how they were chosen.
_TUNED: dict[tuple[str, str], Recipe] = {
    ("sentiment", "lora"): Recipe("lora", 1e-3, 1e-2, epochs=3, batch_size=32,
                                  lora_targets=_ALL,
                                  source=_SWEEP + "candidate 4 of 5, mean dev accuracy 0.883"),
    ("topic", "lora"): Recipe("lora", 1e-3, 1e-2, epochs=3, batch_size=32, lora_targets=_ALL,
                              source=_SWEEP + "candidate 4 of 5, mean dev accuracy 0.978"),
    ("sentiment", "full"): Recipe("full", 1e-4, 1e-2, epochs=2, batch_size=32,
                                  source=_SWEEP + "candidate 2 of 3, mean dev accuracy 0.886"),
    ("topic", "full"): Recipe("full", 1e-4, 1e-2, epochs=2, batch_size=32,
                              source=_SWEEP + "candidate 2 of 3, mean dev accuracy 0.973"),
    ("sentiment", "head"): Recipe("head", 1e-2, 1e-2, epochs=20, batch_size=32,
                                  weight_decay=0.1,
                                  source=_SWEEP + "candidate 5 of 7, mean dev accuracy 0.847"),
    ("topic", "head"): Recipe("head", 1e-2, 3e-3, epochs=20, batch_size=32,
                              source=_SWEEP + "candidate 1 of 7, mean dev accuracy 0.969"),
}


def family_of(task: str) -> str:
    """The family of a task name, or the name itself when it is a family."""
    if task in set(FAMILIES.values()):
        return task
    if task not in FAMILIES:
        raise ValueError(f"no tuned recipe for task {task!r}; known tasks {sorted(FAMILIES)} "
                         f"and families {sorted(set(FAMILIES.values()))}. Run the sweep on your "
                         f"own data (benchmarks/tasks_baseline.py --sweep) or build a Recipe.")
    return FAMILIES[task]


def tuned(task: str, trained: str = "lora") -> Recipe:
    """The package's tuned non-private recipe for ``task`` (a task or family name)."""
    if trained not in TRAINED:
        raise ValueError(f"trained must be one of {TRAINED}, got {trained!r}.")
    return _TUNED[family_of(task), trained]


def save_recipes(path: str | Path, recipes: Mapping[str, Mapping[str, Recipe]],
                 extra: Mapping[str, Any] | None = None) -> None:
    """Writes ``{family: {trained: recipe}}`` (plus ``extra`` keys) as JSON."""
    doc = {"recipes": {fam: {t: r.to_dict() for t, r in by.items()}
                       for fam, by in recipes.items()}, **(extra or {})}
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def load_recipes(path: str | Path) -> dict[str, dict[str, Recipe]]:
    """Reads a file written by :func:`save_recipes`: ``{family: {trained: Recipe}}``."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("recipes"), dict):
        raise ValueError(f"{path} is not a recipe file: expected a JSON object with a "
                         f"'recipes' mapping (written by save_recipes or the sweep).")
    return {fam: {t: Recipe.from_dict(d) for t, d in by.items()}
            for fam, by in doc["recipes"].items()}
