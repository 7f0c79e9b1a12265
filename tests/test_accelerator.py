"""benchmarks/accelerator.py: the budget decision (pure), failures recorded without stopping the
others (fake scripts), and the CPU smoke run of the real benchmarks through accelerator.sh."""

import json
import subprocess
import textwrap

import pytest

from tests._bench import BENCH, benchmark_module

LADDER = [("full", 300.0), ("reduced", 150.0), ("quick", 60.0)]


@pytest.fixture(scope="module")
def acc():
    with benchmark_module("accelerator") as module:
        yield module


def test_full_mode_when_it_fits_after_the_reserve(acc):
    choice = acc.choose_mode(720, LADDER, reserve_s=210)
    assert choice.mode == "full" and choice.timeout_s == pytest.approx(510)
    assert "210 s" in choice.reason


def test_reduced_when_full_does_not_fit(acc):
    choice = acc.choose_mode(400, LADDER, reserve_s=100)  # 300 free: full 300 fits exactly
    assert choice.mode == "full"
    choice = acc.choose_mode(399, LADDER, reserve_s=100)
    assert choice.mode == "reduced" and choice.timeout_s == pytest.approx(299)
    assert "full needs ~300 s" in choice.reason


def test_scale_from_earlier_benchmarks_changes_the_choice(acc):
    assert acc.choose_mode(700, LADDER, reserve_s=100).mode == "full"
    assert acc.choose_mode(700, LADDER, reserve_s=100, scale=2.5).mode == "reduced"
    assert acc.choose_mode(700, LADDER, reserve_s=100, scale=5.0).mode == "quick"


def test_falls_back_to_quick_using_the_reserve(acc):
    # 100 s free after the reserve: not even quick (120 s at scale 2) fits there, but it fits
    # the 150 s left, so it runs with all of them as its timeout.
    choice = acc.choose_mode(150, LADDER, reserve_s=50, scale=2.0)
    assert choice.mode == "quick" and choice.timeout_s == pytest.approx(150)
    assert "reserved" in choice.reason


def test_skips_when_not_even_quick_fits(acc):
    choice = acc.choose_mode(59, LADDER)
    assert choice.mode == "skipped" and choice.timeout_s == 0
    assert "quick needs ~60 s" in choice.reason
    assert acc.choose_mode(-5, LADDER).mode == "skipped"
    assert acc.choose_mode(100, []).mode == "skipped"


def test_scale_factor(acc):
    assert acc.scale_factor([]) == 1.0
    assert acc.scale_factor([(180.0, 90.0), (60.0, 30.0)]) == pytest.approx(2.0)
    assert acc.scale_factor([(1000.0, 10.0)]) == acc.SCALE_BOUNDS[1]
    assert acc.scale_factor([(1.0, 100.0)]) == acc.SCALE_BOUNDS[0]


def test_a_failing_benchmark_is_recorded_and_the_others_still_run(acc, tmp_path, monkeypatch):
    scripts = tmp_path / "bench"
    scripts.mkdir()
    (scripts / "boom.py").write_text(
        "import sys\nprint('ValueError: broken on purpose', file=sys.stderr)\nsys.exit(3)\n")
    (scripts / "fine.py").write_text(textwrap.dedent("""
        import argparse, json
        from pathlib import Path
        p = argparse.ArgumentParser()
        p.add_argument("--quick", action="store_true")
        p.add_argument("--out", type=Path)
        a = p.parse_args()
        a.out.write_text(json.dumps({"benchmark": "fine", "summary": {"speedup": 2.5}}))
        """))
    monkeypatch.setattr(acc, "HERE", scripts)
    monkeypatch.setattr(acc, "BENCHMARKS", (
        acc.Bench("boom", (("full", (), 1.0),), ("quick", ("--quick",), 1.0), ("speedup",)),
        acc.Bench("fine", (("full", (), 1.0),), ("quick", ("--quick",), 1.0), ("speedup",)),
        acc.Bench("late", (("full", (), 1e6),), ("quick", ("--quick",), 1e6), ())))
    monkeypatch.setattr(acc, "probe_device", lambda python: {
        "device_kind": "Fake TPU v9", "platform": "tpu", "device_count": 4, "jax": "9.9",
        "cpu_count": 2})
    out = tmp_path / "acc.json"
    assert acc.main(["--out", str(out), "--budget-s", "60"]) == 1
    result = json.loads(out.read_text())
    recs = {r["name"]: r for r in result["benchmarks"]}
    assert recs["boom"]["status"] == "failed (exit status 3)"
    assert recs["boom"]["returncode"] == 3
    assert "ValueError: broken on purpose" in recs["boom"]["stderr_tail"]
    assert recs["fine"]["status"] == "ok" and recs["fine"]["summary"] == {"speedup": 2.5}
    assert recs["late"]["scaled"] == "skipped" and "out of budget" in recs["late"]["reason"]
    assert result["summary"]["failed"] == ["boom"]
    assert result["summary"]["skipped"] == ["late"]
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# pavejax benchmarks on Fake TPU v9 (tpu, 4 devices)")
    assert "| fine | full | ok |" in md and "speedup 2.5" in md


def test_smoke_run_through_the_wrapper(acc, tmp_path):
    out, md = tmp_path / "acc.json", tmp_path / "acc.md"
    r = subprocess.run(["bash", str(BENCH / "accelerator.sh"), "--smoke", "--out", str(out),
                        "--md", str(md)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"benchmark", "config", "rows", "summary", "env"} <= set(result)
    assert result["config"]["smoke"] is True
    recs = {rec["name"]: rec for rec in result["benchmarks"]}
    assert list(recs) == [b.name for b in acc.BENCHMARKS]
    for name, rec in recs.items():
        assert rec["status"] in ("ok", "skipped"), (name, rec)
        assert rec["scaled"] in ("quick", "help", "skipped") and rec["reason"], (name, rec)
        if rec["status"] == "ok":
            assert rec["returncode"] == 0 and rec["wall_s"] > 0
        if rec["scaled"] == "quick":
            assert rec["summary"], name  # a real run: its JSON summary was read back
    assert recs["dp_overhead"]["scaled"] == "quick" and "lora_ratio" in recs["dp_overhead"][
        "summary"]
    device = result["device"]
    for key in ("device_kind", "platform", "device_count", "jax", "cpu_count"):
        assert device.get(key) not in (None, "unknown"), key
    text = md.read_text()
    assert f"# pavejax benchmarks on {device['device_kind']}" in text
    assert all(f"| {name} |" in text for name in recs)
