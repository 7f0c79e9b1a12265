"""benchmarks/report.py: discovery, --only, subprocess runs, failures reported not fatal, plots
copied next to the report; on fake benchmark scripts in a temporary folder."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._bench import BENCH, benchmark_module

# 1x1 PNG
_PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                     "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


@pytest.fixture(scope="module")
def report():
    with benchmark_module("report") as module:
        yield module


def _write(path: Path, body: str) -> None:
    path.write_text(textwrap.dedent(body))


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    _write(d / "alpha.py", f"""
        import argparse, json, sys
        from pathlib import Path
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true")
        p.add_argument("--out", type=Path)
        a = p.parse_args()
        print("alpha running, quick =", a.quick)
        rows = [{{"mode": "quick" if a.quick else "full", "ratio": 1.25}},
                {{"mode": "b|c", "ratio": 2.0, "extra": 3}}]
        elsewhere = a.out.parent.parent / "alpha_elsewhere.png"
        elsewhere.write_bytes(bytes.fromhex("{_PNG.hex()}"))
        a.out.with_suffix(".png").write_bytes(bytes.fromhex("{_PNG.hex()}"))
        a.out.write_text(json.dumps({{"benchmark": "alpha", "config": {{}}, "rows": rows,
                                      "summary": {{"speedup": 1.25, "plot": str(elsewhere)}},
                                      "env": {{"jax": "9.9", "backend": "cpu",
                                              "device_count": 1, "python": "3.x"}}}}))
        """)
    _write(d / "beta.py", """
        import sys
        print("beta starts")
        print("ValueError: beta is broken on purpose", file=sys.stderr)
        sys.exit(3)
        """)
    _write(d / "gamma.py", """
        import argparse
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true")
        p.add_argument("--out")
        p.parse_args()  # writes no JSON
        """)
    _write(d / "_helper.py", "raise SystemExit('a helper must never run')\n")
    _write(d / "report.py", "raise SystemExit('the report must not run itself')\n")
    return d


def test_discovers_real_benchmarks_without_helpers(report):
    found = report.discover(BENCH)
    assert "report" not in found and not any(n.startswith("_") for n in found)
    assert {"dp_overhead", "dock_search", "paczero"} <= set(found)
    assert all(p.parent == BENCH for p in found.values())


def test_only_selects_and_refuses_unknown_names(report, bench_dir):
    found = report.discover(bench_dir)
    assert list(found) == ["alpha", "beta", "gamma"]
    assert list(report.select(found, "gamma, alpha.py")) == ["gamma", "alpha"]
    assert report.select(found, None) == found
    with pytest.raises(SystemExit, match="unknown benchmark.*'delta'.*available: alpha, beta"):
        report.select(found, "alpha,delta")


def test_report_runs_all_reports_failures_and_copies_plots(report, bench_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = report.main(["--bench-dir", str(bench_dir), "--out-dir", str(out)])
    assert rc == 1  # beta and gamma failed; alpha still ran and is in the report
    md = (out / "report.md").read_text()
    records = {r["name"]: r for r in json.loads((out / "report.json").read_text())}
    assert records["alpha"]["status"] == "ok"
    assert records["beta"]["status"] == "failed (exit status 3)"
    assert records["gamma"]["status"].startswith("failed (no valid JSON result")
    assert "ValueError: beta is broken on purpose" in records["beta"]["log_tail"]
    # alpha ran in quick mode with the contract's flags, and its table made it to the report
    assert "| mode | ratio | extra |" in md and "| quick | 1.25 |  |" in md
    assert "| b\\|c | 2 | 3 |" in md
    assert '"speedup": 1.25' in md and "JAX 9.9, backend cpu" in md
    assert "python benchmarks/alpha.py --quick --out alpha.json" in md.replace("python3", "python")
    # the plot next to the JSON and the one written elsewhere both sit next to the report
    assert (out / "alpha.png").is_file() and (out / "alpha-alpha_elsewhere.png").is_file()
    assert "![alpha](alpha.png)" in md and "![alpha](alpha-alpha_elsewhere.png)" in md
    assert "beta is broken on purpose" in md and "logs/beta.log" in md
    assert (out / "logs" / "alpha.log").read_text().startswith("alpha running, quick = True")
    assert "failed: beta, gamma" in capsys.readouterr().out


def test_full_mode_and_only(report, bench_dir, tmp_path):
    out = tmp_path / "full"
    assert report.main(["--full", "--only", "alpha", "--bench-dir", str(bench_dir),
                        "--out-dir", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "(full mode)" in md and "| full | 1.25 |  |" in md and "## beta" not in md
    assert "--quick" not in (out / "logs" / "alpha.log").read_text()


def test_timeout_is_reported(report, bench_dir, tmp_path):
    _write(bench_dir / "slow.py", "import time\ntime.sleep(30)\n")
    out = tmp_path / "t"
    assert report.main(["--only", "slow", "--timeout", "1", "--bench-dir", str(bench_dir),
                        "--out-dir", str(out)]) == 1
    assert "timed out after 1 s" in (out / "report.md").read_text()


def test_script_entry_point(bench_dir, tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "report.py"), "--only", "alpha",
                        "--bench-dir", str(bench_dir), "--out-dir", str(tmp_path / "cli")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cli" / "report.md").is_file() and "1 ok" in r.stdout
