"""``pavejax adapt --lm`` end to end on a tiny random Llama (Hugging Face layout written here, a
tiny byte-level tokenizer.json), and the cached top-layer path of :mod:`pavejax.lm_cache`.

Figures the command records are recomputed independently: accuracies by scoring the test split
on the whole model (``pavejax.lm.candidate_scores``) with the release's updates added, the PAC
figures from closed forms (ZPL: 0 nats, posterior 1/2)."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import pre_tokenizers

from pavejax import lm, lora as lora_lib
from pavejax.accounting import Ledger
from pavejax.cli import main
from pavejax.commands.adapt_lm import (
    load_adapted_lm,
    load_backbone,
    load_lm_adapter,
)
from pavejax.data.prompts import PromptTemplate, encode_candidates, encode_prompts
from pavejax.data.tasks import limit_task, split_task
from pavejax.lm_cache import TopDownLora, candidate_token_ids, top_features
from pavejax.models import LlamaConfig, LlamaLM, LlamaTokenizer, save_hf_llama

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = ["Ġ g", "r e", "Ġg re", "a t", "Ġgre at", "Ġ b", "Ġb a", "Ġba d"]
TOKENS = SPECIALS + ALPHABET + ["Ġg", "re", "Ġgre", "at", "Ġgreat", "Ġb", "Ġba", "Ġbad"]
GOOD = ["fun", "a joy", "warm", "sharp", "moving"]
BAD = ["dull", "a mess", "flat", "slow", "empty"]
TEMPLATE = "{sentence} It was"
CANDIDATES = (" bad", " great")
SEQ = 24
RUN = ["--template", TEMPLATE, "--candidates", *CANDIDATES, "--seq-len", str(SEQ),
       "--pool-size", "32", "--dev-size", "8", "--test-size", "12", "--subsets", "4",
       "--steps", "6", "--lr", "1", "--zo-eps", "0.01", "--rank", "2", "--seed", "3"]


def _tokenizer_json():
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


def _write_lm(directory, seed):
    """A tiny random Llama, its matrices (std 0.02) scaled by 100 / sqrt(rows): at 0.02 the two
    candidates' scores differ by about 1e-5 and a few steps move nothing measurable."""
    model = LlamaLM(LlamaConfig.tiny(vocab_size=len(TOKENS)), rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    params = jax.tree.map(lambda w: w if w.ndim == 1 else w * (100.0 / np.sqrt(w.shape[0])),
                          nnx.to_pure_dict(state))
    save_hf_llama(nnx.merge(graphdef, params), directory)
    (directory / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}))
    return directory


def _records():
    out = []
    for i in range(60):
        label = i % 2
        word = (GOOD if label else BAD)[(i // 2) % 5]
        out.append({"sentence": f"Film {i}: {word}.", "label": label})
    return out


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def adapt_json(*args):
    rc, out, err = cli("adapt", *args, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt_lm")
    _write_lm(root / "tiny_lm", seed=0)
    _write_lm(root / "other_lm", seed=1)
    _write_jsonl(root / "reviews.jsonl", _records())
    return root


@pytest.fixture(scope="module")
def mezo(work):
    """MeZO (no secret randomness, so one run per flags) on the cached path and on the whole
    model."""
    return {path: adapt_json("--lm", work / "tiny_lm", "--data", work / "reviews.jsonl", *RUN,
                             "--mechanism", "mezo", "--lm-path", path, "--out", work / path)
            for path in ("top", "whole")}


@pytest.fixture(scope="module")
def zpl(work, mezo):
    """ZPL continuing the MeZO adapter."""
    return adapt_json("--lm", work / "tiny_lm", "--model", work / "top", "--data",
                      work / "reviews.jsonl", *RUN, "--out", work / "zpl")


def _test_split():
    """The test split the command uses (pool/dev/test by the public seed, then the caps)."""
    records = _records()
    task = split_task("reviews.jsonl", [r["sentence"] for r in records],
                      np.array([r["label"] for r in records]), ("bad", "great"), seed=3)
    return limit_task(task, max_train=32, max_dev=8, max_test=12, seed=3).test


def _rank(m):
    s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return int(np.sum(s > 1e-5 * max(s[0], 1e-30)))


def _accuracy_with(backbone, deltas):
    """Test accuracy of the whole backbone with ``deltas`` added to its kernels by hand."""
    graphdef, state = nnx.split(backbone.model)
    params = nnx.to_pure_dict(state)
    for path, delta in deltas.items():
        *parents, leaf = path.split("/")
        node = params
        for k in parents:
            node = node[int(k) if k.isdigit() else k]
        node[leaf] = np.asarray(node[leaf]) + delta
    template, split, tok = PromptTemplate(TEMPLATE, CANDIDATES), _test_split(), backbone.tokenizer
    batch = encode_candidates(tok, [template.format(s) for s in split.inputs], template,
                              max_length=SEQ, pad_id=tok.pad_id)
    pred = np.argmax(lm.score_candidates(nnx.merge(graphdef, params), batch), axis=-1)
    return float(np.mean(pred == split.labels))


def test_cached_and_whole_model_paths_train_the_same_adapter(work, mezo):
    backbone = load_backbone(work / "tiny_lm")
    top, meta = load_lm_adapter(work / "top", backbone)
    whole, _ = load_lm_adapter(work / "whole", backbone)
    assert sorted(top) == ["layers/1/mlp/down/kernel"]
    (p,) = top
    assert np.any(top[p]) and meta.extra["selection"]["selected_step"] > 0
    # one adapter up to float rounding, which the ZO steps carry forward (entries ~1e-3; a
    # wrong path would differ by that much, not by the ~1e-6 seen across CPU kinds)
    assert np.abs(top[p]).max() > 1e-4
    np.testing.assert_allclose(top[p], whole[p], rtol=1e-3, atol=1e-5)
    assert _rank(top[p]) <= 2  # a rank-2 LoRA update
    for run in mezo.values():
        assert run["test_accuracy_before"] == pytest.approx(_accuracy_with(backbone, {}))
        assert run["test_accuracy"] == pytest.approx(_accuracy_with(backbone, top))
        assert run["guarantee"]["kind"] == "none"
    assert meta.ledger is None and meta.mechanism == "mezo"


def test_zpl_release_loads_and_its_figures_hold(work, mezo, zpl):
    model, tok, meta = load_adapted_lm(work / "zpl", work / "tiny_lm")
    backbone = load_backbone(work / "tiny_lm")
    assert meta.kind == "lm_adapter" and meta.backbone_id == "tiny_lm"
    assert meta.backbone_hash == backbone.hash
    assert meta.extra["template"] == TEMPLATE and meta.extra["candidates"] == list(CANDIDATES)
    assert meta.extra["classes"] == ["bad", "great"]  # a --data file's labels are the candidates
    assert meta.mechanism == "paczero-zpl" and meta.rank == 2
    # ZPL: zero nats, so a membership attack's posterior stays at the prior 1/2
    g = meta.guarantee
    assert g["kind"] == "pac_mi" and g["mutual_information_nats"] == 0.0
    assert g["mia_posterior_bound"] == pytest.approx(0.5)
    assert Ledger.from_dict(meta.ledger).mutual_information() == 0.0
    # the release holds the upstream update plus one more rank-2 one (zero if none was kept)
    first, _ = load_lm_adapter(work / "top", backbone)
    second, _ = load_lm_adapter(work / "zpl", backbone)
    (p,) = second
    assert _rank(second[p] - first[p]) <= 2
    assert (meta.extra["selection"]["selected_step"] == 0) == \
        np.array_equal(second[p], first[p])
    assert meta.extra["upstream"]["mechanism"] == "mezo"
    assert meta.extra["upstream"]["guarantee"] == {"kind": "none", "note": mezo["top"][
        "guarantee"]["note"]}
    # accuracies on the whole model: before = the upstream adapter's, after = this release's
    assert zpl["test_accuracy_before"] == pytest.approx(_accuracy_with(backbone, first))
    assert zpl["test_accuracy"] == pytest.approx(_accuracy_with(backbone, second))
    assert meta.extra["test_accuracy"] == zpl["test_accuracy"]
    assert float(np.max(np.abs(np.asarray(model.layers[1].mlp.down.kernel[...]) - (
        np.asarray(backbone.model.layers[1].mlp.down.kernel[...]) + second[p])))) < 1e-6
    rc, out, _ = cli("ledger", work / "zpl")
    assert rc == 0 and "lm_adapter" in out
    rc, _, err = cli("adapt", "--lm", work / "other_lm", "--model", work / "zpl", "--data",
                     work / "reviews.jsonl", *RUN, "--out", work / "x")
    assert rc == 1 and "release for another backbone" in err and "tiny_lm" in err


def test_bad_input_is_refused_with_what_to_do(work):
    base = ["adapt", "--lm", work / "tiny_lm", "--data", work / "reviews.jsonl", "--out",
            work / "never"]
    rc, _, err = cli(*base, "--template", "Review: It was")
    assert rc == 1 and "no {sentence} slot" in err
    rc, _, err = cli(*base, "--candidates", " terrible", " great")
    assert rc == 1 and "' terrible' is 9 tokens" in err and "--lm-path whole" in err
    rc, _, err = cli(*base, "--template", "{sentence} It was ")
    assert rc == 1 and "ends with a space" in err
    _write_jsonl(work / "empty.jsonl", [])
    rc, _, err = cli("adapt", "--lm", work / "tiny_lm", "--data", work / "empty.jsonl", "--out",
                     work / "never")
    assert rc == 1 and "holds no labelled sentences" in err
    _write_jsonl(work / "bad_label.jsonl", [*_records()[:5], {"sentence": "x", "label": 2}])
    rc, _, err = cli("adapt", "--lm", work / "tiny_lm", "--data", work / "bad_label.jsonl",
                     "--out", work / "never")
    assert rc == 1 and "bad_label.jsonl:6: label 2 is out of range" in err
    _write_jsonl(work / "few.jsonl", _records()[:3])
    rc, _, err = cli("adapt", "--lm", work / "tiny_lm", "--data", work / "few.jsonl",
                     "--out", work / "never")
    assert rc == 1 and "leave an empty split" in err
    rc, _, err = cli("adapt", "--lm", work / "nowhere", "--data", work / "reviews.jsonl",
                     "--out", work / "never")
    assert rc == 1 and "is not 'smollm2'" in err
    rc, _, err = cli("adapt", "--model", work / "zpl", "--task", "movie", "--template",
                     TEMPLATE, "--out", work / "never")
    assert rc == 1 and "--template apply to a language model only" in err
    rc, _, err = cli("adapt", "--task", "movie", "--out", work / "never")
    assert rc == 1 and "give --model" in err
    assert not (work / "never").exists()


# --- the cached top-layer path -----------------------------------------------------------------


def test_cached_top_layer_equals_the_whole_model(work, getkey):
    """Candidate log-softmax of the cached path = the whole model's with LoRA merged, for a
    moved adapter, prompts of several lengths and a padded last chunk."""
    backbone = load_backbone(work / "tiny_lm")
    model, tok = backbone.model, backbone.tokenizer
    template = PromptTemplate(TEMPLATE, CANDIDATES)
    prompts = [template.format(r["sentence"]) for r in _records()[:6]] + ["It"]
    config = lora_lib.LoraConfig(2, alpha=4, init="kaiming_uniform")
    split, B, frozen = lm.split_lora(model, getkey(), config, targets=("down",), layers=(1,))
    B = jax.tree.map(lambda b: 0.3 * jax.random.normal(getkey(), b.shape), B)
    ids, mask = encode_prompts(tok, prompts, max_length=SEQ, pad_id=tok.pad_id,
                               padding_side="right")
    feats = top_features(model, ids, mask, batch_size=4)  # two chunks, the last one padded
    adapter = TopDownLora.of(model, config)
    top = adapter.frozen(model, frozen["A"], candidate_token_ids(tok, CANDIDATES))
    cached = adapter.batch_logits(B, top, {k: jnp.asarray(v) for k, v in feats.items()})
    whole = lm.score_candidates(split.merged(B, frozen), encode_candidates(
        tok, prompts, template, max_length=SEQ, pad_id=tok.pad_id))
    np.testing.assert_allclose(jax.nn.log_softmax(cached), jax.nn.log_softmax(whole),
                               rtol=1e-4, atol=1e-5)
    assert np.ptp(np.asarray(cached[:, 1] - cached[:, 0])) > 0.1  # the scores do differ


def test_cached_path_refusals(work):
    tok = LlamaTokenizer.from_file(work / "tiny_lm" / "tokenizer.json")
    with pytest.raises(ValueError, match="' terrible' is 9 tokens"):
        candidate_token_ids(tok, (" terrible", " great"))
    model = load_backbone(work / "tiny_lm").model
    ids, mask = encode_prompts(tok, ["It was"], max_length=8, pad_id=tok.pad_id,
                               padding_side="left")
    with pytest.raises(ValueError, match="not right-padded"):
        top_features(model, ids, mask)
    with pytest.raises(ValueError, match="no prompts"):
        top_features(model, ids[:0], mask[:0])
