"""Distinguishing games: attack advantage, epsilon lower bounds, and the white-box Dirac canary.

An adversary sees one release and must say whether it came from D (canary in) or D' (canary
out). Its best **advantage** ``TPR - FPR`` over threshold tests on a score is an empirical lower
bound on the total variation between the two release distributions, the quantity that the
disclosure and amplification risks of :mod:`pavejax.accounting.risk` bound by
``tv_bound(eps, delta)`` (and, more loosely, ``(e^eps - 1) + delta``). :func:`attack_advantage`
picks the threshold on one half of the runs and measures on the other, and adds a Clopper-Pearson
lower confidence bound. :func:`evaluate_game` reports it next to the epsilon lower bound of
:func:`pavejax.audit.epsilon_lower_bound`.

:func:`dirac_whitebox_scores` is the strongest game for the Gaussian step that DP-S-PAVE (and
every other DP-SGD-style trainer here) repeats: the adversary sees every privatised gradient of a
full-batch run and the canary's gradient is exactly ``C`` times a fixed unit vector (a "Dirac
canary", inserted directly, no model in between). The score sums the noisy gradients' components
along that vector, the likelihood-ratio statistic of this game, so the audited epsilon measures
how tight the accounting is (finite runs keep it below the claim).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax.audit.distinguish import clopper_pearson, epsilon_lower_bound

__all__ = [
    "Advantage",
    "GameResult",
    "attack_advantage",
    "dirac_whitebox_scores",
    "evaluate_game",
]


@dataclasses.dataclass(frozen=True)
class Advantage:
    """Held-out advantage ``TPR - FPR`` of the best threshold test (selected on the other half).

    Attributes:
      estimate: the advantage on the evaluation half (an unbiased estimate for the chosen test).
      lower: ``max(0, TPR_lo - FPR_hi)`` with Clopper-Pearson bounds at ``alpha/2`` each: a lower
        bound on the true advantage of that test, hence on the total variation, with
        probability >= 1 - alpha.
      threshold, direction: the test says "in" iff ``score >= threshold`` (direction 1) or
        ``score < threshold`` (direction -1).
    """

    estimate: float
    lower: float
    threshold: float
    direction: int


def _scores(name: str, x: Any) -> np.ndarray:
    a = np.asarray(x, np.float64).ravel()
    if a.size < 4:
        raise ValueError(f"{name} needs at least 4 scores; run the mechanism more times")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN/inf; check the mechanism's outputs")
    return a


def _rates(s_in: np.ndarray, s_out: np.ndarray, thresholds: np.ndarray):
    # TPR/FPR of "score >= t" for every t, via sorted counts.
    tpr = 1.0 - np.searchsorted(np.sort(s_in), thresholds, side="left") / s_in.size
    fpr = 1.0 - np.searchsorted(np.sort(s_out), thresholds, side="left") / s_out.size
    return tpr, fpr


def attack_advantage(in_scores: Any, out_scores: Any, *, alpha: float = 0.05,
                     seed: int = 0) -> Advantage:
    """Best threshold attack on two score samples (canary in / out), in either orientation.

    Args:
      in_scores, out_scores: one score per run of the mechanism on D and on D'.
      alpha: failure probability of ``lower``.
      seed: seed of the random split into selection and evaluation halves.

    Returns an :class:`Advantage`. Every threshold between observed scores is tried on the
    selection half; the chosen test is evaluated once on the evaluation half.
    """
    s_in, s_out = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    rng = np.random.default_rng(seed)
    s_in, s_out = rng.permutation(s_in), rng.permutation(s_out)
    h_in, h_out = s_in.size // 2, s_out.size // 2
    sel_in, sel_out = s_in[:h_in], s_out[:h_out]
    cands = np.unique(np.concatenate([sel_in, sel_out, [np.inf]]))
    tpr, fpr = _rates(sel_in, sel_out, cands)
    gap = tpr - fpr
    i = int(np.argmax(np.abs(gap)))
    t, direction = float(cands[i]), (1 if gap[i] >= 0 else -1)
    ev_in, ev_out = s_in[h_in:], s_out[h_out:]

    def predicted_in(x: np.ndarray) -> int:
        return int(np.sum(x >= t)) if direction == 1 else int(np.sum(x < t))

    tp, fp = predicted_in(ev_in), predicted_in(ev_out)
    n_in, n_out = ev_in.size, ev_out.size
    tpr_lo, _ = clopper_pearson(tp, n_in, alpha / 2)
    _, fpr_hi = clopper_pearson(fp, n_out, alpha / 2)
    return Advantage(estimate=tp / n_in - fp / n_out, lower=max(0.0, tpr_lo - fpr_hi),
                     threshold=t, direction=direction)


@dataclasses.dataclass(frozen=True)
class GameResult:
    """One distinguishing game: the audit's epsilon lower bound and the attack advantage.

    ``epsilon_lower`` holds with probability >= 1 - alpha (Clopper-Pearson);
    ``claimed_epsilon`` is the accountant's epsilon (None for a non-private mechanism).
    """

    epsilon_lower: float
    claimed_epsilon: float | None
    delta: float
    advantage: float
    advantage_lower: float
    runs_per_side: int

    @property
    def over_claimed(self) -> float | None:
        """``epsilon_lower / claimed_epsilon`` (<= 1 for a correctly accounted mechanism)."""
        if self.claimed_epsilon is None or not math.isfinite(self.claimed_epsilon):
            return None
        return self.epsilon_lower / self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"over_claimed": self.over_claimed}


def evaluate_game(in_scores: Any, out_scores: Any, *, delta: float,
                  claimed_epsilon: float | None = None, alpha: float = 0.05,
                  seed: int = 0) -> GameResult:
    """Epsilon lower bound (at ``delta``) and attack advantage from one game's scores."""
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    s_in, s_out = _scores("in_scores", in_scores), _scores("out_scores", out_scores)
    adv = attack_advantage(s_in, s_out, alpha=alpha, seed=seed)
    lower = epsilon_lower_bound(s_in, s_out, delta=delta, alpha=alpha, seed=seed)
    return GameResult(float(lower), None if claimed_epsilon is None else float(claimed_epsilon),
                      float(delta), adv.estimate, adv.lower, int(min(s_in.size, s_out.size)))


def _dirac_loss(trainable, frozen, example):
    # The per-example gradient w.r.t. w is example["x"]: gradients are placed, not computed.
    return jnp.dot(trainable["w"], example["x"])


def dirac_whitebox_scores(key: jax.Array, *, l2_clip: float, noise_multiplier: float,
                          steps: int, runs: int, relation: str = "replace_one",
                          num_examples: int = 8, dim: int = 4,
                          chunk: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """White-box game on the DP engine's Gaussian step (q = 1): ((runs,), (runs,)) scores.

    Each run releases ``steps`` noisy mean gradients computed by
    :func:`pavejax.privacy.noisy_gradient` (joint clipping to ``l2_clip``, noise
    ``noise_multiplier * l2_clip``, full batch of ``num_examples``) and the adversary sees all of
    them. The last example is the canary, with gradient ``l2_clip * e_0``. Its neighbour is the
    example with gradient ``-l2_clip * e_0`` (``relation="replace_one"``, the worst replacement)
    or the canary's absence (``"add_remove"``, masked out; the normaliser is unchanged). The
    other examples are fixed random gradients of norm below ``l2_clip``. Score of a run: the sum
    over steps of the released gradients' ``e_0`` component.

    Compare with a :class:`pavejax.accounting.Ledger` of ``relation`` over ``steps`` events of
    ``DPConfig(l2_clip, noise_multiplier, SamplingConfig("full", num_examples)).step_event()``.
    """
    from pavejax.privacy import DPConfig, SamplingConfig

    if relation not in ("replace_one", "add_remove"):
        raise ValueError(f"relation must be 'replace_one' or 'add_remove', got {relation!r}")
    for name, v in (("steps", steps), ("runs", runs), ("num_examples", num_examples),
                    ("dim", dim), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_examples < 2:
        raise ValueError("num_examples must be >= 2 (the canary and at least one other)")
    cfg = DPConfig(l2_clip, noise_multiplier, SamplingConfig("full", dataset_size=num_examples))
    rng = np.random.default_rng(0)
    others = rng.normal(size=(num_examples - 1, dim))
    others *= 0.5 * l2_clip / np.linalg.norm(others, axis=1, keepdims=True)
    canary = np.zeros((1, dim))
    canary[0, 0] = l2_clip
    x_in = jnp.asarray(np.concatenate([others, canary]), jnp.float32)
    if relation == "replace_one":
        x_out, mask_out = jnp.asarray(np.concatenate([others, -canary]), jnp.float32), None
    else:
        x_out, mask_out = x_in, jnp.arange(num_examples) < num_examples - 1
    mask_in = jnp.ones((num_examples,), bool)
    batched = _whitebox_program(cfg, steps, dim)
    chunk = min(chunk, runs)
    k_in, k_out = jax.random.split(key)
    out = []
    for x, mask, k in ((x_in, mask_in, k_in),
                       (x_out, mask_in if mask_out is None else mask_out, k_out)):
        keys = jax.random.split(k, runs)
        parts = []
        for i in range(0, runs, chunk):
            kk = keys[i:i + chunk]
            pad = chunk - kk.shape[0]
            if pad:
                kk = jnp.concatenate([kk, jnp.broadcast_to(kk[:1], (pad,))])
            parts.append(np.asarray(batched(x, mask, kk))[:chunk - pad])
        out.append(np.concatenate(parts).astype(np.float64))
    return out[0], out[1]


@functools.cache
def _whitebox_program(cfg, steps: int, dim: int):
    from pavejax.privacy import noisy_gradient

    w = {"w": jnp.zeros((dim,), jnp.float32)}

    def run(x, mask, k):
        def step(total, t):
            g, _ = noisy_gradient(_dirac_loss, w, None, {"x": x}, mask,
                                  jax.random.fold_in(k, t), cfg)
            return total + g["w"][0], None

        return jax.lax.scan(step, jnp.float32(0.0), jnp.arange(steps))[0]

    return jax.jit(jax.vmap(run, in_axes=(None, None, 0)))
