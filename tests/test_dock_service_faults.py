"""Faults at the HTTP dock's submit and withdraw endpoints: each refusal has the right status,
an error message naming the problem, and leaves the dock exactly as it was (generation, size,
names, tensor dirs). A server killed mid-submit leaves no partial entry."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from pavejax.pave import _archive  # noqa: E402
from pavejax.pave.dock import Dock  # noqa: E402
from pavejax.release import ReleaseMetadata, _digest, save_spec  # noqa: E402
from pavejax.service.app import create_app  # noqa: E402
from tests._dock_service import (  # noqa: E402
    DELTA,
    OTHER_SIG,
    ROOT,
    cli_env,
    dp_ledger,
    dp_spec,
    free_port,
    model_release,
    serve,
    spec_release,
    wait_ready,
)

URL = "/api/v1/learnwares"
LIMIT = 64 << 10


# ---------------------------------------------------------------------------- helpers


def bundle(spec: Path | None, model: Path | None = None, *, name: str = "lw",
           metadata: dict | None = None, extra: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """A submission tar as RemoteDock.submit writes it (plus ``extra`` top-level files)."""
    dirs = [(k, d) for k, d in (("spec", spec), ("model", model)) if d is not None]
    body = json.dumps({"name": name, "metadata": metadata or {}}).encode()
    buf = io.BytesIO()
    _archive.pack(buf, dirs, [("submission.json", body), *extra])
    return buf.getvalue()


def state(path: Path) -> tuple:
    """What a refused request must not change, read through a fresh handle."""
    tensors = sorted(p.name for p in (path / "tensors").iterdir())
    with Dock.open(path, collect_garbage=False) as d:
        return d.generation, len(d), [e.name for e in d.list()], tensors


def forge_release(path: Path, tensors: dict, meta: ReleaseMetadata) -> Path:
    """A release written like save_release but without its refusals (what a hostile or buggy
    client could upload): Orbax tensors, metadata.json and a valid CONTENT_HASH."""
    path.mkdir()
    with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save((path / "tensors").absolute(), args=ocp.args.PyTreeSave(tensors))
    (path / "metadata.json").write_text(json.dumps(meta.to_dict(), indent=1, sort_keys=True))
    rehash(path)
    return path


def rehash(path: Path) -> None:
    """Rewrite CONTENT_HASH after an edit, with the algorithm of pavejax.release."""
    digest, per_file = _digest(path)
    (path / "CONTENT_HASH").write_text(digest + "\n" + "".join(f"{s}  {r}\n"
                                                               for r, s in per_file.items()))


class Env:
    """The module's dock: one learnware of alice's, accounts alice and bob, an app at LIMIT."""

    def __init__(self, path: Path, tmp: Path, client: TestClient, alice: str, bob: str) -> None:
        self.path, self.tmp, self.client = path, tmp, client
        self.alice, self.bob = alice, bob
        self.first_id: int | None = None
        self._n = 0

    def fresh(self, what: str = "d") -> Path:
        self._n += 1
        return self.tmp / f"{what}{self._n}"

    def post(self, body: bytes, token: str | None = "alice", headers: dict | None = None,
             client: TestClient | None = None):
        """POST a submission; ``token``: an account name of this Env, a raw token, or None."""
        h = {"Content-Type": "application/x-tar", **(headers or {})}
        if token is not None:
            h["Authorization"] = f"Bearer {getattr(self, token, token)}"
        return (client or self.client).post(URL, content=body, headers=h)

    def refused(self, send, status: int, phrase: str) -> str:
        """Run ``send()``; assert the status, the message and an unchanged dock."""
        before = state(self.path)
        resp = send()
        assert resp.status_code == status, resp.text
        message = resp.json()["error"]
        assert re.search(phrase, message), message
        assert str(self.path) not in message and "upload-" not in message  # no server paths
        assert state(self.path) == before
        return message


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    path = tmp / "dock"
    with Dock.create(path) as d:
        alice, bob = d.add_account("alice"), d.add_account("bob")
    with TestClient(create_app(path, max_upload_bytes=LIMIT)) as client:
        e = Env(path, tmp, client, alice, bob)
        r = e.post(bundle(spec_release(tmp / "s0", 0), model_release(tmp / "m0", 0),
                          name="first"))
        assert r.status_code == 201, r.text
        e.first_id = r.json()["id"]
        yield e


# ---------------------------------------------------------------------------- positive control


def test_valid_submission_is_accepted_at_exactly_the_limit(env):
    body = bundle(spec_release(env.fresh(), 1), model_release(env.fresh(), 1), name="control")
    gen, n, names, tensors = state(env.path)
    with TestClient(create_app(env.path, max_upload_bytes=len(body))) as at_limit:
        r = env.post(body, client=at_limit)
    assert r.status_code == 201, r.text
    new = r.json()["id"]
    assert r.json()["submitter"] == "alice"
    assert state(env.path) == (gen + 1, n + 1, [*names, "control"],
                               sorted([*tensors, str(new)]))
    listed = env.client.get(f"{URL}/{new}").json()
    assert listed["name"] == "control" and listed["has_model"]


# ---------------------------------------------------------------------------- size and framing


def test_declared_content_length_over_the_limit(env):
    body = bundle(spec_release(env.fresh(), 2), name="big-declared")
    env.refused(lambda: env.post(body, headers={"Content-Length": str(LIMIT + 1)}), 413,
                rf"upload is {LIMIT + 1} bytes, over this dock's limit of {LIMIT}")


def test_body_over_the_limit_with_a_lying_small_content_length(env):
    body = bundle(spec_release(env.fresh(), 3), name="big-streamed")
    body += b"\0" * (LIMIT + 1 - len(body))
    env.refused(lambda: env.post(body, headers={"Content-Length": "1000"}), 413,
                rf"^the upload is over this dock's limit of {LIMIT} bytes")


def test_upload_one_byte_over_a_small_limit(env):
    body = bundle(spec_release(env.fresh(), 4), model_release(env.fresh(), 4), name="just-over")
    with TestClient(create_app(env.path, max_upload_bytes=len(body) - 1)) as small:
        env.refused(lambda: env.post(body, client=small), 413,
                    rf"upload is {len(body)} bytes, over this dock's limit of {len(body) - 1}")


def test_truncated_upload(env):
    body = bundle(spec_release(env.fresh(), 5), model_release(env.fresh(), 5), name="cut")
    env.refused(lambda: env.post(body[:len(body) // 2]), 400,
                r"not a readable tar archive \(truncated|truncated inside")


def test_body_shorter_than_its_content_length(env):
    body = bundle(spec_release(env.fresh(), 6), name="short")
    env.refused(lambda: env.post(body[:1000], headers={"Content-Length": str(len(body))}), 400,
                rf"truncated \(1000 of {len(body)} bytes\)")


def test_not_a_tar_and_no_content_length(env):
    env.refused(lambda: env.post(b"PK\x03\x04" + bytes(2000)), 400, r"not a readable tar")
    env.refused(lambda: env.post(b"", headers={"Content-Length": "x"}), 411,
                r"needs a Content-Length")


# ---------------------------------------------------------------------------- corrupted archives


def test_corrupted_tensor_file_fails_the_content_hash(env):
    spec = spec_release(env.fresh(), 7)
    data = max((p for p in (spec / "tensors").rglob("*") if p.is_file() and "/d/" in
                p.as_posix()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    msg = env.refused(lambda: env.post(bundle(spec, name="flipped")), 422,
                      r"spec release is refused: .*modified or corrupted")
    assert data.relative_to(spec).as_posix() in msg  # names the changed file


def test_unexpected_top_level_entry(env):
    body = bundle(spec_release(env.fresh(), 8), name="extra", extra=(("notes.txt", b"hi"),))
    env.refused(lambda: env.post(body), 400, r"unexpected archive entry 'notes.txt'")


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_link_in_the_archive(env, kind):
    spec = spec_release(env.fresh(), 9)
    out = io.BytesIO()  # a valid submission with one link added inside spec/
    with tarfile.open(fileobj=io.BytesIO(bundle(spec, name=f"link-{kind}")), mode="r:") as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        link = tarfile.TarInfo("spec/tensors/escape")
        link.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
        link.linkname = "/etc/passwd" if kind == "symlink" else "submission.json"
        dst.addfile(link)
    env.refused(lambda: env.post(out.getvalue()), 400,
                r"'spec/tensors/escape' is not a regular file .*links .* refused")


def test_unsafe_path_in_the_archive(env):
    body = bundle(spec_release(env.fresh(), 10), name="dotdot",
                  extra=(("spec/../../evil", b"x"),))
    env.refused(lambda: env.post(body), 400, r"unsafe path")


# ---------------------------------------------------------------------------- wrong space


def test_spec_of_another_backbone(env):
    spec = spec_release(env.fresh(), 11, sig=OTHER_SIG)
    env.refused(lambda: env.post(bundle(spec, name="other-space")), 409,
                r"does not fit this dock: .*another parameter space.*backbone")


def test_model_release_of_another_backbone(env):
    body = bundle(spec_release(env.fresh(), 12),
                  model_release(env.fresh(), 12, backbone_hash="99" * 32), name="other-model")
    env.refused(lambda: env.post(body), 409, r"model release is refused: .*another backbone")


# ---------------------------------------------------------------------------- not certified DP


def test_non_private_spec(env):
    spec = dp_spec(13)
    spec = type(spec)(spec.vector, spec.signature, "model", {"mechanism": "none"})
    path = env.fresh()
    save_spec(path, spec, guarantee={"kind": "none"})
    env.refused(lambda: env.post(bundle(path, name="no-dp")), 422,
                r"only specs with a certified DP guarantee.*'none'")


def test_conditional_sketch_spec(env):
    ledger = dp_ledger()
    g = {"kind": "sketch_rdp", "conditions": ["A and its key stay secret"],
         "epsilon": ledger.epsilon(DELTA), "delta": DELTA}
    spec = dp_spec(14)
    spec = type(spec)(spec.vector, spec.signature, "model",
                      {"mechanism": "s-pave", "ledger": ledger.to_dict(), "guarantee": g})
    path = env.fresh()
    save_spec(path, spec)
    env.refused(lambda: env.post(bundle(path, name="sketch")), 422,
                r"certified DP.*'sketch_rdp'.*Conditional guarantees")


def test_user_spec(env):
    path = spec_release(env.fresh(), 15, kind="user")
    env.refused(lambda: env.post(bundle(path, name="user-kind")), 422,
                r"model-side specs; this is a 'user' spec")


# ---------------------------------------------------------------------------- secrets


def test_secret_in_the_submission_metadata(env):
    body = bundle(spec_release(env.fresh(), 16), name="meta-secret",
                  metadata={"notes": {"secret_key": "hunter2"}})
    env.refused(lambda: env.post(body), 422, r"entry named 'secret_key'")


def test_secret_tensor_in_the_model_release(env):
    ledger = dp_ledger(4.0, 10)
    meta = ReleaseMetadata(kind="model", backbone_id="tiny-mlp", backbone_hash="ab" * 32,
                           mechanism="dp-sgd", ledger=ledger,
                           guarantee={"kind": "dp", "epsilon": ledger.epsilon(DELTA),
                                      "delta": DELTA})
    model = forge_release(env.fresh(), {"head": {"kernel": np.ones((4, 2), np.float32)},
                                        "lora_a": np.ones((4, 2), np.float32)}, meta)
    body = bundle(spec_release(env.fresh(), 17), model, name="tensor-secret")
    env.refused(lambda: env.post(body), 422, r"model release is refused: .*'lora_a'.*secret")


@pytest.mark.parametrize("planted,phrase", [({"a_key": "00" * 32}, r"entry named 'a_key'"),
                                            ({"replayable": True}, r"replayable")])
def test_secret_in_the_spec_release_metadata(env, planted, phrase):
    spec = spec_release(env.fresh(), 18)
    record = json.loads((spec / "metadata.json").read_text())
    record["extra"]["info"].update(planted)
    (spec / "metadata.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    rehash(spec)  # integrity passes: the secret check itself must refuse it
    env.refused(lambda: env.post(bundle(spec, name="spec-secret")), 422,
                rf"spec release is refused: .*{phrase}")


# ---------------------------------------------------------------------------- accounts


def test_missing_and_wrong_tokens(env):
    body = bundle(spec_release(env.fresh(), 19), name="anon")
    env.refused(lambda: env.post(body, token=None), 401, r"needs a developer token")
    env.refused(lambda: env.post(body, token="pvj_not-a-token"), 401, r"token is not valid")
    env.refused(lambda: env.post(body, None, {"Authorization": f"Basic {env.alice}"}), 401,
                r"token is not valid")
    env.refused(lambda: env.client.delete(f"{URL}/{env.first_id}"), 401,
                r"needs a developer token")


def test_withdraw_someone_elses_learnware(env):
    env.refused(lambda: env.client.delete(f"{URL}/{env.first_id}",
                                          headers={"Authorization": f"Bearer {env.bob}"}),
                403, r"belongs to another account; only the account that submitted it")


def test_withdraw_a_missing_id(env):
    env.refused(lambda: env.client.delete(f"{URL}/99999",
                                          headers={"Authorization": f"Bearer {env.alice}"}),
                404, r"no learnware with id 99999")


def test_duplicate_name(env):
    body = bundle(spec_release(env.fresh(), 20), name="first")
    env.refused(lambda: env.post(body, token="bob"), 409, r"named 'first' is already in the dock")


# ---------------------------------------------------------------------------- killed mid-submit


def post_tar(url: str, body: bytes, token: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + URL, data=body, method="POST", headers={
        "Content-Type": "application/x-tar", "Content-Length": str(len(body)),
        "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the test thread
        return e


def test_server_killed_mid_submit_leaves_no_partial_entry(tmp_path):
    path = tmp_path / "dock"
    with Dock.create(path) as d:
        token = d.add_account("alice")
        d.submit(dp_spec(0), name="kept", submitter="alice")
    before = state(path)
    body = bundle(spec_release(tmp_path / "s", 1), model_release(tmp_path / "m", 1),
                  name="interrupted")
    port = free_port()
    code = ("import time; from pavejax.pave import dock as d; "
            "d._HOOKS['after_tensors'] = lambda: time.sleep(60); from pavejax.cli import main; "
            f"main(['dock', 'serve', {str(path)!r}, '--host', '127.0.0.1', '--port', '{port}'])")
    proc = subprocess.Popen([sys.executable, "-c", code], env=cli_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    outcome: list = []
    try:
        wait_ready(url, proc)
        client = threading.Thread(target=lambda: outcome.append(_try(post_tar, url, body, token)),
                                  daemon=True)
        client.start()
        deadline = time.time() + 30
        while not list((path / "tensors").glob(".tmp-*")):
            assert time.time() < deadline, "the submit never reached its tensor writes"
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        client.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert outcome and isinstance(outcome[0], OSError)  # the client saw the connection die
    assert list((path / "tensors").glob(".tmp-*"))  # the orphan is there until the next open
    with Dock.open(path) as d:  # collects it
        assert (d.generation, len(d), [e.name for e in d.list()]) == before[:3]
    assert state(path) == before
    # the killed server's staged upload is left next to the dock; a restart removes staging
    # dirs once they are an hour old (younger ones may belong to another live server)
    staged = list((path / "staging").glob("upload-*"))
    assert len(staged) == 1
    os.utime(staged[0], (time.time() - 7200, time.time() - 7200))
    with serve(path) as (url, _):
        assert not staged[0].exists()
        with urllib.request.urlopen(url + URL, timeout=30) as resp:
            assert [e["name"] for e in json.loads(resp.read())["learnwares"]] == ["kept"]
        status, out = post_tar(url, body, token)
        assert status == 201, out
    assert state(path)[:3] == (before[0] + 1, 2, ["kept", "interrupted"])
