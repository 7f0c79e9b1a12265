"""Private step time / non-private step time, side by side in one run, on real MiniLM.

Two settings on all-MiniLM-L6-v2 with a 2-way classification head, batch 32 x 64 tokens of real
movie-review sentences (full mode):

* ``lora``: LoRA r=8 on query and value (+ the head) trainable, backbone frozen;
* ``full``: every parameter trainable; the word-embedding table's per-example gradients are
  taken through the rows each example touches (``sparse_rows``), never as per-example copies.

The private step is the pavejax DP step (per-example gradients, joint clipping, one Gaussian
draw, SGD update); the non-private step is the batched gradient of the mean loss and the same
update. Both are jitted whole and timed alternately (medians). Memory is XLA's temp allocation
of each compiled step. Summary keys: ``lora_ratio``, ``full_ratio``, ``lora_mem_ratio``,
``full_mem_ratio``.
"""

from __future__ import annotations

import functools

import _common
import jax
import jax.numpy as jnp
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


def _make_steps(graphdef, merged, l2_clip, sigma, batch, microbatch, sparse):
    opt = optax.sgd(1e-3)

    def example_loss(trainable, frozen, ex):
        p = merged(trainable, frozen)
        return _ce(_logits(graphdef, p, ex["input_ids"], ex["attention_mask"]), ex["label"])

    def batch_loss(trainable, frozen, data):
        p = merged(trainable, frozen)
        logits = _logits(graphdef, p, data["input_ids"], data["attention_mask"])
        return jnp.mean(jax.vmap(_ce)(logits, data["label"]))

    clip = privacy.ClipConfig(l2_clip,
                              sparse_rows={WORD_EMBEDDING: "input_ids"} if sparse else {})

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


def measure(setting, graphdef, params, data, *, rank, repeats, microbatch):
    if setting == "lora":
        trainable, frozen, merged = _lora_parts(graphdef, params, rank)
    else:
        trainable, frozen, merged = _full_parts(params)
    batch = data["label"].shape[0]
    opt, private_step, plain_step = _make_steps(
        graphdef, merged, 1.0, 1.0, batch, microbatch if setting == "full" else None,
        sparse=setting == "full")
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
        "setting": setting, "trainable_params": int(n_train),
        "plain_step_s": times["plain"], "private_step_s": times["private"],
        "time_ratio": times["private"] / times["plain"],
        "plain_temp_MiB": mem["plain"] / 2**20, "private_temp_MiB": mem["private"] / 2**20,
        "mem_ratio": mem["private"] / max(mem["plain"], 1),
    }


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=lambda p: p.add_argument(
        "--microbatch", type=int, default=None,
        help="microbatch size for the full fine-tuning private step (default: batch/2 in full "
             "mode, none in quick mode)"))
    batch, seq, repeats = (8, 32, 3) if args.quick else (32, 64, 10)
    microbatch = args.microbatch if args.microbatch else (None if args.quick else batch // 2)
    graphdef, params, data = _setup(batch, seq)
    rows = [measure(s, graphdef, params, data, rank=8, repeats=repeats, microbatch=microbatch)
            for s in ("lora", "full")]
    by = {r["setting"]: r for r in rows}
    summary = {
        "lora_ratio": by["lora"]["time_ratio"], "full_ratio": by["full"]["time_ratio"],
        "lora_mem_ratio": by["lora"]["mem_ratio"], "full_mem_ratio": by["full"]["mem_ratio"],
    }
    config = {"model": "all-MiniLM-L6-v2", "batch": batch, "seq_len": seq, "lora_rank": 8,
              "lora_targets": ["query", "value"], "l2_clip": 1.0, "noise_multiplier": 1.0,
              "repeats": repeats, "full_microbatch": microbatch, "quick": args.quick}
    return _common.emit("dp_overhead", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
