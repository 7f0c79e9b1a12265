"""Datasets from the user's own files (pavejax.data.files): CSV, JSON Lines, Parquet and a saved
`datasets` split (Arrow stream files) give the same task, with shuffled column order and extra
columns; class lists given or inferred; integer ids; split columns and test files; and a table
of bad inputs, each with the message that names the file and the row or column."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from pavejax.data import files
from pavejax.data.tasks import task_fingerprint

TEXTS = [f"review number {i} {'good' if i % 3 else 'bad'} film" for i in range(60)]
LABELS = ["positive" if i % 3 else "negative" for i in range(60)]


def _table(**extra):
    # shuffled column order and an extra column the loader must ignore
    cols = {"score": list(range(60)), "label": LABELS, "id": [f"r{i}" for i in range(60)],
            "text": TEXTS, **extra}
    return pa.table(cols)


def _write(table, path):
    if path.suffix == ".csv":
        pacsv.write_csv(table, path)
    elif path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    else:  # a folder saved by datasets' save_to_disk: Arrow stream shards + json sidecars
        path.mkdir()
        half = table.num_rows // 2
        for k, part in enumerate((table.slice(0, half), table.slice(half))):
            with pa.OSFile(str(path / f"data-0000{k}-of-00002.arrow"), "wb") as sink, \
                    pa.ipc.new_stream(sink, part.schema) as writer:
                writer.write_table(part)
        (path / "state.json").write_text("{}")
        (path / "dataset_info.json").write_text("{}")
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet", ""])
def test_every_format_gives_the_same_task(tmp_path, suffix):
    path = _write(_table(), tmp_path / f"reviews{suffix or '_saved'}")
    task = files.load_dataset_file(path, id_column="id", seed=3, name="reviews")
    ref = files.load_dataset_file(_write(_table(), tmp_path / "ref.csv"), id_column="id",
                                  seed=3, name="reviews")
    assert task_fingerprint(task) == task_fingerprint(ref)
    assert task.label_names == ("negative", "positive")  # inferred, sorted
    assert task.metadata["label_source"] == "inferred"
    assert (len(task.train), len(task.dev), len(task.test)) == (42, 6, 12)
    # every row lands in exactly one split, with its own label and id
    seen = {}
    for s in ("train", "dev", "test"):
        split = getattr(task, s)
        for text, y, i in zip(split.inputs, split.labels, task.metadata["ids"][s], strict=True):
            j = int(i[1:])
            assert TEXTS[j] == text and LABELS[j] == task.label_names[y]
            seen[j] = s
    assert sorted(seen) == list(range(60))
    digest = task.metadata["files_sha256"]
    assert list(digest) == [path.name] and len(digest[path.name]) == 64
    assert str(tmp_path) not in json.dumps(dict(task.metadata), default=str)


def test_given_classes_set_the_order_and_ids_index_them(tmp_path):
    path = _write(_table(), tmp_path / "r.csv")
    task = files.load_dataset_file(path, classes=["positive", "negative"])
    assert task.label_names == ("positive", "negative")
    assert task.metadata["label_source"] == "given"
    for split in (task.train, task.test):
        for text, y in zip(split.inputs, split.labels, strict=True):
            assert ("bad" in text) == (y == 1)
    ints = _write(pa.table({"text": TEXTS, "label": [int(x == "positive") for x in LABELS]}),
                  tmp_path / "ints.parquet")
    named = files.load_dataset_file(ints, classes=["neg", "pos"])
    assert named.label_names == ("neg", "pos")
    inferred = files.load_dataset_file(ints)
    assert inferred.label_names == ("0", "1")
    np.testing.assert_array_equal(named.train.labels, inferred.train.labels)


def test_split_column_and_test_file(tmp_path):
    split = ["test" if i % 5 == 0 else "validation" if i % 5 == 1 else "train"
             for i in range(60)]
    path = _write(_table(split=split), tmp_path / "s.jsonl")
    task = files.load_dataset_file(path, split_column="split", id_column="id")
    assert (len(task.train), len(task.dev), len(task.test)) == (36, 12, 12)
    assert all(int(i[1:]) % 5 == 0 for i in task.metadata["ids"]["test"])
    assert task.metadata["split"] == "column 'split'"
    train = _write(_table(), tmp_path / "train.csv")
    test = _write(pa.table({"text": ["a fine film", "a bad film"],
                            "label": ["positive", "negative"]}), tmp_path / "test.csv")
    task = files.load_dataset_file(train, test_path=test, dev_fraction=0.0)
    assert task.test.inputs == ["a fine film", "a bad film"]
    assert task.test.labels.tolist() == [1, 0] and len(task.train) == 60 and len(task.dev) == 0
    assert set(task.metadata["files_sha256"]) == {"train.csv", "test.csv"}


def test_feature_columns_give_array_inputs(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    path = _write(pa.table({"y": ["a", "b"] * 20, "f0": x[:, 0], "f1": x[:, 1], "f2": x[:, 2]}),
                  tmp_path / "arr.parquet")
    task = files.load_dataset_file(path, feature_columns=["f2", "f0"], label_column="y",
                                   test_fraction=0.0, dev_fraction=0.0, split_column=None)
    assert task.modality == "image" and task.train.inputs.dtype == np.float32
    rows = {tuple(np.round(r, 5)) for r in task.train.inputs}
    assert rows == {tuple(np.round(r, 5)) for r in x[:, [2, 0]].astype(np.float32)}


def _bad_cases(tmp_path):
    """(what, kwargs for load_dataset_file, exception, words in the message)."""
    def w(name, **cols):
        return _write(pa.table(cols), tmp_path / name)

    nonutf8 = tmp_path / "latin1.csv"
    nonutf8.write_bytes("text,label\ncaf\xe9 au lait,positive\nthe end,negative\n"
                        .encode("latin-1"))
    return [
        ("missing file", dict(path=tmp_path / "nope.csv"), FileNotFoundError, "nope.csv"),
        ("unknown type", dict(path=w("x.csv", text=["a", "b"], label=["p", "n"])
                              .rename(tmp_path / "x.txt")), ValueError, "unknown file type"),
        ("missing column", dict(path=w("m.csv", body=["a", "b"], label=["p", "n"])),
         ValueError, "no text column 'text'; the columns are ['body', 'label']"),
        ("empty", dict(path=w("e.parquet", text=pa.array([], pa.string()),
                              label=pa.array([], pa.string()))), ValueError, "no rows"),
        ("empty text", dict(path=w("t.parquet", text=["a", None, "c"],
                                   label=["p", "n", "p"])), ValueError, "row 2"),
        ("blank text", dict(path=w("b.jsonl", text=["a", "   ", "c"], label=["p", "n", "p"])),
         ValueError, "row 2: the text in column 'text' is blank"),
        ("numeric text", dict(path=w("n.parquet", text=[1, 2], label=["p", "n"])),
         TypeError, "row 1: the text column 'text' holds int"),
        ("non-UTF-8", dict(path=nonutf8), ValueError, "latin1.csv, row 1: the text in column "
                                                     "'text' is not valid UTF-8"),
        ("label outside classes", dict(path=w("o.csv", text=["a", "b", "c"],
                                              label=["pos", "neg", "neutral"]),
                                       classes=["neg", "pos"]),
         ValueError, "row 3: label 'neutral' is not one of the stated classes"),
        ("id outside classes", dict(path=w("i.parquet", text=["a", "b"], label=[0, 2]),
                                    classes=["neg", "pos"]),
         ValueError, "row 2: class id 2 is outside the 2 classes"),
        ("missing label", dict(path=w("l.parquet", text=["a", "b"], label=["p", None])),
         ValueError, "row 2: the label column 'label' is empty"),
        ("one class", dict(path=w("c.csv", text=["a", "b"], label=["p", "p"])),
         ValueError, "at least 2 classes"),
        ("duplicate ids", dict(path=w("d.csv", text=["a", "b", "c"], label=["p", "n", "p"],
                                      id=["x", "y", "x"]), id_column="id"),
         ValueError, "rows 1 and 3: id 'x' appears twice"),
        ("bad split", dict(path=w("sp.csv", text=["a", "b"], label=["p", "n"],
                                  s=["train", "holdout"]), split_column="s"),
         ValueError, "row 2: split 'holdout'"),
        ("NaN feature", dict(path=w("f.parquet", y=["a", "b"], f=[0.5, float("nan")]),
                             feature_columns=["f"], label_column="y"),
         ValueError, "row 2: feature 'f' is missing, NaN or infinite"),
        ("json array", dict(path=tmp_path / "arr.json"), ValueError, "JSON Lines"),
        ("mixed label types", dict(path=tmp_path / "mixed.jsonl"), ValueError,
         "mixed.jsonl: cannot be read as jsonl (JSON files must be JSON Lines: one object per "
         "line, one type per field)"),
        ("classes repeated", dict(path=w("r.csv", text=["a", "b"], label=["p", "n"]),
                                  classes=["p", "p"]), ValueError, "distinct"),
    ]


def test_bad_inputs_name_the_file_and_row_and_write_nothing(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "a", "label": "p"}]))
    (tmp_path / "mixed.jsonl").write_text('{"text": "a", "label": "p"}\n'
                                          '{"text": "b", "label": 1}\n')
    cases = _bad_cases(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for what, kw, exc, words in cases:
        path = kw.pop("path")
        with pytest.raises(exc, match=re.escape(words)):
            files.load_dataset_file(path, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert len(cases) == 18


@pytest.mark.assets
def test_built_in_text_tasks_are_instances_of_the_same_loader(tmp_path):
    """A built-in task written to a file and read back by load_dataset_file is the same task
    (same rows, class order and split for the seed): one code path for both."""
    from pavejax.data import load_task, text

    texts, labels, _ = text.load_sentiment("tweets", 0.5)
    path = _write(pa.table({"label": [text.SENTIMENT_LABELS[y] for y in labels],
                            "text": list(texts)}), tmp_path / "tweets.parquet")
    mine = files.load_dataset_file(path, classes=list(text.SENTIMENT_LABELS), seed=4)
    assert task_fingerprint(mine) == task_fingerprint(load_task("tweets", seed=4))
    with pytest.raises(ValueError, match="row 2: the text in column 'text' is blank"):
        files.task_from_rows("x", ["a", " ", "c"], [0, 1, 0], classes=["n", "p"])
