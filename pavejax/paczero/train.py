"""Zeroth-order training runs: MeZO, DP-ZO, PACZero-ZPL and PACZero-MI on the one driver.

`train` runs the pure steps of :mod:`pavejax.paczero.step` through `pavejax.training.run`, which
owns checkpoint/resume, budget enforcement, the progress bar and ``lax.scan`` over
``steps_per_call`` steps per host call. What stays here is PACZero's own:

* **dev selection**: ``dev_fn(trainable, frozen)`` (jittable, lower is better) is evaluated on
  the device every ``eval_every`` steps and after step T, and the best θ is kept in the run
  state (so a resumed run selects exactly as an uninterrupted one); the dev data lies outside
  the pool, so selection does not touch the secret;
* **PACZero-MI's host phase**: the driver's ``host`` hook runs `mi_host_release` after each
  device phase, applies its update and charges its nats; it refuses to continue a run whose
  charges exceed ``mi_budget``. Its float64 state is checkpointed bit for bit;
* **DP-ZO's budget**: a checkpointer's (ε, δ) budget is checked against the whole run of T steps
  before the first step (the driver then re-checks the remaining steps after a resume).

Every step's secret randomness is ``step_key(state)`` = ``fold_in(state.secret_key, state.step)``,
so a run continued from a returned `ZORun`, resumed from a checkpoint or run uninterrupted
draws the same coins, noise and samples, and ends bit for bit the same (θ, best copy, posterior,
charges, counts, ledger). The checkpoint holds the secret key and index: keep it private, it is
not a release.

Cost: a one-direction step draws z once, runs the inference forward twice (θ + εz, then its
mirror θ − εz) and updates θ along the realised perturbation (θ − mirror)/ε: about two forward
passes and inference memory plus one or two copies of the trainable weights (plus the best copy
with dev selection).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pavejax import training
from pavejax.accounting import BudgetExceededError, Ledger
from pavejax.checkpointing import TrainCheckpointer, enforce_budget, run_record, tree_fingerprint
from pavejax.paczero import mechanisms as mech
from pavejax.paczero.step import (
    MIRelease,
    ZOConfig,
    ZOState,
    _num_examples,
    dpzo_noise_multiplier,
    mi_apply,
    mi_device_phase,
    mi_host_release,
    step,
    step_charge,
    step_key,
)
from pavejax.privacy.checks import check_step

__all__ = ["Selection", "ZORun", "train"]

PyTree = Any
_MI_ROUNDING = 1e-12  # relative slack of summing per-step charges in another order


class Selection(NamedTuple):
    """Dev selection on the device: ``best`` θ, its dev loss ``dev`` (float32, +inf before the
    first evaluation) and ``step`` (int32, -1 before it)."""

    best: PyTree
    dev: jax.Array
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class ZORun:
    """What `train` returns; pass it back to `train` to continue the run.

    state: the final `ZOState` (holds the secret key and index: private). ledger: every charge
    of the run (DP events for DP-ZO, nats for MI, a non-private event for MeZO: ε = ∞; ZPL
    charges 0 nats).
    selection: the dev selection or None. host: PACZero-MI's `MIHostState` or None.
    noise_multiplier: DP-ZO's σ (relative to l2_clip) or None. origin: fingerprint of θ at
    step 0 (names the run's starting point in its checkpoints).
    """

    config: ZOConfig
    state: ZOState
    ledger: Ledger
    selection: Selection | None = None
    host: mech.MIHostState | None = None
    noise_multiplier: float | None = None
    origin: str | None = None

    @property
    def step(self) -> int:
        """Steps done."""
        return int(self.state.step)

    @property
    def trainable(self) -> PyTree:
        """The last θ."""
        return self.state.trainable

    @property
    def unanimity_rate(self) -> float:
        """Fraction of releases that needed no coin or noise (0 before the first release)."""
        return float(self.state.unanimity_rate)

    @property
    def mi_used(self) -> float:
        """Mutual information charged so far (nats): 0 for ZPL, the MI charges for MI."""
        return self.host.mi_used if self.host is not None else self.ledger.mutual_information()

    @property
    def stopped(self) -> bool:
        """PACZero-MI spent its budget before step T (later steps released nothing)."""
        return self.host is not None and bool(self.host.stopped)

    @property
    def best(self) -> PyTree | None:
        """The dev-selected θ, or None (no dev_fn, or no evaluation yet)."""
        return None if self.best_step is None else self.selection.best

    @property
    def best_dev(self) -> float | None:
        """Its dev loss, or None."""
        return None if self.best_step is None else float(self.selection.dev)

    @property
    def best_step(self) -> int | None:
        """The step it was taken at, or None."""
        if self.selection is None or int(self.selection.step) < 0:
            return None
        return int(self.selection.step)


def _select(config: ZOConfig, dev_fn: Callable | None, sel: Selection | None,
            state: ZOState, frozen: PyTree) -> Selection | None:
    """Evaluates θ after steps that are a multiple of ``eval_every`` and after step T."""
    if sel is None:
        return None
    t = state.step
    due = t == config.steps
    if config.eval_every:
        due = due | (t % config.eval_every == 0)

    def evaluate(sel):
        value = jnp.asarray(dev_fn(state.trainable, frozen), jnp.float32).reshape(())
        better = value < sel.dev
        best = jax.tree.map(lambda b, x: jnp.where(better, x, b), sel.best, state.trainable)
        return Selection(best, jnp.where(better, value, sel.dev), jnp.where(better, t, sel.step))

    return jax.lax.cond(due, evaluate, lambda s: s, sel)


@functools.lru_cache(maxsize=32)
def _driver_step(config: ZOConfig, loss_fn: Callable, dev_fn: Callable | None,
                 sigma: float | None, optimizer: optax.GradientTransformation | None):
    """The driver's step ``((state, selection), (pool, frozen), key) -> ...`` (cached, so that
    runs of one configuration share one compilation). The driver's key is not used: the step
    key comes from the state, so a run continued in memory draws what an uninterrupted one
    draws."""

    def run_step(carry, data, _):
        state, sel = carry
        pool, frozen = data
        if config.mechanism == "mi":  # device phase only; the host hook releases and updates
            signals = mi_device_phase(config, loss_fn, state, pool, step_key(state),
                                      frozen=frozen)
            return carry, training.Charge(label=config.label), signals
        state, charge, stats = step(config, loss_fn, state, pool, step_key(state),
                                    frozen=frozen, noise_multiplier=sigma, optimizer=optimizer)
        return (state, _select(config, dev_fn, sel, state, frozen)), charge, stats

    return run_step


@functools.lru_cache(maxsize=32)
def _mi_finish(config: ZOConfig, dev_fn: Callable | None,
               optimizer: optax.GradientTransformation | None):
    def finish(carry, values, agree, frozen):
        state, sel = carry
        release = MIRelease(values, agree, None, None)  # what the update reads
        state = mi_apply(config, state, release, optimizer=optimizer)
        return state, _select(config, dev_fn, sel, state, frozen)

    return jax.jit(finish, donate_argnums=0)


def _pack(host: mech.MIHostState) -> dict[str, np.ndarray]:
    # The driver checkpoints arrays; float64 would come back float32 without x64, so the
    # posterior and the nats travel as their bits.
    return {"log_posterior": np.asarray(host.log_posterior, np.float64).view(np.uint32),
            "mi_used": np.asarray([host.mi_used], np.float64).view(np.uint32),
            "stopped": np.asarray(bool(host.stopped))}


def _unpack(packed: dict[str, Any]) -> mech.MIHostState:
    bits = np.ascontiguousarray(np.asarray(packed["log_posterior"], np.uint32))
    used = np.ascontiguousarray(np.asarray(packed["mi_used"], np.uint32))
    return mech.MIHostState(bits.view(np.float64).copy(), float(used.view(np.float64)[0]),
                            bool(np.asarray(packed["stopped"])))


def _check_mi_budget(config: ZOConfig, used: float, what: str) -> None:
    if used > config.mi_budget * (1.0 + _MI_ROUNDING):
        raise BudgetExceededError(f"the run has charged {used:.6g} nats but mi_budget is "
                                  f"{config.mi_budget:g}: {what}")


def _mi_host(config: ZOConfig, finish: Callable, frozen: PyTree) -> Callable:
    def host(packed, carry, signals, t):
        state = _unpack(packed)
        _check_mi_budget(config, state.mi_used, "it cannot continue (the checkpoint is "
                         "inconsistent with its budget; start a new run)")
        state, release, nats = mi_host_release(config, state, signals)
        _check_mi_budget(config, state.mi_used, "this step's release is refused")
        carry = finish(carry, jnp.asarray(release.values), jnp.asarray(release.unanimous),
                       frozen)
        return _pack(state), carry, training.Charge(nats=nats, label=config.label)

    return host


def _origin(state: ZOState) -> str | None:
    if int(state.step):
        return None
    leaves = jax.tree.leaves(state.trainable)
    if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return None  # spread over hosts: no one process can hash it
    return tree_fingerprint(state.trainable)


def _check_budget(config: ZOConfig, checkpointer: TrainCheckpointer | None, pool_size: int,
                  sigma: float | None) -> None:
    if checkpointer is None or checkpointer.budget is None:
        return
    if config.mechanism != "dpzo":
        raise ValueError(f"a checkpointer budget (epsilon, delta) binds DP-ZO runs only; "
                         f"mechanism {config.mechanism!r} is bounded in nats by its config "
                         "(mi_budget for 'mi', 0 for 'zpl') or not private ('mezo'): create "
                         "the TrainCheckpointer without a budget")
    # The whole run of T steps must fit, not only the steps of this call.
    enforce_budget(Ledger("replace_one", "pld"), checkpointer.budget,
                   step_charge(config, pool_size, sigma).event, config.steps)


def train(config: ZOConfig, loss_fn: Callable, state: ZOState | ZORun, frozen: PyTree,
          pool: PyTree, *, dev_fn: Callable[[PyTree, PyTree], jax.Array] | None = None,
          until: int | None = None, checkpointer: TrainCheckpointer | None = None,
          optimizer: optax.GradientTransformation | None = None, steps_per_call: int = 1,
          progress: bool = False) -> ZORun:
    """Runs steps ``state.step .. until`` (default T) and returns a `ZORun`.

    ``state``: a fresh `pavejax.paczero.init` state (step 0), or the `ZORun` of an earlier call
    to continue it. ``pool``: pytree of arrays with a leading example axis N (the candidate pool
    for PACZero, the private training set for MeZO/DP-ZO). ``loss_fn(trainable, frozen,
    example)`` -> scalar. ``dev_fn(trainable, frozen)`` -> dev loss for selection (lower is
    better), a jittable function: it runs inside the compiled step, with ``frozen`` passed as
    an argument (close over the dev data only). ``optimizer``: an optax transformation fed the
    pseudo-gradient (the state must come from ``init(..., optimizer=...)``), or None for SGD on
    `schedule`.
    ``steps_per_call``: steps per compiled ``lax.scan`` (MeZO, DP-ZO, ZPL; MI needs 1).
    ``progress`` shows a bar.

    With ``checkpointer`` the run resumes from its latest checkpoint when there is one (``state``
    is then only the template: a fresh state, even with another secret key, resumes the saved
    run with the saved secrets), and saves every ``checkpointer.every`` steps and when it
    returns. Refusals before the first step: ``RunMismatchError`` (another config, public key,
    pool size, DP-ZO σ or starting θ), ``LedgerRollbackError`` (``state``'s ledger is ahead of
    the checkpoint; both from :mod:`pavejax.checkpointing`),
    :class:`~pavejax.accounting.BudgetExceededError` when DP-ZO's T steps would exceed the
    checkpointer's (epsilon, delta) budget (the one stored with the first checkpoint binds) or
    an MI run's charges exceed ``mi_budget``.
    """
    n = _num_examples(pool)
    previous = state if isinstance(state, ZORun) else None
    if previous is not None and previous.config != config:
        raise ValueError("this ZORun was trained with another config; continue it with its own")
    state = previous.state if previous is not None else state
    start = int(state.step)
    if previous is None and start:
        raise ValueError(f"the state is at step {start}: continue a run from the ZORun that "
                         "train returned (it holds the run's ledger), or start from init(...)")
    until = config.steps if until is None else min(int(until), config.steps)
    sigma = dpzo_noise_multiplier(config, n) if config.mechanism == "dpzo" else None
    _check_budget(config, checkpointer, n, sigma)
    if previous is not None:
        ledger = Ledger.from_dict(previous.ledger.to_dict())
        sel, host, origin = previous.selection, previous.host, previous.origin
    else:
        ledger, host, origin = Ledger("replace_one", "pld"), None, _origin(state)
        sel = None if dev_fn is None else Selection(
            state.trainable, jnp.full((), jnp.inf, jnp.float32), jnp.full((), -1, jnp.int32))
        if config.mechanism == "mi":
            host = mech.mi_init_host(config.num_subsets)
    if checkpointer is not None and start and checkpointer.latest_step() is None:
        raise ValueError(f"the run is at step {start} but {checkpointer.directory} holds no "
                         "checkpoint of it: a checkpointed run starts at step 0")
    hook = None
    if config.mechanism == "mi":
        hook = _mi_host(config, _mi_finish(config, dev_fn, optimizer), frozen)
    record = None if checkpointer is None else run_record(
        "paczero", config, public_key=np.asarray(jax.random.key_data(state.public_key)).tolist(),
        pool_size=n, origin=origin, noise_multiplier=sigma)
    carry = jax.tree.map(jnp.copy, (state, sel))  # donated to the steps; the caller's stay valid
    out = training.run(_driver_step(config, loss_fn, dev_fn, sigma, optimizer), carry, None,
                       until if checkpointer is not None else max(until - start, 0),
                       batch=(pool, frozen), ledger=ledger, checkpointer=checkpointer,
                       run_record=record, steps_per_call=steps_per_call, check=check_step,
                       host=hook, host_state=None if host is None else _pack(host),
                       progress=progress, desc=config.mechanism, donate=True)
    state, sel = out.state
    return ZORun(config, state, out.ledger, sel,
                 None if out.host_state is None else _unpack(out.host_state), sigma, origin)
