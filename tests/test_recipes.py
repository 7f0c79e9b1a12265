"""pavejax.recipes: validation, the schedules against closed forms, the two-rate AdamW against a
hand-written AdamW, steps, the LoRA target predicate on a real encoder's paths, the JSON round
trip and the presets' coverage."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax import lora, recipes
from pavejax.models import BertConfig, BertEncoder, TextClassifier
from pavejax.recipes import Recipe


def _recipe(**changes):
    base = dict(trained="lora", learning_rate=1e-3, head_learning_rate=1e-2, epochs=2,
                batch_size=32)
    return Recipe(**(base | changes))


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("changes, error, match", [
    ({"trained": "adapter"}, ValueError, "trained must be one of"),
    ({"schedule": "step"}, ValueError, "schedule must be one of"),
    ({"learning_rate": -1e-3}, ValueError, "learning_rate must be a finite number > 0"),
    ({"learning_rate": 0.0}, ValueError, "learning_rate must be a finite number > 0"),
    ({"learning_rate": float("nan")}, ValueError, "learning_rate must be a finite number > 0"),
    ({"learning_rate": math.inf}, ValueError, "learning_rate must be a finite number > 0"),
    ({"learning_rate": "1e-3"}, TypeError, "learning_rate must be a real number"),
    ({"head_learning_rate": 0}, ValueError, "head_learning_rate must be a finite number > 0"),
    ({"head_learning_rate": float("nan")}, ValueError,
     "head_learning_rate must be a finite number > 0"),
    ({"weight_decay": -0.01}, ValueError, "weight_decay must be a finite number >= 0"),
    ({"lora_alpha": 0.0}, ValueError, "lora_alpha must be a finite number > 0"),
    ({"warmup_fraction": 1.0}, ValueError, r"warmup_fraction must be in \[0, 1\)"),
    ({"warmup_fraction": -0.1}, ValueError, "warmup_fraction must be a finite number >= 0"),
    ({"lora_targets": ("query", "mlp")}, ValueError, "lora_targets must be a non-empty subset"),
    ({"lora_targets": ()}, ValueError, "lora_targets must be a non-empty subset"),
    ({"train_a": 1}, TypeError, "train_a must be a bool"),
    ({"epochs": 1.5}, ValueError, "epochs must be a positive int"),
    ({"epochs": True}, ValueError, "epochs must be a positive int"),
    ({"epochs": 0}, ValueError, "epochs must be a positive int"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive int"),
    ({"lora_rank": 2.0}, ValueError, "lora_rank must be a positive int"),
])
def test_recipe_rejects_bad_values(changes, error, match):
    with pytest.raises(error, match=match):
        _recipe(**changes)


def test_recipe_accepts_a_single_target_name_and_replace_validates():
    r = _recipe(lora_targets="value", weight_decay=0)
    assert r.lora_targets == ("value",)
    assert r.replace(learning_rate=2e-3).learning_rate == 2e-3
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
        r.replace(learning_rate=-1.0)


# ------------------------------------------------------------------ schedules


def _closed_form(kind, peak, total, warmup, t):
    """The schedule at integer step t, written out: linear warm-up from 0 reaching peak at step
    ``warmup``, then decay over the remaining ``total - warmup`` steps to 0 at ``total``."""
    if t < warmup:
        return peak * t / warmup
    s, span = t - warmup, total - warmup
    if kind == "constant":
        return peak
    if kind == "linear":
        return peak * (1.0 - min(s, span) / span)
    return 0.5 * peak * (1.0 + np.cos(np.pi * min(s, span) / span))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("total, fraction, warmup", [(50, 0.1, 5), (40, 0.3, 12), (7, 0.0, 0),
                                                     (10, 0.04, 0)])
def test_schedule_matches_closed_form(kind, total, fraction, warmup):
    # ``warmup`` is round(fraction * total) computed by hand (0.4 rounds to 0 warm-up steps)
    peak = 3e-3
    fn = recipes.schedule(kind, peak, total, fraction)
    got = np.array([float(fn(t)) for t in range(total + 3)])
    want = np.array([_closed_form(kind, peak, total, warmup, t) for t in range(total + 3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)
    if warmup:
        assert got[0] == 0.0 and got[warmup] == pytest.approx(peak, rel=1e-6)
    else:
        assert got[0] == pytest.approx(peak, rel=1e-6)
    if kind != "constant":
        assert abs(got[total]) < 1e-9  # decayed to zero at the last step


def test_schedule_takes_a_traced_peak():
    peaks = jnp.array([1e-3, 2e-2], jnp.float32)
    got = jax.vmap(lambda p: recipes.schedule("cosine", p, 20, 0.25)(8))(peaks)
    # warm-up 5 steps; step 8 is 3 steps into a 15-step cosine
    want = 0.5 * np.asarray(peaks) * (1 + np.cos(np.pi * 3 / 15))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


@pytest.mark.parametrize("args, match", [
    (("cosine", 1e-3, 0, 0.1), "total_steps must be a positive int"),
    (("cosine", 1e-3, 10.0, 0.1), "total_steps must be a positive int"),
    (("exp", 1e-3, 10, 0.1), "schedule must be one of"),
    (("linear", 1e-3, 10, 1.0), r"warmup_fraction must be in \[0, 1\)"),
    (("linear", 1e-3, 10, -0.5), "warmup_fraction must be a finite number >= 0"),
])
def test_schedule_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        recipes.schedule(*args)


# ------------------------------------------------------------------ the optimiser


def _numpy_adamw(params, grads_seq, lr_of_step, weight_decay, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW written out in float64: bias-corrected moments, decoupled decay scaled by the
    step's rate (optax's convention), the rate of update t (0-based) is lr_of_step(t)."""
    p = np.asarray(params, np.float64)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads_seq):
        g = np.asarray(g, np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
        p = p - lr_of_step(t) * (mhat / (np.sqrt(vhat) + eps) + weight_decay * p)
    return p


def _run_optax(tx, params, grad_fn, steps):
    state = tx.init(params)
    grads_seen = []
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(steps):
            g = grad_fn(params)
            grads_seen.append(jax.tree.map(np.asarray, g))
            updates, state = tx.update(g, state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, grads_seen


def test_optimizer_with_labels_gives_body_and_head_their_own_schedules():
    r = _recipe(learning_rate=2e-3, head_learning_rate=5e-2, warmup_fraction=0.25,
                schedule="cosine", weight_decay=0.1)
    total = 8  # warm-up round(0.25 * 8) = 2 steps, then a 6-step cosine
    params = {"body": {"w": jnp.array([0.5, -1.0, 2.0])},
              "head": {"w": jnp.array([[1.0, -2.0], [0.3, 0.0]]), "b": jnp.array([0.1, -0.4])}}
    labels = {"body": {"w": "body"}, "head": {"w": "head", "b": "head"}}
    target = jnp.array([1.0, 2.0, 3.0])

    def grad_fn(p):  # a loss whose gradients change from step to step
        def loss(p):
            return (jnp.sum(jnp.square(p["body"]["w"] - target) * jnp.arange(1.0, 4.0))
                    + jnp.sum(jnp.sin(p["head"]["w"])) + jnp.sum(jnp.square(p["head"]["b"])))
        return jax.grad(loss)(p)

    steps = 5
    got, grads = _run_optax(r.optimizer(total, labels), params, grad_fn, steps)

    def lr(peak):
        return lambda t: _closed_form("cosine", peak, total, 2, t)

    for group, name, peak in (("body", "w", 2e-3), ("head", "w", 5e-2), ("head", "b", 5e-2)):
        want = _numpy_adamw(params[group][name], [g[group][name] for g in grads], lr(peak), 0.1)
        # float32 Adam near a minimum (b -> 0) loses a few digits: atol is 2e-4 of a head step
        np.testing.assert_allclose(np.asarray(got[group][name]), want, rtol=1e-5, atol=1e-5)
    # the warm-up starts at rate 0: a single step leaves every parameter where it was
    one, _ = _run_optax(r.optimizer(total, labels), params, grad_fn, 1)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a callable labels argument is the same optimiser
    fn_labels, _ = _run_optax(r.optimizer(total, lambda p: labels), params, grad_fn, steps)
    for a, b in zip(jax.tree.leaves(fn_labels), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_optimizer_without_labels_uses_the_head_rate_everywhere():
    r = _recipe(trained="head", learning_rate=1e-4, head_learning_rate=3e-2, schedule="linear",
                warmup_fraction=0.0, weight_decay=0.0)
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    c = jnp.array([0.3, 0.2, -1.0])

    def grad_fn(p):
        return jax.grad(lambda p: jnp.sum(jnp.square(p["w"] - c) * jnp.array([1.0, 3.0, 0.5])))(p)

    got, grads = _run_optax(r.optimizer(6), params, grad_fn, 4)
    want = _numpy_adamw(params["w"], [g["w"] for g in grads],
                        lambda t: 3e-2 * (1 - t / 6), 0.0)
    np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-5, atol=1e-7)
    # the first Adam step moves each coordinate by the rate times the gradient's sign
    first, g0 = _run_optax(r.optimizer(6), params, grad_fn, 1)
    np.testing.assert_allclose(np.asarray(first["w"] - params["w"]),
                               -3e-2 * np.sign(g0[0]["w"]), rtol=1e-4)


# ------------------------------------------------------------------ steps


def test_steps_count_full_minibatches_per_epoch():
    r = _recipe(epochs=3, batch_size=32)
    assert r.steps(100) == 9  # 3 full batches of 32 per epoch, remainder of 4 dropped
    assert r.steps(32) == 3
    assert r.steps(1024) == 96
    with pytest.raises(ValueError, match="batch_size 32 exceeds the 31 training examples"):
        r.steps(31)
    with pytest.raises(ValueError, match="n_train must be a positive int"):
        r.steps(0)


# ------------------------------------------------------------------ LoRA targets


@pytest.fixture(scope="module")
def classifier_params():
    model = TextClassifier(BertEncoder(BertConfig.tiny(), rngs=nnx.Rngs(0)), 2,
                           rngs=nnx.Rngs(1))
    return nnx.to_pure_dict(nnx.split(model)[1])


def _layer_paths(*suffixes):
    return tuple(sorted(f"encoder/layers/{i}/{s}" for i in (0, 1) for s in suffixes))


@pytest.mark.parametrize("targets, expected", [
    (("query", "value"), _layer_paths("attention/query/kernel", "attention/value/kernel")),
    (("key",), _layer_paths("attention/key/kernel")),
    (("attn_out",), _layer_paths("attention/output/kernel")),
    (("ffn_out",), _layer_paths("output/kernel")),
    (("ffn_in",), _layer_paths("intermediate/kernel")),
    (("ffn_out", "attn_out"), _layer_paths("output/kernel", "attention/output/kernel")),
    (("query", "key", "value", "attn_out", "ffn_in", "ffn_out"), _layer_paths(
        "attention/query/kernel", "attention/key/kernel", "attention/value/kernel",
        "attention/output/kernel", "intermediate/kernel", "output/kernel")),
])
def test_lora_predicate_selects_exactly_the_named_layers(classifier_params, targets, expected):
    assert "encoder/layers/0/attention/output/kernel" in lora.named_leaves(classifier_params)
    chosen = lora.select_paths(classifier_params, _recipe(lora_targets=targets).lora_predicate())
    assert chosen == expected
    assert not any(p.startswith(("head/", "encoder/pooler/")) for p in chosen)


def test_ffn_out_and_attn_out_do_not_select_each_other(classifier_params):
    ffn = lora.select_paths(classifier_params, _recipe(lora_targets=("ffn_out",)).lora_predicate())
    attn = lora.select_paths(classifier_params,
                             _recipe(lora_targets=("attn_out",)).lora_predicate())
    assert not any("attention" in p for p in ffn)
    assert not any(p.endswith("/layers/0/output/kernel") or p.endswith("/layers/1/output/kernel")
                   for p in attn)
    assert set(ffn).isdisjoint(attn)


# ------------------------------------------------------------------ serialisation


def test_to_dict_from_dict_round_trip_and_unknown_fields():
    r = _recipe(trained="full", lora_targets=("key", "ffn_in"), train_a=False,
                schedule="linear", warmup_fraction=0.2, source="hand-made")
    d = r.to_dict()
    assert d["lora_targets"] == ["key", "ffn_in"] and d["train_a"] is False
    back = Recipe.from_dict(json.loads(json.dumps(d)))
    assert back == r and isinstance(back.lora_targets, tuple)
    with pytest.raises(ValueError, match=r"unknown recipe fields \['lr'\]"):
        Recipe.from_dict(d | {"lr": 1e-3})
    with pytest.raises(ValueError, match="trained must be one of"):
        Recipe.from_dict(d | {"trained": "probe"})


def test_save_and_load_recipes_round_trip(tmp_path):
    table = {"sentiment": {"lora": _recipe(), "head": _recipe(trained="head", epochs=20)},
             "topic": {"full": _recipe(trained="full", learning_rate=5e-5, schedule="constant")}}
    path = tmp_path / "recipes.json"
    recipes.save_recipes(path, table, {"chosen_on": "dev"})
    doc = json.loads(path.read_text())
    assert doc["chosen_on"] == "dev"
    assert doc["recipes"]["topic"]["full"]["learning_rate"] == 5e-5
    assert recipes.load_recipes(path) == table
    assert recipes.load_recipes(str(path)) == table


@pytest.mark.parametrize("content", ['{"rows": []}', "[1, 2]", '{"recipes": [1]}'])
def test_load_recipes_rejects_a_file_that_is_not_a_recipe_file(tmp_path, content):
    path = tmp_path / "result.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="is not a recipe file"):
        recipes.load_recipes(path)


# ------------------------------------------------------------------ presets


def test_tuned_covers_every_task_and_kind():
    assert set(recipes.FAMILIES) == {"movie", "amazon", "nyt", "tweets", "bbc"}
    assert set(recipes.TRAINED) == {"lora", "full", "head"}
    for task, family in recipes.FAMILIES.items():
        assert recipes.family_of(task) == family
        for trained in ("lora", "full", "head"):
            r = recipes.tuned(task, trained)
            assert isinstance(r, Recipe) and r.trained == trained
            assert r == recipes.tuned(family, trained)  # a family name works as well
            assert r.steps(1024) >= 1
    assert recipes.tuned("movie") == recipes.tuned("movie", "lora")  # default: LoRA
    assert recipes.tuned("nyt", "head") == recipes.tuned("tweets", "head")


def test_unknown_task_or_kind_errors():
    with pytest.raises(ValueError, match="no tuned recipe for task 'digits'"):
        recipes.family_of("digits")
    with pytest.raises(ValueError, match="no tuned recipe for task 'digits'"):
        recipes.tuned("digits", "lora")
    with pytest.raises(ValueError, match="trained must be one of"):
        recipes.tuned("movie", "probe")
    assert recipes.family_of("topic") == "topic"
