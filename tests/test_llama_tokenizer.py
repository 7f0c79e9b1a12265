"""LlamaTokenizer: a tiny byte-level vocabulary written here (GGUF metadata and tokenizer.json
forms); the SmolLM2 facts on the real file are in test_smollm2.py."""

import json

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from pavejax.models import LlamaTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = ["h e", "Ġ t", "Ġt he", "Ġ g", "r e", "Ġg re", "a t", "Ġgre at", "2 0"]
MERGED = ["he", "Ġt", "Ġthe", "Ġg", "re", "Ġgre", "at", "Ġgreat", "20"]
TOKENS = SPECIALS + ALPHABET + MERGED
TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
            "<|im_start|>system\nDefault.<|im_end|>\n{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VARIED = ["Hello, world!", "  two leading spaces\n\nand\ttabs  ", "Prices: 1234.50 (2024)",
          "naïve café — 東京 🙂", "", "It was great"]


def _id(token):
    return TOKENS.index(token)


def _metadata(**overrides):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(TOKENS) - 3),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.padding_token_id": 2, "tokenizer.chat_template": TEMPLATE}
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def tiny():
    return LlamaTokenizer.from_gguf_metadata(_metadata())


def test_bpe_merges_and_leading_space(tiny):
    assert tiny.encode(" the great") == [_id("Ġthe"), _id("Ġgreat")]
    # no prefix space is added: a text-initial word is not the "Ġ" form
    assert tiny.encode("the") == [_id("t"), _id("he")]
    assert tiny.encode("It was great")[-1] == _id("Ġgreat")
    assert tiny.vocab_size == len(TOKENS)
    assert (tiny.bos_id, tiny.eos_id, tiny.pad_id) == (1, 2, 2)


def test_digits_are_split_one_by_one_despite_a_merge(tiny):
    assert tiny.encode("2024") == [_id("2"), _id("0"), _id("2"), _id("4")]
    assert tiny.encode("x2") == [_id("x"), _id("2")]


def test_control_tokens_stay_whole_and_are_skipped_on_decode(tiny):
    text = "<|im_start|>user\nthe<|im_end|>"
    ids = tiny.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tiny.decode(ids) == "user\nthe"
    assert tiny.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", VARIED)
def test_round_trip(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


def test_no_bos_unless_the_model_asks(tiny):
    assert tiny.encode("the", add_special_tokens=True) == tiny.encode("the")
    with_bos = LlamaTokenizer.from_gguf_metadata(
        _metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("the", add_special_tokens=True) == [1, _id("t"), _id("he")]
    assert with_bos.encode("the") == [_id("t"), _id("he")]


def test_batch_padding_sides_and_left_truncation(tiny):
    texts = ["the great", "x", "abcdefgh"]
    ids = [tiny.encode(t) for t in texts]
    assert [len(i) for i in ids] == [3, 1, 8]
    n = 4
    left, left_mask = tiny.batch(texts, max_length=n)
    right, right_mask = tiny.batch(texts, max_length=n, padding_side="right")
    assert left.dtype == right.dtype == left_mask.dtype == np.int32
    assert left.shape == right.shape == (3, n)
    for row, seq in enumerate(ids):
        kept = seq[-n:]
        pad = [tiny.pad_id] * (n - len(kept))
        np.testing.assert_array_equal(left[row], pad + kept)
        np.testing.assert_array_equal(right[row], kept + pad)
        np.testing.assert_array_equal(left_mask[row], [0] * len(pad) + [1] * len(kept))
        np.testing.assert_array_equal(right_mask[row], [1] * len(kept) + [0] * len(pad))


def test_chat_template_renders_with_default_system_prompt(tiny):
    user = [{"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(user) == (
        "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, *user]
    text = tiny.apply_chat_template(own, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert tiny.encode(text).count(1) == 2


def _hf_tokenizer_json():
    """The same tokenizer written by hand in Hugging Face's tokenizer.json schema."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(TOKENS)}, "merges": MERGES},
    }


def test_from_file_matches_the_gguf_form(tiny, tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(_hf_tokenizer_json()))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
         "pad_token": {"content": "<|im_end|>"}, "chat_template": TEMPLATE}))
    hf = LlamaTokenizer.from_file(tmp_path / "tokenizer.json")
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (1, 2, 2, len(TOKENS))
    for text in [*VARIED, "<|im_start|>user\n2024 the great<|im_end|>"]:
        assert hf.encode(text) == tiny.encode(text)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == \
        tiny.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_sources_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="only byte-level BPE"):
        LlamaTokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="'qwen2' is not supported"):
        LlamaTokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.pre": "qwen2"}))
    with pytest.raises(ValueError, match="eos_id=9999 is outside"):
        LlamaTokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.eos_token_id": 9999}))
    with pytest.raises(ValueError, match="no chat template"):
        LlamaTokenizer.from_gguf_metadata(_metadata(**{"tokenizer.chat_template": None})) \
            .apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        LlamaTokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(TypeError, match="sequence of str"):
        LlamaTokenizer.from_gguf_metadata(_metadata()).batch("the", max_length=4)

