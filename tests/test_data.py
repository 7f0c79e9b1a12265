"""Tests of pavejax.data: parsing, published counts, deterministic stratified splits,
derived class tasks, few-shot selection and batching."""

import collections
import gzip
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from pavejax.assets import AssetMissingError
from pavejax.data import (
    SENTIMENT_DOMAINS,
    Split,
    Task,
    binarize_ratings,
    class_subset_task,
    few_shot,
    group_classes_task,
    iterate_batches,
    list_tasks,
    load_bbc,
    load_digits,
    load_mnist5k,
    load_sentiment,
    load_sentiment_raw,
    load_task,
    split_task,
    stratified_split,
    stratified_subsample,
    task_fingerprint,
)
from pavejax.data.text import decode_text, parse_sentiment_file
from pavejax.data.vision import parse_mnist_csv

# Published statistics of the VADER/ICWSM-2014 sets: (total, rating > 0, rating < 0, rating == 0,
# kept positive, kept negative) with kept meaning |rating| >= 0.5.
PUBLISHED = {
    "movie": (10_605, 5_242, 5_326, 37, 4_996, 5_076),
    "amazon": (3_708, 2_128, 1_482, 98, 1_750, 1_235),
    "nyt": (5_190, 2_204, 2_742, 244, 1_187, 1_783),
    "tweets": (4_200, 2_897, 1_299, 4, 2_345, 1_087),
}
BBC_COUNTS = {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}


def _synthetic_task(counts=(20, 10, 30, 5, 15), seed=0, name="toy"):
    """Image task whose first feature stores the original label, the second a unique id."""
    labels = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    x = np.stack([labels, np.arange(labels.size)], axis=1).astype(np.float32)
    return split_task(name, x, labels, [f"c{i}" for i in range(len(counts))], seed=seed)


# --- parsing ----------------------------------------------------------------------------------


def test_parse_sentiment_file_format(tmp_path):
    path = tmp_path / "gt.txt"
    text_with_separator = "odd\u2028line"  # must not be split like str.splitlines would
    path.write_bytes(f"1\t2.5\tGood.\r\n2_3\t-0.25\t{text_with_separator}\r\n3\t0\tMeh".encode())
    ids, ratings, texts = parse_sentiment_file(path)
    assert ids == ("1", "2_3", "3")
    np.testing.assert_array_equal(ratings, [2.5, -0.25, 0.0])
    assert texts == ("Good.", text_with_separator, "Meh")
    path.write_bytes(b"1\t2.5\tGood.\r\n2\tno tab here\r\n")
    with pytest.raises(ValueError, match=r"gt.txt:2: expected 'id<TAB>rating<TAB>text'"):
        parse_sentiment_file(path)
    path.write_bytes(b"1\tgood\tGood.\r\n")
    with pytest.raises(ValueError, match="rating 'good' is not a number"):
        parse_sentiment_file(path)


def test_binarize_ratings_hand_case():
    keep, labels = binarize_ratings(np.array([-4.0, -0.5, -0.49, 0.0, 0.3, 0.5, 2.0]))
    np.testing.assert_array_equal(keep, [0, 1, 5, 6])
    np.testing.assert_array_equal(labels, [0, 0, 1, 1])
    assert labels.dtype == np.int32
    keep0, labels0 = binarize_ratings(np.array([-0.1, 0.0, 0.1]), min_abs_rating=0.0)
    np.testing.assert_array_equal(keep0, [0, 2])
    np.testing.assert_array_equal(labels0, [0, 1])
    with pytest.raises(ValueError, match="min_abs_rating must be >= 0"):
        binarize_ratings(np.zeros(2), -1.0)


def test_decode_text_is_utf8_then_latin1():
    assert decode_text(b"\xc2\xa3600m") == "\u00a3600m"
    assert decode_text(b"\xa315.8m") == "\u00a315.8m"


def test_parse_mnist_csv_label_last(tmp_path):
    path = tmp_path / "m.csv.gz"
    rows = [[0] * 783 + [255, 7], [51] * 784 + [0]]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    x, y = parse_mnist_csv(path)
    assert x.dtype == np.float32 and x.shape == (2, 784)
    np.testing.assert_array_equal(y, np.array([7, 0], np.int32))
    assert x[0, 783] == 1.0 and x[0, :783].max() == 0.0
    np.testing.assert_allclose(x[1], np.full(784, 0.2, np.float32))


# --- real data: published counts --------------------------------------------------------------


@pytest.mark.assets
@pytest.mark.parametrize("domain", list(PUBLISHED))
def test_sentiment_counts_match_published(domain):
    total, pos, neg, zero, kept_pos, kept_neg = PUBLISHED[domain]
    ids, ratings, texts = load_sentiment_raw(domain)
    assert len(ids) == len(texts) == ratings.shape[0] == total == SENTIMENT_DOMAINS[domain].total
    assert len(set(ids)) == total
    assert ((ratings > 0).sum(), (ratings < 0).sum(), (ratings == 0).sum()) == (pos, neg, zero)
    assert ratings.min() >= -4 and ratings.max() <= 4
    pool_texts, labels, meta = load_sentiment(domain)
    assert labels.dtype == np.int32 and set(labels.tolist()) == {0, 1}
    assert ((labels == 1).sum(), (labels == 0).sum()) == (kept_pos, kept_neg)
    assert meta["n_raw"] == total and len(pool_texts) == kept_pos + kept_neg


@pytest.mark.assets
def test_sentiment_known_lines_and_filter():
    ids, ratings, texts = load_sentiment_raw("movie")
    assert ids[0] == "1" and ratings[0] == pytest.approx(2.26666666667)
    assert texts[0].startswith("The Rock is destined to be the 21st Century's new ''Conan''")
    cases = [  # (domain, id, rating, kept, label)
        ("tweets", "643", -0.5, True, 0), ("tweets", "992", 0.5, True, 1),
        ("nyt", "1_1", 0.4, False, None), ("amazon", "1_2", -0.15, False, None),
        ("amazon", "1_1", -0.9, True, 0),
    ]
    for domain, row_id, rating, kept, label in cases:
        ids, ratings, texts = load_sentiment_raw(domain)
        i = ids.index(row_id)
        assert ratings[i] == rating
        pool_texts, labels, _ = load_sentiment(domain)
        keep, _ = binarize_ratings(ratings)
        assert (i in set(keep.tolist())) == kept
        if kept:
            assert labels[int(np.flatnonzero(keep == i)[0])] == label
            assert texts[i] in pool_texts


@pytest.mark.assets
def test_bbc_counts_classes_and_decoding():
    texts, labels, classes, meta = load_bbc()
    assert classes == tuple(sorted(BBC_COUNTS))
    assert dict(zip(classes, np.bincount(labels).tolist())) == BBC_COUNTS
    assert len(texts) == meta["n_raw"] == 2_225
    assert not any("\ufffd" in t for t in texts)
    assert any("\u00a315.8m" in t for t in texts)  # the one Latin-1 file, decoded
    assert texts[0].startswith("Ad sales boost Time Warner profit")  # business/001.txt


@pytest.mark.assets
def test_images_shapes_ranges_and_independent_reference():
    x, y, _ = load_digits()
    assert x.shape == (1_797, 64) and x.dtype == np.float32 and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    ref = sklearn_datasets.load_digits()
    np.testing.assert_array_equal(x, (ref.data / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y, ref.target)
    xm, ym, meta = load_mnist5k()
    assert xm.shape == (5_000, 784) and xm.dtype == np.float32 and ym.dtype == np.int32
    assert xm.min() == 0.0 and xm.max() == 1.0
    assert np.bincount(ym).tolist() == [500] * 10
    assert meta["image_shape"] == (28, 28)
    with pytest.raises(ValueError, match="read-only"):
        xm[0, 0] = 1.0


# --- splits ---------------------------------------------------------------------------------


def test_stratified_split_hand_counts():
    labels = np.array([0] * 10 + [1] * 5 + [2] * 1)
    train, dev, test = stratified_split(labels, dev_fraction=0.1, test_fraction=0.2, seed=3)
    # test: 0.2*10=2, 0.2*5=1, 0.2*1=0.2->0; dev: 0.1*10=1, 0.1*5=0.5->1 (half up), 0.1->0
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 0]
    assert np.bincount(labels[dev], minlength=3).tolist() == [1, 1, 0]
    assert np.bincount(labels[train], minlength=3).tolist() == [7, 3, 1]
    together = np.concatenate([train, dev, test])
    assert sorted(together.tolist()) == list(range(16))
    again = stratified_split(labels, dev_fraction=0.1, test_fraction=0.2, seed=3)
    for a, b in zip((train, dev, test), again):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="sum < 1"):
        stratified_split(labels, dev_fraction=0.5, test_fraction=0.5)


def test_stratified_subsample_largest_remainder():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    assert np.bincount(labels[stratified_subsample(labels, 10)]).tolist() == [5, 3, 2]
    # exact shares 3.5, 2.1, 1.4 -> floors 3, 2, 1; the one left goes to the largest remainder
    assert np.bincount(labels[stratified_subsample(labels, 7)]).tolist() == [4, 2, 1]
    with pytest.raises(ValueError, match="cannot keep 101 of 100"):
        stratified_subsample(labels, 101)


@pytest.mark.assets
@pytest.mark.parametrize("name", ["movie", "bbc"])
def test_task_splits_disjoint_covering_stratified(name):
    task = load_task(name)
    if name == "movie":
        pool, pool_labels, _ = load_sentiment("movie")
    else:
        pool, pool_labels, _, _ = load_bbc()
    parts = task.train.inputs + task.dev.inputs + task.test.inputs
    assert collections.Counter(parts) == collections.Counter(pool)
    for c in range(task.num_classes):
        n_c = int((pool_labels == c).sum())
        assert task.test.counts(task.num_classes)[c] == int(np.floor(0.2 * n_c + 0.5))
        assert task.dev.counts(task.num_classes)[c] == int(np.floor(0.1 * n_c + 0.5))
    assert task.metadata["n_per_class"]["test"] == dict(
        zip(task.label_names, task.test.counts(task.num_classes)))
    assert task.modality == "text" and task.metadata["seed"] == 0


@pytest.mark.assets
def test_splits_identical_in_a_subprocess_and_seed_dependent():
    names = ["tweets", "bbc", "mnist5k_pair_7_9"]
    local = [task_fingerprint(load_task(n, max_train=300)) for n in names]
    code = ("from pavejax.data import load_task, task_fingerprint\n"
            f"for n in {names!r}: print(task_fingerprint(load_task(n, max_train=300)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), check=True, timeout=120)
    assert out.stdout.split() == local
    assert task_fingerprint(load_task("tweets", seed=1, max_train=300)) != local[0]


@pytest.mark.assets
def test_load_task_caps_and_options():
    task = load_task("amazon", max_train=100, max_test=50)
    assert len(task.train) == 100 and len(task.test) == 50
    full = load_task("amazon")
    assert len(task.dev) == len(full.dev)
    # stratified cap: class shares of the full train split, largest remainder
    share = np.array(full.train.counts(2)) * 100 / len(full.train)
    assert np.all(np.abs(np.array(task.train.counts(2)) - share) < 1)
    assert set(task.train.inputs) <= set(full.train.inputs)
    strict = load_task("amazon", min_abs_rating=2.0)
    _, ratings, _ = load_sentiment_raw("amazon")
    assert len(strict.train) + len(strict.dev) + len(strict.test) == int(
        (np.abs(ratings) >= 2.0).sum())
    with pytest.raises(ValueError, match="min_abs_rating applies to the sentiment tasks"):
        load_task("bbc", min_abs_rating=1.0)


def test_unknown_task_lists_known_ones():
    with pytest.raises(ValueError, match="unknown task 'sst2'; known tasks: movie, amazon"):
        load_task("sst2")
    assert {"movie", "amazon", "nyt", "tweets", "bbc", "digits_pretrain",
            "mnist5k_even_odd"} <= set(list_tasks())
    assert set(list_tasks("text")) == {"movie", "amazon", "nyt", "tweets", "bbc"}


def test_missing_asset_error_from_load_task(monkeypatch, tmp_path):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    with pytest.raises(AssetMissingError, match="pavejax assets"):
        load_task("tweets")
    with pytest.raises(AssetMissingError, match="pavejax assets"):
        load_task("mnist5k_pretrain")


# --- derived tasks, few-shot, validation ------------------------------------------------------


def test_class_subset_relabels_and_keeps_splits():
    base = _synthetic_task()
    sub = class_subset_task(base, [3, 1], name="sub")
    assert sub.label_names == ("c3", "c1") and sub.metadata["base_task"] == "toy"
    for split_name in ("train", "dev", "test"):
        b, s = getattr(base, split_name), getattr(sub, split_name)
        original = s.inputs[:, 0].astype(np.int32)
        np.testing.assert_array_equal(s.labels, np.where(original == 3, 0, 1))
        keep = np.isin(b.labels, [3, 1])
        np.testing.assert_array_equal(s.inputs, b.inputs[keep])  # same examples, same order
    with pytest.raises(ValueError, match="disjoint labels of task 'toy'"):
        class_subset_task(base, [1, 7], name="bad")
    with pytest.raises(ValueError, match="disjoint"):
        class_subset_task(base, [1, 1], name="bad")


def test_group_classes_even_odd():
    base = _synthetic_task(counts=(8, 9, 10, 11))
    eo = group_classes_task(base, [[0, 2], [1, 3]], name="eo", label_names=("even", "odd"))
    original = eo.train.inputs[:, 0].astype(np.int32)
    np.testing.assert_array_equal(eo.train.labels, original % 2)
    assert len(eo.train) + len(eo.dev) + len(eo.test) == 38


@pytest.mark.assets
def test_registered_derived_digit_tasks():
    base = load_task("digits")
    late = load_task("digits_5to9")
    assert late.label_names == ("5", "6", "7", "8", "9")
    np.testing.assert_array_equal(late.test.inputs[late.test.labels == 0],
                                  base.test.inputs[base.test.labels == 5])
    eo = load_task("mnist5k_even_odd")
    assert eo.label_names == ("even", "odd") and eo.test.counts(2) == (500, 500)
    pre = load_task("digits_pretrain")
    assert set(pre.train.labels.tolist()) == set(range(5))


def test_few_shot_counts_and_determinism():
    task = _synthetic_task()
    fs = few_shot(task, 3, seed=5)
    assert fs.train.counts(5) == (3, 3, 3, 3, 3)
    assert fs.metadata["shots_per_class"] == 3
    np.testing.assert_array_equal(fs.test.inputs, task.test.inputs)
    ids = set(fs.train.inputs[:, 1].tolist())
    assert ids <= set(task.train.inputs[:, 1].tolist())
    np.testing.assert_array_equal(few_shot(task, 3, seed=5).train.inputs, fs.train.inputs)
    assert ids != set(few_shot(task, 3, seed=6).train.inputs[:, 1].tolist())
    # class c3 has 5 examples, 1 of them in test and 1 in dev (half up of 0.5) -> 3 in train
    with pytest.raises(ValueError, match=r"too few training examples for 4 shots.*'c3': 3"):
        few_shot(task, 4)
    with pytest.raises(ValueError, match="shots_per_class must be >= 1"):
        few_shot(task, 0)


def test_split_and_task_validation():
    with pytest.raises(TypeError, match="float32"):
        Split(np.zeros((3, 2)), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="3 inputs but 2 labels"):
        Split(["a", "b", "c"], np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="list of str"):
        Split(["a", 1], np.zeros(2, np.int32))
    ok = Split(["a", "b"], np.array([0, 1]))
    assert ok.labels.dtype == np.int32
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        Task("t", ("n", "p"), Split(["a"], np.array([2])), ok, ok)


# --- batching ---------------------------------------------------------------------------------


def test_iterate_batches_cover_and_drop_last():
    batches = list(iterate_batches(10, 4, 0))
    assert [b.size for b in batches] == [4, 4, 2]
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    assert all(b.dtype == np.int32 for b in batches)
    assert [b.size for b in iterate_batches(10, 4, 0, drop_last=True)] == [4, 4]
    assert [b.tolist() for b in iterate_batches(5, 2, None)] == [[0, 1], [2, 3], [4]]
    same = list(iterate_batches(10, 4, 0))
    assert all(np.array_equal(a, b) for a, b in zip(batches, same))


def test_iterate_batches_with_jax_key(key):
    keyed = np.concatenate(list(iterate_batches(12, 5, key)))
    np.testing.assert_array_equal(keyed, np.asarray(jax.random.permutation(key, 12)))
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        next(iterate_batches(4, 0, 0))
    with pytest.raises(TypeError, match="key_or_seed must be a JAX PRNG key"):
        next(iterate_batches(4, 2, "seed"))
