"""What the subcommands share: the text backbone, model releases, privacy wording, output.

A **model release** here is a :func:`pavejax.release.save_release` directory whose tensors are a
classification head ``{"kernel": (hidden, k), "bias": (k,)}`` on the frozen pooled features
of all-MiniLM-L6-v2 (hidden 384, mean pooling) or of a ``--backbone`` folder (the DP-Merging
task models of :mod:`pavejax.lifecycle`). Its metadata ``extra`` records the public facts
needed to use it again: ``classes`` (output order), ``data`` (task name, split seed, sizes,
sequence length) and, for derived models, ``sources`` or ``upstream``. Secrets (noise keys,
the dock's A key, PAC secret index and generator state) are drawn fresh from the OS and
never written anywhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

TEXT_TASKS = ("movie", "amazon", "nyt", "tweets", "bbc")
MODEL_KINDS = ("model", "merged_model")
HIDDEN = 384  # all-MiniLM-L6-v2

DELTA_HELP = ("delta of the (epsilon, delta) guarantee: the probability that the epsilon bound "
              "may fail; keep it well below 1/n for n private examples (default %(default)g)")
NOISE_SECRET = ("The noise and sampling keys are drawn fresh from the operating system and never "
                "written anywhere, so nobody can regenerate and subtract the noise.")


def describe(p: argparse.ArgumentParser, description: str,
             items: Mapping[str, str] | None = None, title: str = "") -> None:
    """Set a wrapped description and an epilog listing ``items`` (name: meaning)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = textwrap.fill(description, 88, break_on_hyphens=False)
    if items:
        width = max(map(len, items)) + 2
        p.epilog = f"{title}:\n" + "\n".join(
            textwrap.fill(v, 88, initial_indent=f"  {k:{width}s}", break_on_hyphens=False,
                          subsequent_indent=" " * (width + 2)) for k, v in items.items())


def add_output_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--out DIR`` (required), ``--overwrite`` and ``--json``."""
    p.add_argument("--out", type=Path, required=True,
                   help=f"directory of the {what} release to write (must not exist, or use "
                        f"--overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing release at --out")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def dock_location(text: str) -> Path | str:
    """A dock argument: an ``http(s)://`` URL of a dock service, else a folder path."""
    return text.rstrip("/") if text.startswith(("http://", "https://")) else Path(text)


def positive_float(text: str) -> float:
    """argparse type: a float > 0 (``inf`` allowed where the caller says so)."""
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def emit(ns: argparse.Namespace, summary: Mapping[str, Any], lines: Sequence[str]) -> None:
    """Print ``summary`` as JSON (``--json``) or the human-readable ``lines``."""
    if getattr(ns, "json", False):
        print(json.dumps(summary, indent=2, default=float))
    else:
        print("\n".join(lines))


# --- the user's own data ----------------------------------------------------------------------

DATA_HELP = ("a labelled file of your own: CSV, JSON Lines (.jsonl), Parquet, or a folder saved "
             "by datasets' save_to_disk; columns named by --text-column and --label-column")


def add_data_file_arguments(p: argparse.ArgumentParser, *, test: bool = True) -> None:
    """``--text-column``, ``--label-column``, ``--classes`` (and ``--test-data``) for a command
    that takes ``--data``/``--user-data`` (the flag itself sits in the command's own group)."""
    p.add_argument("--text-column", default="text",
                   help="with a data file: the column of texts (default %(default)s)")
    p.add_argument("--label-column", default="label",
                   help="with a data file: the column of labels, class names or integer ids "
                        "(default %(default)s)")
    p.add_argument("--classes", default=None,
                   help="with a data file: comma-separated class names in class-id order; "
                        "every label must be one of them (default: the sorted distinct labels)")
    if test:
        p.add_argument("--test-data", type=Path, default=None,
                       help="with --data: a file of the same columns used as the test split "
                            "(default: a stratified share of --data, by --seed)")


def parse_classes(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    classes = tuple(c.strip() for c in text.split(","))
    if len(classes) < 2 or not all(classes):
        raise ValueError(f"--classes must name at least 2 classes, comma-separated, e.g. "
                         f"negative,positive; got {text!r}")
    return classes


def load_data_file(ns: argparse.Namespace, path: Path, *, split: bool = True,
                   test_path: Path | None = None, without_test: bool = False,
                   classes: Sequence[str] | None = None):
    """The :class:`~pavejax.data.Task` of a user's file: ``split=False`` puts every row in
    train; ``without_test`` splits train/dev only (as when a test file was given); ``classes``
    is used when ``--classes`` is not given."""
    from pavejax.data import load_dataset_file

    kw: dict[str, Any] = {}
    if not split:
        kw = {"dev_fraction": 0.0, "test_fraction": 0.0}
    elif without_test:
        kw = {"test_fraction": 0.0}
    given = parse_classes(ns.classes)
    return load_dataset_file(path, text_column=ns.text_column, label_column=ns.label_column,
                             classes=given if given is not None else classes,
                             test_path=test_path, seed=max(int(getattr(ns, "seed", 0)), 0), **kw)


def data_file_record(task: Any, ns: argparse.Namespace) -> dict[str, Any]:
    """What a release states about a user's data file: the columns and the split rule (its stem
    is the task name, recorded by the caller). Not its folder, full name or hash: a hash of the
    private rows would tell neighbouring datasets apart exactly, whatever the noise, so it never
    enters a release."""
    meta = task.metadata
    return {"source": "file", "format": meta["format"], "text_column": ns.text_column,
            "label_column": ns.label_column, "label_source": meta["label_source"],
            "split": meta["split"], "test_file": "test_file" in meta}


# --- backbone ---------------------------------------------------------------------------------

BACKBONE_HELP = ("a BERT-family Hugging Face folder (config.json, model.safetensors, "
                 "tokenizer.json) as the frozen text backbone instead of all-MiniLM-L6-v2; its "
                 "weights' sha256 is the releases' backbone identity, so models, specs and "
                 "docks of different backbones are refused together")

POOLING_HELP = ("how the backbone's hidden states become one feature vector: mean (masked "
                "mean, all-MiniLM-L6-v2's sentence embedding; default) or cls (the first token). "
                "Part of the backbone's identity: releases and docks of another pooling are "
                "refused")

# The backbone of this command: (None = all-MiniLM-L6-v2 or a folder, pooling); set by
# select_backbone.
_BACKBONE: list[Any] = [None, "mean"]


def add_backbone_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backbone", type=Path, default=None, help=BACKBONE_HELP)
    p.add_argument("--pooling", choices=("mean", "cls"), default="mean", help=POOLING_HELP)


def select_backbone(ns: argparse.Namespace) -> None:
    """Use ``ns.backbone`` (a folder, checked here) or MiniLM, and ``ns.pooling``, for this
    command."""
    _BACKBONE[1] = getattr(ns, "pooling", None) or "mean"
    folder = getattr(ns, "backbone", None)
    if folder is not None:
        missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
                   if not (Path(folder) / f).is_file()]
        if missing:
            raise FileNotFoundError(f"--backbone {folder}: missing {missing}; give a Hugging "
                                    f"Face BERT folder with config.json, model.safetensors and "
                                    f"tokenizer.json")
        from pavejax.models import pretrained_kind

        if pretrained_kind(folder) != "bert":
            raise ValueError(f"--backbone {Path(folder).name} is a causal language model "
                             f"(Llama family), not a text encoder; adapt it with 'pavejax "
                             f"adapt --lm {folder}'")
        folder = str(Path(folder).resolve())
    _BACKBONE[0] = folder


def backbone_folder() -> str | None:
    return _BACKBONE[0]


@functools.cache
def _encoder(folder: str | None, seq_len: int):
    from pavejax.models import load_bert, load_minilm

    return load_minilm(max_length=seq_len) if folder is None else \
        load_bert(folder, max_length=seq_len)


def pooling() -> str:
    return _BACKBONE[1]


def backbone_id() -> str:
    """The releases' backbone name: all-MiniLM-L6-v2 or ``bert:<folder name>``, with ``/cls``
    for CLS pooling (so that features of another pooling are never mixed)."""
    from pavejax.pave.text import MINILM_ID

    folder = backbone_folder()
    name = MINILM_ID if folder is None else f"bert:{Path(folder).name}"
    return name if pooling() == "mean" else f"{name}/{pooling()}"


def hidden_size() -> int:
    folder = backbone_folder()
    return HIDDEN if folder is None else int(_encoder(folder, 16)[0].config.hidden_size)


def text_backbone(seq_len: int, layers: tuple[int, ...] | None):
    """The PAVE text backbone (all-MiniLM-L6-v2, or the ``--backbone`` folder) at ``seq_len``
    tokens, adapting the attention query/value kernels of ``layers``; cached per backbone so
    compiled steps are reused."""
    return _text_backbone(seq_len, layers, backbone_folder(), backbone_id(), pooling())


@functools.cache
def _text_backbone(seq_len: int, layers: tuple[int, ...] | None, folder: str | None,
                   name: str, how: str):
    from pavejax.pave.text import TextSpecBackbone

    encoder, tokenizer = _encoder(folder, seq_len)
    return TextSpecBackbone(encoder, tokenizer, max_length=seq_len, layers=layers,
                            backbone_id=name, pooling=how)


@functools.cache
def _weights_hash(folder: str | None) -> str:
    from flax import nnx

    from pavejax.pave.spec import backbone_hash

    encoder, _ = _encoder(folder, 16)  # the weights do not depend on max_length
    return backbone_hash(nnx.to_pure_dict(nnx.split(encoder)[1]))


def minilm_hash() -> str:
    """sha256 of the backbone's weights (all-MiniLM-L6-v2 unless ``--backbone``), as recorded
    in spec signatures and model releases."""
    return _weights_hash(backbone_folder())


def features(texts: Sequence[str], labels: Any, seq_len: int) -> dict[str, Any]:
    """``{"x": (n, hidden) float32 frozen pooled backbone features, "y": (n,) int32}``."""
    import jax.numpy as jnp
    import numpy as np

    from pavejax.models import embed_texts

    return {"x": jnp.asarray(embed_texts(list(texts), max_length=seq_len,
                                         backbone=backbone_folder(), pooling=pooling())),
            "y": jnp.asarray(np.asarray(labels), jnp.int32)}


def accuracy(params: Mapping[str, Any], data: Mapping[str, Any], classes: Sequence[str],
             user_classes: Sequence[str] | None = None) -> float:
    """Accuracy of the head ``params`` on ``data`` whose labels index ``user_classes`` (default
    ``classes``); models and labels are matched by class name."""
    import numpy as np

    from pavejax.data import class_identity_accuracy
    from pavejax.models import apply_head

    user_classes = tuple(classes if user_classes is None else user_classes)
    logits = np.asarray(apply_head(dict(params), data["x"]))
    return float(class_identity_accuracy(logits, tuple(classes), np.asarray(data["y"]),
                                         user_classes))


def lifecycle_config(**overrides: Any):
    """A :class:`pavejax.lifecycle.LifecycleConfig` for one developer task (the user task, which
    the subcommands do not use, is set to another task to satisfy its validation)."""
    from pavejax.lifecycle import LifecycleConfig

    devs = overrides.get("developers", ())
    overrides.setdefault("user_task", next(t for t in TEXT_TASKS if t not in devs))
    overrides.setdefault("progress", False)
    return LifecycleConfig(**overrides)


# --- model releases ---------------------------------------------------------------------------


class ModelRelease(NamedTuple):
    """A loaded model release: the head, its metadata, class names and data record."""

    params: dict
    meta: Any
    classes: tuple[str, ...]
    data: dict


def save_model_release(out: Path, params: Mapping[str, Any], *, kind: str, mechanism: str,
                       ledger: Any, guarantee: dict, risk: dict, hyperparameters: dict,
                       extra: dict, overwrite: bool) -> str:
    """Write a head as a release (see the module docstring); returns its content hash."""
    import numpy as np

    from pavejax.release import ReleaseMetadata, save_release

    meta = ReleaseMetadata(kind=kind, backbone_id=backbone_id(), backbone_hash=minilm_hash(),
                           mechanism=mechanism, ledger=ledger, guarantee=guarantee,
                           hyperparameters=hyperparameters, risk=risk, extra=extra)
    tensors = {"kernel": np.asarray(params["kernel"], np.float32),
               "bias": np.asarray(params["bias"], np.float32)}
    return save_release(out, tensors, meta, overwrite=overwrite)


def load_model_release(path: Path) -> ModelRelease:
    """Verify and read a model release written by ``train``, ``merge`` or ``adapt``."""
    import jax.numpy as jnp

    from pavejax.release import load_release

    tensors, meta = load_release(path, expect_backbone_hash=minilm_hash())
    if meta.backbone_id != backbone_id():
        raise ValueError(f"{path} is a model on {meta.backbone_id!r} features, this command "
                         f"uses {backbone_id()!r}; pass the same --backbone and --pooling")
    if meta.kind not in MODEL_KINDS:
        raise ValueError(f"{path} holds a {meta.kind!r} release, not a model; pass a directory "
                         f"written by 'pavejax train', 'merge' or 'adapt'")
    classes = tuple(meta.extra.get("classes", ()))
    hidden = hidden_size()
    if set(tensors) != {"kernel", "bias"} or tensors["kernel"].shape != (hidden, len(classes)):
        raise ValueError(f"{path} is not a classification head on {backbone_id()} features "
                         f"(expected tensors kernel ({hidden}, k) and bias (k,) with k class "
                         f"names)")
    params = {"kernel": jnp.asarray(tensors["kernel"]), "bias": jnp.asarray(tensors["bias"])}
    return ModelRelease(params, meta, classes, dict(meta.extra.get("data", {})))


def dp_guarantee(ledger: Any, delta: float, *, protects: str, conditions: list[str],
                 **facts: Any) -> dict[str, Any]:
    """A ``"dp"`` guarantee record stating the ledger's own epsilon at ``delta``."""
    eps = ledger.epsilon(delta)
    return {"kind": "dp", "epsilon": eps, "delta": delta, "relation": ledger.relation.value,
            "accountant": ledger.accountant, "protects": protects,
            "against": "anyone who sees this release (tensors, metadata, ledger), whatever else "
                       "they know, including every other record of the data",
            "conditions": conditions, **facts}


def risk_record(epsilon: float, delta: float) -> dict[str, Any]:
    """:func:`pavejax.accounting.risk_report`, or a note when epsilon is infinite."""
    from pavejax.accounting import risk_report

    if not math.isfinite(epsilon):
        return {"note": "no finite epsilon: no risk bound holds (every bound is 1)"}
    return risk_report(epsilon, delta)
