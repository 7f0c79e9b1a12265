"""Every ``>>>`` example in pavejax's docstrings runs, as written, and shows what it says."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import jax
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pavejax"


def _modules_with_examples() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text():
            rel = path.relative_to(PACKAGE.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert "pavejax" in MODULES and "pavejax.training" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    # user code: JAX's default promotion rules (the suite itself runs strict)
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        result = doctest.testmod(module, optionflags=flags, verbose=False, report=False)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed " \
                               "(run `python -m doctest -v` on the module to see them)"
