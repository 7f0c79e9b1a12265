"""Step time of the DP-S-PAVE, DP-SAM and PACZero steps on 1, 2, 4 and 8 devices.

Every trainer trains LoRA factors ``B`` (query and value, rank 8) of a BERT text classifier.
The batch (PACZero: the candidate pool) is sharded over a 1-D ``'data'`` mesh and the
parameters are replicated: DP-S-PAVE and DP-SAM clip per example on each device and join the
clipped sums with one ``psum`` before adding noise once; PACZero's forward passes are split by
GSPMD. One device is the unsharded program (``mesh=None``). All configurations are timed
alternately in one process (medians), and each row reports how far its parameters, after the
same steps with the same keys, are from the one-device run (float summation order only).

Summary: ``max_overhead_8dev`` (step time on 8 devices / 1 device, worst trainer) and the
per-trainer ratios.

2-D meshes (rows ``dp-sgd-fsdp``): DP-SGD of *all* the classifier's parameters on
``(data, model)`` meshes of 2x4 and 4x2 devices (:func:`pavejax.privacy.model_mesh`), the batch
sharded over ``data`` and every parameter of at least 1024 elements sharded over ``model``
(:func:`pavejax.privacy.fsdp_specs`; :func:`pavejax.privacy.sharded_private_gradient`), against
the one-device :func:`pavejax.privacy.private_gradient` with the same keys. Summary keys
``mesh_2x4_ratio_vs_1dev`` / ``mesh_4x2_ratio_vs_1dev`` (step time over one device) and
``mesh_2x4_max_abs_diff`` / ``mesh_4x2_max_abs_diff`` (parameters after the same steps: an
equality check, float summation order only).

On CPU the devices are virtual (``--xla_force_host_platform_device_count=8``, set here before
JAX starts) and share the same cores, so this measures correctness and the overhead of
sharding, not a speed-up. ``--quick`` (a 1-layer, hidden-32 BERT on random tokens, batch 16)
finishes in about two minutes on 2 CPU cores; the full mode (all-MiniLM-L6-v2 on real movie
reviews, expected batch 64 of 128 tokens) is sized for accelerators.

Running the same on a GPU or TPU pod (see also ``docs/scaling.md``):

* One host with several GPUs: run the script unchanged; ``jax.devices()`` lists the GPUs and
  the meshes use the first 1, 2, 4, 8 of them (the virtual-CPU flag is ignored by GPU/TPU).
* Several hosts: start the same command on every host, after calling
  ``pavejax.distributed.initialize(coordinator_address, num_processes, process_id)`` (no
  arguments on TPU pods, SLURM or Open MPI: auto-detected). Build the mesh over all processes
  with ``pavejax.distributed.global_mesh()`` and feed each host's rows with
  ``pavejax.distributed.global_batch``; every trainer takes that mesh as ``mesh=``.
* What changes: nothing in the trainers. Keep the batch a multiple of the device count (the
  trainers pad and mask otherwise), generate noise from the replicated key (they do), and
  expect the ratio to fall below 1 once per-device work outweighs the ``psum``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from pavejax import lora, paczero, privacy  # noqa: E402
from pavejax.merging import train as mt  # noqa: E402
from pavejax.models import BertConfig, BertEncoder, TextClassifier  # noqa: E402
from pavejax.optim import promotion_safe  # noqa: E402

TRAINERS = ("dp-s-pave", "dp-sam", "paczero")
CLIP, SIGMA, RANK = 0.1, 1.0, 8
MESHES_2D = ((2, 4), (4, 2))  # (data, model)
FSDP_LR = 0.05


def _model(quick: bool, batch: int, seq: int, n: int):
    """(graphdef, params, data with n examples) of a 2-label BERT classifier."""
    if quick:
        cfg = BertConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4,
                         intermediate_size=64, max_position=64)
        encoder = BertEncoder(cfg, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(0)
        ids = rng.integers(1, cfg.vocab_size, size=(n, seq)).astype(np.int32)
        data = {"input_ids": ids, "attention_mask": np.ones((n, seq), np.int32),
                "label": rng.integers(0, 2, size=n).astype(np.int32)}
    else:
        from pavejax.data import load_task
        from pavejax.models import load_minilm

        encoder, tok = load_minilm(max_length=seq)
        task = load_task("movie", max_train=n)
        toks = tok(list(task.train.inputs[:n]))
        data = {"input_ids": np.asarray(toks.input_ids),
                "attention_mask": np.asarray(toks.attention_mask),
                "label": np.asarray(task.train.labels[:n], np.int32)}
    graphdef, state = nnx.split(TextClassifier(encoder, 2, rngs=nnx.Rngs(0)))
    return graphdef, nnx.to_pure_dict(state), jax.tree.map(jnp.asarray, data)


def _loss_fn(graphdef, lcfg):
    def example_loss(B, frozen, ex):
        params, A = frozen
        p = lora.apply_lora(params, B, A, lcfg)
        logits = nnx.merge(graphdef, p)(ex["input_ids"], ex["attention_mask"])
        return -jax.nn.log_softmax(logits.astype(jnp.float32))[ex["label"]]

    return example_loss


def _pave_runner(loss, B0, frozen, data, batch, mesh):
    n = data["label"].shape[0]
    dp = privacy.DPGradient(loss, privacy.DPConfig(
        CLIP, SIGMA, privacy.SamplingConfig("poisson", n, batch), relation="replace_one"),
        mesh=mesh)
    opt = promotion_safe(optax.adam(1e-3))

    @jax.jit
    def update(b, grad, opt_state):
        updates, opt_state = opt.update(grad, opt_state, b)
        return optax.apply_updates(b, updates), opt_state

    st = {"B": B0, "opt": opt.init(B0), "t": 0}

    def step():
        grad, _, _ = dp(st["B"], frozen, data, jax.random.fold_in(jax.random.key(1), st["t"]))
        st["B"], st["opt"] = update(st["B"], grad, st["opt"])
        st["t"] += 1
        jax.block_until_ready(st["B"])

    return step, lambda: st["B"]


def _sam_runner(loss, B0, frozen, data, batch, mesh):
    n = data["label"].shape[0]
    cfg = mt.MergeTrainConfig(dataset_size=n, steps=1, mode="same", noise_multiplier=SIGMA,
                              batch_size=batch, l2_clip=CLIP, learning_rate=1e-3)
    step_fn = jax.jit(mt.make_step(loss, cfg, mesh=mesh))  # samples its batch inside
    state, batch = mt.init_state(B0, cfg), mt.SamBatch(data, frozen, B0)
    if mesh is not None:
        state, batch = privacy.replicate((state, batch), mesh)
    st = {"s": state, "t": 0}

    def step():
        key = jax.random.fold_in(jax.random.key(2), st["t"])
        st["s"], _, stats = step_fn(st["s"], batch, key)
        privacy.check_step(stats)  # waits for the step, like the other trainers' runners
        st["t"] += 1
        jax.block_until_ready(st["s"].params)

    return step, lambda: st["s"].params


def _zo_runner(loss, B0, frozen, data, pool_size, mesh):
    pool = jax.tree.map(lambda x: x[:pool_size], data)
    cfg = paczero.ZOConfig("zpl", steps=10_000, learning_rate=1e-4, l2_clip=CLIP, num_subsets=16)
    state = paczero.init(cfg, B0, pool_size, key=jax.random.key(1), public_key=jax.random.key(0))
    if mesh is not None:
        pool = privacy.shard_batch(pool, mesh)
    # the trainer's step: the pure ZPL step, its key from the state
    step_fn = jax.jit(lambda s, p, fr: paczero.step(cfg, loss, s, p, paczero.step_key(s),
                                                    frozen=fr)[0])
    st = {"s": state}

    def step():
        st["s"] = step_fn(st["s"], pool, frozen)
        jax.block_until_ready(st["s"].trainable)

    return step, lambda: st["s"].trainable


def _full_loss(graphdef):
    """Per-example loss of the whole classifier (every parameter trainable, nothing frozen)."""
    def example_loss(params, frozen, ex):
        del frozen
        logits = nnx.merge(graphdef, params)(ex["input_ids"][None], ex["attention_mask"][None])
        return -jax.nn.log_softmax(logits[0].astype(jnp.float32))[ex["label"]]

    return example_loss


def _fsdp_runner(loss, params0, data, batch, mesh):
    """Private SGD on all parameters: one device (``mesh=None``) or parameter-sharded."""
    n = data["label"].shape[0]
    cfg = privacy.DPConfig(CLIP, SIGMA, privacy.SamplingConfig("poisson", n, batch),
                           relation="replace_one")
    if mesh is None:
        grad_fn = lambda p, d, k: privacy.private_gradient(loss, p, None, d, k, cfg)  # noqa: E731
    else:
        specs = privacy.fsdp_specs(params0, mesh)
        params0 = privacy.shard_params(params0, mesh, specs)
        data = privacy.replicate(data, mesh)  # sampled inside the step, rows sharded there
        grad_fn = lambda p, d, k: privacy.sharded_private_gradient(  # noqa: E731
            loss, p, None, d, k, cfg, mesh, param_specs=specs)

    @jax.jit
    def update(p, d, key):
        grad, info = grad_fn(p, d, key)
        return jax.tree.map(lambda w, g: w - FSDP_LR * g, p, grad), info

    st = {"p": params0, "t": 0}

    def step():
        st["p"], info = update(st["p"], data, jax.random.fold_in(jax.random.key(4), st["t"]))
        privacy.check_step(info)
        st["t"] += 1
        jax.block_until_ready(st["p"])

    return step, lambda: st["p"]


def _max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(argv=None):
    args = _common.parse_args(__doc__.splitlines()[0], argv)
    batch, seq, repeats = (16, 16, 5) if args.quick else (64, 128, 20)
    n_data = 4 * batch
    counts = [c for c in (1, 2, 4, 8) if c <= len(jax.devices())]
    graphdef, params, data = _model(args.quick, batch, seq, n_data)
    lcfg = lora.LoraConfig(RANK)
    B0, A = lora.init_lora(jax.random.key(3), params, lambda p, _: p.endswith(
        ("attention/query/kernel", "attention/value/kernel")), lcfg)
    B0 = jax.tree.map(lambda b: b + 0.01, B0)  # away from zero: every gradient path is live
    loss, frozen = _loss_fn(graphdef, lcfg), (params, A)
    runners, finals = {}, {}
    for c in counts:
        mesh = None if c == 1 else privacy.data_mesh(c)
        # Parameters live replicated on the mesh from the start, as the trainers place them.
        b0, fr = (B0, frozen) if mesh is None else privacy.replicate((B0, frozen), mesh)
        for name, make, size in (("dp-s-pave", _pave_runner, batch),
                                 ("dp-sam", _sam_runner, batch),
                                 ("paczero", _zo_runner, batch)):
            runners[(name, c)], finals[(name, c)] = make(loss, b0, fr, data, size, mesh)
    full_loss = _full_loss(graphdef)
    layouts = [(1, 1)] + [m for m in MESHES_2D if m[0] * m[1] <= len(jax.devices())]
    for d, m in layouts:
        mesh = None if d * m == 1 else privacy.model_mesh(d, m)
        runners[("dp-sgd-fsdp", (d, m))], finals[("dp-sgd-fsdp", (d, m))] = _fsdp_runner(
            full_loss, params, data, batch, mesh)
    # Compile (first step of every configuration) in parallel threads: XLA releases the GIL.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda run: run(), runners.values()))
    times = _common.interleaved_medians(runners, repeats=repeats, warmup=1)
    rows = []
    for name in TRAINERS:
        for c in counts:
            rows.append({"trainer": name, "devices": c, "mesh": f"data {c}",
                         "step_s": times[(name, c)],
                         "ratio_vs_1dev": times[(name, c)] / times[(name, 1)],
                         "max_abs_diff_vs_1dev": _max_diff(finals[(name, c)](),
                                                           finals[(name, 1)]())})
    fsdp = {}
    for d, m in layouts:
        key, base = ("dp-sgd-fsdp", (d, m)), ("dp-sgd-fsdp", (1, 1))
        rows.append({"trainer": "dp-sgd-fsdp", "devices": d * m, "mesh": f"data {d} x model {m}",
                     "step_s": times[key], "ratio_vs_1dev": times[key] / times[base],
                     "max_abs_diff_vs_1dev": _max_diff(finals[key](), finals[base]())})
        if d * m > 1:
            fsdp[f"mesh_{d}x{m}_ratio_vs_1dev"] = rows[-1]["ratio_vs_1dev"]
            fsdp[f"mesh_{d}x{m}_max_abs_diff"] = rows[-1]["max_abs_diff_vs_1dev"]
    # how far one device's parameters moved: the equality check is not between two no-ops
    fsdp["fsdp_param_change_1dev"] = _max_diff(finals[("dp-sgd-fsdp", (1, 1))](), params)
    top = max(counts)
    per = {f"{name}_overhead_{top}dev": times[(name, top)] / times[(name, 1)]
           for name in TRAINERS}
    summary = {"max_overhead_8dev": max(per.values()) if top == 8 else None,
               "largest_device_count": top, "max_overhead_largest": max(per.values()), **per,
               "max_abs_diff_vs_1dev": max(r["max_abs_diff_vs_1dev"] for r in rows), **fsdp}
    config = {"model": "bert-tiny-1layer (random)" if args.quick else "all-MiniLM-L6-v2",
              "batch": batch, "seq_len": seq, "dataset_size": n_data, "lora_rank": RANK,
              "l2_clip": CLIP, "noise_multiplier": SIGMA, "paczero": "zpl, 16 subsets, pool "
              f"{batch}", "device_counts": counts, "repeats": repeats, "quick": args.quick,
              "fsdp": f"DP-SGD of all parameters, lr {FSDP_LR}, meshes (data, model) "
              f"{[m for m in layouts if m != (1, 1)]}, fsdp_specs min_size 1024"}
    return _common.emit("scaling", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
