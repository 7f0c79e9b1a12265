"""Run the performance benchmarks on one accelerator host (GPU or TPU) within a time budget.

Usage::

    bash benchmarks/accelerator.sh [--budget-s 720] [--out FILE.json] [--md FILE.md] [--only a,b]
    bash benchmarks/accelerator.sh --smoke          # CPU-sized: every benchmark in seconds

Runs, in this order and each as its own subprocess (own process group, own timeout), the full
modes of ``dp_overhead.py``, ``vs_opacus.py`` (only where ``import torch, opacus`` works and
``torch.cuda.is_available()``; otherwise recorded as skipped with the reason), ``paczero.py``,
``paczero_lm.py`` and ``dock_search.py``. Before each one the time it needs is estimated: a
nominal figure per benchmark and mode (``BENCHMARKS`` below: guesses for one H100-class GPU,
not measurements), times a scale = measured / nominal wall time of the benchmarks that already
ran successfully (clamped to [0.25, 4]). The largest mode (full, then reduced, then quick) whose
estimate fits the remaining budget, less a reserve for the smallest mode of every later
benchmark, is run; when only quick fits by eating into that reserve it still runs; when not even
quick fits, the benchmark is skipped. Each record says which (``scaled``: full / reduced / quick
/ skipped, and ``reason``). A benchmark's timeout is the budget left after the later ones'
reserve (all that is left, for one that ate into the reserve).

``--smoke`` runs every benchmark in its smallest mode, sized for 2 CPU cores (under a minute
in all): ``quick`` is the script's ``--quick`` plus its smallest options (a real run;
``dp_overhead`` only its LoRA setting where it has ``--settings``);
``help`` only imports the script and runs ``--help``, for benchmarks whose quick mode takes
minutes on CPU. ``vs_opacus`` needs only ``import torch, opacus`` there (no CUDA).

The device (``jax.devices()[0].device_kind``, platform, count, JAX version, host CPUs) is read
in a subprocess, so this driver never holds the accelerator (on TPU only one process may).
Output: ``--out`` (default ``benchmark-report/accelerator.json``, next to ``report.py``'s) in
the benchmark format of DESIGN.md plus ``device`` and per-benchmark ``benchmarks`` records
(mode, reason, command, estimate, timeout, wall time, return code, summary, the tail of stderr
on failure); ``--md`` (default: ``--out`` with ``.md``) one table row per benchmark with its
headline summary keys, titled with the device name. Each benchmark's JSON and its stdout /
stderr logs go to the folder ``<out stem>/`` beside ``--out``; both files are rewritten after
every benchmark. A failing or timed-out benchmark does not stop the others; the exit status is
1 if any failed (skips are not failures). ``--quick`` is accepted as ``--smoke`` so that
``report.py`` can run this script like any other benchmark.

Relative paths are taken from the repository root (``accelerator.sh`` changes to it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TAIL_LINES = 20
SCALE_BOUNDS = (0.25, 4.0)


@dataclass(frozen=True)
class Bench:
    """One benchmark script: its modes, largest first, as (label, extra args, nominal seconds
    on one accelerator); its CPU smoke mode; the summary keys the markdown table shows."""

    name: str
    modes: tuple[tuple[str, tuple[str, ...], float], ...]
    smoke: tuple[str, tuple[str, ...], float]
    headline: tuple[str, ...]
    needs_torch: bool = False
    note: str = ""
    # Extra smoke arguments, each group passed only where the script declares its flag (a flag
    # a script may gain or lose without breaking the smoke run).
    smoke_optional: tuple[tuple[str, ...], ...] = ()

    def smoke_args(self, script: Path) -> tuple[str, ...]:
        source = script.read_text() if script.is_file() else ""
        extra = [a for group in self.smoke_optional if f'"{group[0]}"' in source for a in group]
        return (*self.smoke[1], *extra)


BENCHMARKS: tuple[Bench, ...] = (
    Bench("dp_overhead",
          (("full", (), 150.0), ("quick", ("--quick",), 60.0)),
          ("quick", ("--quick",), 30.0),
          ("lora_ratio", "full_ratio", "full_mem_ratio", "full_ghost_ratio",
           "full_ghost_mem_ratio", "lm_full_ghost_ratio", "lm_full_ghost_mem_ratio"),
          smoke_optional=(("--settings", "lora"),)),
    Bench("vs_opacus",
          (("full", (), 240.0), ("reduced", ("--quick",), 120.0),
           ("quick", ("--quick", "--settings", "lora"), 60.0)),
          ("help", ("--help",), 3.0),
          ("lora_dp_speedup", "full_dp_speedup", "full_dp_mem_ratio"),
          needs_torch=True,
          note="_opacus_worker.py runs Opacus on the CPU: on an accelerator host the ratios "
               "compare pavejax on the accelerator with Opacus on the host CPU"),
    Bench("paczero",
          (("full", (), 300.0), ("reduced", ("--mode", "mid"), 150.0),
           ("quick", ("--quick",), 60.0)),
          ("help", ("--help",), 5.0),
          ("zpl_acc", "mezo_acc", "zero_shot_acc", "step_over_forward", "mem_over_inference")),
    Bench("paczero_lm",
          (("full", (), 2400.0), ("reduced", ("--mode", "mid"), 420.0),
           ("quick", ("--quick",), 120.0)),
          ("help", ("--help",), 5.0),
          ("zpl_acc", "mezo_acc", "dplora_eps6_acc", "squad_zpl_f1", "step_over_forward")),
    Bench("dock_search",
          (("full", (), 180.0), ("reduced", ("--sizes", "10000"), 60.0),
           ("quick", ("--quick",), 30.0)),
          ("quick", ("--quick", "--sizes", "1000"), 10.0),
          ("bandwidth_fraction", "speedup_vs_loop", "numpy_gbps_median")),
)


# --- the budget decision (pure) ----------------------------------------------------------------


class Choice(NamedTuple):
    mode: str  # a mode label, or "skipped"
    reason: str
    timeout_s: float  # 0 when skipped


def scale_factor(history: Sequence[tuple[float, float]]) -> float:
    """Measured / nominal seconds over the (measured, nominal) pairs of finished benchmarks,
    clamped to ``SCALE_BOUNDS``; 1 before any finished."""
    nominal = sum(n for _, n in history)
    if nominal <= 0:
        return 1.0
    lo, hi = SCALE_BOUNDS
    return min(hi, max(lo, sum(m for m, _ in history) / nominal))


def choose_mode(remaining_s: float, estimates: Sequence[tuple[str, float]], *,
                reserve_s: float = 0.0, scale: float = 1.0) -> Choice:
    """The largest mode of ``estimates`` ((label, nominal seconds), largest first) whose
    ``nominal * scale`` fits ``remaining_s - reserve_s`` (``reserve_s``: what the later
    benchmarks' smallest modes need); else the smallest mode if it fits ``remaining_s`` at all
    (eating into the reserve); else skipped."""
    if not estimates:
        return Choice("skipped", "no mode to run", 0.0)
    free = remaining_s - reserve_s
    first, first_need = estimates[0][0], estimates[0][1] * scale
    for label, nominal in estimates:
        need = nominal * scale
        if need <= free:
            if label == first:
                why = (f"needs ~{need:.0f} s; {free:.0f} s free after reserving "
                       f"{reserve_s:.0f} s for the later benchmarks")
            else:
                why = (f"{first} needs ~{first_need:.0f} s but only {free:.0f} s are free after "
                       f"reserving {reserve_s:.0f} s for the later benchmarks; {label} needs "
                       f"~{need:.0f} s")
            return Choice(label, why, free)
    label, need = estimates[-1][0], estimates[-1][1] * scale
    if need <= remaining_s:
        return Choice(label, f"only {label} fits (~{need:.0f} s of {remaining_s:.0f} s left), "
                             f"using part of the {reserve_s:.0f} s reserved for the later "
                             f"benchmarks", remaining_s)
    return Choice("skipped", f"out of budget: even {label} needs ~{need:.0f} s, "
                             f"{max(remaining_s, 0.0):.0f} s left", 0.0)


# --- probes (subprocesses: the driver never initialises a backend) ------------------------------

_DEVICE_PROBE = """
import json, os, platform
import jax
d = jax.devices()
print(json.dumps({"device_kind": d[0].device_kind, "platform": d[0].platform,
                  "device_count": len(d), "devices": [str(x) for x in d],
                  "backend": jax.default_backend(), "jax": jax.__version__,
                  "python": platform.python_version(), "machine": platform.machine(),
                  "cpu_count": os.cpu_count()}))
"""


def _tail(text: str, n: int = TAIL_LINES) -> list[str]:
    return text.splitlines()[-n:]


def probe_device(python: str, timeout: float = 180.0) -> dict[str, Any]:
    """What ``jax.devices()`` sees, read in a subprocess; ``device_kind`` "unknown" on failure."""
    try:
        r = subprocess.run([python, "-c", _DEVICE_PROBE], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1])
        error = _tail(r.stderr)
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        error = [f"{type(e).__name__}: {e}"]
    return {"device_kind": "unknown", "platform": "unknown", "device_count": 0,
            "cpu_count": os.cpu_count(), "error": error}


def probe_torch(python: str, *, need_cuda: bool, timeout: float = 180.0) -> tuple[bool, str]:
    """Whether ``import torch, opacus`` works (and, with ``need_cuda``, CUDA is available)."""
    code = "import torch, opacus" + ("; assert torch.cuda.is_available()" if need_cuda else "")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return False, f"`python -c {code!r}` timed out"
    if r.returncode == 0:
        return True, f"`{code}` works"
    last = (_tail(r.stderr, 1) or [f"exit status {r.returncode}"])[0]
    fix = ("install torch with CUDA and the `peers` extra" if need_cuda
           else "install the `peers` extra")
    return False, f"`{code}` fails ({last}); {fix}"


# --- running one benchmark ---------------------------------------------------------------------


def _run_group(cmd: list[str], timeout: float, out_log: Path, err_log: Path
               ) -> tuple[int | None, bool]:
    """Runs ``cmd`` in its own process group; on timeout the whole group (vs_opacus starts
    workers) gets SIGTERM, then SIGKILL after 10 s. Returns (return code, timed out)."""
    with out_log.open("w") as fo, err_log.open("w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=ROOT, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 1.0)), False
        except subprocess.TimeoutExpired:
            pass
        except BaseException:  # Ctrl-C: do not leave the benchmark running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return proc.returncode, True


def run_benchmark(bench: Bench, label: str, args: Sequence[str], python: str, work: Path,
                  timeout: float) -> dict[str, Any]:
    script = HERE / f"{bench.name}.py"
    out_json = work / f"{bench.name}.json"
    out_json.unlink(missing_ok=True)
    help_only = "--help" in args
    cmd = [python, str(script), *args, *([] if help_only else ["--out", str(out_json)])]
    shown = " ".join(["python", f"benchmarks/{script.name}", *args,
                      *([] if help_only else ["--out", str(out_json)])])
    print(f"[accelerator] {bench.name} ({label}, timeout {timeout:.0f} s): {shown}", flush=True)
    t0 = time.perf_counter()
    rc, timed_out = _run_group(cmd, timeout, work / f"{bench.name}.out.log",
                               work / f"{bench.name}.err.log")
    wall = time.perf_counter() - t0
    rec: dict[str, Any] = {"command": shown, "timeout_s": round(timeout, 1),
                           "wall_s": round(wall, 2), "returncode": rc, "summary": {}}
    if timed_out:
        rec["status"] = f"timed out after {timeout:.0f} s"
    elif rc != 0:
        rec["status"] = f"failed (exit status {rc})"
    else:
        rec["status"] = "ok"
        if not help_only:
            try:
                rec["summary"] = json.loads(out_json.read_text()).get("summary", {})
                rec["result"] = str(out_json)
            except (OSError, ValueError) as e:
                rec["status"] = f"failed (no valid JSON result: {e})"
    if rec["status"] != "ok":
        err = (work / f"{bench.name}.err.log").read_text(errors="replace")
        rec["stderr_tail"] = _tail(err)
    print(f"[accelerator] {bench.name}: {rec['status']} in {wall:.1f} s", flush=True)
    return rec


# --- output ------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    text = f"{v:.3g}" if isinstance(v, float) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def headline(bench: Bench, summary: dict[str, Any]) -> str:
    parts = [f"{k} {_fmt(summary[k])}" for k in bench.headline if summary.get(k) is not None]
    return ", ".join(parts) or "-"


def device_title(device: dict[str, Any]) -> str:
    n = device.get("device_count", "?")
    return (f"{device.get('device_kind', 'unknown')} ({device.get('platform', '?')}, "
            f"{n} device{'' if n == 1 else 's'})")


def render_markdown(result: dict[str, Any]) -> str:
    device, summary, cfg = result["device"], result["summary"], result["config"]
    lines = [f"# pavejax benchmarks on {device_title(device)}", "",
             f"JAX {device.get('jax', '?')}, {device.get('cpu_count', '?')} host CPUs; "
             f"{'smoke mode (CPU-sized), ' if cfg['smoke'] else ''}budget {cfg['budget_s']:.0f} s, "
             f"total {summary['total_wall_s']:.0f} s.", "",
             "| benchmark | mode | status | wall s | headline |", "|---|---|---|---|---|"]
    by = {b.name: b for b in BENCHMARKS}
    for r in result["benchmarks"]:
        wall = "-" if r.get("wall_s") is None else f"{r['wall_s']:.0f}"
        lines.append(f"| {r['name']} | {r['scaled']} | {_fmt(r['status'])} | {wall} | "
                     f"{headline(by[r['name']], r.get('summary', {}))} |")
    lines += ["", "Modes chosen:", ""]
    lines += [f"- {r['name']}: {r['scaled']} ({_fmt(r['reason'])})" for r in result["benchmarks"]]
    notes = [f"- {r['name']}: {r['note']}" for r in result["benchmarks"] if r.get("note")]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def _write(result: dict[str, Any], out: Path, md: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    md.write_text(render_markdown(result))


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", "--quick", dest="smoke", action="store_true",
                   help="every benchmark in its smallest mode, sized for 2 CPU cores")
    p.add_argument("--budget-s", type=float, default=720.0,
                   help="total seconds for the whole run, probes included (default 720)")
    p.add_argument("--out", type=Path, default=Path("benchmark-report/accelerator.json"),
                   help="JSON result (relative to the repository root)")
    p.add_argument("--md", type=Path, default=None,
                   help="markdown table (default: --out with .md)")
    p.add_argument("--only", default=None, help="comma-separated benchmark names to run")
    args = p.parse_args(argv)
    known = [b.name for b in BENCHMARKS]
    if args.only:
        names = [n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()]
        if not names or set(names) - set(known):
            p.error(f"--only: unknown benchmark(s) in {args.only!r}; available: {known}")
        args.only = names
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    python = sys.executable
    out = args.out if args.out.is_absolute() else ROOT / args.out
    md = args.md or out.with_suffix(".md")
    md = md if md.is_absolute() else ROOT / md
    work = out.parent / out.stem
    work.mkdir(parents=True, exist_ok=True)

    benches = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    device = probe_device(python)
    print(f"[accelerator] device: {device_title(device)}, JAX {device.get('jax', '?')}",
          flush=True)
    blocked: dict[str, str] = {}
    if any(b.needs_torch for b in benches):
        ok, why = probe_torch(python, need_cuda=not args.smoke)
        if not ok:
            blocked.update({b.name: why for b in benches if b.needs_torch})
    ladders = {b.name: [b.smoke] if args.smoke else list(b.modes) for b in benches}

    result: dict[str, Any] = {
        "benchmark": "accelerator",
        "config": {"budget_s": args.budget_s, "smoke": args.smoke,
                   "benchmarks": [b.name for b in benches],
                   "nominal_s": {n: {m[0]: m[2] for m in lad} for n, lad in ladders.items()}},
        "device": device, "env": device, "benchmarks": [], "rows": [], "summary": {}}
    history: list[tuple[float, float]] = []
    for i, bench in enumerate(benches):
        rec: dict[str, Any] = {"name": bench.name}
        if bench.note and not args.smoke:
            rec["note"] = bench.note
        if bench.name in blocked:
            rec.update(scaled="skipped", status="skipped", reason=blocked[bench.name],
                       wall_s=None, returncode=None, summary={})
        else:
            scale = scale_factor(history)
            later = [b for b in benches[i + 1:] if b.name not in blocked]
            reserve = scale * sum(ladders[b.name][-1][2] for b in later)
            ladder = ladders[bench.name]
            choice = choose_mode(deadline - time.monotonic(), [(m[0], m[2]) for m in ladder],
                                 reserve_s=reserve, scale=scale)
            rec.update(scaled=choice.mode, reason=choice.reason)
            if choice.mode == "skipped":
                rec.update(status="skipped", wall_s=None, returncode=None, summary={})
                print(f"[accelerator] {bench.name}: skipped ({choice.reason})", flush=True)
            else:
                label, extra, nominal = next(m for m in ladder if m[0] == choice.mode)
                if args.smoke:
                    extra = bench.smoke_args(HERE / f"{bench.name}.py")
                rec.update(nominal_s=nominal, estimate_s=round(nominal * scale, 1))
                rec.update(run_benchmark(bench, label, extra, python, work, choice.timeout_s))
                if rec["status"] == "ok":
                    history.append((rec["wall_s"], nominal))
        result["benchmarks"].append(rec)
        result["rows"].append({k: rec.get(k) for k in
                               ("name", "scaled", "status", "wall_s", "returncode")})
        failed = [r["name"] for r in result["benchmarks"]
                  if r["status"] not in ("ok", "skipped")]
        result["summary"] = {
            "total_wall_s": round(time.monotonic() - start, 2), "budget_s": args.budget_s,
            "device_kind": device.get("device_kind"),
            "ok": [r["name"] for r in result["benchmarks"] if r["status"] == "ok"],
            "failed": failed,
            "skipped": [r["name"] for r in result["benchmarks"] if r["status"] == "skipped"],
            "not_full": [r["name"] for r in result["benchmarks"] if r["scaled"] != "full"],
            "scale": round(scale_factor(history), 3)}
        _write(result, out, md)  # after every benchmark: an interrupted run keeps what finished
    print()
    print(render_markdown(result))
    print(f"[accelerator] wrote {out} and {md}", flush=True)
    return 1 if result["summary"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
