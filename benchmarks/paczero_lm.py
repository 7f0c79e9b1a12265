"""PACZero on a causal LM (SmolLM2-135M-Instruct): prompted movie sentiment and SQuAD F1, with
MeZO, DP-ZO, PACZero-MI/-ZPL, zero-shot and first-order DP-LoRA, all in one run.

The paper's Table 1 in spirit. Sentiment is posed as a prompt, ``"<sentence> It was"``, scored by
the two candidate next tokens ``" terrible"`` / ``" great"``; the per-example loss is the
cross-entropy over the two candidates' log-probabilities (the full-vocabulary normaliser cancels,
so only the two candidate rows of the output layer are computed). SQuAD uses the prompt
``"Title: ...\\nContext: ...\\nQuestion: ...\\nAnswer:"``, greedy generation cut at the first
newline, and the per-example loss -F1 (non-differentiable: only zeroth-order methods can use it).
Every method starts from the same pretrained weights; the best dev checkpoint is kept (dev loss
for sentiment, dev F1 for SQuAD), then the test split is scored once.

Rows: ``zero_shot`` (argmax of the two candidates); ``zero_shot_calibrated`` (the decision
threshold on the score difference chosen on the DEV split: zero-shot SmolLM2 says " great" for
almost every sentence, so raw zero-shot measures a bias); ``mezo`` (non-private); ``dpzo_eps2``,
``dpzo_eps6`` ((ε, 1e-5)-DP for one pool example replaced); ``mi033``, ``mi068`` (PACZero-MI at
0.33 / 0.68 nats); ``zpl`` (PACZero-ZPL, zero mutual information); ``dplora_eps6`` (first-order
DP-SGD with Adam on the LoRA adapter at ε = 6: what a user would otherwise pick). Two tracks, as
in the paper: rows without a suffix train full weights (the paper's headline "FT" setting: on
CPU every weight of the top feed-forward block, 2.65 M; in ``full`` mode every weight of the
model), rows ending in ``_lora`` train a LoRA factor (r = 8, α = 16; on CPU on the top
feed-forward down-projection, in ``full`` mode on q and v of every layer).
``mia_matched_eps`` turns each MI figure into the ε whose membership-inference success bound is
the same (δ = 1e-5); ``unanimity_rate`` is the share of PACZero steps whose candidate subsets
all agreed on the sign.

Modes (``--mode``; ``--quick`` is ``--mode quick``):

* ``full`` (sized for one GPU): LoRA r = 8, α = 16 on q and v of every layer, the whole model in
  every forward, pool 1000, M = 128 (126 for ZPL), T = 1000; SQuAD pool 1000 with 50 new tokens.
* ``mid`` (under 30 minutes on 2 CPU cores): pool 512, T = 500; SQuAD pool 32, T = 60.
* ``quick`` (a few minutes): pool 128, T = 100; SQuAD pool 8, T = 4.

On CPU ``quick`` and ``mid`` adapt the top layer only and cache what is frozen below it: the
first 29 blocks and the top block's attention are run once per sentence, at the last position
only, and a step computes the top feed-forward block (or its LoRA term) and the two candidate
rows. For SQuAD the prompt's key/value cache of every layer is built once (the adapted top
feed-forward block changes no key or value of a prompt token) and each step decodes the new
tokens through the whole model. Both shortcuts are exact: the cached paths reproduce the whole
model's logits, checked at start-up (``*_cache_max_abs_diff`` in the config).

Cost ratios, measured in the same run with the WHOLE model on a batch of 32 prompts x 64 tokens
and LoRA on q/v of every layer: ``step_over_forward`` = one ZPL step (two forward passes, the
release and the update, jitted with its state donated) / one forward pass (median over adjacent
pairs; ``*_cpu`` in process CPU time); ``mem_over_inference`` = the compiled step's bytes /
inference's (XLA buffer assignment: arguments + temporaries + outputs, less donated aliases).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pavejax import lora
from pavejax.accounting import Ledger, calibrate, gaussian_step_event, run_event
from pavejax.accounting.pac import epsilon_to_mi, mi_to_epsilon, mia_posterior_bound
from pavejax.paczero import ZOConfig, init, per_example_losses, step, step_key, train
from pavejax.privacy import DPConfig, DPGradient, SamplingConfig, fresh_key

DELTA = 1e-5
LORA = lora.LoraConfig(8, alpha=16, init="kaiming_uniform")
TEMPLATE = "{sentence} It was"
CANDIDATES = (" terrible", " great")
CLIP = 25.0


@dataclasses.dataclass(frozen=True)
class Mode:
    """Sizes of one benchmark mode (see the module docstring)."""

    pool: int
    subsets: int
    steps: int
    seq: int
    n_dev: int
    n_test: int
    track: str  # "top" (cached lower layers) or "whole"
    lr_lora: float
    lr_mlp: float
    microbatch: int | None
    dp_steps: int
    squad_pool: int
    squad_dev: int
    squad_test: int
    squad_steps: int
    squad_new_tokens: int
    squad_prompt_tokens: int
    squad_lr: float
    dp_lr: float
    repeats: int


MODES = {
    "quick": Mode(pool=128, subsets=32, steps=100, seq=48, n_dev=128, n_test=256, track="top",
                  lr_lora=0.3, lr_mlp=3e-3, microbatch=None, dp_steps=100, squad_pool=8,
                  squad_dev=8, squad_test=16, squad_steps=4, squad_new_tokens=6,
                  squad_prompt_tokens=128, squad_lr=3e-3, dp_lr=1e-2, repeats=2),
    "mid": Mode(pool=512, subsets=128, steps=500, seq=64, n_dev=256, n_test=1000, track="top",
                lr_lora=0.3, lr_mlp=3e-3, microbatch=None, dp_steps=500, squad_pool=32,
                squad_dev=24, squad_test=96, squad_steps=60, squad_new_tokens=10,
                squad_prompt_tokens=160, squad_lr=3e-3, dp_lr=1e-2, repeats=4),
    "full": Mode(pool=1000, subsets=128, steps=1000, seq=64, n_dev=500, n_test=1000,
                 track="whole", lr_lora=1e-2, lr_mlp=1e-4, microbatch=64, dp_steps=1000,
                 squad_pool=1000, squad_dev=100, squad_test=500, squad_steps=1000,
                 squad_new_tokens=50, squad_prompt_tokens=512, squad_lr=1e-2, dp_lr=1e-3,
                 repeats=5),
}


# --- model pieces ------------------------------------------------------------------------------


class LM:
    """The loaded model as (graphdef, params) plus the constants the benchmark needs."""

    def __init__(self, model, tokenizer):
        self.graphdef, state = nnx.split(model)
        self.params = nnx.to_pure_dict(state)
        self.config = model.config
        self.tok = tokenizer
        self.top = self.config.num_layers - 1
        self.cands = np.array([_single_token(tokenizer, c) for c in CANDIDATES], np.int32)

    def model(self, params=None):
        return nnx.merge(self.graphdef, self.params if params is None else params)


def _single_token(tok, text: str) -> int:
    ids = tok.encode(text)
    if len(ids) != 1:
        raise ValueError(f"candidate {text!r} is {len(ids)} tokens; this benchmark scores "
                         "single-token candidates")
    return int(ids[0])


def _encode(tok, texts: Sequence[str], length: int, side: str):
    ids, mask = tok.batch(list(texts), max_length=length, padding_side=side)
    return np.asarray(ids, np.int32), np.asarray(mask, np.int32)


def _batched(fn: Callable, arrays: dict[str, np.ndarray], size: int) -> np.ndarray:
    n = len(next(iter(arrays.values())))
    parts = []
    for i in range(0, n, size):
        chunk = {k: v[i:i + size] for k, v in arrays.items()}
        m = len(next(iter(chunk.values())))
        if m < size:  # pad to one compiled shape
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], size - m, 0)]) for k, v in
                     chunk.items()}
        parts.append(jax.tree.map(lambda x: np.asarray(x)[:m], fn(**chunk)))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


# --- sentiment ---------------------------------------------------------------------------------


def _sentiment_data(lm: LM, mode: Mode, seed: int = 0):
    from pavejax.data.prompts import PromptTemplate, load_prompted_sentiment

    task = load_prompted_sentiment("movie", n_train=mode.pool, n_dev=mode.n_dev,
                                   n_test=mode.n_test, seed=seed,
                                   template=PromptTemplate(TEMPLATE, CANDIDATES))
    out = {}
    for split in ("train", "dev", "test"):
        sentences, labels = task.sentences(split), task.labels(split)
        prompts = [task.template.format(s) for s in sentences]
        ids, mask = _encode(lm.tok, prompts, mode.seq, "right")
        out[split] = {"input_ids": ids, "attention_mask": mask,
                      "label": np.asarray(labels, np.int32)}
    return out


def _top_tracks(lm: LM, key):
    """CPU tracks on cached features (:mod:`pavejax.lm_cache`): the top feed-forward block's
    full weights, and LoRA on its down-projection. Each is (trainable, frozen, logits)."""
    from pavejax.lm_cache import TopDownLora, TopMLP

    model = lm.model()
    mlp = TopMLP.of(model)
    down = TopDownLora.of(model, LORA)
    b, a = lora.init_lora(key, lm.params, lambda p, _: p == down.path, LORA)
    return {"": (mlp.trainable(model), mlp.frozen(model, lm.cands), mlp.logits),
            "_lora": (b, down.frozen(model, a, lm.cands), down.logits)}


def _check_top_cache(lm: LM, data: dict, feats: dict, tracks: dict, k: int = 4) -> float:
    """Max |candidate logit| difference between each cached path (untrained) and the whole
    model on ``k`` prompts."""
    m = lm.model()
    ids, mask = data["input_ids"][:k], data["attention_mask"][:k]
    full = np.asarray(jax.jit(lambda i, a: m(i, a))(ids, mask))
    ref = full[np.arange(k), mask.sum(-1) - 1][:, lm.cands]
    ex = {name: v[:k] for name, v in feats.items()}
    return max(float(np.max(np.abs(ref - np.asarray(
        jax.vmap(logits, in_axes=(None, None, 0))(tr, fr, ex))))) for tr, fr, logits in
        tracks.values())


def _whole_track(lm: LM, key):
    """Full mode: LoRA on q and v of every layer, the whole model per example."""
    from pavejax.models.llama import causal_mask, positions_from_mask

    def pred(p, _):
        return p.endswith(("attn/q/kernel", "attn/v/kernel"))

    b, a = lora.init_lora(key, lm.params, pred, LORA)

    def logits(tr, fr, ex):
        m = lm.model(fr["params"])
        ids, mask = ex["input_ids"][None], ex["attention_mask"][None]
        pos, cm = positions_from_mask(mask), causal_mask(mask)
        last = (jnp.sum(mask, -1) - 1)[:, None]
        adapters = lora.LoraAdapters(tr, fr["A"], LORA)
        h = m.run_layers(m.embed_tokens(ids), pos, cm, lora=adapters, query_index=last)
        return m.logits(h[0, 0], rows=jnp.asarray(lm.cands))

    return b, {"A": a, "params": lm.params}, logits


def _whole_ft_track(lm: LM):
    """Full mode, full-weights track: every weight of the model is trained."""
    from pavejax.models.llama import causal_mask, positions_from_mask

    def logits(tr, fr, ex):
        m = lm.model(tr)
        ids, mask = ex["input_ids"][None], ex["attention_mask"][None]
        pos, cm = positions_from_mask(mask), causal_mask(mask)
        last = (jnp.sum(mask, -1) - 1)[:, None]
        h = m.run_layers(m.embed_tokens(ids), pos, cm, query_index=last)
        return m.logits(h[0, 0], rows=jnp.asarray(lm.cands))

    return lm.params, None, logits


def _ce(z, label):
    return -jax.nn.log_softmax(z.astype(jnp.float32))[label]


def _per_example(logits):
    return lambda tr, fr, ex: _ce(logits(tr, fr, ex), ex["label"])


def _evaluators(logits, frozen, dev, test):
    batched = jax.vmap(logits, in_axes=(None, None, 0))

    @jax.jit
    def acc(tr, d):
        return jnp.mean((jnp.argmax(batched(tr, frozen, d), -1) == d["label"]).astype(
            jnp.float32))

    @jax.jit
    def dev_loss(tr, fr):
        z = jax.vmap(logits, in_axes=(None, None, 0))(tr, fr, dev)
        return jnp.mean(jax.vmap(_ce)(z, dev["label"]))

    return (lambda tr: float(acc(tr, test))), dev_loss, jax.jit(
        lambda tr, d: batched(tr, frozen, d))


def _calibrated_accuracy(scores_dev, y_dev, scores_test, y_test) -> tuple[float, float]:
    """Accuracy on test of the threshold on s = z_great - z_terrible that is best on dev."""
    s_dev = scores_dev[:, 1] - scores_dev[:, 0]
    s_test = scores_test[:, 1] - scores_test[:, 0]
    cands = np.concatenate([[-np.inf], np.sort(s_dev)])
    dev_acc = [np.mean((s_dev > t) == y_dev) for t in cands]
    t = cands[int(np.argmax(dev_acc))]
    return float(np.mean((s_test > t) == y_test)), float(t)


def _cells(mode: Mode, suffix: str):
    zpl_m = mode.subsets - 2 if mode.subsets >= 128 else mode.subsets
    dp = {"dp_batch_size": min(64, mode.pool // 4)}  # the paper's 64 (rate 0.064 of 1000)
    return [(f"mezo{suffix}", "mezo", {}),
            (f"dpzo_eps2{suffix}", "dpzo", {"target_epsilon": 2.0, **dp}),
            (f"dpzo_eps6{suffix}", "dpzo", {"target_epsilon": 6.0, **dp}),
            (f"mi033{suffix}", "mi", {"mi_budget": 0.33}),
            (f"mi068{suffix}", "mi", {"mi_budget": 0.68}),
            (f"zpl{suffix}", "zpl", {"num_subsets": zpl_m})]


def _row(name, kind, extra, st, score_best, score_last, seconds, metric="test_acc"):
    mi = {"mi": st.mi_used, "zpl": st.mi_used, "mezo": None}.get(kind)
    if kind == "dpzo":
        mi = epsilon_to_mi(extra["target_epsilon"], DELTA)
    return {"method": name, metric: score_best, "last": score_last,
            "best_step": st.best_step,
            "unanimity_rate": st.unanimity_rate if kind in ("mi", "zpl") else None,
            "mi_nats": mi, "mia_posterior": None if mi is None else mia_posterior_bound(mi),
            "mia_matched_eps": None if mi is None else mi_to_epsilon(mi, DELTA),
            "dp_eps": st.ledger.epsilon(DELTA) if kind == "dpzo" else None,
            "seconds": seconds}


def _run_cell(mode, name, kind, extra, loss, trainable, frozen, pool, dev_fn, score, lr,
              steps, eval_every, microbatch):
    kw = {"num_subsets": mode.subsets, **extra}
    cfg = ZOConfig(kind, steps=steps, learning_rate=lr, l2_clip=CLIP,
                   microbatch_size=microbatch, eval_every=eval_every, **kw)
    t0 = time.perf_counter()
    state = init(cfg, trainable, len(pool["label"]) if "label" in pool else
                 len(next(iter(pool.values()))), key=fresh_key(),
                 public_key=jax.random.key(42))
    st = train(cfg, loss, state, frozen, pool, dev_fn=dev_fn, progress=True)
    best = st.best if st.best is not None else st.trainable
    return _row(name, kind, extra, st, score(best), score(st.trainable),
                time.perf_counter() - t0)


def _dp_lora(mode, loss, trainable, frozen, pool, dev_fn, score, lr):
    """First-order DP-SGD (Adam on the privatised mean gradient) at ε = 6 for one pool example
    replaced (PLD accountant; the RDP accountant has no replace-one analysis of Poisson
    sampling)."""
    n = len(pool["label"])
    batch = min(64, n // 4)
    sampling = SamplingConfig("poisson", dataset_size=n, batch_size=batch)
    z = calibrate(lambda s: run_event(gaussian_step_event(s, q=batch / n), mode.dp_steps),
                  6.0, DELTA, relation="replace_one", accountant="pld")
    dp = DPGradient(loss, DPConfig(l2_clip=1.0, noise_multiplier=z, sampling=sampling,
                                   relation="replace_one"))
    opt = optax.adam(lr)
    tr, opt_state = trainable, opt.init(trainable)
    ledger = Ledger("replace_one")
    key = fresh_key()
    update = jax.jit(lambda g, s, p: opt.update(g, s, p))
    best, best_dev = tr, float(dev_fn(tr, frozen))
    t0 = time.perf_counter()
    every = max(mode.dp_steps // 5, 1)
    for t in range(mode.dp_steps):
        grad, _, event = dp(tr, frozen, pool, jax.random.fold_in(key, t))
        ledger.record(event)
        upd, opt_state = update(grad, opt_state, tr)
        tr = optax.apply_updates(tr, upd)
        if (t + 1) % every == 0:
            d = float(dev_fn(tr, frozen))
            if d < best_dev:
                best, best_dev = tr, d
    eps = ledger.epsilon(DELTA)
    return {"method": "dplora_eps6", "test_acc": score(best), "last": score(tr),
            "best_step": None, "unanimity_rate": None, "mi_nats": epsilon_to_mi(6.0, DELTA),
            "mia_posterior": mia_posterior_bound(epsilon_to_mi(6.0, DELTA)),
            "mia_matched_eps": 6.0, "dp_eps": eps, "seconds": time.perf_counter() - t0,
            "noise_multiplier": z}


def sentiment(lm: LM, mode: Mode) -> tuple[list[dict], dict, dict]:
    """Every sentiment row, the summary entries and config facts."""
    data = _sentiment_data(lm, mode)
    info: dict[str, Any] = {}
    key = jax.random.key(7)  # the adapter's A (public here: no spec is released)
    if mode.track == "top":
        from pavejax.lm_cache import top_features

        t0 = time.perf_counter()
        feats = {s: {**top_features(lm.model(), data[s]["input_ids"],
                                    data[s]["attention_mask"]), "label": data[s]["label"]}
                 for s in data}
        info["top_cache_seconds"] = time.perf_counter() - t0
        top = _top_tracks(lm, key)
        info["top_cache_max_abs_diff"] = _check_top_cache(lm, data["test"], feats["test"], top)
        tracks = {"": (top[""], mode.lr_mlp), "_lora": (top["_lora"], mode.lr_lora)}
    else:
        feats = data
        tracks = {"": (_whole_ft_track(lm), mode.lr_mlp),
                  "_lora": (_whole_track(lm, key), mode.lr_lora)}
    rows = []
    for suffix, ((trainable, frozen, logits), lr) in tracks.items():
        loss = _per_example(logits)
        test_acc, dev_loss, scores = _evaluators(logits, frozen, feats["dev"], feats["test"])
        if not rows:  # both tracks start from the same pretrained model
            z_dev = np.asarray(scores(trainable, feats["dev"]))
            z_test = np.asarray(scores(trainable, feats["test"]))
            y_dev, y_test = feats["dev"]["label"], feats["test"]["label"]
            zero = float(np.mean(np.argmax(z_test, -1) == y_test))
            calibrated, threshold = _calibrated_accuracy(z_dev, y_dev, z_test, y_test)
            info.update(zero_shot_predicted_positive=float(np.mean(np.argmax(z_test, -1))),
                        calibration_threshold=threshold)
            rows.append({"method": "zero_shot", "test_acc": zero, "last": zero})
            rows.append({"method": "zero_shot_calibrated", "test_acc": calibrated,
                         "last": calibrated})
        for name, kind, extra in _cells(mode, suffix):
            rows.append(_run_cell(mode, name, kind, extra, loss, trainable, frozen,
                                  feats["train"], dev_loss, test_acc, lr, mode.steps,
                                  max(mode.steps // 10, 1), mode.microbatch))
            print(rows[-1], flush=True)
        if suffix == "_lora":
            rows.append(_dp_lora(mode, loss, trainable, frozen, feats["train"], dev_loss,
                                 test_acc, mode.dp_lr))
            print(rows[-1], flush=True)
    by = {r["method"]: r["test_acc"] for r in rows}
    summary = {"zero_shot_acc": by["zero_shot"],
               "zero_shot_calibrated_acc": by["zero_shot_calibrated"]}
    for suffix in tracks:
        for cell in ("mezo", "zpl", "mi033", "mi068", "dpzo_eps2", "dpzo_eps6"):
            summary[f"{cell}{suffix}_acc"] = by[f"{cell}{suffix}"]
    summary["dplora_eps6_acc"] = by["dplora_eps6"]
    summary["unanimity_rate"] = next(r["unanimity_rate"] for r in rows if r["method"] == "zpl")
    return rows, summary, info


# --- SQuAD -------------------------------------------------------------------------------------


def _squad_examples(lm: LM, mode: Mode, seed: int = 0):
    """Disjoint pool/dev/test questions whose prompt fits ``squad_prompt_tokens`` (shorter
    contexts only on CPU: the filter is on the prompt's length, nothing else)."""
    from pavejax.data.squad import load_squad, squad_prompt

    need = mode.squad_pool + mode.squad_dev + mode.squad_test
    keep = []
    for ex in load_squad(seed=seed, max_examples=min(20 * need, 10_000)):
        ids = lm.tok.encode(squad_prompt(ex))
        if len(ids) <= mode.squad_prompt_tokens:
            keep.append((ex, ids))
        if len(keep) == need:
            break
    if len(keep) < need:
        raise RuntimeError(f"only {len(keep)} SQuAD prompts fit {mode.squad_prompt_tokens} "
                           f"tokens; {need} needed")
    a, b = mode.squad_pool, mode.squad_pool + mode.squad_dev
    return {"train": keep[:a], "dev": keep[a:b], "test": keep[b:]}


def _prefill(lm: LM, mode: Mode, items, batch: int = 8) -> dict[str, np.ndarray]:
    """Per example: the whole model's key/value cache of its prompt without the last token
    (left-padded to one length), and that last token. Decoding starts by feeding it."""
    from pavejax.models.generate import init_cache

    slots = mode.squad_prompt_tokens - 1 + mode.squad_new_tokens
    width = mode.squad_prompt_tokens - 1
    ids = np.full((len(items), width), lm.tok.pad_id, np.int32)
    mask = np.zeros((len(items), width), np.int32)
    for i, (_, toks) in enumerate(items):
        body = toks[:-1]
        if body:
            ids[i, width - len(body):], mask[i, width - len(body):] = body, 1
    last = np.array([toks[-1] for _, toks in items], np.int32)

    @jax.jit
    def fill(params, input_ids, attention_mask):
        m = lm.model(params)
        cache = init_cache(m, input_ids.shape[0], slots)
        _, cache = m.forward_cached(input_ids, attention_mask, cache)
        # one row per example: (B, L, S, H, D) so that examples are the leading axis
        return {"k": jnp.swapaxes(cache.k, 0, 1), "v": jnp.swapaxes(cache.v, 0, 1),
                "valid": cache.valid, "next_position": cache.next_position}

    out = _batched(lambda **kw: fill(lm.params, **kw),
                   {"input_ids": ids, "attention_mask": mask}, batch)
    out["last"] = last
    out["qid"] = np.arange(len(items), dtype=np.int32)
    return out


def _with_top_mlp(params: dict, mlp: dict, top: int) -> dict:
    """``params`` with the top block's feed-forward kernels replaced by ``mlp``."""
    layers = dict(params["layers"])
    block = dict(layers[top])
    block["mlp"] = {k: {"kernel": v} for k, v in mlp.items()}
    layers[top] = block
    return {**params, "layers": layers}


def _greedy(lm: LM, mode: Mode):
    """Per-example greedy decoding from a prefilled cache, with the top feed-forward block's
    kernels ``mlp`` (the trainable weights of the SQuAD runs); jittable and vmappable."""
    from pavejax.models.generate import KVCache

    width = mode.squad_prompt_tokens - 1

    def run(mlp, params, ex):
        m = lm.model(_with_top_mlp(params, mlp, lm.top))
        cache = KVCache(k=ex["k"][:, None], v=ex["v"][:, None], valid=ex["valid"][None],
                        length=jnp.asarray(width, jnp.int32),
                        next_position=ex["next_position"][None])

        def body(i, carry):
            tok, cache, out = carry
            logits, cache = m.forward_cached(tok.reshape(1, 1), jnp.ones((1, 1), jnp.int32),
                                             cache)
            nxt = jnp.argmax(logits[0, -1]).astype(jnp.int32)
            return nxt, cache, out.at[i].set(nxt)

        out = jnp.zeros((mode.squad_new_tokens,), jnp.int32)
        _, _, out = jax.lax.fori_loop(0, mode.squad_new_tokens, body, (ex["last"], cache, out))
        return out

    return run


def _lengths(tokens, eos: int):
    """Generated tokens before the first end-of-sequence id: (..., L) -> (...) int32."""
    hit = tokens == eos
    return jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), tokens.shape[-1]).astype(jnp.int32)


def _f1(table, tokens, qid, eos: int):
    """F1 of each greedy answer against its gold answers (host side, through a callback)."""
    return jax.pure_callback(table.scores, jax.ShapeDtypeStruct(qid.shape, jnp.float32),
                             tokens, _lengths(tokens, eos), qid, vmap_method="broadcast_all")


def _check_squad_cache(lm: LM, mode: Mode, items, cached: dict, mlp: dict) -> bool:
    """The cached decoding path gives the same greedy tokens as :func:`generate` re-running the
    whole model on the full prompt, for two examples and perturbed top feed-forward weights."""
    from pavejax.models.generate import generate

    keys = jax.random.split(jax.random.key(3), len(mlp))
    moved = {k: w + 0.2 * jnp.std(w) * jax.random.normal(kk, w.shape)
             for (k, w), kk in zip(sorted(mlp.items()), keys)}
    run = jax.jit(jax.vmap(_greedy(lm, mode), in_axes=(None, None, 0)))
    two = {k: v[:2] for k, v in cached.items()}
    got = np.asarray(run(moved, lm.params, two))
    whole = lm.model(_with_top_mlp(lm.params, moved, lm.top))
    width = mode.squad_prompt_tokens
    ids = np.stack([np.pad(np.asarray(t, np.int32), (width - len(t), 0),
                           constant_values=lm.tok.pad_id) for _, t in items[:2]])
    mask = np.stack([np.pad(np.ones(len(t), np.int32), (width - len(t), 0))
                     for _, t in items[:2]])
    ref = generate(whole, jnp.asarray(ids), jnp.asarray(mask),
                   max_new_tokens=mode.squad_new_tokens, pad_id=lm.tok.pad_id)
    return bool(np.array_equal(got, np.asarray(ref.tokens)))


def squad(lm: LM, mode: Mode) -> tuple[list[dict], dict, dict]:
    """SQuAD rows (zero-shot, MeZO, ZPL on the top feed-forward block's weights), summary."""
    items = _squad_examples(lm, mode)
    t0 = time.perf_counter()
    cached = {s: _prefill(lm, mode, items[s]) for s in items}
    info = {"squad_prefill_seconds": time.perf_counter() - t0}
    mlp0 = {k: jnp.asarray(v["kernel"]) for k, v in lm.params["layers"][lm.top]["mlp"].items()}
    info["squad_cache_tokens_equal"] = _check_squad_cache(lm, mode, items["test"],
                                                          cached["test"], mlp0)
    from pavejax.data.squad import answer_text
    from pavejax.lm import AnswerTable

    tables = {s: AnswerTable([ex.answers for ex, _ in items[s]], lm.tok.decode) for s in items}
    eos = lm.tok.eos_id
    greedy = _greedy(lm, mode)
    batched = jax.vmap(greedy, in_axes=(None, None, 0))

    def loss(tr, fr, ex):  # -F1 of the greedy answer, one example
        return -_f1(tables["train"], greedy(tr, fr["params"], ex), ex["qid"], eos)

    dev_fn = jax.jit(lambda tr, fr: -jnp.mean(
        _f1(tables["dev"], batched(tr, fr["params"], fr["dev"]), fr["dev"]["qid"], eos)))
    test_tokens = jax.jit(batched)
    frozen = {"params": lm.params, "dev": cached["dev"]}

    def score(tr):
        toks = _batched(lambda **d: test_tokens(tr, lm.params, d), cached["test"], 16)
        f1 = tables["test"].scores(toks, np.asarray(_lengths(toks, eos)), cached["test"]["qid"])
        return float(np.mean(f1)), toks

    zero, toks = score(mlp0)
    n = np.asarray(_lengths(toks, eos))
    info["squad_zero_shot_examples"] = [[answer_text(lm.tok.decode(toks[i][:n[i]])),
                                         items["test"][i][0].answers[0]] for i in range(4)]
    rows = [{"method": "squad_zero_shot", "test_f1": zero, "last": zero}]
    m = min(mode.subsets, mode.squad_pool)
    for name, kind, extra in (("squad_mezo", "mezo", {}),
                              ("squad_zpl", "zpl", {"num_subsets": m - 2 if m >= 128 else m})):
        cfg = ZOConfig(kind, steps=mode.squad_steps, learning_rate=mode.squad_lr, l2_clip=CLIP,
                       eval_every=max(mode.squad_steps // 6, 1), **{"num_subsets": m, **extra})
        t1 = time.perf_counter()
        state = init(cfg, mlp0, mode.squad_pool, key=fresh_key(), public_key=jax.random.key(43))
        st = train(cfg, loss, state, frozen, cached["train"], dev_fn=dev_fn, progress=True)
        best = st.best if st.best is not None else st.trainable
        row = _row(name, kind, extra, st, score(best)[0], score(st.trainable)[0],
                   time.perf_counter() - t1, metric="test_f1")
        rows.append(row)
        print(row, flush=True)
    by = {r["method"]: r for r in rows}
    summary = {"squad_zero_shot_f1": zero, "squad_mezo_f1": by["squad_mezo"]["test_f1"],
               "squad_zpl_f1": by["squad_zpl"]["test_f1"]}
    return rows, summary, info


# --- cost of a zeroth-order step on the whole model -------------------------------------------


def costs(lm: LM, mode: Mode) -> dict[str, float]:
    """ZO step / forward time and memory with the whole model (LoRA q/v on every layer)."""
    from pavejax.data.prompts import load_prompted_sentiment

    task = load_prompted_sentiment("movie", n_train=32, n_dev=2, n_test=2, seed=1)
    prompts = [TEMPLATE.format(sentence=s) for s in task.sentences("train")]
    ids, mask = _encode(lm.tok, prompts, 64, "right")
    batch = {"input_ids": ids, "attention_mask": mask,
             "label": np.asarray(task.labels("train"), np.int32)}
    trainable, frozen, logits = _whole_track(lm, jax.random.key(7))
    loss = _per_example(logits)
    cfg = ZOConfig("zpl", steps=10**6, learning_rate=1e-7, l2_clip=CLIP, num_subsets=32)
    state = init(cfg, jax.tree.map(jnp.copy, trainable), 32, key=jax.random.key(1),
                 public_key=jax.random.key(0))
    one = jax.jit(lambda s, b, fr: step(cfg, loss, s, b, step_key(s), frozen=fr)[0],
                  donate_argnums=0).lower(state, batch, frozen).compile()
    forward = jax.jit(lambda tr, fr, b: per_example_losses(loss, tr, fr, b),
                      keep_unused=True).lower(trainable, frozen, batch).compile()
    held = {"s": state}

    def zo_step():
        held["s"] = one(held["s"], batch, frozen)
        jax.block_until_ready(held["s"].trainable)

    def infer():
        jax.block_until_ready(forward(trainable, frozen, batch))

    ratio, cpu_ratio = _common.paired_ratio(zo_step, infer, mode.repeats)
    return {"step_over_forward": ratio, "step_over_forward_cpu": cpu_ratio,
            "mem_over_inference": _common.compiled_bytes(one) / _common.compiled_bytes(forward)}


# --- main --------------------------------------------------------------------------------------


def _mode_arg(p):
    p.add_argument("--mode", choices=sorted(MODES), default=None,
                   help="benchmark size (default: full, or quick with --quick)")
    p.add_argument("--mid", action="store_true", help="same as --mode mid")
    p.add_argument("--skip", nargs="*", default=(), choices=("sentiment", "squad", "costs"),
                   help="leave parts out (their summary keys are then absent)")


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=_mode_arg)
    name = args.mode or ("mid" if args.mid else "quick" if args.quick else "full")
    mode = MODES[name]
    t0 = time.perf_counter()
    from pavejax.models.llama_loading import load_smollm2

    model, tok = load_smollm2()
    lm = LM(model, tok)
    config: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)", "mode": name,
        **dataclasses.asdict(mode), "clip": CLIP, "perturbation_scale": 1e-3, "delta": DELTA,
        "template": TEMPLATE, "candidates": list(CANDIDATES),
        "lora": {"rank": LORA.rank, "alpha": LORA.alpha, "init": LORA.init,
                 "targets": "q, v of every layer" if mode.track == "whole"
                 else f"layers/{lm.top}/mlp/down/kernel"}}
    rows: list[dict] = []
    summary: dict[str, Any] = {}
    parts = [("sentiment", sentiment), ("squad", squad),
             ("costs", lambda lm, mode: ([], costs(lm, mode), {}))]
    for part, fn in parts:
        if part in args.skip:
            continue
        t1 = time.perf_counter()
        r, s, info = fn(lm, mode)
        rows += r
        summary.update(s)
        config.update(info)
        config[f"{part}_seconds"] = time.perf_counter() - t1
        print(f"[{part}] {time.perf_counter() - t1:.0f} s: {s}", flush=True)
    config["total_seconds"] = time.perf_counter() - t0
    columns = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{c: r.get(c) for c in columns} for r in rows]
    return _common.emit("paczero_lm", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
