"""benchmarks/private_lr.py: the private peak rate is chosen on dev splits (never the test
split), as the argmax of the mean dev accuracy over tasks and draws; synthetic features stand in
for MiniLM so the test is fast."""

import hashlib

import numpy as np
import pytest

from pavejax import lifecycle
from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("private_lr") as module:
        yield module


def _fake_features(texts, seq_len, backbone=None, pooling="mean"):
    """A deterministic 384-d feature per text (from its hash), with no encoder."""
    out = np.zeros((len(texts), 384), np.float32)
    for i, t in enumerate(texts):
        seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:4], "little")
        out[i] = np.random.default_rng(seed).normal(size=384)
    return out


class _NoTest:
    """A task whose test split cannot be read."""

    def __init__(self, task):
        self.label_names, self.train, self.dev = task.label_names, task.train, task.dev

    @property
    def test(self):
        raise AssertionError("the test split was read")


@pytest.mark.assets
def test_rate_is_the_dev_argmax_and_the_test_split_is_not_read(bench, monkeypatch):
    monkeypatch.setattr(lifecycle, "_features", _fake_features)
    seen = []
    real_load = bench.load_task

    def load_task(name, **kw):
        seen.append(kw)
        return _NoTest(real_load(name, **kw))

    monkeypatch.setattr(bench, "load_task", load_task)
    cfg = lifecycle.LifecycleConfig(developers=("tweets",), user_task="nyt", dev_train=64,
                                    dev_steps=8, dev_batch=16, progress=False)
    s = bench.Settings(rates=(1e-4, 5e-2), draws=1, dev_size=32, lifecycle=cfg)
    # (train_developer imports load_task itself and scores its own test split; the benchmark
    # ignores that score)
    config, rows, summary = bench.run(s)
    assert all("max_test" not in kw for kw in seen)
    by_rate = {r["learning_rate"]: r["dev_accuracy"] for r in rows}
    assert set(by_rate) == {"recipe (non-private)", 1e-4, 5e-2}
    assert summary["chosen_lr"] == max((1e-4, 5e-2), key=lambda lr: by_rate[lr])
    assert summary["dev_0.05"] == by_rate[5e-2] and summary["dev_0.0001"] == by_rate[1e-4]
    assert summary["dev_recipe_nonprivate"] == by_rate["recipe (non-private)"]
    assert config["recipes"]["tweets"]["trained"] == "head"
    assert all(0.0 <= r["dev_accuracy"] <= 1.0 for r in rows)
