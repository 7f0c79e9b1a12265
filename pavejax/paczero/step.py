"""PACZero's functional core: the run state as a pytree, `init`, and one pure step per mechanism.

``state = init(config, trainable, pool_size, key=..., public_key=...)`` builds a `ZOState`
(arrays only: θ, the step counter, the keys, the membership matrix, the secret index, the
unanimity counts and an optional optax state). Then, for MeZO, DP-ZO and ZPL:

    state, charge, stats = step(config, loss_fn, state, pool, key, frozen=...)

is pure: no host reads, no Python-side mutation, so it jits, and ``lax.scan`` runs many steps
with no host synchronisation. ``key`` is the step's **secret** key: ZPL's coins, DP-ZO's
Poisson sample and noise, MI's noise all come from it (`step_key` gives the trainer's choice,
``fold_in(state.secret_key, state.step)``). The directions come from the **public** key in the
state (`direction_keys(state.public_key, state.step, K)`). ``charge`` is a
:class:`pavejax.training.Charge`: DP-ZO's static ``DpEvent``
(`pavejax.accounting.dpzo_step_event`), ZPL's 0 nats (`pavejax.paczero.mechanisms.ZPL_NATS`:
its releases are independent of the secret by construction) and a ``NonPrivateDpEvent`` for
MeZO (not private: its ledger says ε = ∞).

**PACZero-MI is two-phase**, because its release needs float64 and an exact posterior:

    signals = mi_device_phase(config, loss_fn, state, pool, key)        # jittable: signs
    host, release, nats = mi_host_release(config, host, signals)        # host numpy float64
    state = mi_apply(config, state, release)                            # jittable: update

`mi_device_phase` computes the K × M candidate signs at θ; `mi_host_release` reads them, draws
the noise from a numpy generator seeded by the step's key, updates the float64 posterior in
`MIHostState` and returns the K released signs and the nats charged; `mi_apply` takes the
update step (regenerating each z_k from its public key). The secret index crosses to the host inside
``signals`` (the host phase is the mechanism, not a release).

**Updates.** Without an optimiser (default) a step is SGD with the linear-decay `schedule`, along
the realised perturbation for K = 1 (`update_from_mirror`: memory of inference, no second draw of
z) and by regenerating each z_k otherwise. With ``optimizer`` (any ``optax.GradientTransformation``)
the step feeds the pseudo-gradient (1/K) Σ_k Y_k z_k (`pseudo_gradient`) to it instead, e.g.
``optax.adam(...)``; ``optax.sgd(schedule(config))`` gives the default update up to rounding.

Secrets: ``secret_key``, ``secret`` and the step keys are private; ``public_key``, the membership
matrix, the released Y and θ are public. Nothing here puts a secret into ``stats`` except
``signals`` (MI's host input).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event

from pavejax.accounting import calibrate, dpzo_step_event, run_event
from pavejax.paczero import mechanisms as mech
from pavejax.paczero.perturb import (
    _num_examples,
    apply_directions,
    clip_differences,
    direction_keys,
    pseudo_gradient,
    two_point_differences,
    update_from_mirror,
)
from pavejax.paczero.subsets import (
    _check_key,
    draw_secret,
    membership_matrix,
    subset_means,
    subset_signs,
)
from pavejax.privacy import SamplingConfig, take_batch
from pavejax.training import Charge

__all__ = [
    "MIRelease", "MISignals", "ZOConfig", "ZOState", "dpzo_noise_multiplier", "init",
    "mi_apply", "mi_device_phase", "mi_host_release", "schedule", "step", "step_charge",
    "step_key",
]

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]
_INIT = 2**32 - 1  # fold_in data reserved for init's draws; steps use 0 .. 2^31 - 1
_COIN, _SAMPLE, _NOISE = 0, 1, 2  # what a step key is folded with for each use


@dataclasses.dataclass(frozen=True)
class ZOConfig:
    """Hyper-parameters of a zeroth-order run (validated on construction).

    mechanism: ``"mezo"``, ``"dpzo"``, ``"zpl"`` or ``"mi"``. steps: T. learning_rate: η₀ (linear
    decay to ``lr_end``). perturbation_scale: the step ε of the two-point differences (not a
    privacy parameter). l2_clip: per-example bound C on |ĝ_i| (the DP-ZO sensitivity).
    num_directions: K. num_subsets: M (even). mi_budget: B in nats (``"mi"``).
    faithful: reproduce the reference σ solver; its σ can leak more than the per-step budget
    (up to ~50x at β = 1e-8), which is then charged, and it falls back to the conservative σ
    where that would overrun ``mi_budget``. target_epsilon / delta / dp_batch_size: DP-ZO's
    target, (ε, δ)-DP for one pool example replaced (the pool size is public), and the expected
    Poisson batch. microbatch_size: forward chunk size. eval_every: dev evaluation period (0 =
    only at the end).
    """

    mechanism: str
    steps: int
    learning_rate: float
    lr_end: float = 1e-7
    perturbation_scale: float = 1e-3
    l2_clip: float = 25.0
    num_directions: int = 1
    num_subsets: int = 128
    mi_budget: float | None = None
    faithful: bool = False
    target_epsilon: float | None = None
    delta: float = 1e-5
    dp_batch_size: int | None = None
    microbatch_size: int | None = None
    eval_every: int = 0

    def __post_init__(self):
        if self.mechanism not in mech.KINDS:
            raise ValueError(f"mechanism must be one of {mech.KINDS}, got {self.mechanism!r}")
        for name in ("steps", "num_directions"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("learning_rate", "perturbation_scale", "l2_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.num_subsets < 2 or self.num_subsets % 2:
            raise ValueError(f"num_subsets must be an even integer >= 2, got {self.num_subsets}")
        if self.mechanism == "mi" and not (self.mi_budget is not None and self.mi_budget > 0):
            raise ValueError("mechanism 'mi' needs mi_budget > 0 (nats), e.g. 0.33 (≈ ε=2 at "
                             "the MIA level)")
        if self.mechanism == "dpzo" and (self.target_epsilon is None
                                          or self.dp_batch_size is None):
            raise ValueError("mechanism 'dpzo' needs target_epsilon and dp_batch_size (the "
                             "expected Poisson batch size)")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")

    @property
    def label(self) -> str:
        """The ledger label of this mechanism's charges, ``"paczero/<mechanism>"``."""
        return f"paczero/{self.mechanism}"


class ZOState(NamedTuple):
    """The state of a zeroth-order run: a pytree of arrays (jit, scan and checkpoint it).

    step: int32 (), steps done. trainable: θ. opt_state: the optax state (None on the default
    SGD path). public_key: typed key of the directions (public). secret_key: typed key the step
    keys derive from (`step_key`; secret). membership: (N, M) bool, public (ZPL/MI; else None).
    secret: int32 () index j* of the secret subset (ZPL/MI; else None; secret). unanimous /
    releases: int32 () counts of releases that needed no coin or noise, and of all releases.
    """

    step: jax.Array
    trainable: PyTree
    opt_state: PyTree
    public_key: jax.Array
    secret_key: jax.Array
    membership: jax.Array | None
    secret: jax.Array | None
    unanimous: jax.Array
    releases: jax.Array

    @property
    def unanimity_rate(self) -> jax.Array:
        """Fraction of releases that needed no coin or noise (0 before the first one)."""
        return self.unanimous.astype(jnp.float32) / jnp.maximum(self.releases, 1).astype(
            jnp.float32)


def schedule(config: ZOConfig) -> optax.Schedule:
    """η_t = (η₀ − η_end)(1 − t/T) + η_end: HF polynomial decay of power 1, no warm-up (the
    default SGD update's rate; pass it to an optax optimiser to reproduce that update)."""
    return optax.linear_schedule(config.learning_rate, config.lr_end, config.steps)


def init(config: ZOConfig, trainable: PyTree, pool_size: int, *, key: jax.Array,
         public_key: jax.Array, optimizer: optax.GradientTransformation | None = None
         ) -> ZOState:
    """The state at step 0.

    ``key`` (secret; use `pavejax.privacy.fresh_key`) becomes ``secret_key``; the secret index
    j* is drawn from ``fold_in(key, 2**32 − 1)`` (steps fold in their counter, which never gets
    there). ``public_key`` drives the directions and, through ``fold_in(public_key, 2**32 − 1)``,
    the membership matrix: both are public. A fixed ``key`` replays the secret and every coin
    and noise draw, so such a run is not private: for tests only. ``optimizer``: the optax
    transformation the steps will use (its state is initialised here), or None for SGD.
    """
    _check_key(key, "key")
    _check_key(public_key, "public_key")
    if np.array_equal(jax.random.key_data(key), jax.random.key_data(public_key)):
        raise ValueError("key is the secret key and public_key is public: they must differ "
                         "(draw key with pavejax.privacy.fresh_key())")
    if isinstance(pool_size, bool) or not isinstance(pool_size, int | np.integer) \
            or pool_size < 1:
        raise ValueError(f"pool_size must be an integer >= 1, got {pool_size!r}")
    if config.mechanism == "dpzo" and config.dp_batch_size > pool_size:
        raise ValueError(f"dp_batch_size {config.dp_batch_size} exceeds the pool of {pool_size} "
                         "examples: lower it")
    membership = secret = None
    if config.mechanism in ("zpl", "mi"):
        membership = membership_matrix(jax.random.fold_in(public_key, _INIT), int(pool_size),
                                       config.num_subsets)
        secret = draw_secret(jax.random.fold_in(key, _INIT), config.num_subsets)
    def zero():  # one buffer per counter, so the state can be donated
        return jnp.zeros((), jnp.int32)

    return ZOState(step=zero(), trainable=trainable,
                   opt_state=None if optimizer is None else optimizer.init(trainable),
                   public_key=public_key, secret_key=key, membership=membership, secret=secret,
                   unanimous=zero(), releases=zero())


def step_key(state: ZOState) -> jax.Array:
    """The secret key of the state's next step, ``fold_in(state.secret_key, state.step)`` (what
    `pavejax.paczero.train` uses; any other secret key works with `step`)."""
    return jax.random.fold_in(state.secret_key, state.step)


@functools.lru_cache(maxsize=64)
def _dp_noise_multiplier(epsilon: float, delta: float, q: float, steps: int,
                         num_directions: int) -> float:
    return calibrate(lambda z: run_event(dpzo_step_event(z, num_directions=num_directions, q=q),
                                         steps), epsilon, delta, relation="replace_one",
                     accountant="pld")


def dpzo_noise_multiplier(config: ZOConfig, pool_size: int) -> float:
    """DP-ZO's σ (noise std / C per direction) meeting ``config.target_epsilon`` at
    ``config.delta`` over ``config.steps`` steps, replace-one, PLD (host; cached per setting)."""
    if config.mechanism != "dpzo":
        raise ValueError(f"only DP-ZO has a noise multiplier, not {config.mechanism!r}")
    return _dp_noise_multiplier(float(config.target_epsilon), float(config.delta),
                                config.dp_batch_size / int(pool_size), config.steps,
                                config.num_directions)


def step_charge(config: ZOConfig, pool_size: int, noise_multiplier: float | None = None
                ) -> Charge:
    """The static charge of one MeZO, DP-ZO or ZPL step (MI's is computed by its host phase).

    DP-ZO: its `dpzo_step_event` (needs ``noise_multiplier``); ZPL: `mech.ZPL_NATS` = 0 nats;
    MeZO: a ``NonPrivateDpEvent`` (its releases are exact pool means: a ledger holding it
    reports ε = ∞). Labelled ``config.label``."""
    if config.mechanism == "dpzo":
        if noise_multiplier is None:
            raise ValueError("a DP-ZO step needs its noise_multiplier: "
                             "dpzo_noise_multiplier(config, pool_size)")
        event = dpzo_step_event(float(noise_multiplier), num_directions=config.num_directions,
                                q=config.dp_batch_size / int(pool_size))
        return Charge(event=event, label=config.label)
    if config.mechanism == "mezo":
        return Charge(event=dp_event.NonPrivateDpEvent(),
                      label=config.label)
    return Charge(nats=jnp.full((), mech.ZPL_NATS, jnp.float32), label=config.label)


def _differences(config: ZOConfig, loss_fn: LossFn, state: ZOState, batch: PyTree,
                 mask: jax.Array, frozen: PyTree, *, mirror: bool = True):
    """The K direction keys, the clipped masked ĝ (K, n) and, for K = 1 (if ``mirror``), the
    mirror θ − εz."""
    keys = direction_keys(state.public_key, state.step, config.num_directions)
    scale = jnp.float32(config.perturbation_scale)
    one = mirror and config.num_directions == 1
    rows, mirror = [], None
    for k in range(config.num_directions):
        out = two_point_differences(loss_fn, state.trainable, frozen, batch, keys[k], scale,
                                    config.microbatch_size, return_mirror=one)
        g, point = out if one else (out, None)
        rows.append(g)
    g = clip_differences(jnp.stack(rows), config.l2_clip) * mask.astype(jnp.float32)[None]
    return keys, g, point


def _apply(config: ZOConfig, state: ZOState, keys: jax.Array, values: jax.Array,
           agree: jax.Array, mirror: PyTree | None,
           optimizer: optax.GradientTransformation | None) -> ZOState:
    """θ ← the update with released ``values`` (K,); counts and the step move on."""
    theta, opt_state = state.trainable, state.opt_state
    if optimizer is None:
        lr = schedule(config)(state.step)
        if mirror is not None:
            theta = update_from_mirror(theta, mirror, values, lr, config.perturbation_scale)
        else:
            theta = apply_directions(theta, keys, values, lr)
    else:
        if opt_state is None:
            raise ValueError("this state has no optimiser state: build it with "
                             "init(..., optimizer=the same optimizer)")
        updates, opt_state = optimizer.update(pseudo_gradient(theta, keys, values), opt_state,
                                              theta)
        theta = optax.apply_updates(theta, updates)
    return state._replace(step=state.step + 1, trainable=theta, opt_state=opt_state,
                          unanimous=state.unanimous + jnp.sum(agree.astype(jnp.int32)),
                          releases=state.releases + jnp.int32(values.shape[0]))


def step(config: ZOConfig, loss_fn: LossFn, state: ZOState, pool: PyTree, key: jax.Array, *,
         frozen: PyTree = None, noise_multiplier: float | jax.Array | None = None,
         optimizer: optax.GradientTransformation | None = None
         ) -> tuple[ZOState, Charge, dict[str, jax.Array]]:
    """One MeZO, DP-ZO or ZPL step: ``(state, charge, stats)``. Pure; jit and scan it.

    ``pool``: pytree with a leading example axis N (PACZero's candidate pool, the private set
    for MeZO/DP-ZO, which draws its Poisson sample inside the step). ``loss_fn(trainable,
    frozen, example)`` -> scalar. ``key``: the step's secret key (`step_key` for the trainer's
    stream). ``noise_multiplier``: DP-ZO's σ (`dpzo_noise_multiplier`); the charge's event is
    built from it, so pass a Python float to get the event (a traced σ gives a sweep but no
    event). ``stats``: ``release`` (K,) the released Y (public), ``unanimous`` (int32 count
    this step) and ``overflow`` (DP-ZO: the Poisson draw overflowed its padded batch; refuse the
    step with `pavejax.privacy.check_step`).
    """
    if config.mechanism == "mi":
        raise ValueError("PACZero-MI releases on the host: use mi_device_phase, "
                         "mi_host_release and mi_apply (or pavejax.paczero.train)")
    n = _num_examples(pool)
    mask, overflow = jnp.ones((n,), bool), jnp.zeros((), bool)
    if config.mechanism == "dpzo":
        if noise_multiplier is None:
            raise ValueError("a DP-ZO step needs noise_multiplier: "
                             "dpzo_noise_multiplier(config, pool_size)")
        draw = SamplingConfig("poisson", n, config.dp_batch_size).sample(
            jax.random.fold_in(key, _SAMPLE))
        pool, mask, overflow = take_batch(pool, draw.indices), draw.mask, draw.overflow
    keys, g, mirror = _differences(config, loss_fn, state, pool, mask, frozen)
    agree = jnp.zeros((config.num_directions,), bool)
    if config.mechanism == "mezo":
        values = mech.mezo_release(jnp.sum(g, axis=1) / jnp.float32(n))
    elif config.mechanism == "dpzo":
        values = mech.dpzo_release(jnp.sum(g, axis=1), jax.random.fold_in(key, _NOISE),
                                   noise_multiplier=noise_multiplier, l2_clip=config.l2_clip,
                                   expected_batch_size=config.dp_batch_size)
    else:
        signs = subset_signs(subset_means(g, state.membership))
        values, agree = mech.zpl_release(signs, jax.random.fold_in(key, _COIN))
    state = _apply(config, state, keys, values, agree, mirror, optimizer)
    sigma = noise_multiplier if isinstance(noise_multiplier, int | float) else None
    charge = (step_charge(config, n, sigma) if config.mechanism != "dpzo" or sigma is not None
              else Charge(label=config.label))
    stats = {"release": values, "unanimous": jnp.sum(agree.astype(jnp.int32)),
             "overflow": overflow}
    return state, charge, stats


class MISignals(NamedTuple):
    """What PACZero-MI's device phase hands to its host phase (private: never release it).

    step: int32 () the state's step. signs: (K, M) int8 candidate signs. secret: int32 () j*.
    noise_key: typed key seeding the host's Gaussian noise.
    """

    step: jax.Array
    signs: jax.Array
    secret: jax.Array
    noise_key: jax.Array


class MIRelease(NamedTuple):
    """PACZero-MI's K releases of one step (host arrays): ``values`` (K,) float32 Y = ±1 (0 once
    the budget is spent: no update), ``unanimous`` (K,) bool, ``charged`` (K,) float64 nats,
    ``sigma`` (K,) float64 noise std (NaN where none)."""

    values: np.ndarray
    unanimous: np.ndarray
    charged: np.ndarray
    sigma: np.ndarray


def mi_device_phase(config: ZOConfig, loss_fn: LossFn, state: ZOState, pool: PyTree,
                    key: jax.Array, *, frozen: PyTree = None) -> MISignals:
    """PACZero-MI, device phase: the K × M candidate signs at θ (jittable). θ is not updated."""
    if config.mechanism != "mi":
        raise ValueError(f"mi_device_phase is PACZero-MI's; {config.mechanism!r} uses step")
    n = _num_examples(pool)
    _, g, _ = _differences(config, loss_fn, state, pool, jnp.ones((n,), bool), frozen,
                           mirror=False)
    return MISignals(step=state.step, signs=subset_signs(subset_means(g, state.membership)),
                     secret=state.secret, noise_key=jax.random.fold_in(key, _NOISE))


def mi_host_release(config: ZOConfig, host: mech.MIHostState, signals: MISignals
                    ) -> tuple[mech.MIHostState, MIRelease, float]:
    """PACZero-MI, host phase (numpy float64): ``(host, release, nats)``.

    Per-step budget β_t = `per_step_budget` (B, used, t, T) / K; each direction's release is
    `mech.mi_release` with its noise from `mech.host_generator` (signals.noise_key), so the
    release is a function of the signals alone. ``nats``: what the step charged (the sum of the
    K charges). Once the budget is spent before step T the run stops releasing: later steps
    release 0 (no update) and charge nothing.
    """
    k = config.num_directions
    signs, t = np.asarray(signals.signs), int(signals.step)
    if host.stopped:
        zeros = np.zeros(k)
        return host, MIRelease(zeros.astype(np.float32), np.zeros(k, bool), zeros,
                               np.full(k, np.nan)), 0.0
    rng = mech.host_generator(signals.noise_key)
    beta = mech.per_step_budget(config.mi_budget, host.mi_used, t, config.steps) / k
    logp, rels, secret = host.log_posterior, [], int(signals.secret)
    for j in range(k):
        left = config.mi_budget - math.fsum([host.mi_used, *(r.charged for r in rels)])
        rel, logp = mech.mi_release(signs[j], secret, logp, beta, rng,
                                    faithful=config.faithful, limit=left)
        rels.append(rel)
    used = math.fsum([host.mi_used, *(r.charged for r in rels)])
    host = mech.MIHostState(logp, used, used >= config.mi_budget and t + 1 < config.steps)
    release = MIRelease(np.asarray([r.value for r in rels], np.float32),
                        np.asarray([r.unanimous for r in rels], bool),
                        np.asarray([r.charged for r in rels], np.float64),
                        np.asarray([np.nan if r.sigma is None else r.sigma for r in rels]))
    return host, release, math.fsum(r.charged for r in rels)


def mi_apply(config: ZOConfig, state: ZOState, release: MIRelease, *,
             optimizer: optax.GradientTransformation | None = None) -> ZOState:
    """PACZero-MI, update: θ moves by the released ``release.values`` (jittable; only
    ``values`` and ``unanimous`` are read). Each z_k is regenerated from its public key (the
    host phase sits between the passes and the update, so no mirror point is kept)."""
    keys = direction_keys(state.public_key, state.step, config.num_directions)
    values = jnp.asarray(release.values, jnp.float32)
    return _apply(config, state, keys, values, jnp.asarray(release.unanimous, bool), None,
                  optimizer)
