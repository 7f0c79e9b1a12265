"""benchmarks/pave_privacy.py on synthetic clipped sums (no market): the draw statistics, the
private rows from sums computed once, the paired noise-aware summary and the eps = 4 noise
diagnosis."""

import dataclasses
import math

import numpy as np
import pytest

from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def pp():
    with benchmark_module("pave_privacy") as module:
        yield module


@pytest.fixture(scope="module")
def stats():
    with benchmark_module("_stats") as module:
        yield module


def test_summarize_matches_hand_values(stats):
    s = stats.summarize([0.5, 0.7, 0.6, 0.8])
    std = math.sqrt((0.15 ** 2 + 0.05 ** 2 + 0.05 ** 2 + 0.15 ** 2) / 3)  # ddof = 1
    assert s["n"] == 4
    assert s["mean"] == pytest.approx(0.65)
    assert s["std"] == pytest.approx(std)
    assert s["se"] == pytest.approx(std / 2)
    assert s["ci95"] == pytest.approx([0.65 - 1.96 * std / 2, 0.65 + 1.96 * std / 2])
    # linear interpolation on the sorted draws 0.5, 0.6, 0.7, 0.8: positions 0.075 and 2.925
    assert s["p2_5"] == pytest.approx(0.5075)
    assert s["p97_5"] == pytest.approx(0.7925)
    one = stats.summarize([0.3])
    assert (one["mean"], one["std"], one["se"], one["ci95"]) == (0.3, 0.0, 0.0, [0.3, 0.3])
    f = stats.stat_fields("top1", [1.0, 0.0])
    assert f["top1"] == 0.5 and f["top1_se"] == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    for bad in ([], [0.1, float("nan")], [[0.1, 0.2]]):
        with pytest.raises(ValueError, match="summarize"):
            stats.summarize(bad)


def _market(pp, user_dirs, dim=300, n=10, seed=0):
    """Three developers with orthogonal clipped sums of norm 6 (as devs tuples: clipped sum,
    unused full-weight sum, n, norms, by-clip) and users whose sums are the given mixtures of
    the developer directions plus an off-span part; developer j is the best for a user whose
    largest weight is on j."""
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.normal(size=(dim, 3 + len(user_dirs))))
    devs = [({"k": (6.0 * basis[:, j]).reshape(3, dim // 3).astype(np.float32)}, None, n,
             np.ones(n), None) for j in range(3)]
    users = np.stack([-(np.asarray(w[:3]) @ basis[:, :3].T + w[3] * basis[:, 3 + i]) / n
                      for i, w in enumerate(user_dirs)]).astype(np.float32)
    acc = np.stack([np.where(np.arange(3) == np.argmax(w[:3]), 0.9, 0.5) for w in user_dirs])
    base_devs = np.stack([pp.clipped_vector(d[0], n) for d in devs])
    return devs, users, base_devs, acc


def test_without_noise_every_diagnosis_is_the_noise_free_ranking(pp):
    cfg = dataclasses.replace(pp.make_config(quick=True), repeats=2)
    devs, users, base_devs, acc = _market(pp, [(1.0, 0.5, 0.2, 3.0), (0.1, 0.2, 1.0, 0.0)])
    rows, summary = pp.noise_diagnosis_rows(cfg, devs, users, base_devs, acc,
                                            (None, 1e-9, 4.0))
    want = pp._top1(pp.cosine_scores(users, base_devs), acc)[0]
    assert want == pytest.approx(0.9)
    assert {r["setting"] for r in rows} == {"dev, plain", "dev, true_norm", "dev, debiased_norm",
                                            "dev, query_in_dev_span"}
    for name in ("plain", "true_norm", "debiased_norm", "query_in_dev_span"):
        assert summary[f"diag_eps4_{name}"] == pytest.approx(want)
    # user 0: weights (1, .5, .2) in the span, 3 outside; user 1 lies in the span
    share0 = np.linalg.norm([1.0, 0.5, 0.2]) / np.linalg.norm([1.0, 0.5, 0.2, 3.0])
    assert summary["query_norm_in_dev_span"] == pytest.approx((share0 + 1.0) / 2, rel=1e-5)


def test_plain_repeats_the_main_rows_and_the_span_query_gains_where_the_query_is_off_span(pp):
    cfg = dataclasses.replace(pp.make_config(quick=True), repeats=40)
    sigma = 0.3
    # every user prefers its developer by a small margin and has most of its norm off the span
    weights = [(1.0, 0.8, 0.8, 4.0), (0.8, 1.0, 0.8, 4.0), (0.8, 0.8, 1.0, 4.0)] * 4
    devs, users, base_devs, acc = _market(pp, weights, seed=1)
    _, summary = pp.noise_diagnosis_rows(cfg, devs, users, base_devs, acc, (None, sigma, 4.0))
    # the released score, computed as the main rows compute it (same seeds, same noise)
    main = np.mean([pp._top1(pp.cosine_scores(users, np.stack([
        pp.dp_vector(s, n, sigma, cfg.l2_clip, pp._seed(rep, "dev", j))
        for j, (s, _, n, _, _) in enumerate(devs)])), acc)[0] for rep in range(cfg.repeats)])
    assert summary["diag_eps4_plain"] == pytest.approx(main, abs=1e-12)
    assert summary["diag_eps4_plain"] < 0.85  # the noise costs picks ...
    # ... and the query's off-span part is what picks the noise up: a third of its norm is in
    # the span here, so the span query's score noise is three times smaller
    assert summary["query_norm_in_dev_span"] == pytest.approx(
        np.linalg.norm([1.0, 0.8, 0.8]) / np.linalg.norm([1.0, 0.8, 0.8, 4.0]), rel=1e-5)
    assert summary["diag_eps4_query_in_dev_span"] >= summary["diag_eps4_plain"] + 0.1


def _user_sums(users, n=10):
    """User tuples (clipped sum, -, n, norms, -) whose clipped spec is ``users`` (its rows)."""
    return [({"k": (-row * n).reshape(3, -1).astype(np.float32)}, None, n, np.ones(n), None)
            for row in users]


def _no_gradients(pp, monkeypatch):
    """Every gradient pass of the benchmark raises: rows computed after this use given sums."""
    def refuse(*args, **kwargs):
        raise AssertionError("a gradient pass was called")

    for mod, name in ((pp, "Sums"), (pp._spec_sums, "over_market"),
                      (pp._spec_sums, "ClippedSpecs"), (pp._spec_sums, "weight_grads_fn")):
        monkeypatch.setattr(mod, name, refuse)


def test_private_rows_take_60_draws_from_one_pass_of_sums(pp, monkeypatch):
    from pavejax.pave.noise_aware import noise_aware_scores

    _no_gradients(pp, monkeypatch)
    cfg = dataclasses.replace(pp.make_config(quick=True), epsilons=(4.0,))
    assert cfg.repeats >= 60 and pp.make_config(quick=False).repeats >= 60
    sigma = 0.3
    weights = [(1.0, 0.8, 0.8, 4.0), (0.8, 1.0, 0.8, 4.0), (0.8, 0.8, 1.0, 4.0)]
    devs, users, _, acc = _market(pp, weights, seed=1)
    # unequal data sizes: developer 2 holds 4x the data, so its spec carries 1/4 the noise
    devs[2] = (devs[2][0], None, 40, np.ones(40), None)
    rows, curves, draws = pp.private_rows(cfg, devs, _user_sums(users), acc,
                                          {4.0: (None, sigma, 4.0)})
    # the slow path, independently: one release at a time with the main rows' seeds
    ns = np.array([d[2] for d in devs], np.float64)
    want = {"cosine": [], "debiased": [], "posterior": [], "both": []}
    for rep in range(cfg.repeats):
        dev = np.stack([pp.dp_vector(s, n, sigma, cfg.l2_clip, pp._seed(rep, "dev", j))
                        for j, (s, _, n, _, _) in enumerate(devs)])
        user = np.stack([pp.dp_vector(s, n, sigma, cfg.l2_clip, pp._seed(rep, "user", j))
                         for j, (s, _, n, _, _) in enumerate(_user_sums(users))])
        want["cosine"].append(pp._top1(pp.cosine_scores(users, dev), acc)[0])
        for m in ("debiased", "posterior"):
            want[m].append(pp._top1(noise_aware_scores(users, dev, sigma / ns, m), acc)[0])
        want["both"].append(pp._top1(pp.cosine_scores(user, dev), acc)[0])
    by = {r["setting"]: r for r in rows}
    assert set(by) == {"dev", "both"}
    for row in rows:
        assert row["repeats"] == cfg.repeats >= 60
    np.testing.assert_allclose(draws["dev"][4.0]["cosine"], want["cosine"])
    np.testing.assert_allclose(draws["both"][4.0]["cosine"], want["both"])
    for m in ("debiased", "posterior"):
        np.testing.assert_allclose(draws["dev"][4.0][m], want[m])
    v = np.asarray(want["cosine"])
    assert v.std() > 0  # the draws differ: the noise is redrawn, not reused
    se = v.std(ddof=1) / math.sqrt(len(v))
    row = by["dev"]
    assert row["top1_acc"] == pytest.approx(v.mean())
    assert row["top1_acc_se"] == pytest.approx(se)
    assert [row["top1_acc_ci95_lo"], row["top1_acc_ci95_hi"]] == pytest.approx(
        [v.mean() - 1.96 * se, v.mean() + 1.96 * se])
    assert row["top1_acc_p2_5"] <= row["top1_acc"] <= row["top1_acc_p97_5"]
    d = np.asarray(want["posterior"]) - v
    assert row["posterior_minus_cosine"] == pytest.approx(d.mean())
    assert row["posterior_minus_cosine_se"] == pytest.approx(d.std(ddof=1) / math.sqrt(len(d)))
    assert curves["both"]["cosine"][4.0] == pytest.approx(np.mean(want["both"]))


def test_noise_aware_summary_pairs_the_better_score_with_the_cosine(pp):
    cos = np.array([0.5, 0.6, 0.7, 0.6])
    deb = np.array([0.6, 0.6, 0.8, 0.6])  # mean 0.65
    post = np.array([0.7, 0.6, 0.7, 0.8])  # mean 0.70: the better one
    per = {"cosine": cos, "debiased": deb, "posterior": post}
    s = pp.noise_aware_summary({"dev": {4.0: per}, "both": {4.0: per}})
    assert s["top1_eps4"] == pytest.approx(0.6)
    assert s["top1_eps4_noiseaware"] == pytest.approx(0.7)
    assert s["noiseaware_method_eps4"] == "posterior"
    # paired differences 0.2, 0, 0, 0.2: mean 0.1, sample std sqrt(4 * 0.01 / 3)
    se = math.sqrt(0.04 / 3) / 2
    assert s["noiseaware_minus_cosine_eps4"] == pytest.approx(0.1)
    assert s["noiseaware_minus_cosine_eps4_se"] == pytest.approx(se)
    assert s["top1_eps4_ci95"] == pytest.approx(
        [0.6 - 1.96 * math.sqrt(0.02 / 3) / 2, 0.6 + 1.96 * math.sqrt(0.02 / 3) / 2])
    assert s["top1_eps4_debiased"] == pytest.approx(0.65)
    assert pp.noise_aware_summary({"dev": {}, "both": {}})["top1_eps4"] is None


def test_release_draws_equal_the_one_at_a_time_release(pp):
    rng = np.random.default_rng(3)
    sums = [{"a": rng.normal(size=(2, 5)).astype(np.float32),
             "b": rng.normal(size=(3, 4)).astype(np.float32)} for _ in range(3)]
    ns, seeds = [7, 9, 11], np.arange(15).reshape(5, 3) + 100
    out = list(pp.release_draws(sums, ns, 0.7, 2.0, seeds, chunk=2))  # a padded last block
    assert len(out) == 5
    for r, block in enumerate(out):
        for j in range(3):
            np.testing.assert_allclose(block[j], pp.dp_vector(sums[j], ns[j], 0.7, 2.0,
                                                              int(seeds[r, j])), rtol=1e-6,
                                       atol=1e-6)
    with pytest.raises(ValueError, match="seeds must be"):
        next(pp.release_draws(sums, ns, 0.7, 2.0, seeds[:, :2]))


def test_data_scale_rows_cap_developers_and_find_n_star(pp, monkeypatch):
    """Developer j's clipped sum over its first n examples is n e_j (unit per-example
    gradients along its own axis), so its released spec is -e_j plus noise of std sigma C / n:
    noise-dominated at n = 16, clean at n = 256. Developer 2 holds 128 examples only."""
    _no_gradients(pp, monkeypatch)
    dim, sigma = 300, 8.0
    ds = dataclasses.replace(pp.make_data_scale_config(quick=True), ns=(16, 256),
                             epsilons=(4.0,))
    cfg = dataclasses.replace(pp.make_config(quick=True), data_scale=ds)
    eye = np.eye(dim)
    held = [256, 256, 128]
    devs = [({n: n * eye[j] for n in (16, 128, 256) if n <= held[j]}, held[j], np.ones(held[j]))
            for j in range(3)]
    # user i prefers developer i by a clear margin; a part of its query is off the span
    weights = np.array([[1.0, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 1.0]])
    queries = -(weights @ eye[:3] + eye[3 + np.arange(3)])
    users = [(-q * 10, 10) for q in queries]
    acc = np.where(np.eye(3) > 0, 0.9, 0.5)
    names = ["a", "b", "c"]
    rows, summary = pp.data_scale_rows(cfg, devs, users, acc, {4.0: (None, sigma, 4.0)}, names)
    assert len(rows) == 4  # per n: non-private and eps = 4
    by = {(r["n"], r["epsilon"]): r for r in rows}
    assert by[(256, 4.0)]["capped_developers"] == 1 and by[(256, 4.0)]["n_min"] == 128
    assert by[(256, 4.0)]["n_mean"] == pytest.approx((256 + 256 + 128) / 3)
    assert by[(16, 4.0)]["capped_developers"] == 0
    assert summary["data_scale_capped"] == {"256": ["c"]}
    for n in (16, 256):
        assert summary[f"top1_nonprivate_n{n}"] == pytest.approx(0.9)
        assert by[(n, 4.0)]["repeats"] == cfg.repeats >= 60
    # n = 16: score noise sigma / n = 0.5 per unit query against a margin of 0.32
    assert summary["top1_eps4_best_n16"] < 0.8
    # n = 256 (developer 2 at 128): noise <= 0.0625, the margin five times that
    assert summary["top1_eps4_n256"] >= 0.89
    assert summary["n_star_eps4"] == 256
    assert summary["top1_eps4_n2048"] is None and summary["top1_nonprivate_n2048"] is None


def test_prefix_sums_are_the_sums_of_the_first_n_clipped_gradients(pp, monkeypatch):
    from types import SimpleNamespace

    ss = pp._spec_sums
    rng = np.random.default_rng(5)
    g = rng.normal(size=(10, 6))

    def batches(tb, texts, targets, size):
        for i in range(0, len(texts), size):
            idx = np.arange(i, min(i + size, len(texts)))
            real = len(idx)
            yield np.concatenate([idx, np.repeat(idx[:1], size - real)]), None, real

    monkeypatch.setattr(ss, "microbatches", batches)
    sums = ss.ClippedPrefixSums.__new__(ss.ClippedPrefixSums)
    sums.tb, sums.microbatch = SimpleNamespace(head=lambda classes: None), 4
    sums._clipped = lambda head, idx, mask: (g[idx], np.linalg.norm(g[idx], axis=1))
    out, norms = sums(list("abcdefghij"), None, ("x", "y"), [3, 4, 9, 10, 12])
    assert sorted(out) == [3, 4, 9, 10]  # 12 > the 10 examples held
    for n, v in out.items():
        np.testing.assert_allclose(v, g[:n].sum(axis=0))
    np.testing.assert_allclose(norms, np.linalg.norm(g, axis=1))
    with pytest.raises(ValueError, match="positive"):
        sums(list("ab"), None, ("x", "y"), [0])


def test_stratified_order_balances_every_prefix(pp):
    labels = np.array([0] * 30 + [1] * 10 + [2] * 20)
    order = pp.stratified_order(labels, seed=4)
    assert sorted(order) == list(range(60))
    for n in range(1, 31):  # while every class still has examples: within one of n / 3
        counts = np.bincount(labels[order[:n]], minlength=3)
        assert counts.max() - counts.min() <= 1
    assert not np.array_equal(order, pp.stratified_order(labels, seed=5))
