"""``pavejax demo``: the private learnware lifecycle end to end (see :mod:`pavejax.lifecycle`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from pavejax.lifecycle import LifecycleConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LifecycleConfig()
    p.description = (
        "Four developers fine-tune task models with DP-Merging and release DP-S-PAVE specs to a "
        "dock; a user with a small private task searches the dock, merges the top models and "
        "adapts the result with PACZero-ZPL. Writes report.md, summary.json and plots.")
    p.add_argument("--out", type=Path, default=Path(d.out_dir),
                   help="output folder for report.md, summary.json, plots and the dock")
    p.add_argument("--dock", type=Path, default=None,
                   help="use this dock directory (created if missing; developers already in "
                        "it are reused instead of retrained)")
    p.add_argument("--epsilon", type=float, default=d.dev_target_epsilon,
                   help="developers' DP-Merging budget: (epsilon, delta)-DP of each developer "
                        "model with respect to replacing one of its training examples "
                        "(dataset sizes are public); smaller means more noise and stronger "
                        "privacy")
    p.add_argument("--spec-epsilon", type=float, default=d.spec_target_epsilon,
                   help="DP-S-PAVE budget of each released spec: (epsilon, delta)-DP with "
                        "respect to replacing one training example (the report also composes "
                        "it with the model's budget, replace-one)")
    p.add_argument("--delta", type=float, default=d.delta,
                   help="the delta of every (epsilon, delta) guarantee (keep it below 1/n)")
    p.add_argument("--user-task", default=d.user_task,
                   help="the user's private task (a sentiment domain no developer trained on)")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu", "tpu"), default="auto",
                   help="JAX platform to run on (auto: the best available)")
    p.add_argument("--full", action="store_true",
                   help="scale up: more data, longer training, all layers in the specs "
                        "(sized for an accelerator)")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings for a smoke test (seconds to a minute; numbers mean "
                        "little)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every random choice")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON on stdout (the stage log goes to stderr)")


def config_from_args(ns: argparse.Namespace) -> LifecycleConfig:
    """The :class:`LifecycleConfig` the flags describe."""
    common = dict(dev_target_epsilon=ns.epsilon, spec_target_epsilon=ns.spec_epsilon,
                  delta=ns.delta, user_task=ns.user_task, seed=ns.seed, out_dir=str(ns.out),
                  dock_dir=None if ns.dock is None else str(ns.dock))
    if ns.full:
        return LifecycleConfig.full(**common)
    cfg = LifecycleConfig(**common)
    if ns.quick:
        cfg = dataclasses.replace(cfg, seq_len=16, dev_train=64, dev_test=64, user_shots=4,
                                  user_pool=32, user_test=64, dev_steps=5, dev_batch=8,
                                  spec_examples=16, zo_steps=4, zo_subsets=4, progress=False)
    return cfg


def run(ns: argparse.Namespace) -> int:
    if ns.backend != "auto":
        os.environ["JAX_PLATFORMS"] = ns.backend
        import jax

        jax.config.update("jax_platforms", ns.backend)
    from pavejax.lifecycle import run_lifecycle

    if getattr(ns, "json", False):
        import json

        summary = run_lifecycle(config_from_args(ns),
                                log=lambda msg: print(msg, file=sys.stderr, flush=True))
        print(json.dumps(summary, indent=2, default=float))
    else:
        run_lifecycle(config_from_args(ns))
    return 0
