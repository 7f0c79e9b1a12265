"""The Llama-family decoder against a float64 numpy reference written here, and its padding,
single-example, LoRA, dtype, top-layer and input-checking contracts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.lora import LoraAdapters, LoraConfig, apply_lora, init_lora, lora_delta
from pavejax.models import LlamaConfig, LlamaLM, causal_mask, positions_from_mask

TINY = LlamaConfig.tiny()


def random_llama(config, seed=0, *, scale=0.3, norm_noise=0.1, param_dtype=jnp.float32):
    """A LlamaLM of ``config`` whose weights are drawn on the host: kernels and embeddings
    N(0, scale^2), RMSNorm scales 1 + N(0, norm_noise^2), so that activations are O(1) and every
    piece of the model shows in the logits. Built from ``nnx.eval_shape``: no random init runs
    on the device (eagerly, it compiles one program per weight shape, seconds per model)."""
    abstract = nnx.eval_shape(lambda: LlamaLM(config, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def draw(x):
        noise = rng.standard_normal(x.shape)
        value = 1.0 + norm_noise * noise if len(x.shape) == 1 else scale * noise
        return jax.device_put(np.asarray(value, x.dtype))  # jnp.asarray would compile a copy

    return nnx.merge(graphdef, jax.tree_util.tree_map(draw, state))


def _params64(model):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)


# --- float64 reference ---------------------------------------------------------------------------


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
    """Half-split rotary embedding as a complex rotation of the pairs (x_i, x_{i + D/2}):
    x (T, H, D), positions (T,)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * positions[:, None, None] * freqs)
    return np.concatenate([z.real, z.imag], axis=-1)


def _block_ref(p, h, positions, cfg):
    """One block on one unpadded sequence h (T, hidden), float64."""
    t, d = h.shape[0], cfg.dim_per_head
    x = _rms(h, p["attn_norm"]["scale"], cfg.rms_norm_eps)
    q = (x @ p["attn"]["q"]["kernel"]).reshape(t, cfg.num_heads, d)
    k = (x @ p["attn"]["k"]["kernel"]).reshape(t, cfg.num_kv_heads, d)
    v = (x @ p["attn"]["v"]["kernel"]).reshape(t, cfg.num_kv_heads, d)
    q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
    group = cfg.num_heads // cfg.num_kv_heads  # query head i uses key/value head i // group
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    context = np.einsum("hqk,khd->qhd", probs, v).reshape(t, cfg.num_heads * d)
    h = h + context @ p["attn"]["o"]["kernel"]
    x = _rms(h, p["mlp_norm"]["scale"], cfg.rms_norm_eps)
    gate, up = x @ p["mlp"]["gate"]["kernel"], x @ p["mlp"]["up"]["kernel"]
    return h + (gate / (1.0 + np.exp(-gate)) * up) @ p["mlp"]["down"]["kernel"]


def _forward_ref(p, ids, cfg):
    """Logits of one unpadded sequence ids (T,), float64."""
    h = p["embed"]["embedding"][ids]
    positions = np.arange(len(ids), dtype=np.float64)
    for i in range(cfg.num_layers):
        h = _block_ref(p["layers"][i], h, positions, cfg)
    out = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return _rms(h, p["norm"]["scale"], cfg.rms_norm_eps) @ out


# --- one compiled program for all comparisons (compiling is the slow part of this file) ---------

LORA = LoraConfig(rank=2, alpha=3.0)  # scale 1.5: the scaled branch is exercised
T = 11
# (real length, left padding) of each row: unpadded, left- and right-padded
ROWS = ((11, 0), (11, 0), (6, 5), (6, 0), (8, 3), (4, 0))


def _inputs():
    rng = np.random.default_rng(3)
    ids = np.zeros((len(ROWS), T), np.int32)
    mask = np.zeros((len(ROWS), T), np.int32)
    alone = rng.integers(0, TINY.vocab_size, 6)
    for r, (n, left) in enumerate(ROWS):
        ids[r, left:left + n] = alone if n == 6 else rng.integers(0, TINY.vocab_size, n)
        mask[r, left:left + n] = 1
    ids[mask == 0] = rng.integers(0, TINY.vocab_size, int((mask == 0).sum()))  # any pad id
    last = np.array([left + n - 1 for n, left in ROWS])
    return {"block_h": rng.standard_normal((1, 9, TINY.hidden_size)).astype(np.float32),
            "ids": ids, "mask": mask,
            "query": np.stack([last, last // 2], axis=1).astype(np.int32),
            "rows": np.array([5, 2], np.int32)}


def _lora_factors(model):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    targets = model.lora_targets()
    # init_lora's paths and shapes (eval_shape: no random program to compile), host values
    b, a = jax.eval_shape(lambda: init_lora(jax.random.key(7), params,
                                            lambda path, _: path in targets, LORA))
    rng = np.random.default_rng(8)

    def draw(x, scale):
        return jax.device_put((scale * rng.standard_normal(x.shape)).astype(np.float32))

    return ({p: draw(x, 0.3) for p, x in b.items()},
            {p: draw(x, 1 / np.sqrt(LORA.rank)) for p, x in a.items()})


@pytest.fixture(scope="module")
def models():
    tied = random_llama(TINY, seed=2)
    untied = random_llama(LlamaConfig.tiny(tie_embeddings=False), seed=2)
    low = nnx.eval_shape(lambda: LlamaLM(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    low = nnx.merge(nnx.graphdef(low), jax.tree_util.tree_map(  # the same weights, rounded
        lambda x: jax.device_put(np.asarray(x).astype(jnp.bfloat16)), nnx.state(tied)))
    return {"tied": tied, "untied": untied, "bf16": low}


@pytest.fixture(scope="module")
def out(models):
    b, a = _lora_factors(models["tied"])

    @jax.jit
    def run(models, x, b, a):
        model = models["tied"]
        ids, mask, query = x["ids"], x["mask"], x["query"]
        t = x["block_h"].shape[1]
        res = {
            "block": model.layers[0](x["block_h"], jnp.arange(t, dtype=jnp.int32)[None],
                                     causal_mask(jnp.ones((1, t), jnp.int32))),
            "tied": model(ids, mask), "untied": models["untied"](ids, mask),
            "single": model(ids[2], mask[2]),
            "vmapped": jax.vmap(lambda i, m: model(i, m))(ids, mask),
            "factored": model(ids, mask, lora=LoraAdapters(b, a, LORA)),
            "merged": nnx.merge(nnx.graphdef(model), apply_lora(
                nnx.to_pure_dict(nnx.state(model)), b, a, LORA))(ids, mask),
            "bf16": models["bf16"](ids, mask),
            "deltas": lora_delta(b, a, LORA),
        }
        h = model.embed_tokens(ids)
        positions, causal = positions_from_mask(mask), causal_mask(mask)
        res["top"] = model.logits(model.run_layers(h, positions, causal, query_index=query))
        lower = model.run_layers(h, positions, causal, stop=TINY.num_layers - 1)
        top = model.run_layers(lower, positions, causal, start=TINY.num_layers - 1,
                               query_index=query)
        res["cached_top"] = model.logits(top)
        res["rows"] = model.logits(top, rows=x["rows"])
        return res

    return jax.device_get(run(models, _inputs(), b, a)), _inputs(), (b, a)


# --- tests ---------------------------------------------------------------------------------------


def test_block_matches_float64_reference(models, out):
    res, x, _ = out
    h = np.asarray(x["block_h"], np.float64)[0]
    want = _block_ref(_params64(models["tied"])["layers"][0], h,
                      np.arange(h.shape[0], dtype=np.float64), TINY)
    assert res["block"].dtype == np.float32
    np.testing.assert_allclose(res["block"][0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_forward_matches_float64_reference_with_any_padding(models, out, name):
    """Every row, unpadded, left- or right-padded, gives at its real positions the reference
    logits of its real tokens alone (padding shifts no position and is never attended to)."""
    res, x, _ = out
    model = models[name]
    assert hasattr(model, "lm_head") == (name == "untied")
    p = _params64(model)
    got = res[name]
    assert got.dtype == np.float32 and got.shape == (len(ROWS), T, TINY.vocab_size)
    assert np.all(np.isfinite(got))
    for r, (n, left) in enumerate(ROWS):
        want = _forward_ref(p, np.asarray(x["ids"][r, left:left + n]), model.config)
        assert np.abs(want).max() > 1.0  # the logits are not trivially small
        np.testing.assert_allclose(got[r, left:left + n], want, rtol=1e-5, atol=1e-5)
    # rows 2 and 3 hold the same 6 tokens, left- and right-padded
    np.testing.assert_allclose(got[2, 5:], got[3, :6], rtol=1e-5, atol=1e-5)


def test_single_example_equals_batch_row_and_vmaps(out):
    res, _, _ = out
    assert res["single"].shape == (T, TINY.vocab_size)
    np.testing.assert_allclose(res["single"], res["tied"][2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res["vmapped"], res["tied"], rtol=1e-5, atol=1e-5)


def test_factored_lora_on_every_target_equals_merged(models, out):
    res, _, (b, a) = out
    assert set(b) == set(models["tied"].lora_targets()) and len(b) == 7 * TINY.num_layers
    np.testing.assert_allclose(res["factored"], res["merged"], rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(res["tied"] - res["merged"])) > 0.1  # the adapters matter
    # every target's delta is far above the tolerance, so a target the factored path skipped
    # would show in the comparison above
    assert set(res["deltas"]) == set(b)
    assert min(float(np.abs(d).max()) for d in res["deltas"].values()) > 0.1


def test_bfloat16_weights_give_float32_logits_close_to_float32(models, out):
    res, _, _ = out
    assert models["bf16"].embed.embedding[...].dtype == jnp.bfloat16
    got, want = res["bf16"], res["tied"]
    assert got.dtype == np.float32
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err < 0.05 * scale, (err, scale)
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) > 0.8


def test_query_index_top_layer_equals_full_forward(out):
    res, x, _ = out
    want = np.take_along_axis(res["tied"], np.asarray(x["query"])[..., None], axis=1)
    assert res["top"].shape == (len(ROWS), 2, TINY.vocab_size)
    np.testing.assert_allclose(res["top"], want, rtol=1e-5, atol=1e-5)
    # Frozen lower layers cached, then only the top one run at the query positions.
    np.testing.assert_allclose(res["cached_top"], want, rtol=1e-5, atol=1e-5)
    # Only two vocabulary rows of the output layer.
    np.testing.assert_allclose(res["rows"], want[..., np.asarray(x["rows"])],
                               rtol=1e-5, atol=1e-5)


def test_bad_input_gives_clear_errors(models):
    model = models["tied"]
    ids = np.ones((2, 5), np.int32)  # host arrays: the checks run before any device work
    with pytest.raises(TypeError, match="integer array"):
        model(ids.astype(np.float32))
    with pytest.raises(ValueError, match="max_position"):
        model(np.zeros((1, TINY.max_position + 1), np.int32))
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        model(ids, np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="shape"):
        model(np.zeros((1, 2, 3), np.int32))
    with pytest.raises(ValueError, match="num_kv_heads .* must divide num_heads"):
        LlamaConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LlamaConfig.tiny(hidden_size=20, num_heads=4, num_kv_heads=2)
    h, positions = np.zeros((2, 5, TINY.hidden_size), np.float32), np.zeros((2, 5), np.int32)
    causal = np.ones((2, 5, 5), bool)
    with pytest.raises(ValueError, match="start <= stop"):
        model.run_layers(h, positions, causal, start=2, stop=1)
    with pytest.raises(ValueError, match="causal_mask"):
        model.run_layers(h, positions, causal[:, :1])
