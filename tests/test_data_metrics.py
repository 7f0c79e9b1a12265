"""Tests of pavejax.data.metrics: class-identity accuracy and ranking metrics, by hand."""

import numpy as np
import pytest

from pavejax.data import class_identity_accuracy, oracle_best, ranking_metrics


def test_class_identity_accuracy_by_hand():
    logits = np.array([[3.0, 2.0, 9.0], [1.0, 2.0, 9.0], [0.0, 0.0, 0.0]], np.float32)
    # "7" is not a user class, so it is never predicted; a tie goes to the first model class.
    assert class_identity_accuracy(logits, ("5", "6", "7"), np.array([1, 0, 0]),
                                   ("6", "5")) == pytest.approx(2 / 3)
    # Sharing only "5": always predicts "5", right exactly on the "5"s.
    assert class_identity_accuracy(logits[:, :2], ("5", "8"), np.array([0, 1, 0]),
                                   ("5", "6")) == pytest.approx(2 / 3)
    assert class_identity_accuracy(logits[:, :2], ("8", "9"), np.array([0, 1, 0]),
                                   ("5", "6")) == 0.0
    with pytest.raises(ValueError, match="logits must have shape"):
        class_identity_accuracy(logits, ("5", "6"), np.array([0, 1, 0]), ("5", "6"))


def test_ranking_metrics_by_hand():
    acc = np.array([[0.9, 0.5, 0.9], [0.2, 0.8, 0.6], [0.7, 0.7, 0.1]])
    scores = np.array([[0.1, 0.9, 0.5], [0.3, 0.9, 0.1], [0.5, 0.5, 0.9]])
    m = ranking_metrics(scores, acc)
    # user 0: picks dev 1 (0.5; oracle 0.9), best-scored oracle dev 2 is 2nd
    # user 1: picks the oracle; user 2: picks dev 2 (0.1; oracle 0.7), oracle devs tie 2nd
    np.testing.assert_array_equal(m.hits, [False, True, False])
    np.testing.assert_allclose(m.regrets, [0.4, 0.0, 0.6], atol=1e-12)
    np.testing.assert_allclose(m.reciprocal_ranks, [0.5, 1.0, 0.5])
    assert m.top1_hit_rate == pytest.approx(1 / 3)
    assert m.regret == pytest.approx(1 / 3)
    assert m.mrr == pytest.approx(2 / 3)


def test_ranking_metrics_ties():
    # Ties in scores count against the method: constant scores choose the worst model.
    m = ranking_metrics(np.array([[1.0, 1.0, 1.0]]), np.array([[0.5, 0.8, 0.8]]))
    assert (m.top1_hit_rate, m.regret, m.mrr) == (0.0, pytest.approx(0.3), 0.5)
    # Ties in accuracy: any oracle-best model is a hit.
    m = ranking_metrics(np.array([[0.2, 0.9, 0.5]]), np.array([[0.8, 0.8, 0.1]]))
    assert (m.top1_hit_rate, m.regret, m.mrr) == (1.0, 0.0, 1.0)
    # atol widens the oracle set.
    assert ranking_metrics(np.array([[0.0, 1.0]]), np.array([[0.80, 0.79]]),
                           atol=0.02).top1_hit_rate == 1.0
    assert ranking_metrics(np.array([[0.0, 1.0]]), np.array([[0.80, 0.79]])).mrr == 0.5
    np.testing.assert_array_equal(oracle_best(np.array([[0.1, 0.7, 0.7], [0.9, 0.0, 0.3]])),
                                  [1, 0])


def test_ranking_metrics_rejects_bad_input():
    with pytest.raises(ValueError, match="of one shape"):
        ranking_metrics(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="finite"):
        ranking_metrics(np.array([[np.nan, 1.0]]), np.zeros((1, 2)))
    with pytest.raises(ValueError, match="atol must be >= 0"):
        ranking_metrics(np.zeros((1, 2)), np.zeros((1, 2)), atol=-0.1)
