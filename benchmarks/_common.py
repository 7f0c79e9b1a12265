"""Shared benchmark plumbing: the contract of DESIGN.md.

Each benchmark runs as ``python benchmarks/<name>.py [--quick] [--out FILE.json]``, prints a
markdown table and writes ``{"benchmark", "config", "rows", "summary", "env"}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Allow running a benchmark from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="small settings that finish in under two minutes on 2 CPU cores")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    if extra is not None:
        extra(p)
    return p.parse_args(argv)


def env_info() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_count": len(devices),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def median_time(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, repeats: int,
                        warmup: int = 1) -> dict[str, float]:
    """Times several functions alternately (round robin) so drift affects all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def compiled_bytes(compiled) -> int:
    """Bytes a compiled XLA program holds: arguments + temporaries + outputs, less the donated
    buffers it aliases (XLA's buffer assignment)."""
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return int(total - m.alias_size_in_bytes)


def paired_ratio(first: Callable[[], Any], second: Callable[[], Any], repeats: int
                 ) -> tuple[float, float]:
    """Median over ``repeats`` adjacent (first, second) pairs of first time / second time, in
    wall time and in process CPU time (all threads; other jobs on a shared machine stretch wall
    time but not CPU time). One warm-up call of each first; both must block until done."""
    first(), second()
    wall, cpu = [], []
    for _ in range(repeats):
        samples = []
        for fn in (first, second):
            w, c = time.perf_counter(), time.process_time()
            fn()
            samples.append((time.perf_counter() - w, time.process_time() - c))
        wall.append(samples[0][0] / samples[1][0])
        cpu.append(samples[0][1] / samples[1][1])
    return statistics.median(wall), statistics.median(cpu)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def emit(name: str, config: dict[str, Any], rows: list[dict[str, Any]],
         summary: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """Prints the markdown table and summary, writes the JSON result when ``out`` is given."""
    result = {"benchmark": name, "config": config, "rows": rows, "summary": summary,
              "env": env_info()}
    print(f"## {name}\n")
    print(markdown_table(rows))
    print("\nsummary: " + json.dumps(summary, sort_keys=True))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result
