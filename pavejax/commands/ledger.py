"""``pavejax ledger RELEASE``: verify a release and print what it claims about privacy."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pavejax.commands import _shared as sh

DESCRIPTION = (
    "Verify a release (content hash, format) and print its metadata, its guarantee with its "
    "conditions, the epsilon its ledger gives at --delta under both accountants (RDP and PLD), "
    "mutual-information charges, and the disclosure/amplification risk bounds. Epsilons are "
    "for the neighbouring relation the ledger records (replace-one of one private example for "
    "every release this version writes: a release states its dataset sizes, which are public) "
    "and protect that example from anyone who sees the release; a "
    "'sketch_rdp' guarantee is conditional, a 'pac_mi' guarantee bounds mutual information "
    "(nats) instead of epsilon.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION)
    p.add_argument("release", type=Path, help="release directory (model, merged model or spec)")
    p.add_argument("--delta", type=float, default=None,
                   help="report the ledger's epsilon at this delta (default: the guarantee's "
                        "delta, else 1e-5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def ledger_report(meta: Any, delta: float | None) -> dict[str, Any]:
    """The privacy record of a release's metadata, with the ledger re-evaluated at ``delta``."""
    from pavejax.accounting import Ledger

    g = dict(meta.guarantee)
    delta = float(delta if delta is not None else g.get("delta") or 1e-5)
    out: dict[str, Any] = {"kind": meta.kind, "mechanism": meta.mechanism,
                           "backbone_id": meta.backbone_id, "backbone_hash": meta.backbone_hash,
                           "created": meta.created, "library_version": meta.library_version,
                           "guarantee": g, "risk": dict(meta.risk), "ledger": None}
    if meta.a_hash is not None:
        out["space"] = {"rank": meta.rank, "layers": list(meta.adapted_layers),
                        "a_init": meta.a_init, "a_hash": meta.a_hash}
    if meta.ledger is not None:
        ledger = Ledger.from_dict(meta.ledger)
        summary = ledger.summary(delta)
        out["ledger"] = summary | {
            "mutual_information_nats": ledger.mutual_information(),
            "labels": sorted({e.label for e in ledger.entries} |
                             {e.label for e in ledger.mi_entries})}
    composed = dict(meta.extra.get("info", {})).get("composed_with_model")
    if composed is not None:
        out["composed_with_model"] = composed
    upstream = meta.extra.get("upstream")
    if isinstance(upstream, dict):
        out["upstream"] = {k: upstream.get(k) for k in ("release", "kind", "mechanism",
                                                         "guarantee")}
    for key in ("task", "classes", "test_accuracy", "sources"):
        if key in meta.extra:
            out[key] = meta.extra[key]
    data = meta.extra.get("data")
    if isinstance(data, dict):
        out["data"] = data
    return out


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.4g}"
    return "n/a" if x is None else str(x)


def _lines(path: Path, digest: str, r: dict[str, Any]) -> list[str]:
    g = r["guarantee"]
    lines = [f"release {path}", f"  content hash {digest} (verified)",
             f"  kind {r['kind']}; mechanism {r['mechanism']}; backbone {r['backbone_id']} "
             f"({r['backbone_hash'][:12]}...); created {r['created']}; pavejax "
             f"{r['library_version']}"]
    if "space" in r:
        s = r["space"]
        lines.append(f"  spec space: rank {s['rank']}, {len(s['layers'])} adapted leaves, A "
                     f"{s['a_init']} (hash {s['a_hash'][:12]}...; A itself is never released)")
    for key in ("task", "classes", "test_accuracy"):
        if key in r:
            lines.append(f"  {key}: {r[key]}")
    data = r.get("data") or {}
    sizes = ", ".join(f"{k} {data[k]}" for k in ("num_train", "pool_size", "train_size",
                                                   "test_size", "seq_len", "seed") if k in data)
    if sizes:
        lines.append(f"  data (public facts): {sizes}")
    if isinstance(data.get("file"), dict):
        f = data["file"]
        lines.append(f"  data file of the user's own ({f.get('format')}): text column "
                     f"{f.get('text_column')!r}, label column {f.get('label_column')!r}, "
                     f"classes {f.get('label_source')}, split {f.get('split')}"
                     f"{', test file given' if f.get('test_file') else ''}; its folder and hash "
                     f"are not in the release")
    lines.append(f"guarantee: {g.get('kind')}")
    if g.get("kind") == "dp":
        lines.append(f"  epsilon {_fmt(g['epsilon'])} at delta {g['delta']:g}, relation "
                     f"{g.get('relation', '?')}, accountant {g.get('accountant', '?')}")
        if "epsilon_if_disjoint" in g:
            lines.append(f"  epsilon if the sources' data are disjoint "
                         f"{_fmt(g['epsilon_if_disjoint'])}")
    elif g.get("kind") == "pac_mi":
        lines.append(f"  mutual information {_fmt(g['mutual_information_nats'])} nats; "
                     f"membership posterior <= {_fmt(g['mia_posterior_bound'])} (prior "
                     f"{g['membership_prior']})")
    for key in ("protects", "against", "note", "not_covered", "parallel_composition"):
        if key in g:
            lines.append(f"  {key.replace('_', ' ')}: {g[key]}")
    for c in g.get("conditions") or []:
        lines.append(f"  condition: {c}")
    if "composed_with_model" in r:
        c = r["composed_with_model"]
        lines.append(f"  with its model (same data): epsilon {_fmt(c['epsilon'])} at "
                     f"delta {c['delta']:g}, {c.get('relation', 'replace_one')}")
    led = r["ledger"]
    if led is None:
        lines.append("ledger: none (a non-private release)")
    else:
        if led["num_entries"]:
            eps = ", ".join(f"{k} {_fmt(v)}" for k, v in led["epsilon"].items())
            dp = (f"{led['num_entries']} DP entries, relation {led['relation']}; epsilon at "
                  f"delta {led['delta']:g}: {eps}")
        else:
            dp = "no DP entries"
        lines.append(f"ledger: {dp}; mutual information "
                     f"{_fmt(led['mutual_information_nats'])} nats; labels "
                     f"{', '.join(led['labels']) or '-'}")
    bounds = {k: v for k, v in r["risk"].items()
              if k not in ("epsilon", "delta") and not isinstance(v, str)}
    if bounds:
        lines.append("risk bounds: " + ", ".join(f"{k} {_fmt(v)}" for k, v in bounds.items()))
    if "upstream" in r:
        ug = r["upstream"]["guarantee"] or {}
        lines.append(f"upstream: {r['upstream']['release']} ({r['upstream']['mechanism']}), "
                     f"guarantee {ug.get('kind')} epsilon {_fmt(ug.get('epsilon'))} on its own "
                     f"training data")
    return lines


def run(ns: argparse.Namespace) -> int:
    import json

    from pavejax.release import content_hash, load_release

    _, meta = load_release(ns.release)  # checks format and content hash
    report = ledger_report(meta, ns.delta)
    digest = content_hash(ns.release)
    if ns.json:
        print(json.dumps({"release": str(ns.release), "content_hash": digest} | report,
                         indent=2, default=float))
    else:
        print("\n".join(_lines(ns.release, digest, report)))
    return 0
