"""benchmarks/dock_service.py: specs of a real MiniLM DP-S-PAVE spec's size with a certified
guarantee, and the summary keys of a tiny run (both backends; the PostgreSQL keys null with a
reason when no server can be started)."""

import math

import pytest

from tests._bench import benchmark_module

KEYS = ("errors", "lost", "duplicated", "search_p50_ms", "search_p95_ms", "submit_p95_ms")


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("dock_service") as module:
        yield module


def test_specs_have_the_minilm_size_and_a_dp_guarantee(bench):
    assert bench.DIM == 2 * 2 * 8 * 384 == 12288
    assert bench.SIGNATURE.layers == tuple(sorted(bench.SIGNATURE.layers))
    info = bench.dp_info()
    g = info["guarantee"]
    assert g["kind"] == "dp" and g["relation"] == "replace_one"
    assert math.isfinite(g["epsilon"]) and 3 < g["epsilon"] < 5
    spec, query = (f(3) for f in bench.make_specs(info))
    assert spec.vector.shape == query.vector.shape == (12288,)
    assert (spec.kind, query.kind) == ("model", "user")


def _check(summary, rows, pg_ran):
    assert {*KEYS, *(f"pg_{k}" for k in KEYS)} <= set(summary)
    assert [r["backend"] for r in rows] == ["sqlite", "postgresql"]
    assert (summary["errors"], summary["lost"], summary["duplicated"]) == (0, 0, 0)
    assert summary["search_p95_ms"] >= summary["search_p50_ms"] > 0
    assert summary["pg_servers"] == 2
    if pg_ran:
        assert summary["pg_skipped"] is None
        assert (summary["pg_errors"], summary["pg_lost"], summary["pg_duplicated"]) == (0, 0, 0)
        assert rows[1]["listed"] == 2 + 3
    else:
        assert isinstance(summary["pg_skipped"], str)
        assert all(summary[f"pg_{k}"] is None for k in KEYS)


def test_tiny_run_reports_every_key(bench):
    s = bench.Settings(clients=2, searches=6, submits=3, seeded=2)
    _, rows, summary = bench.run(s)
    _check(summary, rows, bench.postgres_starter()[0] is not None)
    assert rows[0]["listed"] == 2 + 3


def test_without_postgres_the_pg_keys_are_null(bench, monkeypatch):
    monkeypatch.setattr(bench, "postgres_starter", lambda: (None, "no PostgreSQL here"))
    _, rows, summary = bench.run(bench.Settings(clients=2, searches=4, submits=2, seeded=1))
    assert summary["pg_skipped"] == "no PostgreSQL here" == rows[1]["skipped"]
    _check(summary, rows, pg_ran=False)
