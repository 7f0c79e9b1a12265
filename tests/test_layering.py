"""The import contract: a layer never imports a layer above it.

Layers, bottom to top (each may import itself and the layers listed in ``MAY_IMPORT``):

* **core**: the DP engine, accounting, LoRA factors, the spec record, tree and optimiser helpers.
  No model, data, file format (Orbax, SQLite) or command line.
* **assets**: the offline asset locator (files installed at install time).
* **models** and **data**: side by side; each imports the core and ``assets``, not the other.
* **methods**: PAVE, merging, PACZero, audits, checkpoints, releases, recipes, interop, the
  training driver. No command line, demo or experiment.
* **apps**: experiments (scenarios that train), the lifecycle, the demo, the command line.

Every ``import`` in every module counts, including those inside functions and under
``TYPE_CHECKING``: :func:`module_imports` walks the whole syntax tree.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pavejax"

# module (or package prefix) -> layer; the longest matching prefix wins.
LAYER_OF: Mapping[str, str] = {
    "pavejax": "core",  # the package's __init__: importing any submodule runs it
    "pavejax._releasable": "core",
    "pavejax._tree": "core",
    "pavejax.accounting": "core",
    "pavejax.distributed": "core",
    "pavejax.lora": "core",
    "pavejax.optim": "core",
    "pavejax.privacy": "core",
    "pavejax.spec_types": "core",
    "pavejax.assets": "assets",
    "pavejax.models": "models",
    "pavejax.data": "data",
    "pavejax.audit": "methods",
    "pavejax.checkpointing": "methods",
    "pavejax.interop": "methods",
    "pavejax.lm": "methods",
    "pavejax.lm_cache": "methods",
    "pavejax.merging": "methods",
    "pavejax.paczero": "methods",
    "pavejax.pave": "methods",
    "pavejax.recipes": "methods",
    "pavejax.release": "methods",
    "pavejax.training": "methods",
    "pavejax.__main__": "apps",
    "pavejax.cli": "apps",
    "pavejax.commands": "apps",
    "pavejax.demo": "apps",
    "pavejax.experiments": "apps",
    "pavejax.finetune_example": "apps",
    "pavejax.lifecycle": "apps",
    "pavejax.service": "apps",
}
LAYERS = ("core", "assets", "models", "data", "methods", "apps")
MAY_IMPORT: Mapping[str, frozenset[str]] = {
    "core": frozenset({"core"}),
    "assets": frozenset({"core", "assets"}),
    "models": frozenset({"core", "assets", "models"}),
    "data": frozenset({"core", "assets", "data"}),
    "methods": frozenset({"core", "assets", "models", "data", "methods"}),
    "apps": frozenset(LAYERS),
}
# Third-party modules a layer may not import, and why.
FORBIDDEN_EXTERNAL: Mapping[str, Mapping[str, str]] = {
    "core": {"orbax": "file I/O", "sqlite3": "file I/O", "flax": "a model library",
             "argparse": "a command line"},
    "models": {"argparse": "a command line"},
    "data": {"argparse": "a command line"},
    "methods": {"argparse": "a command line"},
}
# Imports inside one layer that are still refused.
FORBIDDEN_PAIRS: Mapping[tuple[str, str], str] = {
    ("pavejax.release", "pavejax.pave"):
        "a release reads the spec record from pavejax.spec_types, not from the PAVE method",
}


# --- the checker -------------------------------------------------------------------------------


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """Dotted name of the module in ``path`` (``pavejax/pave/__init__.py`` -> ``pavejax.pave``)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def module_imports(source: str, module: str, *, is_package: bool = False,
                   known: Iterable[str] = ()) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement anywhere in ``source``, by line.

    Relative imports are resolved against ``module``; ``from a import b`` names the module
    ``a.b`` when that is one of the ``known`` modules, else ``a``. A string that is exactly the
    name of a ``known`` module below the root (outside docstrings) counts too: that is how lazy
    exports (``importlib.import_module("pavejax.x")``) name what they will import.
    """
    known = set(known)
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value in known - {"pavejax"} and id(node) not in docstrings):
            out.append((node.value, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(base):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top")
                anchor = base[:len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in known else target, node.lineno))
    return sorted(set(out), key=lambda t: (t[1], t[0]))


def layer_of(module: str) -> str | None:
    """The layer of a ``pavejax`` module (longest prefix in ``LAYER_OF``); None if unmapped.

    The root ``pavejax`` entry names the package's ``__init__`` only, not a default layer.
    """
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        layer = LAYER_OF.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return LAYER_OF.get(module)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(module: str, imports: Iterable[tuple[str, int]], where: str = "") -> list[str]:
    """Readable contract violations of ``module``'s imports (empty: the module is fine)."""
    src = layer_of(module)
    if src is None:
        return [f"{module} has no layer: add it to LAYER_OF in tests/test_layering.py"]
    at = f" [{where or module}:%d]"
    out = []
    for target, line in imports:
        if _within(target, "pavejax"):
            dst = layer_of(target)
            if dst is None:
                out.append(f"{module} -> {target} (no layer: add it to LAYER_OF)" + at % line)
            elif dst not in MAY_IMPORT[src]:
                out.append(f"{module} -> {target} ({src} may not import {dst})" + at % line)
            for (a, b), why in FORBIDDEN_PAIRS.items():
                if _within(module, a) and _within(target, b):
                    out.append(f"{module} -> {target} ({why})" + at % line)
        else:
            top = target.split(".")[0]
            why = FORBIDDEN_EXTERNAL.get(src, {}).get(top)
            if why is not None:
                out.append(f"{module} -> {target} ({src} may not import {why})" + at % line)
    return out


def check_source(source: str, module: str, known: Iterable[str] = ()) -> list[str]:
    """Contract violations of one module given as source text."""
    return violations(module, module_imports(source, module, known=known))


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """``module -> pavejax modules it imports`` over the package (every import, all depths)."""
    graph = {}
    for name, path in modules.items():
        imports = module_imports(path.read_text(), name, is_package=path.name == "__init__.py",
                                 known=modules)
        graph[name] = {t for t, _ in imports if t in modules and t != name}
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


# --- the contract on the package -----------------------------------------------------------------


MODULES = package_modules()


def test_every_module_has_a_layer():
    unmapped = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unmapped, ("modules without a layer (add them to LAYER_OF in "
                          "tests/test_layering.py):\n  " + "\n  ".join(unmapped))


def test_no_layer_imports_upward():
    found = []
    for name, path in MODULES.items():
        imports = module_imports(path.read_text(), name, is_package=path.name == "__init__.py",
                                 known=MODULES)
        found += violations(name, imports, str(path.relative_to(ROOT)))
    assert not found, "upward imports:\n  " + "\n  ".join(found)


def test_no_import_cycles():
    found = [sorted(c) for c in cycles(import_graph(MODULES))]
    assert not found, ("modules that import each other (directly or through others; imports "
                       "inside functions and under TYPE_CHECKING count):\n  "
                       + "\n  ".join(" <-> ".join(c) for c in found))


# --- the checker itself can fail ------------------------------------------------------------------


def test_an_upward_import_is_reported():
    source = "from pavejax.pave.spec import model_spec\n"
    assert check_source(source, "pavejax.models.bert") == [
        "pavejax.models.bert -> pavejax.pave.spec (models may not import methods) "
        "[pavejax.models.bert:1]"]


def test_imports_inside_functions_and_relative_imports_count():
    source = ("import jax\n\n"
              "def run():\n"
              "    from pavejax.cli import main\n"
              "    if True:\n"
              "        from ..data import load_task\n"
              "    return main\n")
    found = check_source(source, "pavejax.privacy.noise")
    assert found == [
        "pavejax.privacy.noise -> pavejax.cli (core may not import apps) "
        "[pavejax.privacy.noise:4]",
        "pavejax.privacy.noise -> pavejax.data (core may not import data) "
        "[pavejax.privacy.noise:6]"]


def test_lazy_imports_by_module_name_count():
    source = ('"""Mentions pavejax.cli in a docstring only."""\n'
              "import importlib\n\n"
              "def __getattr__(name):\n"
              '    return importlib.import_module("pavejax.cli")\n')
    assert check_source(source, "pavejax.privacy", known={"pavejax.cli"}) == [
        "pavejax.privacy -> pavejax.cli (core may not import apps) [pavejax.privacy:5]"]


def test_submodule_resolution_and_sibling_layers():
    known = {"pavejax.models.bert", "pavejax.data.tasks"}
    source = "from pavejax.models import bert\nfrom pavejax.data import tasks\n"
    assert module_imports(source, "pavejax.pave.text", known=known) == [
        ("pavejax.models.bert", 1), ("pavejax.data.tasks", 2)]
    # models and data sit side by side: neither may import the other
    assert check_source(source, "pavejax.data.market", known) == [
        "pavejax.data.market -> pavejax.models.bert (data may not import models) "
        "[pavejax.data.market:1]"]
    assert check_source(source, "pavejax.pave.text", known) == []


def test_forbidden_externals_pairs_and_unmapped_modules_are_reported():
    assert check_source("import orbax.checkpoint as ocp\n", "pavejax.lora") == [
        "pavejax.lora -> orbax.checkpoint (core may not import file I/O) [pavejax.lora:1]"]
    assert check_source("from pavejax.pave.spec import x\n", "pavejax.release") == [
        "pavejax.release -> pavejax.pave.spec (a release reads the spec record from "
        "pavejax.spec_types, not from the PAVE method) [pavejax.release:1]"]
    assert check_source("import numpy\n", "pavejax.newthing") == [
        "pavejax.newthing has no layer: add it to LAYER_OF in tests/test_layering.py"]
    assert layer_of("pavejax.privacy.checks") == "core"
    assert layer_of("pavejax.pavement") is None  # a prefix match is by whole components


def test_cycle_detection():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


# --- importing the core loads no model, data, method or file format ------------------------------


@pytest.mark.parametrize("module", ["pavejax.privacy", "pavejax.accounting", "pavejax.lora",
                                    "pavejax.spec_types"])
def test_importing_the_core_loads_nothing_above_it(module):
    code = (f"import json, sys\nimport {module}\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("orbax", "flax", "sqlite3"))
    assert not heavy, f"importing {module} loaded {heavy[:5]}"
    above = sorted(m for m in loaded if _within(m, "pavejax") and layer_of(m) != "core")
    assert not above, f"importing {module} loaded modules above the core: {above}"
