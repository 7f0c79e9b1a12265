"""The full-weights top feed-forward track of :mod:`pavejax.lm_cache` (``TopMLP``) against the
whole model with the trained kernels put back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.lm_cache import TopMLP, top_features
from pavejax.models.llama import LlamaConfig, LlamaLM

CANDS = np.array([5, 11, 17], np.int32)


@pytest.fixture(scope="module")
def setup():
    model = LlamaLM(LlamaConfig.tiny(num_layers=2, vocab_size=41), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    lengths = np.array([6, 3, 8, 1, 5])
    ids = rng.integers(3, 41, (len(lengths), 8)).astype(np.int32)
    mask = (np.arange(8)[None] < lengths[:, None]).astype(np.int32)  # right padding
    return model, ids, mask, lengths


def _whole_rows(model, ids, mask, lengths):
    logits = np.asarray(jax.jit(lambda i, a: model(i, a))(ids, mask))
    return logits[np.arange(len(lengths)), lengths - 1][:, CANDS]


def test_top_mlp_equals_whole_model_with_trained_kernels(setup):
    model, ids, mask, lengths = setup
    mlp = TopMLP.of(model)
    feats = {k: jnp.asarray(v) for k, v in top_features(model, ids, mask, batch_size=2).items()}
    frozen = mlp.frozen(model, CANDS)
    start = mlp.trainable(model)
    # untrained: the cached path is the model itself
    np.testing.assert_allclose(mlp.batch_logits(start, frozen, feats),
                               _whole_rows(model, ids, mask, lengths), rtol=1e-5, atol=1e-5)
    keys = jax.random.split(jax.random.key(1), 3)
    moved = {k: w + 0.5 * jnp.std(w) * jax.random.normal(kk, w.shape)
             for (k, w), kk in zip(sorted(start.items()), keys)}
    cached = np.asarray(mlp.batch_logits(moved, frozen, feats))
    whole = _whole_rows(mlp.merged(model, moved), ids, mask, lengths)
    np.testing.assert_allclose(cached, whole, rtol=1e-5, atol=1e-5)
    # the perturbation matters, so the comparison above can fail
    assert np.max(np.abs(cached - _whole_rows(model, ids, mask, lengths))) > 1e-2
    # merged() leaves the original model untouched
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.up.kernel[...]),
                                  np.asarray(start["up"]))


def test_top_mlp_loss_and_refusals(setup):
    model, ids, mask, lengths = setup
    mlp = TopMLP.of(model)
    feats = top_features(model, ids, mask)
    frozen = mlp.frozen(model, CANDS)
    tr = mlp.trainable(model)
    ex = {"h_att": jnp.asarray(feats["h_att"][0]), "label": jnp.asarray(2)}
    z = np.asarray(mlp.logits(tr, frozen, ex), np.float64)
    expected = -(z[2] - np.log(np.sum(np.exp(z))))
    assert float(mlp.loss(tr, frozen, ex)) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="candidate_ids"):
        mlp.frozen(model, np.array([4], np.int32))
    with pytest.raises(TypeError, match="LlamaLM"):
        TopMLP.of(object())
