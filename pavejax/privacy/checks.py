"""Host-side checks of a step's flags: the only place a private step is refused.

Steps never read their own values on the host (that would stop them from running under ``jit``
or ``lax.scan``). They return flags instead (a Poisson ``overflow`` and the count of real
examples with a non-finite loss or gradient, ``num_nonfinite``), and the driver calls
:func:`check_step` on them after the call, before it keeps, saves or returns anything from that
call. A refused call therefore releases nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pavejax.privacy.sampling import BatchOverflowError


class NonFiniteError(ValueError):
    """A real example produced a NaN/Inf loss or gradient; the step was not released."""


def _field(stats: Any, name: str) -> Any:
    if isinstance(stats, Mapping):
        return stats.get(name)
    return getattr(stats, name, None)


def check_step(stats: Any) -> None:
    """Raises when a step's statistics flag a problem (works on one step's statistics and on a
    chunk of steps stacked by ``lax.scan``).

    Reads the fields ``overflow`` (bool: a Poisson draw exceeded the padded batch) and
    ``num_nonfinite`` (int: real examples with a NaN/Inf loss or gradient) of a NamedTuple,
    dataclass or mapping; a missing field is not checked.

    Raises:
      BatchOverflowError: some step's Poisson draw overflowed its padded batch.
      NonFiniteError: some step met a non-finite example (a ``ValueError``).
    """
    overflow = _field(stats, "overflow")
    if overflow is not None and bool(np.any(np.asarray(overflow))):
        steps = np.flatnonzero(np.asarray(overflow).reshape(-1))
        raise BatchOverflowError(
            f"a Poisson draw selected more examples than the padded batch holds (step(s) "
            f"{steps.tolist()} of this call); nothing was released. Raise max_batch (see "
            "pavejax.privacy.max_batch_for) or lower the batch size. Examples are never dropped "
            "silently because that would void the accounting.")
    bad = _field(stats, "num_nonfinite")
    if bad is not None:
        total = int(np.sum(np.asarray(bad)))
        if total:
            raise NonFiniteError(
                f"{total} example(s) produced a NaN/Inf loss or gradient; nothing was released. "
                "Check the inputs for NaN/Inf, the loss for log(0) or overflow, and lower the "
                "learning rate if the parameters diverged.")
