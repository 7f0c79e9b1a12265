"""Labelled datasets from the user's own files: CSV, JSON Lines, Parquet and saved Hugging Face
``datasets`` splits (Arrow), read through ``pyarrow`` into a :class:`~pavejax.data.tasks.Task`.

:func:`load_dataset_file` reads one file (or a saved ``datasets`` folder) with named columns:
a text column (or numeric feature columns for array data), a label column (class names or
integer class ids), an optional id column, and an optional split column. The class list is
given (``classes=``; labels are then checked against it, so a user's classes are compared with
a model's by name) or inferred (sorted distinct values) and recorded in the task's metadata with
the file's sha256, never its rows or its folder. Splits come from the split column or from
:func:`~pavejax.data.tasks.stratified_split` with a seed; a separate test file
(``test_path=``) becomes the test split.

Every problem is a ``ValueError`` (``FileNotFoundError`` for a missing file, ``TypeError`` for
a column of the wrong type) that names the file, the row (1-based, counting data rows) or the
column, and what to do. Nothing is written anywhere.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pavejax.data.tasks import Split, Task, stratified_split

__all__ = ["FORMATS", "load_dataset_file", "read_table", "task_from_rows"]

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
           ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}
_SPLITS = {"train": "train", "dev": "dev", "validation": "dev", "valid": "dev", "val": "dev",
           "test": "test"}
_HINT = "install the text extra (`pip install -e .[text]`), which brings pyarrow"


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.csv
        import pyarrow.ipc
        import pyarrow.json
        import pyarrow.parquet
    except ImportError as e:  # pragma: no cover - the test environment has pyarrow
        raise ImportError(f"reading data files needs pyarrow: {_HINT}") from e
    return pyarrow


def _format(path: Path) -> str:
    if path.is_dir():
        return "datasets"
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path.name}: unknown file type {path.suffix!r}; use one of "
                         f"{sorted(FORMATS)} or a folder saved by datasets' save_to_disk")
    return fmt


def _arrow_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise ValueError(f"{folder.name}: a folder must be one split saved by datasets' "
                         f"save_to_disk (data-*.arrow files); none found. For a DatasetDict "
                         f"pass the split's folder, e.g. {folder.name}/train")
    return files


def _read_stream(pa: Any, path: Path) -> Any:
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:  # an Arrow IPC file rather than a stream
            return pa.ipc.open_file(source).read_all()


def read_table(path: str | Path) -> Any:
    """The file (or saved ``datasets`` split folder) at ``path`` as a ``pyarrow.Table``."""
    pa = _pyarrow()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder; check the path (relative "
                                f"paths are read from the current directory)")
    fmt = _format(path)
    try:
        if fmt == "csv":
            return pa.csv.read_csv(path)
        if fmt == "jsonl":
            return pa.json.read_json(path)
        if fmt == "parquet":
            return pa.parquet.read_table(path)
        if fmt == "arrow":
            return _read_stream(pa, path)
        return pa.concat_tables([_read_stream(pa, f) for f in _arrow_files(path)])
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeDecodeError, OSError) as e:
        extra = (" (JSON files must be JSON Lines: one object per line, one type per field)"
                 if fmt == "jsonl" else "")
        raise ValueError(f"{path.name}: cannot be read as {fmt}{extra}: {e}. Save it as UTF-8 "
                         f"{fmt} and try again") from None


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = _arrow_files(path) if path.is_dir() else [path]
    for f in files:
        h.update(f.name.encode() + b"\0" if path.is_dir() else b"")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _column(table: Any, name: str, what: str, where: str) -> list[Any]:
    if name not in table.column_names:
        raise ValueError(f"{where}: no {what} column {name!r}; the columns are "
                         f"{table.column_names}. Name it with --{what}-column / "
                         f"{what}_column=")
    return table.column(name).to_pylist()


def _texts(values: list[Any], name: str, where: str) -> list[str]:
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"{where}, row {i + 1}: the text column {name!r} is empty; fill or "
                             f"drop that row")
        if isinstance(v, bytes):  # pyarrow reads a CSV column with invalid UTF-8 as binary
            try:
                v = values[i] = v.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}, row {i + 1}: the text in column {name!r} is not "
                                 f"valid UTF-8; save the file as UTF-8") from None
        if not isinstance(v, str):
            raise TypeError(f"{where}, row {i + 1}: the text column {name!r} holds "
                            f"{type(v).__name__} values, not text; choose the text column with "
                            f"text_column=")
        if not v.strip():
            raise ValueError(f"{where}, row {i + 1}: the text in column {name!r} is blank; fill "
                             f"or drop that row")
    return values


def _features(table: Any, names: Sequence[str], where: str) -> np.ndarray:
    cols = []
    for name in names:
        values = _column(table, name, "feature", where)
        try:
            col = np.asarray([np.nan if v is None else v for v in values], np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{where}: feature column {name!r} is not numeric") from None
        if col.ndim != 1:
            raise TypeError(f"{where}: feature column {name!r} must hold one number per row")
        bad = np.flatnonzero(~np.isfinite(col))
        if bad.size:
            raise ValueError(f"{where}, row {bad[0] + 1}: feature {name!r} is missing, NaN or "
                             f"infinite; fill or drop that row")
        cols.append(col)
    return np.stack(cols, axis=1).astype(np.float32)


def _label_values(values: list[Any], name: str, where: str) -> list[Any]:
    out = []
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"{where}, row {i + 1}: the label column {name!r} is empty; label "
                             f"or drop that row")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise TypeError(f"{where}, row {i + 1}: labels must be class names or integer "
                            f"class ids, got {v!r}")
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError(f"{where}, row {i + 1}: label {v!r} is not an integer class id")
            v = int(v)
        out.append(v.strip() if isinstance(v, str) else v)
    return out


def _encode_labels(values: list[Any], classes: Sequence[str] | None,
                   where: str) -> tuple[np.ndarray, tuple[str, ...]]:
    kinds = {type(v) for v in values}
    if kinds == {int}:
        if classes is None:
            ids = sorted(set(values))
            index = {v: j for j, v in enumerate(ids)}
            return np.array([index[v] for v in values], np.int32), tuple(str(v) for v in ids)
        for i, v in enumerate(values):
            if not 0 <= v < len(classes):
                raise ValueError(f"{where}, row {i + 1}: class id {v} is outside the "
                                 f"{len(classes)} classes {list(classes)}; ids index the "
                                 f"classes from 0")
        return np.asarray(values, np.int32), tuple(classes)
    if kinds != {str}:
        raise TypeError(f"{where}: the label column mixes class names and integer ids; use "
                        f"one kind")
    names = tuple(sorted(set(values))) if classes is None else tuple(classes)
    index = {c: j for j, c in enumerate(names)}
    for i, v in enumerate(values):
        if v not in index:
            raise ValueError(f"{where}, row {i + 1}: label {v!r} is not one of the stated "
                             f"classes {list(names)}; fix the row or pass the full class list")
    return np.array([index[v] for v in values], np.int32), names


def _check_classes(classes: Sequence[str] | None) -> tuple[str, ...] | None:
    if classes is None:
        return None
    if isinstance(classes, str) or not all(isinstance(c, str) and c.strip() for c in classes):
        raise TypeError(f"classes must be a sequence of non-empty class names, got {classes!r}")
    out = tuple(c.strip() for c in classes)
    if len(set(out)) != len(out):
        raise ValueError(f"classes must be distinct, got {list(out)}")
    if len(out) < 2:
        raise ValueError(f"a classification task needs at least 2 classes, got {list(out)}")
    return out


def _rows(path: Path, text_column: str, label_column: str,
          feature_columns: Sequence[str] | None, id_column: str | None,
          split_column: str | None) -> dict[str, Any]:
    where = path.name
    table = read_table(path)
    if table.num_rows == 0:
        raise ValueError(f"{where}: the file holds no rows; a dataset needs labelled examples")
    out: dict[str, Any] = {"n": table.num_rows, "columns": list(table.column_names)}
    if feature_columns is None:
        out["inputs"] = _texts(_column(table, text_column, "text", where), text_column, where)
    else:
        out["inputs"] = _features(table, feature_columns, where)
    out["labels"] = _label_values(_column(table, label_column, "label", where), label_column,
                                  where)
    if id_column is not None:
        ids = _column(table, id_column, "id", where)
        seen: dict[Any, int] = {}
        for i, v in enumerate(ids):
            if v is None:
                raise ValueError(f"{where}, row {i + 1}: the id column {id_column!r} is empty")
            if v in seen:
                raise ValueError(f"{where}, rows {seen[v] + 1} and {i + 1}: id {v!r} appears "
                                 f"twice; ids must be unique")
            seen[v] = i
        out["ids"] = [str(v) for v in ids]
    if split_column is not None:
        split = []
        for i, v in enumerate(_column(table, split_column, "split", where)):
            key = _SPLITS.get(str(v).strip().lower()) if v is not None else None
            if key is None:
                raise ValueError(f"{where}, row {i + 1}: split {v!r} is not one of "
                                 f"train / dev (validation) / test")
            split.append(key)
        out["split"] = np.asarray(split)
    return out


def task_from_rows(name: str, inputs: list[Any] | np.ndarray, labels: Sequence[Any], *,
                   classes: Sequence[str] | None = None, split: Sequence[str] | None = None,
                   dev_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0,
                   metadata: dict[str, Any] | None = None, where: str | None = None,
                   ids: Sequence[str] | None = None) -> Task:
    """A :class:`Task` from labelled rows: the one path behind :func:`load_dataset_file` and
    the built-in text tasks (:func:`pavejax.data.load_task`).

    ``inputs``: texts (checked: no empty or blank text) or a float32 ``(n, d)`` array;
    ``labels``: class names or integer ids (see :func:`load_dataset_file`); ``split``: per row
    ``"train"``/``"dev"``/``"test"``, else a :func:`stratified_split` by ``seed``. ``where``
    names the source in error messages (default ``name``); ``ids`` (one per row) are kept per
    split in ``metadata["ids"]``.
    """
    where = where or name
    if len(inputs) == 0:
        raise ValueError(f"{where}: no rows; a dataset needs labelled examples")
    if len(labels) != len(inputs):
        raise ValueError(f"{where}: {len(inputs)} inputs but {len(labels)} labels")
    if not isinstance(inputs, np.ndarray):
        inputs = _texts(list(inputs), "text", where)
    values = _label_values(list(labels), "label", where)
    codes, names = _encode_labels(values, _check_classes(classes), where)
    if len(names) < 2:
        raise ValueError(f"{where}: every row has the label {names[0]!r}; a classification "
                         f"task needs at least 2 classes")
    pool = Split(inputs, codes)
    if split is not None:
        split = np.asarray(split)
        idx = {s: np.flatnonzero(split == s) for s in ("train", "dev", "test")}
        rule: dict[str, Any] = {}
    else:
        tr, dv, te = stratified_split(pool.labels, dev_fraction=dev_fraction,
                                      test_fraction=test_fraction, seed=seed)
        idx = {"train": tr, "dev": dv, "test": te}
        rule = {"split": "stratified", "seed": seed, "dev_fraction": dev_fraction,
                "test_fraction": test_fraction}
    if not len(idx["train"]):
        raise ValueError(f"{where}: no training rows after the split; give more rows or a "
                         f"smaller dev/test fraction")
    meta = {**rule, **(metadata or {})}
    if ids is not None:
        meta["ids"] = {s: [ids[j] for j in i.tolist()] for s, i in idx.items()}
    return Task(name, names, pool.take(idx["train"]), pool.take(idx["dev"]),
                pool.take(idx["test"]), meta)


def load_dataset_file(path: str | Path, *, text_column: str = "text",
                      label_column: str = "label",
                      feature_columns: Sequence[str] | None = None,
                      id_column: str | None = None, split_column: str | None = None,
                      classes: Sequence[str] | None = None, test_path: str | Path | None = None,
                      dev_fraction: float = 0.1, test_fraction: float = 0.2, seed: int = 0,
                      name: str | None = None) -> Task:
    """A :class:`Task` from a labelled file.

    Args:
      path: a ``.csv``, ``.jsonl`` (JSON Lines; also ``.json``/``.ndjson``), ``.parquet`` or
        ``.arrow`` file, or a folder saved by ``datasets``' ``save_to_disk`` (one split).
      text_column: the column of texts (ignored when ``feature_columns`` is given).
      label_column: class names (strings) or integer class ids.
      feature_columns: numeric columns that form float32 array inputs ``(n, len(columns))``
        instead of text.
      id_column: an optional column of unique row ids (kept per split in the metadata).
      split_column: an optional column of ``train`` / ``dev`` (or ``validation``) / ``test``;
        without it the rows are split by :func:`~pavejax.data.tasks.stratified_split` with
        ``dev_fraction``, ``test_fraction`` and ``seed``.
      classes: the class names, in class-id order. Given: every label must be one of them (a
        name) or index them (an id). None: the sorted distinct labels (ids are named by their
        number); ``metadata["label_source"]`` says which.
      test_path: a second file of the same columns that becomes the test split (``path`` is
        then split into train and dev only; a split column, if given, must not say ``test``).
      name: the task name (default: the file's stem).

    Returns:
      The task; ``metadata`` holds the file names, their sha256, the format, the columns used,
      ``label_source`` and the split rule (never a folder path or a row).

    Raises:
      FileNotFoundError: a file is missing. ValueError: unreadable or non-UTF-8 file, missing
        column, no rows, an empty or blank text, a missing or unknown label, NaN features,
        duplicate ids, fewer than 2 classes, a bad split value or fraction. TypeError: a column
        of the wrong type. Each names the file and the row or column.
    """
    path = Path(path)
    classes = _check_classes(classes)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    rows = _rows(path, text_column, label_column, feature_columns, id_column, split_column)
    test_rows = None if test_path is None else _rows(
        Path(test_path), text_column, label_column, feature_columns, id_column, None)
    values = rows["labels"] + ([] if test_rows is None else test_rows["labels"])
    where = path.name if test_rows is None else f"{path.name} + {Path(test_path).name}"
    labels, names = _encode_labels(values, classes, where)  # one class list for both files
    n = rows["n"]
    if "split" in rows and test_rows is not None and (rows["split"] == "test").any():
        raise ValueError(f"{path.name}: the split column says 'test' but a test file is given "
                         f"too; use one or the other")
    files = {path.name: _digest(path)}
    if test_path is not None:
        files[Path(test_path).name] = _digest(Path(test_path))
    meta: dict[str, Any] = {
        "source": "file", "format": _format(path), "files_sha256": files,
        "columns": {"text": None if feature_columns is not None else text_column,
                    "features": None if feature_columns is None else list(feature_columns),
                    "label": label_column, "id": id_column, "split": split_column},
        "label_source": "given" if classes is not None else "inferred"}
    if "split" in rows:
        meta["split"] = f"column {split_column!r}"
    task = task_from_rows(name or path.stem, rows["inputs"], labels[:n].tolist(),
                          classes=names, split=rows.get("split"), dev_fraction=dev_fraction,
                          test_fraction=0.0 if test_rows is not None else test_fraction,
                          seed=seed, metadata=meta, where=path.name, ids=rows.get("ids"))
    if test_rows is None:
        return task
    t_in = test_rows["inputs"]
    extra: dict[str, Any] = {"test_file": Path(test_path).name}
    if "ids" in rows:
        extra["ids"] = {**task.metadata["ids"], "test": test_rows["ids"]}
    return task.replace(test=Split(t_in if isinstance(t_in, np.ndarray) else list(t_in),
                                   labels[n:]), metadata=extra)
