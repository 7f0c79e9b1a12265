"""The learnware dock: a persistent, crash-safe store of PAVE specs and models, with search.

Layout of a dock directory::

    index.sqlite        SQLite index (WAL): one row per learnware, the dock's SpecSignature
    tensors/<id>/spec   Orbax checkpoint of the spec vector
    tensors/<id>/model  Orbax checkpoint of the model params (optional)
    secret/a_key        256-bit random seed of the dock's A key (mode 0600)
    subspace/           the public coordinate subspace U, if the dock has one
                        (:mod:`pavejax.pave.subspace`; its hash is in the index and in every
                        spec's signature)

Threat model. Specs are comparable only if every developer and user builds ``A`` from the same
key, so the dock lends :meth:`Dock.a_key` to the developers and users it admits. The dock
operator and those parties hold ``A``; the public sees only cosines, rankings and specs. Anyone
holding the key can regenerate ``A``, so the intrinsic Gaussian-sketch guarantee of compact PAVE
holds only against parties without it (it is conditional, never certified); the DP guarantee of
DP-S-PAVE holds against everyone. The seed is never written into the index or a tensor dir.
JAX's threefry keys carry 64 bits: the key is derived from the seed by SHA-256.

Crash safety. :meth:`Dock.submit` holds the index's write lock (``BEGIN IMMEDIATE``) while it
inserts the row, writes the tensors to a temporary dir, fsyncs them, renames the dir to
``tensors/<id>`` and commits. A process killed anywhere before the commit leaves an uncommitted
row (rolled back by SQLite) and at most an orphan dir; every open garbage-collects dirs without
a committed row under the same lock, so it never touches a live submit. Concurrent submits from
several processes serialise on the lock (``busy_timeout``) and get distinct ids; names are
unique (SQLite UNIQUE constraint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pavejax._releasable import check_record, check_replace_one, check_tensor_names
from pavejax.pave import search as search_lib
from pavejax.pave._dock_io import (
    COLUMNS,
    SCHEMA,
    DockEntry,
    connect,
    entry_from_row,
    fsync_tree,
    ledger_summary,
    load_model_tree,
    load_tree,
    model_to_tree,
    save_tree,
    to_json,
    transaction,
)
from pavejax.pave.search import SCORE_TEMPERATURE, SearchResult, scores_from_cosines
from pavejax.pave.subspace import Subspace
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

if TYPE_CHECKING:
    from pavejax.pave.reuse import Reused

__all__ = ["SCORE_TEMPERATURE", "Dock", "DockEntry", "DockError", "SearchResult",
           "scores_from_cosines"]

FORMAT, VERSION = "pavejax-dock", 1
_KEY_DOMAIN = b"pavejax/dock-a-key/v1"
# Test-only pause points inside submit (stage name -> callable); empty in normal use.
_HOOKS: dict[str, Callable[[], None]] = {}


class DockError(ValueError):
    """The directory is not a dock, or its index is corrupt or from a newer version."""


class Dock:
    """A learnware dock at ``path``. Build with :meth:`create` or :meth:`open`."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path, self._conn = path, conn
        self._cache_generation: str | None = None
        self._vectors: dict[int, np.ndarray] = {}
        self._stds: dict[int, float] = {}
        self._ids: list[int] = []
        self._names: list[str] = []
        self._indexes: dict[tuple, search_lib.CosineIndex] = {}

    # ------------------------------------------------------------------ create / open

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, signature: SpecSignature | None = None,
               subspace: Subspace | None = None, exist_ok: bool = False) -> Dock:
        """Create a dock at ``path`` (a new or empty dir); ``signature`` fixes the spec space
        now, otherwise the first submit locks it. ``subspace``: the public coordinate subspace
        ``U`` of the dock's specs (stored with the dock, :attr:`subspace`; every spec must be
        made with ``SpecConfig(subspace=dock.subspace)``); None for whole-block specs.
        ``exist_ok`` opens an existing dock instead (checking ``signature`` and ``subspace``
        against it)."""
        path = Path(path)
        if signature is not None and not isinstance(signature, SpecSignature):
            raise TypeError(f"signature must be a SpecSignature, got {type(signature).__name__}")
        if subspace is not None and not isinstance(subspace, Subspace):
            raise TypeError(f"subspace must be a pavejax.pave.subspace.Subspace, got "
                            f"{type(subspace).__name__}")
        if (path / "index.sqlite").exists():
            if not exist_ok:
                raise FileExistsError(f"{path} is already a dock; use Dock.open(path) or "
                                      f"Dock.create(path, exist_ok=True)")
            dock = cls.open(path)
            if dock._subspace_hash() != (None if subspace is None else subspace.hash):
                raise DockError(f"the dock at {path} has another coordinate subspace "
                                f"({dock._subspace_hash() or 'none'}) than the one given")
            if signature is not None:
                dock._lock_signature(signature)
            return dock
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise DockError(f"{path} exists and is not an empty directory nor a dock; choose a "
                            f"new path")
        (path / "tensors").mkdir(parents=True, exist_ok=True)
        (path / "secret").mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path / "secret" / "a_key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        if subspace is not None:
            subspace.save(path / "subspace")
        conn = connect(path / "index.sqlite")
        with transaction(conn):
            for statement in filter(str.strip, SCHEMA.split(";")):
                conn.execute(statement)
            conn.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)",
                             [("format", FORMAT), ("version", str(VERSION)),
                              ("generation", "0")])
            if subspace is not None:
                conn.execute("INSERT INTO meta VALUES ('subspace', ?)", (subspace.hash,))
        dock = cls(path, conn)
        if signature is not None:
            dock._lock_signature(signature)
        return dock

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Dock:
        """Open an existing dock; garbage-collects tensor dirs left by killed submits."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no dock at {path}; create one with Dock.create(path)")
        if not (path / "index.sqlite").is_file():
            raise DockError(f"{path} is not a pavejax dock (no index.sqlite); create one with "
                            f"Dock.create on an empty directory")
        try:
            conn = connect(path / "index.sqlite")
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            conn.execute(f"SELECT {COLUMNS} FROM learnwares LIMIT 1").fetchall()
        except sqlite3.DatabaseError as e:
            raise DockError(f"the index of the dock at {path} is corrupt or unreadable ({e}); "
                            f"restore it from a backup") from None
        if meta.get("format") != FORMAT:
            raise DockError(f"{path}/index.sqlite is not a pavejax dock index")
        if int(meta.get("version", "0")) > VERSION:
            raise DockError(f"the dock at {path} has format version {meta['version']}, newer than "
                            f"this library's {VERSION}; upgrade pavejax")
        dock = cls(path, conn)
        dock._collect_garbage()
        return dock

    def close(self) -> None:
        """Close the index connection (the dock object is unusable afterwards)."""
        self._conn.close()

    def __enter__(self) -> Dock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _collect_garbage(self) -> None:
        with transaction(self._conn):  # write lock: no submit is between insert and commit
            ids = {r[0] for r in self._conn.execute("SELECT id FROM learnwares")}
            for child in (self.path / "tensors").iterdir():
                if not (child.name.isdigit() and int(child.name) in ids):
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()

    # ------------------------------------------------------------------ signature and key

    @property
    def signature(self) -> SpecSignature | None:
        """The spec space of this dock, or None before the first submit."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'signature'").fetchone()
        return None if row is None else SpecSignature.from_dict(json.loads(row[0]))

    def _subspace_hash(self) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'subspace'").fetchone()
        return None if row is None else row[0]

    @property
    def subspace(self) -> Subspace | None:
        """The dock's public coordinate subspace ``U`` (None: whole-block specs). Pass it to
        ``SpecConfig(subspace=...)`` for every spec of this dock. Loaded from the dock and
        checked against the hash in its index."""
        expected = self._subspace_hash()
        if expected is None:
            return None
        try:
            sub = Subspace.load(self.path / "subspace")
        except ValueError as e:
            raise DockError(f"the dock's subspace files are unreadable or altered ({e}); "
                            f"restore {self.path / 'subspace'} from a backup") from None
        if sub.hash != expected:
            raise DockError(f"the subspace stored in {self.path / 'subspace'} is not the one "
                            f"this dock was created with; restore it from a backup")
        return sub

    def _lock_signature(self, signature: SpecSignature) -> None:
        with transaction(self._conn):
            self._check_or_lock(signature, what="signature")

    def _check_or_lock(self, signature: SpecSignature, *, what: str) -> None:
        expected = self._subspace_hash() or "identity"
        if signature.subspace != expected:
            have = ("whole B blocks" if signature.subspace == "identity" else
                    f"coordinates of subspace {signature.subspace[:12]}")
            want = ("whole B blocks (this dock has no coordinate subspace)"
                    if expected == "identity" else
                    f"coordinates of its subspace {expected[:12]}: make it with "
                    f"SpecConfig(subspace=dock.subspace)")
            raise SpecMismatchError(f"the {what} holds {have}, but this dock takes {want}")
        current = self.signature
        if current is None:
            self._conn.execute("INSERT INTO meta VALUES ('signature', ?)",
                               (to_json(signature.to_dict(), "signature"),))
        else:
            current.require_compatible(signature, what=what)

    def a_key(self) -> jax.Array:
        """The dock's key for ``A`` (pass to ``pavejax.lora.init_lora``). Secret: lend it only
        to admitted developers and users (see the module docstring)."""
        f = self.path / "secret" / "a_key"
        try:
            seed = bytes.fromhex(f.read_text().strip())
        except (OSError, ValueError):
            seed = b""
        if len(seed) != 32:
            raise DockError(f"{f} is missing or corrupt: this copy of the dock cannot issue A "
                            f"keys (searching still works)")
        digest = hashlib.sha256(_KEY_DOMAIN + seed).digest()
        return jax.random.wrap_key_data(np.frombuffer(digest[:8], np.uint32),
                                        impl="threefry2x32")

    # ------------------------------------------------------------------ submit / remove

    def submit(self, spec: PaveSpec, *, name: str, model: Any = None,
               metadata: Mapping[str, Any] | None = None) -> int:
        """Store a model-side ``spec`` (and optionally the model's params pytree) under the
        unique ``name``; returns its id. ``metadata`` is a JSON-safe dict (reuse reads its
        ``"classes"``: the model's class names in output order). Atomic and crash-safe.

        Refuses what :func:`pavejax.release.save_release` refuses: secrets by name (``A``,
        ``lora_a``, keys, ...) in the model, the spec info or ``metadata``; PRNG key arrays;
        specs made from a caller-supplied noise key (replayable); add/remove figures."""
        if not isinstance(spec, PaveSpec):
            raise TypeError(f"spec must be a PaveSpec, got {type(spec).__name__}")
        if spec.kind != "model":
            raise ValueError(f"the dock stores model specs; got a spec of kind {spec.kind!r} "
                             f"(user specs are for Dock.search)")
        if not np.isfinite(spec.vector).all():
            raise ValueError("the spec vector has NaN/inf entries; regenerate the spec")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
        info = dict(spec.info)
        # the checks of save_release: a submitted learnware is published to every dock user
        check_record(info, "the spec")
        check_replace_one(info.get("ledger"), info.get("guarantee"), "the spec")
        check_record(dict(metadata), "metadata")
        if model is not None:
            check_tensor_names(model, "model")
        meta_json = to_json(dict(metadata), "metadata")
        model_tree, structure = (None, None) if model is None else model_to_tree(model)
        sig = spec.signature
        with transaction(self._conn):
            self._check_or_lock(sig, what="spec")
            if self._conn.execute("SELECT 1 FROM learnwares WHERE name = ?", (name,)).fetchone():
                raise ValueError(f"a learnware named {name!r} is already in the dock; choose "
                                 f"another name (e.g. {name + '-2'!r})")
            cur = self._conn.execute(
                f"INSERT INTO learnwares ({COLUMNS}) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                f"?, ?)", (name, meta_json, sig.backbone_id, sig.backbone_hash, sig.rank,
                           json.dumps(list(sig.layers)), sig.a_hash, to_json(info, "spec info"),
                           to_json(ledger_summary(info), "ledger summary"),
                           None if structure is None else json.dumps(structure), time.time()))
            new_id = int(cur.lastrowid)
            _HOOKS.get("after_insert", _noop)()
            tmp = self.path / "tensors" / f".tmp-{uuid.uuid4().hex}"
            final = self.path / "tensors" / str(new_id)
            try:
                tmp.mkdir()
                save_tree(tmp / "spec", {"vector": np.asarray(spec.vector, np.float32)})
                if model_tree is not None:
                    save_tree(tmp / "model", model_tree)
                fsync_tree(tmp)
                _HOOKS.get("after_tensors", _noop)()
                if final.exists():  # an orphan of a killed submit that got the same id
                    shutil.rmtree(final)
                os.rename(tmp, final)
                fsync_tree(self.path / "tensors", recursive=False)
                _HOOKS.get("after_rename", _noop)()
                self._bump_generation()
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(final, ignore_errors=True)
                raise
        return new_id

    def _bump_generation(self) -> None:
        self._conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 "
                           "WHERE key = 'generation'")

    def remove(self, id_or_name: int | str) -> None:
        """Delete a learnware (row first, then its tensors; an interrupted delete leaves an
        orphan dir that the next open collects)."""
        entry = self._row(id_or_name)
        with transaction(self._conn):
            self._conn.execute("DELETE FROM learnwares WHERE id = ?", (entry.id,))
            self._bump_generation()
        shutil.rmtree(self.path / "tensors" / str(entry.id), ignore_errors=True)

    # ------------------------------------------------------------------ read

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM learnwares").fetchone()[0])

    def list(self) -> list[DockEntry]:
        """All entries in id order (without their spec vectors)."""
        rows = self._conn.execute(f"SELECT {COLUMNS} FROM learnwares ORDER BY id").fetchall()
        return [entry_from_row(r) for r in rows]

    def _row(self, id_or_name: int | str) -> DockEntry:
        if isinstance(id_or_name, (int, np.integer)) and not isinstance(id_or_name, bool):
            q, arg = "id = ?", int(id_or_name)
        elif isinstance(id_or_name, str):
            q, arg = "name = ?", id_or_name
        else:
            raise TypeError(f"expected an int id or a str name, got {type(id_or_name).__name__}")
        row = self._conn.execute(f"SELECT {COLUMNS} FROM learnwares WHERE {q}", (arg,)).fetchone()
        if row is None:
            raise KeyError(f"no learnware {id_or_name!r} in the dock at {self.path}; see "
                           f"Dock.list()")
        return entry_from_row(row)

    def get(self, id_or_name: int | str) -> DockEntry:
        """The entry with its metadata and its spec loaded."""
        entry = self._row(id_or_name)
        return dataclasses.replace(entry, spec=self.load_spec(entry.id))

    def _tensor_dir(self, id_: int) -> Path:
        d = self.path / "tensors" / str(int(id_))
        if not d.is_dir():
            raise DockError(f"the tensors of learnware {id_} are missing from {d}; the dock "
                            f"was modified outside pavejax")
        return d

    def load_spec(self, id_or_name: int | str) -> PaveSpec:
        """The stored spec (vector restored from Orbax, signature and info from the index)."""
        entry = self._row(id_or_name)
        vec = np.asarray(load_tree(self._tensor_dir(entry.id) / "spec")["vector"], np.float32)
        sig = self.signature
        return PaveSpec(vec, sig, kind="model", info=entry.spec_info)

    def load_model(self, id_or_name: int | str, like: Any = None) -> Any:
        """The stored params pytree (NumPy leaves, the submitted dict/list/tuple structure).
        With ``like``, leaves are placed in ``like``'s structure (any pytree kind)."""
        entry = self._row(id_or_name)
        if not entry.has_model:
            raise ValueError(f"learnware {entry.name!r} was submitted without a model")
        row = self._conn.execute("SELECT model_structure FROM learnwares WHERE id = ?",
                                 (entry.id,)).fetchone()
        return load_model_tree(self._tensor_dir(entry.id) / "model", json.loads(row[0]), like)

    # ------------------------------------------------------------------ search

    def _refresh(self) -> None:
        with transaction(self._conn, "BEGIN"):  # one snapshot for generation and rows
            gen = self._conn.execute(
                "SELECT value FROM meta WHERE key = 'generation'").fetchone()[0]
            if gen == self._cache_generation:
                return
            rows = self._conn.execute("SELECT id, name FROM learnwares ORDER BY id").fetchall()
        ids = [int(r[0]) for r in rows]
        self._vectors = {i: self._vectors[i] if i in self._vectors else
                         np.asarray(load_tree(self._tensor_dir(i) / "spec")["vector"], np.float32)
                         for i in ids}
        self._stds = {i: v for i, v in self._stds.items() if i in self._vectors}
        self._ids, self._names = ids, [r[1] for r in rows]
        self._indexes, self._cache_generation = {}, gen

    def _index(self, dtype: str, chunk_size: int | None, mesh: Any) -> search_lib.CosineIndex:
        key = (dtype, chunk_size, mesh)
        if key not in self._indexes:
            matrix = np.stack([self._vectors[i] for i in self._ids])
            self._indexes[key] = search_lib.build_index(matrix, dtype=dtype, chunk_size=chunk_size,
                                                        mesh=mesh, pad_to=256)
        return self._indexes[key]

    def search(self, user_spec: PaveSpec | Sequence[PaveSpec], k: int = 5, *,
               chunk_size: int | None = None, dtype: str = "float32",
               mesh: jax.sharding.Mesh | None = None,
               score: str = "cosine") -> SearchResult | list[SearchResult]:
        """Rank the dock's learnwares for ``user_spec`` (one spec, or a list: one batched
        search, a list of results). ``k`` larger than the dock is clipped to its size; an
        empty dock gives empty results. Placement and dtype as in
        :func:`pavejax.pave.search.build_index`. The spec matrix is cached in memory: the
        first search reads every spec (one Orbax restore each, ~10 ms), later ones only the
        rows added since, by this or another process.

        ``score="cosine"`` (default) ranks by plain cosine. ``"debiased"`` or ``"posterior"``
        rank by :func:`pavejax.pave.noise_aware.noise_aware_scores`, which read each
        learnware's noise level from its public record (:func:`~pavejax.pave.noise_aware.
        spec_noise_std`; post-processing, no privacy cost); they score every learnware on the
        host in float64 (``chunk_size``, ``dtype`` and ``mesh`` do not apply) and need every
        stored spec to be non-private or a plain-SGD DP-S-PAVE spec. Ties break by lower id.
        """
        single = isinstance(user_spec, PaveSpec)
        specs = [user_spec] if single else list(user_spec)
        if not specs or not all(isinstance(s, PaveSpec) for s in specs):
            raise TypeError("user_spec must be a PaveSpec or a non-empty list of PaveSpecs")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        from pavejax.pave import noise_aware  # light: NumPy and SciPy only
        if score not in noise_aware.SCORE_METHODS:
            raise ValueError(f"score must be one of {noise_aware.SCORE_METHODS}, got {score!r}")
        for s in specs:
            if not np.isfinite(s.vector).all():
                raise ValueError("a query spec has NaN/inf entries; regenerate it")
        sig = self.signature
        if sig is not None:
            for s in specs:
                sig.require_compatible(s.signature, what="query spec")
        self._refresh()
        if not self._ids:
            empty = SearchResult((), (), np.zeros(0, np.float32), np.zeros(0, np.float32))
            return empty if single else [empty] * len(specs)
        queries = np.stack([s.vector for s in specs])
        if score != "cosine":
            out = self._search_noise_aware(queries, int(k), score)
            return out[0] if single else out
        index = self._index(dtype, chunk_size, mesh)
        cos, idx = search_lib.search_index(index, queries, int(k))
        out = [SearchResult(tuple(self._ids[j] for j in row), tuple(self._names[j] for j in row),
                            c, scores_from_cosines(c)) for c, row in zip(cos, idx, strict=True)]
        return out[0] if single else out

    def _noise_stds(self) -> np.ndarray:
        """Each stored spec's per-coordinate noise std (in ``self._ids`` order), cached by id."""
        from pavejax.pave.noise_aware import spec_noise_std
        sig = self.signature
        missing = [i for i in self._ids if i not in self._stds]
        for i in missing:
            entry = self._row(i)
            spec = PaveSpec(self._vectors[i], sig, kind="model", info=entry.spec_info)
            try:
                self._stds[i] = spec_noise_std(spec)
            except ValueError as e:
                raise ValueError(f"learnware {entry.name!r} (id {i}) cannot be ranked by a "
                                 f"noise-aware score: {e}; search with score='cosine'") from None
        return np.array([self._stds[i] for i in self._ids], np.float64)

    def _search_noise_aware(self, queries: np.ndarray, k: int,
                            method: str) -> list[SearchResult]:
        from pavejax.pave.noise_aware import noise_aware_scores
        matrix = np.stack([self._vectors[i] for i in self._ids])
        stds = self._noise_stds()
        ranking = noise_aware_scores(queries, matrix, stds, method)
        cosines = noise_aware_scores(queries, matrix, stds, "cosine")
        k = min(k, len(self._ids))
        ids = np.asarray(self._ids)
        out = []
        for r, c in zip(ranking, cosines, strict=True):
            order = _rank_with_ties(r, ids)[:k]
            cos = c[order].astype(np.float32)
            out.append(SearchResult(tuple(int(ids[j]) for j in order),
                                    tuple(self._names[j] for j in order), cos,
                                    scores_from_cosines(cos), method, r[order]))
        return out

    # ------------------------------------------------------------------ reuse

    def reuse(self, user_spec: PaveSpec, strategy: str = "top1", *, apply_fn: Callable,
              user_classes: Sequence[str], k: int = 3, few_shot: tuple | None = None,
              base: Any = None, **options: Any) -> Reused:
        """Search, load the top match(es) and reuse them by ``strategy`` (see
        :func:`pavejax.pave.reuse.reuse_models`; models need ``metadata["classes"]``)."""
        from pavejax.pave import reuse as reuse_lib  # lazy: pulls in the merging stack
        if strategy not in reuse_lib.STRATEGIES:
            raise ValueError(f"strategy must be one of {reuse_lib.STRATEGIES}, got {strategy!r}")
        top = 1 if strategy.startswith("top1") else k
        found = self.search(user_spec, top)
        if not found.ids:
            raise ValueError("the dock is empty: nothing to reuse")
        entries = [self._row(i) for i in found.ids]
        for e in entries:
            if not e.has_model or "classes" not in e.metadata:
                raise ValueError(f"learnware {e.name!r} has no stored model or no "
                                 f"metadata['classes']; it cannot be reused")
        params = [self.load_model(e.id) for e in entries]
        classes = [tuple(e.metadata["classes"]) for e in entries]
        return reuse_lib.reuse_models(strategy, params, classes, apply_fn, user_classes,
                                      ids=found.ids, names=found.names, few_shot=few_shot,
                                      base=base, **options)


# Scores this close (relative to the largest) are ties: equal vectors can score a last bit apart
# when BLAS reduces different rows of one matrix product in different orders.
_TIE_RTOL = 1e-12


def _rank_with_ties(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Indices by score descending; runs of scores within ``_TIE_RTOL`` (of the largest
    magnitude) of their neighbour are one tie, ordered by lower id."""
    order = np.argsort(-scores, kind="stable")
    s = scores[order]
    tol = _TIE_RTOL * max(float(np.max(np.abs(s))), np.finfo(np.float64).tiny)
    group = np.concatenate([[0], np.cumsum(-np.diff(s) > tol)])
    return order[np.lexsort((ids[order], group))]


def _noop() -> None:
    return None
