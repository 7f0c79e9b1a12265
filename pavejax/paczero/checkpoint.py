"""Zeroth-order runs through :class:`pavejax.checkpointing.TrainCheckpointer` (Orbax).

`save_state` writes a `ZOState` as one atomically committed checkpoint step and `restore_state`
reads the latest one back; :func:`pavejax.paczero.train` does both when given a
``checkpointer``, so a run killed at any point (even by SIGKILL) resumes bit for bit.

A step holds the arrays θ, the dev-selected best copy (once there is one) and the (N, M)
membership matrix (ZPL/MI), DP-ZO's Poisson-sampling key (the checkpoint's key), and as JSON
the secret index j*, the mechanism's float64 log posterior, nats used, the PCG64 states of the
noise and coin generators, the per-step charges, the unanimity counts, the dev selection and
the DP-ZO noise multiplier. Floats are stored as ``float.hex`` text, so they come back bit for
bit (infinities included). The checkpoint's ledger is `ZOState.ledger` (DP events for DP-ZO,
nats for ZPL/MI), so the checkpointer refuses to save or resume a ledger that is lower than one
it already holds.

The checkpoint is **secret**: the secret index says which candidate subset of the pool the run
trained on, and the generator states and the sampling key replay every coin, noise draw and
Poisson sample. Keep it private; it is not a release. Publish only the final parameters and the
ledger (:mod:`pavejax.release` refuses entries named ``secret``, ``rng_state``, ...).

What makes a run the same run: the config, the public seed, the pool size and `ZOState.origin`
(a fingerprint of θ at step 0). The mechanism seed is not part of it: a resumed run takes the
membership matrix, secret, generators and sampling key from the checkpoint, so a fresh
OS-seeded template state resumes the saved run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pavejax.accounting import BudgetExceededError, Ledger, Relation
from pavejax.checkpointing import (
    Budget,
    Checkpoint,
    RunMismatchError,
    TrainCheckpointer,
    enforce_budget,
    resolve_budget,
    run_record,
    tree_fingerprint,
)
from pavejax.accounting import dpzo_step_event
from pavejax.paczero.mechanisms import MechanismState

if TYPE_CHECKING:
    from pavejax.paczero.train import ZOConfig, ZOState

__all__ = ["restore_state", "resume", "save_state", "with_origin"]

PyTree = Any
_PAC = ("zpl", "mi")
_MI_ROUNDING = 1e-12  # relative slack of summing per-step charges in another order


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def _unhex(s: str | None) -> float | None:
    return None if s is None else float.fromhex(s)


def _origin(state: ZOState) -> str | None:
    if state.origin is not None or state.step:
        return state.origin
    leaves = jax.tree.leaves(state.trainable)
    if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return None  # spread over hosts: no one process can hash it
    return tree_fingerprint(state.trainable)


def with_origin(state: ZOState) -> ZOState:
    """``state`` with `ZOState.origin` set to the fingerprint of θ when it is at step 0 (θ is
    then the run's starting point); unchanged otherwise."""
    return state if state.origin is not None else dataclasses.replace(state, origin=_origin(state))


def _run(config: ZOConfig, state: ZOState, pool_size: int) -> dict[str, Any]:
    return run_record("paczero", config, public_seed=int(state.public_seed),
                      pool_size=int(pool_size), origin=_origin(state))


def _record(state: ZOState) -> dict[str, Any]:
    m = state.mechanism
    return {"secret": None if state.secret is None else int(state.secret),
            "log_posterior": [_hex(v) for v in np.asarray(m.log_posterior, np.float64).tolist()],
            "mi_used": _hex(m.mi_used), "rng_state": m.rng_state, "coin_state": m.coin_state,
            "charges": [_hex(c) for c in state.charges], "unanimous": int(state.unanimous),
            "releases": int(state.releases), "has_best": state.best is not None,
            "best_dev": _hex(state.best_dev), "best_step": state.best_step,
            "noise_multiplier": _hex(state.noise_multiplier),
            "stopped": bool(state.stopped), "origin": _origin(state)}


def _arrays(state: ZOState) -> dict[str, PyTree]:
    out = {"trainable": state.trainable}
    if state.best is not None:
        out["best"] = state.best
    if state.membership is not None:
        out["membership"] = np.asarray(state.membership, bool)
    return out


def save_state(checkpointer: TrainCheckpointer, state: ZOState, config: ZOConfig,
               pool_size: int, *, budget: Budget | None = None) -> None:
    """Writes ``state`` as checkpoint step ``state.step`` (an existing step is kept as is).

    ``pool_size``: N, the number of pool examples (it sets the DP-ZO sampling rate of the
    ledger). ``budget``: the run's binding DP budget, stored with the step. Raises
    :class:`~pavejax.checkpointing.LedgerRollbackError` if the state's ledger is lower than the
    latest saved one. The written checkpoint is secret (see the module docstring).
    """
    checkpointer.save(Checkpoint(int(state.step), _arrays(state), state.sampling_key,
                                 state.ledger(config, pool_size), _run(config, state, pool_size),
                                 _record(state), budget))


def _template(config: ZOConfig, state: ZOState, pool_size: int):
    def like(record: dict[str, Any]) -> dict[str, PyTree]:
        out = {"trainable": state.trainable}
        if record.get("has_best"):
            out["best"] = state.trainable
        if config.mechanism in _PAC:
            out["membership"] = np.zeros((pool_size, config.num_subsets), bool)
        return out

    return like


def _key_data(key: jax.Array | None) -> np.ndarray | None:
    return None if key is None else np.asarray(jax.random.key_data(key))


def _same_secrets(a: ZOState, b: ZOState) -> bool:
    if a.secret != b.secret or (a.membership is None) != (b.membership is None):
        return False
    ka, kb = _key_data(a.sampling_key), _key_data(b.sampling_key)
    if (ka is None) != (kb is None) or (ka is not None and not np.array_equal(ka, kb)):
        return False
    return a.membership is None or np.array_equal(a.membership, b.membership)


def _same_ledger(a: Ledger, b: Ledger) -> bool:
    # A ledger of MI charges only is relation-free: one written before DP-ZO moved to
    # replace-one (add/remove, RDP) still describes the same releases.
    return a == b or (not a.entries and not b.entries and a.mi_entries == b.mi_entries)


def _coin_state(config: ZOConfig, record: dict[str, Any]) -> dict[str, Any] | None:
    if "coin_state" in record:
        return record["coin_state"]
    # Written before the coins had their own generator: ZPL drew them from its one generator.
    return record["rng_state"] if config.mechanism == "zpl" else None


def _restore(checkpointer: TrainCheckpointer, config: ZOConfig, state: ZOState,
             pool_size: int) -> tuple[ZOState | None, Budget | None]:
    ckpt = checkpointer.restore_latest(_template(config, state, pool_size),
                                       run=_run(config, state, pool_size),
                                       ledger=state.ledger(config, pool_size),
                                       key_like=state.sampling_key
                                       if state.sampling_key is not None else jax.random.key(0))
    if ckpt is None:
        return None, None
    if ckpt.ledger.entries and ckpt.ledger.relation is not Relation.REPLACE_ONE:
        raise RunMismatchError(f"the checkpoint in {checkpointer.directory} accounts DP-ZO under "
                               f"{ckpt.ledger.relation.value} neighbouring, and its noise was "
                               "calibrated for it; DP-ZO is now accounted under replace-one "
                               "(the pool size is public). Start a new run in a new directory")
    m, a = ckpt.mechanism, ckpt.arrays
    mechanism = MechanismState(np.asarray([_unhex(v) for v in m["log_posterior"]], np.float64),
                               _unhex(m["mi_used"]), m["rng_state"], _coin_state(config, m))
    # The uninterrupted run keeps its best copy on the host.
    best = jax.tree.map(np.array, a["best"]) if m["has_best"] else None
    restored = dataclasses.replace(
        state, step=ckpt.step, trainable=a["trainable"], mechanism=mechanism,
        membership=np.asarray(a["membership"], bool) if "membership" in a else None,
        secret=m["secret"], charges=tuple(_unhex(c) for c in m["charges"]),
        unanimous=m["unanimous"], releases=m["releases"], best=best,
        best_dev=_unhex(m["best_dev"]), best_step=m["best_step"],
        noise_multiplier=_unhex(m["noise_multiplier"]), stopped=m["stopped"],
        origin=m["origin"], sampling_key=ckpt.key)
    if state.step and not _same_secrets(state, restored):
        raise RunMismatchError(f"the state passed (step {state.step}) has another secret subset, "
                               f"membership matrix or sampling key than the checkpoint in "
                               f"{checkpointer.directory}: it belongs to another run. Pass a fresh "
                               "init_state (or this run's state) to resume, or use a new directory")
    if not _same_ledger(restored.ledger(config, pool_size), ckpt.ledger):
        raise ValueError(f"the checkpoint in {checkpointer.directory} (step {ckpt.step}) holds a "
                         "ledger that does not match its own charges and step count; it is "
                         "corrupt: resume from an intact copy or start a new directory")
    return restored, ckpt.budget


def restore_state(checkpointer: TrainCheckpointer, config: ZOConfig, state: ZOState,
                  pool_size: int) -> ZOState | None:
    """The `ZOState` of the latest checkpoint, or None when there is none.

    ``state`` is the template: its trainable gives the structure, dtypes and shardings the
    arrays are restored onto, and with its public seed and origin (and ``config`` and
    ``pool_size``) it must describe the saved run, otherwise
    :class:`~pavejax.checkpointing.RunMismatchError` names the differing fields. A template at
    step 0 (e.g. a fresh, OS-seeded `init_state`) takes the checkpoint's membership matrix,
    secret and generator; a template past step 0 must hold the same secrets, and its ledger may
    not be ahead of the checkpoint's
    (:class:`~pavejax.checkpointing.LedgerRollbackError`). The result holds the saved secrets:
    keep it private.
    """
    return _restore(checkpointer, config, state, pool_size)[0]


def _check_mi_budget(config: ZOConfig, state: ZOState) -> None:
    spent = math.fsum(state.charges)
    if spent > config.mi_budget * (1.0 + _MI_ROUNDING) or state.mi_used > config.mi_budget:
        raise BudgetExceededError(f"the run has charged {spent:.6g} nats but mi_budget is "
                                  f"{config.mi_budget:g}: it cannot continue (the checkpoint "
                                  "is inconsistent with its budget; start a new run)")


def resume(checkpointer: TrainCheckpointer, config: ZOConfig, state: ZOState,
           pool_size: int) -> tuple[ZOState, Budget | None]:
    """What `train` does with a ``checkpointer`` before its first step.

    Returns the state to continue from (the latest checkpoint's, or ``state`` with its origin
    set) and the run's binding DP budget (the stored one, else ``checkpointer.budget``). Raises
    ValueError for a DP budget on a non-DP-ZO run, and
    :class:`~pavejax.accounting.BudgetExceededError` when DP-ZO's remaining steps would exceed
    the budget or an MI run's charges exceed ``config.mi_budget``; errors of `restore_state`
    propagate.
    """
    if checkpointer.budget is not None and config.mechanism != "dpzo":
        raise ValueError(f"a checkpointer budget (epsilon, delta) binds DP-ZO runs only; "
                         f"mechanism {config.mechanism!r} is bounded in nats by its config "
                         "(mi_budget for 'mi', 0 for 'zpl') or not private ('mezo'): create "
                         "the TrainCheckpointer without a budget")
    state = with_origin(state)
    restored, stored = _restore(checkpointer, config, state, pool_size)
    state = state if restored is None else restored
    budget = resolve_budget(stored, checkpointer.budget)
    if config.mechanism == "dpzo" and budget is not None:
        event = dpzo_step_event(state.noise_multiplier, q=config.dp_batch_size / pool_size,
                                num_directions=config.num_directions)
        enforce_budget(state.ledger(config, pool_size), budget, event, config.steps - state.step)
    if config.mechanism == "mi":
        _check_mi_budget(config, state)
    return state, budget
