"""benchmarks/tasks_baseline.py: config checks and recipe lookup, the head fit against a
hand-written AdamW loop, feature pooling, LoRA and full training on a tiny random encoder, the
dev-split sweep on fake tasks, and one end-to-end run on real MiniLM and real text."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pavejax import recipes
from pavejax.data import Split
from pavejax.models import BertConfig, BertEncoder, TextClassifier
from pavejax.recipes import Recipe
from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def tb():
    with benchmark_module("tasks_baseline") as module:
        yield module


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("changes, match", [
    ({"tasks": ()}, "tasks must be a non-empty subset"),
    ({"tasks": ("movie", "digits")}, "tasks must be a non-empty subset"),
    ({"methods": ()}, "methods must be a non-empty subset"),
    ({"methods": ("probe", "adapter")}, "methods must be a non-empty subset"),
    ({"train_size": 0}, "train_size must be a positive int"),
    ({"dev_size": 0}, "dev_size must be a positive int"),
    ({"test_size": 2.5}, "test_size must be a positive int"),
    ({"eval_batch": 0}, "eval_batch must be a positive int"),
    ({"seq_len": 1}, "seq_len must be an int >= 2"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"batch_size": 64, "train_size": 32}, "batch_size 64 exceeds train_size 32"),
    ({"seed": -1}, "seed must be a non-negative int"),
])
def test_config_rejects_bad_values(tb, changes, match):
    with pytest.raises(ValueError, match=match):
        tb.Config(**changes)


def test_config_modes(tb):
    full, quick = tb.Config(), tb.QUICK
    assert full.tasks == ("movie", "amazon", "nyt", "tweets", "bbc") == quick.tasks
    assert full.methods == ("probe", "lora", "full") and quick.methods == ("probe", "lora")
    assert (full.train_size, full.dev_size, full.test_size, full.seq_len, full.batch_size,
            full.eval_batch) == (1024, 512, 512, 64, None, 128)
    assert (quick.train_size, quick.dev_size, quick.test_size, quick.seq_len,
            quick.batch_size) == (128, 128, 128, 32, 16)
    assert tb.Config(tasks="bbc", methods="lora").tasks == ("bbc",)
    assert tb.Config(methods="lora").methods == ("lora",)
    assert tb.Config(batch_size=1024).batch_size == 1024  # equal to train_size is allowed


def test_config_recipe_presets_override_and_table(tb):
    cfg = tb.Config()
    for task in ("movie", "bbc"):
        for method, trained in (("probe", "head"), ("lora", "lora"), ("full", "full")):
            assert cfg.recipe(task, method) == recipes.tuned(task, trained)
    small = tb.Config(train_size=64, batch_size=8)
    r = small.recipe("bbc", "probe")
    assert r.trained == "head" and r.batch_size == 8
    assert r == recipes.tuned("topic", "head").replace(batch_size=8)
    mine = Recipe("lora", 7e-4, 3e-3, epochs=5, batch_size=24, lora_targets=("key",))
    table = {"sentiment": {"lora": mine}, "topic": {"lora": mine.replace(epochs=1)}}
    assert cfg.recipe("tweets", "lora", table) == mine  # looked up by the task's family
    assert cfg.recipe("bbc", "lora", table).epochs == 1
    assert small.recipe("nyt", "lora", table) == mine.replace(batch_size=8)
    with pytest.raises(KeyError):  # the table has no head recipe
        cfg.recipe("movie", "probe", table)


# ------------------------------------------------------------------ the head


def _blobs(n, d, k, seed, scale=4.0):
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(size=(k, d)) * scale
    y = (np.arange(n) % k).astype(np.int32)
    rng.shuffle(y)
    x = (centers[y] + rng.normal(size=(n, d))).astype(np.float32)
    return x, y


def test_fit_head_learns_separable_data(tb):
    n, d, k = 240, 6, 3
    x, y = _blobs(n, d, k, 0)
    x_test, y_test = _blobs(120, d, k, 1)
    r = Recipe("head", 1.0, 5e-2, epochs=30, batch_size=40, schedule="constant",
               warmup_fraction=0.0, weight_decay=0.0)
    head = tb.fit_head(jnp.asarray(x), jnp.asarray(y), k, r, seed=0)
    assert head["w"].shape == (d, k) and head["b"].shape == (k,)
    losses = np.asarray(head["losses"])
    assert losses.shape == (30 * 6,)
    assert losses[0] == pytest.approx(math.log(k), rel=1e-6)  # zero init: uniform logits
    assert losses[-6:].mean() < 0.1 * losses[0]
    for xs, ys in ((x, y), (x_test, y_test)):
        pred = np.argmax(xs @ np.asarray(head["w"]) + np.asarray(head["b"]), axis=1)
        assert np.mean(pred == ys) >= 0.95


def _hand_order(n, batch, epochs, seed):
    """One numpy permutation per epoch (seed + epoch), cut into full batches."""
    out = []
    for e in range(epochs):
        perm = np.random.default_rng(seed + e).permutation(n)
        out += [perm[i:i + batch] for i in range(0, n - n % batch, batch)]
    return np.stack(out)


def test_order_is_one_shuffled_pass_per_epoch(tb):
    r = Recipe("head", 1.0, 1e-2, epochs=3, batch_size=16)
    order = tb._order(70, r, 5)
    np.testing.assert_array_equal(order, _hand_order(70, 16, 3, 5))
    assert order.shape == (3 * 4, 16)
    for e in range(3):  # each epoch's batches hold distinct examples
        assert len(set(order[4 * e:4 * e + 4].ravel().tolist())) == 64


def test_fit_head_one_epoch_equals_a_hand_written_adamw_loop(tb):
    n, d, k, batch, seed = 240, 6, 3, 16, 3
    x, y = _blobs(n, d, k, 2, scale=1.0)
    r = Recipe("head", 1.0, 3e-2, epochs=1, batch_size=batch, schedule="cosine",
               warmup_fraction=0.2, weight_decay=0.05)
    got = tb.fit_head(jnp.asarray(x), jnp.asarray(y), k, r, seed=seed)

    steps, warm = n // batch, 3  # 15 steps; warm-up round(0.2 * 15) = 3

    def lr(c):
        c = jnp.asarray(c, jnp.float32)
        return jnp.where(c < warm, 3e-2 * c / warm,
                         0.5 * 3e-2 * (1 + jnp.cos(jnp.pi * (c - warm) / (steps - warm))))

    def loss(p, xb, yb):
        logp = jax.nn.log_softmax(xb @ p["w"] + p["b"][None, :])
        return -jnp.mean(logp[jnp.arange(yb.shape[0]), yb])

    opt = optax.adamw(lr, weight_decay=0.05)

    @jax.jit
    def step(p, state, xb, yb):  # one plain optax step, run in a Python loop
        with jax.numpy_dtype_promotion("standard"):
            value, g = jax.value_and_grad(loss)(p, xb, yb)
            u, state = opt.update(g, state, p)
            return optax.apply_updates(p, u), state, value

    p = {"w": jnp.zeros((d, k), jnp.float32), "b": jnp.zeros((k,), jnp.float32)}
    state, want_losses = opt.init(p), []
    for idx in _hand_order(n, batch, 1, seed):
        p, state, value = step(p, state, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
        want_losses.append(float(value))
    np.testing.assert_allclose(np.asarray(got["losses"]), want_losses, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(p["w"]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["b"]), np.asarray(p["b"]), atol=1e-6)
    assert float(jnp.max(jnp.abs(p["w"]))) > 1e-2  # the loop moved the head


# ------------------------------------------------------------------ features


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


def _tiny_encoder(num_layers=2):
    """BertConfig.tiny(); one layer halves the compilation of a training step."""
    return BertEncoder(dataclasses.replace(BertConfig.tiny(), num_layers=num_layers),
                       rngs=nnx.Rngs(3))


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


# ------------------------------------------------------------------ encoder training


def _keyword_ids(n, seed, k=2):
    """Class c > 0: token 6 + c fills positions 1-4; class 0: random tokens. Learnable from
    mean-pooled features. Returns (ids (n, 8), labels)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(12, 128, (n, 8)).astype(np.int32)
    label = (np.arange(n) % k).astype(np.int32)
    for c in range(1, k):
        ids[label == c, 1:5] = 6 + c
    ids[:, 0] = 1
    return ids, label


def _keyword_task(n, seed):
    ids, label = _keyword_ids(n, seed)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "label": label}


def _capture_steps(tb, monkeypatch):
    """Wraps the training step of train_encoder to keep numpy copies of (trainable, frozen)
    before the first step and after the last (the step donates its inputs)."""
    seen = {"calls": 0}
    original = tb._encoder_fns

    def wrapped(graphdef, recipe, total_steps):
        opt, step, predict = original(graphdef, recipe, total_steps)

        def recording_step(trainable, opt_state, frozen, batch):
            if seen["calls"] == 0:
                seen["first"] = jax.tree.map(np.array, (trainable, frozen))
            seen["calls"] += 1
            out = step(trainable, opt_state, frozen, batch)
            seen["last"] = jax.tree.map(np.array, (out[0], frozen))
            return out

        return opt, recording_step, predict

    monkeypatch.setattr(tb, "_encoder_fns", wrapped)
    return seen


def _max_change(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


@pytest.mark.parametrize("train_a", [True, False])
def test_train_encoder_lora_learns_on_a_tiny_encoder(tb, monkeypatch, train_a):
    seen = _capture_steps(tb, monkeypatch)
    r = Recipe("lora", 3e-2, 1e-2, epochs=8, batch_size=16, train_a=train_a)
    train, test = _keyword_task(64, 0), _keyword_task(32, 1)
    res = tb.train_encoder(_tiny_encoder(), 2, train, {"test": test, "train": train}, r,
                           eval_batch=32)
    assert res["steps"] == seen["calls"] == 8 * 4
    # with A frozen (half the factors) the tiny encoder learns more slowly; majority rate 0.5
    loss_ratio, floor = (0.5, 0.9) if train_a else (0.6, 0.8)
    assert res["last_loss"] < loss_ratio * res["first_loss"]
    assert res["accuracy"]["test"] >= floor and res["accuracy"]["train"] >= floor
    (t0, f0), (t1, f1) = seen["first"], seen["last"]
    want_paths = {f"encoder/layers/{i}/attention/{n}/kernel" for i in (0, 1)
                  for n in ("query", "value")}
    assert set(t0["B"]) == want_paths
    assert all(np.all(b == 0) for b in t0["B"].values())  # B starts at zero ...
    assert _max_change(t1["B"], t0["B"]) > 0  # ... and is trained
    if train_a:
        assert set(t0) == {"A", "B", "head"} and "A" not in f0
        assert _max_change(t1["A"], t0["A"]) > 0
        a = t1["A"]
    else:
        assert set(t0) == {"B", "head"} and set(f0["A"]) == want_paths
        assert _max_change(f1["A"], f0["A"]) == 0  # the frozen A never changes
        a = f1["A"]
    # body_change: the Frobenius norm of the product A B over the adapted kernels
    want = math.sqrt(sum(float(np.sum(np.square(a[p].astype(np.float64) @ t1["B"][p])))
                         for p in want_paths))
    assert res["body_change"] == pytest.approx(want, rel=1e-4)
    assert res["body_change"] > 0


def test_train_encoder_full_changes_the_encoder(tb, monkeypatch):
    seen = _capture_steps(tb, monkeypatch)
    r = Recipe("full", 1e-3, 1e-2, epochs=8, batch_size=16)
    train, test = _keyword_task(64, 0), _keyword_task(32, 1)
    res = tb.train_encoder(_tiny_encoder(1), 2, train, {"test": test}, r, eval_batch=32)
    assert res["steps"] == seen["calls"] == 32
    assert res["last_loss"] < 0.5 * res["first_loss"]
    assert res["accuracy"]["test"] >= 0.9
    (t0, f0), (t1, _) = seen["first"], seen["last"]
    assert set(t0) == {"body", "head"}
    assert _max_change(t0["body"], f0["params"]["encoder"]) == 0  # starts at the encoder
    want = math.sqrt(sum(float(np.sum(np.square(u.astype(np.float64) - v)))
                         for u, v in zip(jax.tree.leaves(t1["body"]),
                                         jax.tree.leaves(t0["body"]))))
    assert want > 0 and res["body_change"] == pytest.approx(want, rel=1e-4)


def test_train_encoder_rejects_a_head_recipe(tb):
    r = Recipe("head", 1e-2, 1e-2, epochs=1, batch_size=16)
    with pytest.raises(ValueError, match="train_encoder trains LoRA or full weights"):
        tb.train_encoder(_tiny_encoder(), 2, _keyword_task(32, 0), {}, r)


# ------------------------------------------------------------------ the sweep on fake tasks

SEQ = 8


class _FakeTokenizer:
    """Texts are space-separated token ids; fixed length SEQ, no padding needed."""

    def __call__(self, texts):
        ids = np.array([[int(w) for w in t.split()] for t in texts], np.int32)
        assert ids.shape[1] == SEQ

        class Out:
            input_ids = ids
            attention_mask = np.ones_like(ids)

        return Out()


def _split(n, seed, k):
    ids, label = _keyword_ids(n, seed, k)
    return Split([" ".join(map(str, row)) for row in ids], label)


class _FakeTask:
    def __init__(self, name, k, n_train, n_dev, seed):
        self.name, self.num_classes = name, k
        self.train = _split(n_train, seed, k)
        self.dev = _split(n_dev, seed + 100, k)

    @property
    def test(self):
        raise AssertionError("the sweep read a test split")


_SWEEP_CFG = dict(tasks=("movie", "tweets"), methods=("probe", "lora"), train_size=32,
                  dev_size=16, test_size=8, seq_len=SEQ, batch_size=16, eval_batch=16)
_HEAD = Recipe("head", 1.0, 1e-2, epochs=20, batch_size=32, weight_decay=0.0)
_GRID = {
    # the middle candidate trains longest at the highest rate, the others barely train
    "head": (_HEAD.replace(head_learning_rate=1e-4, epochs=1),
             _HEAD.replace(head_learning_rate=1e-1, epochs=20),
             _HEAD.replace(head_learning_rate=1e-4, epochs=1, weight_decay=0.5)),
    "lora": (Recipe("lora", 1e-5, 1e-5, epochs=1, batch_size=32),
             Recipe("lora", 3e-2, 3e-2, epochs=12, batch_size=32)),
}


@pytest.fixture(scope="module")
def fake_sweep(tb, tmp_path_factory):
    """run_sweep on fake tasks and a tiny encoder: (result, sweep's return, recipes path,
    load_task calls, splits passed to _encode, tasks)."""
    cfg = tb.Config(**_SWEEP_CFG)
    # two tasks of one family (the mean is over both); the bbc task must not be loaded
    tasks = {"movie": _FakeTask("movie", 2, 32, 16, 0), "tweets": _FakeTask("tweets", 2, 32, 16, 1)}
    calls, encoded, returned = [], [], {}
    encode, sweep = tb._encode, tb.sweep

    def fake_load_task(name, **kwargs):
        calls.append((name, kwargs))
        return tasks[name]

    def fake_load_minilm(max_length):
        assert max_length == SEQ
        return _tiny_encoder(1), _FakeTokenizer()

    def recording_encode(tok, split):
        encoded.append(split)
        return encode(tok, split)

    def recording_sweep(*args, **kwargs):
        returned["value"] = sweep(*args, **kwargs)
        return returned["value"]

    path = tmp_path_factory.mktemp("sweep") / "chosen.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tb, "load_task", fake_load_task)
        mp.setattr(tb, "load_minilm", fake_load_minilm)
        mp.setattr(tb, "_encode", recording_encode)
        mp.setattr(tb, "sweep", recording_sweep)
        result = tb.run_sweep(cfg, None, path, grid=_GRID)
    return result, returned["value"], path, calls, encoded, tasks


def test_sweep_chooses_the_best_mean_dev_accuracy(fake_sweep):
    result, (rows, chosen, summary), _, _, _, _ = fake_sweep
    assert rows == result["rows"]
    assert len(rows) == 2 * (3 + 2)  # tasks x candidates of both methods
    families = {"sentiment": ("movie", "tweets")}
    assert set(chosen) == set(families)
    not_first = 0
    for fam, names in families.items():
        assert set(chosen[fam]) == {"head", "lora"}
        for method, trained in (("probe", "head"), ("lora", "lora")):
            grid = _GRID[trained]
            means = []
            for i, cand in enumerate(grid):
                accs = {r["task"]: r["dev_accuracy"] for r in rows
                        if (r["family"], r["method"], r["candidate"]) == (fam, method, i)}
                assert set(accs) == set(names)
                assert all(0 <= a <= 1 and (a * 16) == round(a * 16) for a in accs.values())
                means.append(sum(accs.values()) / len(accs))
            best = max(range(len(means)), key=lambda i: (means[i], -i))  # ties: the first
            not_first += best != 0
            assert chosen[fam][trained] == grid[best].replace(source=chosen[fam][trained].source)
            assert "dev" in chosen[fam][trained].source
            assert summary[f"{fam}_{trained}_candidate"] == best
            assert summary[f"{fam}_{trained}_dev"] == pytest.approx(means[best])
    assert not_first == 2  # the choice was not decided by candidate order (probe and LoRA)
    for r in rows:  # the batch override applies to every candidate
        grid = _GRID["head" if r["method"] == "probe" else "lora"]
        assert r["steps"] == grid[r["candidate"]].epochs * (32 // 16)
        assert "batch=16" in r["recipe"]


def test_sweep_reads_train_and_dev_never_test(fake_sweep):
    _, _, _, calls, encoded, tasks = fake_sweep
    assert [name for name, _ in calls] == ["movie", "tweets"]
    for _, kwargs in calls:
        assert kwargs.get("max_train") == 32 and kwargs.get("max_dev") == 16
        assert kwargs.get("max_test") is None
    allowed = {id(t.train) for t in tasks.values()} | {id(t.dev) for t in tasks.values()}
    assert len(encoded) == 4 and {id(s) for s in encoded} == allowed


def test_run_sweep_writes_recipes_that_load_back(fake_sweep):
    result, (_, chosen, _), path, _, _, _ = fake_sweep
    assert result["benchmark"] == "tasks_baseline_sweep"
    assert result["summary"]["recipes_file"] == str(path)
    loaded = recipes.load_recipes(path)
    assert loaded == chosen
    doc = json.loads(path.read_text())
    assert doc["chosen_on"] == "dev" and doc["config"]["dev_size"] == 16
    assert doc["config"]["tasks"] == ["movie", "tweets"]


# ------------------------------------------------------------------ end to end


@pytest.mark.assets
@pytest.mark.slow
def test_benchmark_end_to_end_on_real_minilm(tb, tmp_path):
    cfg = tb.Config(tasks=("tweets", "bbc"), methods=("probe", "lora", "full"), train_size=32,
                    dev_size=16, test_size=24, seq_len=16, batch_size=16, eval_batch=16)
    out = tmp_path / "tasks_baseline.json"
    tb.run(cfg, out)
    result = json.loads(out.read_text())
    assert set(result) == {"benchmark", "config", "rows", "summary", "env"}
    assert result["benchmark"] == "tasks_baseline"
    config = result["config"]
    assert config["tasks"] == ["tweets", "bbc"] and config["train_size"] == 32
    assert config["methods"] == ["probe", "lora", "full"]
    assert config["recipes"]["bbc/probe"]["batch_size"] == 16
    rows = result["rows"]
    assert [(r["task"], r["method"]) for r in rows] == [
        (t, m) for t in ("tweets", "bbc") for m in ("probe", "lora", "full")]
    trained = {"probe": "head", "lora": "lora", "full": "full"}
    for r in rows:
        assert r["classes"] == (5 if r["task"] == "bbc" else 2)
        assert r["train_examples"] == 32 and r["test_examples"] == 24
        assert r["steps"] == recipes.tuned(r["task"], trained[r["method"]]).epochs * (32 // 16)
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 < r["majority"] <= 1.0
        assert r["seconds"] > 0
    summary = result["summary"]
    assert set(summary) == {f"{m}_{t}" for m in ("probe", "lora", "full")
                            for t in ("tweets", "bbc")} | {
        "probe_mean", "lora_mean", "full_mean", "lora_minus_probe_tweets",
        "lora_minus_probe_bbc"}
    acc = {(r["method"], r["task"]): r["accuracy"] for r in rows}
    for (m, t), a in acc.items():
        assert summary[f"{m}_{t}"] == a
    for m in ("probe", "lora", "full"):
        assert summary[f"{m}_mean"] == pytest.approx((acc[m, "tweets"] + acc[m, "bbc"]) / 2)
    for t in ("tweets", "bbc"):
        assert summary[f"lora_minus_probe_{t}"] == pytest.approx(acc["lora", t] - acc["probe", t])
    assert result["env"]["device_count"] >= 1 and jax.__version__ == result["env"]["jax"]
