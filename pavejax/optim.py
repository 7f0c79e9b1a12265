"""Optimiser helpers shared by the trainers."""

from __future__ import annotations

import jax
import optax


def promotion_safe(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Wraps ``tx`` so that its update runs under standard dtype promotion.

    optax's bias correction computes ``decay ** count`` (a Python float to an int32 power), which
    JAX's strict promotion mode rejects; pavejax's tests run in strict mode to catch silent
    promotion in noise addition, and the optimiser arithmetic is not where that matters.
    """

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update)
