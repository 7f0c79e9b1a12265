"""Parameter initialisers that draw their random bits as one flat vector.

With JAX's default partitionable threefry, XLA:CPU compiles random draws of small multi-axis
shapes (e.g. a (3, 3, 4, 8) conv kernel) one to two orders of magnitude slower than a 1-D draw
of the same size: seconds per shape. Drawing flat and reshaping gives the same distribution and
keeps model construction fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]

# Standard deviation of a unit normal truncated to [-2, 2] (as in jax.nn.initializers).
_TRUNCATED_STD = 0.87962566103423978


def normal(stddev: float) -> Initializer:
    """N(0, stddev^2) entries."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        flat = jax.random.normal(key, (math.prod(shape),), jnp.float32)
        return (stddev * flat).reshape(shape).astype(dtype)

    return init


def lecun_normal(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Flax's default kernel init: normal truncated at 2 sigma with variance 1/fan_in, where
    fan_in = prod(shape[:-1]) (Linear (in, out) and Conv (kh, kw, in, out) kernels)."""
    fan_in = math.prod(shape[:-1])
    std = math.sqrt(1.0 / fan_in) / _TRUNCATED_STD
    flat = jax.random.truncated_normal(key, -2.0, 2.0, (math.prod(shape),), jnp.float32)
    return (std * flat).reshape(shape).astype(dtype)
