"""One process of the 2-process test: ``python -m tests._multihost_worker PID PORT OUT_DIR``.

Each process joins over loopback with 2 CPU devices, feeds its half of a 16-example batch, and
runs a DP gradient and a DP-SAM step on the 4-device global mesh. :func:`compute` with
``mesh=None`` is the single-process reference.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

TIGHT = 0.05
BATCH, D, H = 16, 5, 8


def problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, D)).astype(np.float32)
    y = (x @ rng.normal(size=D) > 0).astype(np.int32)
    mask = np.arange(BATCH) < BATCH - 3  # padding rows must not count, on any process
    params = {"w1": (rng.normal(size=(D, H)) / math.sqrt(D)).astype(np.float32),
              "w2": (rng.normal(size=(H,)) / math.sqrt(H)).astype(np.float32)}
    return {"x": x, "y": y}, mask, params


def loss(params, frozen, ex):
    import jax
    import jax.numpy as jnp

    logit = jnp.dot(jnp.tanh(ex["x"] @ params["w1"]), params["w2"])
    return jax.nn.softplus(logit) - ex["y"].astype(jnp.float32) * logit


def compute(mesh, batch, mask, params, state, key_data) -> dict[str, np.ndarray]:
    """DP gradient and one DP-SAM ("same") step; all inputs global (or local when no mesh)."""
    import jax

    from pavejax.distributed import fetch
    from pavejax.merging import train as mt
    from pavejax.privacy import DPConfig, SamplingConfig, noisy_gradient

    dp_cfg = DPConfig(TIGHT, 1.0, SamplingConfig("poisson", 64, BATCH, max_batch=BATCH))
    sam_cfg = mt.MergeTrainConfig(dataset_size=64, steps=1, mode="same", noise_multiplier=1.0,
                                  batch_size=BATCH, l2_clip=TIGHT, learning_rate=0.05)

    def dp(params, batch, mask, kd):
        key = jax.random.wrap_key_data(kd)
        grad, info = noisy_gradient(loss, params, None, batch, mask, key, dp_cfg, mesh=mesh)
        return grad, info.num_clipped

    def sam(state, params, batch, mask, kd):
        key = jax.random.wrap_key_data(kd)
        return mt.dp_sam_step(loss, sam_cfg, state, None, params, batch, mask, batch, mask, key,
                              mesh=mesh)

    grad, clipped = jax.jit(dp)(params, batch, mask, key_data)
    new, stats = jax.jit(sam)(state, params, batch, mask, key_data)
    out = {f"grad_{k}": v for k, v in fetch(grad).items()}
    out |= {f"sam_{k}": v for k, v in fetch(new.params).items()}
    out |= {"clipped": fetch(clipped), "sam_loss": fetch(stats.loss),
            "sam_clipped": fetch(stats.num_clipped)}
    return out


def main(pid: int, port: int, out_dir: str) -> None:
    from pavejax import distributed

    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           local_device_count=2)
    import jax

    from pavejax.merging import train as mt

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    assert jax.process_count() == 2 and jax.device_count() == 4
    mesh = distributed.global_mesh()
    data, mask, params = problem()
    rows = slice(pid * BATCH // 2, (pid + 1) * BATCH // 2)
    batch = distributed.global_batch({k: v[rows] for k, v in data.items()}, mesh)
    gmask = distributed.global_batch(mask[rows], mesh)
    state = distributed.replicate_global(
        mt.init_state(params, mt.MergeTrainConfig(dataset_size=64, steps=1,
                                                  noise_multiplier=1.0)), mesh)
    key_data = distributed.replicate_global(np.asarray([0, 42], np.uint32), mesh)
    out = compute(mesh, batch, gmask, distributed.replicate_global(params, mesh), state,
                  key_data)
    np.savez(Path(out_dir) / f"proc{pid}.npz", **out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
