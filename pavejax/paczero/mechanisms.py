"""Release rules of zeroth-order fine-tuning: MeZO, DP-ZO, PACZero-ZPL and PACZero-MI.

Each step computes, on the device, K directions' per-example clipped projected gradients ĝ and
from them the M candidate-subset signs (PACZero), the pool mean (MeZO) or a clipped sum over a
Poisson sample (DP-ZO). The rules here turn those into the K released scalars Y_k; the update is
θ ← θ − η_t (1/K) Σ_k Y_k z_k.

MeZO, DP-ZO and ZPL release on the device (pure jnp, jittable, scannable): their randomness is a
JAX key, so the same key gives the same release. MI keeps its release on the host in float64
(`mi_release`, posterior in `MIHostState`), with its Gaussian noise drawn by a numpy generator
seeded from a JAX key (`host_generator`), so it too is a function of its key.

Guarantees:

* **MeZO** (``"mezo"``): none; Y = mean of the clipped ĝ over the pool.
* **DP-ZO** (``"dpzo"``): (ε, δ)-DP under replace-one neighbouring (data sets of the same,
  public size N that differ in one example), accounted with PLD. Y = (Σ_{i∈batch} clip(ĝ_i)
  + N(0, (σC)²)) / b with Poisson sampling at rate b/N; with K directions the per-example vector
  has L2 norm <= C√K, so one step is the Gaussian event of multiplier σ/√K
  (`pavejax.accounting.dpzo_step_event`,
  in the add/remove-sensitivity convention of `pavejax.accounting`: a replace-one ledger doubles
  the sensitivity to 2C√K itself). The noise key is secret.
* **PACZero-ZPL** (``"zpl"``): I(S*; Y_1:T) = 0. Unanimous signs are released as is; otherwise Y
  is a fair coin from the step's key. `zpl_release` never receives the secret, so each release
  is independent of it: the charge is exactly 0 nats (`ZPL_NATS`), by construction.
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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from pavejax.accounting.pac import (
    biawgn_mi_upper_bound,
    binary_entropy,
    calibrate_biawgn_sigma,
)
from pavejax.paczero.subsets import unanimous as all_agree

__all__ = [
    "KINDS", "MIHostState", "Release", "ZPL_NATS", "dpzo_release", "host_generator",
    "mezo_release", "mi_init_host", "mi_release", "per_step_budget", "positive_mass",
    "zpl_release",
]

KINDS = ("mezo", "dpzo", "zpl", "mi")
ZPL_NATS = 0.0  # ZPL's charge per step: its releases are independent of the secret
_CERTAIN = 1e-12  # posterior mass below which a sign counts as impossible (PAC-unanimous)


@dataclasses.dataclass(frozen=True)
class Release:
    """One MI release (host, float64) and what it cost.

    ``value``: Y = ±1; ``unanimous``: the step needed no noise; ``charged``: nats charged to the
    budget (>= ``realised``); ``realised``: a certified upper bound on the mutual information the
    release has (`biawgn_mi_upper_bound`); ``sigma``: the Gaussian noise std (None if none);
    ``q_plus``: the prior mass on s* = +1.
    """

    value: float
    unanimous: bool = False
    charged: float = 0.0
    realised: float = 0.0
    sigma: float | None = None
    q_plus: float | None = None


class MIHostState(NamedTuple):
    """Host-side state of PACZero-MI. Private: never release it.

    ``log_posterior``: (M,) float64 log posterior over the candidates (given the releases so
    far); ``mi_used``: nats charged so far (float64; the release rule keeps it within the
    budget); ``stopped``: the budget was spent before the last step, so later steps release
    nothing.
    """

    log_posterior: np.ndarray
    mi_used: float
    stopped: bool = False

    def posterior(self) -> np.ndarray:
        """The normalised posterior over candidates, shape (M,)."""
        return np.exp(self.log_posterior - special.logsumexp(self.log_posterior))


def mi_init_host(num_subsets: int) -> MIHostState:
    """Uniform posterior over ``num_subsets`` candidates, nothing charged."""
    return MIHostState(np.full(int(num_subsets), -math.log(num_subsets)), 0.0, False)


def host_generator(key: jax.Array) -> np.random.Generator:
    """A numpy generator seeded with every word of ``key``'s data: the host side's draws are a
    function of the key alone (same key, same draws). Keep ``key`` as secret as the draws."""
    words = np.asarray(jax.random.key_data(key), np.uint32).reshape(-1)
    return np.random.default_rng(np.random.SeedSequence(words.tolist()))


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


def zpl_release(signs: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """PACZero-ZPL for K directions: the common sign where all M candidate signs agree, else a
    fair coin. Jittable.

    ``signs``: (K, M) int8 ±1; ``key``: the step's coin key (coin k is bit k of
    ``bernoulli(key, 0.5, (K,))``). Returns Y (K,) float32 ±1 and the unanimity flags (K,) bool.
    The secret is not an argument: the release cannot depend on it (zero mutual information).
    """
    agree = all_agree(signs)
    coins = jnp.where(jax.random.bernoulli(key, 0.5, agree.shape), jnp.float32(1.0),
                      jnp.float32(-1.0))
    return jnp.where(agree, signs[..., 0].astype(jnp.float32), coins), agree


def mi_release(signs: np.ndarray, secret: int, log_posterior: np.ndarray, beta: float,
               rng: np.random.Generator, *, faithful: bool = False,
               limit: float | None = None) -> tuple[Release, np.ndarray]:
    """PACZero-MI release of one direction with per-release budget ``beta`` (nats). Host, float64.

    Returns the release and the updated log posterior (M,). PAC-unanimous (q₊ within 1e-12 of 0
    or 1): releases s* with no noise and charges 0. Otherwise β ← min(β, 0.999·H_b(q₊)); with
    β = 0 (budget spent) the caller must stop before calling. σ solves I_BIAWGN(q₊, σ) = β
    conservatively (its certified upper bound is <= β), or with the reference's solver if
    ``faithful``; the charge is max(β, the upper bound at σ), so a faithful σ that leaks more
    than β is charged what it leaks. ``limit`` (nats left in the run's budget): a faithful σ
    whose leak would exceed it is replaced by the conservative one, so the budget still binds.
    ``rng`` is the noise generator (secret; `host_generator` of the step's noise key).
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


def mezo_release(pool_mean: jax.Array) -> jax.Array:
    """MeZO (non-private): the projected gradients themselves, Y = mean clipped ĝ (K,)."""
    return pool_mean.astype(jnp.float32)


def dpzo_release(clipped_sum: jax.Array, key: jax.Array, *, noise_multiplier: float,
                 l2_clip: float, expected_batch_size: float) -> jax.Array:
    """DP-ZO for K directions: (Σ clip(ĝ_i) + N(0, (σ·l2_clip)²)) / expected batch size, float32.

    ``clipped_sum``: (K,) sums over the Poisson sample; ``key``: the step's noise key (secret).
    Jittable; ``noise_multiplier`` σ may be traced."""
    std = jnp.asarray(noise_multiplier, jnp.float32) * jnp.asarray(l2_clip, jnp.float32)
    noise = std * jax.random.normal(key, jnp.shape(clipped_sum), jnp.float32)
    return (clipped_sum.astype(jnp.float32) + noise) / jnp.float32(expected_batch_size)
