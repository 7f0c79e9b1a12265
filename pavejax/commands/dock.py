"""``pavejax dock init|submit|search|list|show``: the dock from the command line.

Specs and models travel as releases (:mod:`pavejax.release`): ``pavejax spec`` writes a spec
release; ``submit`` reads it (and optionally a model release) and stores both in the dock.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pavejax.commands import _shared as sh

_PRIVACY_NOTE = (
    "The dock keeps the secret key of A in <dock>/secret (mode 0600): lend it only to the "
    "developers and users of this dock. Specs are compared only within one dock (same backbone, "
    "layers, rank and A).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Create, fill and search a learnware dock. " + _PRIVACY_NOTE
    sub = p.add_subparsers(dest="dock_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="create an empty dock (and its secret A key)")
    init.add_argument("dock", type=Path, help="dock directory to create")
    init.add_argument("--exist-ok", action="store_true", help="open it if it already exists")
    init.add_argument("--subspace", default=None, metavar="KIND:K[:SEED]",
                      help="store a public coordinate subspace U with the dock: every spec then "
                      "releases the coordinates C = B U (r x k per kernel) instead of the whole B "
                      "blocks. 'random:K[:SEED]' (a public random projection) or 'calibrated:K' "
                      "(top-K gradient directions on public Wikipedia text, SQuAD v1.1 dev "
                      "contexts; needs 'pavejax assets --with squad'). Default: none")
    init.add_argument("--layers", default="4,5",
                      help="with --subspace: the encoder layers whose query/value kernels the "
                      "specs adapt (default %(default)s)")
    init.add_argument("--backbone", type=Path, default=None,
                      help="with --subspace: " + sh.BACKBONE_HELP)
    init.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                      help="with --subspace: " + sh.POOLING_HELP)
    init.add_argument("--seq-len", type=int, default=32,
                      help="with --subspace calibrated: tokens per public text (default "
                      "%(default)s)")
    submit = sub.add_parser("submit", help="store a model-side spec release (and a model)")
    submit.add_argument("dock", type=Path)
    submit.add_argument("spec", type=Path, help="spec release directory (pavejax spec --out)")
    submit.add_argument("--name", required=True, help="unique learnware name")
    submit.add_argument("--model", type=Path, default=None,
                        help="model release directory (stored with the spec for reuse)")
    submit.add_argument("--metadata", default="{}",
                        help='JSON metadata, e.g. \'{"classes": ["negative", "positive"]}\'')
    search = sub.add_parser("search", help="rank the dock's learnwares for a user spec release")
    search.add_argument("dock", type=Path)
    search.add_argument("spec", type=Path, nargs="?", default=None,
                        help="user spec release directory (or give --user-data)")
    search.add_argument("--user-data", type=Path, default=None,
                        help="instead of a spec release: the user's labelled shots (" +
                             sh.DATA_HELP + "); a non-private user spec is made in this "
                             "process, used for the search and never written")
    sh.add_data_file_arguments(search, test=False)
    search.add_argument("--backbone", type=Path, default=None,
                        help="with --user-data: " + sh.BACKBONE_HELP)
    search.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                        help="with --user-data: " + sh.POOLING_HELP)
    search.add_argument("--seq-len", type=sh.positive_int, default=32,
                        help="with --user-data: tokens per text (default %(default)s)")
    search.add_argument("--clip", type=sh.positive_float, default=0.05,
                        help="with --user-data: the per-shot clip C of the user spec "
                             "(default %(default)s, as 'pavejax spec')")
    search.add_argument("-k", type=int, default=5, help="number of results (default 5)")
    search.add_argument("--score", choices=("cosine", "debiased", "posterior"),
                        default="cosine",
                        help="ranking score: plain cosine (default), or a noise-aware score that "
                             "reads each learnware's public noise level (plain-SGD DP-S-PAVE or "
                             "non-private specs only; no privacy cost)")
    search.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lst = sub.add_parser("list", help="list the learnwares in the dock")
    lst.add_argument("dock", type=Path)
    for cmd in (init, submit, lst):
        cmd.add_argument("--json", action="store_true", help="print JSON instead of text")
    show = sub.add_parser("show", help="show one learnware's index record")
    show.add_argument("dock", type=Path)
    show.add_argument("learnware", help="id or name")


def _open(path: Path):
    from pavejax.pave.dock import Dock

    return Dock.open(path)


def _subspace(ns: argparse.Namespace):
    from pavejax.commands.spec import parse_layers
    from pavejax.pave import subspace as sub_lib

    parts = ns.subspace.split(":")
    try:
        kind, k = parts[0], int(parts[1])
        seed = int(parts[2]) if len(parts) > 2 else 0
    except (IndexError, ValueError):
        raise ValueError(f"--subspace must be 'random:K[:SEED]' or 'calibrated:K' with integer "
                         f"K, got {ns.subspace!r}") from None
    if kind not in ("random", "calibrated") or len(parts) > 3 or \
            (kind == "calibrated" and len(parts) > 2):
        raise ValueError(f"--subspace must be 'random:K[:SEED]' or 'calibrated:K', got "
                         f"{ns.subspace!r}")
    tb = sh.text_backbone(ns.seq_len, parse_layers(ns.layers))
    if kind == "random":
        return sub_lib.random_projection(tb.backbone.params, tb.predicate, k, seed)
    from pavejax.data.squad import load_squad

    texts = list(dict.fromkeys(ex.context for ex in load_squad(max_examples=4000)))[:256]
    return tb.calibrated_subspace(texts, [("negative", "positive"), ("business",
                                  "entertainment", "politics", "sport", "tech")], k,
                                  info={"data": "SQuAD v1.1 dev contexts (Wikipedia)"})


def _parse_metadata(text: str) -> dict:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--metadata is not valid JSON ({e}); pass e.g. "
                         f"'{{\"classes\": [\"a\", \"b\"]}}'") from None
    if not isinstance(meta, dict):
        raise SystemExit("--metadata must be a JSON object")
    return meta


def run(ns: argparse.Namespace) -> int:
    from pavejax.pave.dock import Dock
    from pavejax.release import load_release, load_spec

    action = ns.dock_command
    sh.select_backbone(ns)  # --backbone where the action takes one, else all-MiniLM-L6-v2
    if action == "init":
        subspace = None if ns.subspace is None else _subspace(ns)
        dock = Dock.create(ns.dock, exist_ok=ns.exist_ok, subspace=subspace)
        if ns.json:
            print(json.dumps({"dock": str(ns.dock), "learnwares": len(dock),
                              "subspace": None if subspace is None else subspace.hash,
                              "note": _PRIVACY_NOTE}, indent=2))
            return 0
        where = "" if subspace is None else f" Coordinate subspace: {subspace!r}."
        print(f"dock ready at {ns.dock} ({len(dock)} learnwares).{where} {_PRIVACY_NOTE}")
        return 0
    dock = _open(ns.dock)
    if action == "submit":
        spec = load_spec(ns.spec)
        model = None
        meta = _parse_metadata(ns.metadata)
        if ns.model is not None:
            model, model_meta = load_release(ns.model, expect_backbone_hash=None)
            meta.setdefault("model_release", model_meta.to_dict())
            # the class names of a model release travel with it (reuse needs them)
            if "classes" in model_meta.extra:
                meta.setdefault("classes", list(model_meta.extra["classes"]))
        i = dock.submit(spec, name=ns.name, model=model, metadata=meta)
        if ns.json:
            print(json.dumps({"id": i, "name": ns.name, "has_model": model is not None,
                              "guarantee": spec.info.get("guarantee")}, indent=2,
                             default=_jsonable))
        else:
            print(f"submitted {ns.name!r} as id {i}")
    elif action == "search":
        res = dock.search(_query(ns), k=ns.k, score=ns.score)
        rows = [{"rank": r + 1, "id": i, "name": n, "cosine": float(c), "score": float(s)}
                for r, (i, n, c, s) in enumerate(zip(res.ids, res.names, res.cosines,
                                                     res.scores, strict=True))]
        if ns.score != "cosine":
            for row, v in zip(rows, res.ranking, strict=True):
                row[ns.score] = float(v)
        if ns.json:
            print(json.dumps(rows, indent=2))
        else:
            extra = "" if ns.score == "cosine" else f" {ns.score} |"
            print(f"| rank | id | name | cosine | score |{extra}\n|---|---|---|---|---|"
                  + ("" if ns.score == "cosine" else "---|"))
            for r in rows:
                tail = "" if ns.score == "cosine" else f" {r[ns.score]:.4f} |"
                print(f"| {r['rank']} | {r['id']} | {r['name']} | {r['cosine']:.4f} | "
                      f"{r['score']:.4f} |{tail}")
    elif action == "list":
        if ns.json:
            print(json.dumps([{"id": e.id, "name": e.name, "rank": e.rank,
                               "layers": list(e.layers), "has_model": e.has_model,
                               "guarantee": e.spec_info.get("guarantee"),
                               "metadata": e.metadata} for e in dock.list()],
                             indent=2, default=_jsonable))
            return 0
        print("| id | name | rank | layers | guarantee | model |\n|---|---|---|---|---|---|")
        for e in dock.list():
            g = e.spec_info.get("guarantee", {})
            eps = g.get("epsilon")
            kind = g.get("kind", "?") + (f" eps={eps:.3g}" if isinstance(eps, float) else "")
            print(f"| {e.id} | {e.name} | {e.rank} | {len(e.layers)} | {kind} | "
                  f"{'yes' if e.has_model else 'no'} |")
    elif action == "show":
        key = int(ns.learnware) if ns.learnware.isdigit() else ns.learnware
        e = dock.get(key)
        print(json.dumps({"id": e.id, "name": e.name, "metadata": dict(e.metadata),
                          "backbone_id": e.backbone_id, "backbone_hash": e.backbone_hash,
                          "rank": e.rank, "layers": list(e.layers), "a_hash": e.a_hash,
                          "spec_info": dict(e.spec_info), "has_model": e.has_model,
                          "created": e.created}, indent=2, default=str))
    return 0


def _query(ns: argparse.Namespace):
    """The user spec of ``dock search``: a release, or made here from --user-data."""
    from pavejax.release import load_spec

    if (ns.spec is None) == (ns.user_data is None):
        raise ValueError("give a user spec release directory or --user-data (one of them)")
    if ns.spec is not None:
        return load_spec(ns.spec)
    from pavejax.commands import spec as spec_cmd

    flags = argparse.Namespace(
        dock=ns.dock, model=None, user_task=None, user_data=ns.user_data, task=None, data=None,
        text_column=ns.text_column, label_column=ns.label_column, classes=ns.classes,
        epsilon=None, delta=1e-5, clip=ns.clip, rank=None, layers=None, seq_len=ns.seq_len,
        seed=0, shots=None, examples=None, backbone=ns.backbone, pooling=ns.pooling)
    return spec_cmd.build_spec(flags)[0]


def _jsonable(obj):
    """json.dumps fallback: read-only mappings as dicts, NumPy scalars as floats."""
    from collections.abc import Mapping

    return dict(obj) if isinstance(obj, Mapping) else float(obj)
