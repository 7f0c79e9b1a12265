"""benchmarks/tasks_baseline.py: config checks, the probe against scipy, feature pooling, LoRA
training on a tiny random encoder, and one end-to-end run on real MiniLM and real text."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.optimize import minimize
from scipy.special import logsumexp

from pavejax.models import BertConfig, BertEncoder, TextClassifier
from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def tb():
    with benchmark_module("tasks_baseline") as module:
        yield module


@pytest.mark.parametrize("changes, match", [
    ({"tasks": ()}, "non-empty subset"),
    ({"tasks": ("movie", "digits")}, "non-empty subset"),
    ({"train_size": 0}, "train_size must be a positive int"),
    ({"epochs": 1.5}, "epochs must be a positive int"),
    ({"seq_len": 1}, "seq_len must be an int >= 2"),
    ({"batch_size": 64, "train_size": 32}, "batch_size 64 exceeds train_size 32"),
    ({"learning_rate": 0.0}, "learning_rate must be a finite number > 0"),
    ({"probe_l2": -1.0}, "probe_l2 must be a finite number >= 0"),
    ({"seed": -1}, "seed must be a non-negative int"),
])
def test_config_rejects_bad_values(tb, changes, match):
    with pytest.raises(ValueError, match=match):
        tb.Config(**changes)


def test_config_modes(tb):
    full, quick = tb.Config(), tb.QUICK
    assert full.tasks == ("movie", "amazon", "nyt", "tweets", "bbc") == quick.tasks
    assert (full.train_size, full.test_size, full.seq_len, full.batch_size) == (1024, 512, 64, 32)
    assert full.epochs * (full.train_size // full.batch_size) == 64
    assert tb.Config(tasks="bbc").tasks == ("bbc",)


def _reference_logreg(x, y, k, l2):
    """Minimiser of mean cross-entropy + 0.5 * l2 * ||W||^2 by scipy L-BFGS in float64."""
    x, n, d = x.astype(np.float64), x.shape[0], x.shape[1]

    def objective(theta):
        w, b = theta[:d * k].reshape(d, k), theta[d * k:]
        z = x @ w + b
        p = np.exp(z - logsumexp(z, axis=1, keepdims=True))
        loss = np.mean(logsumexp(z, axis=1) - z[np.arange(n), y]) + 0.5 * l2 * np.sum(w * w)
        g = p.copy()
        g[np.arange(n), y] -= 1.0
        g /= n
        return loss, np.concatenate([(x.T @ g + l2 * w).ravel(), g.sum(axis=0)])

    res = minimize(objective, np.zeros(d * k + k), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-10, "maxiter": 5000})
    return res.fun, objective


def test_probe_reaches_the_scipy_optimum(tb):
    rng = np.random.default_rng(0)
    n, d, k = 240, 6, 3
    y = rng.integers(0, k, n).astype(np.int32)
    centers = rng.normal(size=(k, d)) * 1.5
    x = (centers[y] + rng.normal(size=(n, d))).astype(np.float32)
    cfg = tb.Config(probe_steps=3000, probe_learning_rate=1e-2, probe_l2=1e-2)
    head = tb.fit_probe(jnp.asarray(x), jnp.asarray(y), k, cfg)
    assert head["w"].shape == (d, k) and head["b"].shape == (k,)
    best, objective = _reference_logreg(x, y, k, cfg.probe_l2)
    theta = np.concatenate([np.asarray(head["w"], np.float64).ravel(),
                            np.asarray(head["b"], np.float64)])
    assert objective(theta)[0] == pytest.approx(best, abs=1e-4)


def test_map_padded_pads_to_one_shape_and_drops_padding(tb):
    ids = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    data = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    shapes = []

    def fn(i, m):
        shapes.append(i.shape)
        return jnp.sum(i * m, axis=1)

    out = tb._map_padded(fn, data, 2)
    assert shapes == [(2, 3)] * 3
    np.testing.assert_array_equal(np.asarray(out), ids.sum(axis=1))


def _tiny_encoder():
    return BertEncoder(BertConfig.tiny(), rngs=nnx.Rngs(3))


def test_encoder_features_equal_text_classifier_mean_pooling(tb):
    enc = _tiny_encoder()
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 128, (7, 10)).astype(np.int32)
    lengths = np.array([10, 3, 5, 1, 10, 7, 2])
    mask = (np.arange(10)[None, :] < lengths[:, None]).astype(np.int32)
    ids = ids * mask
    got = tb.encoder_features(enc, {"input_ids": ids, "attention_mask": mask}, batch=4)
    model = TextClassifier(enc, 2, rngs=nnx.Rngs(0))
    want = jax.jit(model.features)(jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _keyword_task(n, seed):
    """Label 1 iff token 7 fills positions 1-4: learnable from mean-pooled features."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, 128, (n, 8)).astype(np.int32)
    label = (np.arange(n) % 2).astype(np.int32)
    ids[label == 1, 1:5] = 7
    ids[:, 0] = 1
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "label": label}


def test_train_lora_learns_on_a_tiny_encoder(tb):
    cfg = tb.Config(train_size=64, batch_size=16, epochs=8, learning_rate=1e-2, eval_batch=32)
    train, test = _keyword_task(64, 0), _keyword_task(32, 1)
    res = tb.train_lora(_tiny_encoder(), 2, train, test, cfg)
    assert res["steps"] == 8 * 4
    assert res["last_loss"] < 0.5 * res["first_loss"]
    assert res["accuracy"] >= 0.9  # majority rate is 0.5
    assert res["b_norm"] > 0  # the LoRA factors moved, not only the head


@pytest.mark.assets
@pytest.mark.slow
def test_benchmark_end_to_end_on_real_minilm(tb, tmp_path):
    cfg = tb.Config(tasks=("tweets", "bbc"), train_size=32, test_size=24, seq_len=16,
                    batch_size=16, epochs=1, probe_steps=50, eval_batch=16)
    out = tmp_path / "tasks_baseline.json"
    tb.run(cfg, out)
    result = json.loads(out.read_text())
    assert set(result) == {"benchmark", "config", "rows", "summary", "env"}
    assert result["benchmark"] == "tasks_baseline"
    assert result["config"]["tasks"] == ["tweets", "bbc"] and result["config"]["train_size"] == 32
    rows = result["rows"]
    assert [(r["task"], r["method"]) for r in rows] == [
        ("tweets", "probe"), ("tweets", "lora"), ("bbc", "probe"), ("bbc", "lora")]
    for r in rows:
        assert r["classes"] == (5 if r["task"] == "bbc" else 2)
        assert r["train_examples"] == 32 and r["test_examples"] == 24
        assert r["steps"] == (50 if r["method"] == "probe" else 2)
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 < r["majority"] <= 1.0
        assert r["seconds"] > 0
    summary = result["summary"]
    assert set(summary) == {"probe_tweets", "lora_tweets", "probe_bbc", "lora_bbc",
                            "probe_mean", "lora_mean"}
    for r in rows:
        assert summary[f"{r['method']}_{r['task']}"] == r["accuracy"]
    assert summary["lora_mean"] == pytest.approx(
        (summary["lora_tweets"] + summary["lora_bbc"]) / 2)
    assert result["env"]["device_count"] >= 1 and jax.__version__ == result["env"]["jax"]
