"""The two-layer tanh MLP that the spec tests share: a backbone of two kernels (5 -> 6 -> 2),
its logits and the predicate that adapts both kernels."""

import math

import jax.numpy as jnp
import numpy as np

from pavejax.pave import spec as S

D_IN, HIDDEN, K = 5, 6, 2


def logits(params, batch, aux):
    return jnp.tanh(batch["x"] @ params["l1"]["kernel"]) @ params["l2"]["kernel"]


def kernels(path, leaf):
    return path.endswith("kernel")


def tanh_mlp(rng: np.random.Generator) -> S.Backbone:
    """A backbone with N(0, 1/fan_in) kernels drawn from ``rng``."""
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, K)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    return S.Backbone("toy-tanh-mlp", params, S.backbone_hash(params))
