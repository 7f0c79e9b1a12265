"""benchmarks/pave_privacy.py: the eps = 4 noise diagnosis on synthetic clipped sums (no market)."""

import dataclasses

import numpy as np
import pytest

from tests._bench import benchmark_module


@pytest.fixture(scope="module")
def pp():
    with benchmark_module("pave_privacy") as module:
        yield module


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
