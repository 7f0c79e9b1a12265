"""Learnware market: determinism, a computed oracle, disjoint data, bad configs, and the
developers' trainers (default constant-rate Adam; the tuned-recipe AdamW)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pavejax import recipes
from pavejax.data import Split, Task, oracle_best
from pavejax.experiments import (
    MarketConfig,
    build_market,
    developer_classifier,
    evaluate_market,
    example_hashes,
    market as mk,
)
from pavejax.optim import promotion_safe

SMALL = MarketConfig(track="vision", n_developers=8, n_users=4, shots_per_class=3, seed=0,
                     train_per_class=48, test_per_class=24, train_steps=120, backbone_steps=200)


@pytest.fixture(scope="module")
def market():
    # cache=False: tests must not write the user's cache directory.
    return build_market(SMALL, progress=False, cache=False)


@pytest.fixture(scope="module")
def accuracy(market):
    return evaluate_market(market)


def hashes(split):
    return set(example_hashes(split.inputs))


@pytest.mark.assets
def test_same_config_same_market(market, accuracy):
    again = build_market(SMALL, progress=False, cache=False)
    np.testing.assert_array_equal(evaluate_market(again), accuracy)
    assert [d.name for d in again.developers] == [d.name for d in market.developers]
    for a, b in zip(again.users, market.users):
        assert a.classes == b.classes
        np.testing.assert_array_equal(a.few_shot.inputs, b.few_shot.inputs)
        np.testing.assert_array_equal(a.few_shot.labels, b.few_shot.labels)
        np.testing.assert_array_equal(a.test.inputs, b.test.inputs)
    for a, b in zip(again.developers, market.developers):
        np.testing.assert_array_equal(a.head.kernel[...], b.head.kernel[...])
        np.testing.assert_array_equal(a.head.bias[...], b.head.bias[...])


@pytest.mark.assets
def test_market_composition(market):
    qualities = [d.quality for d in market.developers]
    assert (qualities.count("good"), qualities.count("undertrained"),
            qualities.count("corrupted")) == (4, 2, 2)
    assert len(market.users) == 4
    assert {d.domain for d in market.developers} == {"digits", "mnist5k"}
    for d in market.developers:
        assert set(d.classes) <= {"5", "6", "7", "8", "9"} and len(d.classes) in (2, 3)
        assert d.head.kernel[...].shape == (SMALL.hidden, len(d.classes))
        assert len(d.train) == SMALL.train_per_class * len(d.classes)
    for u in market.users:
        # every user has a good developer of its own domain and classes in the market
        assert any(d.quality == "good" and d.domain == u.domain and d.classes == u.classes
                   for d in market.developers)
        k = len(u.classes)
        assert u.few_shot.counts(k) == (SMALL.shots_per_class,) * k
        assert min(u.test.counts(k)) >= 1 and max(u.test.counts(k)) <= SMALL.test_per_class


@pytest.mark.assets
def test_corrupted_labels_are_moved_to_the_next_class(market):
    # Developers of one pool share training inputs; a corrupted one trained on the same inputs
    # as a good one of its classes with the given fraction of labels shifted by one class.
    for bad in (d for d in market.developers if d.quality == "corrupted"):
        good = next(d for d in market.developers if d.quality == "good"
                    and (d.domain, d.classes) == (bad.domain, bad.classes))
        np.testing.assert_array_equal(good.train.inputs, bad.train.inputs)
        k, changed = len(bad.classes), good.train.labels != bad.train.labels
        assert changed.sum() == int(np.floor(SMALL.corrupt_label_fraction * len(bad.train) + 0.5))
        np.testing.assert_array_equal(bad.train.labels[changed],
                                      (good.train.labels[changed] + 1) % k)


@pytest.mark.assets
def test_oracle_is_measured(market, accuracy):
    devs, users = market.developers, market.users
    assert accuracy.shape == (len(users), len(devs))
    compared = 0
    for u, user in enumerate(users):
        same = [i for i, d in enumerate(devs) if (d.domain, d.classes) == (user.domain,
                                                                            user.classes)]
        good = [i for i in same if devs[i].quality == "good"]
        for i in same:
            if devs[i].quality == "corrupted":
                assert accuracy[u, i] < accuracy[u, good].max() - 0.2
                compared += 1
        best = devs[oracle_best(accuracy)[u]]
        assert set(user.classes) <= set(best.classes)
        # a developer sharing no class with the user can never be right
        for i, d in enumerate(devs):
            if not set(d.classes) & set(user.classes):
                assert accuracy[u, i] == 0.0
    assert compared >= 1


@pytest.mark.assets
def test_accuracy_entries_recomputed_by_hand(market, accuracy):
    user = market.users[0]
    for d, dev in enumerate(market.developers):
        logits = dev.logits(user.test.inputs)
        correct = 0
        for row, label in zip(logits, user.test.labels):
            options = [(row[i], -i, c) for i, c in enumerate(dev.classes) if c in user.classes]
            if options:
                correct += max(options)[2] == user.classes[label]
        assert accuracy[0, d] == pytest.approx(correct / len(user.test), abs=1e-12)
    # The head on the shared backbone is one ordinary NNX classifier on pixels.
    dev = market.developers[0]
    model = developer_classifier(market, dev)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, user.test.inputs),
                               dev.logits(user.test.inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.assets
def test_user_test_sets_are_disjoint_from_everything_trained_on(market):
    trained = set().union(*(hashes(d.train) for d in market.developers))
    for user in market.users:
        test = hashes(user.test)
        assert len(test) == len(user.test)  # no duplicate inside a test set
        assert not test & hashes(user.few_shot)
        assert not test & trained
        assert not hashes(user.few_shot) & trained


def test_mnist_is_brought_to_the_digits_grid():
    img = np.zeros((2, 28, 28), np.float32)
    img[0, 2:6, 6:10] = 1.0  # padded by 2: rows 4-7, cols 8-11 = block (1, 2)
    img[1, 0, 0] = 1.0  # padded (2, 2): 1 of the 16 pixels of block (0, 0)
    out = mk._on_digit_grid(img.reshape(2, 784))
    expected = np.zeros((2, 8, 8), np.float32)
    expected[0, 1, 2], expected[1, 0, 0] = 1.0, 1 / 16
    np.testing.assert_allclose(out, expected.reshape(2, 64), atol=1e-7)


@pytest.mark.parametrize("changes, match", [
    ({"good_fraction": 0.5, "undertrained_fraction": 0.3, "corrupted_fraction": 0.3},
     "sum to 1"),
    ({"good_fraction": 1.2, "undertrained_fraction": -0.2, "corrupted_fraction": 0.0},
     r"lie in \[0, 1\]"),
    ({"n_users": 0}, "n_users must be an int >= 1"),
    ({"n_developers": 2.0}, "n_developers must be an int >= 1"),
    ({"track": "audio"}, "track must be 'vision' or 'text'"),
    ({"domains": ("movie",)}, "domains of the vision track"),
    ({"undertrained_steps": 200, "train_steps": 200}, "must be below train_steps"),
    ({"subset_sizes": (1, 2)}, "subset_sizes must be ints >= 2"),
    ({"corrupt_label_fraction": 0.0}, "corrupt_label_fraction must be in"),
])
def test_bad_configs_are_rejected(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(MarketConfig(), **changes)


@pytest.mark.assets
def test_too_many_shots_or_training_examples_are_rejected():
    with pytest.raises(ValueError, match="shots_per_class=50 is too many for the data"):
        build_market(dataclasses.replace(SMALL, domains=("digits",), shots_per_class=50),
                     progress=False, cache=False)
    with pytest.raises(ValueError, match="lower train_per_class"):
        build_market(dataclasses.replace(SMALL, domains=("digits",), train_per_class=1000),
                     progress=False, cache=False)
    with pytest.raises(TypeError, match="MarketConfig"):
        build_market({"track": "vision"})


# --- developer_recipe="tuned": the traced schedule, the AdamW trainer, the plumbing ----------

@pytest.mark.parametrize("warmup_fraction", [0.0, 0.1, 0.3])
def test_traced_schedule_equals_recipes_schedule(warmup_fraction):
    # Every kind and several totals in one vmapped call: kind, peak, total and warm-up are
    # traced per row. Totals 5, 15 and 25 put round(f * T) on a .5 tie for f = 0.1 or 0.3.
    rows = [(kind, peak, total) for kind in recipes.SCHEDULES
            for peak, total in ((1e-2, 1), (3e-3, 2), (0.5, 5), (2e-2, 7), (1e-2, 15),
                                (4e-2, 25), (1e-2, 40))]
    as_recipe = {total: recipes.Recipe("head", 1e-3, 1e-3, 1, 1, warmup_fraction=warmup_fraction)
                 for _, _, total in rows}
    steps = np.arange(43, dtype=np.int32)  # a few past the longest schedule's end
    fn = jax.jit(jax.vmap(jax.vmap(mk._schedule_value, (None, None, 0, None, None)),
                          (0, 0, None, 0, 0)))
    got = np.asarray(fn(np.array([recipes.SCHEDULES.index(k) for k, _, _ in rows], np.int32),
                        np.array([p for _, p, _ in rows], np.float32), steps,
                        np.array([t for _, _, t in rows], np.int32),
                        np.array([mk._warmup_steps(as_recipe[t], t) for _, _, t in rows],
                                 np.int32)))
    with jax.numpy_dtype_promotion("standard"):
        for i, (kind, peak, total) in enumerate(rows):
            ref = recipes.schedule(kind, peak, total, warmup_fraction)
            want = np.array([float(ref(int(s))) for s in steps])
            np.testing.assert_allclose(got[i], want, rtol=2e-6, atol=1e-10,
                                       err_msg=f"{kind} T={total} f={warmup_fraction}")
    if warmup_fraction:  # the warm-up really starts from zero
        assert got[[i for i, r in enumerate(rows) if r[2] == 40], 0].max() == 0.0


def _loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params[0] + params[1][None, :],
                                                           y).mean()


def _hand_loop(tx, x, y, kernel, idx, steps):
    """A plain optax loop on one head: ``steps`` updates over the minibatch rows ``idx``."""
    x, y = jnp.asarray(x), jnp.asarray(y)

    @jax.jit
    def step(params, state, rows):
        updates, state = tx.update(jax.grad(_loss)(params, x[rows], y[rows]), state, params)
        return optax.apply_updates(params, updates), state

    params = (jnp.asarray(kernel), jnp.zeros(kernel.shape[1], jnp.float32))
    state = tx.init(params)
    for t in range(steps):
        params, state = step(params, state, idx[t])
    return np.asarray(params[0]), np.asarray(params[1])


def _synthetic_pools(d=6, n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, d)).astype(np.float32) for _ in range(2)]


def _twin_init(seed, d, k):
    """The job stream as _fit_chunk uses it: N(0, 1/d) kernel first, then the batches."""
    rng = np.random.default_rng(seed)
    return rng, rng.normal(0.0, d ** -0.5, (d, k))


def test_recipe_trainer_equals_a_plain_adamw_loop():
    feats, d = _synthetic_pools(), 6
    rng = np.random.default_rng(1)
    cosine = recipes.Recipe("head", 1e-3, 5e-2, epochs=3, batch_size=8, warmup_fraction=0.2,
                            schedule="cosine", weight_decay=0.1)
    linear = cosine.replace(head_learning_rate=2e-2, epochs=4, warmup_fraction=0.0,
                            schedule="linear", weight_decay=0.01)
    constant = cosine.replace(head_learning_rate=1e-2, epochs=2, warmup_fraction=0.25,
                              schedule="constant", weight_decay=0.0)
    # (pool, k, n, quality, recipe): sizes 37 / 20 / 9 / 5 give 12, 8, 2 and (at least) 1
    # steps; the undertrained one stops after 3 of its 12-step schedule.
    specs = [(0, 3, 37, "good", cosine), (1, 2, 20, "corrupted", linear),
             (0, 3, 37, "undertrained", cosine), (1, 2, 9, "good", constant),
             (0, 2, 5, "good", linear)]
    jobs, want = [], []
    for j, (pool, k, n, quality, recipe) in enumerate(specs):
        rows = rng.choice(feats[pool].shape[0], n, replace=False)
        labels = rng.integers(0, k, n).astype(np.int32)
        steps, total = mk._recipe_steps(recipe, n, quality, undertrained_steps=3)
        expect_total = max(1, recipe.epochs * (n // 8))
        assert total == expect_total
        assert steps == (3 if quality == "undertrained" else expect_total)
        jobs.append(mk._Job(pool, tuple(range(k)), quality, rows, labels, steps,
                            np.random.default_rng(100 + j), total, recipe))
        # the same minibatch indices, drawn independently: one pass per epoch, remainder
        # dropped; fewer examples than a batch: one batch from repeated permutations
        twin, kernel = _twin_init(100 + j, d, k)
        if n >= 8:
            idx = np.concatenate([twin.permutation(n)[: n // 8 * 8].reshape(-1, 8)
                                  for _ in range(recipe.epochs)])
        else:
            idx = np.concatenate([twin.permutation(n) for _ in range(-(-8 // n))])[:8][None]
        assert idx.shape[0] == total
        tx = promotion_safe(optax.adamw(
            recipes.schedule(recipe.schedule, recipe.head_learning_rate, total,
                             recipe.warmup_fraction), weight_decay=recipe.weight_decay))
        with jax.numpy_dtype_promotion("standard"):
            want.append((_hand_loop(tx, feats[pool][rows], labels, kernel, idx, steps),
                         kernel))
    config = MarketConfig(track="text", domains=("movie",), developer_recipe="tuned")
    heads = mk._fit_chunk(jobs, feats, n_max=37, k_max=3, config=config,
                          t_max=max(j.total for j in jobs))
    for head, job, ((w, b), kernel) in zip(heads, jobs, want):
        assert head.kernel[...].shape == (d, len(job.subset))
        np.testing.assert_allclose(head.kernel[...], w, atol=1e-5)
        np.testing.assert_allclose(head.bias[...], b, atol=1e-5)
        assert np.abs(w - kernel).max() > 1e-3  # every developer trained
    # the undertrained developer is not the good one of the same data and schedule
    assert np.abs(want[0][0][0] - want[2][0][0]).max() > 1e-3


def test_default_trainer_is_constant_rate_adam_over_train_steps():
    # developer_recipe=None: config.learning_rate, config.batch_size, train_steps steps
    # (undertrained_steps for undertrained developers) over repeated permutations.
    feats, d = _synthetic_pools(), 6
    config = MarketConfig(train_steps=7, undertrained_steps=2, batch_size=8, learning_rate=0.05)
    rng = np.random.default_rng(2)
    jobs, want = [], []
    for j, (pool, k, n, steps) in enumerate([(0, 3, 30, 7), (1, 2, 21, 2)]):
        rows = rng.choice(60, n, replace=False)
        labels = rng.integers(0, k, n).astype(np.int32)
        jobs.append(mk._Job(pool, tuple(range(k)), "good", rows, labels, steps,
                            np.random.default_rng(200 + j)))
        twin, kernel = _twin_init(200 + j, d, k)
        order = np.concatenate([twin.permutation(n) for _ in range(-(-7 * 8 // n))])
        idx = order[: 7 * 8].reshape(7, 8)
        with jax.numpy_dtype_promotion("standard"):
            want.append(_hand_loop(optax.adam(0.05), feats[pool][rows], labels, kernel, idx,
                                   steps))
    heads = mk._fit_chunk(jobs, feats, n_max=30, k_max=3, config=config)
    for head, (w, b) in zip(heads, want):
        np.testing.assert_allclose(head.kernel[...], w, atol=1e-5)
        np.testing.assert_allclose(head.bias[...], b, atol=1e-5)


def test_developer_recipe_config(monkeypatch):
    with pytest.raises(ValueError, match="tuned recipes .* exist for the text tasks"):
        MarketConfig(track="vision", developer_recipe="tuned")
    with pytest.raises(ValueError, match="developer_recipe must be None or 'tuned'"):
        MarketConfig(track="text", developer_recipe="adamw")
    assert MarketConfig(track="text", developer_recipe="tuned").developer_recipe == "tuned"
    assert MarketConfig().developer_recipe is None
    real = recipes.tuned
    monkeypatch.setattr(mk._recipes, "tuned", lambda task, trained="lora": (
        real(task, trained).replace(batch_size=16) if task == "bbc" else real(task, trained)))
    with pytest.raises(ValueError, match="share one batch size"):
        MarketConfig(track="text", developer_recipe="tuned")
    MarketConfig(track="text", domains=("movie", "nyt"), developer_recipe="tuned")


def test_recipe_jobs_take_their_domains_tuned_recipe():
    def task(name, k, per_class):
        labels = np.repeat(np.arange(k, dtype=np.int32), per_class)
        split = Split([f"{name} {i}" for i in range(labels.size)], labels)
        return Task(name, tuple(f"c{i}" for i in range(k)), split, split, split)

    pools = [task("movie", 2, 50), task("bbc", 5, 50)]
    config = MarketConfig(track="text", domains=("movie", "bbc"), developer_recipe="tuned",
                          undertrained_steps=5)
    # 100 and 150 examples, batch 32, 20 epochs (the presets): 3 and 4 batches per epoch
    for entry, recipe, steps, total in [
            ((0, (0, 1), "good"), recipes.tuned("movie", "head"), 60, 60),
            ((1, (0, 2, 4), "corrupted"), recipes.tuned("bbc", "head"), 80, 80),
            ((1, (1, 3), "undertrained"), recipes.tuned("bbc", "head"), 5, 60)]:
        job = mk._job(0, entry, pools, config)
        assert (job.recipe, job.steps, job.total) == (recipe, steps, total)
    # an undertrained developer must stop before a good one of its size would
    with pytest.raises(ValueError, match="undertrained_steps .20. must be below the 20 steps"):
        mk._job(0, (0, (0, 1), "undertrained"),
                [task("movie", 2, 16), pools[1]], dataclasses.replace(config,
                                                                     undertrained_steps=20))
    # fewer examples than a batch: one step
    assert mk._recipe_steps(recipes.tuned("movie", "head"), 20, "good", 2) == (1, 1)
