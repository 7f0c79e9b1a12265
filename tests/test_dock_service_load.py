"""The dock service under bounded loopback load (:func:`pavejax.service.loadtest.run_load`):
8 clients, 200 searches and 40 submits against real ``pavejax dock serve`` subprocesses, one
server on SQLite and two servers sharing one PostgreSQL database. No request fails, no
submitted learnware is lost or duplicated, and the servers agree afterwards."""

import json
import urllib.request

import pytest

from pavejax.pave.dock import Dock
from pavejax.service.loadtest import run_load
from tests._dock_service import SIG, dp_spec, serve
from tests._postgres import postgres_available, postgres_server, require_or_skip

CLIENTS, SEARCHES, SUBMITS, SEEDED = 8, 200, 40, 5


def _make_spec(j: int):
    return dp_spec(1000 + j)


def _make_query(j: int):
    return dp_spec(50_000 + j, kind="user")


def _prepare(dock: Dock) -> list[str]:
    """Accounts (one token per client) and a few seeded learnwares."""
    tokens = [dock.add_account(f"dev{i}") for i in range(CLIENTS)]
    for i in range(SEEDED):
        dock.submit(dp_spec(i), name=f"seed-{i}")
    return tokens


def _load(urls: list[str], tokens: list[str]) -> dict:
    r = run_load(urls, tokens, clients=CLIENTS, searches=SEARCHES, submits=SUBMITS,
                 make_spec=_make_spec, make_query=_make_query, seed=0)
    print(f"\n{len(urls)} server(s): search p50 {r['search_p50_ms']} ms, p95 "
          f"{r['search_p95_ms']} ms; submit p50 {r['submit_p50_ms']} ms, p95 "
          f"{r['submit_p95_ms']} ms; wall {r['wall_s']} s")
    assert r["errors"] == 0, r["error_messages"]
    assert (r["lost"], r["duplicated"], r["mismatched"]) == (0, 0, 0)
    assert (r["searches_done"], r["submits_done"]) == (SEARCHES, SUBMITS)
    assert r["listed"] == [SEEDED + SUBMITS] * len(urls)
    return r


def _check_final(dock: Dock, r: dict) -> None:
    entries = dock.list()
    expected = {f"load-{j:03d}" for j in range(SUBMITS)} | {f"seed-{i}" for i in range(SEEDED)}
    assert sorted(e.name for e in entries) == sorted(expected)
    assert len({e.id for e in entries}) == len(entries)
    assert {e.name: e.id for e in entries if e.name.startswith("load-")} == r["submitted"]
    assert {e.submitter for e in entries if e.name.startswith("load-")} <= \
        {f"dev{i}" for i in range(CLIENTS)}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read().decode())


def test_sqlite_one_server_under_load(tmp_path):
    path = tmp_path / "dock"
    with Dock.create(path, signature=SIG) as dock:
        tokens = _prepare(dock)
    with serve(path) as (url, _):
        r = _load([url], tokens)
    with Dock.open(path) as dock:
        _check_final(dock, r)


def test_postgres_two_servers_under_load(tmp_path):
    reason = postgres_available()
    if reason:
        require_or_skip(reason)
    path = tmp_path / "dock"
    with postgres_server() as pg:
        database = pg.create_database("loaddock")
        with Dock.create(path, signature=SIG, database=database) as dock:
            assert dock.backend == "postgresql"
            tokens = _prepare(dock)
        with serve(path) as (url_a, _), serve(path) as (url_b, _):
            r = _load([url_a, url_b], tokens)
            snaps = [_get(f"{u}/api/v1/snapshot") for u in (url_a, url_b)]
            lists = [_get(f"{u}/api/v1/learnwares")["learnwares"] for u in (url_a, url_b)]
        assert snaps[0]["version"] == snaps[1]["version"]
        ids = [{e["id"] for e in s["learnwares"]} for s in snaps]
        assert ids[0] == ids[1] and len(ids[0]) == SEEDED + SUBMITS
        assert lists[0] == lists[1]
        assert {e["id"] for e in lists[0]} == ids[0]
        with Dock.open(path) as dock:
            _check_final(dock, r)
            assert dock.generation == snaps[0]["version"]


@pytest.mark.parametrize("bad", [dict(clients=0), dict(searches=-1), dict(submits=True)])
def test_run_load_refuses_bad_settings(bad):
    kw = dict(make_spec=_make_spec, make_query=_make_query) | bad
    with pytest.raises(ValueError):
        run_load(["http://127.0.0.1:1"], ["t"], **kw)
