"""Gaussian privatiser on the clipped sum, normalised by the expected batch size.

Formal guarantee:
  Releasing ``(S + N(0, (z * Delta)^2 I)) / b_exp``, where S is a clipped sum with add/remove
  sensitivity Delta, is the Gaussian mechanism with noise multiplier z relative to Delta (the
  division by the public constant b_exp is post-processing). Under replace-one neighbouring the
  sensitivity doubles; the :mod:`pavejax.accounting` ledger applies that factor, so events always
  carry z relative to the add/remove sensitivity.

Sharp edges:
  * Normalise by the *expected* batch size q*n, never by the realised Poisson batch size: the
    realised size depends on the data set and dividing by it is not covered by the analysis.
  * Noise is added once to the sum (after any cross-device reduction), never per device.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def fresh_key() -> jax.Array:
    """A typed PRNG key filled from the operating system's randomness (``secrets``).

    Use it for DP noise and sampling: a key derived from a recorded or guessable seed lets
    anyone regenerate the noise and subtract it from the release. The key is never written
    anywhere except a training checkpoint (which is not a release).
    """
    like = jax.random.key_data(jax.random.key(0))
    raw = secrets.token_bytes(like.size * like.dtype.itemsize)
    data = np.frombuffer(raw, dtype=like.dtype).reshape(like.shape)
    return jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(jax.random.key(0)))


def gaussian_noise_like(key: jax.Array, tree: PyTree, stddev: float) -> PyTree:
    """N(0, stddev^2) noise with the structure and dtypes of ``tree`` (float32 draws).

    Leaf i uses ``fold_in(key, i)``, so the noise of a leaf does not depend on the others.
    """
    leaves, treedef = jax.tree.flatten(tree)
    noise = [
        (jnp.float32(stddev) * jax.random.normal(jax.random.fold_in(key, i), x.shape,
                                                 jnp.float32)).astype(x.dtype)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, noise)


def privatize_sum(grad_sum: PyTree, key: jax.Array, *, noise_multiplier: float,
                  sensitivity: float, expected_batch_size: float) -> PyTree:
    """Noisy mean gradient ``(grad_sum + N(0, (noise_multiplier*sensitivity)^2)) / b_exp``.

    Args:
      grad_sum: clipped sum (pytree).
      key: PRNG key used for this release only.
      noise_multiplier: z >= 0, noise std in units of ``sensitivity``.
      sensitivity: add/remove L2 sensitivity of ``grad_sum`` (the clip norm for joint clipping).
      expected_batch_size: public normaliser (q*n for Poisson sampling, b for fixed-size).
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}.")
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
        raise ValueError("expected_batch_size must be > 0 (q * dataset size for Poisson "
                         f"sampling), got {expected_batch_size!r}.")
    std = float(noise_multiplier) * float(sensitivity)
    noise = gaussian_noise_like(key, grad_sum, std)
    inv = 1.0 / float(expected_batch_size)
    return jax.tree.map(lambda s, n: (s + n) * jnp.asarray(inv, s.dtype), grad_sum, noise)
