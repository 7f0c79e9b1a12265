"""Zeroth-order fine-tuning loop: MeZO, DP-ZO, PACZero-ZPL and PACZero-MI in one code path.

Every step t: K public direction keys (`direction_keys`), per-example clipped two-point
differences over the pool (or a Poisson sample for DP-ZO) on the device, the mechanism's K
releases on the host, then θ ← θ − η_t (1/K) Σ_k Y_k z_k with η_t = (η₀ − η_end)(1 − t/T) + η_end.
Works for any trainable pytree (LoRA factors or all weights) and any per-example loss
``loss_fn(trainable, frozen, example)``.

Cost (`device_functions`, `zo_signals`, `zo_update`): a one-direction step draws z once (for
θ + εz), runs the inference forward twice (θ + εz, then its in-place mirror θ − εz) and updates
θ in place along the realised perturbation (θ − mirror)/ε: about two forward passes, and
inference memory plus one copy of the trainable weights. With K > 1 the update regenerates
each z_k.

Dev-set selection evaluates ``dev_fn(trainable)`` (lower is better) every ``eval_every`` steps;
the dev data lies outside the pool, so selection does not touch the secret. With a
:class:`~pavejax.checkpointing.TrainCheckpointer` the run saves its whole state (posterior,
budget used, every generator, the sampling key, ledger; see `pavejax.paczero.checkpoint`) and
resumes from it, so a killed and resumed run equals an uninterrupted one bit for bit.
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

from pavejax.accounting import Ledger, calibrate, dpzo_step_event, run_event
from pavejax.checkpointing import TrainCheckpointer
from pavejax.paczero import mechanisms as mech
from pavejax.paczero.checkpoint import resume, save_state, with_origin
from pavejax.paczero.perturb import (
    apply_directions,
    clip_differences,
    direction_keys,
    mirror_point,
    per_example_losses,
    perturbed,
    update_from_mirror,
)
from pavejax.paczero.subsets import (
    draw_secret,
    membership_matrix,
    subset_means,
    subset_signs,
)
from pavejax.privacy import SamplingConfig, fresh_key, take_batch

__all__ = [
    "DeviceFunctions", "ZOConfig", "ZOState", "device_functions", "init_state", "learning_rate",
    "train", "zo_signals", "zo_update",
]

PyTree = Any


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


@dataclasses.dataclass(frozen=True)
class ZOState:
    """Everything a run needs to continue exactly. Fields marked secret must stay private.

    step: steps done. trainable: current θ. best / best_dev / best_step: dev selection.
    public_seed: seed of the public direction keys. mechanism: posterior, nats used, noise
    generator (secret) and coin generator. membership: (N, M) bool (public) or None. secret: j*
    (secret) or None. charges: nats charged per step. unanimous / releases: counts for the
    unanimity rate. noise_multiplier: σ of DP-ZO (relative to l2_clip) or None. stopped: budget
    exhausted. origin: sha256 fingerprint of θ at step 0 (set by `train`; names the run's
    starting point in its checkpoints) or None. sampling_key: DP-ZO's Poisson-sampling key
    (secret; a full-width typed key, folded with the step) or None.
    """

    step: int
    trainable: PyTree
    public_seed: int
    mechanism: mech.MechanismState
    membership: np.ndarray | None = None
    secret: int | None = None
    charges: tuple[float, ...] = ()
    unanimous: int = 0
    releases: int = 0
    best: PyTree | None = None
    best_dev: float | None = None
    best_step: int | None = None
    noise_multiplier: float | None = None
    stopped: bool = False
    origin: str | None = None
    sampling_key: jax.Array | None = None

    @property
    def unanimity_rate(self) -> float:
        """Fraction of releases that needed no noise (0 before the first release)."""
        return self.unanimous / self.releases if self.releases else 0.0

    @property
    def mi_used(self) -> float:
        """Mutual information charged so far (nats)."""
        return self.mechanism.mi_used

    def ledger(self, config: ZOConfig, pool_size: int, *, label: str = "paczero") -> Ledger:
        """The run's privacy ledger: DP events for DP-ZO, per-step MI charges for ZPL/MI.

        Replace-one neighbouring with the PLD accountant: a release states its pool size, so
        its DP figure must hold between pools of that size (MI charges are relation-free)."""
        led = Ledger("replace_one", "pld")
        if config.mechanism == "dpzo" and self.step:
            led.record(dpzo_step_event(self.noise_multiplier,
                                            q=config.dp_batch_size / pool_size,
                                            num_directions=config.num_directions),
                       count=self.step, label=label)
        elif config.mechanism == "zpl" and self.step:
            led.record_mi(0.0, count=self.step, label=label)
        elif config.mechanism == "mi":
            for c in self.charges:
                led.record_mi(c, label=label)
        return led


def learning_rate(config: ZOConfig, step: int) -> float:
    """η_t = (η₀ − η_end)(1 − t/T) + η_end (HF polynomial decay, power 1, no warm-up)."""
    return (config.learning_rate - config.lr_end) * (1.0 - step / config.steps) + config.lr_end


def init_state(config: ZOConfig, trainable: PyTree, pool_size: int, *, public_seed: int,
               mechanism_seed: int | np.random.SeedSequence,
               secret_seed: int | None = None) -> ZOState:
    """Fresh state.

    ``public_seed`` drives the directions. ``mechanism_seed`` drives what the mechanism may
    reveal: the membership matrix (public) and ZPL's fair coins (released). What must stay
    secret comes from the operating system, from streams that release nothing else: the secret
    index j* (``secrets``), the noise generator (MI and DP-ZO noise) and DP-ZO's Poisson-sampling
    key (`pavejax.privacy.fresh_key`, full width, folded with the step). ``secret_seed``
    replaces the operating system for those three so that a test can replay a run: whoever
    knows it regenerates the secret, the noise and the samples, so such a run is not private
    and must not be released.
    """
    public = np.random.default_rng(mechanism_seed)
    replay = None if secret_seed is None else np.random.SeedSequence(int(secret_seed)).spawn(3)
    membership = secret = None
    if config.mechanism in ("zpl", "mi"):
        membership = membership_matrix(public, pool_size, config.num_subsets)
        secret = draw_secret(None if replay is None else np.random.default_rng(replay[0]),
                             config.num_subsets)
    noise = np.random.default_rng(np.random.SeedSequence() if replay is None else replay[1])
    sigma = key = None
    if config.mechanism == "dpzo":
        sigma = _dp_noise_multiplier(float(config.target_epsilon), float(config.delta),
                                     config.dp_batch_size / pool_size, config.steps,
                                     config.num_directions)
        key = fresh_key() if replay is None else _key_from(replay[2])
    mechanism = mech.init_mechanism_state(
        noise, config.num_subsets, coins=public if config.mechanism == "zpl" else None)
    return ZOState(step=0, trainable=trainable, public_seed=int(public_seed),
                   mechanism=mechanism, membership=membership, secret=secret,
                   noise_multiplier=sigma, sampling_key=key)


def _key_from(seed: np.random.SeedSequence) -> jax.Array:
    """A typed key of the default implementation with every word of its data from ``seed``."""
    like = jax.random.key_data(jax.random.key(0))
    data = seed.generate_state(like.size, np.uint32).astype(like.dtype).reshape(like.shape)
    return jax.random.wrap_key_data(jnp.asarray(data),
                                    impl=jax.random.key_impl(jax.random.key(0)))


def _dp_noise_multiplier(epsilon: float, delta: float, q: float, steps: int,
                         num_directions: int) -> float:
    """σ of DP-ZO (replace-one, PLD), calibrated on the run's own events."""
    return calibrate(lambda z: run_event(dpzo_step_event(z, num_directions=num_directions, q=q),
                                         steps), epsilon, delta, relation="replace_one",
                     accountant="pld")


class DeviceFunctions(NamedTuple):
    """The jitted pieces of a zeroth-order step (see `device_functions`)."""

    perturb: Callable
    forward: Callable
    mirror: Callable
    combine: Callable
    update_mirror: Callable
    update_keys: Callable


def _combine(plus, minus, scale, l2_clip, mask, membership):
    g = (plus - minus) / (jnp.float32(2.0) * scale)
    weight = mask.astype(jnp.float32)
    g = clip_differences(jnp.where(jnp.isfinite(g), g, jnp.float32(0.0)), l2_clip) * weight[None]
    out = {"sum": jnp.sum(g, axis=1)}
    out["mean"] = out["sum"] / jnp.maximum(jnp.sum(weight), jnp.float32(1.0))
    if membership is not None:
        out["signs"] = subset_signs(subset_means(g, membership))
    return out


@functools.lru_cache(maxsize=32)
def device_functions(loss_fn: Callable, microbatch_size: int | None) -> DeviceFunctions:
    """Jitted step pieces for ``loss_fn``, cached per (loss, microbatch size).

    ``perturb(θ, key, ε)`` -> θ + εz; ``forward(θ, frozen, batch)`` -> per-example losses (N,),
    the same computation as inference; ``mirror(θ, point)`` -> 2θ − point, overwriting the
    donated point; ``combine(plus (K, N), minus (K, N), ε, l2_clip, mask, membership)`` -> the
    clipped ``sum``/``mean`` per direction and the subset ``signs`` (K, M);
    ``update_mirror(θ, mirror, Y, η, ε)`` and ``update_keys(θ, keys, Ys, η)`` -> new θ, donating
    θ (the consumed mirror is freed). Separate jits rather than one: the forward is compiled
    once and serves both points, the reflection runs in place, and XLA cannot merge the two
    passes' broadcasts of frozen weights into shared materialised buffers (which made one
    jit holding both passes several times slower than two single passes on CPU). A step
    holds θ, one perturbed copy and one microbatch of activations: inference memory plus one
    copy of θ.
    """
    return DeviceFunctions(
        perturb=jax.jit(perturbed),
        forward=jax.jit(functools.partial(_forward, loss_fn, microbatch_size)),
        mirror=jax.jit(mirror_point, donate_argnums=1),
        combine=jax.jit(_combine),
        update_mirror=jax.jit(update_from_mirror, donate_argnums=0),
        update_keys=jax.jit(apply_directions, donate_argnums=0))


def _forward(loss_fn, microbatch_size, trainable, frozen, batch):
    return per_example_losses(loss_fn, trainable, frozen, batch, microbatch_size)


def zo_signals(fns: DeviceFunctions, trainable: PyTree, frozen: PyTree, batch: PyTree,
               mask: jax.Array, keys: jax.Array, scale: jax.Array, l2_clip: jax.Array,
               membership: jax.Array | None) -> dict[str, Any]:
    """Per-direction signals of one step at θ = ``trainable`` (left untouched).

    For each of the K keys: θ + εz, its losses, the mirror θ − εz in place, its losses; then
    `DeviceFunctions.combine`. Returns device arrays ``sum`` and ``mean`` (K,), ``signs``
    (K, M) with ``membership``, and for K = 1 the ``mirror`` point for `update_from_mirror`.
    Everything is dispatched asynchronously; reading a value waits for the device.
    """
    plus, minus, mirror = [], [], None
    for k in range(keys.shape[0]):
        point = fns.perturb(trainable, keys[k], scale)
        plus.append(fns.forward(point, frozen, batch))
        mirror = fns.mirror(trainable, point)
        del point  # donated to the mirror
        minus.append(fns.forward(mirror, frozen, batch))
    out = fns.combine(jnp.stack(plus), jnp.stack(minus), scale, l2_clip, mask, membership)
    if keys.shape[0] == 1:
        out["mirror"] = mirror
    return out


def zo_update(fns: DeviceFunctions, trainable: PyTree, out: dict[str, Any], keys: jax.Array,
              coefficients: jax.Array, learning_rate: jax.Array, scale: jax.Array) -> PyTree:
    """θ − η (1/K) Σ_k Y_k z_k; with K = 1 from the mirror in ``out`` (consumed), otherwise by
    regenerating each z_k. ``trainable`` is donated: do not use it afterwards."""
    if "mirror" in out:
        return fns.update_mirror(trainable, out.pop("mirror"), coefficients, learning_rate,
                                 scale)
    return fns.update_keys(trainable, keys, coefficients, learning_rate)


def _releases(config: ZOConfig, state: ZOState, out: dict, noise: np.random.Generator,
              coins: np.random.Generator | None) -> tuple[list[mech.Release], mech.MechanismState]:
    k, m = config.num_directions, state.mechanism
    if config.mechanism == "mezo":
        return [mech.mezo_release(v) for v in np.asarray(out["mean"])], m
    if config.mechanism == "dpzo":
        return [mech.dpzo_release(v, noise, noise_multiplier=state.noise_multiplier,
                                  l2_clip=config.l2_clip, expected_batch_size=config.dp_batch_size)
                for v in np.asarray(out["sum"], np.float64)], m
    signs = np.asarray(out["signs"])
    if config.mechanism == "zpl":
        return [mech.zpl_release(signs[j], coins) for j in range(k)], m
    beta = mech.per_step_budget(config.mi_budget, m.mi_used, state.step, config.steps) / k
    logp, rels = m.log_posterior, []
    for j in range(k):
        left = config.mi_budget - math.fsum([m.mi_used, *(r.charged for r in rels)])
        rel, logp = mech.mi_release(signs[j], state.secret, logp, beta, noise,
                                    faithful=config.faithful, limit=left)
        rels.append(rel)
    used = math.fsum([m.mi_used, *(r.charged for r in rels)])
    return rels, dataclasses.replace(m, log_posterior=logp, mi_used=min(used, config.mi_budget))


def _host_copy(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _maybe_eval(state: ZOState, dev_fn: Callable | None) -> ZOState:
    if dev_fn is None:
        return state
    value = float(dev_fn(state.trainable))
    if state.best_dev is None or value < state.best_dev:
        return dataclasses.replace(state, best=_host_copy(state.trainable), best_dev=value,
                                   best_step=state.step)
    return state


def train(config: ZOConfig, loss_fn: Callable, state: ZOState, frozen: PyTree, pool: PyTree,
          *, dev_fn: Callable[[PyTree], float] | None = None, until: int | None = None,
          checkpointer: TrainCheckpointer | None = None, progress: bool = False) -> ZOState:
    """Runs steps ``state.step .. until`` (default T) and returns the new state.

    ``pool``: pytree of arrays with a leading example axis N (the candidate pool for PACZero, the
    private training set for MeZO/DP-ZO). ``loss_fn(trainable, frozen, example)`` -> scalar.
    ``dev_fn(trainable)`` -> dev loss for selection. PACZero-MI stops early once its budget is
    spent. ``progress`` shows a bar with the unanimity rate and the nats used.

    With ``checkpointer`` the run first resumes from its latest checkpoint when there is one
    (`pavejax.paczero.checkpoint.restore_state`: ``state`` is the template, and a fresh
    `init_state` takes the saved membership, secret, generators and sampling key), then saves
    every
    ``checkpointer.every`` steps and when it returns, so a run killed at any point and resumed
    ends bit-identical to an uninterrupted one (θ, best, posterior, charges, counts, ledger).
    Refusals before the first step: ``RunMismatchError`` (another config, public seed, pool size
    or starting θ), ``LedgerRollbackError`` (``state`` is ahead of the checkpoint; both from
    :mod:`pavejax.checkpointing`), and :class:`~pavejax.accounting.BudgetExceededError` when
    DP-ZO's remaining steps would exceed the checkpointer's (epsilon, delta) budget (the one
    stored with the first checkpoint binds) or the charges exceed ``mi_budget``. The checkpoint
    holds the secret index, the generators' states and the sampling key: keep it private, it is
    not a release.
    """
    n = int(jax.tree.leaves(pool)[0].shape[0])
    until = config.steps if until is None else min(int(until), config.steps)
    state = with_origin(state)  # so that a later checkpointer knows where the run started
    budget = None
    if checkpointer is not None:
        state, budget = resume(checkpointer, config, state, n)
    fns = device_functions(loss_fn, config.microbatch_size)
    scale, l2_clip = jnp.float32(config.perturbation_scale), jnp.float32(config.l2_clip)
    membership = None if state.membership is None else jnp.asarray(state.membership)
    public_key = jax.random.key(state.public_seed)
    sampler = (SamplingConfig("poisson", n, config.dp_batch_size)
               if config.mechanism == "dpzo" else None)
    if sampler is not None and state.sampling_key is None:
        raise ValueError("a DP-ZO state needs its secret sampling_key; create it with init_state")
    full_mask = jnp.ones((n,), bool)
    state = dataclasses.replace(state, trainable=jax.tree.map(jnp.copy, state.trainable))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=until, initial=state.step, desc=config.mechanism)
    while state.step < until and not state.stopped:
        noise = state.mechanism.generator()
        coins = state.mechanism.coin_generator() if config.mechanism == "zpl" else None
        keys = direction_keys(public_key, state.step, config.num_directions)
        batch, mask = pool, full_mask
        if sampler is not None:
            idx, mask = sampler.sample(jax.random.fold_in(state.sampling_key, state.step))
            batch = take_batch(pool, idx)
        out = zo_signals(fns, state.trainable, frozen, batch, mask, keys, scale, l2_clip,
                         membership)
        rels, mstate = _releases(config, state, out, noise, coins)
        mstate = dataclasses.replace(
            mstate, rng_state=noise.bit_generator.state,
            coin_state=mstate.coin_state if coins is None else coins.bit_generator.state)
        coeffs = jnp.asarray([r.value for r in rels], jnp.float32)
        lr = jnp.float32(learning_rate(config, state.step))
        trainable = zo_update(fns, state.trainable, out, keys, coeffs, lr, scale)
        charged = math.fsum(r.charged for r in rels)
        state = dataclasses.replace(
            state, step=state.step + 1, trainable=trainable, mechanism=mstate,
            charges=(*state.charges, charged) if config.mechanism == "mi" else state.charges,
            unanimous=state.unanimous + sum(r.unanimous for r in rels),
            releases=state.releases + len(rels),
            stopped=config.mechanism == "mi" and mstate.mi_used >= config.mi_budget
            and state.step + 1 < config.steps)
        if config.eval_every and state.step % config.eval_every == 0:
            state = _maybe_eval(state, dev_fn)
        last = state.step >= until or state.stopped  # saved below, after the final selection
        if checkpointer is not None and not last and checkpointer.should_save(state.step):
            save_state(checkpointer, state, config, n, budget=budget)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(unanimity=f"{state.unanimity_rate:.3f}", mi=f"{state.mi_used:.4g}")
    if bar is not None:
        bar.close()
    finished = state.step >= config.steps or state.stopped
    if finished and (not config.eval_every or state.step % config.eval_every):
        state = _maybe_eval(state, dev_fn)  # an interrupted run must not select here
    if checkpointer is not None:
        save_state(checkpointer, state, config, n, budget=budget)
    return state
