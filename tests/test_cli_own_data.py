"""The command line on the user's own files (real MiniLM, real text written to files the way a
user would: shuffled columns, an extra column, CSV / Parquet / JSON Lines, integer labels with
named classes): `train --data` -> `spec --model --data` -> `dock submit` -> `spec --user-data`
-> `dock search` finds the right learnware first -> `merge --eval-data` -> `adapt --data`, each
stage of that chain run as `python -m pavejax` in a subprocess; releases carry the data file's
stem as the task name but never its folder, full name or hash; bad files fail with the file and
row named and leave nothing behind (in-process)."""

import json
import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pavejax.data import load_task
from tests.test_cli import cli, ok_json

pytestmark = [pytest.mark.assets, pytest.mark.slow]

SMALL = ["--steps", "3", "--batch-size", "8", "--train-size", "48", "--test-size", "32",
         "--seq-len", "16"]


def _rows(task_name, n, seed, *, split="train"):
    task = load_task(task_name, seed=seed)
    s = getattr(task, split)
    idx = np.random.default_rng(seed).permutation(len(s))[:n]
    return [s.inputs[i] for i in idx], [int(s.labels[i]) for i in idx], task.label_names


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("own")
    texts, labels, names = _rows("movie", 80, 1)
    # shuffled column order, an extra column, class names as labels
    pacsv.write_csv(pa.table({"stars": list(range(80)), "sentiment": [names[y] for y in labels],
                              "review": texts}), d / "movie.csv")
    t_texts, t_labels, _ = _rows("movie", 32, 2, split="test")
    pq.write_table(pa.table({"review": t_texts, "sentiment": [names[y] for y in t_labels]}),
                   d / "movie_test.parquet")
    b_texts, b_labels, b_names = _rows("bbc", 80, 1)
    # integer class ids, named on the command line
    pq.write_table(pa.table({"text": b_texts, "label": b_labels}), d / "news.parquet")
    s_texts, s_labels, _ = _rows("movie", 8, 3, split="dev")
    (d / "shots.jsonl").write_text("".join(
        json.dumps({"review": t, "sentiment": names[y]}) + "\n"
        for t, y in zip(s_texts, s_labels, strict=True)))
    return {"dir": d, "bbc_classes": ",".join(b_names)}


MOVIE_COLS = ["--text-column", "review", "--label-column", "sentiment"]


def run_json(*args) -> dict:
    """``python -m pavejax *args --json`` in a subprocess, as a user runs it (~10 s each)."""
    r = subprocess.run([sys.executable, "-m", "pavejax", *map(str, args), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def released(files):
    d = files["dir"]
    out = {"movie": run_json("train", "--data", d / "movie.csv", *MOVIE_COLS, "--test-data",
                            d / "movie_test.parquet", "--epsilon", "4", *SMALL,
                            "--out", d / "m_movie"),
           "news": run_json("train", "--data", d / "news.parquet", "--classes",
                           files["bbc_classes"], "--epsilon", "4", *SMALL,
                           "--out", d / "m_news")}
    assert run_json("dock", "init", d / "dock")["learnwares"] == 0
    for name, cols in (("movie", ["--data", d / "movie.csv", *MOVIE_COLS]),
                       ("news", ["--data", d / "news.parquet", "--classes",
                                 files["bbc_classes"]])):
        out[f"s_{name}"] = run_json("spec", "--dock", d / "dock", "--model", d / f"m_{name}",
                                   *cols, "--examples", "32", "--epsilon", "64",
                                   "--seq-len", "16", "--out", d / f"s_{name}")
        sub = run_json("dock", "submit", d / "dock", d / f"s_{name}", "--name", name,
                      "--model", d / f"m_{name}")
        assert sub["name"] == name and sub["has_model"]
    return out


def test_train_on_files_writes_a_dp_release_without_the_file(files, released):
    from pavejax.release import load_release

    d = files["dir"]
    _, meta = load_release(d / "m_movie")
    assert meta.extra["classes"] == ["negative", "positive"]  # inferred, sorted
    assert meta.extra["data"]["file"] == {
        "source": "file", "format": "csv", "text_column": "review",
        "label_column": "sentiment", "label_source": "inferred", "split": "stratified",
        "test_file": True}
    g = meta.guarantee
    assert g["kind"] == "dp" and g["relation"] == "replace_one" and g["epsilon"] <= 4 + 1e-6
    assert meta.extra["data"]["num_train"] == 48 and released["movie"]["test_accuracy"] >= 0
    rc, out, err = cli("ledger", d / "m_movie")
    assert rc == 0, err
    assert ("data file of the user's own (csv): text column 'review', label column "
            "'sentiment', classes inferred, split stratified, test file given") in out
    assert "data (public facts): num_train 48" in out and "movie.csv" not in out
    _, news = load_release(d / "m_news")
    assert news.extra["classes"] == files["bbc_classes"].split(",")
    assert news.extra["data"]["recipe"] == "topic"
    # the release names neither the file (only its stem, the task name), its folder nor its hash
    from pavejax.data import load_dataset_file
    digest = load_dataset_file(d / "movie.csv", text_column="review",
                               label_column="sentiment").metadata["files_sha256"]["movie.csv"]
    for path in (d / "m_movie", d / "s_movie"):
        text = "".join(p.read_text(errors="ignore") for p in path.rglob("*") if p.is_file())
        assert "movie.csv" not in text and digest not in text and str(d) not in text


def test_spec_of_a_file_model_composes_with_the_model(files, released):
    s = released["s_movie"]
    assert s["num_examples"] == 32 and s["task"] == "movie"
    assert s["guarantee"]["kind"] == "dp" and s["guarantee"]["epsilon"] <= 64 + 1e-6
    # the spec data are training rows of the model, so the composition is stated
    assert "composed_with_model" in s and s["composed_with_model"]["relation"] == "replace_one"
    assert math.isfinite(s["composed_with_model"]["epsilon"])
    rc, _, err = cli("spec", "--dock", files["dir"] / "dock", "--model",
                     files["dir"] / "m_movie", "--out", files["dir"] / "never")
    assert rc == 1 and "pass it with --data" in err
    assert not (files["dir"] / "never").exists()


def test_user_shots_from_a_file_find_the_right_learnware(files, released):
    d = files["dir"]
    user = run_json("spec", "--dock", d / "dock", "--user-data", d / "shots.jsonl", *MOVIE_COLS,
                   "--seq-len", "16", "--out", d / "s_user")
    assert user["num_examples"] == 8 and user["guarantee"]["kind"] == "none"
    assert user["classes"] == ["negative", "positive"]
    found = run_json("dock", "search", d / "dock", d / "s_user", "-k", "2")
    assert [r["name"] for r in found] == ["movie", "news"]


def test_search_straight_from_the_shots_file_writes_nothing(files, released, tmp_path):
    d = files["dir"]
    ok_json("spec", "--dock", d / "dock", "--user-data", d / "shots.jsonl", *MOVIE_COLS,
            "--seq-len", "16", "--out", tmp_path / "ref_user")
    before = sorted(p.name for p in d.iterdir())
    rc, out, err = cli("dock", "search", d / "dock", "--user-data", d / "shots.jsonl",
                       *MOVIE_COLS, "--seq-len", "16", "-k", "2", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == ["movie", "news"]
    # the same user spec as 'pavejax spec --user-data' (non-private, so deterministic)
    rc, ref, err = cli("dock", "search", d / "dock", tmp_path / "ref_user", "-k", "2",
                       "--json")
    assert rc == 0, err
    np.testing.assert_allclose([r["cosine"] for r in rows],
                               [r["cosine"] for r in json.loads(ref)], rtol=1e-5)
    assert sorted(p.name for p in d.iterdir()) == before


def test_merge_evaluates_on_a_file_and_adapt_trains_on_one(files, released):
    from pavejax.models import apply_head, embed_texts
    from pavejax.release import load_release

    d = files["dir"]
    merged = run_json("merge", "--base-classes", "negative,positive", "--models", d / "m_movie",
                     "--op", "wa", "--eval-data", d / "shots.jsonl", *MOVIE_COLS,
                     "--out", d / "merged")
    tensors, meta = load_release(d / "merged")
    assert "test_accuracy" not in meta.extra  # the user's eval file stays out of the release
    shots = [json.loads(line) for line in (d / "shots.jsonl").read_text().splitlines()]
    x = embed_texts([r["review"] for r in shots], max_length=16)
    pred = np.asarray(apply_head({k: np.asarray(v) for k, v in tensors.items()}, x)).argmax(1)
    want = np.mean(pred == np.array([r["sentiment"] == "positive" for r in shots]))
    assert merged["test_accuracy"] == pytest.approx(want)
    adapted = run_json("adapt", "--model", d / "merged", "--data", d / "movie.csv", *MOVIE_COLS,
                      "--mechanism", "zpl", "--steps", "4", "--pool-size", "32",
                      "--dev-size", "8", "--test-size", "16", "--subsets", "4",
                      "--out", d / "adapted")
    _, ameta = load_release(d / "adapted")
    assert ameta.guarantee["kind"] == "pac_mi" and ameta.guarantee["mutual_information_nats"] == 0
    assert ameta.extra["data"]["pool_size"] == 32
    assert ameta.extra["data"]["file"]["text_column"] == "review"
    assert 0.0 <= adapted["test_accuracy"] <= 1.0
    # labels outside the model's classes are refused by name
    rc, _, err = cli("adapt", "--model", d / "merged", "--data", d / "news.parquet",
                     "--classes", files["bbc_classes"], "--steps", "2", "--out", d / "never")
    assert rc == 1 and "the model predicts ['negative', 'positive']" in err
    assert not (d / "never").exists()


def test_bad_files_fail_clearly_and_write_nothing(files, released, tmp_path):
    d = files["dir"]
    (tmp_path / "bad_shots.jsonl").write_text(
        '{"review": "great", "sentiment": "positive"}\n'
        '{"review": "meh", "sentiment": "neutral"}\n')
    cases = [
        (["train", "--data", tmp_path / "missing.csv", "--epsilon", "4", *SMALL],
         "missing.csv: no such file"),
        (["train", "--data", d / "movie.csv", "--epsilon", "4", *SMALL],
         "no text column 'text'; the columns are ['stars', 'sentiment', 'review']"),
        (["train", "--task", "movie", "--classes", "a,b", "--epsilon", "4", *SMALL],
         "--classes applies to --data only"),
        (["spec", "--dock", d / "dock", "--user-data", tmp_path / "bad_shots.jsonl",
          *MOVIE_COLS, "--classes", "negative,positive"],
         "bad_shots.jsonl, row 2: label 'neutral' is not one of the stated classes"),
        (["spec", "--dock", d / "dock", "--user-data", d / "shots.jsonl", "--text-column",
          "review", "--label-column", "sentiment", "--classes", "negative,positive,neutral"],
         "no shot of the classes ['neutral']"),
    ]
    for args, words in cases:
        out = tmp_path / "out"
        rc, _, err = cli(*args, "--out", out)
        assert rc == 1 and words in err, (args, err)
        assert not out.exists()
    listed = ok_json("dock", "list", d / "dock")  # unchanged by the failures above
    assert [e["name"] for e in listed] == ["movie", "news"]
    assert all(e["has_model"] and e["guarantee"]["kind"] == "dp" for e in listed)


# --- a backbone of your own ----------------------------------------------------------------------


def test_a_bert_folder_of_your_own_trains_specs_and_keeps_its_identity(files, released,
                                                                        tmp_path):
    """A tiny random BERT written in the Hugging Face layout (hidden 32, 2 layers, not MiniLM's
    384 and 6) is the backbone of a model and its spec; its weights' hash is their identity,
    so MiniLM releases and docks refuse them and the other way round, naming both."""
    from pavejax.release import load_release
    from tests.test_models import _write_tiny_checkpoint, tiny_model

    bert = tmp_path / "tiny-bert"
    bert.mkdir()
    _write_tiny_checkpoint(bert, tiny_model(seed=3, scale=0.2))
    rng = np.random.default_rng(0)
    rows = [(" ".join(f"w{i}" for i in rng.integers(1, 60, 5)) + (" w99" if y else " w98"),
             "yes" if y else "no") for y in rng.integers(0, 2, 80)]
    pacsv.write_csv(pa.table({"text": [t for t, _ in rows], "label": [y for _, y in rows]}),
                    tmp_path / "words.csv")
    rc, text, err = cli("train", "--data", tmp_path / "words.csv", "--backbone", bert,
                        "--epsilon", "4", *SMALL, "--progress", "--json", "--out",
                        tmp_path / "m_tiny")
    assert rc == 0, err  # (--progress draws its bar on a terminal only; here it is off)
    out = json.loads(text)
    tensors, meta = load_release(tmp_path / "m_tiny")
    assert tensors["kernel"].shape == (32, 2) and meta.backbone_id == "bert:tiny-bert"
    _, minilm_meta = load_release(files["dir"] / "m_movie")
    assert meta.backbone_hash != minilm_meta.backbone_hash
    assert 0.0 <= out["test_accuracy"] <= 1.0
    assert ok_json("dock", "init", tmp_path / "tiny-dock")["learnwares"] == 0
    spec = ok_json("spec", "--dock", tmp_path / "tiny-dock", "--model", tmp_path / "m_tiny",
                   "--data", tmp_path / "words.csv", "--backbone", bert, "--layers", "0,1",
                   "--examples", "32", "--seq-len", "16", "--out", tmp_path / "s_tiny")
    assert spec["layers"] == [0, 1] and spec["guarantee"]["kind"] == "dp"
    _, smeta = load_release(tmp_path / "s_tiny")
    assert smeta.backbone_hash == meta.backbone_hash
    assert ok_json("dock", "submit", tmp_path / "tiny-dock", tmp_path / "s_tiny", "--name",
                   "tiny", "--model", tmp_path / "m_tiny")["id"] == 1
    # the model without its backbone, and a MiniLM spec in the tiny dock, are refused
    rc, _, err = cli("spec", "--dock", tmp_path / "tiny-dock", "--model", tmp_path / "m_tiny",
                     "--data", tmp_path / "words.csv", "--out", tmp_path / "never")
    assert rc == 1 and "another backbone" in err and "bert:tiny-bert" in err
    rc, _, err = cli("dock", "submit", tmp_path / "tiny-dock", files["dir"] / "s_movie",
                     "--name", "minilm")
    assert rc == 1 and "backbone_id: 'bert:tiny-bert' vs 'all-MiniLM-L6-v2'" in err
    rc, _, err = cli("train", "--task", "movie", "--backbone", tmp_path / "nothing",
                     "--epsilon", "4", *SMALL, "--out", tmp_path / "never")
    assert rc == 1 and "missing ['config.json', 'model.safetensors', 'tokenizer.json']" in err
    assert not (tmp_path / "never").exists()
    assert [e["name"] for e in ok_json("dock", "list", tmp_path / "tiny-dock")] == ["tiny"]
    # CLS pooling is another feature space: its identity says so, and mean-pooled use refuses it
    ok_json("train", "--data", tmp_path / "words.csv", "--backbone", bert, "--pooling", "cls",
            "--epsilon", "4", *SMALL, "--out", tmp_path / "m_cls")
    assert load_release(tmp_path / "m_cls")[1].backbone_id == "bert:tiny-bert/cls"
    rc, _, err = cli("merge", "--base-classes", "no,yes", "--models", tmp_path / "m_cls",
                     "--op", "wa", "--backbone", bert, "--out", tmp_path / "never")
    assert rc == 1 and "'bert:tiny-bert/cls' features, this command uses 'bert:tiny-bert'" \
        in err
    assert not (tmp_path / "never").exists()


def test_one_entry_point_tells_encoders_from_language_models(tmp_path):
    """pretrained_kind reads config.json: a BERT folder is a --backbone, a Llama folder an
    'adapt --lm' model; each command refuses the other kind by name, and other families too."""
    from pavejax.models import pretrained_kind
    from tests.test_llama_loading import HF_CONFIG
    from tests.test_models import _write_tiny_checkpoint, tiny_model

    bert, llama, gpt = tmp_path / "enc", tmp_path / "lm", tmp_path / "gpt"
    for d in (bert, llama, gpt):
        d.mkdir()
    _write_tiny_checkpoint(bert, tiny_model())
    for d, cfg in ((llama, HF_CONFIG), (gpt, {"model_type": "gpt2"})):
        (d / "config.json").write_text(json.dumps(cfg))
        for f in ("model.safetensors", "tokenizer.json"):
            (d / f).write_text("{}")
    assert pretrained_kind(bert) == "bert" and pretrained_kind(llama) == "llama"
    no_type = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    (gpt / "config.json").write_text(json.dumps(no_type))
    assert pretrained_kind(gpt) == "llama"  # RMSNorm's epsilon marks the Llama family
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        pretrained_kind(gpt)
    rc, _, err = cli("train", "--task", "movie", "--backbone", llama, "--epsilon", "4", *SMALL,
                     "--out", tmp_path / "never")
    assert rc == 1 and "is a causal language model" in err and "adapt --lm" in err
    rc, _, err = cli("adapt", "--lm", bert, "--task", "movie", "--steps", "1", "--out",
                     tmp_path / "never")
    assert rc == 1 and "is a BERT-family encoder" in err and "--backbone" in err
    assert not (tmp_path / "never").exists()
