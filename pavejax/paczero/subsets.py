"""Candidate subsets of the pool, the secret index, subset means and sign quantisation.

M candidate subsets of an N-example public pool: every example is placed in exactly M/2 of them,
chosen uniformly without replacement and independently per example, so each example's
membership prior is exactly 1/2 whatever the secret. The secret j* is uniform on {0..M−1} and is
drawn from the operating system (`secrets`), never from a generator whose outputs are released
(the membership matrix, ZPL's coins) nor from the public perturbation seeds: recovering such a
generator's state from its outputs must not reveal j*.

Host side: `membership_matrix`, `draw_secret` (numpy). Device side: `subset_means`,
`subset_signs`, `unanimous` (jnp, jit-friendly).
"""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["draw_secret", "membership_matrix", "subset_means", "subset_signs", "unanimous"]


def _check_subsets(num_subsets: int) -> int:
    if isinstance(num_subsets, bool) or not isinstance(num_subsets, (int, np.integer)):
        raise TypeError(f"num_subsets must be an int, got {type(num_subsets).__name__}")
    if num_subsets < 2 or num_subsets % 2:
        raise ValueError(f"num_subsets (M) must be an even integer >= 2 so that every example "
                         f"is in exactly M/2 subsets, got {num_subsets}")
    return int(num_subsets)


def membership_matrix(rng: np.random.Generator, pool_size: int, num_subsets: int) -> np.ndarray:
    """Boolean (N, M) matrix: row i marks the M/2 subsets holding example i.

    Each row is an independent uniform choice of M/2 distinct columns (``rng.permutation``), so
    P(example i ∈ S_m) = 1/2 for every m and every row has exactly M/2 ones.
    """
    m = _check_subsets(num_subsets)
    if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) \
            or pool_size < 1:
        raise ValueError(f"pool_size must be an integer >= 1, got {pool_size!r}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError("rng must be a numpy.random.Generator (the mechanism's own generator)")
    out = np.zeros((int(pool_size), m), dtype=bool)
    for i in range(int(pool_size)):
        out[i, rng.permutation(m)[: m // 2]] = True
    return out


def draw_secret(rng: np.random.Generator | None, num_subsets: int) -> int:
    """The secret index j* ~ Uniform{0, ..., M−1}.

    ``rng=None`` (use this): from the operating system (``secrets.randbelow``). A generator makes
    j* replayable by whoever knows its seed: for tests only, and never one whose outputs are
    released.
    """
    m = _check_subsets(num_subsets)
    return secrets.randbelow(m) if rng is None else int(rng.integers(m))


def subset_means(g: jax.Array, membership: jax.Array) -> jax.Array:
    """ḡ_m = mean of ``g`` over subset m as one matrix product.

    ``g``: (..., N) float32 per-example values; ``membership``: (N, M) 0/1. Returns (..., M)
    float32; an empty subset's count is clamped to 1 (its mean is 0).
    """
    b = membership.astype(jnp.float32)
    counts = jnp.maximum(jnp.sum(b, axis=0), jnp.float32(1.0))
    sums = jnp.matmul(g.astype(jnp.float32), b)
    return sums / counts.reshape((1,) * (sums.ndim - 1) + counts.shape)


def subset_signs(means: jax.Array) -> jax.Array:
    """Sign quantisation s_m ∈ {−1, +1} as int8; a tie (mean exactly 0) goes to +1."""
    return jnp.where(means >= 0, jnp.int8(1), jnp.int8(-1))


def unanimous(signs: jax.Array) -> jax.Array:
    """True where all M signs along the last axis agree; shape ``signs.shape[:-1]``."""
    return jnp.all(signs == signs[..., :1], axis=-1)
