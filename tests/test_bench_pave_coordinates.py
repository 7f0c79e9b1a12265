"""benchmarks/_pave_coordinates.py on a tiny BERT: one pass of prefix sums equals separate
passes, the coordinate sums are generate_spec's coordinate spec, the intrinsic query equals the
library's clipped average query, and the rows carry what they claim."""

import dataclasses
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from pavejax.accounting.intrinsic import clipped_average_query
from pavejax.models.bert import BertConfig, BertEncoder
from pavejax.pave import spec as S, subspace as sub_lib
from pavejax.pave.text import TextSpecBackbone
from tests._bench import benchmark_module

LENGTH, VOCAB = 8, 64
CLASSES = ("negative", "positive")


class _Tok:
    """Words hashed into a 64-token vocabulary, padded to 8 tokens."""

    def __call__(self, texts):
        ids = np.zeros((len(texts), LENGTH), np.int32)
        mask = np.zeros_like(ids)
        for i, t in enumerate(texts):
            words = [2 + zlib.crc32(w.encode()) % (VOCAB - 2) for w in t.split()][:LENGTH]
            ids[i, :len(words)], mask[i, :len(words)] = words, 1
        return type("Enc", (), {"input_ids": ids, "attention_mask": mask})()


@pytest.fixture(scope="module")
def tb():
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2,
                     intermediate_size=32, max_position=LENGTH)
    return TextSpecBackbone(BertEncoder(cfg, rngs=nnx.Rngs(0)), _Tok(), backbone_id="tiny-bert")


@pytest.fixture(scope="module")
def pc():
    with benchmark_module("_pave_coordinates") as module:
        yield module


def _texts(n, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)]
    return [" ".join(rng.choice(words, size=rng.integers(3, LENGTH + 1))) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tb, pc):
    subs = {k: sub_lib.random_projection(tb.backbone.params, tb.predicate, k, seed=k)
            for k in (2, 4)}
    a_key = jax.random.key(1)
    A = pc.a_factors(tb, a_key, 2)
    sums = pc.CoordinateSums(tb, A, subs, clip=0.05, query_clip=0.05, microbatch=4)
    texts = _texts(11)
    targets = S.hard_targets(np.arange(11) % 2, 2)
    return {"subs": subs, "a_key": a_key, "A": A, "sums": sums, "texts": texts,
            "targets": targets, "out": sums(texts, targets, CLASSES, ns=[5, 11, 99])}


def test_prefix_sums_equal_separate_passes(setup):
    out = setup["out"]
    assert sorted(out) == [5, 11]  # 99 exceeds the data set
    alone = setup["sums"](setup["texts"][:5], setup["targets"][:5], CLASSES)
    for k in (2, 4):
        np.testing.assert_allclose(out[5][k][0], alone[5][k][0], rtol=1e-6, atol=1e-9)
        for p, h in alone[5][k][1].items():
            np.testing.assert_allclose(out[5][k][1][p], h, rtol=1e-6, atol=1e-9)


def test_coordinate_sums_are_generate_specs_coordinate_spec(tb, setup):
    for k in (2, 4):
        cfg = S.SpecConfig.preset("one_step_clipped", rank=2, example_clip=0.05,
                                  progress=False, subspace=setup["subs"][k])
        res = tb.user_spec(setup["texts"], np.arange(11) % 2, CLASSES, setup["a_key"], cfg)
        mine = -setup["out"][11][k][0] / 11
        assert np.abs(mine).max() > 0
        np.testing.assert_allclose(res.spec.vector, mine, rtol=1e-4,
                                   atol=1e-5 * np.abs(mine).max())


def test_intrinsic_query_equals_the_librarys_clipped_average(tb, pc, setup):
    import _spec_sums

    grads = jax.jit(_spec_sums.weight_grads_fn(tb, setup["sums"].paths))
    batch = tb.encode(setup["texts"])
    batch["__target"] = setup["targets"]
    g = {p: np.asarray(v, np.float64) for p, v in grads(tb.head(CLASSES), batch).items()}
    for k in (2, 4):
        U = {p: setup["subs"][k].basis(p) for p in g}
        ref = clipped_average_query(g, U, 0.05)
        for p, h in setup["out"][11][k][1].items():
            np.testing.assert_allclose(h, ref[p], rtol=1e-4, atol=1e-7)


def test_intrinsic_rows_are_scoped_and_summarised(pc, setup):
    rows, summary = pc.intrinsic_rows([setup["out"][11], setup["out"][5]], [11, 5], rank=2,
                                      query_clip=0.05, delta=1e-5)
    assert [r["k"] for r in rows] == [2, 4]
    for r in rows:
        assert r["developers"] == 2 and "data-dependent" in r["scope"]
        assert r["gamma_min"] > 0 and r["n_for_gamma_one_median"] > 0
    assert set(summary) == {"intrinsic_eps_median_k2", "intrinsic_gamma_median_k2",
                            "intrinsic_eps_median_k4", "intrinsic_gamma_median_k4"}


def test_coordinate_rows_without_noise_repeat_the_nonprivate_ranking(pc, setup):
    out = setup["out"]
    devs = [out[11], out[5]]
    acc = np.array([[0.9, 0.4], [0.3, 0.8]])

    def top1(scores, acc):
        return float(np.mean(acc[np.arange(len(scores)), np.argmax(scores, 1)]))

    rows, summary = pc.coordinate_identification_rows(
        devs, devs, [11, 5], [11, 5], acc, 0.0, 0.0, rank=2, l2_clip=0.05, repeats=3, seed=0,
        top1=top1, scores=None)
    for r in rows:  # each user's own data is its best developer's: top-1 = 0.85 noise-free
        assert r["top1_nonprivate"] == pytest.approx(0.85)
        assert r["top1_acc"] == r["top1_nonprivate"] and r["top1_acc_std"] == 0.0
    assert summary["coord_top1_eps4_k2"] == pytest.approx(0.85)


# --- the hooks in pave_privacy.py ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pp():
    with benchmark_module("pave_privacy") as module:
        yield module


class _Split:
    def __init__(self, texts, labels):
        self.inputs, self.labels = texts, np.asarray(labels)


class _Dev:
    """A developer of the data-scale market: its pool and a model (fixed random logits)."""

    def __init__(self, texts, labels, seed):
        self.train, self.classes = _Split(texts, labels), CLASSES
        self._rng = np.random.default_rng(seed)
        self._logits = {t: self._rng.normal(size=2) for t in texts}

    def logits(self, texts):
        return np.stack([self._logits[t] for t in texts])


def test_data_scale_intrinsic_uses_the_spec_examples_in_order_and_caps_n(tb, pp, pc, setup,
                                                                         monkeypatch):
    """Per n, the rows are intrinsic_rows over each developer's first min(n, held) examples in
    the stratified order (checked against separate passes), and a developer holding fewer than
    n releases on all it holds."""
    subs = {8: sub_lib.random_projection(tb.backbone.params, tb.predicate, 8, seed=8)}
    monkeypatch.setattr(pp.coords, "public_subspaces", lambda tb_, ks, n_public: subs)
    assert pp._public_subspaces(tb, (8,), 16) == (subs, "calibrated on 16 public SQuAD v1.1 "
                                                        "contexts")
    held = (12, 7)
    market = type("M", (), {"developers": [_Dev(_texts(m, seed=10 + j), np.arange(m) % 2, j)
                                           for j, m in enumerate(held)]})()
    ds = dataclasses.replace(pp.make_data_scale_config(True), ns=(5, 10), intrinsic_k=8)
    cfg = dataclasses.replace(pp.make_config(True), data_scale=ds, rank=2, l2_clip=0.05,
                              microbatch=4)
    rows, summary = pp.data_scale_intrinsic(cfg, market, tb, setup["a_key"])
    assert [(r["n"], r["k"]) for r in rows] == [(5, 8), (10, 8)]
    assert set(summary) == {f"intrinsic_{m}_median_k8_n{n}" for m in ("eps", "gamma")
                            for n in (5, 10)} | {"data_scale_intrinsic_subspace"}
    sums = pc.CoordinateSums(tb, pc.a_factors(tb, setup["a_key"], 2), subs, clip=0.05,
                             query_clip=0.05, microbatch=4)
    for n in (5, 10):
        per_dev, dev_n = [], []
        for j, d in enumerate(market.developers):
            order = pp.stratified_order(d.train.labels, ds.seed * 1_000 + j)
            m = min(n, held[j])  # the second developer holds 7 < 10
            texts = [d.train.inputs[i] for i in order[:m]]
            per_dev.append(sums(texts, S.soft_targets(d.logits(texts)), CLASSES)[m])
            dev_n.append(m)
        want, want_summary = pc.intrinsic_rows(per_dev, dev_n, rank=2, query_clip=0.05,
                                               delta=cfg.delta)
        got = [r for r in rows if r["n"] == n][0]
        assert got["median_n"] == float(np.median(dev_n))
        for key in ("gamma_median", "gamma_min", "n_for_gamma_one_median"):
            assert got[key] == pytest.approx(want[0][key], rel=1e-6)
        assert summary[f"intrinsic_gamma_median_k8_n{n}"] == pytest.approx(
            want_summary["intrinsic_gamma_median_k8"], rel=1e-6)


def test_without_the_public_corpus_the_subspace_is_a_labelled_random_projection(tb, pp,
                                                                               monkeypatch):
    from pavejax.assets import AssetMissingError

    def missing(*a, **k):
        raise AssetMissingError("the 'squad' asset is not installed")

    monkeypatch.setattr(pp.coords, "public_subspaces", missing)
    subs, what = pp._public_subspaces(tb, (2, 4), 16)
    assert "random projection" in what and "--with squad" in what
    for k in (2, 4):
        assert subs[k] == sub_lib.random_projection(tb.backbone.params, tb.predicate, k, seed=0)
