"""Load Hugging Face (torch-named) safetensors checkpoints into NNX modules, without torch.

Loading is strict: every tensor in the file must be used (except explicitly ignored buffers),
every parameter of the module must be filled, and every shape must match; otherwise one
``ValueError`` lists all the problems at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax.models.bert import BertConfig, BertEncoder
from pavejax.models.tokenize import Tokenizer

__all__ = [
    "BERT_IGNORED_TENSORS",
    "TorchTarget",
    "bert_torch_names",
    "load_bert",
    "load_minilm",
    "load_state_from_torch_names",
    "parameter_count",
    "pretrained_kind",
]

# config.json model_type -> kind
PRETRAINED_KINDS = {"bert": "bert", "llama": "llama", "mistral": "llama"}

M = TypeVar("M", bound=nnx.Module)
StatePath = tuple[str | int, ...]

# ``position_ids`` is a constant arange(max_position) buffer, not a parameter: positions are
# recomputed from the sequence length, so the buffer carries no information.
BERT_IGNORED_TENSORS: tuple[str, ...] = ("embeddings.position_ids",)

_MAX_LISTED = 12


class TorchTarget(NamedTuple):
    """Where a torch tensor goes: an NNX state path, transposed when it is a Linear weight."""

    path: StatePath
    transpose: bool = False


def _linear(prefix: str, path: StatePath) -> dict[str, TorchTarget]:
    return {f"{prefix}.weight": TorchTarget((*path, "kernel"), True),
            f"{prefix}.bias": TorchTarget((*path, "bias"))}


def _layer_norm(prefix: str, path: StatePath) -> dict[str, TorchTarget]:
    return {f"{prefix}.weight": TorchTarget((*path, "scale")),
            f"{prefix}.bias": TorchTarget((*path, "bias"))}


def bert_torch_names(config: BertConfig) -> dict[str, TorchTarget]:
    """Hugging Face ``BertModel`` tensor name -> ``BertEncoder`` state path (table in ``bert``)."""
    emb = "embeddings"
    table = {
        f"{emb}.word_embeddings.weight": TorchTarget((emb, "word", "embedding")),
        f"{emb}.position_embeddings.weight": TorchTarget((emb, "position", "embedding")),
        f"{emb}.token_type_embeddings.weight": TorchTarget((emb, "token_type", "embedding")),
        **_layer_norm(f"{emb}.LayerNorm", (emb, "norm")),
        **_linear("pooler.dense", ("pooler",)),
    }
    for i in range(config.num_layers):
        hf, nx = f"encoder.layer.{i}", ("layers", i)
        for proj in ("query", "key", "value"):
            table |= _linear(f"{hf}.attention.self.{proj}", (*nx, "attention", proj))
        table |= _linear(f"{hf}.attention.output.dense", (*nx, "attention", "output"))
        table |= _layer_norm(f"{hf}.attention.output.LayerNorm", (*nx, "attention", "norm"))
        table |= _linear(f"{hf}.intermediate.dense", (*nx, "intermediate"))
        table |= _linear(f"{hf}.output.dense", (*nx, "output"))
        table |= _layer_norm(f"{hf}.output.LayerNorm", (*nx, "norm"))
    return table


def _flatten(tree: Mapping, prefix: StatePath = ()) -> dict[StatePath, Any]:
    flat: dict[StatePath, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            flat |= _flatten(v, (*prefix, k))
        else:
            flat[(*prefix, k)] = v
    return flat


def _unflatten(flat: Mapping[StatePath, Any]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def _fmt_path(path: StatePath) -> str:
    return "/".join(str(p) for p in path)


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in shown) + more


def _check_mapping(flat: Mapping[StatePath, Any], tensors: Mapping[str, np.ndarray],
                   mapping: Mapping[str, TorchTarget], ignore: Iterable[str]) -> list[str]:
    """All problems that prevent loading, as human-readable sections (empty when loadable)."""
    ignore = set(ignore)
    unused = sorted(set(tensors) - set(mapping) - ignore)
    absent = sorted(set(mapping) - set(tensors))
    not_in_model = sorted(f"{n} -> {_fmt_path(t.path)}" for n, t in mapping.items()
                          if t.path not in flat)
    targets = [t.path for t in mapping.values()]
    duplicated = sorted({_fmt_path(p) for p in targets if targets.count(p) > 1})
    unfilled = sorted(_fmt_path(p) for p in set(flat) - set(targets))
    bad = []
    for name, (path, transpose) in mapping.items():
        if name not in tensors or path not in flat:
            continue
        arr, leaf = tensors[name], flat[path]
        if transpose and arr.ndim != 2:
            bad.append(f"{name}: expected a 2-D (out, in) weight, got shape {arr.shape}")
            continue
        got = arr.shape[::-1] if transpose else arr.shape
        if tuple(got) != tuple(leaf.shape):
            how = f" (transposed from {arr.shape})" if transpose else ""
            bad.append(f"{name}: shape {tuple(got)}{how} but {_fmt_path(path)} "
                       f"expects {tuple(leaf.shape)}")
        elif jnp.issubdtype(leaf.dtype, jnp.inexact) != jnp.issubdtype(arr.dtype, jnp.inexact):
            bad.append(f"{name}: dtype {arr.dtype} cannot fill {_fmt_path(path)} ({leaf.dtype})")
    sections = [
        ("tensors in the file used by no parameter", unused),
        ("tensors the mapping needs but the file lacks", absent),
        ("mapping targets that are not parameters of the model", not_in_model),
        ("parameters filled by more than one tensor", duplicated),
        ("model parameters no tensor fills", unfilled),
        ("shape/dtype mismatches", bad),
    ]
    return [_listing(title, items) for title, items in sections if items]


def load_state_from_torch_names(model: M, tensors: Mapping[str, np.ndarray],
                                mapping: Mapping[str, TorchTarget], *,
                                ignore: Iterable[str] = ()) -> M:
    """A copy of ``model`` whose parameters (``nnx.Param``) are filled from torch-named ``tensors``.

    Args:
      model: an NNX module; may be abstract (``nnx.eval_shape``), which avoids a random init.
      tensors: name -> numpy array, e.g. from ``safetensors.numpy.load_file``.
      mapping: name -> ``TorchTarget``; ``transpose=True`` turns torch (out, in) Linear weights
        into Flax (in, out) kernels.
      ignore: tensor names that are allowed to stay unused (buffers).

    Returns:
      A new module of the same structure; every array is cast to the dtype of the parameter it
      replaces, and non-parameter state is kept. ``model`` itself is not modified.

    Raises:
      ValueError: listing every unused tensor, missing tensor, unknown target, parameter left
        unfilled, and shape or dtype mismatch.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat = _flatten(nnx.to_pure_dict(params))
    problems = _check_mapping(flat, tensors, mapping, ignore)
    if problems:
        raise ValueError("cannot load the checkpoint into "
                         f"{type(model).__name__}:\n" + "\n".join(problems))
    filled = {}
    for name, (path, transpose) in mapping.items():
        arr = np.asarray(tensors[name])
        filled[path] = jnp.asarray(arr.T if transpose else arr, dtype=flat[path].dtype)
    nnx.replace_by_pure_dict(params, _unflatten(filled))
    return nnx.merge(graphdef, params, rest)


def _require_file(directory: Path, name: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in {directory}; expected a Hugging Face BERT "
                                "folder with model.safetensors, config.json and tokenizer.json")
    return path


def load_bert(directory: str | os.PathLike[str], *, dtype: Any = jnp.float32,
              max_length: int = 128) -> tuple[BertEncoder, Tokenizer]:
    """Load a Hugging Face BERT folder (``config.json``, ``model.safetensors``, ``tokenizer.json``).

    No hash check: use ``load_minilm`` for the pinned, verified MiniLM asset. ``dtype`` is the
    parameter dtype (float32 or bfloat16); the forward pass computes in float32 regardless.
    """
    from safetensors.numpy import load_file  # the ``text`` extra

    directory = Path(directory)
    config = BertConfig.from_json(_require_file(directory, "config.json"))
    tokenizer = Tokenizer.from_file(_require_file(directory, "tokenizer.json"), max_length,
                                    pad_id=config.pad_token_id)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"tokenizer vocabulary ({tokenizer.vocab_size}) differs from the model's "
                         f"vocab_size ({config.vocab_size}) in {directory}")
    tensors = load_file(_require_file(directory, "model.safetensors"))
    abstract = nnx.eval_shape(lambda: BertEncoder(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    model = load_state_from_torch_names(abstract, tensors, bert_torch_names(config),
                                        ignore=BERT_IGNORED_TENSORS)
    return model, tokenizer


def pretrained_kind(directory: str | os.PathLike[str]) -> str:
    """``"bert"`` (an encoder: :func:`load_bert`) or ``"llama"`` (a causal LM:
    :func:`pavejax.models.load_hf_llama`) from a Hugging Face folder's ``config.json``
    ``model_type``: the one entry point that tells the two families apart.

    Raises ``FileNotFoundError`` without a config.json and ``ValueError`` for another family.
    """
    import json

    config = _require_file(Path(directory), "config.json")
    try:
        raw = json.loads(config.read_text())
        # without a model_type: RMSNorm's epsilon marks the Llama family
        model_type = raw.get("model_type", "llama" if "rms_norm_eps" in raw else "bert")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{config} is not a JSON object; expected a Hugging Face "
                         f"config.json") from None
    if model_type not in PRETRAINED_KINDS:
        raise ValueError(f"{Path(directory).name}: model_type {model_type!r} is not supported; "
                         f"pavejax loads BERT-family encoders (model_type 'bert') and Llama-"
                         f"family causal LMs (model_type 'llama' or 'mistral')")
    return PRETRAINED_KINDS[model_type]


def load_minilm(path: str | os.PathLike[str] | None = None, *, dtype: Any = jnp.float32,
                max_length: int = 128) -> tuple[BertEncoder, Tokenizer]:
    """all-MiniLM-L6-v2 (6 layers, hidden 384) and its tokenizer, fixed at ``max_length`` tokens.

    With ``path=None`` the files come from the installed asset (``pavejax.assets.require``),
    whose sha256 hashes are checked against the pinned upstream revision; a missing asset raises
    ``AssetMissingError`` naming the install command. An explicit ``path`` is loaded as given.
    For sentence embeddings use ``sentence_embedding`` (mean pooling + L2 normalisation).
    """
    if path is None:
        from pavejax import assets

        path = assets.require("minilm")
    return load_bert(path, dtype=dtype, max_length=max_length)


def parameter_count(model: nnx.Module) -> int:
    """Number of scalar parameters (``nnx.Param`` leaves) in ``model``."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    return int(sum(np.prod(x.shape) for x in leaves))
