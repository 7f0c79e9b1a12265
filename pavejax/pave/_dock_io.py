"""Storage plumbing of the dock: index rows, Orbax tensor dirs, fsync, and a JSON record of a
params pytree's structure (the index database itself is :mod:`pavejax.pave._index_db`).

Model params are saved as a flat Orbax tree of NumPy leaves; the nesting (dicts with str or int
keys, lists, tuples, None) is recorded as JSON so that ``load`` gives back the submitted
structure with its key types (Orbax alone turns int keys into strings). Other pytree kinds are
stored as their ``jax.tree.leaves`` and need a ``like`` pytree to be restored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from pavejax.spec_types import PaveSpec

COLUMNS = ("id, name, metadata, backbone_id, backbone_hash, rank, layers, a_hash, spec_info, "
           "ledger_summary, model_structure, created, submitter, version, files")
_SCALARS = (bool, int, float, np.generic, np.ndarray, jax.Array)


@dataclasses.dataclass(frozen=True)
class DockEntry:
    """One learnware's index row. ``spec`` is filled by :meth:`Dock.get`, None in lists."""

    id: int
    name: str
    metadata: Mapping[str, Any]
    backbone_id: str
    backbone_hash: str
    rank: int
    layers: tuple[str, ...]
    a_hash: str
    spec_info: Mapping[str, Any]
    ledger_summary: Any
    has_model: bool
    created: float  # Unix time, seconds
    spec: PaveSpec | None = None
    submitter: str | None = None  # the account that submitted it over HTTP; None: locally
    version: int = 0  # the dock generation it was added at
    files: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # stored release archives


_KEY_DOMAIN = b"pavejax/dock-a-key/v1"


def a_key_from_seed(seed_hex: str) -> jax.Array:
    """The dock's key for ``A`` from its 256-bit seed (hex). JAX's threefry keys carry 64 bits:
    the key is derived from the seed by SHA-256."""
    try:
        seed = bytes.fromhex(str(seed_hex).strip())
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise ValueError("the A-key seed must be 64 hex digits (256 bits)")
    digest = hashlib.sha256(_KEY_DOMAIN + seed).digest()
    return jax.random.wrap_key_data(np.frombuffer(digest[:8], np.uint32), impl="threefry2x32")


def entry_from_row(r: tuple) -> DockEntry:
    """A :class:`DockEntry` from a row selected as :data:`COLUMNS`."""
    return DockEntry(int(r[0]), r[1], json.loads(r[2]), r[3], r[4], int(r[5]),
                     tuple(json.loads(r[6])), r[7], json.loads(r[8]), json.loads(r[9]),
                     r[10] is not None, float(r[11]), submitter=r[12], version=int(r[13]),
                     files=json.loads(r[14]) if r[14] else {})


def ledger_summary(info: Mapping[str, Any]) -> Any:
    """The privacy summary stored in the index: ``info["ledger_summary"]``, else the
    guarantee record (with the mechanism), else the raw ledger, else None (non-private)."""
    if "ledger_summary" in info:
        return info["ledger_summary"]
    if "guarantee" in info:
        return {"mechanism": info.get("mechanism"), **dict(info["guarantee"])}
    return info.get("ledger")


def to_json(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serialisable with finite numbers: {e}") from None


@functools.lru_cache(maxsize=1)
def _checkpointer() -> ocp.PyTreeCheckpointer:
    return ocp.PyTreeCheckpointer()


def is_local(root: Any) -> bool:
    """True for a local or mounted folder, False for a URL-like path (``gs://...``)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(root)) is None


def _target(path: Any) -> Any:
    return Path(path).absolute() if is_local(path) else epath.Path(path)


def save_tree(path: Path, tree: Any) -> None:
    """Synchronous Orbax save of a pytree of NumPy arrays to the new dir ``path``."""
    _checkpointer().save(_target(path), tree)


def load_tree(path: Path) -> Any:
    """Orbax restore of :func:`save_tree`'s tree (NumPy leaves)."""
    return _checkpointer().restore(_target(path))


def fsync_tree(path: Path, *, recursive: bool = True) -> None:
    """fsync every file and dir under ``path`` (only ``path`` itself if not recursive)."""
    def sync(p: str, flags: int) -> None:
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if recursive:
        for root, _, files in os.walk(path):
            for f in files:
                sync(os.path.join(root, f), os.O_RDONLY)
            sync(root, os.O_RDONLY)
    sync(str(path), os.O_RDONLY)


def _leaf(node: Any, path: str) -> np.ndarray:
    arr = np.asarray(jax.device_get(node))
    if not (jnp.issubdtype(arr.dtype, jnp.number) or arr.dtype == np.bool_):
        raise TypeError(f"model leaf {path or '<root>'!r} has dtype {arr.dtype}; model params "
                        f"must be numeric arrays")
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not np.isfinite(arr.astype(np.float64)).all():
        raise ValueError(f"model leaf {path or '<root>'!r} has NaN/inf entries; the model "
                         f"diverged: fix its training before submitting it")
    return arr


def _encode(node: Any, leaves: list[np.ndarray], path: str) -> Any:
    if node is None:
        return {"none": None}
    if type(node) is dict:
        items = []
        for k, v in node.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise _Opaque
            items.append([k, _encode(v, leaves, f"{path}/{k}")])
        return {"dict": items}
    if type(node) in (list, tuple):
        return {type(node).__name__: [_encode(v, leaves, f"{path}/{i}")
                                       for i, v in enumerate(node)]}
    if isinstance(node, _SCALARS):
        leaves.append(_leaf(node, path))
        return {"leaf": len(leaves) - 1}
    raise _Opaque


class _Opaque(Exception):
    """A node the JSON record cannot describe."""


def model_to_tree(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Orbax tree of NumPy leaves, JSON structure record) of a params pytree.

    Refuses NaN/inf and non-numeric leaves, and models without arrays.
    """
    leaves: list[np.ndarray] = []
    try:
        structure = _encode(model, leaves, "")
    except _Opaque:
        named = jax.tree_util.tree_flatten_with_path(model)[0]
        leaves = [_leaf(v, jax.tree_util.keystr(p)) for p, v in named]
        structure = {"opaque": len(leaves)}
    if not leaves:
        raise ValueError("model has no arrays; pass its params pytree (e.g. nnx.to_pure_dict)")
    return {"leaves": {f"{i:06d}": a for i, a in enumerate(leaves)}}, structure


def _decode(node: Mapping[str, Any], leaves: list[np.ndarray]) -> Any:
    (kind, value), = node.items()
    if kind == "none":
        return None
    if kind == "leaf":
        return leaves[value]
    if kind == "dict":
        return {k: _decode(v, leaves) for k, v in value}
    children = [_decode(v, leaves) for v in value]
    return children if kind == "list" else tuple(children)


def load_model_tree(path: Path, structure: Mapping[str, Any], like: Any = None) -> Any:
    """Inverse of :func:`model_to_tree` from the Orbax dir ``path``; with ``like``, the leaves
    are placed in ``like``'s pytree structure (shapes checked)."""
    stored = load_tree(path)["leaves"]
    leaves = [np.asarray(stored[k]) for k in sorted(stored)]
    opaque = "opaque" in structure
    if like is None:
        if opaque:
            raise ValueError("this model was stored from a custom pytree kind; pass like=<a "
                             "pytree of that structure> to load it")
        return _decode(structure, leaves)
    ordered = leaves if opaque else jax.tree.leaves(_decode(structure, leaves))
    like_leaves, treedef = jax.tree.flatten(like)
    shapes = [np.shape(x) for x in like_leaves]
    if shapes != [x.shape for x in ordered]:
        raise ValueError(f"like has {len(like_leaves)} leaves of shapes {shapes[:4]}..., the "
                         f"stored model {len(ordered)} of shapes "
                         f"{[x.shape for x in ordered][:4]}...; pass a pytree of the same model")
    return jax.tree.unflatten(treedef, ordered)
