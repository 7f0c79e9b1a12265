"""Pytree path helpers shared by the whole package: one way to name a leaf."""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any


def _key_str(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def path_string(keypath: tuple[Any, ...]) -> str:
    """Readable path of a leaf: its key names joined by ``"/"`` (list indices as digits)."""
    return "/".join(_key_str(k) for k in keypath)


def named_leaves(params: PyTree) -> dict[str, Any]:
    """All leaves of ``params`` keyed by :func:`path_string`, in tree-flatten order.

    Raises ``ValueError`` if two leaves render to the same string (e.g. keys ``0`` and ``"0"``,
    or a key containing ``"/"``), because paths must name leaves uniquely.
    """
    out: dict[str, Any] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_string(keypath)
        if name in out:
            raise ValueError(f"two leaves share the path string {name!r}; rename the keys so "
                             f"that joining them with '/' is unique.")
        out[name] = leaf
    return out
