"""``pavejax adapt``: zeroth-order adaptation of a model release on a private task.

The task's training split is the private pool; PACZero (:mod:`pavejax.paczero`) releases one
sign per step that is unanimous over the secret candidate subsets of the pool or a fair coin
(ZPL: zero mutual information), or a budgeted noisy sign (MI). MeZO (non-private) and DP-ZO
(Gaussian noise on clipped per-example differences) are the baselines. Model selection reads
the task's dev split, which lies outside the pool. With ``--lm`` the model is a causal language
model adapted on a prompted task and the output an LM adapter release
(:mod:`pavejax.commands.adapt_lm`).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from pavejax.commands import _shared as sh, _zo, adapt_lm

MECHANISMS = {
    "zpl": "PACZero-ZPL: zero mutual information between the secret candidate subset and "
           "everything released (certified PAC privacy: an example's membership posterior stays "
           "at the prior 1/2); the pool's content itself is not protected",
    "mi": "PACZero-MI: at most --mi-budget nats of mutual information between the secret "
          "candidate subset and the releases (chain rule over steps)",
    "mezo": "MeZO: exact pool-mean directional derivatives, NOT private (baseline)",
    "dpzo": "DP-ZO: Gaussian noise on the clipped sum of per-example differences, Poisson "
            "sampling; (--epsilon, --delta)-DP for one pool example replaced (the pool size is "
            "public)",
}

DESCRIPTION = (
    "Adapt a model release on the private training split of TASK with zeroth-order steps and "
    "write a model release with the ledger of this adaptation. Privacy (zpl, mi): PACZero "
    "protects each pool example's membership in a secret candidate subset, not the pool's "
    "content. The pool (the training split of TASK) is split into M candidate subsets, each "
    "example in exactly half of them; one subset is drawn in secret and the releases depend on "
    "it only through what the guarantee allows. The PAC guarantee bounds the mutual "
    "information (nats) between that secret subset and the release plus every update along "
    "the way, against an adversary assumed to know the whole pool and the subsets: whether a "
    "given example was in the secret subset (prior 1/2) stays hidden up to the posterior "
    "bound. ZPL's unanimous signs are a deterministic function of the whole pool, so what the "
    "pool contains is NOT protected. dpzo instead is (epsilon, delta)-DP for one pool example "
    "replaced (the pool size is public). The dev split used for model selection and the test "
    "split "
    "used for the reported accuracy are read without noise and are not covered. The input "
    "model's own guarantee (on its developers' data) is copied into the release as upstream. "
    "The secret index and the mechanism key (coins, noise, samples) come from the OS and never "
    "enter the release; with --checkpoint-dir they are saved in that directory (so the run can "
    "resume), which must stay private. The membership matrix is drawn from the public --seed: "
    "the guarantee assumes the adversary knows it. "
    "LANGUAGE MODELS (--lm): the model is a causal LM (smollm2, a .gguf file or a Hugging Face "
    "Llama folder), optionally with an LM adapter release made on it (--model); each labelled "
    "sentence becomes a prompt (--template) scored by one candidate continuation per label "
    "(--candidates), the loss is the cross-entropy over the candidate scores, and the adapted "
    "weights are a LoRA adapter of the top block's feed-forward down-projection. The output "
    "is an LM adapter release: the dense weight updates of the adapted kernels (W + delta; an "
    "input adapter's updates included), named by the backbone's weights hash (a release for "
    "another backbone is refused), with the template, candidates, guarantee and ledger. "
    "--lm-path top (default) runs the frozen model once per sentence and then only the top "
    "down-projection and the candidate rows of the output layer (exact; single-token "
    "candidates; CPU-friendly); --lm-path whole runs the whole model at every step (any "
    "candidates; sized for an accelerator).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION, MECHANISMS, "mechanisms")
    p.add_argument("--model", type=Path, default=None,
                   help="model release directory (train, merge or adapt output); with --lm, "
                        "optionally an LM adapter release made on that backbone")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--task",
                      help="the private task; its class names must be the model's (with --lm: "
                           "one --candidates entry per class, in class order)")
    data.add_argument("--data", type=Path, default=None,
                      help="the private labelled data of your own: " + sh.DATA_HELP + "; "
                           "labels must be the model's class names (or ids in its class "
                           "order); split 70/10/20 per label into pool/dev/test by --seed. "
                           'With --lm: a JSON-lines file of {"sentence": "...", "label": i} '
                           "records (i indexes --candidates)")
    sh.add_data_file_arguments(p)
    lm = p.add_argument_group("language models")
    lm.add_argument("--lm", default=None,
                    help="adapt a causal LM: 'smollm2' (the installed SmolLM2-135M-Instruct), "
                         "a .gguf file or a Hugging Face Llama folder (config.json, "
                         "model.safetensors, tokenizer.json)")
    lm.add_argument("--template", default=None,
                    help="prompt with one {sentence} slot, ending without a space (default "
                         "'{sentence} It was')")
    lm.add_argument("--candidates", nargs="+", default=None, metavar="TEXT",
                    help="one continuation per label, with its leading space (default "
                         "' terrible' ' great'); single tokens for --lm-path top")
    lm.add_argument("--lm-path", choices=("top", "whole"), default=None,
                    help="top (default): cache the frozen model below the adapted kernel "
                         "(exact, single-token candidates, CPU-friendly); whole: the whole "
                         "model at every step (any candidates; for an accelerator)")
    lm.add_argument("--rank", type=sh.positive_int, default=None,
                    help="LoRA rank r (alpha = 2r; default 8)")
    lm.add_argument("--seq-len", type=sh.positive_int, default=None,
                    help="tokens per prompt (longer prompts keep their end; default 64)")
    p.add_argument("--mechanism", choices=tuple(MECHANISMS), default="zpl",
                   help="zeroth-order mechanism (see below), default %(default)s")
    p.add_argument("--mi-budget", type=sh.positive_float, default=None,
                   help="mi: total mutual-information budget in nats between the secret subset "
                        "and all releases (e.g. 0.33 matches epsilon = 2 at the "
                        "membership-inference level)")
    p.add_argument("--epsilon", type=sh.positive_float, default=None,
                   help="dpzo: the run is (epsilon, --delta)-DP for one pool example replaced "
                        "(the pool size is public; noise calibrated by the PLD accountant)")
    p.add_argument("--delta", type=float, default=1e-5, help="dpzo: " + sh.DELTA_HELP)
    p.add_argument("--steps", type=sh.positive_int, default=300, help="zeroth-order steps")
    p.add_argument("--lr", type=sh.positive_float, default=None,
                   help="initial learning rate (default 1e-2; 0.3 with --lm: a LoRA factor of "
                        "the top down-projection barely moves at 3e-3 in 500 steps)")
    p.add_argument("--zo-eps", type=sh.positive_float, default=None,
                   help="perturbation scale of the two-point differences (default 1e-2; 1e-3 "
                        "with --lm)")
    p.add_argument("--subsets", type=sh.positive_int, default=16,
                   help="zpl/mi: number M of secret candidate subsets (even)")
    p.add_argument("--dp-batch", type=sh.positive_int, default=64,
                   help="dpzo: expected Poisson batch size")
    p.add_argument("--pool-size", type=sh.positive_int, default=256,
                   help="private pool: examples of the training split")
    p.add_argument("--dev-size", type=sh.positive_int, default=64,
                   help="dev examples for model selection (outside the pool)")
    p.add_argument("--test-size", type=sh.positive_int, default=256,
                   help="test examples for the reported accuracy")
    p.add_argument("--seed", type=int, default=0,
                   help="public seed of the split and of the perturbation directions")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="resumable run: save the training state here at every dev evaluation "
                        "and resume from the latest one if there is one (same flags). It holds "
                        "the secret subset index and generator state: keep it private, it is "
                        "not a release")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("--backbone", type=Path, default=None,
                   help="without --lm: " + sh.BACKBONE_HELP)
    p.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                   help="without --lm: " + sh.POOLING_HELP)
    sh.add_output_arguments(p, "adapted model")


def _resolve_defaults(ns: argparse.Namespace) -> None:
    """Refuse LM-only flags without --lm (and a missing --model), then fill the defaults that
    differ between a classification head and an LM adapter."""
    lm_only = {"--template": ns.template, "--candidates": ns.candidates,
               "--lm-path": ns.lm_path, "--rank": ns.rank, "--seq-len": ns.seq_len}
    if ns.lm is None:
        given = [k for k, v in lm_only.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to a language model only: add --lm "
                             f"(smollm2, a .gguf file or a Hugging Face Llama folder)")
        if ns.model is None:
            raise ValueError("give --model (a model release to adapt), or --lm to adapt a "
                             "language model")
        defaults = {"lr": 1e-2, "zo_eps": 1e-2}
    else:
        if ns.backbone is not None:
            raise ValueError("--backbone applies to a classifier model; with --lm the backbone "
                             "is the language model")
        if ns.test_data is not None or ns.classes is not None:
            raise ValueError("--test-data and --classes apply to a classifier model; with --lm "
                             "the classes are the --candidates")
        defaults = {**adapt_lm.DEFAULTS, "lm_path": "top"}
    for name, value in defaults.items():
        if getattr(ns, name) is None:
            setattr(ns, name, value)


def _config(ns: argparse.Namespace, n: int):
    from pavejax.paczero import ZOConfig

    return ZOConfig(mechanism=ns.mechanism, steps=ns.steps, learning_rate=ns.lr,
                    perturbation_scale=ns.zo_eps, num_subsets=ns.subsets, l2_clip=25.0,
                    mi_budget=ns.mi_budget, target_epsilon=ns.epsilon, delta=ns.delta,
                    dp_batch_size=min(ns.dp_batch, n) if ns.mechanism == "dpzo" else None,
                    eval_every=max(1, ns.steps // 10))


def run(ns: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from pavejax.checkpointing import TrainCheckpointer
    from pavejax.data import limit_task, load_task
    from pavejax.models import apply_head, example_loss
    from pavejax.paczero import init, train
    from pavejax.privacy import fresh_key

    _resolve_defaults(ns)
    if ns.lm is not None:
        return adapt_lm.run(ns)
    _zo.check_flags(ns)
    sh.select_backbone(ns)
    model = sh.load_model_release(ns.model)
    if ns.data is None:
        for flag in ("test_data", "classes"):
            if getattr(ns, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies to --data only")
        task = load_task(ns.task, seed=ns.seed, max_train=ns.pool_size, max_dev=ns.dev_size,
                         max_test=ns.test_size)
    else:
        task = limit_task(sh.load_data_file(ns, ns.data, test_path=ns.test_data,
                                            classes=model.classes),
                          max_train=ns.pool_size, max_dev=ns.dev_size, max_test=ns.test_size,
                          seed=ns.seed)
        if task.modality != "text":
            raise ValueError(f"{ns.data.name}: the model is a head on text features; give a "
                             f"text column")
        if not len(task.dev):
            raise ValueError(f"{ns.data.name}: no dev rows for model selection; give more rows")
    name = task.name
    if tuple(task.label_names) != model.classes:
        raise ValueError(f"the model predicts {list(model.classes)} but task {name!r} has "
                         f"classes {list(task.label_names)}: adapt a model of this label space "
                         f"(e.g. merge models with --base-classes "
                         f"{','.join(task.label_names)})")
    seq_len = int(model.data.get("seq_len", 32))
    pool = sh.features(task.train.inputs, task.train.labels, seq_len)
    dev = sh.features(task.dev.inputs, task.dev.labels, seq_len)
    test = sh.features(task.test.inputs, task.test.labels, seq_len)
    n = int(pool["y"].shape[0])
    zcfg = _config(ns, n)

    @jax.jit
    def dev_loss(p):
        logp = jax.nn.log_softmax(apply_head(p, dev["x"]))
        return jnp.mean(-jnp.take_along_axis(logp, dev["y"][:, None], 1))

    start_dev = float(dev_loss(model.params))
    # A resumed run replaces this fresh OS-seeded state by its checkpoint's (same secrets).
    state = init(zcfg, model.params, n, key=fresh_key(), public_key=jax.random.key(ns.seed))
    ckpt = (contextlib.nullcontext() if ns.checkpoint_dir is None else
            TrainCheckpointer(ns.checkpoint_dir, every=zcfg.eval_every))
    with ckpt as checkpointer:
        state = train(zcfg, example_loss, state, None, pool, dev_fn=lambda p, _: dev_loss(p),
                      checkpointer=checkpointer, progress=ns.progress)
    improved = state.best is not None and state.best_dev < start_dev
    final = jax.tree.map(jnp.asarray, state.best) if improved else model.params
    before, after = (sh.accuracy(p, test, model.classes) for p in (model.params, final))
    led = state.ledger
    guarantee, risk = _zo.guarantee(ns, zcfg, led, n, name)
    ledger = None if ns.mechanism == "mezo" else led
    data = {"task": name, "seed": ns.seed, "pool_size": n, "seq_len": seq_len}
    if ns.data is not None:
        data["file"] = sh.data_file_record(task, ns)
    extra = {"task": name, "classes": list(model.classes),
             "test_accuracy": after, "test_accuracy_before": before, "data": data,
             "selection": {"start_dev_loss": start_dev, "best_dev_loss": state.best_dev,
                           "selected_step": state.best_step if improved else 0},
             "unanimity_rate": state.unanimity_rate,
             "upstream": {"release": ns.model.name, "kind": model.meta.kind,
                          "mechanism": model.meta.mechanism, "guarantee": model.meta.guarantee,
                          "ledger": model.meta.ledger,
                          "note": "the input model's guarantee on its own training data"},
             "model": f"linear head on frozen {sh.backbone_id()} {sh.pooling()}-pooled "
                      f"features"}
    hyper = {"mechanism": ns.mechanism, "steps": ns.steps, "learning_rate": ns.lr,
             "perturbation_scale": ns.zo_eps, "num_subsets": zcfg.num_subsets,
             "mi_budget": ns.mi_budget,
             "target_epsilon": ns.epsilon, "dp_batch_size": zcfg.dp_batch_size,
             "noise_multiplier": state.noise_multiplier, "public_seed": ns.seed}
    digest = sh.save_model_release(ns.out, final, kind="model",
                                   mechanism=f"paczero-{ns.mechanism}" if ns.mechanism in
                                   ("zpl", "mi") else ns.mechanism, ledger=ledger,
                                   guarantee=guarantee, risk=risk, hyperparameters=hyper,
                                   extra=extra, overwrite=ns.overwrite)
    summary = {"out": str(ns.out), "content_hash": digest, "mechanism": ns.mechanism,
               "steps": state.step, "test_accuracy_before": before, "test_accuracy": after,
               "guarantee": guarantee}
    sh.emit(ns, summary, [
        f"adapted with {ns.mechanism} on {n} private examples of {name!r} ({state.step} "
        f"steps, unanimity rate {state.unanimity_rate:.3f})",
        *_zo.summary_lines(guarantee, ns.delta, before, after),
        f"model release: {ns.out} (content hash {digest})"])
    return 0
