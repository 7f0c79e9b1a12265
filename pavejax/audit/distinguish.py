"""Distinguishing-game audit: a statistically valid lower bound on epsilon.

Run a mechanism many times on neighbouring data sets D (with a canary) and D' (without), reduce
each release to a scalar score (higher = "canary present"), and compare the two score samples.
Any (epsilon, delta)-DP mechanism satisfies TPR <= e^eps * FPR + delta and
(1 - FPR) <= e^eps * (1 - TPR) + delta for every threshold test. With Clopper-Pearson bounds on
TPR and FPR at confidence 1 - alpha, the largest epsilon those inequalities force is a lower
bound that holds with probability >= 1 - alpha. The threshold is chosen on one half of the
samples and evaluated on the other, so the choice does not bias the bound.

A bound above the accountant's epsilon proves the mechanism is not as private as claimed.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Two-sided (1 - alpha) Clopper-Pearson interval for a binomial proportion."""
    if trials <= 0:
        raise ValueError("trials must be >= 1.")
    lo = 0.0 if successes == 0 else stats.beta.ppf(alpha / 2, successes, trials - successes + 1)
    hi = 1.0 if successes == trials else stats.beta.ppf(1 - alpha / 2, successes + 1,
                                                        trials - successes)
    return float(lo), float(hi)


def _eps_at(tpr_lo: float, fpr_hi: float, fnr_hi: float, tnr_lo: float, delta: float) -> float:
    cands = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        cands.append(math.log((tpr_lo - delta) / fpr_hi))
    if tnr_lo - delta > 0 and fnr_hi > 0:
        cands.append(math.log((tnr_lo - delta) / fnr_hi))
    return max(cands)


def _bound_for_threshold(s_in, s_out, t, delta, alpha) -> float:
    n_in, n_out = len(s_in), len(s_out)
    tp, fp = int(np.sum(s_in >= t)), int(np.sum(s_out >= t))
    # alpha is split between the two proportions (union bound).
    tpr_lo, _ = clopper_pearson(tp, n_in, alpha / 2)
    _, fpr_hi = clopper_pearson(fp, n_out, alpha / 2)
    return _eps_at(tpr_lo, fpr_hi, 1 - tpr_lo, 1 - fpr_hi, delta)


def epsilon_lower_bound(in_scores, out_scores, delta: float = 0.0, alpha: float = 0.05,
                        seed: int = 0) -> float:
    """Lower bound on epsilon (holds with prob. >= 1 - alpha) from two score samples.

    Args:
      in_scores: scores of releases on D (canary present); higher means "present".
      out_scores: scores of releases on D' (canary absent).
      delta: the mechanism's delta.
      alpha: total failure probability of the bound.
      seed: seed of the split between threshold selection and evaluation.
    """
    s_in = np.asarray(in_scores, np.float64).ravel()
    s_out = np.asarray(out_scores, np.float64).ravel()
    if len(s_in) < 4 or len(s_out) < 4:
        raise ValueError("need at least 4 scores per side; run the mechanism more times.")
    if not (np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out))):
        raise ValueError("scores contain NaN/Inf; check the mechanism's outputs.")
    rng = np.random.default_rng(seed)
    s_in, s_out = rng.permutation(s_in), rng.permutation(s_out)
    h_in, h_out = len(s_in) // 2, len(s_out) // 2
    sel_in, ev_in = s_in[:h_in], s_in[h_in:]
    sel_out, ev_out = s_out[:h_out], s_out[h_out:]
    cands = np.unique(np.quantile(np.concatenate([sel_in, sel_out]), np.linspace(0, 1, 257)))
    # Both directions of the test are covered by _eps_at; pick the best threshold on one half.
    best_t = max(cands, key=lambda t: _bound_for_threshold(sel_in, sel_out, t, delta, alpha))
    return _bound_for_threshold(ev_in, ev_out, best_t, delta, alpha)
