"""Every mechanism on a causal LM: per-example DP gradients (clipped sum, private gradient,
DP-SAM) against per-example loops of jax.grad with padding; MeZO, DP-ZO, PACZero-ZPL and -MI
steps on the prompted candidate loss and on -F1 of greedy generations (ZPL never reads the
secret); LM specs in a dock that identifies the matching LM learnware.

Compiling and tracing dominate: the model's weights are drawn on the host, one LoRA rank and one
pool size serve every test (split_lora's eager draws and the membership matrix compile once),
and the zeroth-order mechanisms share one compiled step."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from pavejax import paczero
from pavejax.lm import (
    AnswerTable,
    LMSpecBackbone,
    candidate_examples,
    candidate_loss_fn,
    candidate_predict,
    generation_f1_loss_fn,
    lora_predicate,
    score_candidates,
    split_full,
    split_lora,
    token_loss_fn,
)
from pavejax.lora import LoraConfig
from pavejax.merging.train import MergeTrainConfig, SamBatch, init_state, make_step
from pavejax.models.llama import LlamaConfig
from pavejax.pave.dock import Dock
from pavejax.pave.spec import SpecConfig
from pavejax.privacy import DPConfig, SamplingConfig, private_gradient
from tests.test_llama import random_llama

CFG = LlamaConfig.tiny(num_layers=1)
T = 8
GREAT, TERRIBLE = 6, 5  # candidate token ids (label 1, label 0)
LORA = LoraConfig(2)
POOL = 16  # the ZO pools' size


@pytest.fixture(scope="module")
def model():
    """LlamaLM's own initial distribution (weights N(0, 0.02^2), unit norm scales), drawn on
    the host."""
    return random_llama(CFG, seed=0, scale=0.02, norm_noise=0.0)


def prompts(seed, n, length=5):
    """Random prompts over ids 10..96, each holding marker 7 and/or 8 at random."""
    rng = np.random.default_rng(seed)
    out = rng.integers(10, CFG.vocab_size, (n, length))
    has7, has8 = rng.random(n) < 0.5, rng.random(n) < 0.5
    out[has7, rng.integers(0, length, n)[has7]] = 7
    pos8 = (rng.integers(0, length, n) + 1) % length
    out[has8, pos8[has8]] = 8
    return out.astype(np.int32), has7, has8


def candidate_pool(p):
    """(N, 2, T) right-padded prompt + candidate rows, option mask on the candidate."""
    n, length = p.shape
    ids = np.zeros((n, 2, T), np.int32)
    mask, option = np.zeros_like(ids), np.zeros_like(ids)
    for c, tok in enumerate((TERRIBLE, GREAT)):
        ids[:, c, :length], ids[:, c, length] = p, tok
        mask[:, c, :length + 1], option[:, c, length] = 1, 1
    return {"input_ids": ids, "attention_mask": mask, "option_mask": option}


@functools.cache
def jitted_grad(loss_fn):
    return jax.jit(jax.grad(loss_fn))


def per_example_grads(loss_fn, trainable, frozen, data):
    g = jitted_grad(loss_fn)
    data = jax.device_get(data)  # host slicing: no eager program per example
    n = jax.tree.leaves(data)[0].shape[0]
    return [g(trainable, frozen, jax.tree.map(lambda x, i=i: x[i], data)) for i in range(n)]


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


# --- per-example DP gradients -------------------------------------------------------------------


def test_private_gradient_of_the_token_loss_equals_a_per_example_loop(model):
    split, B, frozen = split_lora(model, jax.random.key(0), LORA, targets=("q", "v", "down"))
    rng = np.random.default_rng(0)
    B = {p: (0.1 * rng.standard_normal(b.shape)).astype(np.float32) for p, b in B.items()}
    ids = rng.integers(3, CFG.vocab_size, (6, T)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0   # left padded
    mask[2, 5:] = 0   # right padded
    loss_mask = np.zeros_like(ids)
    loss_mask[:, 4:] = 1  # only the last tokens count (an "answer")
    data = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    loss_fn = token_loss_fn(split)
    grads = per_example_grads(loss_fn, B, frozen, data)
    norms = np.array([np.linalg.norm(flat(g)) for g in grads])
    clip = float(np.median(norms))  # clipping binds for about half the examples
    expected = np.mean([flat(g) * min(1.0, clip / nrm) for g, nrm in zip(grads, norms)], axis=0)
    # every example, noise 0: the mean of the clipped per-example gradients
    cfg = DPConfig(clip, 0.0, SamplingConfig("full", 6))
    @jax.jit
    def dp_gradient(trainable, frozen, data, key):
        return private_gradient(loss_fn, trainable, frozen, data, key, cfg)

    grad, info = dp_gradient(B, frozen, data, jax.random.key(0))
    np.testing.assert_allclose(flat(grad), expected, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(info.norms, norms, rtol=1e-4)
    assert int(info.num_clipped) == int(np.sum(norms > clip)) > 0


def test_dp_sam_step_on_the_candidate_loss_equals_a_per_example_loop(model):
    split, tr, frozen = split_full(model, lora_predicate(("o", "down")))
    p, has7, _ = prompts(0, 6)
    data = candidate_examples(candidate_pool(p), has7.astype(np.int32))
    loss_fn = candidate_loss_fn(split)
    n = 6
    # "same" batch, noise 0, q = 1, SGD, no anchor: w - lr * g(w + e) with e = rho * a / |a|,
    # a and g the means of the clipped per-example gradients
    clip, rho, lr = 0.5, 0.05, 0.1
    mcfg = MergeTrainConfig(dataset_size=n, steps=1, mode="same", noise_multiplier=0.0,
                            l2_clip=clip, batch_size=n, learning_rate=lr, rho=rho, anchor=0.0,
                            optimizer="sgd")
    step = jax.jit(make_step(loss_fn, mcfg))
    state, charge, stats = step(init_state(tr, mcfg), SamBatch(data, frozen, tr),
                                jax.random.key(1))
    assert not bool(stats.overflow) and int(stats.num_nonfinite) == 0

    def clipped_mean(params):
        gs = [flat(g) for g in per_example_grads(loss_fn, params, frozen, data)]
        return np.mean([g * min(1.0, clip / np.linalg.norm(g)) for g in gs], axis=0)

    a = clipped_mean(tr)
    w0 = flat(tr)
    e = rho * a / np.linalg.norm(a)
    leaves, treedef = jax.tree.flatten(tr)
    sizes = np.cumsum([0] + [x.size for x in leaves])
    shifted = jax.tree.unflatten(treedef, [
        (w0 + e)[sizes[i]:sizes[i + 1]].reshape(x.shape).astype(np.float32)
        for i, x in enumerate(leaves)])
    np.testing.assert_allclose(flat(state.params), w0 - lr * clipped_mean(shifted), rtol=1e-5,
                               atol=1e-6)


# --- zeroth order: MeZO, DP-ZO, PACZero -------------------------------------------------------


ZPL = paczero.ZOConfig("zpl", steps=2, learning_rate=0.5, num_subsets=4, l2_clip=5.0)
MEZO = paczero.ZOConfig("mezo", steps=2, learning_rate=0.05, l2_clip=5.0)
DPZO = paczero.ZOConfig("dpzo", steps=2, learning_rate=0.5, l2_clip=5.0, target_epsilon=6.0,
                        dp_batch_size=8)
MI = paczero.ZOConfig("mi", steps=2, learning_rate=0.5, num_subsets=4, l2_clip=5.0,
                      mi_budget=0.33)


@pytest.fixture(scope="module")
def zo_runs(model):
    """Two steps of each zeroth-order mechanism on the prompted candidate loss, one compiled
    program for a step of all of them: ZPL on LoRA, MeZO on the full weights of the MLP (a
    selected subset of the weights is the trainable), DP-ZO on LoRA and PACZero-MI's device
    phase on LoRA (its host release and its update run between the calls). ZPL runs three
    times (secret 0; the same coins with secret 3; other coins): the calls of the two other
    runs recompute the other mechanisms' steps and drop them."""
    lora_split, B, lora_frozen = split_lora(model, jax.random.key(5), LORA, targets=("q", "v"))
    full_split, tr, full_frozen = split_full(model, lambda p, _: "/mlp/" in p)
    p, has7, _ = prompts(1, POOL)
    pool = candidate_examples(candidate_pool(p), has7.astype(np.int32))
    lora_loss, full_loss = candidate_loss_fn(lora_split), candidate_loss_fn(full_split)

    def init(cfg, params, key):
        return paczero.init(cfg, params, POOL, key=jax.random.key(key),
                            public_key=jax.random.key(100))

    zpl = [init(ZPL, B, 1)._replace(secret=jax.device_put(np.int32(0))),
           init(ZPL, B, 1)._replace(secret=jax.device_put(np.int32(3))), init(ZPL, B, 2)]
    mezo, dpzo, mi = init(MEZO, tr, 1), init(DPZO, B, 1), init(MI, B, 1)

    @jax.jit
    def zo_step(zpl, mezo, dpzo, mi, pool, lora_frozen, full_frozen):
        return (paczero.step(ZPL, lora_loss, zpl, pool, paczero.step_key(zpl),
                             frozen=lora_frozen)[0],
                paczero.step(MEZO, full_loss, mezo, pool, paczero.step_key(mezo),
                             frozen=full_frozen)[::2],
                paczero.step(DPZO, lora_loss, dpzo, pool, paczero.step_key(dpzo),
                             frozen=lora_frozen, noise_multiplier=1.0)[::2],
                paczero.mi_device_phase(MI, lora_loss, mi, pool, paczero.step_key(mi),
                                        frozen=lora_frozen))

    # jitted (the update regenerates the directions: eagerly, many small programs to compile)
    mi_apply = jax.jit(lambda s, values, unanimous: paczero.mi_apply(
        MI, s, paczero.MIRelease(values, unanimous, None, None)))
    host, mi_used = paczero.mi_init_host(MI.num_subsets), 0.0
    for _ in range(2):
        out = [zo_step(z, mezo, dpzo, mi, pool, lora_frozen, full_frozen) for z in zpl]
        zpl = [o[0] for o in out]
        (mezo, mezo_stats), (dpzo, dpzo_stats), signals = out[0][1:]
        host, release, nats = paczero.mi_host_release(MI, host, signals)
        mi = mi_apply(mi, release.values, release.unanimous)
        mi_used += nats
    return {"zpl": zpl, "mezo": (tr, mezo, mezo_stats), "dpzo": (dpzo, dpzo_stats),
            "mi": (mi, mi_used)}


def moved(trainable):
    return max(np.abs(np.asarray(b)).max() for b in trainable.values()) > 0


def test_zpl_moves_lora_and_never_reads_the_secret(zo_runs):
    a, b, c = zo_runs["zpl"]
    assert moved(a.trainable) and int(a.releases) == 2
    for p in a.trainable:
        np.testing.assert_array_equal(a.trainable[p], b.trainable[p])
    # other coins, another trajectory
    assert int(a.unanimous) == 2 or any(
        not np.array_equal(a.trainable[p], c.trainable[p]) for p in a.trainable)


def test_mezo_on_full_weights_and_dpzo_on_lora_move_their_params(zo_runs):
    tr, mezo, stats = zo_runs["mezo"]
    release = np.asarray(stats["release"])
    assert np.isfinite(release).all() and release[0] != 0
    assert all(not np.array_equal(mezo.trainable[p], tr[p]) for p in tr)
    dpzo, stats = zo_runs["dpzo"]
    assert moved(dpzo.trainable) and not bool(stats["overflow"])


def test_mi_two_phases_move_lora_within_budget(zo_runs):
    state, used = zo_runs["mi"]
    assert int(state.step) == 2 and moved(state.trainable) and 0.0 <= used <= 0.33 + 1e-12


def test_zpl_step_on_minus_f1_of_greedy_generations(model):
    split, B, frozen = split_lora(model, jax.random.key(6), LORA, targets=("down",))
    rng = np.random.default_rng(3)
    ids = rng.integers(4, CFG.vocab_size, (POOL, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::2, :2] = 0  # left padding
    table = AnswerTable([[f"w{i + 10}"] for i in range(POOL)],
                        lambda toks: " ".join(f"w{t}" for t in toks))
    loss_fn = generation_f1_loss_fn(split, table, max_new_tokens=3, pad_id=0, stop_tokens=(3,))
    pool = {"input_ids": ids, "attention_mask": mask,
            "example_id": np.arange(POOL, dtype=np.int32)}
    cfg = paczero.ZOConfig("zpl", steps=2, learning_rate=0.1, num_subsets=4,
                           perturbation_scale=0.5, microbatch_size=4)
    state = paczero.init(cfg, B, POOL, key=jax.random.key(1), public_key=jax.random.key(2))
    @jax.jit
    def f1_step(state):
        return paczero.step(cfg, loss_fn, state, pool, paczero.step_key(state),
                            frozen=frozen)[::2]

    state, stats = f1_step(state)
    assert int(state.step) == 1 and np.isfinite(np.asarray(stats["release"])).all()
    assert moved(state.trainable)


# --- PAVE specs of an LM and a dock of LM learnwares --------------------------------------------


# Two prompted tasks on the prompt's last token (ids 10..17, each equally often, so both tasks
# are balanced): "A" says great for 10..13, "B" for 10, 11, 14, 15 (they agree on half).
KEY_TOKENS = np.arange(10, 18)
POSITIVE = {"A": (10, 11, 12, 13), "B": (10, 11, 14, 15)}


def keyed_task(seed, n):
    rng = np.random.default_rng(seed)
    p = rng.integers(20, CFG.vocab_size, (n, 5)).astype(np.int32)
    p[:, -1] = rng.permutation(np.tile(KEY_TOKENS, n // len(KEY_TOKENS)))
    return candidate_pool(p), {k: np.isin(p[:, -1], v).astype(np.int32)
                               for k, v in POSITIVE.items()}


def developer(model, task, strength=10.0):
    """A developer's LM for ``task``: the backbone with the task written into its weights, each
    key token's embedding moved by +-strength (e[great] - e[terrible]) (its sign the token's
    label). The embedding is tied to the output layer, so after the last prompt token the
    residual stream points to " great" or " terrible". A stand-in for fine-tuning (which costs
    a compiled training program): the dock only ever sees the developer LM's predictions."""
    params = nnx.to_pure_dict(nnx.state(model))
    emb = np.array(params["embed"]["embedding"], np.float64)
    direction = emb[GREAT] - emb[TERRIBLE]
    for k in KEY_TOKENS:
        emb[k] += (strength if k in POSITIVE[task] else -strength) * direction
    params["embed"]["embedding"] = jax.device_put(emb.astype(np.float32))
    return nnx.merge(nnx.graphdef(model), params)


def test_dock_identifies_the_lm_learnware_of_the_users_task(model, tmp_path):
    batch, labels = keyed_task(10, 32)
    bb = LMSpecBackbone(model, "tiny-llama", targets=("v", "down"))
    cfg = SpecConfig.preset("quick", rank=8, steps=10, batch_size=16, learning_rate=1e-2,
                            progress=False)
    key = jax.random.key(0)  # the A key every party uses (fixed: a deterministic test)
    with Dock.create(tmp_path / "dock") as dock:
        for task in POSITIVE:
            dev = developer(model, task)
            scores = score_candidates(dev, batch)  # the developer LM's own predictions
            assert np.mean(np.asarray(candidate_predict(scores)) == labels[task]) > 0.9
            spec = bb.model_spec(batch, scores, key, cfg).spec
            assert spec.signature.backbone_id == "tiny-llama" and spec.kind == "model"
            dock.submit(spec, name=task)
        for seed, task in ((20, "A"), (21, "B")):
            shots, user_labels = keyed_task(seed, 16)
            user = bb.user_spec(shots, user_labels[task], key, cfg).spec
            found = dock.search(user, k=2)
            assert found.names[0] == task and found.cosines[0] > 0, (task, found)
