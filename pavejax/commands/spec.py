"""``pavejax spec``: a PAVE spec release, model side (DP-S-PAVE) or user side.

Model side: fit the LoRA ``B`` factors of all-MiniLM-L6-v2 (the dock's secret ``A``) to a model
release's own predictions on the training inputs of its task (one full-batch DP-S-PAVE step,
:mod:`pavejax.pave.spec`). User side: fit ``B`` to a user's few labelled shots, non-private by
default (the user spec stays in the user's process and only drives a search) or DP-S-PAVE with
``--epsilon``. Either way the spec lives in the dock's parameter space (backbone, layers, rank,
``A``); its ``A`` hash is released, ``A`` and its key never are.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pavejax.commands import _shared as sh

DESCRIPTION = (
    "Write a PAVE spec release in the parameter space of a dock. Model side (--model): a "
    "DP-S-PAVE spec of a model release, computed on the training inputs of its task; it is "
    "(epsilon, delta)-DP with respect to replacing one spec example (replace-one neighbouring, "
    "sensitivity 2C), against everyone, including holders of the dock's A key. User side "
    "(--user-task or --user-data): a spec of a user's few labelled shots; without --epsilon it "
    "is NOT private "
    "(keep it in your process: it is meant only for 'pavejax dock search'), with --epsilon it "
    "is DP-S-PAVE. The dock's secret A key is read from the dock and never written. "
    + sh.NOISE_SECRET)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION)
    p.add_argument("--dock", type=sh.dock_location, required=True,
                   help="the dock whose secret A key and parameter space the spec uses")
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--model", type=Path, help="model release directory (model side)")
    side.add_argument("--user-task", help=f"user side: a built-in user task "
                                          f"({', '.join(sh.TEXT_TASKS)}); --shots per class")
    side.add_argument("--user-data", type=Path,
                      help="user side: the user's own labelled shots, every row one shot: "
                           + sh.DATA_HELP)
    p.add_argument("--task", default=None,
                   help="model side: the task whose training inputs are the spec data "
                        "(default: the task the model was trained on)")
    p.add_argument("--data", type=Path, default=None,
                   help="model side: the data file the model was trained on (needed for a "
                        "model trained with 'pavejax train --data'; the same columns and "
                        "--seed select the same training rows)")
    sh.add_data_file_arguments(p, test=False)
    p.add_argument("--shots", type=sh.positive_int, default=8,
                   help="user side: labelled shots per class (default %(default)s)")
    p.add_argument("--epsilon", type=sh.positive_float, default=None,
                   help="DP-S-PAVE budget: the spec is (epsilon, --delta)-DP with respect to "
                        "replacing one example of the spec data (the model's training inputs "
                        "or the user's shots; their number is public); noise calibrated by the "
                        "RDP accountant. "
                        "Default: 4 on the model side, none (non-private) on the user side")
    p.add_argument("--delta", type=float, default=1e-5, help=sh.DELTA_HELP)
    p.add_argument("--clip", type=sh.positive_float, default=0.05,
                   help="joint L2 clip C of each example's gradient on all B blocks: DP-S-PAVE's "
                   "on the model side; the non-private user spec clips its shots at the same C")
    p.add_argument("--examples", type=sh.positive_int, default=256,
                   help="model side: at most this many training inputs are the spec data")
    p.add_argument("--rank", type=sh.positive_int, default=None,
                   help="LoRA rank r (default: the dock's, or 8 for an empty dock)")
    p.add_argument("--layers", default=None,
                   help="comma-separated encoder layers adapted (default: the dock's, or 4,5)")
    p.add_argument("--seq-len", type=sh.positive_int, default=None,
                   help="tokens per text (default: the model's; 32 on the user side)")
    p.add_argument("--seed", type=int, default=0,
                   help="user side: public seed of the task split and the shot choice")
    sh.add_backbone_argument(p)
    p.add_argument("--progress", action="store_true",
                   help="show a progress bar (with ETA) over the spec's steps")
    sh.add_output_arguments(p, "spec")


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        layers = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, e.g. 4,5; got {text!r}") \
            from None
    if not layers:
        raise ValueError("--layers is empty; give e.g. 4,5")
    return layers


def _layer_indices(paths) -> tuple[int, ...]:
    return tuple(sorted({int(p.split("/")[p.split("/").index("layers") + 1]) for p in paths}))


def dock_space(signature, rank: int | None, layers: tuple[int, ...] | None, subspace=None):
    """(rank, layers) of a spec for a dock: the dock's own once it holds specs (the layers of
    its coordinate subspace, if it has one); an explicit value that contradicts the dock is
    refused (its specs could not be compared)."""
    if signature is None and subspace is None:
        return rank or 8, layers or (4, 5)
    dock_layers = _layer_indices(subspace.paths if signature is None else signature.layers)
    if signature is None:
        if layers is not None and layers != dock_layers:
            raise ValueError(f"--layers {layers} differs from the dock's subspace layers "
                             f"{dock_layers}; drop --layers")
        return rank or 8, dock_layers
    for name, mine, theirs in (("rank", rank, signature.rank),
                               ("layers", layers, dock_layers)):
        if mine is not None and mine != theirs:
            raise ValueError(f"--{name} {mine} differs from the dock's {theirs}: specs are "
                             f"comparable only in the dock's space; drop --{name}")
    return signature.rank, dock_layers


def _with_facts(spec, **facts):
    from pavejax.spec_types import PaveSpec

    return PaveSpec(spec.vector, spec.signature, spec.kind, dict(spec.info) | facts)


def build_spec(ns: argparse.Namespace):
    """(spec, rank, layers, facts) of the flags of ``pavejax spec`` (nothing written)."""
    from pavejax.pave.dock import Dock
    from pavejax.pave.spec import PrivacyConfig, SpecConfig

    sh.select_backbone(ns)
    if ns.model is None and (ns.task is not None or ns.data is not None):
        raise ValueError("--task and --data are for the model side (with --model); the user "
                         "side takes --user-task or --user-data")
    if ns.data is not None and ns.task is not None:
        raise ValueError("give --task or --data for the model side, not both")
    from pavejax.pave.remote import is_url

    with (Dock.remote(ns.dock) if is_url(ns.dock) else Dock.open(ns.dock)) as dock:
        a_key, signature, subspace = dock.a_key(), dock.signature, dock.subspace
    rank, layers = dock_space(signature, ns.rank, parse_layers(ns.layers), subspace)
    epsilon = ns.epsilon if ns.epsilon is not None or ns.model is None else 4.0
    privacy = None if epsilon is None else PrivacyConfig(
        target_epsilon=epsilon, l2_clip=ns.clip, sampling="full", accountant="rdp",
        delta=ns.delta)
    # DP-S-PAVE draws its noise key fresh from the OS (generate_spec's default)
    # a non-private spec (the user side) clips each example like the DP release, without noise
    progress = bool(getattr(ns, "progress", False))
    config = (SpecConfig.preset("one_step", rank=rank, progress=progress, privacy=privacy)
              if privacy is not None else
              SpecConfig.preset("one_step_clipped", rank=rank, example_clip=ns.clip,
                                progress=progress))
    config = dataclasses.replace(config, subspace=subspace)  # the dock's coordinates, if any
    if ns.model is not None:
        res, facts, seq_len = _model_side(ns, config, a_key, layers)
    else:
        res, facts, seq_len = _user_side(ns, config, a_key, layers)
    return _with_facts(res.spec, seq_len=seq_len, **facts), rank, layers, facts


def run(ns: argparse.Namespace) -> int:
    from pavejax.release import save_spec

    spec, rank, layers, facts = build_spec(ns)
    g = spec.info["guarantee"]
    if g["kind"] == "dp":
        risk = sh.risk_record(g["epsilon"], g["delta"]) | {
            "amplification_note": "amplification_bound: the extra advantage of seeing the spec "
                                  "next to the model over the model alone (Theorem 4.3)"}
    else:
        risk = {"note": "non-private spec: no risk bound; keep it in your process"}
    digest = save_spec(ns.out, spec, risk=risk, overwrite=ns.overwrite)
    summary = {"out": str(ns.out), "content_hash": digest, "kind": spec.kind,
               "dim": int(spec.vector.shape[0]), "rank": rank, "layers": list(layers),
               "guarantee": g, **facts}
    eps = (f"epsilon={g['epsilon']:.4g} at delta={g['delta']:g} (replace one spec example)"
           if g["kind"] == "dp" else "non-private")
    sh.emit(ns, summary, [
        f"{spec.kind} spec of {facts['task']!r}: dim {summary['dim']} (rank {rank}, layers "
        f"{','.join(map(str, layers))}), {facts['num_examples']} examples; {eps}",
        f"spec release: {ns.out} (content hash {digest})"])
    return 0


def _microbatched(config, n: int):
    # per-example gradients in chunks of at most 32 (memory); never more than the data (the
    # padded full batch must hold whole chunks)
    if config.privacy is None:
        return config
    return dataclasses.replace(config, microbatch_size=min(32, n))


def _model_side(ns, config, a_key, layers):
    import numpy as np

    from pavejax.data import load_task
    from pavejax.models import apply_head

    model = sh.load_model_release(ns.model)
    data = model.data
    seq_len = ns.seq_len or int(data.get("seq_len", 32))
    if ns.data is not None or "file" in data:
        if ns.data is None:
            raise ValueError(f"{ns.model} was trained on a data file of your own; pass it with "
                             f"--data (and the same --text-column / --label-column / --classes)")
        task, same = _file_task(ns, data, model.classes)
        task_name = task.name
    else:
        task_name = ns.task or data.get("task")
        if task_name is None:
            raise ValueError(f"{ns.model} does not record its task; pass --task")
        same = task_name == data.get("task")
        task = load_task(task_name, seed=int(data.get("seed", 0)) if same else 0,
                         max_train=int(data.get("train_size", ns.examples)) if same
                         else ns.examples)
    texts = list(task.train.inputs)[:ns.examples]
    x = sh.features(texts, np.asarray(task.train.labels)[:len(texts)], seq_len)["x"]
    tb = sh.text_backbone(seq_len, layers)
    logits = np.asarray(apply_head(model.params, x))
    res = tb.model_spec(texts, logits, model.classes, a_key, _microbatched(config, len(texts)),
                        task=task_name)
    facts = {"task": task_name, "num_examples": len(texts), "classes": list(model.classes),
             "model_content_hash": _content_hash(ns.model)}
    if same and model.meta.guarantee.get("kind") == "dp" and res.ledger is not None:
        facts["composed_with_model"] = _composed(model.meta, res.ledger)
    return res, facts, seq_len


def _composed(model_meta, spec_ledger) -> dict:
    # The spec data are training examples of the model: an example's total loss composes both.
    from pavejax.accounting import Ledger

    delta = float(model_meta.guarantee["delta"])
    model_ledger = Ledger.from_dict(model_meta.ledger)
    if model_ledger.relation is not spec_ledger.relation:
        raise ValueError(f"the model release accounts {model_ledger.relation.value} "
                         f"neighbouring and the spec replace-one, so their composition has no "
                         f"valid figure; retrain the model with this pavejax (replace-one)")
    total = model_ledger.compose(spec_ledger)
    return {"epsilon": total.epsilon(delta), "delta": delta, "relation": "replace_one",
            "note": "the spec data are training examples of the model; for them the model and "
                    "the spec together are (epsilon, delta)-DP (replace one example)"}


def _file_task(ns, data, classes):
    """The model's training rows from the user's file: the same columns, split, seed, class
    order and train size as the model release records."""
    from pavejax.data import limit_task

    record = data.get("file", {})
    for flag, key in (("text_column", "text_column"), ("label_column", "label_column")):
        if record and getattr(ns, flag) != record.get(key):
            raise ValueError(f"the model was trained with --{flag.replace('_', '-')} "
                             f"{record.get(key)!r}, not {getattr(ns, flag)!r}; pass the same")
    ns.seed = int(data.get("seed", 0))
    task = sh.load_data_file(ns, ns.data, without_test=bool(record.get("test_file")),
                             classes=classes)
    if not record:  # a built-in model given a file: the file's first rows are the spec data
        return limit_task(task, max_train=ns.examples, seed=ns.seed), False
    return limit_task(task, max_train=int(data.get("train_size", ns.examples)),
                      seed=ns.seed), True


def _user_side(ns, config, a_key, layers):
    from pavejax.data import few_shot, load_task

    seq_len = ns.seq_len or 32
    if ns.user_data is not None:
        task = sh.load_data_file(ns, ns.user_data, split=False)
        shots, name = task.train, task.name
        per_class = dict(zip(task.label_names, shots.counts(task.num_classes), strict=True))
        if min(per_class.values()) < 1:
            missing = [c for c, k in per_class.items() if k == 0]
            raise ValueError(f"{ns.user_data.name}: no shot of the classes {missing}; give at "
                             f"least one labelled shot per class")
    else:
        task = load_task(ns.user_task, seed=ns.seed)
        shots, name = few_shot(task, ns.shots, seed=ns.seed).train, ns.user_task
        per_class = ns.shots
    classes = tuple(task.label_names)
    tb = sh.text_backbone(seq_len, layers)
    res = tb.user_spec(list(shots.inputs), shots.labels, classes, a_key,
                       _microbatched(config, len(shots.inputs)), task=name)
    facts = {"task": name, "num_examples": len(shots.inputs), "classes": list(classes),
             "shots_per_class": per_class}
    return res, facts, seq_len


def _content_hash(path: Path) -> str:
    from pavejax.release import content_hash

    return content_hash(path)
