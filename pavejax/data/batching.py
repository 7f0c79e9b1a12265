"""Index batches for host-side data loops (tokenisation and device transfer happen elsewhere)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


def _order(n: int, key_or_seed: Any) -> np.ndarray:
    if key_or_seed is None:
        return np.arange(n, dtype=np.int32)
    if isinstance(key_or_seed, bool) or not isinstance(key_or_seed, int | np.integer):
        import jax  # imported here so that loading data alone does not import jax

        if not isinstance(key_or_seed, jax.Array):
            raise TypeError("key_or_seed must be a JAX PRNG key, an int seed or None, got "
                            f"{type(key_or_seed).__name__}")
        return np.asarray(jax.random.permutation(key_or_seed, n)).astype(np.int32)
    return np.random.default_rng(int(key_or_seed)).permutation(n).astype(np.int32)


def iterate_batches(n: int, batch_size: int, key_or_seed: Any = 0, *,
                    drop_last: bool = False) -> Iterator[np.ndarray]:
    """Yield int32 index arrays covering ``range(n)`` once, in batches of ``batch_size``.

    The order is a permutation drawn from ``key_or_seed``: a JAX PRNG key
    (``jax.random.permutation``), an int seed (``numpy.random.default_rng``), or ``None`` for
    the identity order. The last batch is shorter unless ``drop_last``, which drops it.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    order = _order(int(n), key_or_seed)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]
