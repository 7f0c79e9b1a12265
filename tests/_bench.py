"""Importing a benchmark script (``benchmarks/<name>.py``) as a module in the tests."""

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """The module ``benchmarks/<name>.py``, with ``benchmarks/`` on ``sys.path`` (the scripts
    import their helpers, e.g. ``_common``, by plain name) while the context is open."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
