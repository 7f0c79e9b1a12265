"""The demo developers' private learning rate, re-tuned under noise on the dev splits.

A private counterpart of a tuned non-private recipe keeps its optimiser, schedule and weight
decay and changes what privacy requires (clipping, noise, Poisson batches) plus the peak
learning rate, which noise moves. This benchmark re-tunes that rate for the demo's developers
(:func:`pavejax.lifecycle.train_developer`: a linear head on frozen all-MiniLM-L6-v2 features,
DP-SAM at the demo's epsilon, the task's tuned ``"head"`` recipe): for every candidate peak
rate it trains each developer task ``draws`` times (independent noise and sampling keys) and
scores the **dev** split; the rate with the best mean dev accuracy is chosen. The test splits
are not read. The non-private recipe itself (no clipping, no noise, shuffled minibatches, the
recipe's own rate and epochs) is scored on the same dev splits as the reference row.

Rows: task, rate, mean dev accuracy over draws and its standard deviation (and the ``recipe``
row). Summary: ``chosen_lr``, ``dev_<rate>`` (mean over tasks), ``dev_recipe_nonprivate``.
``--quick``: two tasks, two rates, one draw, 64 steps.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

import _common
import jax
import jax.numpy as jnp
import numpy as np

from pavejax import lifecycle, recipes
from pavejax.data import load_task


@dataclasses.dataclass(frozen=True)
class Settings:
    """Candidates and draws; the demo's developer settings come from ``LifecycleConfig``."""

    rates: tuple[float, ...] = (3e-3, 1e-2, 3e-2, 1e-1)
    draws: int = 3
    dev_size: int = 256
    lifecycle: lifecycle.LifecycleConfig = lifecycle.LifecycleConfig(progress=False)


QUICK = Settings(rates=(1e-2, 3e-2), draws=1, dev_size=64,
                 lifecycle=lifecycle.LifecycleConfig(developers=("movie", "bbc"), dev_steps=64,
                                                     progress=False))


def _dev(cfg: lifecycle.LifecycleConfig, task: str, dev_size: int):
    t = load_task(task, seed=cfg.seed, max_train=cfg.dev_train, max_dev=dev_size)
    return t, lifecycle._data(t.dev.inputs, t.dev.labels, cfg.seq_len)


def nonprivate_recipe_accuracy(cfg: lifecycle.LifecycleConfig, task: str, dev: dict) -> float:
    """The tuned head recipe without privacy on the developer's training data (dev accuracy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tasks_baseline

    t = load_task(task, seed=cfg.seed, max_train=cfg.dev_train)
    train = lifecycle._data(t.train.inputs, t.train.labels, cfg.seq_len)
    recipe = recipes.tuned(task, "head")
    head = tasks_baseline.fit_head(train["x"], train["y"], len(t.label_names), recipe, cfg.seed)
    pred = jnp.argmax(dev["x"] @ head["w"] + head["b"][None, :], -1)
    return float(np.mean(np.asarray(pred) == np.asarray(dev["y"])))


def run(s: Settings) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    cfg = s.lifecycle
    rows, per_rate = [], {}
    reference = []
    for task in cfg.developers:
        t, dev = _dev(cfg, task, s.dev_size)
        classes = tuple(t.label_names)
        acc_np = nonprivate_recipe_accuracy(cfg, task, dev)
        reference.append(acc_np)
        rows.append({"task": task, "learning_rate": "recipe (non-private)",
                     "dev_accuracy": acc_np, "dev_std": 0.0})
        for lr in s.rates:
            c = dataclasses.replace(cfg, dev_lr=lr)
            accs = []
            for d in range(s.draws):
                key = jax.random.key(1000 + d)  # benchmark draws: replayable by design
                params, *_ = lifecycle.train_developer(c, task, noise_key=key)
                accs.append(lifecycle._accuracy(params, dev, classes, classes))
            per_rate.setdefault(lr, []).append(statistics.fmean(accs))
            rows.append({"task": task, "learning_rate": lr, "dev_accuracy": statistics.fmean(accs),
                         "dev_std": statistics.stdev(accs) if len(accs) > 1 else 0.0})
    means = {lr: statistics.fmean(v) for lr, v in per_rate.items()}
    chosen = max(s.rates, key=lambda lr: means[lr])
    summary = {"chosen_lr": chosen, **{f"dev_{lr:g}": m for lr, m in means.items()},
               "dev_recipe_nonprivate": statistics.fmean(reference),
               "epsilon": cfg.dev_target_epsilon}
    config = {"rates": list(s.rates), "draws": s.draws, "dev_size": s.dev_size,
              "developers": list(cfg.developers), "dev_steps": cfg.dev_steps,
              "dev_batch": cfg.dev_batch, "dev_target_epsilon": cfg.dev_target_epsilon,
              "dev_mode": cfg.dev_mode, "dev_l2_clip": cfg.dev_l2_clip, "seq_len": cfg.seq_len,
              "recipes": {t: recipes.tuned(t, "head").to_dict() for t in cfg.developers}}
    return config, rows, summary


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv)
    config, rows, summary = run(QUICK if args.quick else Settings())
    return _common.emit("private_lr", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
