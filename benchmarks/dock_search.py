"""Dock search throughput as a fraction of the memory-read floor, and speed-up over a spec loop.

Synthetic specs of MiniLM size: LoRA r=8 on query and value of 6 layers of width 384, i.e.
d = 6 * 2 * 8 * 384 = 36,864 float32 entries per spec. For each store size N (quick: 10k;
full: 10k and 100k) and storage dtype (float32, bfloat16), a :class:`CosineIndex` is built once
(device-resident unless it exceeds half the device memory, then streamed from host memory in
chunks) and searched with Q = 1 and Q = 16 queries (exact top-10).

* ``bandwidth``: stored matrix bytes / search time (the matrix is read once per search).
* ``numpy_gbps``: read bandwidth of a plain NumPy/BLAS matrix-vector product ``M @ v`` on the
  same float32 matrix, timed alternately with each search in the same run (the floor).
* ``fraction`` = bandwidth / numpy_gbps; summary ``bandwidth_fraction`` is the best row.
* ``speedup_vs_loop``: a per-learnware loop as the learnware package's searcher does it (load
  one spec from the dock's Orbax storage, compute its cosine, next) is timed on a real dock of
  ``loop_entries`` specs, extrapolated linearly to N, and divided by the float32 Q = 1 search
  time at the largest N.

On CPU, XLA has no fast bfloat16 matrix product (without AVX512-BF16), so the bf16 rows are
slow there; on GPU they halve the bytes read. Quick mode (10k, fewer repeats, a 50-entry loop)
runs in about a minute on 2 CPU cores; with 2 shared cores the NumPy reference itself is noisy.
When host RAM cannot hold the float32 matrix with room to spare, the matrix is written to a
temporary memmap and streamed (placement ``stream``).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import _common
import jax
import numpy as np

from pavejax.pave.dock import Dock
from pavejax.pave.search import build_index, search_index
from pavejax.spec_types import PaveSpec, SpecSignature, cosine

RANK, WIDTH, LAYERS = 8, 384, 6
PATHS = tuple(f"encoder/layers/{i}/attention/{m}/kernel" for i in range(LAYERS)
              for m in ("query", "value"))
SIGNATURE = SpecSignature("all-MiniLM-L6-v2", "0" * 64, RANK, PATHS, (RANK * WIDTH,) * len(PATHS),
                          "1" * 64, "gaussian")
DIM = SIGNATURE.dim
K = 10


def _extra(p) -> None:
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated store sizes N (default: quick 10000; full 10000,100000)")


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def synthetic_matrix(n: int, seed: int, workdir: Path) -> np.ndarray:
    """(n, DIM) float32 Gaussian specs, in RAM or (if RAM is short) in a memmap file."""
    rng = np.random.default_rng(seed)
    nbytes = n * DIM * 4
    if 3 * nbytes < _host_ram():
        m = np.empty((n, DIM), np.float32)
    else:
        m = np.memmap(workdir / f"specs-{n}.f32", np.float32, "w+", shape=(n, DIM))
    for s in range(0, n, 2048):
        m[s:s + 2048] = rng.standard_normal((min(2048, n - s), DIM), dtype=np.float32)
    return m


def loop_seconds_per_entry(matrix: np.ndarray, entries: int, workdir: Path) -> float:
    """Per-entry time of load-one-spec-then-cosine over a real dock of ``entries`` specs."""
    with Dock.create(workdir / "loop-dock") as dock:
        for i in range(entries):
            dock.submit(PaveSpec(matrix[i], SIGNATURE), name=f"dev{i}")
        ids = [e.id for e in dock.list()]
        query = np.asarray(matrix[0], np.float64) + 1.0
        t0 = time.perf_counter()
        scores = [(cosine(query, dock.load_spec(i).vector), i) for i in ids]
        sorted(scores, reverse=True)[:K]
        return (time.perf_counter() - t0) / entries


def _agrees(matrix: np.ndarray, query: np.ndarray, idx: np.ndarray) -> bool:
    """Our top-K equals the NumPy float32 ranking (same rows, allowing near-ties to swap)."""
    norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix, dtype=np.float64))
    cos = (matrix @ query) / norms / np.linalg.norm(query)
    ref = np.argsort(-cos, kind="stable")[:K]
    return bool(np.allclose(np.sort(cos[idx]), np.sort(cos[ref]), atol=1e-5))


def bench_size(n: int, workdir: Path, repeats: int, bf16_repeats: int) -> list[dict]:
    matrix = synthetic_matrix(n, seed=n, workdir=workdir)
    rng = np.random.default_rng(1)
    queries = {q: rng.standard_normal((q, DIM), dtype=np.float32) for q in (1, 16)}
    v = queries[1][0]
    rows = []
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        index = build_index(matrix, dtype=dtype)
        jax.block_until_ready(index.rows) if index.placement != "stream" else None
        build_s = time.perf_counter() - t0
        stored = n * DIM * (4 if dtype == "float32" else 2)
        for q, qs in queries.items():
            med = _common.interleaved_medians(
                {"ours": lambda qs=qs, index=index: search_index(index, qs, K),
                 "numpy": lambda: matrix @ v},
                repeats=repeats if dtype == "float32" else bf16_repeats)
            numpy_gbps = matrix.nbytes / med["numpy"] / 1e9
            ours_gbps = stored / med["ours"] / 1e9
            row = {"N": n, "dtype": dtype, "Q": q, "placement": index.placement,
                   "search_ms": 1e3 * med["ours"], "bandwidth_gbps": ours_gbps,
                   "numpy_gbps": numpy_gbps, "fraction": ours_gbps / numpy_gbps,
                   "specs_per_s": n * q / med["ours"], "build_s": build_s}
            if dtype == "float32" and q == 1:
                row["agrees_with_numpy"] = _agrees(matrix, v, search_index(index, v, K)[1][0])
            rows.append(row)
            print(row, flush=True)
        del index
    return rows


def main(argv=None) -> dict:
    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=_extra)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else
             [10_000] if args.quick else [10_000, 100_000])
    repeats, bf16_repeats = (5, 2) if args.quick else (9, 5)
    loop_entries = 50 if args.quick else 200
    config = {"dim": DIM, "rank": RANK, "layers": LAYERS, "width": WIDTH, "sizes": sizes, "k": K,
              "queries": [1, 16], "repeats": repeats, "bf16_repeats": bf16_repeats,
              "loop_entries": loop_entries, "quick": args.quick}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for n in sizes:
            rows += bench_size(n, workdir, repeats, bf16_repeats)
        per_entry = loop_seconds_per_entry(
            synthetic_matrix(loop_entries, seed=7, workdir=workdir), loop_entries, workdir)
    n_max = max(sizes)
    fp32_q1 = next(r for r in rows if r["N"] == n_max and r["dtype"] == "float32" and r["Q"] == 1)
    for r in rows:
        r["loop_s_extrapolated"] = per_entry * r["N"]
    best = max(rows, key=lambda r: r["fraction"])
    summary = {
        "bandwidth_fraction": round(best["fraction"], 3),
        "best_config": f"N={best['N']} {best['dtype']} Q={best['Q']} ({best['placement']})",
        "speedup_vs_loop": round(per_entry * n_max / (fp32_q1["search_ms"] / 1e3), 1),
        "loop_ms_per_entry": round(1e3 * per_entry, 3),
        "numpy_gbps_median": round(float(np.median([r["numpy_gbps"] for r in rows])), 2),
        "agrees_with_numpy": all(r.get("agrees_with_numpy", True) for r in rows),
        "target_bandwidth_fraction": 0.7,
    }
    return _common.emit("dock_search", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
