"""SmolLM2-135M-Instruct on its real GGUF file (the ``smollm2`` asset): perplexity on real
text and the facts of its vocabulary. The file is read once for the whole module (parsing and
dequantising it is most of the cost); the loaders and the tokenizer are tested on tiny files in
test_llama_loading.py and test_llama_tokenizer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pavejax.models import load_smollm2
from tests.test_llama_tokenizer import VARIED

pytestmark = pytest.mark.assets


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)`` of the real file, loaded once."""
    from pavejax import assets

    try:
        return load_smollm2()
    except assets.AssetMissingError as err:
        pytest.skip(str(err))


@nnx.jit
def _forward(model, ids, mask):
    return model(ids, mask)


def test_prefers_real_english_to_the_same_words_shuffled(smollm2):
    """Perplexity of a real sentence against the same words in a fixed random order. Without the
    q/k un-permute this sentence measured about 45 (with it about 24)."""
    model, tok = smollm2
    assert (model.config.num_layers, model.config.hidden_size, model.config.num_kv_heads) == \
        (30, 576, 3)
    sentence = ("The quick brown fox jumps over the lazy dog, and the dog does not seem to mind "
                "at all.")
    words = sentence.split()
    shuffled = " ".join(words[i] for i in np.random.default_rng(0).permutation(len(words)))
    ids, mask = tok.batch([sentence, shuffled], max_length=32, padding_side="right")
    assert mask.sum(1).max() < 32
    logits = _forward(model, jnp.asarray(ids), jnp.asarray(mask))
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)[..., 0]
    ppl = np.exp((nll * mask[:, 1:]).sum(1) / mask[:, 1:].sum(1))
    assert ppl[0] < 35, ppl
    assert ppl[1] > 10 * ppl[0], ppl


def test_special_tokens_and_candidates(smollm2):
    _, tok = smollm2
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.decode([0, 1, 2], skip_special_tokens=False) == \
        "<|endoftext|><|im_start|><|im_end|>"
    assert tok.decode(list(range(17))) == ""  # the 17 control tokens
    chat = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert chat[0] == 1 and chat[-1] == 2 and tok.decode(chat) == "user\nHi"
    assert tok.encode(" great") == [1109] and tok.encode(" terrible") == [13321]
    prompt = tok.encode("It was")
    assert prompt[0] != tok.bos_id  # no BOS added
    assert tok.encode("It was great") == prompt + [1109]
    assert len(tok.encode("12345")) == 5


def test_round_trip_and_chat_template(smollm2):
    _, tok = smollm2
    for text in VARIED:
        assert tok.decode(tok.encode(text)) == text
    user = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(user)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *user])
    assert "SmolLM" not in own and own.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    ids = tok.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed
