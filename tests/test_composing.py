"""Runs every Python block of docs/composing.md (each a complete program that asserts its own
claims) in a fresh namespace, in page order, under JAX's default dtype promotion (the page is
user code; the rest of the suite runs in strict mode to catch pavejax's own silent promotions)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "composing.md"


def _blocks() -> list[tuple[str, str]]:
    text = PAGE.read_text()
    out, title = [], "preamble"
    for part in re.split(r"(?m)^(## .*)$", text):
        if part.startswith("## "):
            title = part[3:].strip()
            continue
        for code in re.findall(r"```python\n(.*?)```", part, flags=re.S):
            out.append((title, code))
    return out


BLOCKS = _blocks()


def test_page_has_every_recipe():
    titles = " ".join(t for t, _ in BLOCKS)
    for letter in "abcdef":
        assert f"({letter})" in titles, f"recipe ({letter}) is missing from {PAGE.name}"


@pytest.mark.parametrize("title,code", BLOCKS, ids=[t.split(")")[0].strip("(") for t, _ in BLOCKS])
def test_recipe_runs(title, code, capsys):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        exec(compile(code, f"{PAGE.name}: {title}", "exec"), {"__name__": "__main__"})
