"""Tiny problems for the three private trainers, shared by the scale-out tests and their worker
processes (``python -m tests._scale_problems <trainer> <dir>`` trains with a checkpoint after
every step and a pause after each, so the parent can SIGKILL it midway)."""

from __future__ import annotations

import math
import os
import sys
import time

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):  # same device setup as the test process
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pavejax.checkpointing import TrainCheckpointer  # noqa: E402
from pavejax.merging import train as mt  # noqa: E402
from pavejax.paczero import ZOConfig, init, train as zo_train  # noqa: E402
from pavejax.pave.spec import (  # noqa: E402
    Backbone,
    PrivacyConfig,
    SpecConfig,
    backbone_hash,
    generate_spec,
    hard_targets,
)

STEPS = 8
TIGHT = 0.05  # far below the per-example gradient norms of these problems: clipping is active

# ------------------------------------------------------------------ DP-SAM on a tiny MLP


def sam_data(n: int = 64, d: int = 5, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=d) > 0).astype(np.int32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def sam_params(d: int = 5, h: int = 8) -> dict:
    rng = np.random.default_rng(1)
    return {"w1": jnp.asarray(rng.normal(size=(d, h)).astype(np.float32) / math.sqrt(d)),
            "w2": jnp.asarray(rng.normal(size=(h,)).astype(np.float32) / math.sqrt(h))}


def sam_loss(params, frozen, ex):
    logit = jnp.dot(jnp.tanh(ex["x"] @ params["w1"]), params["w2"])
    return jax.nn.softplus(logit) - ex["y"].astype(jnp.float32) * logit


def sam_config(steps: int = STEPS, **kw) -> mt.MergeTrainConfig:
    # "reuse" carries mechanism state (the previous private gradient) from step to step.
    base = dict(dataset_size=64, steps=steps, mode="reuse", noise_multiplier=1.0, batch_size=16,
                l2_clip=TIGHT, learning_rate=0.05, anchor=0.1)
    return mt.MergeTrainConfig(**(base | kw))


def run_sam(checkpointer=None, mesh=None, steps: int = STEPS, **kw) -> mt.TrainResult:
    return mt.train_task(sam_loss, sam_params(), None, sam_data(), jax.random.key(3),
                         sam_config(steps, **kw), checkpointer=checkpointer, mesh=mesh)


# ------------------------------------------------------------------ DP-S-PAVE on a toy backbone

D_IN, HIDDEN = 8, 16


def spec_backbone() -> Backbone:
    rng = np.random.default_rng(0)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, 2)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    return Backbone("toy-mlp", params, backbone_hash(params))


def spec_logits(p, batch, aux):
    return jnp.tanh(batch["x"] @ p["l1"]["kernel"]) @ p["l2"]["kernel"]


def _kernels(path, leaf):
    return path.endswith("kernel")


def spec_task(n: int = 48):
    x = np.random.default_rng(2).normal(size=(n, D_IN)).astype(np.float32)
    return {"x": x}, hard_targets((x[:, 0] > 0).astype(np.int32), 2)


def spec_config(steps: int = STEPS, microbatch_size: int | None = None, **priv) -> SpecConfig:
    # Full batches with RDP: cheap accounting (PLD builds one distribution per recorded step and
    # RDP of sampling without replacement takes a second per step on a loaded CPU).
    privacy = PrivacyConfig(**({"l2_clip": TIGHT, "noise_multiplier": 1.0, "sampling": "full",
                                "accountant": "rdp"} | priv))
    return SpecConfig(rank=2, steps=steps, batch_size=12, learning_rate=3e-3, progress=False,
                      privacy=privacy, microbatch_size=microbatch_size)


SPEC_NOISE_KEY = 21  # a replayable noise key, so that runs can be compared bit for bit


def run_spec(checkpointer=None, mesh=None, steps: int = STEPS, noise_key="fixed", **priv):
    inputs, targets = spec_task()
    key = jax.random.key(SPEC_NOISE_KEY) if noise_key == "fixed" else noise_key
    return generate_spec(spec_logits, spec_backbone(), _kernels, inputs, targets,
                         jax.random.key(5), spec_config(steps, **priv), kind="user",
                         checkpointer=checkpointer, mesh=mesh, noise_key=key)


# ------------------------------------------------------------------ PACZero on logistic regression

ZO_N, ZO_D = 32, 4


def zo_pool() -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ZO_N, ZO_D)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 1.0], np.float32) > 0).astype(np.int32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def zo_loss(tr, fr, ex):
    logit = jnp.dot(ex["x"], tr["w"]) + tr["b"]
    return jax.nn.softplus(logit) - ex["y"].astype(jnp.float32) * logit


def zo_start() -> dict:
    return {"w": jnp.zeros((ZO_D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def zo_config(mechanism: str = "mi", **kw) -> ZOConfig:
    extra = {"mi": {"mi_budget": 0.2, "num_subsets": 8},
             "zpl": {"num_subsets": 8},
             "dpzo": {"target_epsilon": 2.0, "dp_batch_size": 8}}[mechanism]
    return ZOConfig(mechanism, **({"steps": STEPS, "learning_rate": 0.05, "l2_clip": TIGHT,
                                   "eval_every": 1} | extra | kw))


@jax.jit
def zo_dev(tr, fr=None) -> jax.Array:
    pool = zo_pool()
    return jnp.mean(jax.vmap(lambda ex: zo_loss(tr, None, ex))(pool))


def zo_init(cfg: ZOConfig, secret: int = 6):
    # a fixed secret key replays the run (tests only)
    return init(cfg, zo_start(), ZO_N, key=jax.random.key(secret), public_key=jax.random.key(4))


# ------------------------------------------------------------------ the killable worker

PAUSE_S = 0.4


class _PausingCheckpointer(TrainCheckpointer):
    def save(self, ckpt):
        super().save(ckpt)
        time.sleep(PAUSE_S)


def run_zo(checkpointer=None) -> None:
    cfg = zo_config()
    zo_train(cfg, zo_loss, zo_init(cfg), None, zo_pool(), dev_fn=zo_dev,
             checkpointer=checkpointer)


def main(trainer: str, directory: str) -> None:
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    run = {"dp-sam": run_sam, "dp-s-pave": run_spec, "paczero": run_zo}[trainer]
    with _PausingCheckpointer(directory) as ckpt:
        run(checkpointer=ckpt)
    print("finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
