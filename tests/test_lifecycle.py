"""The lifecycle job behind ``pavejax demo``, on real weights and text with tiny settings."""

from __future__ import annotations

import argparse
import json

import pytest

from pavejax import demo
from pavejax.lifecycle import LifecycleConfig

pytestmark = [pytest.mark.assets, pytest.mark.slow]

SUMMARY_KEYS = ("zero_shot_acc", "top1_reuse_acc", "merged_acc", "final_acc", "oracle_acc")


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(["--quick", "--out", str(tmp_path / "out"), *extra])


def test_config_validation():
    with pytest.raises(ValueError, match="must not be a developer task"):
        LifecycleConfig(user_task="movie")
    with pytest.raises(ValueError, match="dev_target_epsilon must be > 0"):
        LifecycleConfig(dev_target_epsilon=0.0)
    with pytest.raises(ValueError, match="delta must be in"):
        LifecycleConfig(delta=1.0)


def test_quick_demo_writes_report_summary_and_ledgers(tmp_path):
    from pavejax.lifecycle import run_lifecycle
    from pavejax.pave.dock import Dock

    lines: list[str] = []
    cfg = demo.config_from_args(_args(tmp_path))
    summary = run_lifecycle(cfg, log=lines.append)
    out = tmp_path / "out"
    on_disk = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert 0.0 <= on_disk[key] <= 1.0 and on_disk[key] == pytest.approx(summary[key])
    # the oracle is the best dock model on the user's test set, so top-1 reuse cannot beat it
    assert summary["top1_reuse_acc"] <= summary["oracle_acc"]
    assert [r["rank"] for r in summary["ranking"]] == [1, 2, 3, 4]
    cosines = [r["cosine"] for r in summary["ranking"]]
    assert cosines == sorted(cosines, reverse=True)
    ledger = on_disk["ledger"]
    for name in cfg.developers:
        dev = ledger[f"developer/{name}"]
        assert dev["model"]["epsilon"] <= cfg.dev_target_epsilon + 1e-6
        assert dev["spec"]["epsilon"] <= cfg.spec_target_epsilon + 1e-6
        # model and spec read the same data: the composition costs more than either alone
        assert dev["composed"]["epsilon"] > dev["model"]["epsilon"]
        assert dev["composed"]["relation"] == dev["model"]["relation"] == "replace_one"
        assert "add_remove" not in json.dumps(dev)
    assert ledger["user/final_model"]["mutual_information_nats"] == 0.0
    report = (out / "report.md").read_text()
    assert "Dock ranking" in report and "Privacy ledger" in report
    assert any("PACZero-ZPL" in line for line in lines)
    dock = Dock.open(out / "dock")
    assert sorted(e.name for e in dock.list()) == sorted(f"dev-{n}" for n in cfg.developers)
    # a second run on the same dock reuses the developers instead of training them again
    lines.clear()
    run_lifecycle(cfg, log=lines.append)
    assert sum("already in the dock" in line for line in lines) == len(cfg.developers)
    assert len(Dock.open(out / "dock")) == len(cfg.developers)
    # 'pavejax demo --json': the summary alone on stdout, the stage log on stderr
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert demo.run(_args(tmp_path, "--json")) == 0
    printed = json.loads(stdout.getvalue())
    assert printed == json.loads((out / "summary.json").read_text())
    assert "already in the dock" in stderr.getvalue()
