"""The HTTP dock: client and server agree with a local dock (search, listing, downloads), the
snapshot is versioned and incremental, the page renders in a real browser, and both index
backends (SQLite, PostgreSQL) hold the same schema and migrate old docks."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import re
import shutil
import sqlite3
import urllib.request

import jax
import numpy as np
import pytest
from starlette.testclient import TestClient

from pavejax.pave import _index_db as idb
from pavejax.pave._archive import pack
from pavejax.pave.dock import Dock, DockError
from pavejax.pave.remote import RemoteDock, RemoteDockError
from pavejax.release import content_hash
from pavejax.service.app import create_app
from tests._browser import artifact_dir, chromium_path, dump_dom, screenshot
from tests._dock_service import (
    SIG,
    RecordingProxy,
    dp_spec,
    leaked,
    model_release,
    serve,
    spec_release,
)
from tests._postgres import postgres_available, postgres_server
from tests._services import require_or_skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A dock served by a real server subprocess: alice holds 'a0', 'a1'; bob holds 'b0'."""
    tmp = tmp_path_factory.mktemp("served")
    with Dock.create(tmp / "dock") as d:
        tokens = {who: d.add_account(who) for who in ("alice", "bob")}
    with serve(tmp / "dock") as (url, _):
        alice, bob = Dock.remote(url, tokens["alice"]), Dock.remote(url, tokens["bob"])
        alice.submit(spec_release(tmp / "s0", 0), name="a0",
                     model=model_release(tmp / "m0", 0), metadata={"team": "x"})
        alice.submit(dp_spec(1, sigma=3.0), name="a1")
        bob.submit(dp_spec(2, sigma=9.0), name="b0")
        yield {"url": url, "tmp": tmp, "dock": tmp / "dock", "tokens": tokens}


def _local(served):
    return Dock.open(served["dock"], collect_garbage=False)


def test_remote_search_ranks_exactly_as_the_local_dock(served):
    remote = Dock.remote(served["url"])
    queries = [dp_spec(s, kind="user") for s in (0, 1, 2, 7)]
    with _local(served) as local:
        for score in ("cosine", "debiased", "posterior"):
            got, want = remote.search(queries, k=3, score=score), local.search(queries, k=3,
                                                                                score=score)
            for g, w in zip(got, want, strict=True):
                assert g.ids == w.ids and g.names == w.names
                np.testing.assert_allclose(g.cosines, w.cosines, rtol=1e-6, atol=1e-7)
        # the query matching 'a0' exactly ranks it first with cosine 1
        top = remote.search(dp_spec(0, kind="user"), k=1)
        assert top.names == ("a0",) and top.cosines[0] == pytest.approx(1.0, abs=1e-6)
        assert [e.name for e in remote.list()] == [e.name for e in local.list()]
        assert len(remote) == len(local) == 3


def test_search_sends_nothing_of_the_query_and_the_recording_catches_a_leaky_client(served):
    """The recording check of the end-to-end test, with a deliberately broken client: one that
    ranks on the server (it sends the query) is flagged; the real client is not."""
    proxy = RecordingProxy(int(served["url"].rsplit(":", 1)[1]))
    try:
        query = dp_spec(11, kind="user")
        plain = np.array(query.vector)  # a non-private user spec's vector
        Dock.remote(proxy.url).search(query, k=2, score="debiased")
        honest = b"".join(proxy.requests_since(0))
        assert honest and leaked(honest, plain) == []
        assert all(r.startswith(b"GET /api/v1/snapshot") for r in proxy.requests_since(0))

        class LeakyRemote(RemoteDock):  # server-side search: what a Beimingwu-style client does
            def search(self, user_spec, k=5, **kw):
                body = json.dumps({"vector": [float(x) for x in user_spec.vector], "k": k})
                with contextlib.suppress(RemoteDockError):
                    self._json("POST", "/api/v1/search", data=body.encode(),
                               headers={"Content-Type": "application/json"})
                return super().search(user_spec, k, **kw)

        start = len(proxy.sent)
        LeakyRemote(proxy.url).search(query, k=2)
        assert leaked(b"".join(proxy.requests_since(start)), plain)
        # and one that sends the raw float32 bytes, base64-encoded, in a query string
        start = len(proxy.sent)
        b64 = base64.urlsafe_b64encode(plain.astype("<f4").tobytes()).decode()
        with contextlib.suppress(RemoteDockError):
            RemoteDock(proxy.url)._json("GET", "/api/v1/snapshot?q=" + b64.replace("-", "+")
                                        .replace("_", "/"))
        assert leaked(b"".join(proxy.requests_since(start)), plain)
    finally:
        proxy.close()


def test_listing_publishes_the_guarantees_submitters_and_hashes(served):
    remote = Dock.remote(served["url"])
    by_name = {e.name: e for e in remote.list()}
    assert by_name["a0"].submitter == "alice" and by_name["b0"].submitter == "bob"
    assert by_name["a0"].has_model and not by_name["a1"].has_model
    assert by_name["a0"].metadata["classes"] == ["negative", "positive"]
    assert by_name["a0"].metadata["team"] == "x"
    for name, sigma in (("a1", 3.0), ("b0", 9.0)):
        g = by_name[name].spec_info["guarantee"]
        assert g["epsilon"] == pytest.approx(dp_spec(0, sigma=sigma).info["guarantee"]["epsilon"])
    # the archives served are the submitted releases, byte for byte
    assert by_name["a0"].files["spec"]["content_hash"] == content_hash(served["tmp"] / "s0")
    assert by_name["a0"].files["model"]["content_hash"] == content_hash(served["tmp"] / "m0")
    info = remote.info()
    assert info["certified_dp_only"] and info["signature"] == SIG.to_dict()
    with _local(served) as local:  # the published A key is the dock's
        np.testing.assert_array_equal(jax.random.key_data(remote.a_key()),
                                      jax.random.key_data(local.a_key()))


def test_downloads_are_verified_and_equal_the_submitted_releases(served, tmp_path):
    remote = Dock.remote(served["url"])
    out = remote.download("a0", "model", tmp_path / "m")
    assert content_hash(out) == content_hash(served["tmp"] / "m0")
    params = remote.load_model("a0")
    with _local(served) as local:
        np.testing.assert_array_equal(params["head"]["kernel"],
                                      local.load_model("a0")["head"]["kernel"])
        np.testing.assert_array_equal(remote.load_spec("b0").vector, local.load_spec("b0").vector)
        # local download of the same archive, and a spec submitted as an object
        assert content_hash(local.download("a0", "spec", tmp_path / "ls")) == \
            content_hash(served["tmp"] / "s0")
    with pytest.raises(KeyError, match="no model release"):
        remote.download("a1", "model", tmp_path / "none")
    with pytest.raises(FileExistsError):
        remote.download("a0", "model", tmp_path / "m")


def test_download_of_a_damaged_archive_is_refused(tmp_path):
    with Dock.create(tmp_path / "dock") as d:
        token = d.add_account("alice")
    with serve(tmp_path / "dock") as (url, _):
        remote = Dock.remote(url, token)
        i = remote.submit(spec_release(tmp_path / "s", 5), name="s")
        archive = tmp_path / "dock" / "tensors" / str(i) / "files" / "spec.tar"
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF  # bit rot on the server's disk
        archive.write_bytes(bytes(data))
        with pytest.raises(RemoteDockError, match="arrived damaged"):
            remote.download(i, "spec", tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_snapshot_is_versioned_incremental_and_cached_by_etag(tmp_path):
    with Dock.create(tmp_path / "dock") as d:
        token = d.add_account("alice")
    client = TestClient(create_app(tmp_path / "dock"))
    auth = {"Authorization": f"Bearer {token}"}

    def submit(seed, name):
        release = spec_release(tmp_path / f"s{seed}", seed)
        buf = io.BytesIO()
        pack(buf, [("spec", release)], [("submission.json", json.dumps({"name": name}).encode())])
        body = buf.getvalue()
        r = client.post("/api/v1/learnwares", content=body, headers=auth |
                        {"Content-Type": "application/x-tar"})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    empty = client.get("/api/v1/snapshot").json()
    assert empty["learnwares"] == [] and empty["full"]
    ids = [submit(s, f"n{s}") for s in range(3)]
    full = client.get("/api/v1/snapshot")
    snap, etag = full.json(), full.headers["etag"]
    assert [e["id"] for e in snap["learnwares"]] == ids and snap["version"] == 3
    assert client.get("/api/v1/snapshot", headers={"If-None-Match": etag}).status_code == 304
    v = snap["version"]
    # an up-to-date client asking for changes since its version gets 304 too
    assert client.get(f"/api/v1/snapshot?since={v}",
                      headers={"If-None-Match": etag}).status_code == 304
    r = client.delete(f"/api/v1/learnwares/{ids[0]}", headers=auth)
    assert r.status_code == 200, r.text
    new = submit(9, "n9")
    inc = client.get(f"/api/v1/snapshot?since={v}").json()
    assert inc["removed"] == [ids[0]] and [e["id"] for e in inc["learnwares"]] == [new]
    assert not inc["full"] and inc["version"] == v + 2
    assert client.get(f"/api/v1/snapshot?since={v + 99}").status_code == 400
    assert client.get("/api/v1/snapshot?since=-1").status_code == 400
    # a client applying the increments holds what a fresh full download holds
    with Dock.open(tmp_path / "dock") as d:
        assert sorted(e.id for e in d.list()) == [ids[1], ids[2], new]


def test_remote_client_syncs_only_what_changed(served):
    remote = Dock.remote(served["url"])
    v = remote.sync()
    calls = []
    real_open = remote._open

    def spy(method, path, **kw):
        ctx = real_open(method, path, **kw)
        calls.append(path)
        return ctx

    remote._open = spy
    table = remote._table.vectors
    assert remote.sync() == v and remote.sync() == v
    assert calls == [f"/api/v1/snapshot?since={v}"] * 2
    assert remote._table.vectors is table  # 304: the table was not rebuilt
    assert remote._table.names == ["a0", "a1", "b0"]


def test_serving_refuses_a_dock_with_uncertified_specs(tmp_path):
    with Dock.create(tmp_path / "dock") as d:
        d.submit(dp_spec(0), name="dp")
        spec = dp_spec(1)
        d.submit(type(spec)(spec.vector, spec.signature, "model",
                            {"mechanism": "none", "guarantee": {"kind": "none"}}), name="plain")
    with pytest.raises(DockError, match="certified DP.*'plain'"):
        create_app(tmp_path / "dock")


def test_token_cli_and_accounts(tmp_path, capsys):
    from tests.test_cli import cli

    with Dock.create(tmp_path / "dock"):
        pass
    rc, out, err = cli("dock", "token", tmp_path / "dock", "--account", "carol")
    assert rc == 0 and out.strip().startswith("pvj_") and "shown once" in err
    token = out.strip().splitlines()[0]
    with Dock.open(tmp_path / "dock") as d:
        assert d.account_for_token(token) == "carol"
        assert d.account_for_token(token + "x") is None
        assert token not in (tmp_path / "dock" / "index.sqlite").read_bytes().decode("latin-1")
    rc, _, err = cli("dock", "token", tmp_path / "dock", "--account", "carol")
    assert rc != 0 and "already exists" in err
    rc, _, err = cli("dock", "token", tmp_path / "dock", "--account", "bad name!")
    assert rc != 0 and "account names" in err
    assert cli("dock", "token", tmp_path / "dock", "--account", "carol", "--revoke")[0] == 0
    with Dock.open(tmp_path / "dock") as d:
        assert d.account_for_token(token) is None and d.accounts() == []
    rc, _, err = cli("dock", "token", "http://127.0.0.1:9", "--account", "x")
    assert rc != 0


def test_client_checks_token_and_size_before_uploading(tmp_path):
    with Dock.create(tmp_path / "dock") as d:
        token = d.add_account("alice")
    with serve(tmp_path / "dock", "--max-upload-mb", "0.01") as (url, _):
        assert Dock.remote(url, token).account() == "alice"
        calls = []
        wrong = Dock.remote(url, "pvj_wrong")
        real_open = wrong._open
        wrong._open = lambda method, path, **kw: calls.append(method) or real_open(method, path,
                                                                                  **kw)
        with pytest.raises(RemoteDockError, match="not valid for this dock") as e:
            wrong.submit(dp_spec(0), name="x")
        assert e.value.status == 401 and "POST" not in calls
        big = dp_spec(0, sig=dataclasses.replace(SIG, layer_sizes=(4000, 4000)))
        with pytest.raises(RemoteDockError, match="over the dock's upload limit") as e:
            Dock.remote(url, token).submit(big, name="big")
        assert e.value.status == 413
        assert Dock.remote(url).info()["max_upload_bytes"] == int(0.01 * (1 << 20))
    with Dock.open(tmp_path / "dock") as d:
        assert len(d) == 0


def test_remote_refusals_before_any_request():
    with pytest.raises(ValueError, match="http://"):
        RemoteDock("ftp://example")
    r = RemoteDock("http://127.0.0.1:9")
    with pytest.raises(PermissionError, match="developer token"):
        r._json("DELETE", "/api/v1/learnwares/1", auth=True)
    with pytest.raises(TypeError, match="as a release"):
        r.submit(dp_spec(0), name="x", model={"w": np.zeros(2)})
    with pytest.raises(ValueError, match="k must be"):
        r.search(dp_spec(0, kind="user"), k=0)


# ------------------------------------------------------------------ the page in a browser


def test_page_renders_in_headless_chromium(served):
    if chromium_path() is None:
        require_or_skip("headless Chromium (Debian package chromium) is not installed")
    url = served["url"]
    dom = dump_dom(url + "/")
    with _local(served) as local:
        entries = local.list()
    rows = re.findall(r'<tr data-id="(\d+)"', dom)
    assert [int(r) for r in rows] == [e.id for e in entries]
    for e in entries:
        assert e.name in dom
        eps = e.spec_info["guarantee"]["epsilon"]
        cell = re.search(rf'<tr data-id="{e.id}".*?<td class="eps"[^>]*>([^<]*)</td>', dom,
                         re.S)
        assert cell is not None and cell.group(1).strip() == f"{eps:.3g}"
    bars = re.findall(r'<rect[^>]*class="bar"[^>]*data-id="(\d+)"', dom) or \
        re.findall(r'<rect[^>]*data-id="(\d+)"[^>]*class="bar"', dom)
    assert sorted(int(b) for b in bars) == sorted(e.id for e in entries)
    detail = dump_dom(f"{url}/learnwares/{entries[0].id}")
    assert entries[0].name in detail and "sha256" in detail.lower()
    shot = screenshot(url + "/", artifact_dir() / "dock_page.png")
    assert shot.stat().st_size > 1000


# ------------------------------------------------------------------ storage backends


def _v1_sqlite_dock(path):
    """A dock as version 1 of the library wrote it (index schema of migration 1 only)."""
    path.mkdir()
    (path / "tensors").mkdir()
    (path / "secret").mkdir()
    (path / "secret" / "a_key").write_text("ab" * 32)
    conn = sqlite3.connect(path / "index.sqlite")
    for s in idb.migration_statements("sqlite", 1):
        conn.execute(s)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("format", "pavejax-dock"),
                                                        ("version", "1"), ("generation", "0")])
    conn.commit()
    conn.close()


def test_a_version_1_dock_is_migrated_on_open(tmp_path):
    _v1_sqlite_dock(tmp_path / "old")
    with Dock.open(tmp_path / "old") as d:
        i = d.submit(dp_spec(0), name="x", submitter="alice")
        assert d.list()[0].submitter == "alice" and d.list()[0].version == 1
        assert d.add_account("bob").startswith("pvj_")
        d.remove(i)
        assert d.snapshot(0)["removed"] == [i]
    conn = sqlite3.connect(tmp_path / "old" / "index.sqlite")
    assert dict(conn.execute("SELECT key, value FROM meta").fetchall())["version"] == \
        str(idb.SCHEMA_VERSION)
    conn.close()


def test_a_newer_dock_is_refused(tmp_path):
    with Dock.create(tmp_path / "d"):
        pass
    conn = sqlite3.connect(tmp_path / "d" / "index.sqlite")
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'version'")
    conn.commit()
    conn.close()
    with pytest.raises(DockError, match="newer than this library"):
        Dock.open(tmp_path / "d")


@pytest.fixture(scope="module")
def pg():
    reason = postgres_available()
    if reason:
        require_or_skip(reason)
    with postgres_server() as server:
        yield server


def test_postgres_dock_matches_sqlite(pg, tmp_path):
    url = pg.create_database("dock_match")
    specs = [dp_spec(s) for s in range(6)]
    with Dock.create(tmp_path / "pg", database=url) as p, Dock.create(tmp_path / "lite") as s:
        assert p.backend == "postgresql" and s.backend == "sqlite"
        assert not (tmp_path / "pg" / "index.sqlite").exists()
        assert json.loads((tmp_path / "pg" / "index.json").read_text())["database"] == url
        for d in (p, s):
            for j, spec in enumerate(specs):
                d.submit(spec, name=f"n{j}", submitter="alice" if j % 2 else None)
            d.remove("n2")
        q = [dp_spec(9, kind="user"), dp_spec(3, kind="user")]
        for a, b in zip(p.search(q, k=4), s.search(q, k=4), strict=True):
            assert a.ids == b.ids
            np.testing.assert_allclose(a.cosines, b.cosines, rtol=1e-6)
        assert [(e.id, e.name, e.submitter, e.version) for e in p.list()] == \
            [(e.id, e.name, e.submitter, e.version) for e in s.list()]
        assert p.snapshot(3)["removed"] == s.snapshot(3)["removed"] == [3]
        with pytest.raises(PermissionError):
            p.remove("n1", submitter="bob")
    # a second handle (another process would do the same) sees the same dock
    with Dock.open(tmp_path / "pg") as again:
        assert [e.name for e in again.list()] == ["n0", "n1", "n3", "n4", "n5"]


def test_postgres_dock_refusals(pg, tmp_path):
    url = pg.create_database("dock_refusals")
    with Dock.create(tmp_path / "a", database=url):
        pass
    with pytest.raises(DockError, match="already holds a dock index"):
        Dock.create(tmp_path / "b", database=url)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    with pytest.raises(ValueError, match="PGPASSWORD"):
        Dock.create(tmp_path / "c", database=url.replace("postgres@", "postgres:pw@"))
    # a dock folder pointed at another dock's database is refused
    other = pg.create_database("dock_other")
    with Dock.create(tmp_path / "o", database=other):
        pass
    shutil.copy(tmp_path / "o" / "index.json", tmp_path / "a" / "index.json")
    (tmp_path / "a" / "index.json").write_text(
        (tmp_path / "o" / "index.json").read_text().replace('"dock_uid": "',
                                                            '"dock_uid": "0'))
    with pytest.raises(DockError, match="another dock's index"):
        Dock.open(tmp_path / "a")
    with pytest.raises(ConnectionError, match="cannot connect"):
        Dock.create(tmp_path / "x", database=f"postgresql://postgres@127.0.0.1:9/{'nope'}")


def test_two_servers_on_one_postgres_dock_agree(pg, tmp_path):
    url = pg.create_database("dock_two")
    with Dock.create(tmp_path / "dock", database=url) as d:
        token = d.add_account("alice")
    with serve(tmp_path / "dock") as (u1, _), serve(tmp_path / "dock") as (u2, _):
        one, two = Dock.remote(u1, token), Dock.remote(u2, token)
        a = one.submit(dp_spec(0), name="via-one")
        b = two.submit(dp_spec(1), name="via-two")
        with pytest.raises(RemoteDockError, match="already in the dock") as e:
            two.submit(dp_spec(2), name="via-one")
        assert e.value.status == 409
        for client in (one, two):
            assert [(x.id, x.name) for x in client.list()] == [(a, "via-one"), (b, "via-two")]
            assert client.search(dp_spec(1, kind="user"), k=1).names == ("via-two",)
        two.remove("via-one")  # withdrawn through the other server
        assert [x.name for x in one.list()] == ["via-two"]
        assert one.search(dp_spec(0, kind="user"), k=5).names == ("via-two",)
        snaps = [json.loads(urllib.request.urlopen(u + "/api/v1/snapshot").read())
                 for u in (u1, u2)]
        assert snaps[0]["version"] == snaps[1]["version"] == 3
        assert [e["id"] for e in snaps[0]["learnwares"]] == [e["id"] for e in
                                                            snaps[1]["learnwares"]] == [b]


def test_spec_release_of_a_stored_object_spec(tmp_path):
    with Dock.create(tmp_path / "d") as d:
        d.submit(dp_spec(4), name="obj")
        out = d.download("obj", "spec", tmp_path / "rel")
    from pavejax.release import load_spec

    np.testing.assert_array_equal(load_spec(out).vector, dp_spec(4).vector)
    assert load_spec(out).info["guarantee"] == dp_spec(4).info["guarantee"]


# ------------------------------------------------------------------ tensors elsewhere


@pytest.mark.parametrize("as_url", [False, True], ids=["mounted-folder", "epath-branch"])
def test_tensors_under_another_root(tmp_path, monkeypatch, as_url):
    """The tensor dirs and archives under a root outside the dock folder. ``epath-branch``
    treats the (local) root as an object store would be treated (no fsync, renames and copies
    through etils.epath, downloads streamed), which is the code path of a gs:// root."""
    from pavejax.pave import _dock_io, dock as dock_mod
    from pavejax.service import app as app_mod

    if as_url:
        for mod in (dock_mod, _dock_io, app_mod):
            monkeypatch.setattr(mod, "is_local", lambda root: False)
    root = tmp_path / "object-store" / "market"
    with Dock.create(tmp_path / "dock", tensors=str(root)) as d:
        token = d.add_account("alice")
        i = d.submit(dp_spec(0), name="kept")
        (root / ".tmp-orphan").mkdir()  # a killed submit's leftovers
    assert not any((tmp_path / "dock" / "tensors").iterdir())
    with Dock.open(tmp_path / "dock") as d:
        assert not (root / ".tmp-orphan").exists()  # collected under the write lock
        assert d.search(dp_spec(0, kind="user"), k=1).names == ("kept",)
    client = TestClient(create_app(tmp_path / "dock"))
    body = io.BytesIO()
    pack(body, [("spec", spec_release(tmp_path / "s", 1)),
                ("model", model_release(tmp_path / "m", 1))],
         [("submission.json", json.dumps({"name": "up"}).encode())])
    r = client.post("/api/v1/learnwares", content=body.getvalue(),
                    headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 201, r.text
    j = r.json()["id"]
    assert (root / str(j) / "files" / "model.tar").is_file()
    got = client.get(f"/api/v1/learnwares/{j}/model")
    assert got.status_code == 200
    assert hashlib.sha256(got.content).hexdigest() == got.headers["x-content-sha256"]
    with Dock.open(tmp_path / "dock") as d:
        out = d.download(j, "model", tmp_path / "dl")
        assert content_hash(out) == content_hash(tmp_path / "m")
        d.remove(i)
        assert not (root / str(i)).exists() and [e.name for e in d.list()] == ["up"]
    with pytest.raises(DockError, match="not empty"):
        Dock.create(tmp_path / "dock2", tensors=str(root))
