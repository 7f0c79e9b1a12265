"""Line-based JSON protocol between a benchmark driver and a long-lived worker process.

The driver writes one JSON command per line to the worker's stdin; the worker answers with one
JSON line on the stream it had as stdout at start. Everything else written to file descriptor 1
(library banners, prints) is redirected to stderr so that it cannot corrupt the protocol. This
module imports no numerical framework: the pavejax and the Opacus workers share it.

Memory is measured the same way for every framework: the peak resident set size (VmHWM) of the
worker process. Before each timed chunk the peak is reset (``/proc/self/clear_refs``, Linux), so
the value read afterwards is the peak of that chunk alone, not of model loading or compilation.
Where the reset is refused the whole-process peak (``ru_maxrss``) is reported and flagged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import resource
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            m = re.search(rf"^{field}:\s+(\d+)\s+kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def current_rss_mib() -> float:
    """Resident set size now, MiB (0.0 where /proc is unavailable)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) / 1024.0


def reset_peak_rss() -> bool:
    """Resets the process peak RSS to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """Peak RSS since the last successful ``reset_peak_rss`` (else since start), MiB."""
    kib = _status_kib("VmHWM")
    if kib is None:  # ru_maxrss is in KiB on Linux
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0


def trim_heap() -> None:
    """Returns freed heap pages to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Called before every timed chunk in every worker, so memory that the allocator kept from
    loading or compiling does not count as memory of the steps.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed_chunk(step: Callable[[int], None], first: int, count: int) -> dict[str, Any]:
    """Runs ``step(i)`` for ``i`` in ``first .. first+count-1``; per-step seconds and peak RSS.

    ``step`` must block until its results are computed (the wall time is the step time).
    """
    trim_heap()
    resettable = reset_peak_rss()
    rss_before = current_rss_mib()
    times = []
    for i in range(first, first + count):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return {"times": times, "rss_before_mib": rss_before, "peak_rss_mib": peak_rss_mib(),
            "peak_is_chunk": resettable}


def serve(handlers: dict[str, Handler]) -> None:
    """Answers commands ``{"cmd": name, ...}`` from stdin until ``quit`` or end of input.

    A handler's dict is sent back with ``"ok": true``; an exception is sent back as
    ``{"ok": false, "error": ...}`` and the loop goes on, so the driver can report it.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # stray prints from libraries now go to stderr
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        name = request.get("cmd")
        if name == "quit":
            out.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            if name not in handlers:
                raise ValueError(f"unknown command {name!r}; known: {sorted(handlers)}")
            reply = {"ok": True, **handlers[name](request)}
        except Exception as err:  # noqa: BLE001 - reported to the driver, which stops the run
            reply = {"ok": False, "error": f"{type(err).__name__}: {err}",
                     "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
    out.close()
