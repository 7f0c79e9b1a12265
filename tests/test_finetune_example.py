"""The DP LoRA fine-tuning example on real weights and real text (small settings)."""

import pytest

from pavejax.finetune_example import FinetuneConfig, run_finetune


@pytest.mark.assets
@pytest.mark.slow
def test_finetune_small_run_reports_real_numbers():
    lines = []
    cfg = FinetuneConfig(train_size=64, test_size=64, seq_len=16, batch_size=16, steps=2,
                     epsilon=4.0)
    report = run_finetune(cfg, log=lines.append)
    assert report["train_examples"] == 64 and report["steps"] == 2
    assert 0.0 <= report["accuracy_before"] <= 1.0 and 0.0 <= report["accuracy_after"] <= 1.0
    # The ledger's epsilon comes from the accountant and respects the calibrated target.
    assert 0 < report["epsilon_rdp"] <= 4.0 + 1e-6
    assert 0 < report["epsilon_pld"] <= report["epsilon_rdp"] + 1e-6
    assert report["noise_multiplier"] > 0
    assert any("privacy ledger" in line for line in lines)
