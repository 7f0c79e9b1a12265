"""Tests of pavejax.data.prompts: templates, prompted sentiment splits, fixed-shape batches."""

import numpy as np
import pytest

from pavejax.data import prompts as prompts_mod
from pavejax.data.prompts import (
    CandidateBatch,
    PromptedTask,
    PromptTemplate,
    encode_candidates,
    encode_prompts,
    load_prompted_sentiment,
)
from pavejax.data.tasks import Split, Task

PAD = 0


class CharTokenizer:
    """One token per character: id = code point (never 0, the pad id here)."""

    def encode(self, text):
        return [ord(ch) for ch in text]


def _row(text, length):
    """Expected ids of ``text`` right-padded to ``length``, written out independently."""
    return [ord(ch) for ch in text] + [PAD] * (length - len(text))


def _mask(pattern):
    return [int(ch) for ch in pattern]


# --- template ---------------------------------------------------------------------------------


def test_template_defaults_and_format():
    t = PromptTemplate()
    assert t.candidates == (" terrible", " great")
    assert t.format("  A fine film. ") == "A fine film. It was"
    assert t.format("uses {braces} and {sentence}") == "uses {braces} and {sentence} It was"
    assert PromptTemplate("Review: {sentence}\nSentiment:", [" bad", " good"]).candidates == (
        " bad", " good")


@pytest.mark.parametrize("kwargs, message", [
    ({"template": "{text} It was"}, "containing '{sentence}'"),
    ({"candidates": (" great",)}, "at least 2 candidates"),
    ({"candidates": (" bad", "")}, "non-empty str"),
    ({"candidates": (" bad", " bad")}, "distinct"),
    ({"candidates": " bad"}, "not one string"),
])
def test_template_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptTemplate(**kwargs)


# --- encode_candidates ------------------------------------------------------------------------


def test_encode_candidates_masks_and_left_truncation():
    template = PromptTemplate("{sentence}", (" x", " yz"))
    batch = encode_candidates(CharTokenizer(), ["ab", "abcdef"], template, max_length=6,
                              pad_id=PAD)
    assert isinstance(batch, CandidateBatch)
    assert all(a.dtype == np.int32 and a.shape == (2, 2, 6) for a in batch)
    # Worked by hand. "abcdef" + " x" is 8 > 6 tokens: the prompt keeps its last 4 ("cdef");
    # with " yz" (3 tokens) it keeps its last 3 ("def"). Candidates are never cut.
    texts = [["ab x", "ab yz"], ["cdef x", "def yz"]]
    attention = [["111100", "111110"], ["111111", "111111"]]
    option = [["001100", "001110"], ["000011", "000111"]]
    for n in range(2):
        for c in range(2):
            assert batch.input_ids[n, c].tolist() == _row(texts[n][c], 6)
            assert batch.attention_mask[n, c].tolist() == _mask(attention[n][c])
            assert batch.option_mask[n, c].tolist() == _mask(option[n][c])


def test_encode_candidates_scores_follow_the_shift_rule():
    """The documented reading (log-prob of token t from the logits at t - 1) gives, for a
    bigram model, the sum of log p(char | previous char) over the candidate's characters."""
    rng = np.random.default_rng(0)
    vocab = 128
    table = rng.normal(size=(vocab, vocab))
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))  # row = previous token
    template = PromptTemplate("{sentence} was", (" bad", " ok"))
    sentences = ["it", "a long sentence here"]
    batch = encode_candidates(CharTokenizer(), [template.format(s) for s in sentences], template,
                              max_length=16, pad_id=PAD)
    logits = logp[batch.input_ids]                                   # (N, C, T, vocab)
    lp = np.take_along_axis(logits[:, :, :-1], batch.input_ids[:, :, 1:, None], -1)[..., 0]
    scores = (lp * batch.option_mask[:, :, 1:]).sum(-1)
    for n, s in enumerate(sentences):
        for c, cand in enumerate(template.candidates):
            text = template.format(s) + cand
            expected = sum(logp[ord(a), ord(b)] for a, b in zip(text[-len(cand) - 1:-1],
                                                                text[-len(cand):]))
            assert scores[n, c] == pytest.approx(expected, rel=1e-12)
    assert not batch.option_mask[..., 0].any()


def test_encode_candidates_errors():
    template = PromptTemplate("{sentence}", (" x", " yz"))
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="no room for the prompt"):
        encode_candidates(tok, ["abc"], template, max_length=3, pad_id=PAD)
    batch = encode_candidates(tok, ["abc"], template, max_length=4, pad_id=PAD)
    assert batch.input_ids[0, 1].tolist() == _row("c yz", 4)  # one prompt token is enough
    with pytest.raises(ValueError, match="prompt '' encodes to no tokens"):
        encode_candidates(tok, ["ok", ""], template, max_length=8, pad_id=PAD)
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        encode_candidates(tok, ["ok"], template, max_length=0, pad_id=PAD)


# --- encode_prompts ---------------------------------------------------------------------------


def test_encode_prompts_left_and_right_padding_with_truncation():
    tok = CharTokenizer()
    texts = ["ab", "abcdefg", "wxyz"]
    ids, mask = encode_prompts(tok, texts, max_length=4, pad_id=PAD)
    assert ids.dtype == mask.dtype == np.int32 and ids.shape == mask.shape == (3, 4)
    assert ids.tolist() == [[PAD, PAD, ord("a"), ord("b")], [ord(c) for c in "defg"],
                            [ord(c) for c in "wxyz"]]
    assert mask.tolist() == [_mask("0011"), _mask("1111"), _mask("1111")]
    ids, mask = encode_prompts(tok, texts, max_length=4, pad_id=PAD, padding_side="right")
    assert ids.tolist() == [_row("ab", 4), _row("defg", 4), _row("wxyz", 4)]
    assert mask.tolist() == [_mask("1100"), _mask("1111"), _mask("1111")]
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        encode_prompts(tok, texts, max_length=4, pad_id=PAD, padding_side="middle")
    with pytest.raises(ValueError, match="encodes to no tokens"):
        encode_prompts(tok, [""], max_length=4, pad_id=PAD)


# --- prompted sentiment -----------------------------------------------------------------------


def _fake_pool(monkeypatch):
    """100 distinct sentences, 30 negative and 70 positive, plus two repeats."""
    texts = [f"sentence {i:03d}" for i in range(100)]
    labels = np.array([0] * 30 + [1] * 70, np.int32)
    texts += ["sentence 005", "sentence 050"]
    labels = np.concatenate([labels, [0, 1]]).astype(np.int32)
    gold = dict(zip(texts, labels.tolist()))

    def fake_load_sentiment(domain, min_abs_rating=0.5):
        assert domain == "movie"
        return list(texts), labels.copy(), {"domain": domain}

    monkeypatch.setattr(prompts_mod, "load_sentiment", fake_load_sentiment)
    return gold


def test_prompted_sentiment_splits(monkeypatch):
    gold = _fake_pool(monkeypatch)
    task = load_prompted_sentiment(n_train=50, n_dev=10, n_test=20, seed=4)
    assert task.template == PromptTemplate()
    sets = {s: task.sentences(s) for s in ("train", "dev", "test")}
    assert {s: len(v) for s, v in sets.items()} == {"train": 50, "dev": 10, "test": 20}
    every = sets["train"] + sets["dev"] + sets["test"]
    assert len(set(every)) == len(every) == 80                      # disjoint, no repeats
    for split, sentences in sets.items():
        labels = task.labels(split)
        assert labels.dtype == np.int32
        assert labels.tolist() == [gold[s] for s in sentences]     # label follows its sentence
        # Pool proportions 30 : 70, so the quotas are exact: 30% negative in every split.
        assert int((labels == 0).sum()) == {"train": 15, "dev": 3, "test": 6}[split]
    assert task.prompts("dev") == [f"{s} It was" for s in sets["dev"]]
    assert task.task.metadata["n_unique"] == 100
    # Shuffled (the stratified draw is sorted by position), deterministic, seed-dependent.
    assert sets["train"] != sorted(sets["train"])
    again = load_prompted_sentiment(n_train=50, n_dev=10, n_test=20, seed=4)
    assert again.sentences("train") == sets["train"]
    other = load_prompted_sentiment(n_train=50, n_dev=10, n_test=20, seed=5)
    assert other.sentences("test") != sets["test"]
    # The test set depends only on (seed, n_test).
    smaller = load_prompted_sentiment(n_train=5, n_dev=30, n_test=20, seed=4)
    assert smaller.sentences("test") == sets["test"]


def test_prompted_sentiment_errors(monkeypatch):
    _fake_pool(monkeypatch)
    with pytest.raises(ValueError, match="exceeds the 100 sentences"):
        load_prompted_sentiment(n_train=80, n_dev=10, n_test=11)
    with pytest.raises(ValueError, match="n_dev must be a non-negative int"):
        load_prompted_sentiment(n_train=8, n_dev=-1, n_test=1)
    with pytest.raises(ValueError, match="exactly 2 candidates"):
        load_prompted_sentiment(n_train=8, n_dev=1, n_test=1,
                                template=PromptTemplate(candidates=(" bad", " ok", " good")))
    task = load_prompted_sentiment(n_train=8, n_dev=1, n_test=1)
    with pytest.raises(ValueError, match="split must be one of"):
        task.sentences("val")
    three = Task("t", ("a", "b", "c"), *(Split(["x", "y", "z"], np.arange(3)),) * 3)
    with pytest.raises(ValueError, match="3 classes but the template has 2 candidates"):
        PromptedTask(three, PromptTemplate())


@pytest.mark.assets
def test_prompted_movie_sentiment_on_real_data():
    from pavejax.data.text import load_sentiment

    texts, labels, _ = load_sentiment("movie")
    gold = dict(zip(texts, labels.tolist()))
    task = load_prompted_sentiment("movie", n_train=64, n_dev=32, n_test=100, seed=0)
    every = sum((task.sentences(s) for s in ("train", "dev", "test")), [])
    assert len(set(every)) == 196
    for split in ("train", "dev", "test"):
        assert task.labels(split).tolist() == [gold[s] for s in task.sentences(split)]
        assert all(p.endswith(" It was") for p in task.prompts(split))
    # About half of the movie snippets are positive; stratification keeps that to a sentence.
    assert abs(int(task.labels("test").sum()) - 100 * float(labels.mean())) <= 1
