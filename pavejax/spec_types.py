"""The PAVE specification record shared by spec generation, the dock and releases.

A :class:`PaveSpec` is the compact release of PAVE: the concatenated, trained ``B`` factors of a
shared backbone (float32, shape ``(dim,)``), together with a :class:`SpecSignature` that says in
which parameter space the vector lives. Two specs can be compared (cosine) only when their
signatures match: same backbone weights, same adapted layers, same rank, same secret ``A``
(identified by its hash, never by its value), same per-layer scaling.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["SPEC_KINDS", "PaveSpec", "SpecMismatchError", "SpecSignature", "cosine"]

SPEC_KINDS = ("model", "user")
LAYER_SCALINGS = ("none", "fan_in")


class SpecMismatchError(ValueError):
    """Two specifications (or a spec and a dock) live in different parameter spaces."""


@dataclasses.dataclass(frozen=True)
class SpecSignature:
    """Identity of the parameter space a spec lives in.

    Attributes:
      backbone_id: human name of the shared backbone, e.g. ``"all-MiniLM-L6-v2"``.
      backbone_hash: sha256 (hex) of the backbone weights the factors were trained on.
      rank: LoRA rank ``r``.
      layers: adapted leaf paths, sorted; ``B`` blocks are concatenated in this order.
      layer_sizes: number of ``B`` entries per layer (``r * d_out``), same order.
      a_hash: :func:`pavejax.lora.a_hash` of the secret ``A`` (the hash, never ``A``).
      a_init: ``A``'s init scheme (``"gaussian"`` or ``"kaiming_uniform"``).
      layer_scaling: ``"none"`` or ``"fan_in"`` (each block multiplied by ``sqrt(d_in / r)``
        so that layers of different fan-in weigh as in ``cos(BA, B'A)``).
      subspace: ``"identity"`` (the whole ``B`` blocks) or the
        :attr:`pavejax.pave.subspace.Subspace.hash` of the public basis ``U`` whose coordinates
        ``C = B U`` the spec holds (``layer_sizes`` are then ``r * k`` per layer).
    """

    backbone_id: str
    backbone_hash: str
    rank: int
    layers: tuple[str, ...]
    layer_sizes: tuple[int, ...]
    a_hash: str
    a_init: str
    layer_scaling: str = "none"
    subspace: str = "identity"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "layer_sizes", tuple(int(s) for s in self.layer_sizes))
        if not self.layers or len(self.layers) != len(self.layer_sizes):
            raise ValueError(f"layers and layer_sizes must be non-empty and of one length, got "
                             f"{len(self.layers)} layers and {len(self.layer_sizes)} sizes")
        if any(s < 1 for s in self.layer_sizes):
            raise ValueError(f"layer_sizes must be >= 1, got {self.layer_sizes}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        if self.layer_scaling not in LAYER_SCALINGS:
            raise ValueError(f"layer_scaling must be one of {LAYER_SCALINGS}, "
                             f"got {self.layer_scaling!r}")
        for name in ("backbone_id", "backbone_hash", "a_hash", "a_init", "subspace"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got "
                                 f"{getattr(self, name)!r}")

    @property
    def dim(self) -> int:
        """Length of the spec vector."""
        return sum(self.layer_sizes)

    def mismatches(self, other: SpecSignature) -> list[str]:
        """Human-readable differences with ``other`` (empty when compatible)."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                if f.name in ("layers", "layer_sizes"):
                    a = f"{len(a)} entries starting {a[:2]}"
                    b = f"{len(b)} entries starting {b[:2]}"
                out.append(f"{f.name}: {a!r} vs {b!r}")
        return out

    def require_compatible(self, other: SpecSignature, *, what: str = "spec") -> None:
        """Raise :class:`SpecMismatchError` unless ``other`` lives in the same space."""
        diff = self.mismatches(other)
        if diff:
            raise SpecMismatchError(
                f"the {what} was made in another parameter space ({'; '.join(diff)}). Specs are "
                f"comparable only with the same backbone weights, adapted layers, rank, secret A, "
                f"layer scaling and coordinate subspace: regenerate it with this dock's "
                f"SpecConfig, subspace and A key.")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
               for f in dataclasses.fields(self)}
        if out["subspace"] == "identity":  # records of whole-block specs keep their old form
            del out["subspace"]
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SpecSignature:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(obj) - {"layer_scaling", "subspace"}
        if missing:
            raise ValueError(f"spec signature lacks fields {sorted(missing)}")
        return cls(**{k: (tuple(v) if isinstance(v, list) else v)
                      for k, v in obj.items() if k in names})


def _json_safe(info: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        text = json.dumps(dict(info), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"spec info must be JSON-serialisable with finite numbers: {e}") from None
    return MappingProxyType(json.loads(text))


@dataclasses.dataclass(frozen=True, eq=False)
class PaveSpec:
    """A PAVE specification: ``vector`` (dim,) float32 in the space of ``signature``.

    ``kind`` is ``"model"`` (fit to a developer model's predictions) or ``"user"`` (fit to a
    user's labels). ``info`` is a JSON-safe record of how it was made: fit target, mechanism,
    hyper-parameters, ledger (``Ledger.to_dict()``), guarantee and its conditions.
    The constructor refuses NaN/inf vectors, wrong shapes and all-zero vectors (no direction).
    """

    vector: np.ndarray
    signature: SpecSignature
    kind: str = "model"
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.signature, SpecSignature):
            raise TypeError(f"signature must be a SpecSignature, got "
                            f"{type(self.signature).__name__}")
        v = np.asarray(self.vector)
        if not np.issubdtype(v.dtype, np.floating):
            raise TypeError(f"spec vector must be floating, got dtype {v.dtype}")
        if v.shape != (self.signature.dim,):
            raise ValueError(f"spec vector must have shape ({self.signature.dim},) for its "
                             f"signature, got {v.shape}")
        v = v.astype(np.float32)
        if not np.isfinite(v).all():
            bad = int(np.size(v) - np.isfinite(v).sum())
            raise ValueError(f"spec vector has {bad} NaN/inf entries; the spec training "
                             f"diverged: lower the learning rate or check the data.")
        if not np.any(v):
            raise ValueError("spec vector is all zeros (no direction to compare): train for "
                             "at least one step on non-empty data.")
        v.setflags(write=False)
        object.__setattr__(self, "vector", v)
        if self.kind not in SPEC_KINDS:
            raise ValueError(f"kind must be one of {SPEC_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "info", _json_safe(self.info))

    @property
    def dim(self) -> int:
        return self.signature.dim

    def blocks(self) -> dict[str, np.ndarray]:
        """Per-layer slices of the vector, keyed by layer path (views, read-only)."""
        out, start = {}, 0
        for path, size in zip(self.signature.layers, self.signature.layer_sizes, strict=True):
            out[path] = self.vector[start:start + size]
            start += size
        return out

    def cosine(self, other: PaveSpec) -> float:
        """cos(self, other) after checking both live in one space."""
        self.signature.require_compatible(other.signature)
        return cosine(self.vector, other.vector)


def cosine(u: np.ndarray, v: np.ndarray) -> float:
    """Cosine similarity of two 1-D vectors, computed in float64."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    nu, nv = math.sqrt(float(u @ u)), math.sqrt(float(v @ v))
    if nu == 0.0 or nv == 0.0:
        raise ValueError("cosine of a zero vector is undefined")
    return float(u @ v) / (nu * nv)
