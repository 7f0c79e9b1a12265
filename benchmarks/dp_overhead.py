"""Private step time / non-private step time, side by side in one run, on real MiniLM and SmolLM2.

Settings on all-MiniLM-L6-v2 with a 2-way classification head, batch 32 x 64 tokens of real
movie-review sentences (full mode):

* ``lora``: LoRA r=8 on query and value (+ the head) trainable, backbone frozen;
* ``full``: every parameter trainable, per-example gradients materialised (vmap, microbatches
  of 16); the word-embedding table's per-example gradients are taken through the rows each
  example touches (``sparse_rows``), never as per-example copies;
* ``full_ghost``: every parameter trainable, ghost clipping with book-keeping
  (``ClipConfig(method="ghost")``: norms from activations and output gradients, no
  per-example gradients, one backward pass);
* ``full_ghost_two_pass``: the same norms, then a second backward of the clip-weighted loss;

and on SmolLM2-135M-Instruct (real weights, tied embeddings), every weight trained on the
causal-LM token loss of real movie reviews, batch 8 x 64 tokens:

* ``lm_full_ghost``: ghost clipping with book-keeping.

The private step is the pavejax DP step (per-example norms, joint clipping at 1, one Gaussian
draw with multiplier 1, SGD update); the non-private step is the batched gradient of the mean
loss and the same update. Both are jitted whole and timed alternately (medians). Memory is XLA's
temp allocation of each compiled step. Summary keys: ``<setting>_ratio`` (time, DP / non-DP) and
``<setting>_mem_ratio`` (XLA temp memory, DP / non-DP) for each setting run: ``lora``, ``full``,
``full_ghost``, ``full_ghost_two_pass``, ``lm_full_ghost``. ``--settings`` picks a subset;
``--quick`` runs MiniLM at 8 x 32 and SmolLM2 at 2 x 16 with fewer repeats;
``--ghost-microbatch N`` runs the ghost settings in microbatches of N (less memory).

The DP step's time includes drawing the noise (threefry, 22.7M values for full MiniLM: about
0.25 s of the 1.2 s step on 2 CPU cores), which no clipping method avoids.
"""

from __future__ import annotations

import functools

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pavejax import lora, privacy
from pavejax.data import load_task
from pavejax.models import TextClassifier, load_minilm

WORD_EMBEDDING = "encoder/embeddings/word/embedding"


def _setup(batch: int, seq: int):
    encoder, tok = load_minilm(max_length=seq)
    model = TextClassifier(encoder, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    task = load_task("movie", max_train=batch)
    toks = tok(list(task.train.inputs[:batch]))
    data = {"input_ids": jnp.asarray(toks.input_ids), "attention_mask":
            jnp.asarray(toks.attention_mask), "label": jnp.asarray(task.train.labels[:batch])}
    return graphdef, params, data


def _logits(graphdef, params, input_ids, attention_mask):
    return nnx.merge(graphdef, params)(input_ids, attention_mask)


def _ce(logits, label):
    return -jax.nn.log_softmax(logits)[label]


def _lora_parts(graphdef, params, rank):
    cfg = lora.LoraConfig(rank)

    def pred(path, leaf):
        return path.endswith(("attention/query/kernel", "attention/value/kernel"))

    B, A = lora.init_lora(jax.random.key(1), params, pred, cfg)
    B = jax.tree.map(lambda b: b + 0.01, B)  # away from zero so that A's gradient path is live

    def merged(trainable, frozen):
        p = dict(frozen["params"])
        p["head"] = trainable["head"]
        return lora.apply_lora(p, trainable["B"], frozen["A"], cfg)

    trainable = {"B": B, "head": params["head"]}
    frozen = {"params": params, "A": A}
    return trainable, frozen, merged


def _full_parts(params):
    return params, {}, lambda trainable, frozen: trainable


def _classifier_losses(graphdef, merged):
    def example_loss(trainable, frozen, ex):
        p = merged(trainable, frozen)
        return _ce(_logits(graphdef, p, ex["input_ids"], ex["attention_mask"]), ex["label"])

    def batch_loss(trainable, frozen, data):
        p = merged(trainable, frozen)
        logits = _logits(graphdef, p, data["input_ids"], data["attention_mask"])
        return jnp.mean(jax.vmap(_ce)(logits, data["label"]))

    return example_loss, batch_loss


def _lm_losses(split):
    from pavejax import lm

    example_loss = lm.token_loss_fn(split)

    def batch_loss(trainable, frozen, data):
        model, lora_ = split.model(trainable, frozen)
        return jnp.mean(lm.token_loss(model, data["input_ids"], data["attention_mask"],
                                      lora=lora_))

    return example_loss, batch_loss


def _make_steps(losses, l2_clip, sigma, batch, microbatch, sparse, method="vmap"):
    opt = optax.sgd(1e-3)
    example_loss, batch_loss = losses
    clip = privacy.ClipConfig(l2_clip,
                              sparse_rows={WORD_EMBEDDING: "input_ids"} if sparse else {},
                              method=method)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def private_step(trainable, opt_state, frozen, data, key):
        r = privacy.clipped_sum(example_loss, trainable, frozen, data, None, clip,
                                microbatch_size=microbatch)
        g = privacy.privatize_sum(r.grad_sum, key, noise_multiplier=sigma, sensitivity=l2_clip,
                                  expected_batch_size=float(batch))
        updates, opt_state = opt.update(g, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def plain_step(trainable, opt_state, frozen, data, key):
        del key
        g = jax.grad(batch_loss)(trainable, frozen, data)
        updates, opt_state = opt.update(g, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    return opt, private_step, plain_step


def _temp_bytes(step, *args) -> int:
    return int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def measure(setting, graphdef, params, data, *, rank, repeats, microbatch,
            ghost_microbatch=None):
    """One row: ``lora``, ``full`` (vmap path, microbatched), ``full_ghost`` and
    ``full_ghost_two_pass`` on MiniLM; ``lm_full_ghost`` on SmolLM2 (``graphdef`` is then the
    LM split and ``params`` its (trainable, frozen))."""
    if setting.startswith("lm_"):
        trainable, frozen = params
        losses = _lm_losses(graphdef)
    elif setting == "lora":
        trainable, frozen, merged = _lora_parts(graphdef, params, rank)
        losses = _classifier_losses(graphdef, merged)
    else:
        trainable, frozen, merged = _full_parts(params)
        losses = _classifier_losses(graphdef, merged)
    batch = data["input_ids"].shape[0]
    method = "vmap"
    if "ghost" in setting:
        method = "ghost_two_pass" if setting.endswith("two_pass") else "ghost"
    mb = microbatch if setting == "full" else (ghost_microbatch if "ghost" in setting else None)
    opt, private_step, plain_step = _make_steps(
        losses, 1.0, 1.0, batch, mb, sparse=setting == "full", method=method)
    key = jax.random.key(0)
    mem = {
        "private": _temp_bytes(private_step, trainable, opt.init(trainable), frozen, data, key),
        "plain": _temp_bytes(plain_step, trainable, opt.init(trainable), frozen, data, key),
    }
    states = {k: [jax.tree.map(jnp.copy, trainable), opt.init(trainable)] for k in mem}

    def runner(name, step):
        def run():
            s = states[name]
            s[0], s[1] = step(s[0], s[1], frozen, data, key)
            jax.block_until_ready(s[0])
        return run

    times = _common.interleaved_medians(
        {"private": runner("private", private_step), "plain": runner("plain", plain_step)},
        repeats=repeats, warmup=1)
    n_train = sum(x.size for x in jax.tree.leaves(trainable))
    return {
        "setting": setting, "method": method, "microbatch": mb,
        "trainable_params": int(n_train),
        "batch": int(batch), "seq_len": int(data["input_ids"].shape[1]),
        "plain_step_s": times["plain"], "private_step_s": times["private"],
        "time_ratio": times["private"] / times["plain"],
        "plain_temp_MiB": mem["plain"] / 2**20, "private_temp_MiB": mem["private"] / 2**20,
        "mem_ratio": mem["private"] / max(mem["plain"], 1),
    }


SETTINGS = ("lora", "full", "full_ghost", "full_ghost_two_pass", "lm_full_ghost")


def _lm_setup(batch: int, seq: int):
    """SmolLM2-135M (real weights), every weight trained, ``batch`` real movie reviews."""
    from pavejax import lm
    from pavejax.models.llama_loading import load_smollm2

    model, tok = load_smollm2()
    split, trainable, frozen = lm.split_full(model, lambda path, leaf: True)
    task = load_task("movie", max_train=batch)
    texts = list(task.train.inputs[:batch])
    ids = np.zeros((batch, seq), np.int32)
    am = np.zeros((batch, seq), np.int32)
    for i, text in enumerate(texts):
        row = tok.encode(text)[:seq]
        ids[i, :len(row)] = row
        am[i, :len(row)] = 1
    return split, (trainable, frozen), {"input_ids": jnp.asarray(ids),
                                        "attention_mask": jnp.asarray(am)}


def main(argv=None):
    def extra(p):
        p.add_argument("--microbatch", type=int, default=None,
                       help="microbatch size for the full fine-tuning vmap private step "
                            "(default: batch/2 in full mode, none in quick mode)")
        p.add_argument("--ghost-microbatch", type=int, default=None,
                       help="microbatch size for the ghost settings (default: none, the "
                            "whole batch in one book-keeping pass)")
        p.add_argument("--settings", default=",".join(SETTINGS),
                       help=f"comma-separated subset of {','.join(SETTINGS)}")
        p.add_argument("--lm-batch", type=int, default=None,
                       help="SmolLM2 batch (default 8 x 64 tokens; quick: 2 x 16)")

    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=extra)
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    batch, seq, repeats = (8, 32, 3) if args.quick else (32, 64, 10)
    lm_batch, lm_seq = (2, 16) if args.quick else (8, 64)
    lm_batch = args.lm_batch or lm_batch
    microbatch = args.microbatch if args.microbatch else (None if args.quick else batch // 2)
    rows = []
    if any(not s.startswith("lm_") for s in settings):
        graphdef, params, data = _setup(batch, seq)
        rows += [measure(s, graphdef, params, data, rank=8, repeats=repeats,
                         microbatch=microbatch, ghost_microbatch=args.ghost_microbatch)
                 for s in settings if not s.startswith("lm_")]
        del params, data
    if "lm_full_ghost" in settings:
        split, parts, lm_data = _lm_setup(lm_batch, lm_seq)
        rows.append(measure("lm_full_ghost", split, parts, lm_data, rank=8,
                            repeats=max(2, repeats // 2), microbatch=None,
                            ghost_microbatch=args.ghost_microbatch))
    by = {r["setting"]: r for r in rows}
    summary = {}
    for name, key in (("lora", "lora"), ("full", "full"), ("full_ghost", "full_ghost"),
                      ("full_ghost_two_pass", "full_ghost_two_pass"),
                      ("lm_full_ghost", "lm_full_ghost")):
        if name in by:
            summary[f"{key}_ratio"] = by[name]["time_ratio"]
            summary[f"{key}_mem_ratio"] = by[name]["mem_ratio"]
    config = {"model": "all-MiniLM-L6-v2", "batch": batch, "seq_len": seq, "lora_rank": 8,
              "lora_targets": ["query", "value"], "l2_clip": 1.0, "noise_multiplier": 1.0,
              "repeats": repeats, "full_microbatch": microbatch,
              "ghost_microbatch": args.ghost_microbatch, "quick": args.quick,
              "settings": settings, "lm_model": "SmolLM2-135M-Instruct (every weight trained)",
              "lm_batch": lm_batch, "lm_seq_len": lm_seq}
    return _common.emit("dp_overhead", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
