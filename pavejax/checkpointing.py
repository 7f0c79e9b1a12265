"""Resumable private training: atomic Orbax checkpoints of a run that never rewind its ledger.

A :class:`TrainCheckpointer` wraps one ``orbax.checkpoint.CheckpointManager``. Each saved step
holds, in one atomically committed step directory:

* ``arrays``: the trainer's array state (trainable parameters, optimiser state, anything else
  it carries) and the raw data of its PRNG key;
* ``meta`` (JSON): the step, the privacy ledger, the budget (target epsilon at delta), a record
  of the run's configuration, and JSON-safe mechanism state (e.g. a numpy generator state or the
  loss history).

Guarantees:
  * A step is either fully on disk or ignored: Orbax writes into a temporary directory and
    renames it on commit, so a run killed (even by SIGKILL) mid-save resumes from the previous
    complete step.
  * Resuming never rewinds the ledger: :meth:`TrainCheckpointer.restore_latest` refuses a
    checkpoint whose ledger holds fewer releases than the caller's in-memory ledger,
    :meth:`TrainCheckpointer.save` refuses one with fewer releases than the latest saved, and a
    run configured differently from the saved one is refused (it would not be the same run).
  * The budget stored with the first checkpoint is binding for the whole run: a resumed run
    cannot change it, and :func:`enforce_budget` raises
    :class:`~pavejax.accounting.BudgetExceededError` before any step that would exceed it.

Sharp edges: a training checkpoint is **not a release**. It holds PRNG key data and mechanism
state that must stay private; publish only the final parameters and the ledger
(:mod:`pavejax.release`). Saves are synchronous (a training state is small next to a step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from dp_accounting import dp_event

from pavejax.accounting import Ledger

__all__ = [
    "Budget",
    "Checkpoint",
    "LedgerRollbackError",
    "RunMismatchError",
    "TrainCheckpointer",
    "enforce_budget",
    "ledger_releases",
    "resolve_budget",
    "run_record",
    "tree_fingerprint",
]

PyTree = Any
_FORMAT, _VERSION = "pavejax.train_checkpoint", 1


class LedgerRollbackError(ValueError):
    """Restoring would give a ledger with fewer releases than the one in memory."""


class RunMismatchError(ValueError):
    """The checkpoint was written by a run with another configuration or budget."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """A privacy budget: the run must stay (epsilon, delta)-DP under its ledger's relation."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        eps, delta = self.epsilon, self.delta
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0 \
                or math.isnan(eps):
            raise ValueError(f"budget epsilon must be a number > 0, got {eps!r}")
        if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 < delta < 1:
            raise ValueError(f"budget delta must be in (0, 1), got {delta!r}")
        object.__setattr__(self, "epsilon", float(eps))
        object.__setattr__(self, "delta", float(delta))

    def to_dict(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "delta": self.delta}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One resumable training state.

    Attributes:
      step: number of steps completed (the next step to run).
      arrays: pytree of arrays (parameters, optimiser state, ...). Restored onto the structure,
        dtypes and shardings of the template given to :meth:`TrainCheckpointer.restore_latest`.
      key: the run's current typed PRNG key, or None.
      ledger: every release made so far.
      run: JSON-safe record of what defines the run (config, noise multiplier, ...); a resumed
        run must present an equal record.
      mechanism: JSON-safe mechanism state (generator state, loss history, ...).
      budget: the binding :class:`Budget`, or None for an unbudgeted run.
    """

    step: int
    arrays: PyTree
    key: jax.Array | None
    ledger: Ledger
    run: dict[str, Any]
    mechanism: dict[str, Any] = dataclasses.field(default_factory=dict)
    budget: Budget | None = None


def ledger_releases(ledger: Ledger) -> int:
    """Number of releases a ledger records: DP events and MI charges, each counted ``count``
    times. Resuming must never make this smaller."""
    return (sum(e.count for e in ledger.entries) + sum(e.count for e in ledger.mi_entries))


def resolve_budget(stored: Budget | None, requested: Budget | None) -> Budget | None:
    """The budget a resumed run keeps: the stored one. A different request raises
    :class:`RunMismatchError` (a budget cannot be raised, or silently lowered, mid-run)."""
    if stored is None or requested is None or stored == requested:
        return stored if stored is not None else requested
    raise RunMismatchError(f"the checkpoint was written with budget (epsilon={stored.epsilon:g}, "
                           f"delta={stored.delta:g}) but this run asks for "
                           f"(epsilon={requested.epsilon:g}, delta={requested.delta:g}); a "
                           "resumed run keeps its budget (start a new run in a new directory)")


def enforce_budget(ledger: Ledger, budget: Budget | None, pending: dp_event.DpEvent,
                   count: int) -> float | None:
    """Raises :class:`~pavejax.accounting.BudgetExceededError` if ``count`` more ``pending``
    events would take ``ledger`` past ``budget``; returns the epsilon the run would reach.

    Checking the whole remaining run once is enough: epsilon grows with every release, so
    no intermediate step can exceed a budget that the final one meets.
    """
    if budget is None or count <= 0:
        return None
    return ledger.check_budget(budget.epsilon, budget.delta, pending=pending,
                               pending_count=int(count))


def tree_fingerprint(tree: PyTree) -> str:
    """sha256 (hex) of a pytree's structure, dtypes, shapes and bytes: a run record can name
    its starting point without storing it."""
    h = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.dtype.str}|{a.shape}\n".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no inf/nan; "inf" compares equal across runs
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


def run_record(trainer: str, config: Any, *, exclude: tuple[str, ...] = (),
               **extra: Any) -> dict[str, Any]:
    """JSON-safe record of a run: the trainer's name, a dataclass ``config`` without the
    ``exclude`` fields, and ``extra`` facts (resolved noise multiplier, fingerprints...)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in exclude}
    fields = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
              for k, v in fields.items()}
    return _json_value({"trainer": trainer, "config": fields, **extra})


def _json_ready(name: str, value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be JSON-safe (dicts, lists, str, finite numbers): "
                        f"{err}") from None


def _abstract(tree: PyTree) -> PyTree:
    def one(x):
        x = x if isinstance(x, jax.Array) else np.asarray(x)
        sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _diff(saved: Any, current: Any, where: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current), key=str):
            out += _diff(saved.get(k), current.get(k), f"{where}.{k}" if where else str(k))
        return out
    return [] if saved == current else [where or "<run>"]


class TrainCheckpointer:
    """Atomic, resumable checkpoints of a private training run (see the module docstring).

    Args:
      directory: where the step directories go (created if missing).
      every: save after every ``every``-th step (trainers also save after the last step).
      max_to_keep: how many recent steps to keep on disk (None keeps all).
      budget: optional :class:`Budget` (or ``(epsilon, delta)``) for the run; the one stored
        with an existing checkpoint is binding.

    Example (any trainer takes it: ``train_task``, ``generate_spec``, PACZero's ``train``, or
    :func:`pavejax.training.run` driving your own step):
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from pavejax.accounting import Ledger, gaussian_step_event
      >>> from pavejax.training import Charge, run
      >>> event = gaussian_step_event(2.0, q=0.01, sampling="poisson")
      >>> def step(x, batch, key):
      ...     return x + jax.random.normal(key), Charge(event), {}
      >>> tmp = tempfile.mkdtemp()
      >>> with TrainCheckpointer(tmp, every=10, budget=(4.0, 1e-5)) as ckpt:
      ...     out = run(step, jnp.float32(0), jax.random.key(0), 20, ledger=Ledger("add_remove"),
      ...               checkpointer=ckpt, run_record={"trainer": "example"}, progress=False)
      >>> ckpt.latest_step()
      20
    """

    def __init__(self, directory: str | os.PathLike[str], *, every: int = 1,
                 max_to_keep: int | None = 2,
                 budget: Budget | tuple[float, float] | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (save every that many steps), got "
                             f"{every!r}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None or an int >= 1, got {max_to_keep!r}")
        self.directory = Path(directory).absolute()
        self.every = every
        self.budget = budget if budget is None or isinstance(budget, Budget) else Budget(*budget)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("arrays", "meta"))

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.close()

    def latest_step(self) -> int | None:
        """The last fully committed step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def should_save(self, step: int, last: bool = False) -> bool:
        """Whether a trainer saves after completing ``step`` steps."""
        return last or step % self.every == 0

    def save(self, ckpt: Checkpoint) -> None:
        """Writes ``ckpt`` as step ``ckpt.step`` (replacing nothing: an existing step is kept).

        The budget saved is ``ckpt.budget`` (the trainer resolves it with
        :func:`resolve_budget`). Raises :class:`LedgerRollbackError` when ``ckpt.ledger`` holds
        fewer releases than the latest saved checkpoint (a saved ledger only grows)."""
        if ckpt.step in self._manager.all_steps():
            return
        latest = self._manager.latest_step()
        if latest is not None:
            saved = ledger_releases(Ledger.from_dict(self._meta(latest)["ledger"]))
            if saved > ledger_releases(ckpt.ledger):
                raise LedgerRollbackError(
                    f"the checkpoint for step {ckpt.step} records {ledger_releases(ckpt.ledger)} "
                    f"releases but step {latest} already saved records {saved}; a saved ledger "
                    "can only grow. Save a state at least as recent as the latest one")
        meta = {"format": _FORMAT, "version": _VERSION, "step": int(ckpt.step),
                "ledger": ckpt.ledger.to_dict(), "run": _json_ready("run", ckpt.run),
                "mechanism": _json_ready("mechanism", ckpt.mechanism),
                "budget": None if ckpt.budget is None else ckpt.budget.to_dict(),
                "has_key": ckpt.key is not None}
        arrays = {"state": ckpt.arrays}
        if ckpt.key is not None:
            arrays["key"] = jax.random.key_data(ckpt.key)
        self._manager.save(int(ckpt.step), args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def _meta(self, step: int) -> dict[str, Any]:
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise ValueError(f"{self.directory} step {step} is not a {_FORMAT} v{_VERSION} "
                             "checkpoint")
        return meta

    def restore_latest(self, like: PyTree | Callable[[dict[str, Any]], PyTree], *,
                       run: dict[str, Any],
                       ledger: Ledger | None = None,
                       key_like: jax.Array | None = None) -> Checkpoint | None:
        """The latest committed checkpoint, or None when there is none.

        Args:
          like: a template of ``arrays`` (same structure, shapes and dtypes); restored arrays get
            its shardings, so a template on a mesh restores onto that mesh. Or a function of the
            saved ``mechanism`` record returning the template, for a trainer whose array
            structure depends on its state (e.g. whether a best-so-far copy exists yet).
          run: the current run record; it must equal the saved one.
          ledger: the in-memory ledger; a checkpoint with fewer releases is refused with
            :class:`LedgerRollbackError` (resuming can never lower the ledger).
          key_like: a key of the PRNG implementation to rewrap the saved key data with.

        Raises :class:`RunMismatchError` naming the differing fields when ``run`` differs.
        """
        step = self.latest_step()
        if step is None:
            return None
        meta = self._meta(step)
        saved_ledger = Ledger.from_dict(meta["ledger"])
        if ledger is not None and ledger_releases(saved_ledger) < ledger_releases(ledger):
            raise LedgerRollbackError(
                f"the latest checkpoint (step {step}) records {ledger_releases(saved_ledger)} "
                f"releases but the ledger in memory already records {ledger_releases(ledger)}; "
                "resuming from it would forget privacy already spent. Keep the in-memory run "
                "or restore a checkpoint at least as recent")
        diff = _diff(meta["run"], _json_ready("run", run))
        if diff:
            raise RunMismatchError(f"the checkpoint in {self.directory} was written by a "
                                   f"different run (fields {diff} differ); resume with the same "
                                   "configuration or use a new directory")
        template = {"state": like(meta["mechanism"]) if callable(like) else like}
        if meta["has_key"]:
            if key_like is None:
                raise ValueError("the checkpoint holds a PRNG key: pass key_like")
            template["key"] = jax.random.key_data(key_like)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(_abstract(template))))["arrays"]
        key = None
        if meta["has_key"]:
            key = jax.random.wrap_key_data(restored["key"], impl=jax.random.key_impl(key_like))
        budget = None if meta["budget"] is None else Budget(**meta["budget"])
        return Checkpoint(step=int(meta["step"]), arrays=restored["state"], key=key,
                          ledger=saved_ledger, run=meta["run"], mechanism=meta["mechanism"],
                          budget=budget)
