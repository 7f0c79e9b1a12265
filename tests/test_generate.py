"""KV-cache decoding (``LlamaLM.forward_cached``, ``generate``) against full re-computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.lora import LoraAdapters, LoraConfig, init_lora
from pavejax.models import KVCache, LlamaConfig, generate, init_cache
from tests.test_llama import random_llama

CFG = LlamaConfig.tiny()  # two layers: each layer must read its own slice of the cache
LENGTHS = (7, 3, 5, 1)  # real prompt lengths; the prompts are left-padded to T
T, N, PAD = 7, 6, 0


@jax.jit
def _forward(model, ids, mask, lora):
    """Full-forward logits without and with the adapters (one compiled program for both)."""
    return model(ids, mask), model(ids, mask, lora=lora)


@pytest.fixture(scope="module")
def model():
    """Weights N(0, 0.3^2), norm scales 1: O(1) logits, varied greedy outputs."""
    return random_llama(CFG, seed=0, norm_noise=0.0)


@pytest.fixture(scope="module")
def lora(model):
    """Factored LoRA on q, v and down of every layer, B far from zero (the adapters matter)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    config = LoraConfig(rank=2)
    # init_lora's paths and shapes (eval_shape: no random program to compile), host values
    b, a = jax.eval_shape(lambda: init_lora(
        jax.random.key(4), params,
        lambda path, _: path.endswith(("q/kernel", "v/kernel", "down/kernel")), config))
    rng = np.random.default_rng(5)

    def draw(x, scale):
        return jax.device_put((scale * rng.standard_normal(x.shape)).astype(np.float32))

    return LoraAdapters({p: draw(x, 0.3) for p, x in b.items()},
                        {p: draw(x, 1 / np.sqrt(config.rank)) for p, x in a.items()}, config)


def _prompts(right=False):
    rng = np.random.default_rng(1)
    ids = np.full((len(LENGTHS), T), PAD, np.int32)
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for r, n in enumerate(LENGTHS):
        cols = slice(0, n) if right else slice(T - n, T)
        ids[r, cols] = rng.integers(3, CFG.vocab_size, n)
        mask[r, cols] = 1
    return ids, mask


@pytest.fixture(scope="module")
def reference(model, lora):
    """Greedy continuation (B, N) by re-running the full forward on the growing sequence: ``N``
    calls of one compiled forward on a (B, T + N) buffer whose not-yet-generated slots are
    masked out."""
    ids, mask = _prompts()
    buf = np.concatenate([ids, np.full((len(LENGTHS), N), PAD, np.int32)], axis=1)
    seen = np.concatenate([mask, np.zeros((len(LENGTHS), N), np.int32)], axis=1)
    for i in range(N):
        logits = _forward(model, buf, seen, lora)[0]
        buf[:, T + i] = np.asarray(logits[:, T - 1 + i]).argmax(axis=-1)
        seen[:, T + i] = 1
    return buf[:, T:]


def test_cached_decoding_equals_full_recomputation_token_by_token(model, lora, reference):
    """With factored LoRA on every layer: feed the prompts slot by slot (padding included), then
    the reference tokens one at a time, through one jitted, cache-donating step. The logits at
    every position that chooses a token equal the full forward's on the whole sequence (causal,
    so one call gives them all); the step compiles once and the cache keeps its shapes."""
    ids, mask = _prompts()
    seq = np.concatenate([ids, reference], axis=1)
    seq_mask = np.concatenate([mask, np.ones((len(LENGTHS), N), np.int32)], axis=1)
    plain, want = map(np.asarray, _forward(model, seq, seq_mask, lora))
    assert np.max(np.abs(want - plain)) > 0.1  # the adapters matter
    traces = []

    def step(m, ids, mask, cache, lora):
        traces.append(1)
        return m.forward_cached(ids, mask, cache, lora=lora)

    step = jax.jit(step, donate_argnames="cache")
    cache = init_cache(model, len(LENGTHS), T + N - 1)
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), cache)
    got = []
    for t in range(T + N - 1):
        old = cache
        out, cache = step(model, seq[:, t:t + 1], seq_mask[:, t:t + 1], cache, lora)
        assert old.k.is_deleted()  # donated: updated in place
        got.append(np.asarray(out[:, 0]))
    assert len(traces) == 1
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), cache) == shapes
    assert int(cache.length) == T + N - 1
    np.testing.assert_array_equal(cache.next_position, np.array(LENGTHS) + N - 1)
    np.testing.assert_array_equal(np.asarray(cache.valid).sum(axis=1),
                                  np.array(LENGTHS) + N - 1)
    real = seq_mask[:, :-1] == 1  # padded slots' logits are meaningless
    np.testing.assert_allclose(np.stack(got, axis=1)[real], want[:, :-1][real],
                               rtol=1e-5, atol=1e-5)


def _stop_token(tokens):
    """A token that row 0 emits after its first step but some other row never emits, so that
    one row stops early and another runs to the end."""
    for s in tokens[0, 1:]:
        if any(s not in row for row in tokens[1:]):
            return int(s)
    raise AssertionError("no suitable stop token in the reference continuation")


def _expected(tokens, stop):
    """The reference continuation cut after the first stop token, padded after it."""
    out = np.full_like(tokens, PAD)
    lengths, finished = [], []
    for r, row in enumerate(tokens):
        hits = np.flatnonzero(row == stop)
        n = int(hits[0]) + 1 if hits.size else N
        out[r, :n] = row[:n]
        lengths.append(n)
        finished.append(bool(hits.size))
    return out, np.array(lengths), np.array(finished)


@pytest.fixture(scope="module")
def runs(model, reference):
    """Greedy generation (stop token chosen from the reference), sampling and top-1 sampling in
    one jitted program (each ``generate`` inside with its own static settings), called on left-
    and right-padded prompts and with several keys: it must compile only once."""
    stop = _stop_token(reference)
    traces = []

    @jax.jit
    def generations(model, ids, mask, key):
        traces.append(1)
        greedy = dict(max_new_tokens=N, stop_tokens=(stop,), pad_id=PAD)
        return {"greedy": generate(model, ids, mask, **greedy),
                "sampled": generate(model, ids, mask, max_new_tokens=N, pad_id=PAD,
                                    temperature=1.5, key=key),
                "top1": generate(model, ids, mask, key=key, top_k=1, temperature=0.7,
                                 **greedy)}

    out = {"stop": stop,
           "left": generations(model, *_prompts(), jax.random.key(1)),
           "right": generations(model, *_prompts(right=True), jax.random.key(3)),
           "left_again": generations(model, *_prompts(), jax.random.key(1)),
           "left_key2": generations(model, *_prompts(), jax.random.key(2))}
    out["traces"] = len(traces)
    return jax.device_get(out)


def test_greedy_generation_equals_recomputation_and_stops(reference, runs):
    want, lengths, finished = _expected(reference, runs["stop"])
    assert finished.any() and not finished.all() and lengths.min() < N
    got = runs["left"]["greedy"]
    assert got.tokens.dtype == np.int32 and got.tokens.shape == (len(LENGTHS), N)
    np.testing.assert_array_equal(got.tokens, want)
    np.testing.assert_array_equal(got.lengths, lengths)
    np.testing.assert_array_equal(got.finished, finished)
    assert runs["traces"] == 1  # same shapes, other prompts and keys: no new compilation


def test_right_padded_prompts_generate_as_left_padded(runs):
    for field in ("tokens", "lengths", "finished"):
        np.testing.assert_array_equal(getattr(runs["right"]["greedy"], field),
                                      getattr(runs["left"]["greedy"], field))


def test_sampling_is_reproducible_per_key_and_top1_is_greedy(runs):
    key1, again, key2 = (runs[k]["sampled"] for k in ("left", "left_again", "left_key2"))
    np.testing.assert_array_equal(key1.tokens, again.tokens)
    assert np.mean(key1.tokens != key2.tokens) > 0.3
    assert np.all(key1.lengths == N) and not key1.finished.any()
    for run in ("left", "right"):  # top-1 sampling is greedy whatever the key
        for field in ("tokens", "lengths", "finished"):
            np.testing.assert_array_equal(getattr(runs[run]["top1"], field),
                                          getattr(runs["left"]["greedy"], field))


def test_bad_input_gives_clear_errors(model):
    ids, mask = _prompts()  # host arrays: the checks run before any device work
    ok = dict(max_new_tokens=2, pad_id=PAD)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        generate(model, ids, mask, temperature=1.0, **ok)
    with pytest.raises(TypeError, match="integer array"):
        generate(model, ids.astype(np.float32), mask, **ok)
    with pytest.raises(ValueError, match="shape of input_ids"):
        generate(model, ids, mask[:, 1:], **ok)
    with pytest.raises(ValueError, match="max_position"):
        generate(model, ids, mask, max_new_tokens=CFG.max_position, pad_id=PAD)
    empty = mask.copy()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] .* no real token"):
        generate(model, ids, empty, **ok)
    with pytest.raises(TypeError, match="tuple"):
        generate(model, ids, mask, stop_tokens=[2], **ok)
    with pytest.raises(ValueError, match="pad_id"):
        generate(model, ids, mask, max_new_tokens=2, pad_id=CFG.vocab_size)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, ids, mask, top_k=0, **ok)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, mask, max_new_tokens=0, pad_id=PAD)
    cache = init_cache(CFG, 2, 4)
    assert isinstance(cache, KVCache) and cache.k.dtype == jnp.float32
    with pytest.raises(ValueError, match="init_cache"):
        model.forward_cached(ids, mask, cache)  # batch 4, cache for 2
    with pytest.raises(ValueError, match="do not fit"):
        model.forward_cached(ids[:2], mask[:2], cache)  # 7 tokens, 4 slots
    with pytest.raises(ValueError, match="max_position"):
        init_cache(model, 1, CFG.max_position + 1)
