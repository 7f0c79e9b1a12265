"""Summary statistics over repeated random draws (noise draws, draws of a secret key), shared by
the benchmarks that average over draws.

A benchmark figure measured over R independent draws is reported as its mean, the standard
error of that mean (sample standard deviation / sqrt(R)), the normal 95% interval of the mean
(mean +- 1.96 SE) and the 2.5 / 97.5 percentiles of the draws themselves (where one draw falls,
not where the mean is). Paired differences (two scores on the same draws) are summarised the same
way: :func:`summarize` of the per-draw differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Z95 = 1.96


def summarize(values: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """Mean, spread and 95% intervals of ``values`` (one figure per independent draw).

    Args:
      values: the per-draw figures, a non-empty sequence or 1-D array of finite numbers.

    Returns:
      ``{"n", "mean", "std", "se", "ci95", "p2_5", "p97_5"}``: ``std`` is the sample standard
      deviation (ddof = 1; 0.0 for one draw), ``se = std / sqrt(n)``, ``ci95 = [mean - 1.96 se,
      mean + 1.96 se]`` (a list) and ``p2_5`` / ``p97_5`` the 2.5 / 97.5 percentiles of the
      draws (linear interpolation, NumPy's default). Floats are Python floats.

    Raises:
      ValueError: ``values`` is empty, not one-dimensional, or holds a non-finite number.
    """
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"summarize needs a non-empty 1-D sequence of per-draw values, got "
                         f"shape {v.shape}; pass one figure per draw")
    if not np.all(np.isfinite(v)):
        raise ValueError("summarize got a non-finite value (nan or inf); every draw must give "
                         "a finite figure")
    n = int(v.size)
    mean = float(v.mean())
    std = float(v.std(ddof=1)) if n > 1 else 0.0
    se = std / math.sqrt(n)
    lo, hi = np.percentile(v, [2.5, 97.5])
    return {"n": n, "mean": mean, "std": std, "se": se,
            "ci95": [mean - Z95 * se, mean + Z95 * se], "p2_5": float(lo), "p97_5": float(hi)}


def stat_fields(name: str, values: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """:func:`summarize` of ``values`` as flat table columns: ``name`` (the mean), ``name_std``,
    ``name_se``, ``name_ci95_lo``, ``name_ci95_hi``, ``name_p2_5`` and ``name_p97_5``.

    Raises:
      ValueError: as :func:`summarize`.
    """
    s = summarize(values)
    return {name: s["mean"], f"{name}_std": s["std"], f"{name}_se": s["se"],
            f"{name}_ci95_lo": s["ci95"][0], f"{name}_ci95_hi": s["ci95"][1],
            f"{name}_p2_5": s["p2_5"], f"{name}_p97_5": s["p97_5"]}
