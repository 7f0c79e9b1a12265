"""Small MLP/CNN backbones, training on digits, and the cached backbone pretrainer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.models import (
    MLP,
    PretrainConfig,
    SmallCNN,
    classification_loss,
    fit_classifier,
    pretrain_backbone,
    small,
    with_new_head,
)


@pytest.fixture(scope="module")
def digits():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    d = sklearn_datasets.load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


@nnx.jit
def run(model, x):
    """Jitted forward pass (eager dispatch compiles every op separately: slow on CPU)."""
    return model(x)


@nnx.jit
def feats(model, x):
    return model.features(x)


def param_paths(model):
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat}


def assert_same_params(a, b):
    la = jax.tree_util.tree_leaves(nnx.state(a, nnx.Param))
    lb = jax.tree_util.tree_leaves(nnx.state(b, nnx.Param))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def test_mlp_shapes_and_backbone_split():
    model = MLP(64, 32, 10, depth=3, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).random((5, 64)), jnp.float32)
    logits = run(model, x)
    assert logits.shape == (5, 10) and logits.dtype == jnp.float32
    assert feats(model, x).shape == (5, 32)
    assert run(model, x[0]).shape == (10,)  # single example, for vmap
    np.testing.assert_allclose(nnx.vmap(run, in_axes=(None, 0))(model, x), logits, atol=1e-6)
    assert param_paths(model) == {
        "backbone/layers/0/kernel", "backbone/layers/0/bias", "backbone/layers/1/kernel",
        "backbone/layers/1/bias", "backbone/layers/2/kernel", "backbone/layers/2/bias",
        "head/kernel", "head/bias"}
    # head(features(x)) is one Linear on top of the backbone.
    w, b = model.head.kernel[...], model.head.bias[...]
    np.testing.assert_allclose(logits, feats(model, x) @ w + b[None, :], atol=1e-5)
    with pytest.raises(ValueError, match=r"expects inputs of shape \(\.\.\., 64\)"):
        run(model, jnp.ones((5, 63), jnp.float32))
    with pytest.raises(ValueError, match="depth must be a positive int"):
        MLP(64, 32, 10, depth=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("image_shape", [(8, 8), (28, 28)])
def test_cnn_shapes(image_shape):
    h, w = image_shape
    model = SmallCNN(image_shape, 10, channels=(4, 8), hidden=16, rngs=nnx.Rngs(0))
    flat = jnp.asarray(np.random.default_rng(0).random((3, h * w)), jnp.float32)
    logits = run(model, flat)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32
    np.testing.assert_allclose(run(model, flat.reshape(3, h, w, 1)), logits, atol=1e-5)
    np.testing.assert_allclose(run(model, flat[1]), logits[1], atol=1e-5)
    assert feats(model, flat).shape == (3, 16)
    pooled = (h // 4) * (w // 4) * 8  # two 2x2 pools
    assert model.backbone.dense.kernel[...].shape == (pooled, 16)
    assert {"backbone/convs/0/kernel", "backbone/convs/1/kernel", "backbone/dense/kernel",
            "head/kernel"} <= param_paths(model)


def test_cnn_bad_inputs():
    with pytest.raises(ValueError, match="too small for 3 pooling stages"):
        SmallCNN((4, 4), 10, channels=(2, 2, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="image_shape must be"):
        SmallCNN((8,), 10, rngs=nnx.Rngs(0))
    model = SmallCNN((8, 8), 10, channels=(4,), hidden=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"expects \(\.\.\., 64\) or \(\.\.\., 8, 8, 1\)"):
        run(model, jnp.ones((2, 65), jnp.float32))


def test_avg_pool_by_hand():
    x = jnp.arange(16, dtype=jnp.float32).reshape(1, 4, 4, 1)
    np.testing.assert_allclose(small._avg_pool_2x2(x)[0, :, :, 0], [[2.5, 4.5], [10.5, 12.5]])


def test_a_few_steps_reduce_the_loss_on_digits(digits):
    x, y = digits
    model = MLP(64, 32, 10, depth=1, rngs=nnx.Rngs(0))
    before = float(classification_loss(model, jnp.asarray(x), jnp.asarray(y)))
    assert abs(before - np.log(10)) < 0.5  # an untrained head is near chance
    trained, losses = fit_classifier(model, x, y, steps=5, batch_size=128, learning_rate=1e-2)
    after = float(classification_loss(trained, jnp.asarray(x), jnp.asarray(y)))
    assert losses.shape == (5,)
    assert after < before - 0.1
    # The input model is not modified.
    assert float(classification_loss(model, jnp.asarray(x), jnp.asarray(y))) == before


def test_batches_are_seeded_permutations():
    idx = small._batch_indices(10, steps=5, batch_size=4, seed=3)
    assert idx.shape == (5, 4)
    flat = idx.reshape(-1)
    assert sorted(flat[:10]) == list(range(10))  # first epoch covers every example once
    np.testing.assert_array_equal(idx, small._batch_indices(10, 5, 4, 3))
    assert not np.array_equal(idx, small._batch_indices(10, 5, 4, 4))


FAST = PretrainConfig(hidden=32, depth=1, steps=60, batch_size=64, learning_rate=1e-2)


def test_pretrain_backbone_caches_and_reloads(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    calls = []
    real_fit = small.fit_classifier
    monkeypatch.setattr(small, "fit_classifier",
                        lambda *a, **k: calls.append(1) or real_fit(*a, **k))
    x, y = digits
    keep = np.flatnonzero(y < 5)[::2]  # the training half used below too: one compilation
    first = pretrain_backbone(x[keep], y[keep], FAST)
    assert not first.from_cache and len(calls) == 1
    assert first.path.parent == tmp_path / "backbones" and first.path.is_file()
    second = pretrain_backbone(x[keep], y[keep], FAST)
    assert second.from_cache and len(calls) == 1  # no retraining
    assert second.path == first.path
    assert_same_params(first.model, second.model)
    # Another seed is another key: retrained and stored beside the first.
    other = pretrain_backbone(x[keep], y[keep], PretrainConfig(**{**FAST.__dict__, "seed": 1}))
    assert not other.from_cache and len(calls) == 2 and other.path != first.path
    # A damaged cache file is recomputed, not trusted.
    first.path.write_bytes(b"not an npz file")
    again = pretrain_backbone(x[keep], y[keep], FAST)
    assert not again.from_cache and len(calls) == 3
    assert_same_params(first.model, again.model)  # training is deterministic


def test_pretrained_backbone_generalises_to_held_out_digits(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    x, y = digits
    keep = np.flatnonzero(y < 5)
    train, test = keep[::2], keep[1::2]
    result = pretrain_backbone(x[train], y[train], FAST, cache=False)
    assert result.path is None and not any(tmp_path.iterdir())
    pred = np.argmax(np.asarray(run(result.model, jnp.asarray(x[test]))), axis=-1)
    assert (pred == y[test]).mean() > 0.9  # chance is 0.2
    # A downstream task swaps the head and keeps the backbone.
    task = with_new_head(result.model, 2, seed=1)
    assert run(task, jnp.asarray(x[:3])).shape == (3, 2)
    np.testing.assert_array_equal(feats(task, jnp.asarray(x[:3])),
                                  feats(result.model, jnp.asarray(x[:3])))
    assert result.model.head.kernel[...].shape == (32, 5)


def test_pretrain_cnn_runs(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    x, y = digits
    keep = y < 3
    cfg = PretrainConfig(arch="cnn", image_shape=(8, 8), channels=(4,), hidden=16, steps=20,
                         batch_size=32, learning_rate=1e-2)
    result = pretrain_backbone(x[keep], y[keep], cfg)
    assert isinstance(result.model, SmallCNN) and result.path.name.startswith("cnn-")
    assert run(result.model, jnp.asarray(x[:2])).shape == (2, 3)


def test_pretrain_bad_inputs(digits):
    x, y = digits
    with pytest.raises(ValueError, match="labels must be 0..K-1"):
        pretrain_backbone(x[y >= 5], y[y >= 5], FAST, cache=False)
    with pytest.raises(ValueError, match=r"expected x \(N, D\) and y \(N,\)"):
        pretrain_backbone(x[:10], y[:9], FAST, cache=False)
    with pytest.raises(ValueError, match="arch='cnn' needs image_shape"):
        PretrainConfig(arch="cnn")
    with pytest.raises(ValueError, match="arch must be 'mlp' or 'cnn'"):
        PretrainConfig(arch="vit")
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        PretrainConfig(learning_rate=0.0)
