"""PACZero on movie-review sentiment with MiniLM: accuracy of MeZO, DP-ZO, PACZero-MI and -ZPL,
unanimity, MIA-matched ε, and the cost of a zeroth-order step, all in one run.

Model: all-MiniLM-L6-v2, mean pooling, a 2-way head initialised zero-shot from class prompts
(the mean normalised embedding of a few public sentences per class, times a temperature of 20),
trained jointly with a LoRA adapter (r = 8, α = 16); every method starts from this same model.

Modes (``--mode``; ``--quick`` is ``--mode quick``):

* ``full`` (sized for one GPU; the paper's setting): LoRA on every query/value kernel, the whole
  encoder in each forward pass, pool 1000, M = 128 (126 for ZPL), T = 1000, seq 64.
* ``mid`` (under 15 minutes on 2 idle CPU cores): pool 512, M = 128 (126 for ZPL), T = 500.
* ``quick`` (under two minutes on 2 CPU cores): pool 256, M = 32, T = 200.

On CPU two passes of the whole encoder over the pool cost seconds, so ``quick`` and ``mid``
put the adapter on the top layer's feed-forward output kernel instead and cache everything below
it once (exact: the cached model reproduces the full model's logits, checked at start-up and
reported as ``top_cache_max_abs_diff``). A few hundred zeroth-order steps move such a model
only a little: expect accuracies close to the zero-shot row, and read differences of a point
or two between methods as noise (the test split has 512 examples). They are not the paper's
numbers. The ``probe_nonprivate`` row (a logistic-regression head fitted with exact gradients
on the pool's frozen features) shows what those features allow.

Cost ratios, measured in this run with the whole encoder on batch 32 x 64 tokens (the shape
of the MeZO-in-PyTorch anchor: 1.99x a forward pass with LoRA, 3.44x with all weights) and, in
``full`` mode, also on the pool (``*_pool``): ``step_over_forward`` = one ZO step (the
trainer's pure ZPL step, jitted with its state donated: θ + εz, two forward passes, the
release, the update) / one forward pass, with LoRA on query/value, as the median over adjacent
(step, forward) pairs of their wall-time ratio (``*_cpu``: process CPU time, which other jobs
on a shared machine do not stretch); ``step_over_forward_full`` the same with every weight
perturbed; ``mem_over_inference`` (LoRA) and ``mem_over_inference_full`` = the compiled step's
bytes / inference's, from XLA's buffer assignment (arguments + temporaries + outputs, less
donated aliases; both hold every weight, read or not). With all weights perturbed the step
needs inference memory plus one copy of θ (θ ± εz built from an untouched θ in the loop that
runs the two passes, one group of same-shaped draws at a time), so that ratio is about
1 + θ / inference: about 1.76 on the 32 x 64 batch, lower when activations are larger.
"""

from __future__ import annotations

import dataclasses
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
from pavejax.models.bert import gelu, mean_pool
from pavejax.paczero import ZOConfig, init, per_example_losses, step, step_key, train
from pavejax.privacy import fresh_key

DELTA = 1e-5
LORA = lora.LoraConfig(8, alpha=16)
TEMPERATURE = 20.0
PROMPTS = (("This movie is terrible.", "A bad, boring film.", "negative"),
           ("This movie is great.", "A good, wonderful film.", "positive"))
QV = ("attention/query/kernel", "attention/value/kernel")


def _top_path(params) -> str:
    """The last encoder layer's feed-forward output kernel (``encoder/layers/5/...`` on MiniLM)."""
    return f"encoder/layers/{len(params['encoder']['layers']) - 1}/output/kernel"


@dataclasses.dataclass(frozen=True)
class Mode:
    """Sizes of one benchmark mode (see the module docstring)."""

    pool: int
    subsets: int
    steps: int
    seq: int
    n_dev: int
    n_test: int
    adapter: str  # "top" (cached lower layers) or "qv" (whole encoder)
    microbatch: int | None
    lr: float  # η₀ for every method (linear decay)
    cost_on_pool: bool
    repeats: int


MODES = {
    "quick": Mode(256, 32, 200, 32, 128, 512, "top", None, 1e-2, False, 3),
    "mid": Mode(512, 128, 500, 32, 256, 512, "top", None, 1e-2, False, 5),
    "full": Mode(1000, 128, 1000, 64, 500, 1000, "qv", 125, 1e-3, True, 5),
}


def _tokens(tok, texts):
    t = tok(list(texts))
    return jnp.asarray(t.input_ids), jnp.asarray(t.attention_mask)


def _data(tok, split):
    ids, mask = _tokens(tok, split.inputs)
    return {"input_ids": ids, "attention_mask": mask,
            "label": jnp.asarray(np.asarray(split.labels), jnp.int32)}


def _zero_shot_head(graphdef, params, tok):
    """Head kernel (hidden, 2) from the class prompts' mean normalised features; bias 0."""
    features = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p).features(ids, mask))
    cols = []
    for prompts in PROMPTS:
        f = features(params, *_tokens(tok, prompts))
        cols.append(jnp.mean(f / jnp.linalg.norm(f, axis=-1, keepdims=True), axis=0))
    kernel = jnp.float32(TEMPERATURE) * jnp.stack(cols, axis=1)
    return {"dense": {"kernel": kernel, "bias": jnp.zeros((2,), jnp.float32)}}


def _layer_norm(x, p):
    # BERT's post-LN (two-pass variance, eps 1e-12), written rank-explicitly.
    lead = (1,) * (x.ndim - 1)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return ((x - mu) / jnp.sqrt(var + jnp.float32(1e-12)) * p["scale"].reshape(lead + (-1,))
            + p["bias"].reshape(lead + (-1,)))


def _qv_setup(graphdef, params, data):
    """LoRA on every query/value kernel; each forward runs the whole encoder."""
    B, A = lora.init_lora(jax.random.key(1), params, lambda p, _: p.endswith(QV), LORA)

    def logits(tr, fr, d):
        p = dict(fr["params"])
        p["head"] = tr["head"]
        model = nnx.merge(graphdef, lora.apply_lora(p, tr["B"], fr["A"], LORA))
        return model(d["input_ids"], d["attention_mask"])

    return {"B": B, "head": params["head"]}, {"params": params, "A": A}, logits, data


def _top_setup(graphdef, params, data):
    """LoRA on the top layer's feed-forward output kernel, everything below cached once.

    With W' = W + s·A·B the top layer's output is LN(pre + s·(ff·A)·B) where
    pre = h + ff·W + b and ff = GELU(intermediate(h)) do not depend on B: both are cached.
    """
    top = _top_path(params)
    last = len(params["encoder"]["layers"]) - 1
    B, A = lora.init_lora(jax.random.key(1), params, lambda p, _: p == top, LORA)

    @jax.jit
    def cache(params, A, d):  # weights as arguments: closed over, XLA would constant-fold them
        enc = nnx.merge(graphdef, params).encoder
        mask = d["attention_mask"] != 0
        h = enc.embeddings(d["input_ids"], jnp.zeros_like(d["input_ids"]))
        for layer in enc.layers[:-1]:
            h = layer(h, mask)
        h = enc.layers[-1].attention(h, mask)
        ff = gelu(enc.layers[-1].intermediate(h))
        return {"pre": h + enc.layers[-1].output(ff), "u": ff @ A[top],
                "mask": d["attention_mask"], "label": d["label"]}

    def cached(d):
        n = d["label"].shape[0]
        parts = [cache(params, A, jax.tree.map(lambda x, i=i: x[i:i + 128], d))
                 for i in range(0, n, 128)]
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)

    norm = params["encoder"]["layers"][last]["norm"]

    def logits(tr, fr, d):
        y = _layer_norm(d["pre"] + jnp.float32(LORA.scale) * (d["u"] @ tr["B"][top]), norm)
        head = tr["head"]["dense"]
        return mean_pool(y, d["mask"]) @ head["kernel"] + head["bias"][None, :]

    trainable = {"B": B, "head": params["head"]}
    # The cache must reproduce the full model: compare logits at a random B on a few examples.
    probe = jax.tree.map(lambda x: x[:8], data["test"])
    tr = {"B": {top: 0.02 * jax.random.normal(jax.random.key(2), B[top].shape)},
          "head": params["head"]}
    full = jax.jit(_qv_setup(graphdef, params, None)[2])
    ref = full(tr, {"params": params, "A": A}, probe)
    diff = float(jnp.max(jnp.abs(ref - logits(tr, None, cached(probe)))))
    return trainable, None, logits, {k: cached(v) for k, v in data.items()}, diff


def _probe_accuracy(params, data):
    """Test accuracy of a non-private logistic-regression head (exact gradients, scipy L-BFGS)
    on the cached top features at B = 0, L2 weight picked on dev: what the frozen features
    allow, for reading the zeroth-order rows (top adapter only)."""
    from scipy.optimize import minimize

    norm = params["encoder"]["layers"][len(params["encoder"]["layers"]) - 1]["norm"]

    def feats(d):
        return (np.asarray(mean_pool(_layer_norm(d["pre"], norm), d["mask"]), np.float64),
                np.asarray(d["label"]))

    (x, y), (xd, yd), (xt, yt) = (feats(data[k]) for k in ("pool", "dev", "test"))
    best = None
    for l2 in (1e-3, 1e-2, 1e-1):
        def objective(w, l2=l2):
            z = x @ w[:-1] + w[-1]
            return np.mean(np.logaddexp(0.0, z) - y * z) + 0.5 * l2 * w[:-1] @ w[:-1]

        w = minimize(objective, np.zeros(x.shape[1] + 1), method="L-BFGS-B").x
        dev = np.mean(((xd @ w[:-1] + w[-1]) > 0) == yd)
        if best is None or dev > best[0]:
            best = (dev, float(np.mean(((xt @ w[:-1] + w[-1]) > 0) == yt)))
    return best[1]


def _per_example(logits):
    def loss(tr, fr, ex):
        lg = logits(tr, fr, jax.tree.map(lambda x: x[None], ex))[0]
        return -jax.nn.log_softmax(lg.astype(jnp.float32))[ex["label"]]

    return loss


def _evaluators(logits, frozen, dev, test):
    @jax.jit
    def acc(tr, d):
        return jnp.mean((jnp.argmax(logits(tr, frozen, d), -1) == d["label"]).astype(jnp.float32))

    @jax.jit
    def dev_loss(tr, fr):  # the trainer passes the frozen weights as an argument
        lg = logits(tr, fr, dev).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), dev["label"][:, None], 1))

    return (lambda tr: float(acc(tr, test))), dev_loss


def _cells(mode: Mode):
    zpl_m = mode.subsets - 2 if mode.subsets >= 128 else mode.subsets
    dp = {"dp_batch_size": min(64, mode.pool // 4)}  # the paper's 64 (rate 0.064 of 1000)
    return [("mezo", "mezo", {}), ("dpzo_eps2", "dpzo", {"target_epsilon": 2.0, **dp}),
            ("dpzo_eps6", "dpzo", {"target_epsilon": 6.0, **dp}),
            ("mi033", "mi", {"mi_budget": 0.33}), ("mi068", "mi", {"mi_budget": 0.68}),
            ("zpl", "zpl", {"num_subsets": zpl_m})]


def _run_cell(mode, name, kind, extra, loss, trainable, frozen, pool, dev_loss, test_acc):
    kw = {"num_subsets": mode.subsets, **extra}
    cfg = ZOConfig(kind, steps=mode.steps, learning_rate=mode.lr, l2_clip=25.0,
                   microbatch_size=mode.microbatch, eval_every=max(mode.steps // 5, 1), **kw)
    t0 = time.perf_counter()
    state = init(cfg, trainable, mode.pool, key=fresh_key(), public_key=jax.random.key(42))
    st = train(cfg, loss, state, frozen, pool, dev_fn=dev_loss)
    best = st.best if st.best is not None else st.trainable
    # PACZero: the MI it charged; DP-ZO: the MI matched to its ε at the MIA level (δ = 1e-5);
    # MeZO is non-private (no bound).
    mi = {"mi": st.mi_used, "zpl": st.mi_used, "mezo": None}.get(kind)
    if kind == "dpzo":
        mi = epsilon_to_mi(extra["target_epsilon"], DELTA)
    return {"method": name, "test_acc": test_acc(best), "last_acc": test_acc(st.trainable),
            "best_step": st.best_step,
            "unanimity_rate": st.unanimity_rate if kind in ("mi", "zpl") else None,
            "mi_nats": mi, "mia_posterior": None if mi is None else mia_posterior_bound(mi),
            "mia_matched_eps": None if mi is None else mi_to_epsilon(mi, DELTA),
            "dp_eps": st.ledger.epsilon(DELTA) if kind == "dpzo" else None,
            "seconds": time.perf_counter() - t0}


def _cost(loss, trainable, frozen, batch, repeats, microbatch):
    """(step / forward wall time, the same in CPU time, step peak bytes / inference bytes).

    The step is the trainer's: the pure ZPL step (32 candidate subsets) jitted with its state
    donated; the forward is inference, the same per-example losses. Both are compiled ahead of
    time, which also gives their memory from XLA's buffer assignment."""
    n = batch["label"].shape[0]
    cfg = ZOConfig("zpl", steps=10**6, learning_rate=1e-7, perturbation_scale=1e-3,
                   l2_clip=25.0, num_subsets=32, microbatch_size=microbatch)
    state = init(cfg, jax.tree.map(jnp.copy, trainable), n, key=jax.random.key(1),
                 public_key=jax.random.key(0))
    one = jax.jit(lambda s, b, fr: step(cfg, loss, s, b, step_key(s), frozen=fr)[0],
                  donate_argnums=0).lower(state, batch, frozen).compile()
    # keep_unused: inference holds every weight, as the step does (it passes all of them into
    # its loop); pruned, a weight the forward never reads (MiniLM's pooler) would count as step
    # memory.
    forward = jax.jit(lambda tr, fr, b: per_example_losses(loss, tr, fr, b, microbatch),
                      keep_unused=True).lower(trainable, frozen, batch).compile()
    held = {"s": state}

    def zo_step():
        held["s"] = one(held["s"], batch, frozen)
        jax.block_until_ready(held["s"].trainable)

    def infer():
        jax.block_until_ready(forward(trainable, frozen, batch))

    ratio, cpu_ratio = _common.paired_ratio(zo_step, infer, repeats)
    return ratio, cpu_ratio, _common.compiled_bytes(one) / _common.compiled_bytes(forward)


def _costs(graphdef, params, tok, mode):
    """Cost ratios with the whole encoder (LoRA on query/value, then all weights)."""
    shapes = [("", 32, 64, None)]
    if mode.cost_on_pool:
        shapes.append(("_pool", mode.pool, mode.seq, mode.microbatch))
    task = load_task("movie", seed=1, max_train=max(s[1] for s in shapes))
    out = {}
    for suffix, n, seq, mb in shapes:
        _, tok_seq = load_minilm(max_length=seq)
        batch = _data(tok_seq, dataclasses.replace(
            task.train, inputs=task.train.inputs[:n], labels=task.train.labels[:n]))
        trainable, frozen, logits, _ = _qv_setup(graphdef, params, None)
        r, rc, m = _cost(_per_example(logits), trainable, frozen, batch, mode.repeats, mb)
        full_logits = lambda tr, fr, d: nnx.merge(graphdef, tr)(  # noqa: E731
            d["input_ids"], d["attention_mask"])
        rf, rfc, mf = _cost(_per_example(full_logits), params, None, batch, mode.repeats, mb)
        out.update({f"step_over_forward{suffix}": r, f"step_over_forward_full{suffix}": rf,
                    f"mem_over_inference{suffix}": m, f"mem_over_inference_full{suffix}": mf,
                    f"step_over_forward_cpu{suffix}": rc,
                    f"step_over_forward_full_cpu{suffix}": rfc})
    return out


def _mode_arg(p):
    p.add_argument("--mode", choices=sorted(MODES), default=None,
                   help="benchmark size (default: full, or quick with --quick)")


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=_mode_arg)
    name = args.mode or ("quick" if args.quick else "full")
    mode = MODES[name]
    t0 = time.perf_counter()
    encoder, tok = load_minilm(max_length=mode.seq)
    graphdef, state = nnx.split(TextClassifier(encoder, 2, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    params["head"] = _zero_shot_head(graphdef, params, tok)
    task = load_task("movie", seed=0, max_train=mode.pool, max_dev=mode.n_dev,
                     max_test=mode.n_test)
    data = {"pool": _data(tok, task.train), "dev": _data(tok, task.dev),
            "test": _data(tok, task.test)}
    config = {"model": "all-MiniLM-L6-v2", "task": "movie", "mode": name,
              **dataclasses.asdict(mode), "clip": 25.0, "eps": 1e-3, "delta": DELTA,
              "lora": {"rank": 8, "alpha": 16, "targets": list(QV) if mode.adapter == "qv"
                       else [_top_path(params)]}, "head": "zero-shot from class prompts, trainable",
              "temperature": TEMPERATURE, "dp_batch_size": min(64, mode.pool // 4)}
    if mode.adapter == "top":
        trainable, frozen, logits, data, diff = _top_setup(graphdef, params, data)
        config["top_cache_max_abs_diff"] = diff
    else:
        trainable, frozen, logits, data = _qv_setup(graphdef, params, data)
    loss = _per_example(logits)
    test_acc, dev_loss = _evaluators(logits, frozen, data["dev"], data["test"])
    config["setup_seconds"] = time.perf_counter() - t0
    rows = [_run_cell(mode, *cell, loss, trainable, frozen, data["pool"], dev_loss, test_acc)
            for cell in _cells(mode)]
    start = test_acc(trainable)
    rows.append({**dict.fromkeys(rows[0]), "method": "zero_shot", "test_acc": start,
                 "last_acc": start})
    if mode.adapter == "top":
        probe = _probe_accuracy(params, data)
        rows.append({**dict.fromkeys(rows[0]), "method": "probe_nonprivate", "test_acc": probe,
                     "last_acc": probe})
    by = {r["method"]: r for r in rows}
    summary = {"zpl_acc": by["zpl"]["test_acc"], "mezo_acc": by["mezo"]["test_acc"],
               "mi033_acc": by["mi033"]["test_acc"], "dpzo_eps2_acc": by["dpzo_eps2"]["test_acc"],
               "zero_shot_acc": by["zero_shot"]["test_acc"],
               "probe_acc": by.get("probe_nonprivate", {}).get("test_acc"),
               "unanimity_rate": by["zpl"]["unanimity_rate"],
               **_costs(graphdef, params, tok, mode)}
    config["total_seconds"] = time.perf_counter() - t0
    return _common.emit("paczero", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
