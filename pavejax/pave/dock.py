"""The learnware dock: a persistent, crash-safe store of PAVE specs and models, with search.

Layout of a dock directory::

    index.sqlite        SQLite index (WAL): one row per learnware, the dock's SpecSignature,
                        accounts (token hashes) and the log of withdrawals
    index.json          instead of index.sqlite: {"database": "postgresql://..."}, the
                        PostgreSQL database holding the index (same schema, same migrations;
                        several machines or server processes share one dock this way)
    tensors/<id>/spec   Orbax checkpoint of the spec vector
    tensors/<id>/model  Orbax checkpoint of the model params (optional)
    tensors/<id>/files/ the submitted spec and model releases as archives (optional; what an
                        HTTP dock serves for download, byte for byte)

``tensors/`` may live elsewhere: ``Dock.create(path, tensors="gs://bucket/market")`` (any path
``etils.epath`` and Orbax open: a local or mounted folder, or an object store with its
filesystem package installed) records the root in the index, so every process of the dock
uses it. On an object store a rename is a copy: atomicity still comes from the index commit
(a row is committed only after its tensors are complete; orphans are collected), and fsync
applies to local folders only.
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
unique (UNIQUE constraint). On PostgreSQL the write lock is a transaction-scoped advisory lock
(:mod:`pavejax.pave._index_db`), with the same guarantees between processes on several machines
sharing the dock directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from etils import epath

from pavejax._releasable import check_record, check_replace_one, check_tensor_names
from pavejax.pave import _index_db as idb
from pavejax.pave._archive import file_sha256
from pavejax.pave._dock_io import (
    COLUMNS,
    DockEntry,
    a_key_from_seed,
    entry_from_row,
    fsync_tree,
    is_local,
    ledger_summary,
    load_model_tree,
    load_tree,
    model_to_tree,
    save_tree,
    to_json,
)
from pavejax.pave._index_db import transaction
from pavejax.pave._ranking import SpecTable, check_query, rank_with_ties
from pavejax.pave.search import SCORE_TEMPERATURE, SearchResult, scores_from_cosines
from pavejax.pave.subspace import Subspace
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

if TYPE_CHECKING:
    from pavejax.pave.remote import RemoteDock
    from pavejax.pave.reuse import Reused

__all__ = ["SCORE_TEMPERATURE", "Dock", "DockEntry", "DockError", "SearchResult",
           "scores_from_cosines"]

FORMAT, VERSION = "pavejax-dock", idb.SCHEMA_VERSION
_TOKEN_PREFIX = "pvj_"
# Test-only pause points inside submit (stage name -> callable); empty in normal use.
_HOOKS: dict[str, Callable[[], None]] = {}


class DockError(ValueError):
    """The directory is not a dock, or its index is corrupt or from a newer version."""


class Dock:
    """A learnware dock at ``path``. Build with :meth:`create` or :meth:`open`."""

    def __init__(self, path: Path, conn: Any) -> None:
        self.path, self._conn = path, conn
        self._cache_generation: str | None = None
        self._table = SpecTable()
        row = conn.execute("SELECT value FROM meta WHERE key = 'tensors'").fetchone()
        self.tensors_root = path / "tensors" if row is None else epath.Path(row[0])
        self._local_tensors = row is None or is_local(row[0])

    # ------------------------------------------------------------------ create / open

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, signature: SpecSignature | None = None,
               subspace: Subspace | None = None, exist_ok: bool = False,
               database: str | None = None, tensors: str | os.PathLike[str] | None = None
               ) -> Dock:
        """Create a dock at ``path`` (a new or empty dir); ``signature`` fixes the spec space
        now, otherwise the first submit locks it. ``subspace``: the public coordinate subspace
        ``U`` of the dock's specs (stored with the dock, :attr:`subspace`; every spec must be
        made with ``SpecConfig(subspace=dock.subspace)``); None for whole-block specs.
        ``exist_ok`` opens an existing dock instead (checking ``signature`` and ``subspace``
        against it). ``database``: a ``postgresql://user@host:port/dbname`` URL to keep the
        index in that (empty) PostgreSQL database instead of ``index.sqlite``; put the
        password in ``PGPASSWORD`` or ``~/.pgpass``, not in the URL (the URL is stored in
        ``index.json``). ``tensors``: where the Orbax tensor dirs and release archives go
        (default ``path/tensors``; see the module docstring)."""
        path = Path(path)
        if signature is not None and not isinstance(signature, SpecSignature):
            raise TypeError(f"signature must be a SpecSignature, got {type(signature).__name__}")
        if subspace is not None and not isinstance(subspace, Subspace):
            raise TypeError(f"subspace must be a pavejax.pave.subspace.Subspace, got "
                            f"{type(subspace).__name__}")
        if database is not None and not idb.is_database_url(database):
            raise ValueError(f"database must be a postgresql:// URL, got {database!r}")
        if (path / "index.sqlite").exists() or (path / "index.json").exists():
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
        if database is not None:
            if urllib.parse.urlsplit(database).password is not None:
                raise ValueError("put the database password in PGPASSWORD or ~/.pgpass, not in "
                                 "the URL: the URL is stored in the dock's index.json")
            conn = idb.PostgresConnection(database)
            if idb.table_exists(conn, "meta"):
                conn.close()
                raise DockError(f"the database {idb.redact(database)} already holds a dock "
                                f"index; give each dock its own database (CREATE DATABASE)")
        if tensors is not None:
            root = epath.Path(tensors)
            if root.exists() and any(root.iterdir()):
                raise DockError(f"the tensor root {tensors} is not empty; give each dock its "
                                f"own")
        (path / "tensors").mkdir(parents=True, exist_ok=True)
        if tensors is not None:
            epath.Path(tensors).mkdir(parents=True, exist_ok=True)
        (path / "secret").mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path / "secret" / "a_key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        if subspace is not None:
            subspace.save(path / "subspace")
        dock_uid = uuid.uuid4().hex
        if database is None:
            conn = idb.connect_sqlite(path / "index.sqlite")
        with transaction(conn):
            idb.migrate(conn, 0)
            for key, value in (("format", FORMAT), ("generation", "0"), ("dock_uid", dock_uid)):
                conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) "
                             "DO NOTHING", (key, value))
            if subspace is not None:
                conn.execute("INSERT INTO meta (key, value) VALUES ('subspace', ?)",
                             (subspace.hash,))
            if tensors is not None:
                conn.execute("INSERT INTO meta (key, value) VALUES ('tensors', ?)",
                             (str(tensors),))
        if database is not None:  # written last: a crash before leaves no half-made dock
            (path / "index.json").write_text(json.dumps(
                {"database": database, "dock_uid": dock_uid}, indent=1) + "\n")
        dock = cls(path, conn)
        if signature is not None:
            dock._lock_signature(signature)
        return dock

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, collect_garbage: bool = True) -> Dock:
        """Open an existing dock; garbage-collects tensor dirs left by killed submits (unless
        ``collect_garbage=False``, for extra handles of a dock already open) and applies the
        index migrations of this library version."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no dock at {path}; create one with Dock.create(path)")
        pointer = path / "index.json"
        if pointer.is_file():
            try:
                where = json.loads(pointer.read_text())
                url, uid = where["database"], where["dock_uid"]
            except (ValueError, KeyError, TypeError):
                raise DockError(f"{pointer} is corrupt; it must hold the dock's database URL "
                                f"and uid") from None
            conn = idb.PostgresConnection(url)
            source = idb.redact(url)
        elif (path / "index.sqlite").is_file():
            uid, source = None, f"{path}/index.sqlite"
            try:
                conn = idb.connect_sqlite(path / "index.sqlite")
            except idb.sqlite3.DatabaseError as e:
                raise DockError(f"the index of the dock at {path} ({source}) is corrupt or "
                                f"unreadable ({e}); restore it from a backup") from None
        else:
            raise DockError(f"{path} is not a pavejax dock (no index.sqlite); create one with "
                            f"Dock.create on an empty directory")
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except idb.database_errors(conn) as e:
            conn.close()
            raise DockError(f"the index of the dock at {path} ({source}) is corrupt or "
                            f"unreadable ({e}); restore it from a backup") from None
        if meta.get("format") != FORMAT:
            conn.close()
            raise DockError(f"{source} is not a pavejax dock index")
        if uid is not None and meta.get("dock_uid") != uid:
            conn.close()
            raise DockError(f"the database {source} holds another dock's index than the one "
                            f"{path} was created with; point index.json at the right database")
        version = int(meta.get("version", "0"))
        if version > VERSION:
            conn.close()
            raise DockError(f"the dock at {path} has format version {meta['version']}, newer than "
                            f"this library's {VERSION}; upgrade pavejax")
        if version < VERSION:
            with transaction(conn):
                current = int(dict(conn.execute("SELECT key, value FROM meta").fetchall())
                              .get("version", "0"))
                if current < VERSION:  # another process may have migrated meanwhile
                    idb.migrate(conn, current)
        try:
            conn.execute(f"SELECT {COLUMNS} FROM learnwares LIMIT 1").fetchall()
        except idb.database_errors(conn) as e:
            conn.close()
            raise DockError(f"the index of the dock at {path} ({source}) is corrupt or "
                            f"unreadable ({e}); restore it from a backup") from None
        dock = cls(path, conn)
        if collect_garbage:
            dock._collect_garbage()
        return dock

    @classmethod
    def remote(cls, url: str, token: str | None = None, *, timeout: float = 120.0) -> RemoteDock:
        """A client of the HTTP dock served at ``url`` (``pavejax dock serve``), with the same
        ``search``, ``load_spec``, ``load_model``, ``list``, ``get`` and ``submit`` as a local
        dock. ``token``: the developer token of an account (needed to submit and withdraw).
        Searches download the published spec snapshot and rank on this machine: the user's spec
        is never sent."""
        from pavejax.pave.remote import RemoteDock

        return RemoteDock(url, token=token, timeout=timeout)

    @property
    def backend(self) -> str:
        """``"sqlite"`` or ``"postgresql"``: where the index lives."""
        return getattr(self._conn, "dialect", "sqlite")

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
            for child in self.tensors_root.iterdir():
                if not (child.name.isdigit() and int(child.name) in ids):
                    _rmtree(child) if child.is_dir() else child.unlink()

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
        """The dock's key for ``A`` (pass to ``pavejax.lora.init_lora``). Secret for a local
        dock: lend it only to admitted developers and users (see the module docstring). An
        HTTP dock (certified DP specs only) publishes it."""
        return a_key_from_seed(self.a_key_seed())

    def a_key_seed(self) -> str:
        """The 256-bit seed (hex) behind :meth:`a_key`, as stored in ``secret/a_key``."""
        f = self.path / "secret" / "a_key"
        try:
            seed = f.read_text().strip()
            a_key_from_seed(seed)
        except (OSError, ValueError):
            raise DockError(f"{f} is missing or corrupt: this copy of the dock cannot issue A "
                            f"keys (searching still works)") from None
        return seed

    # ------------------------------------------------------------------ submit / remove

    def submit(self, spec: PaveSpec, *, name: str, model: Any = None,
               metadata: Mapping[str, Any] | None = None, submitter: str | None = None,
               files: Mapping[str, tuple[os.PathLike[str] | str, str]] | None = None) -> int:
        """Store a model-side ``spec`` (and optionally the model's params pytree) under the
        unique ``name``; returns its id. ``metadata`` is a JSON-safe dict (reuse reads its
        ``"classes"``: the model's class names in output order). Atomic and crash-safe.
        ``submitter``: the account submitting it (recorded; only it may withdraw it over
        HTTP). ``files``: release archives to keep with it, ``{"spec": (archive path,
        release content hash), "model": ...}`` (what :meth:`download` and an HTTP dock serve).

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
        stored_files = {}
        for key, (archive, content_hash) in (files or {}).items():
            if key not in ("spec", "model") or not Path(archive).is_file():
                raise ValueError(f"files must map 'spec'/'model' to (archive path, content "
                                 f"hash); got {key!r} -> {archive!r}")
            stored_files[key] = {"sha256": file_sha256(Path(archive)),
                                 "size": Path(archive).stat().st_size,
                                 "content_hash": str(content_hash)}
        if submitter is not None and (not isinstance(submitter, str) or not submitter):
            raise ValueError(f"submitter must be a non-empty account name, got {submitter!r}")
        sig = spec.signature
        with transaction(self._conn):
            self._check_or_lock(sig, what="spec")
            if self._conn.execute("SELECT 1 FROM learnwares WHERE name = ?", (name,)).fetchone():
                raise ValueError(f"a learnware named {name!r} is already in the dock; choose "
                                 f"another name (e.g. {name + '-2'!r})")
            version = self._bump_generation()
            cur = self._conn.execute(
                f"INSERT INTO learnwares ({COLUMNS.removeprefix('id, ')}) VALUES (?, ?, ?, ?, "
                f"?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (name, meta_json, sig.backbone_id, sig.backbone_hash, sig.rank,
                 json.dumps(list(sig.layers)), sig.a_hash, to_json(info, "spec info"),
                 to_json(ledger_summary(info), "ledger summary"),
                 None if structure is None else json.dumps(structure), time.time(), submitter,
                 version, json.dumps(stored_files) if stored_files else None))
            new_id = int(cur.fetchone()[0])
            _HOOKS.get("after_insert", _noop)()
            tmp = self.tensors_root / f".tmp-{uuid.uuid4().hex}"
            final = self.tensors_root / str(new_id)
            try:
                tmp.mkdir()
                save_tree(tmp / "spec", {"vector": np.asarray(spec.vector, np.float32)})
                if model_tree is not None:
                    save_tree(tmp / "model", model_tree)
                if files:
                    (tmp / "files").mkdir()
                    for key, (archive, _) in files.items():
                        epath.Path(archive).copy(tmp / "files" / f"{key}.tar")
                if self._local_tensors:
                    fsync_tree(tmp)
                _HOOKS.get("after_tensors", _noop)()
                if final.exists():  # an orphan of a killed submit that got the same id
                    _rmtree(final)
                tmp.rename(final)
                if self._local_tensors:
                    fsync_tree(self.tensors_root, recursive=False)
                _HOOKS.get("after_rename", _noop)()
            except BaseException:
                _rmtree(tmp)
                _rmtree(final)
                raise
        return new_id

    def _bump_generation(self) -> int:
        """Advance the generation (inside a write transaction); returns the new one."""
        self._conn.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) "
                           "WHERE key = 'generation'")
        return int(self._conn.execute(
            "SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])

    def remove(self, id_or_name: int | str, *, submitter: str | None = None) -> DockEntry:
        """Delete a learnware (row first, then its tensors; an interrupted delete leaves an
        orphan dir that the next open collects); returns its entry. With ``submitter``, only
        a learnware that account submitted is removed (``PermissionError`` otherwise), checked
        under the write lock. The withdrawal is logged, so incremental snapshots drop it."""
        entry = self._row(id_or_name)
        with transaction(self._conn):
            row = self._conn.execute("SELECT submitter FROM learnwares WHERE id = ?",
                                     (entry.id,)).fetchone()
            if row is None:
                raise KeyError(f"no learnware {id_or_name!r} in the dock at {self.path} (it "
                               f"was just withdrawn)")
            if submitter is not None and row[0] != submitter:
                owner = "was submitted locally" if row[0] is None else "belongs to another account"
                raise PermissionError(f"learnware {entry.name!r} (id {entry.id}) {owner}; only "
                                      f"the account that submitted it may withdraw it")
            self._conn.execute("DELETE FROM learnwares WHERE id = ?", (entry.id,))
            version = self._bump_generation()
            self._conn.execute("INSERT INTO withdrawn (id, version) VALUES (?, ?)",
                               (entry.id, version))
        _rmtree(self.tensors_root / str(entry.id))
        return entry

    # ------------------------------------------------------------------ accounts

    def add_account(self, name: str) -> str:
        """Create the developer account ``name`` and return its token (shown once; the dock
        keeps only its sha256). Submitting and withdrawing over HTTP need a token."""
        if not isinstance(name, str) or not name.strip() or len(name) > 64 or \
                not all(c.isalnum() or c in "-_.@" for c in name):
            raise ValueError(f"account names are 1-64 characters of letters, digits and -_.@; "
                             f"got {name!r}")
        token = _TOKEN_PREFIX + secrets.token_urlsafe(32)
        with transaction(self._conn):
            if self._conn.execute("SELECT 1 FROM accounts WHERE name = ?", (name,)).fetchone():
                raise ValueError(f"account {name!r} already exists; revoke it first to issue a "
                                 f"new token (pavejax dock token --revoke)")
            self._conn.execute("INSERT INTO accounts (name, token_hash, created) VALUES "
                               "(?, ?, ?)", (name, _token_hash(token), time.time()))
        return token

    def revoke_account(self, name: str) -> None:
        """Delete the account (its token stops working; its learnwares stay)."""
        with transaction(self._conn):
            if self._conn.execute("SELECT 1 FROM accounts WHERE name = ?", (name,)).fetchone() \
                    is None:
                raise KeyError(f"no account {name!r}; see Dock.accounts()")
            self._conn.execute("DELETE FROM accounts WHERE name = ?", (name,))

    def accounts(self) -> list[str]:
        """The account names, sorted."""
        return [r[0] for r in self._conn.execute("SELECT name FROM accounts ORDER BY name")]

    def account_for_token(self, token: str) -> str | None:
        """The account whose token this is, or None (compared by hash, in constant time)."""
        if not isinstance(token, str) or not token.startswith(_TOKEN_PREFIX):
            return None
        digest = _token_hash(token)
        rows = self._conn.execute("SELECT name, token_hash FROM accounts").fetchall()
        found = None
        for name, stored in rows:
            if hmac.compare_digest(stored, digest):
                found = name
        return found

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

    def _tensor_dir(self, id_: int) -> Any:
        d = self.tensors_root / str(int(id_))
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
            rows = self._conn.execute(
                "SELECT id, name, spec_info FROM learnwares ORDER BY id").fetchall()
        table = self._table
        ids = [int(r[0]) for r in rows]
        vectors = {i: table.vectors[i] if i in table.vectors else
                   np.asarray(load_tree(self._tensor_dir(i) / "spec")["vector"], np.float32)
                   for i in ids}
        infos = {int(r[0]): json.loads(r[2]) for r in rows}
        table.replace(ids, [r[1] for r in rows], vectors, infos)
        self._cache_generation = gen

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
        sig = self.signature
        specs = check_query(user_spec, k, score, sig)
        self._refresh()
        out = self._table.search(specs, int(k), signature=sig, chunk_size=chunk_size,
                                 dtype=dtype, mesh=mesh, score=score)
        return out[0] if isinstance(user_spec, PaveSpec) else out

    # ------------------------------------------------------------------ publishing

    def snapshot(self, since: int | None = None) -> dict[str, Any]:
        """The dock's specs for client-side search, from one consistent read: ``{"version":
        generation, "full": since is None, "learnwares": [{"id", "name", "version",
        "spec_info", "vector"}], "removed": [ids]}``. With ``since``, only the learnwares
        added after generation ``since`` and the ids withdrawn after it (a client that held
        the snapshot of generation ``since`` applies these to reach ``version``)."""
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)
                                  or since < 0):
            raise ValueError(f"since must be a generation >= 0, got {since!r}")
        with transaction(self._conn, "BEGIN"):
            gen = int(self._conn.execute(
                "SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])
            rows = self._conn.execute(
                "SELECT id, name, version, spec_info FROM learnwares WHERE version > ? "
                "ORDER BY id", (-1 if since is None else since,)).fetchall()
            removed = [] if since is None else [int(r[0]) for r in self._conn.execute(
                "SELECT id FROM withdrawn WHERE version > ? ORDER BY id", (since,))]
        self._refresh()
        out = []
        for r in rows:
            i = int(r[0])
            vec = self._table.vectors.get(i)
            if vec is None:  # added after our refresh read: read it directly
                vec = np.asarray(load_tree(self._tensor_dir(i) / "spec")["vector"], np.float32)
            out.append({"id": i, "name": r[1], "version": int(r[2]),
                        "spec_info": json.loads(r[3]), "vector": vec})
        return {"version": gen, "full": since is None, "learnwares": out,
                "removed": [i for i in removed if i not in {o["id"] for o in out}]}

    @property
    def generation(self) -> int:
        """A counter that advances with every submit and withdrawal."""
        return int(self._conn.execute(
            "SELECT value FROM meta WHERE key = 'generation'").fetchone()[0])

    def file_path(self, id_or_name: int | str, what: str) -> Any:
        """The stored release archive (``what``: ``"spec"`` or ``"model"``) of a learnware (a
        ``pathlib.Path``, or an ``etils.epath.Path`` for a tensor root elsewhere)."""
        entry = self._row(id_or_name)
        if what not in ("spec", "model"):
            raise ValueError(f"what must be 'spec' or 'model', got {what!r}")
        if what not in entry.files:
            raise FileNotFoundError(f"learnware {entry.name!r} has no stored {what} release "
                                    f"(it was submitted without one, or locally as a spec "
                                    f"object)")
        return self._tensor_dir(entry.id) / "files" / f"{what}.tar"

    def download(self, id_or_name: int | str, what: str, out: str | os.PathLike[str]) -> Path:
        """Write a learnware's ``what`` (``"spec"`` or ``"model"``) release to the new
        directory ``out``: the stored archive (the submitted bytes, content hash verified), or
        for a spec submitted as an object, a fresh release of the stored spec."""
        from pavejax.pave import _archive
        from pavejax.release import content_hash, save_spec

        entry, out = self._row(id_or_name), Path(out)
        if out.exists():
            raise FileExistsError(f"{out} already exists; choose a new directory")
        if what not in entry.files:
            if what != "spec":
                raise FileNotFoundError(f"learnware {entry.name!r} has no stored {what} "
                                        f"release")
            save_spec(out, self.load_spec(entry.id))
            return out
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex}")
        try:
            _archive.extract(self.file_path(entry.id, what), tmp, allowed_top={"release"},
                             max_bytes=2 * int(entry.files[what]["size"]) + 1)
            if content_hash(tmp / "release") != entry.files[what]["content_hash"]:
                raise DockError(f"the stored {what} release of {entry.name!r} was altered; "
                                f"restore the dock from a backup")
            os.rename(tmp / "release", out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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


_rank_with_ties = rank_with_ties  # the name the tests and benchmarks import


def _rmtree(path: Any) -> None:
    if isinstance(path, Path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError, OSError):
        if path.exists():
            path.rmtree()


def _token_hash(token: str) -> str:
    return hashlib.sha256(b"pavejax/dock-token/v1\0" + token.encode()).hexdigest()


def _noop() -> None:
    return None
