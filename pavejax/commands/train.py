"""``pavejax train``: DP-Merging fine-tuning of a task model, written as a model release.

The model is a classification head on frozen pooled features (all-MiniLM-L6-v2, mean, unless
``--backbone``/``--pooling``),
started from the public label-keyed head of its label space (so models of one label space
merge), trained with DP-SAM (``--mode``) plus the anchor to the public start
(:func:`pavejax.lifecycle.train_developer`, :mod:`pavejax.merging.train`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pavejax.commands import _shared as sh

DESCRIPTION = (
    "Fine-tune a task model with DP-Merging (DP sharpness-aware steps + anchor to the public "
    "start) and write a model release with its ledger, guarantee and risk bounds. Privacy: the "
    "release is (epsilon, delta)-differentially private with respect to replacing one "
    "training example of TASK or of the --data file (replace-one neighbouring), against "
    "anyone who sees the release. "
    "The number of training examples and the sampling rate are public (the release states "
    "them) and not protected; that is why the figure is replace-one, not add/remove. "
    "The test split, used only to report accuracy, is read without noise and is not covered. "
    + sh.NOISE_SECRET)

_MODE_HELP = {
    "same": "SAM ascent on the same Poisson batch as the descent (two Gaussian queries per step, "
            "accounted as one composed event per sampled batch)",
    "fresh": "ascent on a fresh Poisson batch (2K subsampled Gaussian queries)",
    "reuse": "ascent along the previous step's private gradient (no extra privacy cost)",
    "none": "plain DP-AdamW (no ascent)",
    "random": "random ascent direction (ablation; no extra privacy cost)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION, _MODE_HELP, "modes")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help=f"a built-in private training task "
                                       f"({', '.join(sh.TEXT_TASKS)})")
    source.add_argument("--data", type=Path, help="the private training data: " + sh.DATA_HELP)
    sh.add_data_file_arguments(p)
    p.add_argument("--recipe", choices=("sentiment", "topic"), default=None,
                   help="with --data: the tuned head recipe family (warm-up, decay, weight "
                        "decay; default: sentiment for 2 classes, topic for more)")
    p.add_argument("--epsilon", type=sh.positive_float, required=True,
                   help="privacy budget: the noise is calibrated so that the whole run, every "
                        "SAM query included, is (epsilon, --delta)-DP for one training example "
                        "replaced (PLD accountant). Smaller is more private. 'inf' "
                        "trains without noise and releases with guarantee 'none'")
    p.add_argument("--delta", type=float, default=1e-5, help=sh.DELTA_HELP)
    p.add_argument("--mode", choices=tuple(_MODE_HELP), default="same",
                   help="DP-SAM ascent mode (see below; each is accounted exactly)")
    p.add_argument("--steps", type=sh.positive_int, default=300, help="optimiser steps")
    p.add_argument("--batch-size", type=sh.positive_int, default=32,
                   help="expected Poisson batch size (sampling rate q = batch / train size)")
    p.add_argument("--train-size", type=sh.positive_int, default=512,
                   help="private training examples (stratified subsample)")
    p.add_argument("--test-size", type=sh.positive_int, default=256,
                   help="test examples for the reported accuracy")
    p.add_argument("--clip", type=sh.positive_float, default=1.0,
                   help="per-example L2 clip norm C (the sensitivity the noise is scaled to)")
    p.add_argument("--lr", type=sh.positive_float, default=3e-2,
                   help="peak AdamW learning rate (the task's tuned recipe gives the warm-up, "
                        "decay and weight decay)")
    p.add_argument("--seq-len", type=sh.positive_int, default=32, help="tokens per text")
    p.add_argument("--seed", type=int, default=0,
                   help="public seed of the train/test split (not of the noise)")
    sh.add_backbone_argument(p)
    p.add_argument("--progress", action="store_true",
                   help="show a progress bar (with ETA) over the training steps")
    sh.add_output_arguments(p, "model")


def run(ns: argparse.Namespace) -> int:
    from pavejax.lifecycle import train_developer

    sh.select_backbone(ns)
    task, recipe, name = None, None, ns.task
    if ns.data is None:
        for flag in ("test_data", "classes", "recipe"):
            if getattr(ns, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies to --data only")
    else:
        task = sh.load_data_file(ns, ns.data, test_path=ns.test_data)
        name = task.name
        recipe = ns.recipe or ("sentiment" if task.num_classes == 2 else "topic")
    cfg = sh.lifecycle_config(developers=(name,), seq_len=ns.seq_len,
                              dev_train=ns.train_size, dev_test=ns.test_size,
                              dev_target_epsilon=ns.epsilon, delta=ns.delta, dev_steps=ns.steps,
                              dev_batch=ns.batch_size, dev_mode=ns.mode, dev_lr=ns.lr,
                              dev_l2_clip=ns.clip, seed=ns.seed, progress=ns.progress)
    # train_developer draws its noise and sampling key fresh from the OS (never recorded); the
    # split seed stays public and reproducible.
    params, classes, train, _, acc, res, mcfg = train_developer(
        cfg, name, task=task, recipe=recipe, backbone=sh.backbone_folder(),
        pooling=sh.pooling())
    n = int(train["y"].shape[0])
    mechanism = f"dp-merging (DP-SAM mode {ns.mode!r} + anchor {mcfg.anchor})"
    protects = (f"each training example (text and label) of the {n} used from task "
                f"{name!r}")
    if math.isinf(ns.epsilon):
        guarantee = {"kind": "none", "note": "trained without noise (--epsilon inf): not private"}
        risk = sh.risk_record(math.inf, ns.delta)
    else:
        guarantee = sh.dp_guarantee(
            res.ledger, ns.delta, protects=protects, conditions=[
                "noise and Poisson-sampling keys fresh and secret (never released)",
                f"per-example gradients clipped jointly to C = {ns.clip}",
                "normalised by the expected batch size; every SAM ascent query accounted",
                f"the number of training examples ({n}) and the sampling rate are public",
                "the public initial head and anchor use no private data"],
            not_covered="the test split behind the reported accuracy (read without noise)")
        risk = sh.risk_record(guarantee["epsilon"], ns.delta)
    hyper = {"mode": ns.mode, "steps": ns.steps,
             "noise_multiplier": mcfg.resolved_noise_multiplier,
             "sampling_rate": mcfg.q, "expected_batch_size": mcfg.batch_size,
             "l2_clip": ns.clip, "learning_rate": ns.lr, "rho": mcfg.rho,
             "anchor": mcfg.anchor, "optimizer": mcfg.optimizer,
             "weight_decay": mcfg.weight_decay, "schedule": mcfg.schedule,
             "warmup_fraction": mcfg.warmup_fraction, "target_epsilon": ns.epsilon
             if math.isfinite(ns.epsilon) else None}
    data = {"task": name, "seed": ns.seed, "train_size": ns.train_size,
            "test_size": ns.test_size, "num_train": n, "seq_len": ns.seq_len}
    if task is not None:
        data |= {"file": sh.data_file_record(task, ns), "recipe": recipe}
    extra = {"task": name, "classes": list(classes), "test_accuracy": acc, "data": data,
             "model": f"linear head on frozen {sh.backbone_id()} {sh.pooling()}-pooled "
                      f"features"}
    digest = sh.save_model_release(ns.out, params, kind="model", mechanism=mechanism,
                                   ledger=res.ledger, guarantee=guarantee, risk=risk,
                                   hyperparameters=hyper, extra=extra, overwrite=ns.overwrite)
    eps = guarantee.get("epsilon", math.inf)
    summary = {"out": str(ns.out), "content_hash": digest, "task": name,
               "classes": list(classes), "test_accuracy": acc, "guarantee": guarantee,
               "noise_multiplier": mcfg.resolved_noise_multiplier, "steps": ns.steps}
    sh.emit(ns, summary, [
        f"trained {name!r} ({n} private examples, {ns.steps} steps, mode {ns.mode!r}, "
        f"noise multiplier {mcfg.resolved_noise_multiplier:.4g})",
        f"test accuracy: {acc:.4f}",
        f"guarantee: {guarantee['kind']} epsilon={eps:.4g} at delta={ns.delta:g} (replace one "
        f"training example; the {n} examples' count is public)",
        f"model release: {ns.out} (content hash {digest})"])
    return 0
