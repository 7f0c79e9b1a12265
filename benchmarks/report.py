"""Run every benchmark and assemble one markdown report with its tables, summaries and plots.

Usage::

    python benchmarks/report.py [--quick | --full] [--only a,b] [--out-dir DIR]

Every ``benchmarks/<name>.py`` except ``_*.py`` and this script runs as its own subprocess,
``python <name>.py [--quick] --out DIR/<name>.json`` (the benchmark contract of DESIGN.md), in
name order. ``--quick`` (the default) runs each in its quick mode (under about two minutes
each on 2 CPU cores; numbers can be far from the papers'); ``--full`` runs the full modes,
sized for one GPU. The report ``DIR/report.md`` holds a status table, then for each benchmark
its command, wall time, table, summary and every PNG it wrote (benchmarks put their plot next
to their JSON, i.e. in ``DIR``; a plot written elsewhere and named in the summary is copied
there). Each benchmark's output goes to ``DIR/logs/<name>.log``. A failing or timed-out
benchmark is reported with the end of its log and the others still run; the exit status is 1
if any failed. ``DIR/report.json`` collects the results. Both files are rewritten after every
benchmark, so an interrupted run leaves the report of what finished.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOG_TAIL = 40


def discover(bench_dir: Path) -> dict[str, Path]:
    """Benchmark scripts in ``bench_dir`` by name: ``*.py`` minus ``_*.py``, this script and
    ``accelerator.py`` (a driver of the others for one accelerator host, not a benchmark)."""
    me = Path(__file__).resolve()
    return {p.stem: p for p in sorted(bench_dir.glob("*.py"))
            if not p.name.startswith("_") and p.resolve() != me
            and p.name not in ("report.py", "accelerator.py")}


def select(found: dict[str, Path], only: str | None) -> dict[str, Path]:
    """The benchmarks named in ``only`` (comma-separated), or all."""
    if not only:
        return found
    names = [n.strip().removesuffix(".py") for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in found]
    if unknown or not names:
        raise SystemExit(f"--only: unknown benchmark(s) {unknown or only!r}; available: "
                         f"{', '.join(found) or '(none)'}")
    return {n: found[n] for n in names}


def run_one(name: str, script: Path, out_dir: Path, *, quick: bool,
            timeout: float | None) -> dict[str, Any]:
    """Run one benchmark; returns its record (status, seconds, command, result or log tail)."""
    out_json = out_dir / f"{name}.json"
    out_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), *(["--quick"] if quick else []), "--out", str(out_json)]
    log = out_dir / "logs" / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=script.parent,
                                timeout=timeout).returncode
            status = "ok" if rc == 0 else f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:g} s"
    record: dict[str, Any] = {"name": name, "status": status,
                              "seconds": time.perf_counter() - t0,
                              "command": " ".join([Path(sys.executable).name,
                                                   f"benchmarks/{script.name}", *cmd[2:-2],
                                                   "--out", out_json.name])}
    if status == "ok":
        try:
            record["result"] = json.loads(out_json.read_text())
        except (OSError, ValueError) as e:
            record["status"] = f"failed (no valid JSON result: {e})"
    if record["status"] != "ok":
        lines = log.read_text(errors="replace").splitlines()
        record["log_tail"] = lines[-LOG_TAIL:]
    record["plots"] = _collect_plots(name, record.get("result"), out_dir)
    return record


def _collect_plots(name: str, result: dict | None, out_dir: Path) -> list[str]:
    named = (result or {}).get("summary", {}).get("plot")
    if isinstance(named, str) and Path(named).is_file():
        src = Path(named).resolve()
        if src.parent != out_dir.resolve():
            shutil.copy2(src, out_dir / f"{name}-{src.name}")
    found = [*out_dir.glob(f"{name}.png"), *out_dir.glob(f"{name}-*.png")]
    return sorted(p.name for p in found)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(c for r in rows for c in r))

    def fmt(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def render(records: list[dict[str, Any]], *, quick: bool) -> str:
    """The markdown report."""
    mode = "quick" if quick else "full"
    env = next((r["result"].get("env", {}) for r in records if "result" in r), {})
    lines = [f"# pavejax benchmarks ({mode} mode)", ""]
    if env:
        lines += [f"JAX {env.get('jax', '?')}, backend {env.get('backend', '?')}, "
                  f"{env.get('device_count', '?')} device(s), Python {env.get('python', '?')}.",
                  ""]
    if quick:
        lines += ["Quick mode: small settings that run on 2 CPU cores; numbers can be far from "
                  "the papers' (see each benchmark's docstring).", ""]
    lines += ["| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| [{r['name']}](#{r['name']}) | {r['status']} | "
              f"{r['seconds']:.0f} |" for r in records]
    for r in records:
        lines += ["", f"## {r['name']}", "", f"`{r['command']}`: {r['status']} in "
                  f"{r['seconds']:.0f} s", ""]
        if "result" in r:
            res = r["result"]
            lines += [_table(res.get("rows", [])), "", "Summary:", "", "```json",
                      json.dumps(res.get("summary", {}), indent=2, sort_keys=True,
                                 default=str), "```"]
        else:
            lines += [f"Last lines of `logs/{r['name']}.log`:", "", "```",
                      *r.get("log_tail", []), "```"]
        lines += [f"\n![{r['name']}]({p})" for p in r["plots"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="run each benchmark in quick mode (default)")
    mode.add_argument("--full", dest="quick", action="store_false",
                      help="run each benchmark in full mode (sized for one GPU)")
    p.add_argument("--only", default=None, help="comma-separated benchmark names to run")
    p.add_argument("--out-dir", type=Path, default=Path("benchmark-report"),
                   help="folder for report.md, report.json, JSON results, plots and logs")
    p.add_argument("--bench-dir", type=Path, default=HERE,
                   help="folder of the benchmark scripts (default: this script's folder)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a benchmark is stopped and reported as timed out")
    args = p.parse_args(argv)
    scripts = select(discover(args.bench_dir.resolve()), args.only)
    if not scripts:
        raise SystemExit(f"no benchmarks found in {args.bench_dir}")
    out_dir = args.out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    records = []
    for name, script in scripts.items():
        print(f"[report] {name} ...", flush=True)
        records.append(run_one(name, script, out_dir, quick=args.quick, timeout=args.timeout))
        print(f"[report] {name}: {records[-1]['status']} ({records[-1]['seconds']:.0f} s)",
              flush=True)
        # rewritten after every benchmark, so an interrupted run still leaves a report
        (out_dir / "report.md").write_text(render(records, quick=args.quick))
        (out_dir / "report.json").write_text(json.dumps(records, indent=2, default=str) + "\n")
    failed = [r["name"] for r in records if r["status"] != "ok"]
    print(f"[report] {out_dir / 'report.md'}: {len(records) - len(failed)} ok"
          + (f", failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
