"""PACZero on movie-review sentiment with MiniLM: accuracy of MeZO, DP-ZO, PACZero-MI and -ZPL,
unanimity, MIA-matched ε, and the cost of a zeroth-order step, all in one run.

Model: all-MiniLM-L6-v2 with a 2-way head; LoRA r=8 on query/value plus the head trainable.
Full mode (sized for one GPU): pool 1000, M = 128 (126 for ZPL), T = 1000, seq 64. Quick mode
(2 CPU cores, a few minutes on a loaded machine): pool 32, M = 8, T = 8, seq 32, test 64 —
far too few steps to move accuracy much, so quick accuracies sit near the zero-shot head and
say nothing about the paper's numbers; the cost ratios are meaningful in both modes.

Cost ratios, measured in this run on the same model and batch: ``step_over_forward`` = one ZO
step (two forward passes over the pool per direction, z regenerated, update) / one forward pass
over the pool, with LoRA; ``step_over_forward_full`` the same with every weight perturbed;
``mem_over_inference`` = XLA argument + temporary memory of the LoRA ZO step / of the forward.
"""

from __future__ import annotations

import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax import lora
from pavejax.accounting.pac import epsilon_to_mi, mi_to_epsilon, mia_posterior_bound
from pavejax.data import load_task
from pavejax.models import TextClassifier, load_minilm
from pavejax.paczero import ZOConfig, init_state, per_example_losses, train
from pavejax.paczero.train import _device_fns

DELTA = 1e-5


def _tokens(tok, split, n):
    t = tok(list(split.inputs[:n]))
    return {"input_ids": jnp.asarray(t.input_ids), "attention_mask": jnp.asarray(t.attention_mask),
            "label": jnp.asarray(np.asarray(split.labels[:n]), jnp.int32)}


def _setup(pool_size, n_test, n_dev, seq):
    encoder, tok = load_minilm(max_length=seq)
    model = TextClassifier(encoder, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    task = load_task("movie", seed=0, max_train=pool_size, max_dev=n_dev, max_test=n_test)
    return (graphdef, params, _tokens(tok, task.train, pool_size),
            _tokens(tok, task.dev, n_dev), _tokens(tok, task.test, n_test))


def _lora_model(graphdef, params):
    cfg = lora.LoraConfig(8, alpha=16)
    B, A = lora.init_lora(jax.random.key(1), params, lambda p, _: p.endswith(
        ("attention/query/kernel", "attention/value/kernel")), cfg)

    def merged(tr, fr):
        p = dict(fr["params"])
        p["head"] = tr["head"]
        return lora.apply_lora(p, tr["B"], fr["A"], cfg)

    return {"B": B, "head": params["head"]}, {"params": params, "A": A}, merged


def _loss_fns(graphdef, merged):
    def logits(tr, fr, ids, mask):
        return nnx.merge(graphdef, merged(tr, fr))(ids, mask)

    def loss(tr, fr, ex):
        lg = logits(tr, fr, ex["input_ids"][None], ex["attention_mask"][None])[0]
        return -jax.nn.log_softmax(lg.astype(jnp.float32))[ex["label"]]

    @jax.jit
    def accuracy(tr, fr, data):
        lg = logits(tr, fr, data["input_ids"], data["attention_mask"])
        return jnp.mean((jnp.argmax(lg, -1) == data["label"]).astype(jnp.float32))

    return loss, accuracy


def _bytes(fn, *args):
    m = fn.lower(*args).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes)


def _cost(loss, trainable, frozen, pool, repeats, microbatch):
    signals, update = _device_fns(loss, microbatch)
    eps, clip = jnp.float32(1e-3), jnp.float32(25.0)
    forward = jax.jit(lambda tr, fr, b: per_example_losses(loss, tr, fr, b, microbatch))
    keys = jax.random.key(0)[None]
    mask = jnp.ones((pool["label"].shape[0],), bool)
    state = {"tr": jax.tree.map(jnp.copy, trainable)}

    def step():
        out = signals(state["tr"], frozen, pool, mask, keys, eps, clip, None)
        y = jnp.sign(out["mean"]).astype(jnp.float32)
        state["tr"] = update(state["tr"], keys, y, jnp.float32(1e-6))
        jax.block_until_ready(state["tr"])

    def fwd():
        jax.block_until_ready(forward(trainable, frozen, pool))

    t = _common.interleaved_medians({"step": step, "forward": fwd}, repeats=repeats)
    mem = (_bytes(signals, trainable, frozen, pool, mask, keys, eps, clip, None),
           _bytes(forward, trainable, frozen, pool))
    return t["step"] / t["forward"], mem[0] / mem[1]


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv)
    if args.quick:
        pool_n, m, steps, seq, n_test, n_dev, lr, mb, repeats = 32, 8, 8, 32, 64, 32, 5e-3, 32, 3
    else:
        pool_n, m, steps, seq, n_test, n_dev, lr, mb, repeats = 1000, 128, 1000, 64, 1000, 500, \
            1e-3, 125, 5
    graphdef, params, pool, dev, test = _setup(pool_n, n_test, n_dev, seq)
    trainable, frozen, merged = _lora_model(graphdef, params)
    loss, accuracy = _loss_fns(graphdef, merged)
    dev_fn = lambda tr: -float(accuracy(tr, frozen, dev))  # noqa: E731
    cells = [("mezo", {}), ("dpzo_eps2", {"dp_epsilon": 2.0}), ("dpzo_eps6", {"dp_epsilon": 6.0}),
             ("mi033", {"mi_budget": 0.33}), ("mi068", {"mi_budget": 0.68}),
             ("zpl", {"num_subsets": m - 2 if not args.quick else m})]
    rows = []
    for name, extra in cells:
        kind = name.split("_")[0].rstrip("0123456789") if name != "mezo" else "mezo"
        kind = {"mi": "mi"}.get(kind, kind)
        kw = {"num_subsets": m, **extra}
        if kind == "dpzo":
            kw["dp_batch_size"] = max(8, pool_n // 16)
        cfg = ZOConfig(kind, steps=steps, learning_rate=lr, clip=25.0, microbatch_size=mb,
                       eval_every=max(steps // 10, 1), **kw)
        t0 = time.perf_counter()
        st = train(cfg, loss, init_state(cfg, trainable, pool_n, public_seed=42,
                                         mechanism_seed=42), frozen, pool, dev_fn=dev_fn)
        best = jax.tree.map(jnp.asarray, st.best) if st.best is not None else st.trainable
        if kind in ("mi", "zpl"):
            mi = st.mi_used
        else:  # DP-ZO matched at the MIA level; MeZO is non-private (p = 1)
            mi = epsilon_to_mi(extra["dp_epsilon"], DELTA) if kind == "dpzo" else float("inf")
        rows.append({"method": name, "test_acc": float(accuracy(best, frozen, test)),
                     "last_acc": float(accuracy(st.trainable, frozen, test)),
                     "unanimity_rate": st.unanimity_rate if kind in ("mi", "zpl") else None,
                     "mi_nats": mi, "mia_posterior": mia_posterior_bound(min(mi, 1.0)),
                     "mia_matched_eps": mi_to_epsilon(min(mi, 1.0), DELTA),
                     "dp_eps": (st.ledger(cfg, pool_n).epsilon(DELTA) if kind == "dpzo"
                                else None), "seconds": time.perf_counter() - t0})
    ratio_lora, mem_lora = _cost(loss, trainable, frozen, pool, repeats, mb)
    loss_full, _ = _loss_fns(graphdef, lambda tr, fr: tr)
    ratio_full, mem_full = _cost(loss_full, params, {}, pool, repeats, mb)
    by = {r["method"]: r for r in rows}
    summary = {"zpl_acc": by["zpl"]["test_acc"], "mezo_acc": by["mezo"]["test_acc"],
               "mi033_acc": by["mi033"]["test_acc"], "dpzo_eps2_acc": by["dpzo_eps2"]["test_acc"],
               "unanimity_rate": by["zpl"]["unanimity_rate"], "step_over_forward": ratio_lora,
               "step_over_forward_full": ratio_full, "mem_over_inference": mem_lora,
               "mem_over_inference_full": mem_full}
    config = {"model": "all-MiniLM-L6-v2", "task": "movie", "pool": pool_n, "num_subsets": m,
              "steps": steps, "seq_len": seq, "lr": lr, "clip": 25.0, "eps": 1e-3,
              "lora": {"rank": 8, "alpha": 16, "targets": ["query", "value"]},
              "microbatch": mb, "delta": DELTA, "quick": args.quick}
    return _common.emit("paczero", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
