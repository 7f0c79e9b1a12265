"""Automatic microbatch size for the materialised per-example-gradient path.

:func:`~pavejax.privacy.clipped_sum` materialises ``microbatch_size`` per-example gradients at
once (``lax.scan`` over chunks), so the chunk size trades memory for speed and never changes the
result. :func:`pavejax.privacy.auto_microbatch_size` (defined in :mod:`pavejax.privacy.gradient`,
which imports this module) picks the largest chunk whose *compiled* step fits a memory
budget: it lowers and compiles the step for candidate sizes on abstract shapes (nothing runs, no
real arrays are needed) and reads XLA's ``temp_size_in_bytes`` (:func:`compiled_temp_bytes`).

Search (why bisection): the candidates are the divisors of the (per-device) batch size. Each
candidate costs one XLA compilation, which for a large model takes seconds to minutes, so the
divisors are bisected (about ``2 + log2(#divisors)`` compilations) instead of scanned from the
largest down. Bisection relies on temp memory growing with the chunk size, which XLA does not
promise; the search therefore keeps a bracket of *compiled* facts: the returned size was compiled
and fits the budget, and the next larger divisor was compiled and does not fit (unless the
returned size is the whole batch). A non-monotone profile can only hide a larger size that also
fits further up; it can never make the returned size exceed the budget.

Reporting the whole batch: when no microbatching is needed, the result is the (per-device)
batch size itself, an int that :func:`~pavejax.privacy.clipped_sum` treats exactly like
``microbatch_size=None`` (one vmap over the whole batch, the same compiled program).

Results are cached by (loss function, shapes and dtypes of the arguments, config, mesh, budget),
so repeated calls with the same shapes compile nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

PyTree = Any

# The searches over pavejax's own steps (``auto_microbatch_size`` and DPGradient's "auto") live
# in pavejax.privacy.gradient, which imports this module (never the other way round).
__all__ = ["MicrobatchDoesNotFitError", "clear_autotune_cache", "compiled_temp_bytes",
           "default_memory_budget", "search_microbatch_size"]

_log = logging.getLogger(__name__)
_CACHE: dict = {}
_CACHE_MAX = 64


class MicrobatchDoesNotFitError(ValueError):
    """Even ``microbatch_size=1`` needs more temporary memory than the budget allows."""


def compiled_temp_bytes(fn: Callable, *args, **kwargs) -> int:
    """XLA's temporary-buffer size (``temp_size_in_bytes``) of ``jax.jit(fn)`` compiled for
    ``args``/``kwargs`` (arrays or ``jax.ShapeDtypeStruct``; compiled only, never run).

    Raises ``RuntimeError`` when the backend's compiled executable gives no memory analysis.
    """
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError) as e:  # pragma: no cover
        analysis, err = None, e
    else:
        err = None
    temp = getattr(analysis, "temp_size_in_bytes", None)
    if temp is None:
        raise RuntimeError(
            f"the {jax.default_backend()!r} backend gives no XLA memory analysis for the compiled "
            f"step (memory_analysis() returned {analysis!r}{f', {err}' if err else ''}), so its "
            "temporary memory cannot be measured; pass an explicit microbatch_size instead."
        ) from err
    return int(temp)


def _abstract(tree: PyTree) -> PyTree:
    """ShapeDtypeStructs for every leaf (keeps a multi-device array's sharding; a single-device
    placement is dropped, as jit would move such an array next to a mesh anyway)."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            sharding = (None if isinstance(x.sharding, jax.sharding.SingleDeviceSharding)
                        else x.sharding)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        x = np.asarray(x) if not hasattr(x, "dtype") else x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    return jax.tree.map(leaf, tree)


def _nbytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
               else math.prod(x.shape) * 8
               for x in jax.tree.leaves(_abstract(tree)))


def _signature(tree: PyTree):
    leaves, treedef = jax.tree.flatten(_abstract(tree))
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def default_memory_budget(*args: PyTree, budget_fraction: float = 0.8,
                          mesh: jax.sharding.Mesh | None = None) -> int:
    """``budget_fraction`` of the device's ``memory_stats()["bytes_limit"]`` minus the bytes of
    ``args`` (counted in full, even when sharded: a conservative per-device figure).

    Raises ``ValueError`` on backends without ``memory_stats`` (CPU): pass
    ``memory_budget_bytes`` there.
    """
    if not 0 < float(budget_fraction) <= 1:
        raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}.")
    device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"the {device.platform!r} device {device} reports no memory limit "
            "(memory_stats() has no 'bytes_limit'; CPU never does), so no default budget can be "
            "derived; pass memory_budget_bytes=<bytes of temporary memory the step may use>.")
    budget = int(float(budget_fraction) * stats["bytes_limit"]) - _nbytes(args)
    if budget <= 0:
        raise MicrobatchDoesNotFitError(
            f"the arguments alone ({_nbytes(args)} bytes) exceed {budget_fraction} of the "
            f"device's {stats['bytes_limit']} bytes; no microbatch size can fit.")
    return budget


def _check_budget(memory_budget_bytes) -> int:
    if (isinstance(memory_budget_bytes, bool)
            or not isinstance(memory_budget_bytes, (int, np.integer)) or memory_budget_bytes <= 0):
        raise ValueError(f"memory_budget_bytes must be a positive int, got "
                         f"{memory_budget_bytes!r}.")
    return int(memory_budget_bytes)


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})


def _search(make_step: Callable[[int], Callable], args: tuple, local_batch: int, budget: int,
            cache_key) -> int:
    """Largest divisor of ``local_batch`` whose compiled step fits ``budget`` (bisection with a
    compiled bracket; see the module docstring)."""
    if cache_key is not None and cache_key in _CACHE:
        return _CACHE[cache_key]
    sizes = _divisors(local_batch)
    need: dict[int, int] = {}

    def fits(i: int) -> bool:
        mb = sizes[i]
        if mb not in need:
            need[mb] = compiled_temp_bytes(make_step(mb), *args)
            _log.debug("microbatch %d: %d temp bytes (budget %d)", mb, need[mb], budget)
        return need[mb] <= budget

    if fits(len(sizes) - 1):
        chosen = sizes[-1]
    elif not fits(0):
        raise MicrobatchDoesNotFitError(
            f"even microbatch_size=1 needs {need[1]} bytes of temporary memory, more than the "
            f"budget of {budget} bytes (the whole batch of {local_batch} needs "
            f"{need[local_batch]}); raise memory_budget_bytes, shrink the model or the batch, "
            "or use a method that does not materialise per-example gradients.")
    else:
        lo, hi = 0, len(sizes) - 1  # invariant: sizes[lo] fits, sizes[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        chosen = sizes[lo]
    _log.info("auto microbatch size %d of %d (temp bytes %s, budget %d)", chosen, local_batch,
              need, budget)
    if cache_key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[cache_key] = chosen
    return chosen


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        return None
    return key


def clear_autotune_cache() -> None:
    """Forgets every cached :func:`auto_microbatch_size` result."""
    _CACHE.clear()


def _local_batch(batch_size: int, mesh) -> int:
    n = mesh.shape["data"] if mesh is not None else 1
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} is not divisible by the {n} devices on the "
                         f"mesh's 'data' axis; pad the batch and mask the padding.")
    return batch_size // n


def search_microbatch_size(make_step: Callable[[int | None], Callable], args: tuple,
                           batch_size: int, budget: int, cache_key, mesh=None) -> int:
    """The largest divisor of the (per-device) batch whose compiled ``make_step(mb)(*args)``
    needs at most ``budget`` bytes of XLA temp memory (the search behind
    :func:`pavejax.privacy.auto_microbatch_size`); cached under ``cache_key``."""
    return _search(make_step, args, _local_batch(batch_size, mesh), budget,
                   _hashable(cache_key))
