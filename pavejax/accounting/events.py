"""The ``dp_accounting`` events of pavejax's mechanisms: one builder per mechanism step, and
`run_event` for a run of equal steps.

Convention (as in :mod:`pavejax.accounting.ledger`): every multiplier is the noise std divided
by the add/remove sensitivity C (the per-record L2 bound), whatever the neighbouring relation;
a :class:`~pavejax.accounting.Ledger` built for ``"replace_one"`` doubles the sensitivity
itself. A multiplier of 0 is a non-private step (``NonPrivateDpEvent``, ε = inf).

Sampling (the same rule in every builder): ``q`` is the sampling rate, by default
``batch_size / dataset_size`` when both are given and 1 otherwise; q = 1 is a full batch (the
bare query). Otherwise ``sampling="poisson"`` wraps the query in ``PoissonSampledDpEvent`` and
``sampling="fixed"`` (needs ``dataset_size`` and ``batch_size``) in
``SampledWithoutReplacementDpEvent``. The builders do not know the neighbouring relation; the
relation guards live where the event is analysed (the ledger and `calibrate`), once for every
builder: fixed-size sampling only under replace-one with RDP, Poisson sampling under replace-one
only with PLD.

All numbers are host-side Python floats; nothing here touches JAX.
"""

from __future__ import annotations

import math

from dp_accounting import dp_event

from pavejax.accounting.ledger import _check_count, _check_real

__all__ = [
    "DP_SAM_MODES", "dp_sam_step_event", "dpzo_step_event", "gaussian_step_event", "run_event",
]

DP_SAM_MODES = ("none", "fresh", "same", "reuse", "random")


def _sampling_rate(q: float | None, sampling: str, dataset_size: int | None,
                   batch_size: int | None) -> float:
    if sampling not in ("poisson", "fixed"):
        raise ValueError(f"unknown sampling {sampling!r}; use 'poisson' or 'fixed'")
    if dataset_size is not None or batch_size is not None:
        n = _check_count("dataset_size", dataset_size)
        m = _check_count("batch_size", batch_size)
        if m > n:
            raise ValueError(f"batch_size ({m}) must not exceed dataset_size ({n})")
        if q is not None and not math.isclose(_check_real("q", q), m / n, rel_tol=1e-9):
            raise ValueError(f"q={q!r} disagrees with batch_size/dataset_size = {m}/{n}; pass "
                             "q=batch_size/dataset_size or leave q unset")
        q = m / n
    elif sampling == "fixed":
        raise ValueError("sampling='fixed' needs dataset_size and batch_size (both integers)")
    q = 1.0 if q is None else _check_real("q", q)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q (sampling probability) must be in (0, 1], got {q!r}; use q=1 for "
                         "full-batch steps")
    return q


def _multiplier(noise_multiplier: float) -> float:
    s = _check_real("noise_multiplier", noise_multiplier)
    if s < 0.0:
        raise ValueError(f"noise_multiplier must be >= 0 (noise std / clip norm), got {s!r}")
    return s


def _sampled(query: dp_event.DpEvent, q: float | None, sampling: str,
             dataset_size: int | None, batch_size: int | None) -> dp_event.DpEvent:
    """``query`` run on a sample drawn by ``sampling`` at rate q (see the module docstring)."""
    q = _sampling_rate(q, sampling, dataset_size, batch_size)
    if isinstance(query, dp_event.NonPrivateDpEvent) or q == 1.0:
        return query
    if sampling == "poisson":
        return dp_event.PoissonSampledDpEvent(q, query)
    return dp_event.SampledWithoutReplacementDpEvent(int(dataset_size), int(batch_size), query)


def gaussian_step_event(noise_multiplier: float, *, q: float | None = None,
                        sampling: str = "poisson", dataset_size: int | None = None,
                        batch_size: int | None = None) -> dp_event.DpEvent:
    """Event of one Gaussian step with noise std ``noise_multiplier * C`` (C = clip norm).

    One DP-SGD / DP-S-PAVE step: a sampled Gaussian query of the clipped per-example sum.
    Sampling follows the module docstring (q = 1: a bare ``GaussianDpEvent``).

    Example:
        >>> gaussian_step_event(1.1, q=0.01).event
        GaussianDpEvent(noise_multiplier=1.1)
    """
    s = _multiplier(noise_multiplier)
    query = dp_event.NonPrivateDpEvent() if s == 0.0 else dp_event.GaussianDpEvent(s)
    return _sampled(query, q, sampling, dataset_size, batch_size)


def run_event(step_event: dp_event.DpEvent, steps: int) -> dp_event.DpEvent:
    """Event of a run of ``steps`` steps, each described by ``step_event`` (adaptive
    composition: a ``SelfComposedDpEvent``).

    Example:
        >>> run_event(gaussian_step_event(2.0), 3)
        SelfComposedDpEvent(event=GaussianDpEvent(noise_multiplier=2.0), count=3)
    """
    if not isinstance(step_event, dp_event.DpEvent):
        raise TypeError(f"step_event must be a dp_accounting.DpEvent (e.g. from "
                        f"gaussian_step_event), got {type(step_event).__name__}")
    return dp_event.SelfComposedDpEvent(step_event, _check_count("steps", steps))


def dp_sam_step_event(mode: str, noise_multiplier: float, *, q: float | None = None,
                      sampling: str = "poisson", dataset_size: int | None = None,
                      batch_size: int | None = None) -> dp_event.DpEvent:
    """Event of one DP-SAM step in ``mode`` (one of `DP_SAM_MODES`), each private gradient a
    Gaussian query of multiplier ``noise_multiplier`` (see :mod:`pavejax.merging.train`).

    * ``"none"``, ``"reuse"``, ``"random"``: one sampled Gaussian (the ascent direction is
      absent, post-processing of past releases, or data-free);
    * ``"fresh"``: two sampled Gaussians on independent samples (``SelfComposed(..., 2)``);
    * ``"same"``: both queries on *one* sample: ``Sampled(Composed[G, G])``. Counting it as two
      independently sampled Gaussians under-counts ε by a large factor.

    Example:
        >>> type(dp_sam_step_event("same", 1.0, q=0.1).event).__name__
        'ComposedDpEvent'
    """
    if mode not in DP_SAM_MODES:
        raise ValueError(f"mode must be one of {DP_SAM_MODES}, got {mode!r}")
    one = gaussian_step_event(noise_multiplier, q=1.0)
    if mode == "same" and not isinstance(one, dp_event.NonPrivateDpEvent):
        return _sampled(dp_event.ComposedDpEvent([one, one]), q, sampling, dataset_size,
                        batch_size)
    step = _sampled(one, q, sampling, dataset_size, batch_size)
    if mode == "fresh" and not isinstance(step, dp_event.NonPrivateDpEvent):
        return dp_event.SelfComposedDpEvent(step, 2)
    return step


def dpzo_step_event(noise_multiplier: float, *, num_directions: int = 1, q: float | None = None,
                    sampling: str = "poisson", dataset_size: int | None = None,
                    batch_size: int | None = None) -> dp_event.DpEvent:
    """Event of one DP-ZO step: K = ``num_directions`` clipped scalars per example (L2 norm
    <= C√K) with noise σC per coordinate, i.e. a sampled Gaussian of multiplier σ/√K.

    Example:
        >>> dpzo_step_event(2.0, num_directions=4)
        GaussianDpEvent(noise_multiplier=1.0)
    """
    k = _check_count("num_directions", num_directions)
    return gaussian_step_event(_multiplier(noise_multiplier) / math.sqrt(k), q=q,
                               sampling=sampling, dataset_size=dataset_size,
                               batch_size=batch_size)
