"""LoRA adapters and merged models in the Hugging Face PEFT / transformers safetensors layout.

PyTorch users load what pavejax produces with ``PeftModel.from_pretrained(base, adapter_dir)``
(adapters) or ``BertModel.from_pretrained`` (merged models), and pavejax reads theirs back.

Orientation. pavejax computes ``y = x @ (W + s A B)`` with a Flax kernel ``W`` (in, out),
``A`` (in, r), ``B`` (r, out) and ``s = alpha / r``. torch stores ``weight = W.T`` (out, in) and
PEFT computes ``y = x @ weight.T + s * (x @ lora_A.T) @ lora_B.T``, so
``lora_A.weight = A.T`` (r, in) and ``lora_B.weight = B.T`` (out, r). Both directions are exact
copies (a transpose moves values, it does not round them).

**An exported adapter contains A.** PAVE's conditional sketch guarantee needs A secret, so an
adapter export is for a user's own model, never something to publish next to a PAVE spec made
with the same A: :func:`export_lora_peft` refuses unless ``include_secret_A=True`` is passed.

Names. :func:`minilm_torch_name` maps a Flax path of :class:`pavejax.models.BertEncoder`
(``layers/0/attention/query/kernel``, optionally under ``encoder/`` as in ``TextClassifier``) to the
torch module (``encoder.layer.0.attention.self.query``); :func:`minilm_torch_tensor_name` gives
full tensor names for every parameter, from the loader's table (``bert_torch_names``) inverted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax._tree import named_leaves, path_string
from pavejax.lora import LoraConfig
from pavejax.models.bert import BertConfig
from pavejax.models.loading import BERT_IGNORED_TENSORS, bert_torch_names

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "export_lora_peft",
    "export_merged_safetensors",
    "import_lora_peft",
    "import_merged_safetensors",
    "minilm_flax_path",
    "minilm_torch_name",
    "minilm_torch_tensor_name",
]

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
_LAYER_FLAX = re.compile(r"(?:encoder/)?layers/(\d+)/(.+)")
_LAYER_TORCH = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
# One-layer table; layer i is layer 0 with the index substituted (the table is per-layer uniform).
_ONE_LAYER = {"/".join(map(str, t.path)): (name, t.transpose) for name, t in
              bert_torch_names(dataclasses.replace(BertConfig(), num_layers=1)).items()}
_MODULES = {name[:-len(".weight")]: path for path, (name, transpose) in _ONE_LAYER.items()
            if transpose}


def minilm_torch_tensor_name(flax_path: str) -> str:
    """Hugging Face ``BertModel`` tensor name of a ``BertEncoder`` parameter path.

    E.g. ``layers/2/attention/query/kernel -> encoder.layer.2.attention.self.query.weight`` (a
    kernel, stored transposed), ``embeddings/norm/scale -> embeddings.LayerNorm.weight``. A leading
    ``encoder/`` (``TextClassifier`` params) is dropped. Unknown paths raise ``ValueError``.
    """
    m = _LAYER_FLAX.fullmatch(flax_path)
    key = f"layers/0/{m.group(2)}" if m else flax_path.removeprefix("encoder/")
    if key not in _ONE_LAYER:
        raise ValueError(f"{flax_path!r} is not a BERT parameter path (e.g. "
                         f"'layers/0/attention/query/kernel' or 'embeddings/norm/scale'); for "
                         f"other models pass your own name map (return None to leave a leaf out)")
    name = _ONE_LAYER[key][0]
    return name.replace("encoder.layer.0.", f"encoder.layer.{m.group(1)}.", 1) if m else name


def minilm_torch_name(flax_path: str) -> str:
    """torch module name of a ``BertEncoder`` Linear kernel path, as PEFT names LoRA targets.

    ``encoder/layers/0/attention/query/kernel -> encoder.layer.0.attention.self.query``.
    Raises ``ValueError`` for paths that are not Linear kernels (LoRA adapts those only).
    """
    name = minilm_torch_tensor_name(flax_path)
    if not flax_path.endswith("/kernel"):
        raise ValueError(f"{flax_path!r} is not a Linear kernel; LoRA factors attach to "
                         f"'.../kernel' leaves only (e.g. 'layers/0/attention/query/kernel')")
    return name.removesuffix(".weight")


def minilm_flax_path(torch_module: str, *, prefix: str = "") -> str:
    """Inverse of :func:`minilm_torch_name`: ``encoder.layer.0.attention.self.query`` ->
    ``prefix + "layers/0/attention/query/kernel"`` (``prefix="encoder/"`` for ``TextClassifier``).
    """
    m = _LAYER_TORCH.fullmatch(torch_module)
    key = f"encoder.layer.0.{m.group(2)}" if m else torch_module
    if key not in _MODULES:
        raise ValueError(f"{torch_module!r} is not a BERT Linear module (e.g. "
                         f"'encoder.layer.0.attention.self.query'); pass your own inverse map")
    path = _MODULES[key]
    return prefix + (path.replace("layers/0/", f"layers/{m.group(1)}/", 1) if m else path)


def _as_function(name_map: Callable[[str], Any] | Mapping[str, Any], what: str):
    if isinstance(name_map, Mapping):
        def lookup(name: str) -> Any:
            if name not in name_map:
                raise ValueError(f"{what} has no entry for {name!r}; add it")
            return name_map[name]
        return lookup
    if not callable(name_map):
        raise TypeError(f"{what} must be a callable or a dict, got {type(name_map).__name__}")
    return name_map


def _host(x: Any) -> np.ndarray:
    a = np.asarray(jax.device_get(x))
    if a.dtype == jnp.bfloat16:  # safetensors.numpy has no bfloat16; float32 holds it exactly
        a = a.astype(np.float32)
    return a


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    taken = [str(p) for p in paths if p.exists()]
    if taken and not overwrite:
        raise FileExistsError(f"{taken} already exist; pass overwrite=True to replace them")


def export_lora_peft(path_dir: str | os.PathLike[str], B: Mapping[str, Any],
                     A: Mapping[str, Any], cfg: LoraConfig, *,
                     name_map: Callable[[str], str] | Mapping[str, str],
                     include_secret_A: bool = False,
                     base_model_name_or_path: str = "sentence-transformers/all-MiniLM-L6-v2",
                     target_modules: tuple[str, ...] = ("query", "value"),
                     task_type: str | None = None, overwrite: bool = False) -> Path:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` that PEFT loads.

    Args:
      B, A: the factors of :func:`pavejax.lora.init_lora` (``B[p]`` (r, out), ``A[p]`` (in, r)).
      name_map: Flax path -> torch module name (e.g. :func:`minilm_torch_name`).
      include_secret_A: must be ``True``: the file holds ``A`` (see the module docstring).
      target_modules: last components of the adapted torch modules (checked against the names).
      task_type: PEFT task type, ``None`` or e.g. ``"FEATURE_EXTRACTION"``.

    Returns the directory. Tensors are ``base_model.model.<module>.lora_A.weight`` = ``A.T``
    and ``.lora_B.weight`` = ``B.T``, in the factors' dtype (bfloat16 widened to float32).
    """
    if include_secret_A is not True:
        raise ValueError("a PEFT adapter contains A (lora_A.weight). A and its key must stay "
                         "secret wherever a PAVE spec made with them is published; export only "
                         "your own adapter, and pass include_secret_A=True to confirm")
    if not isinstance(cfg, LoraConfig):
        raise TypeError(f"cfg must be a LoraConfig, got {type(cfg).__name__}")
    if set(B) != set(A) or not B:
        raise ValueError(f"B and A must have the same non-empty paths; only in B: "
                         f"{sorted(set(B) - set(A))}, only in A: {sorted(set(A) - set(B))}")
    to_torch = _as_function(name_map, "name_map")
    tensors, modules = {}, {}
    for path in sorted(B):
        a, b = _host(A[path]), _host(B[path])
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != cfg.rank or b.shape[0] != cfg.rank:
            raise ValueError(f"at {path!r} expected A (in, {cfg.rank}) and B ({cfg.rank}, out), "
                             f"got {a.shape} and {b.shape}; PEFT adapts 2-D Linear weights only")
        module = to_torch(path)
        if module in modules:
            raise ValueError(f"{path!r} and {modules[module]!r} both map to {module!r}")
        if module.rsplit(".", 1)[-1] not in target_modules:
            raise ValueError(f"{module!r} (from {path!r}) does not end in one of target_modules "
                             f"{tuple(target_modules)}; PEFT would not attach it: add its last "
                             f"name component to target_modules")
        modules[module] = path
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    out = Path(path_dir)
    _refuse_existing([out / ADAPTER_WEIGHTS, out / ADAPTER_CONFIG], overwrite)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file  # the ``text`` extra

    save_file(tensors, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt", "pavejax_a_init": cfg.init})
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    config = {"peft_type": "LORA", "r": cfg.rank, "lora_alpha": alpha,
              "target_modules": sorted(set(target_modules)), "fan_in_fan_out": False,
              "bias": "none", "task_type": task_type, "init_lora_weights": True,
              "base_model_name_or_path": base_model_name_or_path, "lora_dropout": 0.0,
              "inference_mode": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": {}, "alpha_pattern": {}, "revision": None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _read_adapter_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the directory of a PEFT adapter")
    config = json.loads(path.read_text())
    unsupported = {"peft_type": "LORA", "fan_in_fan_out": False, "use_rslora": False,
                   "use_dora": False, "bias": "none"}
    bad = [f"{k}={config.get(k)!r} (need {v!r})" for k, v in unsupported.items()
           if config.get(k, v if k != "peft_type" else None) != v]
    bad += [f"{k} is set" for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if bad:
        raise ValueError(f"{path} describes an adapter pavejax cannot represent exactly: "
                         f"{', '.join(bad)}; export a plain LoRA adapter (one rank and alpha)")
    return config


def import_lora_peft(path_dir: str | os.PathLike[str], *,
                     name_map_inverse: Callable[[str], str] | Mapping[str, str]
                     ) -> tuple[dict[str, jax.Array], dict[str, jax.Array], LoraConfig]:
    """Read a PEFT LoRA adapter directory back as ``(B, A, LoraConfig)`` (exact inverse of
    :func:`export_lora_peft`). ``name_map_inverse``: torch module name -> Flax path (e.g.
    :func:`minilm_flax_path`). ``A``'s init scheme is read from the file when pavejax wrote it,
    else PEFT's default ``"kaiming_uniform"`` is assumed."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    root = Path(path_dir)
    config = _read_adapter_config(root / ADAPTER_CONFIG)
    tensors = load_file(str(root / ADAPTER_WEIGHTS))
    with safe_open(str(root / ADAPTER_WEIGHTS), "np") as f:
        file_meta = f.metadata() or {}
    rank = config.get("r")
    factors: dict[str, dict[str, np.ndarray]] = {}
    unknown = []
    for name, arr in tensors.items():
        m = _LORA_KEY.fullmatch(name)
        if m is None:
            unknown.append(name)
        else:
            factors.setdefault(m.group(1), {})[m.group(2)] = arr
    if unknown:
        raise ValueError(f"{ADAPTER_WEIGHTS} has tensors that are not LoRA factors: "
                         f"{sorted(unknown)[:5]}; only base_model.model.<module>.lora_[AB].weight "
                         f"is supported")
    to_flax = _as_function(name_map_inverse, "name_map_inverse")
    B, A = {}, {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{module!r} has lora_{''.join(sorted(pair))} only; both lora_A "
                             f"and lora_B are needed")
        a_t, b_t = pair["A"], pair["B"]
        if a_t.ndim != 2 or b_t.ndim != 2 or a_t.shape[0] != rank or b_t.shape[1] != rank:
            raise ValueError(f"{module!r}: lora_A {a_t.shape} and lora_B {b_t.shape} do not fit "
                             f"r={rank} (need (r, in) and (out, r))")
        path = to_flax(module)
        A[path] = jnp.asarray(np.ascontiguousarray(a_t.T))
        B[path] = jnp.asarray(np.ascontiguousarray(b_t.T))
    if not B:
        raise ValueError(f"{ADAPTER_WEIGHTS} in {root} holds no LoRA factors")
    dtype = next(iter(B.values())).dtype
    cfg = LoraConfig(rank=rank, alpha=config.get("lora_alpha", rank),
                     init=file_meta.get("pavejax_a_init", "kaiming_uniform"), dtype=dtype)
    return B, A, cfg


def _torch_layout(path: str, leaf: np.ndarray) -> np.ndarray:
    if not path.endswith("kernel"):
        return leaf
    if leaf.ndim != 2:
        raise ValueError(f"{path!r} has shape {leaf.shape}; only 2-D Linear kernels have a torch "
                         f"(out, in) layout here: map it to None or reshape it yourself")
    return np.ascontiguousarray(leaf.T)


def export_merged_safetensors(path: str | os.PathLike[str], params: Any, *,
                              to_torch_name: Callable[[str], str | None] =
                              minilm_torch_tensor_name, overwrite: bool = False) -> list[str]:
    """Write a full (e.g. LoRA-merged) params pytree as a torch-named safetensors file.

    Leaves named ``.../kernel`` (Flax (in, out)) are stored transposed as torch (out, in)
    weights; other leaves as they are. ``to_torch_name`` returns ``None`` for a leaf to leave
    out (e.g. a task head). Returns the tensor names written. With the default names the file
    is a Hugging Face ``BertModel`` ``model.safetensors``.
    """
    out = Path(path)
    _refuse_existing([out], overwrite)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for leaf_path, leaf in named_leaves(params).items():
        name = to_torch_name(leaf_path)
        if name is None:
            continue
        if name in origin:
            raise ValueError(f"{leaf_path!r} and {origin[name]!r} both map to {name!r}")
        origin[name] = leaf_path
        tensors[name] = _torch_layout(leaf_path, _host(leaf))
    if not tensors:
        raise ValueError("to_torch_name left out every leaf; nothing to export")
    from safetensors.numpy import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt"})
    return sorted(tensors)


def import_merged_safetensors(path: str | os.PathLike[str], template: Any, *,
                              to_torch_name: Callable[[str], str | None] =
                              minilm_torch_tensor_name,
                              ignore: tuple[str, ...] = BERT_IGNORED_TENSORS) -> Any:
    """Read a torch-named safetensors file into the structure of ``template`` (exact inverse of
    :func:`export_merged_safetensors`).

    ``template``: params pytree (arrays or ``jax.ShapeDtypeStruct``); each leaf is cast to its
    template dtype. Leaves mapped to ``None`` are taken from the template unchanged. Raises one
    ``ValueError`` listing missing tensors, unused tensors (except ``ignore``) and bad shapes.
    """
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    leaves = named_leaves(template)
    names = {p: to_torch_name(p) for p in leaves}
    wanted = {n for n in names.values() if n is not None}
    problems = [f"missing tensor {n!r} (for {p!r})" for p, n in names.items()
                if n is not None and n not in tensors]
    problems += [f"unused tensor {n!r}" for n in sorted(set(tensors) - wanted - set(ignore))]
    for p, n in names.items():
        if n in tensors:
            got = _torch_layout(p, tensors[n]).shape
            if tuple(got) != tuple(np.shape(leaves[p])):
                problems.append(f"{n!r}: shape {tuple(got)} in Flax layout but {p!r} is "
                                f"{tuple(np.shape(leaves[p]))}")
    if problems:
        raise ValueError(f"{path} does not fit the template:\n  " + "\n  ".join(problems[:20]))

    def fill(keypath, leaf):
        p = path_string(keypath)
        if names[p] is None:
            return leaf
        return jnp.asarray(_torch_layout(p, tensors[names[p]]), dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, template)
