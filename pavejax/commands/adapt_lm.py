"""``pavejax adapt --lm``: prompted zeroth-order adaptation of a causal language model.

The backbone is a Llama-family LM (:mod:`pavejax.models`): ``smollm2`` (the installed
SmolLM2-135M-Instruct asset), a ``.gguf`` file, or a Hugging Face Llama folder (``config.json``,
``model.safetensors``, ``tokenizer.json``). Each labelled sentence becomes a prompt
(``--template``) scored by its candidate continuations (``--candidates``, one per label); the
per-example loss is the cross-entropy over the candidate scores (:mod:`pavejax.lm`). The adapter
is LoRA on the top block's feed-forward down-projection; ``--lm-path top`` (default) caches the
frozen model below it and scores single-token candidates exactly from the cached features
(:mod:`pavejax.lm_cache`), ``--lm-path whole`` runs the whole model at every step (any
candidates).

An **LM adapter release** (kind ``"lm_adapter"``) holds the dense weight updates
``{"deltas": {path: (d_in, d_out)}}`` to add to the backbone's kernels (``W + delta``), so using
it needs neither the LoRA factors nor their key; its metadata names the backbone by id and by
:func:`pavejax.pave.spec.backbone_hash` of its float32 weights (a release for another backbone
is refused), and records the template, candidates, guarantee, ledger and LoRA space of the last
adaptation. A release given with ``--model`` is folded into the backbone first; the new
release holds the sum of its updates and the new ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from pavejax.commands import _shared as sh, _zo

KIND = "lm_adapter"
LM_PATHS = ("top", "whole")
DEFAULT_TEMPLATE = "{sentence} It was"
DEFAULT_CANDIDATES = (" terrible", " great")
DEFAULTS = {"lr": 0.3, "zo_eps": 1e-3, "rank": 8, "seq_len": 64}
WHOLE_MICROBATCH = 32


class Backbone(NamedTuple):
    """A loaded causal-LM backbone: the model, its tokenizer, public id and weights hash."""

    model: Any
    tokenizer: Any
    id: str
    hash: str


def load_backbone(source: str | Path) -> Backbone:
    """``smollm2``, a ``.gguf`` file or a Hugging Face Llama folder as a :class:`Backbone`
    (float32 weights). The id is the file or folder name (never a local path); the hash is
    :func:`pavejax.pave.spec.backbone_hash` of the weights."""
    from flax import nnx

    from pavejax.models import (
        SMOLLM2_FILE,
        LlamaTokenizer,
        load_gguf,
        load_hf_llama,
        load_smollm2,
    )
    from pavejax.pave.spec import backbone_hash

    text = str(source)
    path = Path(text)
    if text == "smollm2":
        model, tokenizer = load_smollm2()
        name = SMOLLM2_FILE
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = load_gguf(path)
        name = path.name
    elif path.is_dir() and (path / "config.json").is_file():
        from pavejax.models import pretrained_kind

        if pretrained_kind(path) != "llama":
            raise ValueError(f"{path.name} is a BERT-family encoder, not a causal language "
                             f"model; use it as the classifier backbone with --backbone "
                             f"{path} (train, spec, merge, adapt without --lm)")
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json: put the model's Hugging "
                                    f"Face tokenizer.json (and tokenizer_config.json) next to "
                                    f"its config.json")
        model = load_hf_llama(path)
        tokenizer = LlamaTokenizer.from_file(path / "tokenizer.json")
        name = path.resolve().name
    else:
        raise ValueError(f"--lm {text!r} is not 'smollm2', an existing .gguf file or a Hugging "
                         f"Face Llama folder (config.json, model.safetensors, tokenizer.json)")
    state = nnx.to_pure_dict(nnx.split(model)[1])
    return Backbone(model, tokenizer, name, backbone_hash(state))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def load_lm_adapter(path: str | Path, backbone: Backbone) -> tuple[dict[str, Any], Any]:
    """Verify an LM adapter release for ``backbone`` and read it: ``(deltas, metadata)`` with
    ``deltas`` ``{kernel path: (d_in, d_out) float32 numpy}``. Refuses (``ReleaseError``) a
    release made on another backbone or of another kind."""
    import numpy as np

    from pavejax._tree import named_leaves
    from pavejax.release import ReleaseError, load_release

    tensors, meta = load_release(path, expect_backbone_hash=backbone.hash)
    if meta.kind != KIND or set(tensors) != {"deltas"}:
        raise ReleaseError(f"{path} holds a {meta.kind!r} release, not an LM adapter; pass a "
                           f"directory written by 'pavejax adapt --lm'")
    return {p: np.asarray(v, np.float32) for p, v in named_leaves(tensors["deltas"]).items()}, \
        meta


def apply_deltas(model: Any, deltas: dict[str, Any]) -> Any:
    """A copy of ``model`` with ``W + delta`` at each kernel path of ``deltas``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pavejax._tree import path_string

    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    unknown = sorted(set(deltas) - set(model.lora_targets()))
    if unknown:
        raise ValueError(f"the release updates {unknown}, which this backbone does not have")

    def add(keypath, w):
        d = deltas.get(path_string(keypath))
        if d is None:
            return w
        if tuple(d.shape) != tuple(w.shape):
            raise ValueError(f"the release's update of {path_string(keypath)} has shape "
                             f"{tuple(d.shape)}, the backbone's kernel {tuple(w.shape)}")
        return (w.astype(jnp.float32) + jnp.asarray(d, jnp.float32)).astype(w.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(add, params))


def load_adapted_lm(release: str | Path, source: str | Path) -> tuple[Any, Any, Any]:
    """The backbone ``source`` (as ``--lm`` takes it) with an LM adapter release applied:
    ``(model, tokenizer, metadata)``; ``metadata.extra`` holds the template and candidates."""
    backbone = load_backbone(source)
    deltas, meta = load_lm_adapter(release, backbone)
    return apply_deltas(backbone.model, deltas), backbone.tokenizer, meta


# --- data ---------------------------------------------------------------------------------------


def read_labelled_sentences(path: Path, num_labels: int) -> tuple[list[str], Any]:
    """A JSON-lines file of ``{"sentence": str, "label": int}`` records: ``(sentences, labels
    (n,) int32)``. Labels index the candidates (0 .. num_labels - 1). Raises ``ValueError``
    naming the line of a malformed record, and for a file without records."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data file not found: {path}")
    sentences, labels = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: not a JSON record ({err}); each line must be "
                             f'{{"sentence": "...", "label": 0}}') from None
        if not isinstance(record, dict) or set(record) < {"sentence", "label"}:
            raise ValueError(f'{where}: a record needs "sentence" and "label", got {record!r}')
        sentence, label = record["sentence"], record["label"]
        if not isinstance(sentence, str) or not sentence.strip():
            raise ValueError(f"{where}: the sentence must be a non-empty string")
        if isinstance(label, bool) or not isinstance(label, int):
            raise ValueError(f"{where}: the label must be an integer candidate index, got "
                             f"{label!r}")
        if not 0 <= label < num_labels:
            raise ValueError(f"{where}: label {label} is out of range: labels index the "
                             f"{num_labels} --candidates (0 .. {num_labels - 1})")
        sentences.append(sentence)
        labels.append(label)
    if not sentences:
        raise ValueError(f"--data {path.name} holds no labelled sentences (one JSON record per "
                         f'line: {{"sentence": "...", "label": 0}})')
    return sentences, np.asarray(labels, np.int32)


def _task(ns: argparse.Namespace, label_names: tuple[str, ...]):
    from pavejax.data import load_task
    from pavejax.data.tasks import limit_task, split_task

    if ns.data is not None:
        sentences, labels = read_labelled_sentences(ns.data, len(label_names))
        task = split_task(Path(ns.data).name, sentences, labels, label_names, seed=ns.seed)
        task = limit_task(task, max_train=ns.pool_size, max_dev=ns.dev_size,
                          max_test=ns.test_size, seed=ns.seed)
        sizes = {s: len(getattr(task, s)) for s in ("train", "dev", "test")}
        if min(sizes.values()) == 0:
            raise ValueError(f"--data {Path(ns.data).name}: {len(sentences)} sentences leave an "
                             f"empty split ({sizes}; 70/10/20 per label): give more labelled "
                             f"sentences of each label")
        return task
    task = load_task(ns.task, seed=ns.seed, max_train=ns.pool_size, max_dev=ns.dev_size,
                     max_test=ns.test_size)
    if task.modality != "text":
        raise ValueError(f"task {ns.task!r} holds images; a prompted LM needs text")
    if task.num_classes != len(label_names):
        raise ValueError(f"task {ns.task!r} has {task.num_classes} classes "
                         f"({', '.join(task.label_names)}) but {len(label_names)} --candidates "
                         f"were given: give one candidate per class, in this order")
    return task


def template_from_flags(ns: argparse.Namespace):
    """The :class:`~pavejax.data.prompts.PromptTemplate` of ``--template`` and
    ``--candidates`` (defaults: MeZO's ``"{sentence} It was"`` / ``" terrible" " great"``)."""
    from pavejax.data.prompts import PromptTemplate

    template = DEFAULT_TEMPLATE if ns.template is None else ns.template
    candidates = DEFAULT_CANDIDATES if ns.candidates is None else tuple(ns.candidates)
    if "{sentence}" not in template:
        raise ValueError(f"--template {template!r} has no {{sentence}} slot: write where the "
                         f"sentence goes, e.g. --template '{{sentence}} It was'")
    if template.endswith(" "):
        raise ValueError(f"--template {template!r} ends with a space: candidates carry their "
                         f"own leading space (' great'), so end the template without one")
    return PromptTemplate(template, candidates)


# --- the two scoring paths ----------------------------------------------------------------------


class _Problem(NamedTuple):
    loss_fn: Any
    frozen: Any
    pool: Any
    dev_loss: Any      # jittable (trainable, frozen) -> () float32
    accuracy: Any      # host (trainable, split name) -> float


def _top_problem(backbone: Backbone, model, A, config, template, task, seq_len) -> _Problem:
    import jax
    import jax.numpy as jnp

    from pavejax.data.prompts import encode_prompts
    from pavejax.lm_cache import TopDownLora, candidate_token_ids, top_features

    tok = backbone.tokenizer
    cands = candidate_token_ids(tok, template.candidates)
    adapter = TopDownLora.of(model, config)
    frozen = adapter.frozen(model, A, cands)
    data = {}
    for split in ("train", "dev", "test"):
        part = getattr(task, split)
        prompts = [template.format(s) for s in part.inputs]
        ids, mask = encode_prompts(tok, prompts, max_length=seq_len, pad_id=tok.pad_id,
                                   padding_side="right")
        feats = top_features(model, ids, mask)
        data[split] = {k: jnp.asarray(feats[k]) for k in ("act", "h_base")} | {
            "label": jnp.asarray(part.labels, jnp.int32)}

    def dev_loss(tr, fr):
        return jnp.mean(jax.vmap(adapter.loss, in_axes=(None, None, 0))(tr, fr, data["dev"]))

    @jax.jit
    def hits(tr, d):
        z = adapter.batch_logits(tr, frozen, d)
        return jnp.sum((jnp.argmax(z, -1) == d["label"]).astype(jnp.int32))

    return _Problem(adapter.loss, frozen, data["train"], dev_loss,
                    lambda tr, split: int(hits(tr, data[split])) / len(getattr(task, split)))


def _whole_problem(backbone: Backbone, split_, frozen, template, task, seq_len) -> _Problem:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pavejax import lm
    from pavejax.data.prompts import encode_candidates

    tok = backbone.tokenizer
    loss_fn = lm.candidate_loss_fn(split_)
    data, labels = {}, {}
    for split in ("train", "dev", "test"):
        part = getattr(task, split)
        batch = encode_candidates(tok, [template.format(s) for s in part.inputs], template,
                                  max_length=seq_len, pad_id=tok.pad_id)
        labels[split] = np.asarray(part.labels, np.int32)
        data[split] = lm.candidate_examples(batch, labels[split])

    def dev_loss(tr, fr):
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, None, 0))(tr, fr, data["dev"]))

    def accuracy(tr, split):
        scores = lm.score_candidates(split_.merged(tr, frozen), data[split],
                                     batch_size=WHOLE_MICROBATCH)
        return float(np.mean(np.argmax(scores, axis=-1) == labels[split]))

    return _Problem(loss_fn, frozen, data["train"], dev_loss, accuracy)


# --- the command --------------------------------------------------------------------------------


def _upstream(ns: argparse.Namespace, backbone: Backbone) -> tuple[dict[str, Any], dict | None]:
    if ns.model is None:
        return {}, None
    deltas, meta = load_lm_adapter(ns.model, backbone)
    return deltas, {"release": Path(ns.model).name, "kind": meta.kind,
                    "mechanism": meta.mechanism, "guarantee": meta.guarantee,
                    "ledger": meta.ledger, "template": meta.extra.get("template"),
                    "candidates": meta.extra.get("candidates"),
                    "note": "the input adapter's guarantee on its own training data; its "
                            "updates are included in this release's"}


def run(ns: argparse.Namespace) -> int:
    """The ``--lm`` branch of ``pavejax adapt`` (flags as :mod:`pavejax.commands.adapt`)."""
    import jax
    import numpy as np

    from pavejax import lm, lora as lora_lib
    from pavejax.checkpointing import TrainCheckpointer
    from pavejax.paczero import ZOConfig, init, train
    from pavejax.privacy import fresh_key
    from pavejax.release import ReleaseMetadata, save_release

    _zo.check_flags(ns)
    template = template_from_flags(ns)
    label_names = tuple(c.strip() for c in template.candidates)
    task = _task(ns, label_names)
    task_name = task.name
    backbone = load_backbone(ns.lm)
    upstream_deltas, upstream = _upstream(ns, backbone)
    model = apply_deltas(backbone.model, upstream_deltas) if upstream_deltas else backbone.model
    top = model.config.num_layers - 1
    config = lora_lib.LoraConfig(ns.rank, alpha=2 * ns.rank, init="kaiming_uniform")
    # A is public here (drawn from the public seed; no spec is made from it) and the release
    # holds the dense update, so A is needed neither to use nor to check the release.
    a_key = jax.random.fold_in(jax.random.key(ns.seed), 1)
    split_, B, frozen_whole = lm.split_lora(model, a_key, config, targets=("down",),
                                            layers=(top,))
    A = frozen_whole["A"]
    if ns.lm_path == "top":
        prob = _top_problem(backbone, model, A, config, template, task, ns.seq_len)
    else:
        prob = _whole_problem(backbone, split_, frozen_whole, template, task, ns.seq_len)
    n = int(prob.pool["label"].shape[0])
    zcfg = ZOConfig(mechanism=ns.mechanism, steps=ns.steps, learning_rate=ns.lr,
                    perturbation_scale=ns.zo_eps, num_subsets=ns.subsets, l2_clip=25.0,
                    mi_budget=ns.mi_budget, target_epsilon=ns.epsilon, delta=ns.delta,
                    dp_batch_size=min(ns.dp_batch, n) if ns.mechanism == "dpzo" else None,
                    microbatch_size=WHOLE_MICROBATCH if ns.lm_path == "whole" else None,
                    eval_every=max(1, ns.steps // 10))
    dev_loss = jax.jit(prob.dev_loss)
    start_dev = float(dev_loss(B, prob.frozen))
    state = init(zcfg, B, n, key=fresh_key(), public_key=jax.random.key(ns.seed))
    ckpt = (contextlib.nullcontext() if ns.checkpoint_dir is None else
            TrainCheckpointer(ns.checkpoint_dir, every=zcfg.eval_every))
    with ckpt as checkpointer:
        state = train(zcfg, prob.loss_fn, state, prob.frozen, prob.pool, dev_fn=prob.dev_loss,
                      checkpointer=checkpointer, progress=ns.progress)
    improved = state.best is not None and state.best_dev < start_dev
    final = state.best if improved else B
    before, after = prob.accuracy(B, "test"), prob.accuracy(final, "test")
    guarantee, risk = _zo.guarantee(ns, zcfg, state.ledger, n, task_name)
    new = {p: np.asarray(d, np.float32)
           for p, d in lora_lib.lora_delta(final, A, config).items()}
    deltas = {p: new.get(p, 0) + upstream_deltas.get(p, 0) for p in {*new, *upstream_deltas}}
    hyper = {"mechanism": ns.mechanism, "steps": ns.steps, "learning_rate": ns.lr,
             "perturbation_scale": ns.zo_eps, "num_subsets": zcfg.num_subsets,
             "mi_budget": ns.mi_budget, "target_epsilon": ns.epsilon,
             "dp_batch_size": zcfg.dp_batch_size, "noise_multiplier": state.noise_multiplier,
             "public_seed": ns.seed, "lora_rank": ns.rank, "lora_alpha": config.alpha,
             "lm_path": ns.lm_path, "seq_len": ns.seq_len}
    extra = {"task": task_name, "classes": list(task.label_names), "template": template.template,
             "candidates": list(template.candidates),
             "test_accuracy": after, "test_accuracy_before": before,
             "data": {"task": task_name, "seed": ns.seed, "pool_size": n,
                      "dev_size": len(task.dev), "test_size": len(task.test),
                      "seq_len": ns.seq_len},
             "selection": {"start_dev_loss": start_dev, "best_dev_loss": state.best_dev,
                           "selected_step": state.best_step if improved else 0},
             "unanimity_rate": state.unanimity_rate, "upstream": upstream,
             "lm": {"backbone": backbone.id, "num_layers": model.config.num_layers,
                    "adapted": split_.trainable_paths, "lm_path": ns.lm_path},
             "model": f"{backbone.id} with LoRA (rank {ns.rank}, alpha {config.alpha}) on the "
                      f"top block's feed-forward down-projection; the tensors are the dense "
                      f"updates W + delta of the adapted kernels (upstream ones included); "
                      f"the LoRA A factor is drawn from the public seed"}
    meta = ReleaseMetadata(
        kind=KIND, backbone_id=backbone.id, backbone_hash=backbone.hash,
        mechanism=f"paczero-{ns.mechanism}" if ns.mechanism in ("zpl", "mi") else ns.mechanism,
        ledger=None if ns.mechanism == "mezo" else state.ledger, guarantee=guarantee,
        adapted_layers=tuple(sorted(deltas)), rank=ns.rank, a_init=config.init,
        a_hash=lora_lib.a_hash(A), hyperparameters=hyper, risk=risk, extra=extra)
    digest = save_release(ns.out, {"deltas": _nest(deltas)}, meta, overwrite=ns.overwrite)
    summary = {"out": str(ns.out), "content_hash": digest, "mechanism": ns.mechanism,
               "steps": state.step, "test_accuracy_before": before, "test_accuracy": after,
               "guarantee": guarantee, "backbone": backbone.id,
               "template": template.template, "candidates": list(template.candidates)}
    sh.emit(ns, summary, [
        f"adapted {backbone.id} (LoRA on the top down-projection, {ns.lm_path} path) with "
        f"{ns.mechanism} on {n} private examples of {task_name!r} ({state.step} steps, "
        f"unanimity rate {state.unanimity_rate:.3f})",
        f"prompt: {template.template!r} -> {' | '.join(map(repr, template.candidates))}",
        *_zo.summary_lines(guarantee, ns.delta, before, after),
        f"LM adapter release: {ns.out} (content hash {digest})"])
    return 0
