"""Releases: what leaves a private training run, as an Orbax checkpoint with metadata and a hash.

A release is a directory::

    <release>/
      tensors/        Orbax PyTree checkpoint (uncompressed, so byte scans of the release are sound)
      metadata.json   ReleaseMetadata: format version, backbone id and hash, adapted layers, rank,
                      A's init scheme and hash, mechanism, hyper-parameters, ledger, guarantee,
                      risk bounds, library version, creation time
      CONTENT_HASH    sha256 over the sorted relative path and bytes of every other file, then one
                      ``<sha256>  <path>`` line per file (to name what changed)

Guarantees of :func:`save_release`: the directory appears complete or not at all (written into a
temporary sibling, renamed at the end); the secret ``A``, PRNG keys, the PAC secret index and
mechanism RNG state never enter it (refused by name and by dtype; release
:func:`pavejax.lora.a_hash` instead); nothing made from a caller-supplied (replayable) noise key
is released; a ``"dp"`` guarantee never claims less epsilon than its own ledger gives, and is
replace-one: a release states its dataset sizes (public, not protected), which add/remove
neighbours differ in, so add/remove ledgers and figures are refused; the writer's local paths do
not appear in any file.
:func:`load_release` checks the content hash, the format version and the backbone before
restoring, and restores onto any target structure and sharding (e.g. another mesh).

Sharp edges: single process only (multi-host saves raise); the name check cannot see a secret
stored under an innocent name, which is why the caller-side rule is "pass only what you mean to
publish" and the tests scan the bytes of a real release.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import pavejax
from pavejax._releasable import check_record, check_replace_one, check_tensor_names
from pavejax.accounting import Ledger
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

__all__ = [
    "FORMAT_VERSION",
    "ReleaseError",
    "ReleaseIntegrityError",
    "ReleaseMetadata",
    "check_publishable",
    "content_hash",
    "load_release",
    "load_spec",
    "save_release",
    "save_spec",
]

FORMAT_VERSION = 1
_FORMAT = "pavejax.release"
_TENSORS, _METADATA, _HASH = "tensors", "metadata.json", "CONTENT_HASH"
_HASH_DOMAIN = b"pavejax.release.content.v1\0"
_HEX64 = re.compile(r"[0-9a-f]{64}")
class ReleaseError(ValueError):
    """A release cannot be written or read as asked (the message says what to change)."""


class ReleaseIntegrityError(ReleaseError):
    """The bytes of a release differ from those it was written with."""


def _json_copy(name: str, value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ReleaseError(f"metadata field {name!r} must be JSON-serialisable with finite "
                           f"numbers (plain dict/list/str/int/float/bool/None; convert numpy "
                           f"scalars with float()): {e}") from None


def _require_dict(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ReleaseError(f"metadata field {name!r} must be a dict, got {type(value).__name__}")
    return _json_copy(name, dict(value))


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ReleaseError(f"guarantee[{name!r}] must be a finite number, got {value!r}")
    return float(value)


def _check_guarantee(g: dict[str, Any], has_ledger: bool) -> None:
    kind = g.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ReleaseError("guarantee needs a non-empty string 'kind' such as 'dp', "
                           "'sketch_rdp', 'pac_mi' or 'none'")
    if not has_ledger and kind != "none":
        raise ReleaseError(f"guarantee kind {kind!r} needs its ledger: pass ledger=Ledger(...) "
                           "(or its to_dict()); only guarantee={'kind': 'none'} goes without one")
    if kind == "none":
        if "epsilon" in g:
            raise ReleaseError("guarantee kind 'none' must not state an epsilon; use kind 'dp'")
        return
    if kind == "dp":
        if _real("epsilon", g.get("epsilon")) < 0:
            raise ReleaseError(f"guarantee epsilon must be >= 0, got {g['epsilon']!r}")
        if not 0 <= _real("delta", g.get("delta")) < 1:
            raise ReleaseError(f"guarantee delta must lie in [0, 1), got {g['delta']!r}")
    if kind == "sketch_rdp":
        conditions = g.get("conditions")
        if not isinstance(conditions, list) or not conditions:
            raise ReleaseError("a 'sketch_rdp' guarantee is conditional: list its conditions, "
                               "e.g. conditions=['A and its key stay secret', ...]")
        if g.get("certified", False):
            raise ReleaseError("a 'sketch_rdp' guarantee is conditional; it cannot be "
                               "'certified': drop that flag")


def _check_format(obj: Any) -> None:
    if not isinstance(obj, Mapping) or obj.get("format") != _FORMAT:
        raise ReleaseError("metadata.json is not a pavejax release record "
                           f"(expected format {_FORMAT!r}); is this the right directory?")
    version = obj.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and \
            version > FORMAT_VERSION:
        raise ReleaseError(f"release format version {version} is newer than this pavejax "
                           f"({pavejax.__version__}) reads (version {FORMAT_VERSION}): "
                           f"upgrade pavejax to read it")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise ReleaseError(f"unknown release format version {version!r}; this pavejax reads "
                           f"version {FORMAT_VERSION}. The release is damaged or was not "
                           f"written by pavejax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseMetadata:
    """The JSON record of a release. Validated on construction (``ReleaseError`` says what to fix).

    Attributes:
      kind: what is released: ``"spec"``, ``"model"``, ``"adapter"``, ``"merged_model"`` or
        another non-empty string.
      backbone_id, backbone_hash: name and weights hash (sha256 hex) of the shared backbone.
      mechanism: e.g. ``"dp-s-pave"``, ``"dp-sam"``, ``"paczero-mi"``, ``"none"``.
      ledger: ``Ledger`` (stored as ``Ledger.to_dict()``) or its dict; must be passed, and may be
        ``None`` only together with ``guarantee={"kind": "none"}`` (a non-private release).
      guarantee: ``{"kind": ..., ...}``; ``"dp"`` needs ``epsilon`` and ``delta``;
        ``"sketch_rdp"`` needs a non-empty ``conditions`` list and is never ``certified``.
      adapted_layers, rank, a_init, a_hash: the low-rank space; ``"spec"`` and ``"adapter"``
        releases need all four (``a_hash`` from :func:`pavejax.lora.a_hash`, never ``A``).
      hyperparameters, risk, extra: JSON-safe dicts (deep-copied).
      format_version, library_version, created: filled in automatically.
    """

    kind: str
    backbone_id: str
    backbone_hash: str
    mechanism: str
    ledger: Any
    guarantee: dict[str, Any]
    adapted_layers: tuple[str, ...] = ()
    rank: int | None = None
    a_init: str | None = None
    a_hash: str | None = None
    hyperparameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    risk: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    library_version: str = pavejax.__version__
    created: str = dataclasses.field(default_factory=lambda: datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        fv = self.format_version
        if isinstance(fv, bool) or fv != FORMAT_VERSION:
            raise ReleaseError(f"this pavejax writes release format version {FORMAT_VERSION}, "
                               f"got format_version={fv!r}; leave it at its default")
        for name in ("kind", "backbone_id", "backbone_hash", "mechanism", "library_version",
                     "created"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ReleaseError(f"metadata field {name!r} must be a non-empty string, got "
                                   f"{getattr(self, name)!r}")
        layers = self.adapted_layers
        if isinstance(layers, str) or not all(isinstance(p, str) and p for p in layers):
            raise ReleaseError(f"adapted_layers must be a sequence of path strings, got "
                               f"{layers!r}")
        object.__setattr__(self, "adapted_layers", tuple(layers))
        if self.rank is not None and (isinstance(self.rank, bool) or
                                      not isinstance(self.rank, int) or self.rank < 1):
            raise ReleaseError(f"rank must be an int >= 1 or None, got {self.rank!r}")
        if self.a_init is not None and (not isinstance(self.a_init, str) or not self.a_init):
            raise ReleaseError(f"a_init must be a non-empty string or None, got {self.a_init!r}")
        if self.a_hash is not None and not (isinstance(self.a_hash, str)
                                            and _HEX64.fullmatch(self.a_hash)):
            raise ReleaseError(f"a_hash must be 64 lowercase hex digits (pavejax.lora.a_hash(A)),"
                               f" got {self.a_hash!r}; never put A itself in a release")
        if self.kind in ("spec", "adapter"):
            missing = [n for n in ("rank", "a_init", "a_hash") if getattr(self, n) is None]
            if missing or not self.adapted_layers:
                raise ReleaseError(f"a {self.kind!r} release must name its low-rank space; "
                                   f"missing {missing + ([] if layers else ['adapted_layers'])}")
        ledger = self.ledger.to_dict() if isinstance(self.ledger, Ledger) else self.ledger
        if ledger is not None:
            ledger = _require_dict("ledger", ledger)
            try:
                Ledger.from_dict(ledger)
            except ValueError as e:
                raise ReleaseError(f"metadata ledger is not a valid Ledger.to_dict(): {e}") \
                    from None
        object.__setattr__(self, "ledger", ledger)
        for name in ("guarantee", "hyperparameters", "risk", "extra"):
            object.__setattr__(self, name, _require_dict(name, getattr(self, name)))
        _check_guarantee(self.guarantee, ledger is not None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record written to ``metadata.json`` (with ``"format": "pavejax.release"``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["adapted_layers"] = list(self.adapted_layers)
        return {"format": _FORMAT, **out}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ReleaseMetadata:
        """Inverse of :meth:`to_dict`; checks the format and version first."""
        _check_format(obj)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names - {"format"})
        if unknown:
            raise ReleaseError(f"metadata.json has unknown fields {unknown} for format version "
                               f"{FORMAT_VERSION}; the release is damaged")
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as e:
            raise ReleaseError(f"metadata.json lacks required fields: {e}") from None


# ------------------------------------------------------------------------------ secrets


def _check_tensors(tensors: Any) -> None:
    flat = jax.tree_util.tree_flatten_with_path(tensors)[0]
    if not flat:
        raise ReleaseError("tensors is empty; a release holds at least one array")
    check_tensor_names(tensors, "tensors", ReleaseError)
    for keypath, leaf in flat:
        if not isinstance(leaf, np.ndarray | np.generic | jax.Array):
            raise ReleaseError(f"tensors{jax.tree_util.keystr(keypath)} is a "
                               f"{type(leaf).__name__}; every leaf must be an array (wrap "
                               f"scalars with np.asarray)")


# ------------------------------------------------------------------------------ hashing


def _files(root: Path) -> list[str]:
    out = []
    for p in root.rglob("*"):
        if p.is_symlink():
            raise ReleaseError(f"{p} is a link; a release holds plain files only")
        if p.is_file() and p.relative_to(root).as_posix() != _HASH:
            out.append(p.relative_to(root).as_posix())
    return sorted(out)


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(root: Path) -> tuple[str, dict[str, str]]:
    per_file = {rel: _file_sha(root / rel) for rel in _files(root)}
    h = hashlib.sha256(_HASH_DOMAIN)
    for rel, sha in per_file.items():
        name = rel.encode("utf-8")
        h.update(len(name).to_bytes(8, "little") + name + bytes.fromhex(sha))
    return h.hexdigest(), per_file


def content_hash(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of a release directory's content, as stored in its ``CONTENT_HASH``."""
    return _digest(Path(path))[0]


def _verify(root: Path) -> str:
    lines = (root / _HASH).read_text().splitlines()
    stored = lines[0].strip() if lines else ""
    recorded = dict(reversed(ln.split("  ", 1)) for ln in lines[1:] if "  " in ln)
    actual, per_file = _digest(root)
    if actual != stored:
        changed = sorted(r for r in per_file if recorded.get(r) not in (None, per_file[r]))
        added = sorted(set(per_file) - set(recorded))
        removed = sorted(set(recorded) - set(per_file))
        what = "; ".join(f"{t}: {v[:5]}{' ...' if len(v) > 5 else ''}" for t, v in
                         (("changed", changed), ("added", added), ("removed", removed)) if v)
        raise ReleaseIntegrityError(
            f"release {root} was modified or corrupted after it was written (content hash "
            f"{actual} != recorded {stored}{'; ' + what if what else ''}). Do not trust it: "
            f"fetch the release again from its publisher.")
    return actual


# ------------------------------------------------------------------------------ save / load


def _check_ledger_covers(meta: ReleaseMetadata) -> None:
    check_replace_one(meta.ledger, meta.guarantee, "the release", ReleaseError)
    g = meta.guarantee
    if g["kind"] != "dp" or meta.ledger is None:
        return
    ledger = Ledger.from_dict(meta.ledger)
    if g.get("relation", ledger.relation.value) != ledger.relation.value:
        raise ReleaseError(f"the guarantee is stated for relation {g['relation']!r} but the "
                           f"ledger accounts {ledger.relation.value!r}: release the ledger of "
                           f"the relation the guarantee states")
    accountant = g.get("accountant", ledger.accountant)
    eps = ledger.epsilon(float(g["delta"]), accountant=accountant)
    if float(g["epsilon"]) < eps * (1 - 1e-9) - 1e-12:
        raise ReleaseError(f"the guarantee claims epsilon {g['epsilon']} at delta {g['delta']} "
                           f"but its ledger gives {eps} ({accountant}): state the ledger's "
                           f"epsilon (ledger.epsilon(delta))")


def check_publishable(tensors: Any, metadata: ReleaseMetadata) -> None:
    """The checks :func:`save_release` makes before writing, for a release received from
    elsewhere (e.g. a dock service vetting an upload): no secrets by name or dtype, nothing
    replayable, no add/remove figure, a ``"dp"`` guarantee covered by its own ledger. Raises
    :class:`ReleaseError` saying what is wrong."""
    _check_tensors(tensors)
    check_record(metadata.to_dict(), "metadata", ReleaseError)
    _check_ledger_covers(metadata)


def _is_release(path: Path) -> bool:
    try:
        return json.loads((path / _METADATA).read_text()).get("format") == _FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_destination(path: Path, overwrite: bool) -> None:
    if not path.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace the "
                              f"release there, or choose another path")
    if not path.is_dir() or (any(path.iterdir()) and not _is_release(path)):
        raise FileExistsError(f"{path} exists and is not a pavejax release; refusing to "
                              f"replace it even with overwrite=True: choose another path")


def save_release(path: str | os.PathLike[str], tensors: Any, metadata: ReleaseMetadata, *,
                 overwrite: bool = False) -> str:
    """Write ``tensors`` (a pytree of arrays) and ``metadata`` as a release directory at ``path``.

    Synchronous and atomic: the release is assembled in a temporary sibling directory and renamed
    into place when complete. Refuses secrets (entries named like ``A``, ``lora_A``, ``a_key``,
    ``secret``, ``secret_index``, ``mechanism_rng``, ... in the tensors or the metadata; PRNG key
    arrays among the tensors), anything marked replayable (made from a caller-supplied noise
    key; see :mod:`pavejax._releasable`), a ``"dp"`` guarantee whose epsilon is below its
    ledger's, and add/remove figures (a release states its dataset size, which add/remove
    neighbours differ in: every DP figure in a release is replace-one).

    Returns:
      The content hash (sha256 hex), also written to ``CONTENT_HASH``.
    """
    if not isinstance(metadata, ReleaseMetadata):
        raise TypeError(f"metadata must be a ReleaseMetadata, got {type(metadata).__name__}")
    if jax.process_count() > 1:
        raise ReleaseError("save_release runs in a single process; gather the tensors to "
                           "process 0 and call it there")
    _check_tensors(tensors)
    record = metadata.to_dict()
    check_record(record, "metadata", ReleaseError)
    _check_ledger_covers(metadata)
    path = Path(path).absolute()
    _check_destination(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        tmp.mkdir()
        with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
            ckptr.save(tmp / _TENSORS, args=ocp.args.PyTreeSave(tensors))
        marker = tmp / _TENSORS / "commit_success.txt"
        if marker.exists():  # Orbax writes the absolute local path; keep the publisher's paths out
            marker.write_text(f"Checkpoint commit was successful to {_TENSORS}")
        (tmp / _METADATA).write_text(json.dumps(record, indent=1, sort_keys=True,
                                                allow_nan=False))
        digest, per_file = _digest(tmp)
        (tmp / _HASH).write_text(digest + "\n" + "".join(f"{s}  {r}\n"
                                                         for r, s in per_file.items()))
        _install(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digest


def _install(tmp: Path, path: Path, overwrite: bool) -> None:
    if not path.exists():
        tmp.rename(path)
        return
    _check_destination(path, overwrite)
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
    path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _abstract_target(root: Path, sharding: Any) -> Any:
    with ocp.PyTreeCheckpointer() as ckptr:
        saved = ckptr.metadata(root / _TENSORS).item_metadata.tree
    leaves, treedef = jax.tree.flatten(saved, is_leaf=lambda x: hasattr(x, "shape"))
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = ([sharding] * len(leaves) if isinstance(sharding, jax.sharding.Sharding)
                 else jax.tree.leaves(sharding))
    if len(shardings) != len(leaves):
        raise ReleaseError(f"sharding must be one Sharding or a pytree of {len(leaves)} "
                           f"shardings (one per tensor), got {len(shardings)}")
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s)
                                        for m, s in zip(leaves, shardings, strict=True)])


def _restore(root: Path, target: Any, sharding: Any) -> Any:
    if target is None:
        target = _abstract_target(root, sharding)
    elif sharding is not None:
        target = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding),
                              target)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(root / _TENSORS, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    except (ValueError, KeyError, TypeError) as e:
        raise ReleaseError(f"cannot restore the tensors of {root} onto the given target: {e}. "
                           f"Pass a target with the saved structure and shapes (or none).") \
            from None


def _signature_of(meta: ReleaseMetadata) -> SpecSignature | None:
    sig = meta.extra.get("signature")
    return SpecSignature.from_dict(sig) if sig is not None else None


def _check_signature(meta: ReleaseMetadata, expected: SpecSignature) -> None:
    sig = _signature_of(meta)
    if sig is not None:
        expected.require_compatible(sig, what=f"{meta.kind} release")
        return
    have = {"backbone_id": meta.backbone_id, "backbone_hash": meta.backbone_hash,
            "rank": meta.rank, "layers": meta.adapted_layers, "a_hash": meta.a_hash,
            "a_init": meta.a_init}
    diff = [f"{k}: {getattr(expected, k)!r} vs {v!r}" for k, v in have.items()
            if getattr(expected, k) != v]
    if diff:
        raise SpecMismatchError(f"the {meta.kind} release was made in another parameter space "
                                f"({'; '.join(diff)}); use a release made with this backbone, "
                                f"layers, rank and A")


def load_release(path: str | os.PathLike[str], *, expect_backbone_hash: str | None = None,
                 expect_signature: SpecSignature | None = None, target: Any = None,
                 sharding: Any = None) -> tuple[Any, ReleaseMetadata]:
    """Verify and read the release at ``path``: returns ``(tensors, metadata)``.

    Checks, in order: format version (newer: "upgrade pavejax"), content hash
    (``ReleaseIntegrityError`` naming changed files), backbone hash (``ReleaseError`` naming
    both), signature (``SpecMismatchError``). ``target``: pytree of ``jax.ShapeDtypeStruct``
    (with ``sharding=``) or arrays with the saved structure; ``sharding``: one ``Sharding`` for
    every tensor (or a pytree of them when ``target`` is None). With neither, tensors land on the
    first device.
    """
    root = Path(path).absolute()
    missing = [n for n in (_TENSORS, _METADATA, _HASH) if not (root / n).exists()]
    if missing:
        raise ReleaseError(f"{root} is not a pavejax release (missing {missing}); pass the "
                           f"directory that save_release wrote")
    try:
        record = json.loads((root / _METADATA).read_text())
    except ValueError as e:
        raise ReleaseIntegrityError(f"metadata.json of {root} is not valid JSON ({e}); the "
                                    f"release is corrupted: fetch it again") from None
    _check_format(record)
    _verify(root)
    meta = ReleaseMetadata.from_dict(record)
    if expect_backbone_hash is not None and meta.backbone_hash != expect_backbone_hash:
        raise ReleaseError(f"this is a release for another backbone: it was made on "
                           f"{meta.backbone_id!r} with weights hash {meta.backbone_hash}, but "
                           f"the expected backbone hash is {expect_backbone_hash}. Load it "
                           f"with the backbone it was made for.")
    if expect_signature is not None:
        _check_signature(meta, expect_signature)
    return _restore(root, target, sharding), meta


# ------------------------------------------------------------------------------ PAVE specs


def save_spec(path: str | os.PathLike[str], spec: PaveSpec, *, ledger: Any = None,
              guarantee: Mapping[str, Any] | None = None, risk: Mapping[str, Any] | None = None,
              mechanism: str | None = None, overwrite: bool = False) -> str:
    """Release a PAVE spec: its vector is the one tensor, its signature and ``info`` the metadata.

    ``ledger``, ``guarantee`` and ``mechanism`` default to ``spec.info["ledger"]``,
    ``["guarantee"]`` and ``["mechanism"]``; a spec without a ledger needs
    ``guarantee={"kind": "none"}``. Returns the content hash.
    """
    if not isinstance(spec, PaveSpec):
        raise TypeError(f"spec must be a PaveSpec, got {type(spec).__name__}")
    info, sig = dict(spec.info), spec.signature
    ledger = info.get("ledger") if ledger is None else ledger
    guarantee = info.get("guarantee") if guarantee is None else guarantee
    if guarantee is None:
        raise ReleaseError("a spec release states its guarantee: pass guarantee={'kind': 'dp', "
                           "'epsilon': ..., 'delta': ...} with its ledger, or "
                           "guarantee={'kind': 'none'} for a non-private spec")
    mechanism = mechanism or info.get("mechanism") or \
        ("none" if dict(guarantee).get("kind") == "none" else None)
    if not isinstance(mechanism, str):
        raise ReleaseError("name the spec's mechanism: pass mechanism='dp-s-pave' (or record "
                           "info['mechanism'] when generating the spec)")
    hyper = info.get("hyperparameters", info.get("config", {}))
    meta = ReleaseMetadata(
        kind="spec", backbone_id=sig.backbone_id, backbone_hash=sig.backbone_hash,
        mechanism=mechanism, ledger=ledger, guarantee=dict(guarantee),
        adapted_layers=sig.layers, rank=sig.rank, a_init=sig.a_init, a_hash=sig.a_hash,
        hyperparameters=hyper if isinstance(hyper, Mapping) else {"value": hyper},
        risk=dict(risk or info.get("risk") or {}),
        extra={"signature": sig.to_dict(), "spec_kind": spec.kind, "info": info})
    return save_release(path, {"vector": np.asarray(spec.vector, np.float32)}, meta,
                        overwrite=overwrite)


def load_spec(path: str | os.PathLike[str], *,
              expect_signature: SpecSignature | None = None) -> PaveSpec:
    """Read a spec release written by :func:`save_spec` (all checks of :func:`load_release`).

    A mismatched ``expect_signature`` raises ``SpecMismatchError`` naming the differing fields.
    """
    tensors, meta = load_release(path, expect_signature=expect_signature)
    if meta.kind != "spec" or _signature_of(meta) is None or "vector" not in tensors:
        raise ReleaseError(f"{path} holds a {meta.kind!r} release, not a spec; use "
                           f"load_release for it")
    return PaveSpec(np.asarray(tensors["vector"], np.float32), _signature_of(meta),
                    meta.extra.get("spec_kind", "model"), meta.extra.get("info", {}))
