"""The HTTP dock under concurrent load: search and submit latency, errors, lost and duplicated
learnwares, on SQLite (one server) and PostgreSQL (two server processes, one database).

Each backend gets a fresh dock (``seeded`` learnwares submitted locally, one account per
client) served by real ``python -m pavejax dock serve`` subprocesses on loopback ports, then
:func:`pavejax.service.loadtest.run_load`: ``clients`` threads, each with its own
:class:`~pavejax.pave.remote.RemoteDock` (round robin over the servers), share a shuffled queue
of searches (snapshot sync + local top-5 ranking) and submits (a spec release uploaded, vetted
and committed). Afterwards every server's listing is checked: ``lost`` (a 201 submit missing
from a listing) and ``duplicated`` (a name listed twice, or listings that disagree) must be 0.

Specs have the size of a real all-MiniLM-L6-v2 DP-S-PAVE spec, rank 8 on the query and value
kernels of layers 4 and 5 (four 8 x 384 ``B`` blocks: dim 12,288), random vectors with the
certified guarantee of a real replace-one RDP ledger (sampled Gaussian steps).

Quick: 8 clients, 200 searches, 40 submits, 20 seeded learnwares; full: 16 clients, 2000
searches, 200 submits, 200 seeded. Rows: one per backend; summary keys without a prefix are
SQLite, ``pg_*`` PostgreSQL (null, with ``pg_skipped`` saying why, when no PostgreSQL server
can be started here). Searches run in this process (threads share its cores with the servers
on the same machine), so latencies include CPU contention with the servers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
import numpy as np

from pavejax.accounting import Ledger
from pavejax.accounting.events import gaussian_step_event
from pavejax.pave.dock import Dock
from pavejax.service.loadtest import local_server, run_load
from pavejax.spec_types import PaveSpec, SpecSignature

ROOT = Path(__file__).resolve().parent.parent
RANK, WIDTH, LAYERS = 8, 384, (4, 5)
PATHS = tuple(f"encoder/layers/{i}/attention/{m}/kernel" for i in LAYERS
              for m in ("query", "value"))
SIGNATURE = SpecSignature("all-MiniLM-L6-v2", "0" * 64, RANK, PATHS, (RANK * WIDTH,) * len(PATHS),
                          "1" * 64, "gaussian")
DIM = SIGNATURE.dim
# A DP-S-PAVE run: 200 steps of 64 of 1000 examples (fixed-size sampling without replacement),
# noise multiplier 4.5: epsilon 4.09 at delta 1e-5 (RDP, replace-one), near the demo's 4.
SIGMA, N, BATCH, STEPS, DELTA = 4.5, 1000, 64, 200, 1e-5
SUMMARY_KEYS = ("errors", "lost", "duplicated", "search_p50_ms", "search_p95_ms",
                "submit_p95_ms")


@dataclasses.dataclass(frozen=True)
class Settings:
    clients: int = 16
    searches: int = 2000
    submits: int = 200
    seeded: int = 200
    postgres: bool = True


QUICK = Settings(clients=8, searches=200, submits=40, seeded=20)


def dp_info() -> dict[str, Any]:
    """The spec info of a DP-S-PAVE spec: a real replace-one RDP ledger and its guarantee."""
    ledger = Ledger("replace_one", accountant="rdp")
    step = gaussian_step_event(SIGMA, q=BATCH / N, sampling="fixed", dataset_size=N,
                               batch_size=BATCH)
    ledger.record(step, count=STEPS, label="dp-s-pave")
    guarantee = {"kind": "dp", "epsilon": ledger.epsilon(DELTA), "delta": DELTA,
                 "relation": "replace_one", "accountant": "rdp"}
    return {"mechanism": "dp-s-pave", "noise_multiplier": SIGMA, "sampling_rate": BATCH / N,
            "ledger": ledger.to_dict(), "guarantee": guarantee}


def make_specs(info: dict[str, Any]):
    """``(make_spec, make_query)``: model spec ``j`` and user query ``j``, seeded by ``j``."""
    def vector(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(DIM, dtype=np.float32)

    def make_spec(j: int) -> PaveSpec:
        return PaveSpec(vector(1_000_000 + j), SIGNATURE, "model", info)

    def make_query(j: int) -> PaveSpec:
        return PaveSpec(vector(2_000_000 + j), SIGNATURE, "user", info)

    return make_spec, make_query


def dock_server(dock: Path, log: Path):
    """``python -m pavejax dock serve DOCK`` on a free loopback port; yields ``(url, proc)``."""
    return local_server(dock, log=log, env={"PYTHONPATH": str(ROOT)})


def run_backend(s: Settings, workdir: Path, info: dict[str, Any], *,
                database: str | None = None, servers: int = 1) -> dict[str, Any]:
    """One dock (SQLite, or PostgreSQL at ``database``), ``servers`` server processes, one
    load run; returns the row."""
    backend = "sqlite" if database is None else "postgresql"
    path = workdir / backend
    make_spec, make_query = make_specs(info)
    t0 = time.perf_counter()
    with Dock.create(path, signature=SIGNATURE, database=database) as dock:
        tokens = [dock.add_account(f"client{i}") for i in range(s.clients)]
        for i in range(s.seeded):
            dock.submit(make_spec(100_000 + i), name=f"seed-{i:04d}")
    seed_s = time.perf_counter() - t0
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(dock_server(path, workdir / f"{backend}-{i}.log"))[0]
                for i in range(servers)]
        r = run_load(urls, tokens, clients=s.clients, searches=s.searches, submits=s.submits,
                     make_spec=make_spec, make_query=make_query, seed=0)
    for msg in r["error_messages"]:
        print(f"[{backend}] error: {msg}", file=sys.stderr)
    keep = ("errors", "lost", "duplicated", "mismatched", "search_p50_ms", "search_p95_ms",
            "submit_p50_ms", "submit_p95_ms", "warmup_search_ms", "wall_s", "ops_per_s")
    return {"backend": backend, "servers": servers, "clients": s.clients,
            "searches": s.searches, "submits": s.submits, "seeded": s.seeded, "dim": DIM,
            **{k: r[k] for k in keep}, "listed": r["listed"][0] if r["listed"] else None,
            "seed_s": round(seed_s, 2)}


def postgres_starter():
    """``(postgres_server, None)`` from the test suite's throwaway PostgreSQL starter, or
    ``(None, reason)`` when no server can be started here."""
    try:
        from tests._postgres import postgres_available, postgres_server
    except ImportError as e:
        return None, f"the PostgreSQL starter (tests/_postgres.py) cannot be imported: {e}"
    reason = postgres_available()
    return (None, reason) if reason else (postgres_server, None)


def run(s: Settings) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    info = dp_info()
    config = {**dataclasses.asdict(s), "dim": DIM, "rank": RANK, "width": WIDTH,
              "layers": list(LAYERS), "k": 5, "epsilon": info["guarantee"]["epsilon"],
              "delta": DELTA, "pg_servers": 2}
    rows = []
    pg_skipped = None
    with tempfile.TemporaryDirectory(prefix="pavejax-dock-service-") as tmp:
        workdir = Path(tmp)
        rows.append(run_backend(s, workdir, info))
        print(rows[-1], flush=True)
        starter, pg_skipped = postgres_starter() if s.postgres else \
            (None, "PostgreSQL run switched off")
        if starter is not None:
            with starter() as pg:
                rows.append(run_backend(s, workdir, info, database=pg.create_database("bench"),
                                        servers=2))
            print(rows[-1], flush=True)
        else:
            rows.append({"backend": "postgresql", "servers": 2, "skipped": pg_skipped})
    sqlite, pg = rows[0], rows[1]
    summary: dict[str, Any] = {k: sqlite[k] for k in SUMMARY_KEYS}
    summary.update({f"pg_{k}": pg.get(k) for k in SUMMARY_KEYS})
    summary.update({"submit_p50_ms": sqlite["submit_p50_ms"],
                    "pg_submit_p50_ms": pg.get("submit_p50_ms"), "wall_s": sqlite["wall_s"],
                    "pg_wall_s": pg.get("wall_s"), "clients": s.clients,
                    "searches": s.searches, "submits": s.submits, "seeded": s.seeded,
                    "dim": DIM, "pg_servers": 2, "pg_skipped": pg_skipped})
    return config, rows, summary


def main(argv=None) -> dict:
    args = _common.parse_args(__doc__.splitlines()[0], argv)
    config, rows, summary = run(QUICK if args.quick else Settings())
    config["quick"] = args.quick
    return _common.emit("dock_service", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
