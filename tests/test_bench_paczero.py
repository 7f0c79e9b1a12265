"""benchmarks/paczero.py: the modes follow the issue, the cached top-layer adapter reproduces the
whole model, the cost and memory ratios of a step, and one benchmark cell, on a tiny encoder."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.models import BertConfig, BertEncoder, TextClassifier
from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("paczero") as module:
        yield module


@pytest.fixture(scope="module")
def tiny():
    graphdef, state = nnx.split(TextClassifier(BertEncoder(BertConfig.tiny(), rngs=nnx.Rngs(0)),
                                               2, rngs=nnx.Rngs(1)))
    rng = np.random.default_rng(0)

    def split(n):
        lengths = rng.integers(3, 12, n)
        mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int32)
        ids = rng.integers(1, 128, (n, 12)).astype(np.int32) * mask
        return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask),
                "label": jnp.asarray(rng.integers(0, 2, n), jnp.int32)}

    return graphdef, nnx.to_pure_dict(state), {"pool": split(16), "dev": split(8),
                                                "test": split(8)}


@pytest.fixture(scope="module")
def top(bench, tiny):
    graphdef, params, data = tiny
    return bench._top_setup(graphdef, params, data)


def test_modes_follow_the_issue(bench):
    quick, full, mid = bench.MODES["quick"], bench.MODES["full"], bench.MODES["mid"]
    assert (quick.pool, quick.subsets, quick.adapter) == (256, 32, "top")
    assert 100 <= quick.steps <= 500
    assert (full.pool, full.subsets, full.steps, full.seq, full.adapter) == \
        (1000, 128, 1000, 64, "qv")
    assert (mid.pool, mid.subsets, mid.steps) == (512, 128, 500)
    names = [c[0] for c in bench._cells(full)]
    assert names == ["mezo", "dpzo_eps2", "dpzo_eps6", "mi033", "mi068", "zpl"]
    assert dict((c[0], c[2]) for c in bench._cells(full))["zpl"]["num_subsets"] == 126
    assert bench.main.__module__ == "paczero"
    with pytest.raises(SystemExit):
        bench._common.parse_args("x", ["--mode", "huge"], extra=bench._mode_arg)


def test_top_cache_reproduces_the_whole_model(top):
    # LoRA on the last feed-forward output kernel with the layers below cached must give the
    # logits of the whole encoder with the same adapter applied (apply_lora), at a nonzero B.
    trainable, frozen, logits, cached, diff = top
    assert diff < 1e-5
    assert list(trainable["B"]) == ["encoder/layers/1/output/kernel"] and frozen is None
    assert cached["pool"]["pre"].shape == (16, 12, 32) and cached["pool"]["u"].shape[-1] == 8
    assert logits(trainable, None, cached["test"]).shape == (8, 2)


def test_probe_row_fits_the_pool(bench, tiny, top):
    # The non-private probe, fitted on the pool, classifies its own training features well
    # above chance (here the test split is the pool itself).
    params, cached = tiny[1], top[3]
    same = {"pool": cached["pool"], "dev": cached["pool"], "test": cached["pool"]}
    assert bench._probe_accuracy(params, same) >= 0.9


def test_step_cost_and_memory_ratios(bench, tiny):
    graphdef, params, data = tiny
    trainable, frozen, logits, _ = bench._qv_setup(graphdef, params, None)
    loss = bench._per_example(logits)
    ratio, _, mem = bench._cost(loss, trainable, frozen, data["pool"], 3, None)
    # Two forward passes per step; LoRA factors are tiny, so the step needs inference memory
    # (plus, at 16 examples, a few kilobytes of its own: the membership matrix, the counters).
    assert ratio > 1.3
    assert 1.0 <= mem <= 1.05
    full_logits = lambda tr, fr, d: nnx.merge(graphdef, tr)(  # noqa: E731
        d["input_ids"], d["attention_mask"])
    full_loss = bench._per_example(full_logits)
    _, _, mem_full = bench._cost(full_loss, params, None, data["pool"], 1, None)
    # All weights perturbed: the peak is inference plus exactly one copy of θ (no piece of the
    # step, θ + εz with its draws, the mirror, the update, needs more), never a second copy.
    inference = bench._common.compiled_bytes(jax.jit(lambda tr, b: jax.vmap(
        lambda ex: full_loss(tr, None, ex))(b), keep_unused=True).lower(
            params, data["pool"]).compile())
    one_copy = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / inference
    # (the tiny pool's small buffers, the losses and the step's counters, show up at 16 examples:
    # under a tenth of this tiny θ; the z stacks of all same-shaped groups held at once, rather
    # than one group at a time, add more than that)
    assert 1.0 + 0.95 * one_copy <= mem_full <= 1.0 + 1.1 * one_copy
    assert mem_full < 2.0


def test_one_cell_reports_zero_mi_for_zpl(bench, top):
    trainable, frozen, logits, cached, _ = top
    mode = bench.Mode(16, 4, 4, 12, 8, 8, "top", None, 1e-2, False, 1)
    test_acc, dev_loss = bench._evaluators(logits, frozen, cached["dev"], cached["test"])
    row = bench._run_cell(mode, "zpl", "zpl", {}, bench._per_example(logits), trainable, frozen,
                          cached["pool"], dev_loss, test_acc)
    assert row["mi_nats"] == 0.0 and row["mia_posterior"] == 0.5 and row["mia_matched_eps"] == 0
    assert 0.0 <= row["unanimity_rate"] <= 1.0 and 0.0 <= row["test_acc"] <= 1.0
    assert row["best_step"] in (1, 2, 3, 4) and row["dp_eps"] is None
