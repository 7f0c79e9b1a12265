"""The client of an HTTP dock (``pavejax dock serve``): :class:`RemoteDock`, made by
:meth:`pavejax.pave.dock.Dock.remote`, with the API of a local dock.

Privacy model of a remote search. :meth:`RemoteDock.search` downloads the dock's published spec
snapshot (every stored spec is DP-S-PAVE with a certified DP guarantee, safe to publish; kept in
memory and brought up to date incrementally, by version, with an ETag) and ranks on this
machine, with the same code as a local dock. The user's spec, DP or not, is never sent: the only
requests a search makes are ``GET /api/v1/snapshot`` (with the snapshot version this client
holds). The server learns that a search happened (and when), not what was searched.

Downloads are checked twice: the archive's sha256 against the listing and the response header,
then the release's own content hash (:func:`pavejax.release.load_release`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pavejax.pave import _archive
from pavejax.pave._dock_io import DockEntry, a_key_from_seed
from pavejax.pave._ranking import SpecTable, check_query
from pavejax.pave.search import SearchResult
from pavejax.spec_types import PaveSpec, SpecSignature

__all__ = ["RemoteDock", "RemoteDockError", "is_url"]

API = "/api/v1"
_CHUNK = 1 << 20


class RemoteDockError(ValueError):
    """The dock service refused a request or could not be reached (``status``: the HTTP status,
    0 when there was no answer); the message is the server's explanation."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def is_url(text: Any) -> bool:
    """True for ``http://`` and ``https://`` addresses (a dock URL rather than a folder)."""
    return isinstance(text, str | os.PathLike) and \
        str(text).startswith(("http://", "https://"))


class RemoteDock:
    """A dock served over HTTP. ``token``: a developer token (``pavejax dock token``), needed
    to :meth:`submit` and :meth:`remove`; reading and searching need none."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 120.0) -> None:
        url = str(url)
        if not is_url(url):
            raise ValueError(f"a dock URL starts with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._table = SpecTable()
        self._version: int | None = None
        self._etag: str | None = None
        self._signature: SpecSignature | None = None

    def __repr__(self) -> str:
        return f"RemoteDock({self.url!r})"

    def close(self) -> None:
        """Drop the cached snapshot (no connection is held between calls)."""
        self._table = SpecTable()
        self._version = self._etag = None

    def __enter__(self) -> RemoteDock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP

    @contextlib.contextmanager
    def _open(self, method: str, path: str, *, data: Any = None,
              headers: Mapping[str, str] | None = None, auth: bool = False) -> Iterator[Any]:
        headers = dict(headers or {})
        if auth:
            if not self.token:
                raise PermissionError("this action needs a developer token: pass token=... "
                                      "(or --token / PAVEJAX_DOCK_TOKEN); the dock operator "
                                      "issues one with 'pavejax dock token DOCK --account NAME'")
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 304:
                yield e
                return
            try:
                message = json.loads(e.read().decode())["error"]
            except (ValueError, KeyError, TypeError, OSError):
                message = e.reason
            raise RemoteDockError(f"{method} {self.url}{path}: HTTP {e.code}: {message}",
                                  e.code) from None
        except (BrokenPipeError, ConnectionResetError) as e:
            raise RemoteDockError(f"the dock at {self.url} closed the connection during "
                                  f"{method} {path} ({e}); a server refuses an upload before "
                                  f"reading it when the token or the size is wrong") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RemoteDockError(f"cannot reach the dock at {self.url}: {reason}") from None
        with resp:
            yield resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        with self._open(method, path, **kw) as resp:
            return json.loads(resp.read().decode())

    # ------------------------------------------------------------------ dock facts

    def info(self) -> dict[str, Any]:
        """The dock's public record: signature, published A-key seed, size, version."""
        return self._json("GET", f"{API}/dock")

    @property
    def signature(self) -> SpecSignature | None:
        """The dock's spec space (None before its first learnware)."""
        sig = self.info().get("signature")
        return None if sig is None else SpecSignature.from_dict(sig)

    def a_key(self) -> jax.Array:
        """The dock's published key for ``A`` (an HTTP dock holds only certified DP specs, so
        ``A`` is public); build specs for this dock with it."""
        seed = self.info().get("a_key")
        if not seed:
            raise RemoteDockError(f"the dock at {self.url} does not publish its A key")
        return a_key_from_seed(seed)

    @property
    def subspace(self) -> None:
        """None for a whole-block dock. A coordinate-subspace dock's ``U`` is not served over
        HTTP: searching works, making specs for it needs a copy of the dock's ``subspace/``."""
        if self.info().get("subspace"):
            raise RemoteDockError(f"the dock at {self.url} uses a coordinate subspace, which is "
                                  f"not served over HTTP; make specs with a copy of the dock's "
                                  f"subspace/ directory (searching works without it)")
        return None

    def __len__(self) -> int:
        return int(self.info()["learnwares"])

    def list(self) -> list[DockEntry]:
        """All entries in id order (without their spec vectors)."""
        return [_entry(e) for e in self._json("GET", f"{API}/learnwares")["learnwares"]]

    def _entry(self, id_or_name: int | str) -> DockEntry:
        if isinstance(id_or_name, (int, np.integer)) and not isinstance(id_or_name, bool):
            return _entry(self._json("GET", f"{API}/learnwares/{int(id_or_name)}"))
        if not isinstance(id_or_name, str):
            raise TypeError(f"expected an int id or a str name, got {type(id_or_name).__name__}")
        for e in self.list():
            if e.name == id_or_name:
                return e
        raise KeyError(f"no learnware {id_or_name!r} in the dock at {self.url}; see list()")

    def get(self, id_or_name: int | str) -> DockEntry:
        """The entry with its metadata and its spec (downloaded and verified)."""
        entry = self._entry(id_or_name)
        return dataclasses.replace(entry, spec=self.load_spec(entry.id))

    # ------------------------------------------------------------------ downloads

    def download(self, id_or_name: int | str, what: str, out: str | os.PathLike[str]) -> Path:
        """Download a learnware's ``what`` (``"spec"`` or ``"model"``) release into the new
        directory ``out``, verified (archive sha256, then the release content hash)."""
        if what not in ("spec", "model"):
            raise ValueError(f"what must be 'spec' or 'model', got {what!r}")
        out = Path(out)
        if out.exists():
            raise FileExistsError(f"{out} already exists; choose a new directory")
        entry = self._entry(id_or_name)
        listed = entry.files.get(what)
        if listed is None:
            raise KeyError(f"learnware {entry.name!r} has no {what} release on the dock")
        with tempfile.TemporaryDirectory(prefix="pavejax-download-") as tmp:
            archive = Path(tmp) / "release.tar"
            h = hashlib.sha256()
            with self._open("GET", f"{API}/learnwares/{entry.id}/{what}") as resp, \
                    open(archive, "wb") as f:
                header = resp.headers.get("X-Content-SHA256")
                for chunk in iter(lambda: resp.read(_CHUNK), b""):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != listed["sha256"] or header not in (None, listed["sha256"]):
                raise RemoteDockError(f"the {what} release of {entry.name!r} arrived damaged "
                                      f"(sha256 {h.hexdigest()} != listed {listed['sha256']}); "
                                      f"download it again")
            _archive.extract(archive, Path(tmp) / "x", allowed_top={"release"},
                             max_bytes=max(int(listed["size"]), 1) * 2)
            from pavejax.release import content_hash

            got = content_hash(Path(tmp) / "x" / "release")
            if got != listed.get("content_hash", got):
                raise RemoteDockError(f"the {what} release of {entry.name!r} is not the one "
                                      f"listed (content hash {got} != {listed['content_hash']})")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / "x" / "release"), out)
        return out

    def load_spec(self, id_or_name: int | str) -> PaveSpec:
        """The stored spec, from its downloaded and verified release."""
        from pavejax.release import load_spec

        with tempfile.TemporaryDirectory(prefix="pavejax-spec-") as tmp:
            path = self.download(id_or_name, "spec", Path(tmp) / "spec")
            return load_spec(path, expect_signature=self.signature)

    def load_model(self, id_or_name: int | str, like: Any = None) -> Any:
        """The stored model params (from its downloaded, verified model release; NumPy leaves
        in the release's structure, or placed in ``like``'s structure, shapes checked)."""
        from pavejax.release import load_release

        sig = self.signature
        with tempfile.TemporaryDirectory(prefix="pavejax-model-") as tmp:
            path = self.download(id_or_name, "model", Path(tmp) / "model")
            tensors, _ = load_release(path, expect_backbone_hash=None if sig is None
                                      else sig.backbone_hash)
        tensors = jax.tree.map(np.asarray, tensors)
        if like is None:
            return tensors
        leaves, (like_leaves, treedef) = jax.tree.leaves(tensors), jax.tree.flatten(like)
        if [np.shape(x) for x in like_leaves] != [x.shape for x in leaves]:
            raise ValueError(f"like has {len(like_leaves)} leaves, the stored model "
                             f"{len(leaves)} of other shapes; pass a pytree of the same model")
        return jax.tree.unflatten(treedef, leaves)

    # ------------------------------------------------------------------ search

    def sync(self) -> int:
        """Bring the local copy of the spec snapshot up to date (only what changed since the
        version held); returns the dock version now held."""
        headers = {} if self._etag is None else {"If-None-Match": self._etag}
        query = "" if self._version is None else f"?since={self._version}"
        with self._open("GET", f"{API}/snapshot{query}", headers=headers) as resp:
            if getattr(resp, "code", 200) == 304:
                return int(self._version)
            snap = json.loads(resp.read().decode())
            etag = resp.headers.get("ETag")
        table = self._table
        vectors, infos = dict(table.vectors), dict(table.infos)
        names = dict(zip(table.ids, table.names, strict=True))
        if snap["full"]:
            vectors, infos, names = {}, {}, {}
        for i in snap["removed"]:
            vectors.pop(i, None), infos.pop(i, None), names.pop(i, None)
        for e in snap["learnwares"]:
            raw = base64.b64decode(e["vector"])
            if hashlib.sha256(raw).hexdigest() != e["sha256"]:
                raise RemoteDockError(f"the snapshot's spec of {e['name']!r} arrived damaged; "
                                      f"search again")
            i = int(e["id"])
            vectors[i] = np.frombuffer(raw, "<f4").astype(np.float32)
            infos[i], names[i] = e["spec_info"], e["name"]
        ids = sorted(vectors)
        table.replace(ids, [names[i] for i in ids], vectors, infos)
        sig = snap.get("signature")
        self._signature = None if sig is None else SpecSignature.from_dict(sig)
        self._version, self._etag = int(snap["version"]), etag
        return self._version

    def search(self, user_spec: PaveSpec | Sequence[PaveSpec], k: int = 5, *,
               chunk_size: int | None = None, dtype: str = "float32", mesh: Any = None,
               score: str = "cosine") -> SearchResult | list[SearchResult]:
        """As :meth:`pavejax.pave.dock.Dock.search`, on this machine: the snapshot is synced
        (see :meth:`sync`), the user's spec never leaves the process."""
        check_query(user_spec, k, score, None)
        self.sync()
        specs = check_query(user_spec, k, score, self._signature)
        out = self._table.search(specs, int(k), signature=self._signature,
                                 chunk_size=chunk_size, dtype=dtype, mesh=mesh, score=score)
        return out[0] if isinstance(user_spec, PaveSpec) else out

    # ------------------------------------------------------------------ submit / withdraw

    def submit(self, spec: PaveSpec | str | os.PathLike[str], *, name: str,
               model: str | os.PathLike[str] | None = None,
               metadata: Mapping[str, Any] | None = None) -> int:
        """Submit a learnware (needs a token); returns its id. ``spec``: a DP-S-PAVE
        :class:`PaveSpec` (released here with :func:`pavejax.release.save_spec`) or a spec
        release directory; ``model``: a model release directory (optional). The server checks
        integrity, backbone, the certified DP guarantee and secrets, and refuses with a reason.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError("over HTTP a model travels as a release: save it with "
                            "pavejax.release.save_release and pass the directory")
        meta = dict(metadata or {})
        try:
            body_json = json.dumps({"name": name, "metadata": meta}, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serialisable with finite numbers: {e}") \
                from None
        with tempfile.TemporaryDirectory(prefix="pavejax-submit-") as tmp:
            if isinstance(spec, PaveSpec):
                from pavejax.release import save_spec

                save_spec(Path(tmp) / "spec", spec)
                spec = Path(tmp) / "spec"
            elif not isinstance(spec, str | os.PathLike):
                raise TypeError(f"spec must be a PaveSpec or a spec release directory, got "
                                f"{type(spec).__name__}")
            dirs = [("spec", Path(spec))] + ([] if model is None else [("model", Path(model))])
            for what, d in dirs:
                if not d.is_dir():
                    raise FileNotFoundError(f"the {what} release {d} does not exist")
            bundle = Path(tmp) / "submission.tar"
            with open(bundle, "wb") as f:
                _archive.pack(f, dirs, [("submission.json", body_json)])
            size = bundle.stat().st_size
            # refused before the upload rather than mid-way: the token, then the size
            self.account()
            limit = self.info().get("max_upload_bytes")
            if isinstance(limit, int) and size > limit:
                raise RemoteDockError(f"the submission is {size} bytes, over the dock's upload "
                                      f"limit of {limit} bytes", 413)
            with open(bundle, "rb") as f:
                out = self._json("POST", f"{API}/learnwares", data=f, auth=True, headers={
                    "Content-Type": "application/x-tar", "Content-Length": str(size)})
        return int(out["id"])

    def account(self) -> str:
        """The account this client's token belongs to (raises if the token is not valid)."""
        return str(self._json("GET", f"{API}/account", auth=True)["account"])

    def remove(self, id_or_name: int | str) -> DockEntry:
        """Withdraw a learnware this token's account submitted; returns its entry."""
        entry = self._entry(id_or_name)
        self._json("DELETE", f"{API}/learnwares/{entry.id}", auth=True)
        return entry

    withdraw = remove


def _entry(e: Mapping[str, Any]) -> DockEntry:
    return DockEntry(int(e["id"]), e["name"], e.get("metadata", {}), e["backbone_id"],
                     e["backbone_hash"], int(e["rank"]), tuple(e["layers"]), e["a_hash"],
                     e.get("spec_info", {}), e.get("ledger_summary"), bool(e["has_model"]),
                     float(e["created"]), submitter=e.get("submitter"),
                     version=int(e.get("version", 0)), files=e.get("files", {}))
