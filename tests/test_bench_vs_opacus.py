"""The pavejax-vs-Opacus benchmark's plumbing, without torch: summary arithmetic, the worker
protocol, peak-memory probes and the message shown when the peer frameworks are missing."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def vs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("vs_opacus")


@pytest.fixture
def protocol(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("_worker_protocol")


def _chunks(times, peaks):
    return [{"times": t, "peak_rss_mib": p, "rss_before_mib": 100.0, "peak_is_chunk": True,
             "load_avg_1m": 2.0 + len(t)} for t, p in zip(times, peaks)]


def _results():
    first = {"losses": [0.5, 0.25], "norms": [2.0, 4.0]}
    return {"full": {
        "setup": {"pavejax": {"trainable_params": 7, "compile_dp_s": 3.0, "compile_nondp_s": 1.0,
                              "xla_memory": {"dp": {"temp_bytes": 3 * 2**20,
                                                     "argument_bytes": 2**19},
                                              "nondp": None}},
                  "opacus": {"trainable_params": 7}},
        "first": {"pavejax": first,
                  "opacus": {"losses": [0.5, 0.2], "norms": [2.0, 5.0]}},
        "chunks": {
            "pavejax/dp": _chunks([[1.0, 3.0], [2.0]], [500.0, 700.0]),
            "pavejax/nondp": _chunks([[1.0], [1.0], [4.0]], [400.0, 300.0, 350.0]),
            "opacus/dp": _chunks([[5.0, 9.0], [6.0, 7.0]], [1000.0, 1400.0]),
            "opacus/nondp": _chunks([[2.0], [3.0]], [900.0, 800.0]),
        },
    }}


def test_summary_ratios_are_medians_and_peaks(vs):
    rows, summary = vs.summarize(_results())
    # Medians by hand: pavejax dp {1,2,3} -> 2; opacus dp {5,6,7,9} -> 6.5;
    # pavejax nondp {1,1,4} -> 1; opacus nondp {2,3} -> 2.5.
    assert summary["full_dp_speedup"] == pytest.approx(6.5 / 2.0)
    assert summary["full_nondp_speedup"] == pytest.approx(2.5 / 1.0)
    assert summary["full_dp_mem_ratio"] == pytest.approx(700.0 / 1400.0)
    assert summary["full_nondp_mem_ratio"] == pytest.approx(400.0 / 900.0)
    assert summary["full_pavejax_dp_overhead"] == pytest.approx(2.0 / 1.0)
    assert summary["full_opacus_dp_overhead"] == pytest.approx(6.5 / 2.5)
    # Parity: |0.25-0.2|/0.2 = 0.25 and |4-5|/5 = 0.2.
    assert summary["full_parity_loss_rel"] == pytest.approx(0.25)
    assert summary["full_parity_norm_rel"] == pytest.approx(0.2)
    assert len(rows) == 4
    by = {(r["framework"], r["mode"]): r for r in rows}
    assert by["pavejax", "dp"]["timed_steps"] == 3
    assert by["opacus", "dp"]["median_step_s"] == pytest.approx(6.5)
    assert (by["opacus", "dp"]["min_step_s"], by["opacus", "dp"]["max_step_s"]) == (5.0, 9.0)
    # Loads: 2 + chunk length -> {4, 3, 3, 3, 3, 4, 4, 3, 3}; median 3, max 4.
    assert summary["load_avg_1m_median"] == 3.0 and summary["load_avg_1m_max"] == 4.0
    assert by["pavejax", "dp"]["xla_temp_mib"] == pytest.approx(3.0)
    assert by["pavejax", "dp"]["xla_args_mib"] == pytest.approx(0.5)
    assert by["pavejax", "nondp"]["xla_temp_mib"] == ""
    assert by["pavejax", "dp"]["compile_s"] == 3.0 and by["opacus", "dp"]["compile_s"] == 0.0
    assert summary["peak_rss_is_per_chunk"] is True


def test_summary_flags_whole_process_peaks(vs):
    results = _results()
    results["full"]["chunks"]["opacus/dp"][1]["peak_is_chunk"] = False
    assert vs.summarize(results)[1]["peak_rss_is_per_chunk"] is False


def test_max_relative_diff(vs):
    assert vs.max_relative_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert vs.max_relative_diff([0.0], [0.0]) == 0.0
    with pytest.raises(ValueError, match="equal length"):
        vs.max_relative_diff([1.0], [1.0, 2.0])


def test_config_validates(vs):
    assert vs.Config.quick().timed_steps < vs.Config().timed_steps
    assert vs.Config().timed_steps >= 10
    with pytest.raises(ValueError, match="must divide batch_size"):
        vs.Config(microbatch_full=5)
    with pytest.raises(ValueError, match="parity check"):
        vs.Config(warmup_dp=0)


def test_missing_peers_names_the_install_command(vs, monkeypatch):
    monkeypatch.setattr(vs.importlib.util, "find_spec", lambda name: None)
    assert vs.missing_peers() == ["torch", "opacus"]
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[peers\]"'):
        vs.require_peers()
    with pytest.raises(SystemExit, match="torch and opacus"):
        vs.main(["--quick"])


def test_worker_protocol_round_trip(vs, tmp_path):
    script = tmp_path / "echo_worker.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        import _worker_protocol as protocol

        def echo(req):
            print("library chatter on stdout")  # must not corrupt the protocol
            return {{"twice": 2 * req["x"]}}

        def fail(req):
            raise ValueError("bad request, change x")

        def steps(req):
            return protocol.timed_chunk(lambda i: None, 0, req["n"])

        protocol.serve({{"echo": echo, "fail": fail, "steps": steps}})
    """))
    w = vs.WorkerProcess("echo", script, tmp_path / "echo.log")
    try:
        assert w.call("echo", x=21)["twice"] == 42
        with pytest.raises(RuntimeError, match="bad request, change x"):
            w.call("fail")
        with pytest.raises(RuntimeError, match="unknown command"):
            w.call("nope")
        out = w.call("steps", n=3)
        assert len(out["times"]) == 3 and all(t >= 0 for t in out["times"])
        assert out["peak_rss_mib"] > 0
    finally:
        w.close()
    assert w.proc.returncode == 0
    assert "library chatter" in (tmp_path / "echo.log").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_rss_sees_a_large_allocation(protocol):
    protocol.trim_heap()
    resettable = protocol.reset_peak_rss()
    before = protocol.peak_rss_mib()
    block = np.ones(40 * 2**20 // 8 * 4)  # 160 MiB, touched
    assert protocol.peak_rss_mib() >= before + 120
    del block
    if resettable:
        protocol.trim_heap()
        protocol.reset_peak_rss()
        assert protocol.peak_rss_mib() < before + 120
