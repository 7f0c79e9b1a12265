"""The DP LoRA fine-tuning example on real weights and real text (small settings)."""

import pytest

from pavejax.finetune_example import FinetuneConfig, run_finetune


@pytest.mark.assets
@pytest.mark.slow
def test_finetune_small_run_reports_real_numbers():
    lines = []
    cfg = FinetuneConfig(train_size=64, test_size=64, seq_len=16, batch_size=16, steps=2,
                     target_epsilon=4.0)
    report = run_finetune(cfg, log=lines.append)
    assert report["train_examples"] == 64 and report["steps"] == 2
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
    assert 3.9 < report["epsilon_pld"] <= 4.0 + 1e-6
    assert report["noise_multiplier"] > 0
    assert any("privacy ledger" in line for line in lines)
