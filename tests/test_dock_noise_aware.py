"""Dock.search(score=...): noise-aware ranking over a dock of private and non-private specs on a
tiny model. The ranking equals noise_aware_scores over the stored vectors with each spec's
closed-form noise level, ties break by id, unsupported specs are refused by name (and cosine
search still works), and removing them makes the dock searchable again."""

import dataclasses

import numpy as np
import pytest

from pavejax.pave import noise_aware as na, spec as S
from pavejax.pave.dock import Dock
from tests import _toy

D_IN, K = _toy.D_IN, _toy.K
LR, CLIP = 0.7, 0.5
_logits, _kernels = _toy.logits, _toy.kernels


@pytest.fixture(scope="module")
def market(tmp_path_factory):
    rng = np.random.default_rng(2)
    bb = _toy.tanh_mlp(rng)
    dock = Dock.create(tmp_path_factory.mktemp("dock") / "dock")
    base = S.SpecConfig.preset("one_step", rank=2, progress=False, learning_rate=LR)

    def task(j, n):
        x = rng.normal(size=(n, D_IN)).astype(np.float32)
        return {"x": x}, S.hard_targets((x[:, j % D_IN] > 0).astype(np.int32), K)

    def make(j, n, sigma):
        inputs, targets = task(j, n)
        cfg = base if sigma is None else dataclasses.replace(
            base, privacy=S.PrivacyConfig(l2_clip=CLIP, noise_multiplier=sigma, sampling="full"))
        return S.generate_spec(_logits, bb, _kernels, inputs, targets, dock.a_key(), cfg).spec

    # (task, n, sigma): one non-private spec, private ones with noise levels that differ 10x
    plan = [(0, 40, None), (0, 40, 0.5), (1, 30, 2.0), (2, 60, 5.0), (3, 20, 1.0), (4, 50, 3.0)]
    want_std = {}
    for j, (t, n, sigma) in enumerate(plan):
        i = dock.submit(make(t, n, sigma), name=f"dev{j}")
        want_std[i] = 0.0 if sigma is None else LR * sigma * CLIP / n
    inputs, targets = task(0, 40)
    query = S.generate_spec(_logits, bb, _kernels, inputs, targets, dock.a_key(), base,
                            kind="user").spec
    adam = dataclasses.replace(base, optimizer="adam",
                               privacy=S.PrivacyConfig(l2_clip=CLIP, noise_multiplier=1.0,
                                                       sampling="full"))
    adam_spec = S.generate_spec(_logits, bb, _kernels, *task(5, 30), dock.a_key(), adam).spec
    return {"dock": dock, "query": query, "want_std": want_std, "adam": adam_spec}


def test_noise_aware_search_is_noise_aware_scores_over_the_stored_specs(market):
    dock, query, want_std = market["dock"], market["query"], market["want_std"]
    ids = sorted(want_std)
    stored = np.stack([dock.load_spec(i).vector for i in ids]).astype(np.float64)
    stds = np.array([want_std[i] for i in ids])
    for i in ids:  # the stated noise level is the closed form of the config it was made with
        assert na.spec_noise_std(dock.load_spec(i)) == pytest.approx(want_std[i], rel=1e-12)
    cos = na.noise_aware_scores(query.vector, stored, stds, "cosine")[0]
    for method in ("debiased", "posterior"):
        want = na.noise_aware_scores(query.vector, stored, stds, method)[0]
        res = dock.search(query, k=4, score=method)
        order = np.argsort(-want, kind="stable")[:4]
        assert res.method == method and res.ids == tuple(ids[j] for j in order)
        assert res.names == tuple(f"dev{ids.index(i)}" for i in res.ids)
        np.testing.assert_allclose(res.ranking, want[order], rtol=1e-6)
        np.testing.assert_allclose(res.cosines, cos[order], rtol=1e-5, atol=1e-7)
        assert np.all(np.diff(res.ranking) <= 0)
    # the noise-aware scores do change the ranking's numbers against the plain cosine here
    deb = dock.search(query, k=6, score="debiased")
    assert not np.allclose(deb.ranking, deb.cosines)
    plain = dock.search(query, k=6)
    assert plain.method == "cosine" and np.array_equal(plain.ranking, plain.cosines)
    # a batch of queries gives one result per query, equal to single searches
    both = dock.search([query, query], k=3, score="posterior")
    assert [r.ids for r in both] == [dock.search(query, k=3, score="posterior").ids] * 2


def test_ties_break_by_lower_id(market, tmp_path):
    src = market["dock"]
    dock = Dock.create(tmp_path / "twins")
    spec = src.load_spec(2)
    # the same release under three names (identical vectors and noise levels: equal scores)
    for name in ("c", "a", "b"):
        dock.submit(spec, name=name)
    res = dock.search(market["query"], k=3, score="debiased")
    assert res.ids == (1, 2, 3) and res.names == ("c", "a", "b")


def test_unsupported_specs_are_refused_by_name_and_removing_them_restores_search(market):
    dock, query = market["dock"], market["query"]
    before = dock.search(query, k=6, score="posterior")
    i = dock.submit(market["adam"], name="adam-dev")
    with pytest.raises(ValueError, match=r"'adam-dev' \(id \d+\) cannot be ranked.*adaptive"):
        dock.search(query, k=3, score="debiased")
    assert dock.search(query, k=7).ids  # cosine search is unaffected
    dock.remove(i)
    again = dock.search(query, k=6, score="posterior")
    assert again.ids == before.ids
    np.testing.assert_array_equal(again.ranking, before.ranking)
    with pytest.raises(ValueError, match="score must be one of"):
        dock.search(query, k=3, score="l2")
    empty = Dock.create(dock.path.parent / "empty")
    assert empty.search(query, k=3, score="debiased").ids == ()


def test_scores_a_last_bit_apart_are_ties():
    """Equal specs can score a last bit apart (BLAS reduces rows of one product in different
    orders, which made the twins above rank 3, 1, 2 on one machine): such scores are one tie,
    ordered by id; scores further apart keep their order."""
    from pavejax.pave.dock import _rank_with_ties

    s = np.array([0.5, 0.7, 0.7 + 1e-16, 0.7 - 2e-16, 0.1, 0.7 - 1e-9])
    ids = np.array([9, 5, 3, 4, 1, 2])
    assert ids[_rank_with_ties(s, ids)].tolist() == [3, 4, 5, 2, 9, 1]
