"""The dock over HTTP: a Starlette application serving one dock (SQLite or PostgreSQL index).

Endpoints (JSON unless said otherwise; errors are ``{"error": "<what is wrong and what to
do>"}`` with a 4xx status, and leave the dock unchanged):

* ``GET /`` and ``GET /learnwares/{id}``: the read-only HTML pages (:mod:`.page`).
* ``GET /api/v1/dock``: the dock's public record (signature, the published A-key seed, size,
  version, upload limit).
* ``GET /api/v1/account`` (token): the account the token belongs to (a client checks its token
  and the upload size before uploading).
* ``GET /api/v1/learnwares`` and ``/api/v1/learnwares/{id}``: metadata (classes, backbone,
  guarantee, ε/δ, ledger summary, risk bounds, submitter, file hashes).
* ``GET /api/v1/learnwares/{id}/spec`` and ``.../model``: the release archive, streamed, with
  ``X-Content-SHA256`` and ``X-Release-Content-Hash``.
* ``GET /api/v1/snapshot[?since=V]``: every spec (or the changes since version ``V``) for
  client-side search, with an ``ETag`` (``If-None-Match`` gives 304).
* ``POST /api/v1/learnwares`` (``Authorization: Bearer <token>``): a submission archive
  (uncompressed tar: ``submission.json`` with ``name`` and ``metadata``, ``spec/`` and optionally
  ``model/`` release directories). Staged in a temporary directory, vetted, then committed by
  :meth:`~pavejax.pave.dock.Dock.submit` in one transaction: a server killed at any point leaves
  no partial entry.
* ``DELETE /api/v1/learnwares/{id}`` (token): withdraw; only the submitting account may.

Vetting a submission (each failure is a 4xx naming the problem): the archive is well formed and
within the size limit (413 over it), holds only release files, each release's content hash
verifies; the spec is a model-side spec whose guarantee is certified DP (kind ``"dp"``, covered
by its own replace-one ledger; conditional guarantees such as the intrinsic sketch bound need a
secret A and are refused), the spec's recorded guarantee equals its release's; the spec fits the
dock (backbone, layers, rank, A); the model release is for the same backbone; no secret by name
or dtype, nothing replayable, in either release or the metadata.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

import pavejax
from pavejax._releasable import check_record
from pavejax.pave import _archive
from pavejax.pave._dock_io import DockEntry, is_local
from pavejax.pave.dock import Dock, DockError
from pavejax.release import (
    ReleaseError,
    ReleaseMetadata,
    check_publishable,
    content_hash,
    load_release,
)
from pavejax.service import page
from pavejax.spec_types import PaveSpec, SpecMismatchError, SpecSignature

__all__ = ["DockService", "create_app"]

API = "/api/v1"
DEFAULT_MAX_UPLOAD = 256 << 20
_SUBMISSION_TOP = {"submission.json", "spec", "model"}
_STAGING_PREFIX = "upload-"


class HTTPProblem(Exception):
    """A request refused with ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def uncertified(spec_info: Mapping[str, Any]) -> str | None:
    """Why a spec (its record) cannot be served over HTTP (None if it can)."""
    g = spec_info.get("guarantee") or {}
    if g.get("kind") != "dp":
        return (f"its spec's guarantee is {g.get('kind', 'none')!r}, not certified DP "
                f"(kind 'dp')")
    eps, delta = g.get("epsilon"), g.get("delta")
    if not (isinstance(eps, int | float) and math.isfinite(eps) and
            isinstance(delta, int | float) and 0 <= delta < 1):
        return "its DP guarantee has no finite epsilon and delta"
    if spec_info.get("ledger") is None:
        return "its DP guarantee comes without a ledger"
    return None


class DockService:
    """One dock behind the HTTP API: a handle, a lock for the index and tensor store, and the
    per-version caches of the listing and the snapshot."""

    def __init__(self, dock_path: str | os.PathLike[str], *,
                 max_upload_bytes: int = DEFAULT_MAX_UPLOAD, title: str | None = None) -> None:
        self.path = Path(dock_path)
        self.dock = Dock.open(self.path)
        bad = [(e.name, why) for e in self.dock.list() if (why := uncertified(e.spec_info))]
        if bad:
            self.dock.close()
            listed = "; ".join(f"{n!r}: {w}" for n, w in bad[:5])
            raise DockError(f"an HTTP dock serves only specs with a certified DP guarantee (its A "
                            f"key is public), but {len(bad)} learnware(s) of {self.path} are not: "
                            f"{listed}. Withdraw them (pavejax dock withdraw) or serve another "
                            f"dock; a dock of conditional (intrinsic) specs stays local")
        if isinstance(max_upload_bytes, bool) or not isinstance(max_upload_bytes, int) or \
                max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes must be a positive int, got {max_upload_bytes!r}")
        self.max_upload = max_upload_bytes
        self.title = title or f"pavejax dock {self.path.name}"
        self.lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        # uploads are staged next to the dock; a server killed mid-upload leaves its staging
        # dir, removed by the next server start once it is an hour old (another server
        # process of the same dock may be using a younger one)
        self.staging = self.path / "staging"
        self.staging.mkdir(exist_ok=True)
        now = time.time()
        for old in self.staging.glob(f"{_STAGING_PREFIX}*"):
            with contextlib.suppress(OSError):
                if now - old.stat().st_mtime > 3600:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.dock.close()

    # ------------------------------------------------------------------ cached reads

    def _cached(self, key: tuple, build) -> Any:
        """``build()`` once per (dock generation, key); call with the lock held."""
        full = (self.dock.generation, *key)
        if full not in self._cache:
            self._cache[full] = build()
            while len(self._cache) > 64:
                self._cache.popitem(last=False)
        return self._cache[full]

    def info(self) -> dict[str, Any]:
        with self.lock:
            return self._cached(("info",), self._info)

    def _info(self) -> dict[str, Any]:
        sig = self.dock.signature
        return {"format": "pavejax-dock", "title": self.title, "learnwares": len(self.dock),
                "version": self.dock.generation,
                "signature": None if sig is None else sig.to_dict(),
                "a_key": self.dock.a_key_seed(), "certified_dp_only": True,
                "subspace": self.dock._subspace_hash(), "backend": self.dock.backend,
                "max_upload_bytes": self.max_upload,
                "library_version": pavejax.__version__}

    def entries(self) -> list[dict[str, Any]]:
        with self.lock:
            return self._cached(("entries",), lambda: [public_entry(e)
                                                       for e in self.dock.list()])

    def entry(self, id_: int) -> dict[str, Any]:
        for e in self.entries():
            if e["id"] == id_:
                return e
        raise HTTPProblem(404, f"no learnware with id {id_} in this dock (withdrawn, or never "
                               f"submitted); see {API}/learnwares")

    def snapshot(self, since: int | None) -> tuple[bytes, str]:
        with self.lock:
            gen = self.dock.generation
            if since is not None and since > gen:
                raise HTTPProblem(400, f"since={since} is newer than the dock's version {gen}; "
                                       f"fetch the full snapshot (no since)")
            return self._cached(("snapshot", since), lambda: self._snapshot(since))

    def _snapshot(self, since: int | None) -> tuple[bytes, str]:
        snap = self.dock.snapshot(since)
        sig = self.dock.signature
        out = {"format": "pavejax-dock-snapshot", "version": snap["version"],
               "full": snap["full"], "since": since,
               "signature": None if sig is None else sig.to_dict(),
               "removed": snap["removed"], "learnwares": []}
        for e in snap["learnwares"]:
            raw = np.asarray(e["vector"], "<f4").tobytes()
            out["learnwares"].append({"id": e["id"], "name": e["name"], "version": e["version"],
                                      "spec_info": e["spec_info"],
                                      "sha256": hashlib.sha256(raw).hexdigest(),
                                      "vector": base64.b64encode(raw).decode()})
        body = json.dumps(out, allow_nan=False).encode()
        # the ETag names the dock state: a client holding version V (full or brought up to
        # date incrementally) sends it back and gets 304 while the dock is still at V
        return body, f'"v{snap["version"]}"'

    # ------------------------------------------------------------------ writes

    def account(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        if not header:
            raise HTTPProblem(401, "this action needs a developer token (Authorization: Bearer "
                                   "<token>); the dock operator issues one with 'pavejax dock "
                                   "token DOCK --account NAME'")
        scheme, _, token = header.partition(" ")
        with self.lock:
            name = self.dock.account_for_token(token.strip()) if scheme.lower() == "bearer" \
                else None
        if name is None:
            raise HTTPProblem(401, "the token is not valid for this dock (revoked, mistyped, or "
                                   "for another dock); ask the dock operator for a new one")
        return name

    def submit_staged(self, upload: Path, account: str) -> dict[str, Any]:
        """Vet the uploaded archive and commit it (see the module docstring)."""
        work = upload.parent
        try:
            _archive.extract(upload, work / "x", allowed_top=_SUBMISSION_TOP,
                             max_bytes=self.max_upload)
        except _archive.ArchiveError as e:
            raise HTTPProblem(400, str(e)) from None
        root = work / "x"
        try:
            sub = json.loads((root / "submission.json").read_text())
        except (OSError, ValueError):
            raise HTTPProblem(400, "the upload has no valid submission.json (a JSON object with "
                                   "'name' and 'metadata')") from None
        if not isinstance(sub, dict) or set(sub) - {"name", "metadata"} or \
                not isinstance(sub.get("name"), str) or not sub["name"].strip() or \
                len(sub["name"]) > 200 or not isinstance(sub.get("metadata", {}), dict):
            raise HTTPProblem(400, "submission.json must be {'name': non-empty str (<= 200 "
                                   "chars), 'metadata': {...}}")
        name, metadata = sub["name"], dict(sub.get("metadata", {}))
        if not (root / "spec").is_dir():
            raise HTTPProblem(400, "the upload has no spec/ release directory")
        spec, spec_meta = self._vet_spec(root / "spec")
        if spec_meta.risk:  # the release's risk bounds (disclosure, amplification) are listed
            metadata["spec_risk"] = spec_meta.risk
        files = {"spec": self._repack(root / "spec", work / "spec.tar")}
        model = None
        if (root / "model").is_dir():
            model, model_meta = self._vet_model(root / "model", spec)
            metadata.setdefault("model_release", model_meta.to_dict())
            if "classes" in model_meta.extra:
                metadata.setdefault("classes", list(model_meta.extra["classes"]))
            files["model"] = self._repack(root / "model", work / "model.tar")
        try:
            check_record(metadata, "metadata")
        except ValueError as e:
            raise HTTPProblem(422, str(e)) from None
        with self.lock:
            try:
                new_id = self.dock.submit(spec, name=name, model=model, metadata=metadata,
                                          submitter=account, files=files)
            except SpecMismatchError as e:
                raise HTTPProblem(409, f"the spec does not fit this dock: {e}") from None
            except ValueError as e:
                status = 409 if "already in the dock" in str(e) else 422
                raise HTTPProblem(status, str(e)) from None
        return {"id": new_id, "name": name, "submitter": account,
                "guarantee": spec.info.get("guarantee")}

    @staticmethod
    def _load(root: Path, what: str, **kw: Any) -> tuple[Any, ReleaseMetadata]:
        try:
            _archive.release_files(root)
            return load_release(root, sharding=jax.sharding.SingleDeviceSharding(
                jax.devices("cpu")[0]), **kw)
        except _archive.ArchiveError as e:
            raise HTTPProblem(422, f"the {what} release is malformed: {e}") from None
        except SpecMismatchError as e:
            raise HTTPProblem(409, f"the {what} release does not fit this dock: {e}") from None
        except (ReleaseError, ValueError, KeyError, TypeError) as e:
            status = 409 if "another backbone" in str(e) else 422
            raise HTTPProblem(status, f"the {what} release is refused: {e}") from None

    def _vet_spec(self, root: Path) -> tuple[PaveSpec, ReleaseMetadata]:
        tensors, meta = self._load(root, "spec")
        sig = meta.extra.get("signature")
        if meta.kind != "spec" or sig is None or set(tensors) != {"vector"}:
            raise HTTPProblem(422, f"spec/ holds a {meta.kind!r} release, not a spec release "
                                   f"(pavejax spec --out / pavejax.release.save_spec)")
        try:
            check_publishable(tensors, meta)
            spec = PaveSpec(np.asarray(tensors["vector"], np.float32),
                            SpecSignature.from_dict(sig), meta.extra.get("spec_kind", "model"),
                            meta.extra.get("info", {}))
        except (ReleaseError, ValueError, TypeError, KeyError) as e:
            raise HTTPProblem(422, f"the spec release is refused: {e}") from None
        if spec.kind != "model":
            raise HTTPProblem(422, f"a dock stores model-side specs; this is a {spec.kind!r} "
                                   f"spec (user specs stay with the user: search locally)")
        if not np.isfinite(spec.vector).all():
            raise HTTPProblem(422, "the spec vector has NaN/inf entries; regenerate the spec")
        g = meta.guarantee
        if g.get("kind") != "dp":
            raise HTTPProblem(422, f"this dock serves only specs with a certified DP guarantee "
                                   f"(DP-S-PAVE: pavejax spec --epsilon ...); this spec's "
                                   f"guarantee is {g.get('kind')!r}. Conditional guarantees "
                                   f"(the intrinsic sketch bound) need a secret A and stay in "
                                   f"local docks")
        if spec.info.get("guarantee") != g or spec.info.get("ledger") != meta.ledger:
            raise HTTPProblem(422, "the spec's recorded guarantee or ledger differs from its "
                                   "release's; regenerate the release with save_spec")
        why = uncertified(spec.info)
        if why:
            raise HTTPProblem(422, f"the spec is refused: {why}")
        return spec, meta

    def _vet_model(self, root: Path, spec: PaveSpec) -> tuple[Any, ReleaseMetadata]:
        tensors, meta = self._load(root, "model",
                                   expect_backbone_hash=spec.signature.backbone_hash)
        try:
            check_publishable(tensors, meta)
        except ReleaseError as e:
            raise HTTPProblem(422, f"the model release is refused: {e}") from None
        return jax.tree.map(np.asarray, tensors), meta

    @staticmethod
    def _repack(root: Path, out: Path) -> tuple[Path, str]:
        with open(out, "wb") as f:
            _archive.pack(f, [("release", root)])
        return out, content_hash(root)

    def withdraw(self, id_: int, account: str) -> dict[str, Any]:
        with self.lock:
            try:
                entry = self.dock.remove(id_, submitter=account)
            except KeyError:
                raise HTTPProblem(404, f"no learnware with id {id_} in this dock") from None
            except PermissionError as e:
                raise HTTPProblem(403, str(e)) from None
        return {"id": entry.id, "name": entry.name, "withdrawn": True}


def public_entry(e: DockEntry) -> dict[str, Any]:
    """The listing record of one learnware (everything in it is published)."""
    info = dict(e.spec_info)
    model_release = e.metadata.get("model_release") if isinstance(e.metadata, dict) else None
    return {"id": e.id, "name": e.name, "submitter": e.submitter, "created": e.created,
            "version": e.version, "classes": e.metadata.get("classes"),
            "backbone_id": e.backbone_id, "backbone_hash": e.backbone_hash, "rank": e.rank,
            "layers": list(e.layers), "a_hash": e.a_hash, "mechanism": info.get("mechanism"),
            "guarantee": info.get("guarantee"), "ledger_summary": e.ledger_summary,
            "risk": info.get("risk") or e.metadata.get("spec_risk") or {},
            "has_model": e.has_model,
            "model_guarantee": None if not isinstance(model_release, dict)
            else model_release.get("guarantee"),
            "files": dict(e.files), "metadata": dict(e.metadata), "spec_info": info}


def _problem(status: int, message: str, html: bool = False) -> Response:
    if html:
        return HTMLResponse(page.render_error(status, message), status_code=status)
    return JSONResponse({"error": message}, status_code=status)


def create_app(dock_path: str | os.PathLike[str], *, max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
               title: str | None = None) -> Starlette:
    """The ASGI application serving the dock at ``dock_path`` (run it with uvicorn, or
    ``pavejax dock serve``). Refuses a dock holding any learnware without a certified DP
    guarantee."""
    svc = DockService(dock_path, max_upload_bytes=max_upload_bytes, title=title)

    def guarded(fn, html: bool = False):
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except HTTPProblem as p:
                return _problem(p.status, p.message, html)
        return endpoint

    def learnware_id(request: Request) -> int:
        raw = request.path_params["id"]
        if not raw.isdigit():
            raise HTTPProblem(404, f"learnware ids are integers, got {raw!r}")
        return int(raw)

    async def index(request: Request) -> Response:
        info, entries = await run_in_threadpool(lambda: (svc.info(), svc.entries()))
        return HTMLResponse(page.render_index(info, entries))

    async def detail(request: Request) -> Response:
        i = learnware_id(request)
        info, entry = await run_in_threadpool(lambda: (svc.info(), svc.entry(i)))
        return HTMLResponse(page.render_learnware(info, entry))

    async def dock_info(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(svc.info))

    async def learnwares(request: Request) -> Response:
        entries = await run_in_threadpool(svc.entries)
        return JSONResponse({"learnwares": entries})

    async def learnware(request: Request) -> Response:
        i = learnware_id(request)
        return JSONResponse(await run_in_threadpool(svc.entry, i))

    async def release(request: Request) -> Response:
        i, what = learnware_id(request), request.path_params["what"]
        if what not in ("spec", "model"):
            raise HTTPProblem(404, f"releases are 'spec' or 'model', got {what!r}")
        entry = await run_in_threadpool(svc.entry, i)
        f = entry["files"].get(what)
        if f is None:
            raise HTTPProblem(404, f"learnware {entry['name']!r} has no {what} release")
        path = svc.dock.tensors_root / str(i) / "files" / f"{what}.tar"
        if not await run_in_threadpool(path.is_file):
            raise HTTPProblem(404, f"learnware {i} was just withdrawn")
        headers = {"X-Content-SHA256": f["sha256"], "X-Release-Content-Hash": f["content_hash"],
                   "ETag": f'"{f["sha256"]}"'}
        if is_local(path):
            return FileResponse(os.fspath(path), media_type="application/x-tar",
                                filename=f"{entry['name']}-{what}.tar", headers=headers)

        def chunks():  # a tensor root on an object store: stream through epath
            with path.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/x-tar",
                                 headers=headers | {"Content-Length": str(f["size"])})

    async def snapshot(request: Request) -> Response:
        raw = request.query_params.get("since")
        if raw is not None and not raw.isdigit():
            raise HTTPProblem(400, f"since must be a dock version (an integer >= 0), got {raw!r}")
        body, etag = await run_in_threadpool(svc.snapshot, None if raw is None else int(raw))
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        return Response(body, media_type="application/json", headers={"ETag": etag})

    async def submit(request: Request) -> Response:
        account = await run_in_threadpool(svc.account, request)
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            raise HTTPProblem(411, "a submission needs a Content-Length header")
        if int(declared) > svc.max_upload:
            raise HTTPProblem(413, f"the upload is {int(declared)} bytes, over this dock's "
                                   f"limit of {svc.max_upload} bytes")
        work = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=svc.staging))
        try:
            upload, received = work / "upload.tar", 0
            with open(upload, "wb") as f:
                async for chunk in request.stream():
                    received += len(chunk)
                    if received > svc.max_upload:
                        raise HTTPProblem(413, f"the upload is over this dock's limit of "
                                               f"{svc.max_upload} bytes")
                    f.write(chunk)
            if received != int(declared):
                raise HTTPProblem(400, f"the upload is truncated ({received} of {declared} "
                                       f"bytes); send it again")
            out = await run_in_threadpool(svc.submit_staged, upload, account)
        except ClientDisconnect:
            raise HTTPProblem(400, "the client disconnected during the upload") from None
        except HTTPProblem as p:  # the staging paths are the server's business
            p.message = p.message.replace(f"{work}/x/", "").replace(str(work), "the upload")
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return JSONResponse(out, status_code=201)

    async def withdraw(request: Request) -> Response:
        i = learnware_id(request)
        account = await run_in_threadpool(svc.account, request)
        return JSONResponse(await run_in_threadpool(svc.withdraw, i, account))

    async def whoami(request: Request) -> Response:
        return JSONResponse({"account": await run_in_threadpool(svc.account, request)})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/", guarded(index, True)),
        Route("/learnwares/{id}", guarded(detail, True)),
        Route("/healthz", health),
        Route(f"{API}/dock", guarded(dock_info)),
        Route(f"{API}/account", guarded(whoami)),
        Route(f"{API}/learnwares", guarded(learnwares), methods=["GET"]),
        Route(f"{API}/learnwares", guarded(submit), methods=["POST"]),
        Route(f"{API}/learnwares/{{id}}", guarded(learnware), methods=["GET"]),
        Route(f"{API}/learnwares/{{id}}", guarded(withdraw), methods=["DELETE"]),
        Route(f"{API}/learnwares/{{id}}/{{what}}", guarded(release)),
        Route(f"{API}/snapshot", guarded(snapshot)),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        svc.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = svc
    return app
