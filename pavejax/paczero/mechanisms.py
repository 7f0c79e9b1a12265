"""Release rules of zeroth-order fine-tuning: MeZO, DP-ZO, PACZero-ZPL and PACZero-MI.

Each step computes, on the device, K directions' per-example clipped projected gradients ĝ and
from them the M candidate-subset signs (PACZero), the pool mean (MeZO) or a clipped sum over a
Poisson sample (DP-ZO). The rules here turn those into the K released scalars Y_k; the update is
θ ← θ − η_t (1/K) Σ_k Y_k z_k. They run on the host in float64 with numpy generators whose
states live in `MechanismState` (so a resumed run draws exactly the same numbers): the noise
generator (MI and DP-ZO noise; secret) and the coin generator (ZPL's fair coins; public, as the
coins are released). The two never share a stream, and neither draws the secret index.

Guarantees:

* **MeZO** (``"mezo"``): none; Y = mean of the clipped ĝ over the pool.
* **DP-ZO** (``"dpzo"``): (ε, δ)-DP under replace-one neighbouring (data sets of the same,
  public size N that differ in one example), accounted with PLD. Y = (Σ_{i∈batch} clip(ĝ_i)
  + N(0, (σC)²)) / b with Poisson sampling at rate b/N; with K directions the per-example vector
  has L2 norm <= C√K, so one step is the Gaussian event of multiplier σ/√K (`pavejax.accounting.dpzo_step_event`,
  in the add/remove-sensitivity convention of `pavejax.accounting`: a replace-one ledger doubles
  the sensitivity to 2C√K itself).
* **PACZero-ZPL** (``"zpl"``): I(S*; Y_1:T) = 0. Unanimous signs are released as is; otherwise Y
  is a fair coin. `zpl_release` never receives the secret.
* **PACZero-MI** (``"mi"``): I(S*; Y_1:T) <= B nats. With posterior mass q₊ on s* = +1 and
  per-release budget β (capped at 0.999·H_b(q₊)), y = s* + N(0, σ²) with σ calibrated so that
  a certified upper bound on I_BIAWGN(q₊, σ) (`biawgn_mi_upper_bound`) is <= β, Y = sign(y)
  (ties +1), the posterior is updated on the real y (treated as public: conservative), and
  max(β, that upper bound) is charged: β by construction, more only with the reference's
  ``faithful`` solver, whose σ can leak far more than β. The chain rule bounds the total by
  the sum of the charges.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import special

from pavejax.accounting.pac import (
    biawgn_mi_upper_bound,
    binary_entropy,
    calibrate_biawgn_sigma,
)

__all__ = [
    "KINDS", "MechanismState", "Release", "dpzo_release", "init_mechanism_state", "mezo_release", "mi_release", "per_step_budget", "positive_mass",
    "zpl_release",
]

KINDS = ("mezo", "dpzo", "zpl", "mi")
_CERTAIN = 1e-12  # posterior mass below which a sign counts as impossible (PAC-unanimous)


@dataclasses.dataclass(frozen=True)
class Release:
    """One released scalar and what it cost.

    ``value``: Y (±1 for PACZero, real for MeZO/DP-ZO); ``unanimous``: the step needed no noise;
    ``charged``: nats charged to the budget (>= ``realised``); ``realised``: a certified upper
    bound on the mutual information the release has (`biawgn_mi_upper_bound`); ``sigma``: the
    Gaussian noise std (None if none); ``q_plus``: the prior mass on s* = +1.
    """

    value: float
    unanimous: bool = False
    charged: float = 0.0
    realised: float = 0.0
    sigma: float | None = None
    q_plus: float | None = None


def _generator(state: dict[str, Any]) -> np.random.Generator:
    bit = np.random.PCG64()
    bit.state = state
    return np.random.Generator(bit)


def _pcg64_state(rng: np.random.Generator) -> dict[str, Any]:
    if not isinstance(rng.bit_generator, np.random.PCG64):
        raise TypeError("mechanism generators must use PCG64 (np.random.default_rng)")
    return rng.bit_generator.state


@dataclasses.dataclass(frozen=True)
class MechanismState:
    """Host-side state of the release rules. Private: never release it.

    ``log_posterior``: log posterior over the M candidates (float64); ``mi_used``: nats charged;
    ``rng_state``: the noise generator's `numpy.random.PCG64` state (MI and DP-ZO noise: secret,
    seeded from the OS); ``coin_state``: the coin generator's state (ZPL's fair coins, which are
    released), or None when the mechanism draws no coins.
    """

    log_posterior: np.ndarray
    mi_used: float
    rng_state: dict[str, Any]
    coin_state: dict[str, Any] | None = None

    def generator(self) -> np.random.Generator:
        """The noise generator, positioned exactly at ``rng_state``."""
        return _generator(self.rng_state)

    def coin_generator(self) -> np.random.Generator:
        """The coin generator, positioned exactly at ``coin_state``."""
        if self.coin_state is None:
            raise ValueError("this mechanism state has no coin generator; build it with "
                             "init_mechanism_state(..., coins=generator)")
        return _generator(self.coin_state)

    def posterior(self) -> np.ndarray:
        """The normalised posterior over candidates, shape (M,)."""
        return np.exp(self.log_posterior - special.logsumexp(self.log_posterior))


def init_mechanism_state(rng: np.random.Generator, num_subsets: int, *,
                         coins: np.random.Generator | None = None) -> MechanismState:
    """Uniform posterior over ``num_subsets`` candidates, nothing used, noise generator ``rng``
    and coin generator ``coins`` (both PCG64; keep them apart: coins are released)."""
    if coins is rng:
        raise ValueError("the coin generator is released through the coins: it must not be the "
                         "noise generator")
    return MechanismState(np.full(int(num_subsets), -math.log(num_subsets)), 0.0,
                          _pcg64_state(rng), None if coins is None else _pcg64_state(coins))


def positive_mass(log_posterior: np.ndarray, signs: np.ndarray) -> float:
    """q₊ = posterior mass of the candidates whose sign is +1 (float64)."""
    signs = np.asarray(signs)
    lp = np.asarray(log_posterior, np.float64) - special.logsumexp(log_posterior)
    pos = signs > 0
    if not pos.any():
        return 0.0
    if pos.all():
        return 1.0
    return float(np.exp(special.logsumexp(lp[pos])))


def per_step_budget(budget: float, used: float, step: int, total_steps: int) -> float:
    """Adaptive per-step budget β_t = max(B − used, 0)/(T − t) (t 0-based), never letting
    used + β_t exceed B in floating point; 0 once t >= T."""
    if step >= total_steps:
        return 0.0
    beta = max(budget - used, 0.0) / (total_steps - step)
    while beta > 0.0 and used + beta > budget:
        beta = float(np.nextafter(beta, 0.0))
    return beta


def zpl_release(signs: np.ndarray, rng: np.random.Generator) -> Release:
    """PACZero-ZPL: the common sign if all M candidate signs agree, else a fair coin.

    The secret is not an argument: the release cannot depend on it (zero mutual information).
    """
    signs = np.asarray(signs)
    if np.all(signs == signs[0]):
        return Release(float(1.0 if signs[0] > 0 else -1.0), unanimous=True)
    return Release(float(1.0 if rng.random() < 0.5 else -1.0))


def mi_release(signs: np.ndarray, secret: int, log_posterior: np.ndarray, beta: float,
               rng: np.random.Generator, *, faithful: bool = False,
               limit: float | None = None) -> tuple[Release, np.ndarray]:
    """PACZero-MI release of one direction with per-release budget ``beta`` (nats).

    Returns the release and the updated log posterior (M,). PAC-unanimous (q₊ within 1e-12 of 0
    or 1): releases s* with no noise and charges 0. Otherwise β ← min(β, 0.999·H_b(q₊)); with
    β = 0 (budget spent) the caller must stop before calling. σ solves I_BIAWGN(q₊, σ) = β
    conservatively (its certified upper bound is <= β), or with the reference's solver if
    ``faithful``; the charge is max(β, the upper bound at σ), so a faithful σ that leaks more
    than β is charged what it leaks. ``limit`` (nats left in the run's budget): a faithful σ
    whose leak would exceed it is replaced by the conservative one, so the budget still binds.
    ``rng`` is the noise generator (secret).
    """
    signs = np.asarray(signs)
    s_star = float(signs[secret])
    q = positive_mass(log_posterior, signs)
    if q <= _CERTAIN or q >= 1.0 - _CERTAIN:
        return Release(1.0 if s_star > 0 else -1.0, unanimous=True, q_plus=q), log_posterior
    if beta <= 0.0:
        raise ValueError("the per-release budget is 0 (the MI budget is spent); stop training "
                         "instead of releasing")
    beta = min(beta, 0.999 * binary_entropy(q))
    sigma = calibrate_biawgn_sigma(q, beta, faithful=faithful)
    leak = biawgn_mi_upper_bound(q, sigma)
    if faithful and limit is not None and leak > limit:
        sigma = calibrate_biawgn_sigma(q, beta)
        leak = biawgn_mi_upper_bound(q, sigma)
    y = s_star + sigma * float(rng.standard_normal())
    s = np.where(signs > 0, 1.0, -1.0)
    updated = np.asarray(log_posterior, np.float64) - (y - s) ** 2 / (2.0 * sigma**2)
    updated = updated - special.logsumexp(updated)
    release = Release(1.0 if y >= 0.0 else -1.0, charged=max(beta, leak), realised=leak,
                      sigma=sigma, q_plus=q)
    return release, updated


def mezo_release(pool_mean: float) -> Release:
    """MeZO (non-private): the projected gradient itself, Y = mean clipped ĝ."""
    return Release(float(pool_mean))


def dpzo_release(clipped_sum: float, rng: np.random.Generator, *, noise_multiplier: float,
                 l2_clip: float, expected_batch_size: float) -> Release:
    """DP-ZO: (Σ clip(ĝ_i) + N(0, (σ·l2_clip)²)) / expected batch size; ``rng`` is the noise
    generator (secret)."""
    noise = noise_multiplier * l2_clip * float(rng.standard_normal())
    return Release((float(clipped_sum) + noise) / expected_batch_size,
                   sigma=noise_multiplier * l2_clip / expected_batch_size)
