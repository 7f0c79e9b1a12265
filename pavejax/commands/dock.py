"""``pavejax dock init|submit|search|list|show|download|withdraw|token|serve``: the dock from
the command line.

Specs and models travel as releases (:mod:`pavejax.release`): ``pavejax spec`` writes a spec
release; ``submit`` reads it (and optionally a model release) and stores both in the dock.
Every action but ``init``, ``token`` and ``serve`` takes a dock folder or the URL of a dock
service (``pavejax dock serve``); over HTTP, ``search`` downloads the published specs and ranks
on this machine (the user's spec is never sent), and ``submit``/``withdraw`` need a developer
token (``--token`` or ``PAVEJAX_DOCK_TOKEN``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pavejax.commands import _shared as sh

_PRIVACY_NOTE = (
    "The dock keeps the secret key of A in <dock>/secret (mode 0600): lend it only to the "
    "developers and users of this dock. Specs are compared only within one dock (same backbone, "
    "layers, rank and A). 'dock serve' publishes the key and serves only specs with a certified "
    "DP guarantee; searches over HTTP run on the user's machine.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Create, fill and search a learnware dock. " + _PRIVACY_NOTE
    sub = p.add_subparsers(dest="dock_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="create an empty dock (and its secret A key)")
    init.add_argument("dock", type=Path, help="dock directory to create")
    init.add_argument("--exist-ok", action="store_true", help="open it if it already exists")
    init.add_argument("--database", default=None, metavar="URL",
                      help="keep the index in this empty PostgreSQL database "
                      "(postgresql://user@host:port/dbname; password in PGPASSWORD or "
                      "~/.pgpass) instead of <dock>/index.sqlite, so several machines or "
                      "server processes share the dock")
    init.add_argument("--tensors", default=None, metavar="ROOT",
                      help="keep the tensor dirs and release archives under ROOT instead of "
                      "<dock>/tensors: a local or mounted folder, or an object-store path "
                      "such as gs://bucket/market (with its filesystem package installed)")
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
    submit.add_argument("dock", type=sh.dock_location, help=_WHERE)
    submit.add_argument("spec", type=Path, help="spec release directory (pavejax spec --out)")
    submit.add_argument("--name", required=True, help="unique learnware name")
    submit.add_argument("--model", type=Path, default=None,
                        help="model release directory (stored with the spec for reuse)")
    submit.add_argument("--metadata", default="{}",
                        help='JSON metadata, e.g. \'{"classes": ["negative", "positive"]}\'')
    search = sub.add_parser("search", help="rank the dock's learnwares for a user spec release")
    search.add_argument("dock", type=sh.dock_location, help=_WHERE)
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
    lst.add_argument("dock", type=sh.dock_location, help=_WHERE)
    for cmd in (init, submit, lst):
        cmd.add_argument("--json", action="store_true", help="print JSON instead of text")
    show = sub.add_parser("show", help="show one learnware's index record")
    show.add_argument("dock", type=sh.dock_location, help=_WHERE)
    show.add_argument("learnware", help="id or name")
    down = sub.add_parser("download", help="write a learnware's spec or model release to a "
                          "folder (verified)")
    down.add_argument("dock", type=sh.dock_location, help=_WHERE)
    down.add_argument("learnware", help="id or name")
    down.add_argument("--what", choices=("spec", "model"), default="model",
                      help="which release (default %(default)s)")
    down.add_argument("--out", type=Path, required=True, help="new release directory")
    wd = sub.add_parser("withdraw", help="remove a learnware (over HTTP: only the account that "
                        "submitted it)")
    wd.add_argument("dock", type=sh.dock_location, help=_WHERE)
    wd.add_argument("learnware", help="id or name")
    for cmd in (submit, wd):
        cmd.add_argument("--token", default=None,
                         help="developer token for a dock URL (default: $PAVEJAX_DOCK_TOKEN)")
    tok = sub.add_parser("token", help="issue (or revoke) a developer account's token for "
                         "submitting over HTTP")
    tok.add_argument("dock", type=Path, help="dock directory (on the serving machine)")
    tok.add_argument("--account", default=None, help="account name (letters, digits, -_.@)")
    tok.add_argument("--revoke", action="store_true", help="revoke the account's token")
    tok.add_argument("--list", action="store_true", help="list the accounts")
    tok.add_argument("--json", action="store_true", help="print JSON instead of text")
    serve = sub.add_parser("serve", help="serve the dock over HTTP: the JSON API, the spec "
                           "snapshot for client-side search, submissions with tokens, and a "
                           "read-only page")
    serve.add_argument("dock", type=Path, help="dock directory (SQLite or PostgreSQL index)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default %(default)s: this machine only)")
    serve.add_argument("--port", type=sh.positive_int, default=8750,
                       help="TCP port (default %(default)s)")
    serve.add_argument("--max-upload-mb", type=sh.positive_float, default=256,
                       help="largest submission accepted, MiB (default %(default)s)")
    serve.add_argument("--title", default=None, help="title of the page")


_WHERE = "dock directory, or the URL of a dock service (http://host:port)"


def _open(where: Path | str, token: str | None = None):
    from pavejax.pave.dock import Dock
    from pavejax.pave.remote import is_url

    if is_url(where):
        return Dock.remote(str(where), token=token or os.environ.get("PAVEJAX_DOCK_TOKEN"))
    return Dock.open(where)


def _local_only(ns: argparse.Namespace) -> None:
    from pavejax.pave.remote import is_url

    if is_url(str(ns.dock)):
        raise ValueError(f"'dock {ns.dock_command}' runs on the dock's own folder, not a URL")


def _serve(ns: argparse.Namespace) -> int:
    try:
        import uvicorn

        from pavejax.service.app import create_app
    except ImportError:
        raise SystemExit("serving a dock needs the service extra: pip install "
                         "'pavejax[service]'") from None
    app = create_app(ns.dock, max_upload_bytes=int(ns.max_upload_mb * (1 << 20)),
                     title=ns.title)
    svc = app.state.service
    print(f"serving the dock {ns.dock} ({len(svc.dock)} learnwares, {svc.dock.backend} index) "
          f"at http://{ns.host}:{ns.port}/ : certified DP specs only, A key public, searches "
          f"run on the clients", flush=True)
    if ns.host not in ("127.0.0.1", "localhost", "::1"):
        print("note: plain HTTP; beyond a trusted network put the service behind TLS (a "
              "reverse proxy), or tokens and downloads can be read and altered in transit",
              file=sys.stderr, flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning", access_log=False)
    return 0


def _token(ns: argparse.Namespace) -> int:
    from pavejax.pave.dock import Dock

    with Dock.open(ns.dock) as dock:
        if ns.list:
            print("\n".join(dock.accounts()) or "(no accounts)")
            return 0
        if not ns.account:
            raise ValueError("give --account NAME (or --list)")
        if ns.revoke:
            dock.revoke_account(ns.account)
            print(f"revoked the token of {ns.account!r}")
            return 0
        token = dock.add_account(ns.account)
    print(token if not ns.json else json.dumps({"account": ns.account, "token": token}))
    print(f"# the token of {ns.account!r}: shown once, the dock keeps only its hash; pass it "
          f"as --token or PAVEJAX_DOCK_TOKEN", file=sys.stderr)
    return 0


def _local_submit(dock, ns: argparse.Namespace, meta: dict):
    """Store a spec (and model) release in a local dock, with the release archives."""
    import tempfile

    from pavejax.pave import _archive
    from pavejax.release import content_hash, load_release, load_spec

    spec = load_spec(ns.spec)
    risk = load_release(ns.spec)[1].risk
    if risk:  # the release's risk bounds travel with the learnware, as over HTTP
        meta.setdefault("spec_risk", risk)
    model = None
    with tempfile.TemporaryDirectory(prefix="pavejax-submit-") as tmp:
        files = {}
        for what, d in (("spec", ns.spec), ("model", ns.model)):
            if d is None:
                continue
            with open(Path(tmp) / f"{what}.tar", "wb") as f:
                _archive.pack(f, [("release", Path(d))])
            files[what] = (Path(tmp) / f"{what}.tar", content_hash(d))
        if ns.model is not None:
            model, model_meta = load_release(ns.model,
                                             expect_backbone_hash=spec.signature.backbone_hash)
            meta.setdefault("model_release", model_meta.to_dict())
            # the class names of a model release travel with it (reuse needs them)
            if "classes" in model_meta.extra:
                meta.setdefault("classes", list(model_meta.extra["classes"]))
        return dock.submit(spec, name=ns.name, model=model, metadata=meta, files=files), spec


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
    from pavejax.pave.remote import RemoteDock

    action = ns.dock_command
    sh.select_backbone(ns)  # --backbone where the action takes one, else all-MiniLM-L6-v2
    if action == "serve":
        return _serve(ns)
    if action == "token":
        return _token(ns)
    if action == "init":
        subspace = None if ns.subspace is None else _subspace(ns)
        dock = Dock.create(ns.dock, exist_ok=ns.exist_ok, subspace=subspace,
                           database=ns.database, tensors=ns.tensors)
        if ns.json:
            print(json.dumps({"dock": str(ns.dock), "learnwares": len(dock),
                              "subspace": None if subspace is None else subspace.hash,
                              "note": _PRIVACY_NOTE}, indent=2))
            return 0
        where = "" if subspace is None else f" Coordinate subspace: {subspace!r}."
        print(f"dock ready at {ns.dock} ({len(dock)} learnwares).{where} {_PRIVACY_NOTE}")
        return 0
    dock = _open(ns.dock, getattr(ns, "token", None))
    remote = isinstance(dock, RemoteDock)
    if action == "submit":
        meta = _parse_metadata(ns.metadata)
        if remote:
            from pavejax.release import load_spec

            spec = load_spec(ns.spec)  # verified here too: a damaged release is not uploaded
            i = dock.submit(ns.spec, name=ns.name, model=ns.model, metadata=meta)
        else:
            i, spec = _local_submit(dock, ns, meta)
        if ns.json:
            print(json.dumps({"id": i, "name": ns.name, "has_model": ns.model is not None,
                              "guarantee": spec.info.get("guarantee")}, indent=2,
                             default=_jsonable))
        else:
            print(f"submitted {ns.name!r} as id {i}")
    elif action == "download":
        key = int(ns.learnware) if ns.learnware.isdigit() else ns.learnware
        out = dock.download(key, ns.what, ns.out)
        print(f"wrote the {ns.what} release of learnware {ns.learnware!r} to {out} (verified)")
    elif action == "withdraw":
        key = int(ns.learnware) if ns.learnware.isdigit() else ns.learnware
        entry = dock.remove(key)
        print(f"withdrew {entry.name!r} (id {entry.id})")
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
