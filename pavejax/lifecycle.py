"""The private learnware lifecycle end to end: the job behind ``pavejax demo``.

On the real all-MiniLM-L6-v2 and real text (sentiment domains and BBC topics):

1. **Developers** (one per task of ``developers``) fine-tune a task model with DP-Merging
   (same-batch DP-SAM + anchor, ``dev_target_epsilon``): a classification head on the frozen
   backbone's mean-pooled features (cached once), from a public, label-keyed initial head shared
   by every developer of a label space, so that models merge. Each releases a **DP-S-PAVE**
   spec of its model (one full-batch Gaussian step on LoRA ``B`` factors of the backbone,
   ``spec_target_epsilon``, replace-one) and submits spec + model to a
   :class:`~pavejax.pave.dock.Dock` on disk.
2. **The user** (a few-shot private task ``user_task``) builds a spec of its few shots with the
   dock's key (it never leaves the user's process), searches the dock, merges the top-K models
   of its label space (``merge_op``), and adapts the merged model on its private pool with
   **PACZero-ZPL** (the user's dev selection uses the few shots).
3. **The report**: the dock ranking with scores, accuracy at every stage against the zero-shot
   backbone, top-1 reuse and the oracle (the best developer model on the user's test set), and
   the ledger of every artefact. ``report.md``, ``summary.json`` and PNG plots go to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LifecycleConfig", "adapt_zpl", "developer_spec", "run_lifecycle", "train_developer"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class LifecycleConfig:
    """Settings of the lifecycle run (defaults: the CPU demo, a few minutes on 2 cores)."""

    developers: tuple[str, ...] = ("movie", "amazon", "tweets", "bbc")
    user_task: str = "nyt"
    seq_len: int = 32
    dev_train: int = 512
    dev_test: int = 256
    user_shots: int = 16
    user_pool: int = 256
    user_test: int = 512
    dev_target_epsilon: float = 4.0
    spec_target_epsilon: float = 4.0
    delta: float = 1e-5
    dev_steps: int = 300
    dev_batch: int = 32
    dev_mode: str = "same"
    dev_lr: float = 3e-2  # re-tuned under noise on dev: benchmarks/private_lr.py
    dev_l2_clip: float = 1.0
    spec_examples: int = 256
    spec_l2_clip: float = 0.05
    spec_rank: int = 8
    spec_layers: tuple[int, ...] | None = (4, 5)
    top_k: int = 3
    merge_op: str = "ties"
    merge_hyper: tuple[tuple[str, Any], ...] = (("density", 0.5), ("merge", "mean"),
                                                ("scaling", 1.0))
    zo_steps: int = 300
    zo_lr: float = 1e-2
    zo_perturbation_scale: float = 1e-2
    zo_subsets: int = 16
    seed: int = 0
    out_dir: str = "pavejax-demo"
    dock_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.user_task in self.developers:
            raise ValueError(f"user_task {self.user_task!r} must not be a developer task: the "
                             f"demo shows reuse on a task nobody trained for")
        if not self.developers:
            raise ValueError("give at least one developer task")
        for name in ("seq_len", "dev_train", "dev_test", "user_shots", "user_pool", "user_test",
                     "dev_steps", "dev_batch", "top_k", "zo_steps", "zo_subsets", "spec_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("dev_target_epsilon", "spec_target_epsilon"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not v > 0 or math.isnan(v):
                raise ValueError(f"{name} must be > 0 (math.inf: no noise), got {v!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")

    @classmethod
    def full(cls, **overrides: Any) -> LifecycleConfig:
        """A larger run for an accelerator: 5 developers, more data, longer training."""
        base = dict(developers=("movie", "amazon", "tweets", "bbc"), seq_len=64,
                    dev_train=2048, dev_test=512, user_shots=32, user_pool=1024,
                    user_test=1024, dev_steps=1000, dev_batch=64, spec_examples=1024,
                    spec_layers=None, zo_steps=1000, zo_subsets=64)
        return cls(**(base | overrides))


# --- data ------------------------------------------------------------------------------------


def _features(texts: Sequence[str], seq_len: int, backbone: str | None = None,
              pooling: str = "mean") -> np.ndarray:
    """Frozen pooled features (n, hidden) float32 of all-MiniLM-L6-v2 or of the BERT folder
    ``backbone`` (cached per process)."""
    from pavejax.models import embed_texts

    return embed_texts(list(texts), max_length=seq_len, backbone=backbone, pooling=pooling)


def _data(texts: Sequence[str], labels: Any, seq_len: int, backbone: str | None = None,
          pooling: str = "mean") -> dict[str, jax.Array]:
    return {"x": jnp.asarray(_features(texts, seq_len, backbone, pooling)),
            "y": jnp.asarray(np.asarray(labels), jnp.int32)}


def _accuracy(params, data, classes, user_classes) -> float:
    from pavejax.data import class_identity_accuracy
    from pavejax.models import apply_head

    return class_identity_accuracy(np.asarray(apply_head(params, data["x"])), tuple(classes),
                                   np.asarray(data["y"]), tuple(user_classes))


# --- the run ---------------------------------------------------------------------------------


def train_developer(cfg: LifecycleConfig, task_name: str, noise_key: jax.Array | None = None,
                    *, task: Any = None, recipe: str | None = None,
                    backbone: str | None = None, pooling: str = "mean"):
    """DP-Merging fine-tuning of one developer's head; returns (params, classes, train data,
    train texts, test accuracy, TrainResult, MergeTrainConfig).

    The optimiser is the task's tuned head recipe (``pavejax.recipes.tuned(task, "head")``:
    AdamW, linear warm-up, cosine decay, its weight decay) at the peak rate ``cfg.dev_lr``,
    over ``cfg.dev_steps`` DP-SAM steps on Poisson batches of expected size ``cfg.dev_batch``.

    ``task``: a :class:`~pavejax.data.Task` of the user's own data (e.g.
    :func:`pavejax.data.load_dataset_file`) instead of the built-in task ``task_name``; its
    splits are capped at ``cfg.dev_train`` / ``cfg.dev_test`` with ``cfg.seed``. ``recipe``: the
    recipe family (``"sentiment"`` or ``"topic"``; default: the task's own, which a task of
    the user's data needs to be given). ``backbone``: a BERT-family Hugging Face folder whose
    frozen features the head is trained on (default all-MiniLM-L6-v2), pooled by ``pooling``
    (``"mean"`` or ``"cls"``).

    ``noise_key``: the key of the sampling and the noise; None (the default) draws a fresh one
    from the operating system. Pass one only to replay a run: it makes the noise removable.
    """
    from pavejax import recipes
    from pavejax.data import limit_task, load_task
    from pavejax.merging import train as mt
    from pavejax.models import example_loss, head0
    from pavejax.privacy import fresh_key

    if task is None:
        task = load_task(task_name, seed=cfg.seed, max_train=cfg.dev_train,
                         max_test=cfg.dev_test)
    else:
        if task.modality != "text":
            raise ValueError(f"task {task.name!r} holds array inputs; the developer model is a "
                             f"head on text features, so it needs a text column")
        task = limit_task(task, max_train=cfg.dev_train, max_test=cfg.dev_test, seed=cfg.seed)
    classes = tuple(task.label_names)
    train = _data(task.train.inputs, task.train.labels, cfg.seq_len, backbone, pooling)
    test = _data(task.test.inputs, task.test.labels, cfg.seq_len, backbone, pooling)
    n = int(train["y"].shape[0])
    # The tuned non-private head recipe (pavejax.recipes) gives the optimiser, schedule and
    # weight decay; privacy changes the rest: clipping, noise, Poisson batches of dev_batch
    # and the peak rate dev_lr (re-tuned under noise).
    mcfg = mt.MergeTrainConfig.from_recipe(
        recipes.tuned(recipe or task_name, "head"), dataset_size=n, steps=cfg.dev_steps,
        learning_rate=cfg.dev_lr, mode=cfg.dev_mode, target_epsilon=cfg.dev_target_epsilon,
        delta=cfg.delta, l2_clip=cfg.dev_l2_clip, batch_size=min(cfg.dev_batch, n),
        relation="replace_one", accountant="pld")
    params0 = head0(int(train["x"].shape[1]), classes)
    res = mt.train_task(example_loss, params0, None, train,
                        fresh_key() if noise_key is None else noise_key, mcfg,
                        progress=cfg.progress)
    acc = _accuracy(res.params, test, classes, classes)
    return res.params, classes, train, list(task.train.inputs), acc, res, mcfg


def developer_spec(cfg: LifecycleConfig, tb, a_key, params, classes, train, texts, name: str):
    """DP-S-PAVE spec of a developer model on (a prefix of) its training inputs."""
    from pavejax.models import apply_head
    from pavejax.pave.spec import PrivacyConfig, SpecConfig

    m = min(cfg.spec_examples, len(texts))
    logits = np.asarray(apply_head(params, train["x"][:m]))
    spec_cfg = SpecConfig.preset("one_step", rank=cfg.spec_rank, progress=False,
                                 privacy=PrivacyConfig(target_epsilon=cfg.spec_target_epsilon,
                                                       l2_clip=cfg.spec_l2_clip, sampling="full",
                                                       accountant="rdp", delta=cfg.delta),
                                 microbatch_size=32)
    return tb.model_spec(texts[:m], logits, classes, a_key, spec_cfg, task=name)


def run_lifecycle(cfg: LifecycleConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the lifecycle; return the summary (also written to ``cfg.out_dir``)."""
    from pavejax.data import few_shot as take_few_shot, load_task
    from pavejax.models import head0, load_minilm
    from pavejax.pave.dock import Dock
    from pavejax.pave.reuse import merge_topk
    from pavejax.pave.spec import SpecConfig
    from pavejax.pave.text import TextSpecBackbone

    t0 = time.perf_counter()

    def stage(msg: str) -> None:
        log(f"[{time.perf_counter() - t0:5.0f} s] {msg}")

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    encoder, tok = load_minilm(max_length=cfg.seq_len)
    hidden = encoder.config.hidden_size
    tb = TextSpecBackbone(encoder, tok, max_length=cfg.seq_len, layers=cfg.spec_layers)
    dock_path = Path(cfg.dock_dir) if cfg.dock_dir else out / "dock"
    dock = Dock.create(dock_path, exist_ok=True)
    a_key = dock.a_key()
    existing = {e.name for e in dock.list()}
    stage(f"backbone {tb.backbone.id} loaded; dock at {dock_path} ({len(dock)} learnwares)")

    # 1. developers ---------------------------------------------------------------------------
    ledgers: dict[str, Any] = {}
    developers: dict[str, Any] = {}
    for name in cfg.developers:
        if f"dev-{name}" in existing:  # a dock given with --dock may hold it already
            meta = dock.get(f"dev-{name}").metadata
            ledgers[f"developer/{name}"] = meta.get("ledger", {})
            developers[name] = {"classes": list(meta["classes"]),
                                "own_test_accuracy": meta.get("own_test_accuracy")}
            stage(f"developer {name}: already in the dock, reused")
            continue
        stage(f"developer {name}: DP-Merging fine-tuning (epsilon {cfg.dev_target_epsilon})")
        params, classes, train, texts, acc, res, mcfg = train_developer(cfg, name)
        stage(f"developer {name}: own test accuracy {acc:.3f}; DP-S-PAVE spec "
              f"(epsilon {cfg.spec_target_epsilon})")
        spec = developer_spec(cfg, tb, a_key, params, classes, train, texts, name)
        g = spec.spec.info["guarantee"]
        total = res.ledger.compose(spec.ledger)
        ledgers[f"developer/{name}"] = {
            "model": {"mechanism": f"DP-Merging (DP-SAM mode {cfg.dev_mode!r} + anchor)",
                      "epsilon": res.ledger.epsilon(cfg.delta), "delta": cfg.delta,
                      "relation": "replace_one",
                      "noise_multiplier": mcfg.resolved_noise_multiplier,
                      "steps": cfg.dev_steps, "sampling_rate": mcfg.q,
                      "dataset_size": mcfg.dataset_size},
            "spec": {"mechanism": "DP-S-PAVE (one full-batch Gaussian step)",
                     "epsilon": g["epsilon"], "delta": cfg.delta, "relation": "replace_one",
                     "noise_multiplier": spec.spec.info["noise_multiplier"],
                     "num_examples": spec.spec.info["num_examples"]},
            "composed": {"epsilon": total.epsilon(cfg.delta), "delta": cfg.delta,
                         "relation": "replace_one",
                         "note": "model and spec on the same private data (the spec examples "
                                 "are training examples of the model)"},
            "public": "dataset sizes and sampling rates are public and not protected; every "
                      "figure is replace-one (neighbours of the same size)"}
        dock.submit(spec.spec, name=f"dev-{name}", model=jax.tree.map(np.asarray, params),
                    metadata={"classes": list(classes), "task": name,
                              "own_test_accuracy": acc, "ledger": ledgers[f"developer/{name}"]})
        developers[name] = {"classes": list(classes), "own_test_accuracy": acc}

    # 2. the user -----------------------------------------------------------------------------
    stage(f"user ({cfg.user_task}): few-shot spec and dock search")
    utask = load_task(cfg.user_task, seed=cfg.seed + 1,
                      max_train=cfg.user_pool + cfg.user_shots * 8, max_test=cfg.user_test)
    uclasses = tuple(utask.label_names)
    shots = take_few_shot(utask, cfg.user_shots, seed=cfg.seed).train
    shot_set = set(shots.inputs)
    pool_idx = [i for i, t in enumerate(utask.train.inputs) if t not in shot_set][:cfg.user_pool]
    u_shots = _data(shots.inputs, shots.labels, cfg.seq_len)
    u_pool = _data([utask.train.inputs[i] for i in pool_idx],
                   np.asarray(utask.train.labels)[pool_idx], cfg.seq_len)
    u_test = _data(utask.test.inputs, utask.test.labels, cfg.seq_len)
    # the developers' recipe without the noise: each shot's gradient clipped to their C
    uspec = tb.user_spec(shots.inputs, shots.labels, uclasses, a_key,
                         SpecConfig.preset("one_step_clipped", rank=cfg.spec_rank,
                                           example_clip=cfg.spec_l2_clip, progress=False))
    found = dock.search(uspec.spec, k=len(dock))
    entries = {e.id: e for e in dock.list()}
    ranking, accs = [], {}
    for i, name, cos, score in zip(found.ids, found.names, found.cosines, found.scores,
                                   strict=True):
        classes = entries[i].metadata["classes"]
        accs[i] = _accuracy(dock.load_model(i), u_test, classes, uclasses)
        ranking.append({"rank": len(ranking) + 1, "name": name, "cosine": float(cos),
                        "score": float(score), "classes": list(classes),
                        "user_test_accuracy": accs[i]})
    base = head0(hidden, uclasses)
    zero_shot = _accuracy(base, u_test, uclasses, uclasses)
    # The user knows its label space: like the learnware market's semantic filter before the
    # statistical search, reuse considers the ranked models that cover the user's classes.
    covering = [i for i in found.ids if set(uclasses) <= set(entries[i].metadata["classes"])]
    top1 = covering[0] if covering else found.ids[0]
    top1_acc, oracle_acc = accs[top1], max(accs.values())
    chosen = [i for i in covering if tuple(entries[i].metadata["classes"]) == uclasses]
    chosen = chosen[:cfg.top_k]
    if len(chosen) >= 2:
        merged = merge_topk(base, [dock.load_model(i) for i in chosen], op=cfg.merge_op,
                            **dict(cfg.merge_hyper))
    elif chosen:
        merged = dock.load_model(chosen[0])
    else:
        merged = base
    merged = jax.tree.map(jnp.asarray, merged)
    merged_acc = _accuracy(merged, u_test, uclasses, uclasses)
    stage(f"user: top-1 {entries[top1].name} ({top1_acc:.3f}); {cfg.merge_op.upper()} merge of "
          f"{[entries[i].name for i in chosen]} ({merged_acc:.3f}); PACZero-ZPL adaptation")
    final, zo_info = adapt_zpl(cfg, merged, u_pool, u_shots)
    final_acc = _accuracy(final, u_test, uclasses, uclasses)
    ledgers["user/spec"] = {"mechanism": "PAVE (non-private)",
                            "note": "kept in the user's process, used only for the search"}
    ledgers["user/final_model"] = zo_info.pop("ledger")
    summary = {"zero_shot_acc": zero_shot, "top1_reuse_acc": top1_acc,
               "merged_acc": merged_acc, "final_acc": final_acc, "oracle_acc": oracle_acc,
               "top1_name": entries[top1].name, "merged_from": [entries[i].name for i in chosen],
               "merge_op": cfg.merge_op, "ranking": ranking, "developers": developers,
               "ledger": ledgers, "paczero": zo_info, "config": dataclasses.asdict(cfg),
               "seconds": time.perf_counter() - t0}
    _write_report(out, summary, log)
    return summary


def adapt_zpl(cfg: LifecycleConfig, params: dict, pool: dict, dev: dict):
    """PACZero-ZPL on the user's private pool; dev selection on the few shots (the start
    counts as a candidate, so selection never returns a worse dev loss than the input)."""
    from pavejax.models import apply_head, example_loss
    from pavejax.paczero import ZOConfig, init, train
    from pavejax.privacy import fresh_key

    zcfg = ZOConfig(mechanism="zpl", steps=cfg.zo_steps, learning_rate=cfg.zo_lr,
                    perturbation_scale=cfg.zo_perturbation_scale, num_subsets=cfg.zo_subsets,
                    l2_clip=25.0, eval_every=max(1, cfg.zo_steps // 10))

    @jax.jit
    def dev_loss_jit(p):
        z = apply_head(p, dev["x"])
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(z), dev["y"][:, None], 1))

    n = int(pool["y"].shape[0])
    # the secret index and coins come from fresh OS entropy; only the probe directions (and
    # the membership matrix, which the guarantee assumes known) are public
    state = init(zcfg, params, n, key=fresh_key(), public_key=jax.random.key(cfg.seed + 7))
    start_dev = float(dev_loss_jit(params))
    state = train(zcfg, example_loss, state, None, pool,
                  dev_fn=lambda p, _: dev_loss_jit(p), progress=cfg.progress)
    improved = state.best is not None and state.best_dev < start_dev
    ledger = state.ledger
    info = {"steps": state.step, "unanimity_rate": state.unanimity_rate,
            "start_dev_loss": start_dev, "best_dev_loss": state.best_dev,
            "selected_step": state.best_step if improved else 0,
            "ledger": {"mechanism": "PACZero-ZPL", "mutual_information_nats":
                       ledger.mutual_information(), "membership_prior": 0.5,
                       "num_subsets": cfg.zo_subsets,
                       "guarantee": "PAC privacy: every release is a unanimous sign or a fair "
                                    "coin, so the trajectory is independent of the secret subset"
                                    " (0 nats of mutual information)",
                       "protects": "each pool example's membership in the secret candidate "
                                   "subset, against an adversary assumed to know the pool; the "
                                   "pool's content is not protected",
                       "pool_size": n}}
    return jax.tree.map(jnp.asarray, state.best if improved else params), info


def _write_report(out: Path, summary: dict, log: Callable[[str], None]) -> None:
    stages = [("zero-shot backbone", summary["zero_shot_acc"]),
              (f"top-1 reuse ({summary['top1_name']})", summary["top1_reuse_acc"]),
              (f"merged top-K ({summary['merge_op']})", summary["merged_acc"]),
              ("merged + PACZero-ZPL", summary["final_acc"]),
              ("oracle (best dock model)", summary["oracle_acc"])]
    lines = ["# pavejax private learnware lifecycle", "",
             "## Dock ranking for the user's task", "",
             "| rank | learnware | cosine | score | classes | user test accuracy |",
             "|---|---|---|---|---|---|"]
    for r in summary["ranking"]:
        lines.append(f"| {r['rank']} | {r['name']} | {r['cosine']:.3f} | {r['score']:.3f} | "
                     f"{', '.join(r['classes'])} | {r['user_test_accuracy']:.3f} |")
    lines += ["", "## User accuracy by stage", "", "| stage | test accuracy |", "|---|---|"]
    lines += [f"| {s} | {a:.3f} |" for s, a in stages]
    lines += ["", "## Privacy ledger of every artefact", "", "```json",
              json.dumps(summary["ledger"], indent=2, default=float), "```", "",
              "![accuracy by stage](accuracy_by_stage.png)", "",
              "![dock ranking](dock_ranking.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    _plots(out, stages, summary["ranking"])
    for line in lines[:lines.index("## Privacy ledger of every artefact")]:
        log(line)
    log(f"report: {out / 'report.md'}; summary: {out / 'summary.json'}")


def _plots(out: Path, stages, ranking) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plots are optional; the markdown report is complete without them
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([s for s, _ in stages][::-1], [a for _, a in stages][::-1], color="#4c72b0")
    ax.set_xlim(0, 1)
    ax.set_xlabel("user test accuracy")
    fig.tight_layout()
    fig.savefig(out / "accuracy_by_stage.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar([r["name"] for r in ranking], [r["cosine"] for r in ranking], color="#dd8452")
    ax.set_ylabel("cosine with the user's spec")
    fig.tight_layout()
    fig.savefig(out / "dock_ranking.png", dpi=120)
    plt.close(fig)
