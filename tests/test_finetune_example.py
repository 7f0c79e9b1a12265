"""The DP LoRA fine-tuning example on real weights and real text (small settings)."""

import pytest

from pavejax.finetune_example import FinetuneConfig, run_finetune


@pytest.mark.assets
@pytest.mark.slow
def test_finetune_small_run_reports_real_numbers():
    lines = []
    # Small where the checks allow: 8 tokens, one evaluation chunk, and q = 0.5 at epsilon 2,
    # where the noise is large enough (z ~ 1.5) that each PLD build of the calibration is cheap
    # (about 3 s of accounting instead of 9 s at q = 0.25, epsilon 4; the claims are the same).
    cfg = FinetuneConfig(train_size=64, test_size=32, seq_len=8, batch_size=32, steps=2,
                         target_epsilon=2.0)
    report = run_finetune(cfg, log=lines.append)
    assert report["train_examples"] == 64 and report["steps"] == 2
    assert report["test_examples"] == 32 and report["sampling_rate"] == 0.5
    assert 0.0 <= report["accuracy_before"] <= 1.0 and 0.0 <= report["accuracy_after"] <= 1.0
    # The ledger's epsilon comes from the accountant and respects the calibrated target.
    # replace-one (n is in the report), against dp-accounting's PLD directly
    import dp_accounting as dpa

    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(report["sampling_rate"], dpa.GaussianDpEvent(
        report["noise_multiplier"])), report["steps"])
    assert report["relation"] == "replace_one"
    assert report["epsilon_pld"] == pytest.approx(acc.get_epsilon(report["delta"]), rel=1e-9)
    # calibrated tight: within 2.5 % below the target, never above it
    assert 0.975 * cfg.target_epsilon < report["epsilon_pld"] <= cfg.target_epsilon + 1e-6
    assert report["noise_multiplier"] > 0
    assert any("privacy ledger" in line for line in lines)
