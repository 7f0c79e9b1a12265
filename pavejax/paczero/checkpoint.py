"""Exact checkpoint/resume of a zeroth-order run (`ZOState`).

A checkpoint directory holds ``arrays.npz`` (every array leaf as raw bytes, so bf16 and float32
round-trip bit for bit) and ``state.json`` (step, counts, charges, dev selection, the
mechanism's posterior, budget used and generator state, the secret index, the public seed and
the config). Floats go through JSON with ``repr`` and come back exactly.

A training checkpoint is **not a release**: it holds the secret index and the mechanism's
generator state. Keep it private; release only the final parameters and the ledger.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax.paczero.mechanisms import MechanismState
from pavejax.paczero.train import ZOConfig, ZOState

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT, _VERSION = "pavejax.paczero.checkpoint", 1


def _pack(prefix: str, tree: Any, arrays: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    meta = []
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        a = np.asarray(leaf)
        arrays[f"{prefix}{i}"] = np.frombuffer(a.tobytes(), np.uint8)
        meta.append({"dtype": jnp.dtype(a.dtype).name, "shape": list(a.shape)})
    return meta


def _unpack(prefix: str, meta: list[dict[str, Any]], like: Any, arrays: Any) -> Any:
    leaves, treedef = jax.tree.flatten(like)
    if len(leaves) != len(meta):
        raise ValueError(f"checkpoint has {len(meta)} parameter leaves but the template has "
                         f"{len(leaves)}; pass the same trainable structure that was saved")
    out = []
    for i, (leaf, m) in enumerate(zip(leaves, meta, strict=True)):
        if tuple(m["shape"]) != tuple(np.shape(leaf)) or jnp.dtype(m["dtype"]) != \
                jnp.dtype(jnp.result_type(leaf)):
            raise ValueError(f"leaf {i}: checkpoint has {m['dtype']}{m['shape']} but the "
                             f"template has {jnp.result_type(leaf)}{list(np.shape(leaf))}")
        raw = arrays[f"{prefix}{i}"]
        out.append(jnp.asarray(np.frombuffer(raw.tobytes(), jnp.dtype(m["dtype"]))
                               .reshape(m["shape"])))
    return jax.tree.unflatten(treedef, out)


def save_checkpoint(directory: str | os.PathLike[str], state: ZOState,
                    config: ZOConfig) -> Path:
    """Writes ``state`` to ``directory`` atomically (a temporary sibling, then a rename)."""
    directory = Path(directory)
    arrays: dict[str, np.ndarray] = {}
    if state.membership is not None:
        arrays["membership"] = np.asarray(state.membership, bool)
    record = {
        "format": _FORMAT, "version": _VERSION, "config": dataclasses.asdict(config),
        "step": state.step, "public_seed": state.public_seed, "secret": state.secret,
        "charges": list(state.charges), "unanimous": state.unanimous,
        "releases": state.releases, "best_dev": state.best_dev, "best_step": state.best_step,
        "dp_noise_multiplier": state.dp_noise_multiplier, "stopped": state.stopped,
        "mechanism": {"log_posterior": state.mechanism.log_posterior.tolist(),
                      "mi_used": state.mechanism.mi_used,
                      "rng_state": state.mechanism.rng_state},
        "trainable": _pack("p", state.trainable, arrays),
        "best": None if state.best is None else _pack("b", state.best, arrays),
    }
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez(tmp / "arrays.npz", **arrays)
    (tmp / "state.json").write_text(json.dumps(record, allow_nan=False))
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def load_checkpoint(directory: str | os.PathLike[str], like: Any,
                    config: ZOConfig | None = None) -> ZOState:
    """Restores the `ZOState` saved in ``directory``; ``like`` gives the trainable structure.

    With ``config`` the saved config must be equal (a resumed run with other hyper-parameters is
    not the same run); a mismatch raises ValueError naming the differing fields.
    """
    directory = Path(directory)
    try:
        record = json.loads((directory / "state.json").read_text())
    except FileNotFoundError as err:
        raise ValueError(f"no checkpoint in {directory} (state.json missing)") from err
    if record.get("format") != _FORMAT or record.get("version") != _VERSION:
        raise ValueError(f"{directory} is not a {_FORMAT} v{_VERSION} checkpoint")
    if config is not None:
        saved = record["config"]
        diff = sorted(k for k, v in dataclasses.asdict(config).items() if saved.get(k) != v)
        if diff:
            raise ValueError(f"checkpoint was written with a different config (fields {diff}); "
                             "resume with the saved config")
    with np.load(directory / "arrays.npz") as arrays:
        trainable = _unpack("p", record["trainable"], like, arrays)
        best = None if record["best"] is None else jax.tree.map(
            np.asarray, _unpack("b", record["best"], like, arrays))
        membership = np.array(arrays["membership"]) if "membership" in arrays else None
    m = record["mechanism"]
    mechanism = MechanismState(np.asarray(m["log_posterior"], np.float64), m["mi_used"],
                               m["rng_state"])
    return ZOState(step=record["step"], trainable=trainable, public_seed=record["public_seed"],
                   mechanism=mechanism, membership=membership, secret=record["secret"],
                   charges=tuple(record["charges"]), unanimous=record["unanimous"],
                   releases=record["releases"], best=best, best_dev=record["best_dev"],
                   best_step=record["best_step"],
                   dp_noise_multiplier=record["dp_noise_multiplier"], stopped=record["stopped"])
