"""``pavejax merge``: merge model releases of one label space into a merged model release.

The task vectors are taken relative to the public label-keyed head of ``--base-classes`` (the
start every DP-Merging model of that label space shares), merged with a
:mod:`pavejax.merging.operators` operator, and added back. Merging reads only the released
models, so it is post-processing: every source's guarantee still holds for its own data.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from pavejax.commands import _shared as sh

OPS = ("ties", "wa", "ta", "pcb", "wudi", "dare", "iso_c")

DESCRIPTION = (
    "Merge model releases that share a label space (the public initial head of "
    "--base-classes) and write a merged model release. Privacy: merging is post-processing of "
    "the released models, so it reads no private data. The merged release's ledger composes "
    "the sources' ledgers: its epsilon (at the largest source delta, same neighbouring "
    "relation) holds for an example whatever sources' training sets it belongs to. When the "
    "sources were trained on disjoint data (parallel composition), each source's own guarantee "
    "applies to its own data, so an example is protected at its source's epsilon "
    "(epsilon_if_disjoint is the largest of them).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION)
    p.add_argument("--base-classes", required=True,
                   help="comma-separated class names of the label space, in output order, e.g. "
                        "negative,positive (every model must have exactly these)")
    p.add_argument("--models", type=Path, nargs="+", required=True,
                   help="model release directories to merge (written by train/merge/adapt)")
    p.add_argument("--op", choices=OPS, default="ties",
                   help="merging operator (TIES, weight average, task arithmetic, PCB, WUDI, "
                        "DARE, Iso-C), default %(default)s")
    p.add_argument("--seed", type=int, default=0,
                   help="public seed of DARE's drop masks (they use no private data)")
    p.add_argument("--eval-task", default=None,
                   help="optionally report the merged model's accuracy on this task's test "
                        "split (read without noise: that accuracy is not covered by any "
                        "guarantee)")
    p.add_argument("--eval-data", type=Path, default=None,
                   help="optionally report the merged model's accuracy on a labelled file of "
                        "your own (" + sh.DATA_HELP + "; labels are the --base-classes names "
                        "or ids in their order); printed only, never written into the release")
    p.add_argument("--eval-size", type=sh.positive_int, default=256,
                   help="test examples for --eval-task or --eval-data")
    sh.add_data_file_arguments(p, test=False)
    sh.add_backbone_argument(p)
    sh.add_output_arguments(p, "merged model")


def _check_sources(models, classes: tuple[str, ...], paths) -> int:
    for m, path in zip(models, paths, strict=True):
        if m.classes != classes:
            raise ValueError(f"{path} predicts classes {list(m.classes)}, not --base-classes "
                             f"{list(classes)}: only models of one label space (same class "
                             f"names in the same order) can be merged")
    seq = {int(m.data.get("seq_len", 32)) for m in models}
    if len(seq) > 1:
        raise ValueError(f"the models were trained on features of different sequence lengths "
                         f"{sorted(seq)}; merge models trained with one --seq-len")
    return seq.pop()


def combined_guarantee(metas, paths) -> tuple[object, dict]:
    """(ledger, guarantee) of a model derived from ``metas`` (post-processing of all of them)."""
    from pavejax.accounting import Ledger

    per_source = [{"release": Path(p).name, "mechanism": m.mechanism,
                   "guarantee": m.guarantee} for m, p in zip(metas, paths, strict=True)]
    ledgers = [Ledger.from_dict(m.ledger) for m in metas if m.ledger is not None]
    ledger = functools.reduce(Ledger.compose, ledgers) if ledgers else None
    if ledger is None or any(m.guarantee.get("kind") != "dp" for m in metas):
        return ledger, {"kind": "per_source" if ledger is not None else "none",
                        "note": "not every source has a DP guarantee: no combined epsilon is "
                                "stated; each source's guarantee below holds for its own data "
                                "(merging is post-processing)", "per_source": per_source}
    delta = max(float(m.guarantee["delta"]) for m in metas)
    disjoint = max(Ledger.from_dict(m.ledger).epsilon(delta) for m in metas)
    return ledger, sh.dp_guarantee(
        ledger, delta, protects="each training example of every source model (sequential "
                                "composition: valid whatever the overlap of their data)",
        conditions=["every source's own conditions (see per_source)",
                    "merging is post-processing of the released source models"],
        epsilon_if_disjoint=disjoint,
        parallel_composition="if the sources' training sets are disjoint, each source's "
                             "guarantee applies to its own data: an example is protected at "
                             "its source's epsilon (at most epsilon_if_disjoint)",
        per_source=per_source)


def run(ns: argparse.Namespace) -> int:
    import jax

    from pavejax.models import head0
    from pavejax.pave.reuse import merge_topk

    sh.select_backbone(ns)
    classes = tuple(c.strip() for c in ns.base_classes.split(",") if c.strip())
    if len(classes) < 2:
        raise ValueError(f"--base-classes needs at least two class names, got {classes}")
    models = [sh.load_model_release(p) for p in ns.models]
    seq_len = _check_sources(models, classes, ns.models)
    base = head0(sh.hidden_size(), classes)
    hyper = {"key": jax.random.key(ns.seed)} if ns.op == "dare" else {}
    merged = merge_topk(base, [m.params for m in models], op=ns.op, **hyper)
    ledger, guarantee = combined_guarantee([m.meta for m in models], ns.models)
    eps = guarantee.get("epsilon")
    risk = sh.risk_record(eps, guarantee["delta"]) if eps is not None else {}
    extra = {"classes": list(classes), "op": ns.op,
             "sources": [{"release": p.name, "content_hash": _hash(p), "task":
                          m.meta.extra.get("task")} for m, p in zip(models, ns.models,
                                                                    strict=True)],
             "data": {"seq_len": seq_len},
             "model": f"linear head on frozen {sh.backbone_id()} {sh.pooling()}-pooled "
                      f"features"}
    acc = eval_name = None
    if ns.eval_task is not None and ns.eval_data is not None:
        raise ValueError("give --eval-task or --eval-data, not both")
    if ns.eval_task is not None:
        acc = _evaluate(merged, classes, ns.eval_task, ns.eval_size, seq_len)
        eval_name = repr(ns.eval_task)
        extra["test_accuracy"] = {ns.eval_task: acc}
    elif ns.eval_data is not None:
        from pavejax.data import limit_task

        own = sh.load_data_file(ns, ns.eval_data, split=False, classes=classes)
        own = limit_task(own, max_train=ns.eval_size, seed=0)
        if tuple(own.label_names) != classes:
            raise ValueError(f"{ns.eval_data.name} has classes {list(own.label_names)}, the "
                             f"merged model {list(classes)}; give labels of --base-classes")
        acc = sh.accuracy(merged, sh.features(own.train.inputs, own.train.labels, seq_len),
                          classes)
        eval_name = "the --eval-data file (not written into the release)"
    digest = sh.save_model_release(
        ns.out, merged, kind="merged_model", mechanism=f"merge ({ns.op}) of released models",
        ledger=ledger, guarantee=guarantee, risk=risk,
        hyperparameters={"op": ns.op, "seed": ns.seed if ns.op == "dare" else None,
                         "base": f"public label-keyed head of {list(classes)}"},
        extra=extra, overwrite=ns.overwrite)
    summary = {"out": str(ns.out), "content_hash": digest, "op": ns.op,
               "num_models": len(models), "guarantee": guarantee, "test_accuracy": acc}
    lines = [f"merged {len(models)} models of {list(classes)} with {ns.op}"]
    if eps is not None:
        lines.append(f"guarantee: dp epsilon={eps:.4g} at delta={guarantee['delta']:g} "
                     f"(composed); if the sources' data are disjoint: each source's own, at "
                     f"most {guarantee['epsilon_if_disjoint']:.4g}")
    else:
        lines.append(f"guarantee: {guarantee['kind']} ({guarantee['note']})")
    if acc is not None:
        lines.append(f"test accuracy on {eval_name}: {acc:.4f}")
    lines.append(f"merged model release: {ns.out} (content hash {digest})")
    sh.emit(ns, summary, lines)
    return 0


def _evaluate(params, classes, task_name: str, size: int, seq_len: int) -> float:
    from pavejax.data import load_task

    task = load_task(task_name, seed=0, max_test=size)
    test = sh.features(task.test.inputs, task.test.labels, seq_len)
    return sh.accuracy(params, test, classes, task.label_names)


def _hash(path: Path) -> str:
    from pavejax.release import content_hash

    return content_hash(path)
