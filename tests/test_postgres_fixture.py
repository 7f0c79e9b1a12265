"""tests/_postgres.py: a real PostgreSQL server starts on a loopback port, keeps what one
connection writes for the next, and is gone (port closed, directory removed) after its block."""

import socket

import pytest

from tests._postgres import postgres_available, postgres_server, require_or_skip


@pytest.fixture(scope="module")
def psycopg():
    reason = postgres_available()
    if reason:
        require_or_skip(reason)
    import psycopg

    return psycopg


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_server_round_trip_and_teardown(psycopg):
    with postgres_server() as pg:
        assert pg.url() == f"postgresql://postgres@127.0.0.1:{pg.port}/postgres"
        url = pg.create_database("dock test")
        assert url == pg.url("dock test")
        with psycopg.connect(url) as conn:
            conn.execute("CREATE TABLE runs (id serial PRIMARY KEY, name text NOT NULL)")
            conn.execute("INSERT INTO runs (name) VALUES (%s)", ("ménage",))
        with psycopg.connect(url) as other:
            rows = other.execute("SELECT id, name FROM runs").fetchall()
            encoding = other.execute("SHOW server_encoding").fetchone()[0]
        assert rows == [(1, "ménage")]
        assert encoding == "UTF8"
        assert _port_open(pg.port)
        datadir = pg.datadir
        assert (datadir / "PG_VERSION").exists()
    assert not _port_open(pg.port)
    assert not datadir.exists() and not datadir.parent.exists()


def test_server_stops_when_the_block_raises(psycopg):
    with pytest.raises(KeyError), postgres_server() as pg:
        raise KeyError("boom")
    assert not _port_open(pg.port)
    assert not pg.datadir.parent.exists()


def test_require_or_skip_fails_when_services_are_required(monkeypatch):
    monkeypatch.setenv("PAVEJAX_REQUIRE_SERVICES", "1")
    with pytest.raises(pytest.fail.Exception, match="no server"):
        require_or_skip("no server")
    monkeypatch.delenv("PAVEJAX_REQUIRE_SERVICES")
    with pytest.raises(pytest.skip.Exception, match="no server"):
        require_or_skip("no server")
