"""The command line and the end-to-end demo, on real weights and real text (small settings)."""

import subprocess
import sys

import pytest

from pavejax.cli import main
from pavejax.demo import DemoConfig, run_demo


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "assets" in out and "demo" in out


def test_cli_demo_help_explains_privacy_flags(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--epsilon" in out and "delta" in out


def test_cli_without_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "pavejax", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout


@pytest.mark.assets
@pytest.mark.slow
def test_demo_small_run_reports_real_numbers():
    lines = []
    cfg = DemoConfig(train_size=64, test_size=64, seq_len=16, batch_size=16, steps=2,
                     epsilon=4.0)
    report = run_demo(cfg, log=lines.append)
    assert report["train_examples"] == 64 and report["steps"] == 2
    assert 0.0 <= report["accuracy_before"] <= 1.0 and 0.0 <= report["accuracy_after"] <= 1.0
    # The ledger's epsilon comes from the accountant and respects the calibrated target.
    assert 0 < report["epsilon_rdp"] <= 4.0 + 1e-6
    assert 0 < report["epsilon_pld"] <= report["epsilon_rdp"] + 1e-6
    assert report["noise_multiplier"] > 0
    assert any("privacy ledger" in line for line in lines)
