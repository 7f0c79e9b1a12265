"""The spec's fitting loss, shared by :mod:`pavejax.pave.spec` and :mod:`pavejax.pave.subspace`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cross_entropy(logits: jax.Array, target: jax.Array) -> jax.Array:
    """Cross-entropy of ``logits`` to probability ``target`` rows (the spec's fitting loss),
    in float32, over the last axis."""
    return -jnp.sum(target * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
