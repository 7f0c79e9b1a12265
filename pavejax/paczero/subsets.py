"""Candidate subsets of the pool, the secret index, subset means and sign quantisation.

M candidate subsets of an N-example public pool: every example is placed in exactly M/2 of them,
chosen uniformly without replacement and independently per example, so each example's
membership prior is exactly 1/2 whatever the secret. The membership matrix is public (the
guarantee assumes the adversary knows it) and is drawn from a public key. The secret index j* is
uniform on {0..M−1} and is drawn from a secret key (`pavejax.privacy.fresh_key`), never from a
key whose draws are released: a key is a pseudo-random function, so releasing the coins or
directions drawn from other keys reveals nothing about j*.

Everything here is jnp and jit-friendly.
"""

from __future__ import annotations

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


def _check_key(key: jax.Array, name: str) -> None:
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and key.shape == ()):
        raise TypeError(f"{name} must be one typed PRNG key (jax.random.key(...) or "
                        f"pavejax.privacy.fresh_key()), got {type(key).__name__}"
                        f"{getattr(key, 'dtype', '')}")


def membership_matrix(key: jax.Array, pool_size: int, num_subsets: int) -> jax.Array:
    """Boolean (N, M) matrix: row i marks the M/2 subsets holding example i.

    Row i is the first M/2 entries of the uniform permutation
    ``jax.random.permutation(fold_in(key, i), M)``, so P(example i ∈ S_m) = 1/2 for every m,
    every row has exactly M/2 ones and rows are independent. ``key`` is public.
    """
    m = _check_subsets(num_subsets)
    if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) \
            or pool_size < 1:
        raise ValueError(f"pool_size must be an integer >= 1, got {pool_size!r}")
    _check_key(key, "key")
    return _membership(key, int(pool_size), m)


@jax.jit(static_argnums=(1, 2))
def _membership(key: jax.Array, pool_size: int, m: int) -> jax.Array:
    rows = jnp.arange(pool_size, dtype=jnp.uint32)
    perms = jax.vmap(lambda i: jax.random.permutation(jax.random.fold_in(key, i), m))(rows)
    out = jnp.zeros((pool_size, m), bool)
    return out.at[rows[:, None].astype(jnp.int32), perms[:, : m // 2]].set(True)


def draw_secret(key: jax.Array, num_subsets: int) -> jax.Array:
    """The secret index j* ~ Uniform{0, ..., M−1} as an int32 scalar, from the secret ``key``.

    Whoever holds the key knows j*: draw it from `pavejax.privacy.fresh_key` (the operating
    system) and keep it out of every release; a key from a fixed seed is for tests only.
    """
    m = _check_subsets(num_subsets)
    _check_key(key, "key")
    return jax.random.randint(key, (), 0, m, jnp.int32)


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
