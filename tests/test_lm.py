"""LM objectives and splits: the token loss against a hand loop over unpadded sequences,
candidate scores against a per-candidate computation from full logits, factored LoRA equal to
merged on the LM objective, full-weight splits, and -F1 of greedy generations against a host
recomputation."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from pavejax import lora as lora_lib
from pavejax.lm import (
    AnswerTable,
    LMSplit,
    candidate_examples,
    candidate_loss,
    candidate_loss_fn,
    candidate_predict,
    candidate_scores,
    generation_f1_loss_fn,
    generation_f1_losses,
    lora_predicate,
    score_candidates,
    split_full,
    split_lora,
    token_logprobs,
    token_loss,
    token_loss_fn,
)
from pavejax.models.llama import LlamaConfig, LlamaLM
from tests.test_llama import random_llama

CFG = LlamaConfig.tiny(num_layers=1)  # one block: compilation dominates these tests
LORA = lora_lib.LoraConfig(2, alpha=4.0)  # one rank in the file: its eager draws compile once


@pytest.fixture(scope="module")
def model():
    return random_llama(CFG, seed=0)


def log_softmax64(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


REF_LEN = 16


@functools.cache
def _full_logits(graphdef):
    return jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))


def unpadded_log_softmax(model, tokens):
    """Next-token log-probabilities after each token of one unpadded sequence, float64
    (len, vocab).

    The sequence is followed by filler tokens under an all-ones mask (no padding logic): a
    causal model's logits at the sequence's own positions do not depend on what follows."""
    graphdef, state = nnx.split(model)
    ids = np.full((1, REF_LEN), 1, np.int32)
    ids[0, :len(tokens)] = tokens
    logits = np.asarray(_full_logits(graphdef)(nnx.to_pure_dict(state), ids)[0])
    return log_softmax64(logits)[:len(tokens)]


def unpadded_logprobs(model, tokens):
    """log p(x_t | x_<t) for t = 1.. of one unpadded sequence, float64 (len - 1,)."""
    lsm = unpadded_log_softmax(model, tokens)
    return np.array([lsm[t - 1, tokens[t]] for t in range(1, len(tokens))])


def greedy_continuation(model, prompt, max_new_tokens, stop):
    """Greedy decoding of one unpadded prompt by full re-computation: the argmax after the last
    token is appended, up to ``max_new_tokens`` tokens or the first ``stop`` (kept)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(np.argmax(unpadded_log_softmax(model, seq)[-1])))
        if seq[-1] == stop:
            break
    return seq[len(prompt):]


def padded(rows, length, side):
    ids = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        s = side[i] if isinstance(side, list) else side
        sl = slice(length - len(r), length) if s == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def test_token_loss_equals_a_hand_loop_with_padding_and_loss_mask(model):
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(3, CFG.vocab_size, n)) for n in (9, 5, 7)]
    ids, mask = padded(rows, 10, ["left", "right", "left"])
    ids[mask == 0] = 1  # a pad id that is a real token id: only the mask may hide it
    # loss_mask: the last 3 real tokens of each row (an "answer")
    loss_mask = np.zeros_like(mask)
    for i in range(3):
        real = np.flatnonzero(mask[i])
        loss_mask[i, real[-3:]] = 1
    lp, full, answer = map(np.asarray, jax.jit(lambda i, m, lm: (
        token_logprobs(model, i, m), token_loss(model, i, m),
        token_loss(model, i, m, loss_mask=lm)))(ids, mask, loss_mask))
    for i, r in enumerate(rows):
        ref = unpadded_logprobs(model, r)
        real = np.flatnonzero(mask[i])
        np.testing.assert_allclose(lp[i, real[1:]], ref, rtol=1e-5, atol=1e-5)
        assert np.all(lp[i, np.flatnonzero(mask[i] == 0)] == 0) and lp[i, real[0]] == 0
        np.testing.assert_allclose(full[i], -ref.mean(), rtol=1e-5)
        np.testing.assert_allclose(answer[i], -ref[-3:].mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="loss_mask must have the shape"):
        token_loss(model, ids, mask, loss_mask=loss_mask[:, :3])
    with pytest.raises(ValueError, match="2 axes"):
        token_loss(model, ids[0], mask[0])


def candidate_batch(rng, prompts, cands, t):
    n, c = len(prompts), len(cands)
    ids = np.zeros((n, c, t), np.int32)
    mask, option = np.zeros_like(ids), np.zeros_like(ids)
    for i, p in enumerate(prompts):
        for j, cand in enumerate(cands):
            seq = p + cand
            ids[i, j, :len(seq)], mask[i, j, :len(seq)] = seq, 1
            option[i, j, len(p):len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "option_mask": option}


def test_candidate_scores_equal_a_per_candidate_computation(model):
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, CFG.vocab_size, n)) for n in (6, 3, 8)]
    cands = [[7], [11, 12]]  # one- and two-token candidates, right padded
    batch = candidate_batch(rng, prompts, cands, 11)
    # chunked host scoring, its last chunk padded: candidate_scores of every row
    scores = score_candidates(model, batch, batch_size=2)
    ref = np.zeros((3, 2))
    for i, p in enumerate(prompts):
        for j, cand in enumerate(cands):
            lp = unpadded_logprobs(model, p + cand)
            ref[i, j] = lp[len(p) - 1:].mean()
    np.testing.assert_allclose(scores, ref, rtol=1e-5, atol=1e-6)
    labels = np.array([0, 1, 1], np.int32)
    ce = -log_softmax64(ref)[np.arange(3), labels]
    np.testing.assert_allclose(candidate_loss(scores, labels), ce, rtol=1e-5)
    np.testing.assert_array_equal(candidate_predict(scores), ref.argmax(axis=1))
    # the per-example loss of the mechanisms is the same number
    split, tr, fr = split_full(model, lora_predicate(("o",)))
    pool = candidate_examples(batch, labels)
    per = jax.jit(jax.vmap(lambda ex: candidate_loss_fn(split)(tr, fr, ex)))(pool)
    np.testing.assert_allclose(per, ce, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(N, C, T\)"):
        candidate_scores(model, {k: v[0] for k, v in batch.items()})
    with pytest.raises(ValueError, match="one per prompt"):
        candidate_examples(batch, labels[:2])


def test_lora_factored_equals_merged_on_the_token_loss(model):
    split, B, frozen = split_lora(model, jax.random.key(3), LORA,
                                  targets=("q", "k", "v", "o", "gate", "up", "down"))
    assert isinstance(split, LMSplit) and split.kind == "lora"
    assert set(B) == set(model.lora_targets())
    rng = np.random.default_rng(4)
    B = {p: (0.3 * rng.standard_normal(b.shape)).astype(np.float32) for p, b in B.items()}
    ids, mask = padded([[5, 9, 2, 44, 17, 3], [8, 8, 31, 62]], 7, "left")
    ex = {"input_ids": ids[1], "attention_mask": mask[1]}
    loss_fn = token_loss_fn(split)

    def merged_loss(b):  # through pavejax.lora.apply_lora on the weights
        m = split.merged(b, frozen)
        return token_loss(m, ids[1:], mask[1:])[0]

    @jax.jit  # one program for both forms
    def both(b, frozen, ex):
        return jax.value_and_grad(loss_fn)(b, frozen, ex), jax.value_and_grad(merged_loss)(b)

    (factored, g_f), (merged, g_m) = both(B, frozen, ex)
    np.testing.assert_allclose(factored, merged, rtol=1e-5)
    for p in B:
        np.testing.assert_allclose(g_f[p], g_m[p], rtol=1e-4, atol=1e-6)
    base = -unpadded_logprobs(model, [8, 8, 31, 62]).mean()
    assert abs(float(factored) - base) > 1e-4  # the adapters do act
    with pytest.raises(ValueError, match="pass the trainable"):
        loss_fn({p: b for p, b in list(B.items())[1:]}, frozen, ex)


def test_full_weight_split_rebuilds_the_model_and_trains_only_its_subset(model):
    pred = lambda p, _: p.startswith("layers/0/mlp/")  # noqa: E731
    split, tr, fr = split_full(model, pred)
    assert split.kind == "full" and all(p.startswith("layers/0/mlp/") for p in tr)
    assert not set(tr) & set(fr["params"])
    ids, mask = padded([[5, 9, 2, 44, 17, 3]], 6, "right")
    ex = {"input_ids": ids[0], "attention_mask": mask[0]}
    value_and_grad = jax.jit(jax.value_and_grad(token_loss_fn(split)))
    loss, grads = value_and_grad(tr, fr, ex)
    grads = {p: np.asarray(g, np.float64) for p, g in grads.items()}
    np.testing.assert_allclose(loss, -unpadded_logprobs(model, list(ids[0])).mean(), rtol=1e-5)
    assert set(grads) == set(tr) and all(np.abs(g).max() > 0 for g in grads.values())
    # the gradient against a central difference of the loss along a random direction (the
    # points on the host: the same compiled program evaluates them)
    rng = np.random.default_rng(5)
    d = {p: rng.standard_normal(x.shape) for p, x in tr.items()}
    h = 1e-3
    up, down = (value_and_grad({p: (np.asarray(tr[p], np.float64) + s * h * d[p]).astype(
        np.float32) for p in tr}, fr, ex)[0] for s in (1, -1))
    slope = sum(float(np.sum(grads[p] * d[p])) for p in tr)
    np.testing.assert_allclose((float(up) - float(down)) / (2 * h), slope, rtol=1e-2)
    with pytest.raises(ValueError, match="selected none"):
        split_full(model, lambda p, _: False)


def test_lora_predicate_selects_targets_and_layers_and_refuses_unknown_names():
    two = nnx.eval_shape(lambda: LlamaLM(LlamaConfig.tiny(num_layers=2), rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.split(two)[1])  # paths and shapes are all it needs
    chosen = lora_lib.select_paths(params, lora_predicate(("v", "down"), layers=[1]))
    assert chosen == ("layers/1/attn/v/kernel", "layers/1/mlp/down/kernel")
    assert len(lora_lib.select_paths(params, lora_predicate())) == 4
    with pytest.raises(ValueError, match="subset of"):
        lora_predicate(("query",))
    with pytest.raises(ValueError, match="block indices"):
        lora_predicate(layers=[-1])
    with pytest.raises(TypeError, match="LlamaLM"):
        split_full(object(), lambda p, _: True)


# --- -F1 of greedy generations -----------------------------------------------------------------

def word_decoder(newline):
    """A tiny word-level tokenizer: id ``newline`` is a line break, others are words 'w<id>'."""
    return lambda ids: " ".join("\n" if i == newline else f"w{i}" for i in ids).replace(
        " \n ", "\n")


def test_generation_f1_loss_equals_a_host_recomputation(model):
    from pavejax.data.squad import answer_text, squad_f1

    rng = np.random.default_rng(2)
    rows = [list(rng.integers(4, CFG.vocab_size, n)) for n in (5, 7, 3, 6)]
    ids, mask = padded(rows, 8, "left")
    split, B, frozen = split_lora(model, jax.random.key(3), LORA)
    # The line break is the third token row 0 generates, so that row stops early and its text
    # is cut there. The reference: greedy continuations of the unpadded prompts, recomputed in
    # full.
    newline = greedy_continuation(model, rows[0], 3, stop=None)[-1]
    decode = word_decoder(newline)
    texts = [answer_text(decode(greedy_continuation(model, r, 4, newline))) for r in rows]
    words = [t.split() for t in texts]
    assert len(words[0]) <= 2 and len(words[1]) >= 1
    answers = [[texts[0]],                                   # exact: F1 = 1
               [" ".join(words[1][:1] + ["zz"]), "nothing"],  # one word shared
               ["unrelated words"],                          # F1 = 0
               [texts[3], "other"]]
    table = AnswerTable(answers, decode)
    loss_fn = generation_f1_loss_fn(split, table, max_new_tokens=4, pad_id=0,
                                    stop_tokens=(newline,))

    @jax.jit
    def run(i, m, e, pool):  # one compilation: both loss forms
        batched = generation_f1_losses(model, i, m, e, table, max_new_tokens=4, pad_id=0,
                                       stop_tokens=(newline,))
        return batched, jax.vmap(lambda ex: loss_fn(B, frozen, ex))(pool)

    eids = np.arange(4, dtype=np.int32)
    pool = {"input_ids": ids, "attention_mask": mask,
            "example_id": np.where(eids == 2, -1, eids).astype(np.int32)}  # id -1: scores 0
    losses, per = run(ids, mask, eids, pool)
    ref = np.array([-squad_f1(t, a) for t, a in zip(texts, answers, strict=True)])
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    assert np.all((ref >= -1) & (ref <= 0)) and ref[0] == -1.0 and ref[2] == 0.0
    assert ref[1] not in (0.0, -1.0)
    np.testing.assert_allclose(per, ref * np.array([1, 1, 0, 1]), rtol=1e-6)
    with pytest.raises(Exception, match="past the answer table"):
        jax.block_until_ready(run(ids, mask, eids + 10, pool))
    with pytest.raises(ValueError, match="non-empty sequence of strings"):
        AnswerTable([["a"], "b"], decode)
