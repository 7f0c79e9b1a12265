"""A bounded load test of running dock services (``pavejax dock serve``): concurrent clients
searching and submitting through :class:`~pavejax.pave.remote.RemoteDock`, then a consistency
check of what every server lists.

What :func:`run_load` measures:

* latency of each operation as the client sees it (``time.perf_counter`` around one
  :meth:`~pavejax.pave.remote.RemoteDock.search`, i.e. the snapshot sync plus local ranking, or
  one :meth:`~pavejax.pave.remote.RemoteDock.submit`, i.e. packing, upload, server-side vetting
  and the committed insert); building the job's spec is not timed;
* errors: every exception an operation raises (count and the first few messages);
* after the load, each server's listing: ``lost`` counts names whose submit succeeded but that
  some listing lacks, ``duplicated`` counts names listed more than once plus the ``(id, name)``
  pairs on which two listings disagree, ``mismatched`` counts names listed under another id
  than their submit returned.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pavejax.pave.remote import RemoteDock
from pavejax.spec_types import PaveSpec

__all__ = ["free_port", "local_server", "run_load", "wait_ready"]

_MESSAGES = 5


def _percentile_ms(seconds: list[float], q: float) -> float | None:
    return None if not seconds else round(1e3 * float(np.percentile(seconds, q)), 3)


def run_load(urls: Sequence[str], tokens: Sequence[str], *, clients: int = 8,
             searches: int = 200, submits: int = 40, make_spec: Callable[[int], PaveSpec],
             make_query: Callable[[int], PaveSpec], seed: int = 0, k: int = 5,
             warmup: bool = True, timeout: float = 120.0) -> dict[str, Any]:
    """Run ``searches`` search jobs and ``submits`` submit jobs, shuffled together (by
    ``seed``), through ``clients`` threads. Client ``i`` holds its own :class:`RemoteDock` on
    ``urls[i % len(urls)]`` with token ``tokens[i % len(tokens)]``. Submit job ``j`` submits
    ``make_spec(j)`` as ``f"load-{j:03d}"``; search job ``j`` searches ``make_query(j)`` for the
    top ``k``. With ``warmup``, each client first runs one untimed search (full snapshot
    download, JIT compile) of ``make_query(0)``; the slowest is ``warmup_search_ms``.

    Returns ``errors``, ``error_messages``, ``lost``, ``duplicated``, ``mismatched``,
    ``listed`` (entries per listing), ``search_p50_ms``, ``search_p95_ms``,
    ``submit_p50_ms``, ``submit_p95_ms`` (None without that operation), ``wall_s`` (the
    jobs, from first to last), ``ops_per_s``, ``submitted`` (submit ids by name) and the
    settings."""
    urls, tokens = [str(u) for u in urls], list(tokens)
    if not urls or not tokens:
        raise ValueError("run_load needs at least one url and one token")
    for name, v in (("clients", clients), ("searches", searches), ("submits", submits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "clients" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'clients' else 0}, "
                             f"got {v!r}")
    jobs = [("search", j) for j in range(searches)] + [("submit", j) for j in range(submits)]
    random.Random(seed).shuffle(jobs)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)

    lock = threading.Lock()
    lat: dict[str, list[float]] = {"search": [], "submit": []}
    warm: list[float] = []
    errors: list[str] = []
    submitted: dict[str, int] = {}
    docks = [RemoteDock(urls[i % len(urls)], tokens[i % len(tokens)], timeout=timeout)
             for i in range(clients)]
    start = threading.Barrier(clients + 1, timeout=4 * timeout)

    def fail(what: str, e: BaseException) -> None:
        with lock:
            errors.append(f"{what}: {type(e).__name__}: {e}")

    def worker(dock: RemoteDock) -> None:
        if warmup:
            try:
                t0 = time.perf_counter()
                dock.search(make_query(0), k=k)
                with lock:
                    warm.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 -- counted, not raised
                fail(f"warm-up search on {dock.url}", e)
        start.wait()
        while True:
            try:
                kind, j = todo.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "search":
                    q = make_query(j)
                    t0 = time.perf_counter()
                    dock.search(q, k=k)
                else:
                    spec, name = make_spec(j), f"load-{j:03d}"
                    t0 = time.perf_counter()
                    new_id = dock.submit(spec, name=name)
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 -- counted, not raised
                fail(f"{kind} {j} on {dock.url}", e)
                continue
            with lock:
                lat[kind].append(dt)
                if kind == "submit":
                    submitted[name] = new_id

    threads = [threading.Thread(target=worker, args=(d,), name=f"load-client-{i}", daemon=True)
               for i, d in enumerate(docks)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    listings: list[list[tuple[int, str]]] = []
    for url in urls:
        try:
            listings.append([(e.id, e.name) for e in RemoteDock(url, timeout=timeout).list()])
        except Exception as e:  # noqa: BLE001 -- counted, not raised
            fail(f"list on {url}", e)
    lost = sum(1 for n in submitted
               if any(n not in {name for _, name in listing} for listing in listings))
    duplicated = sum(c - 1 for listing in listings
                     for c in Counter(name for _, name in listing).values() if c > 1)
    for other in listings[1:]:
        duplicated += len(set(listings[0]) ^ set(other))
    mismatched = sum(1 for listing in listings for i, n in listing
                     if n in submitted and submitted[n] != i)
    for d in docks:
        d.close()
    done = len(lat["search"]) + len(lat["submit"])
    return {"errors": len(errors), "error_messages": errors[:_MESSAGES], "lost": lost,
            "duplicated": duplicated, "mismatched": mismatched,
            "listed": [len(listing) for listing in listings],
            "search_p50_ms": _percentile_ms(lat["search"], 50),
            "search_p95_ms": _percentile_ms(lat["search"], 95),
            "submit_p50_ms": _percentile_ms(lat["submit"], 50),
            "submit_p95_ms": _percentile_ms(lat["submit"], 95),
            "warmup_search_ms": _percentile_ms(warm, 100),
            "wall_s": round(wall, 3), "ops_per_s": round(done / wall, 2) if wall > 0 else None,
            "searches_done": len(lat["search"]), "submits_done": len(lat["submit"]),
            "submitted": dict(sorted(submitted.items())), "clients": clients,
            "searches": searches, "submits": submits, "servers": len(urls)}


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until the dock server ``proc`` answers ``url/healthz``; ``RuntimeError`` if it
    exits, ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the dock server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return
        except OSError:
            if time.time() > deadline:
                raise TimeoutError(f"the dock server at {url} did not answer in {timeout} s") \
                    from None
            time.sleep(0.2)


@contextlib.contextmanager
def local_server(dock: str | os.PathLike[str], *args: str, port: int | None = None,
                 log: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``python -m pavejax dock serve DOCK`` on a loopback port (a free one by default) in
    a subprocess, on the CPU; yields ``(url, process)`` once ``/healthz`` answers and stops it
    on exit. Its output goes to ``log`` (a file; a temporary one by default, whose tail is
    raised with a start failure). ``args``: more ``serve`` flags."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **(env or {})}
    out = open(log, "w+") if log is not None else tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "pavejax", "dock", "serve", str(dock),
                             "--host", "127.0.0.1", "--port", str(port), *args],
                            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_ready(url, proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            out.seek(0)
            raise RuntimeError(f"{e}; its output:\n{out.read()[-4000:]}") from None
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
