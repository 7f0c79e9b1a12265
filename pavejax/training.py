"""The one host driver: runs a pure step ``(state, batch, key) -> (state, charge, stats)``.

Every pavejax trainer (DP-S-PAVE, DP-SAM, PACZero) is a pure step plus this driver, and a user's
own step runs the same way. The driver owns what a step cannot do under ``jit``:

* **keys**: step ``t`` gets ``jax.random.fold_in(key, t)``; a resumed run needs only the step
  counter and the key to continue exactly where it stopped (bit-exact);
* **accounting**: each step returns a :class:`Charge` (the ``DpEvent`` of the noise it added, a
  mutual-information charge in nats, or nothing), which the driver records in a
  :class:`~pavejax.accounting.Ledger`; a checkpointer's budget is enforced *before* the first
  step for the whole remaining run (the event is known without running the step);
* **checks**: steps return flags (a Poisson overflow, non-finite examples) in their statistics;
  ``check`` raises on them on the host, before anything of that chunk is saved or returned;
* **many steps per host call**: ``steps_per_call`` steps run in one compiled ``lax.scan``, with
  no host synchronisation in between;
* **checkpoint/resume** through :class:`~pavejax.checkpointing.TrainCheckpointer` (state, key,
  ledger, metric history, budget; a resumed run must present the same run record and never
  rewinds the ledger), and a progress bar.

The step protocol: ``state`` is what the step carries (parameters, optimiser state, ...);
``batch`` is what it reads but does not carry, passed unchanged to every step (the private data
set it samples its batch from, frozen weights, public constants); ``key`` is the step's key.
Passing the data as ``batch`` (rather than closing over it) keeps it an argument of the compiled
call instead of a constant baked into it.

Example (any pure step works):

  >>> import jax, jax.numpy as jnp
  >>> from pavejax.accounting import Ledger
  >>> from pavejax.training import Charge, run
  >>> def step(x, batch, key):
  ...     return x + batch * jax.random.normal(key), Charge(), {"x": x}
  >>> out = run(step, jnp.float32(0), jax.random.key(0), 10, batch=jnp.float32(0.5),
  ...           ledger=Ledger("replace_one"), steps_per_call=5, progress=False)
  >>> out.steps
  10
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import dp_event
from tqdm.auto import tqdm

from pavejax.accounting import Ledger

PyTree = Any
StepFn = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, "Charge", PyTree]]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Charge:
    """The privacy cost of one step, returned by the step itself (principle: accounted where the
    noise is added).

    Attributes:
      event: the ``dp_accounting.DpEvent`` of the step's release (static: identical at every
        step of a run), or None when the step releases nothing that DP accounts for.
      nats: mutual information charged by the step (PAC privacy), an array leaf (may be traced),
        or None when the step makes no PAC release. A release that costs 0 nats (PACZero-ZPL)
        is still a release: it is recorded (at 0 nats), so resuming can never forget it.
      label: the ledger label of the charge (static).
    """

    event: dp_event.DpEvent | None = None
    nats: Any = None
    label: str = ""

    def tree_flatten(self):
        return (self.nats,), (self.event, self.label)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], children[0], aux[1])


class RunResult(NamedTuple):
    """What :func:`run` returns.

    state: the final state; host_state: the final host state (None without a host phase);
    ledger: every charge recorded (including those of a resumed run's earlier part);
    metrics: one host float per step when ``metric`` is given (else empty); steps: steps done.
    """

    state: PyTree
    host_state: PyTree
    ledger: Ledger
    metrics: list[float]
    steps: int


def step_keys(key: jax.Array, start: int | jax.Array, count: int) -> jax.Array:
    """The keys of steps ``start .. start+count-1``: ``fold_in(key, t)`` each."""
    ts = jnp.asarray(start, jnp.uint32) + jnp.arange(count, dtype=jnp.uint32)
    return jax.vmap(lambda t: jax.random.fold_in(key, t))(ts)


def scan_steps(step: StepFn, state: PyTree, batch: PyTree, keys: jax.Array):
    """``lax.scan`` of ``step`` over ``keys`` (``batch`` passed to every step): (state, charges,
    stats) with a leading step axis on the charges' ``nats`` and on every statistic. Pure and
    jittable."""

    def body(s, k):
        s, charge, stats = step(s, batch, k)
        return s, (charge, stats)

    state, (charges, stats) = jax.lax.scan(body, state, keys)
    return state, charges, stats


def charge_of(step: StepFn, state: PyTree, batch: PyTree, key: jax.Array) -> Charge:
    """The :class:`Charge` structure of one step, found by tracing it abstractly (nothing runs):
    its ``event`` is the step's static ``DpEvent``."""
    _, charge, _ = jax.eval_shape(step, state, batch, key)
    if not isinstance(charge, Charge):
        raise TypeError("a step must return (state, Charge, stats); got "
                        f"{type(charge).__name__} as the second item")
    return charge


def record(ledger: Ledger, charge: Charge, nats: np.ndarray | float | None = None,
           count: int = 1, *, label: str | None = None) -> None:
    """Records ``count`` steps' charges: the event ``count`` times (coalesced with the
    ledger's last entry when that is the same event: a run is one entry of count K), and the
    steps' nats (one charge per step when ``nats`` is an array of per-step charges)."""
    name = label if label is not None else charge.label
    if charge.event is not None:  # a NonPrivateDpEvent too: the ledger then says epsilon = inf
        ledger.record(charge.event, count=count, label=name, coalesce=True)
    if charge.nats is None and nats is None:
        return
    per_step = np.asarray(charge.nats if nats is None else nats, np.float64).reshape(-1)
    if not np.all(np.isfinite(per_step)) or np.any(per_step < 0):
        raise ValueError(f"a step charged {per_step.tolist()} nats; a charge must be finite "
                         "and >= 0")
    if per_step.size == 1 or np.all(per_step == per_step[0]):
        ledger.record_mi(float(per_step[0]), count=count if per_step.size == 1 else per_step.size,
                         label=name, coalesce=True)
    else:
        for v in per_step:
            ledger.record_mi(float(v), label=name, coalesce=True)


@functools.lru_cache(maxsize=64)
def _compiled(step: StepFn, count: int, donate: bool):
    def chunk(state, batch, key, start):
        return scan_steps(step, state, batch, step_keys(key, start, count))

    return jax.jit(chunk, donate_argnums=(0,) if donate else ())


def _like_key(key: jax.Array | None) -> jax.Array:
    return jax.random.key(0) if key is None else key


def run(step: StepFn, state: PyTree, key: jax.Array | None, steps: int, *,
        batch: PyTree = None, ledger: Ledger, checkpointer=None,
        run_record: dict[str, Any] | None = None,
        steps_per_call: int = 1, check: Callable[[PyTree], None] | None = None,
        host: Callable[[PyTree, PyTree, PyTree, int], tuple[PyTree, PyTree, Charge]] | None = None,
        host_state: PyTree = None, metric: Callable[[PyTree], Any] | None = None,
        callback: Callable[[int, PyTree], None] | None = None,
        place: Callable[[PyTree], PyTree] | None = None,
        progress: bool = True, desc: str = "training", donate: bool = False) -> RunResult:
    """Runs steps ``0 .. steps-1`` of ``step`` (the remaining ones after a checkpoint).

    Args:
      step: pure ``(state, batch, key_t) -> (state, Charge, stats)``; ``key_t = fold_in(key,
        t)``. It is compiled once per ``steps_per_call`` (cache keyed on the function object:
        pass the same function to reuse the compilation).
      state: the initial state (a pytree of arrays).
      batch: what every step reads but does not carry (data set, frozen weights); not saved.
      key: the run's secret key (use :func:`pavejax.privacy.fresh_key`); None with a
        checkpointer resumes with the checkpoint's key (a fresh key when there is none).
      steps: total number of steps of the run.
      ledger: where the charges go (its relation is the guarantee's neighbouring relation);
        on resume the checkpoint's ledger replaces its contents' role (see ``RunResult``).
      checkpointer: a :class:`~pavejax.checkpointing.TrainCheckpointer` to resume from and save
        to; its budget is enforced for the whole remaining run before the first step.
      run_record: JSON-safe record of what makes a resumed run the same run (required with a
        checkpointer).
      steps_per_call: steps per compiled ``lax.scan`` (host syncs once per call). Checkpoints
        and the callback happen at call boundaries: a call that passes a multiple of the
        checkpointer's ``every`` saves at its end.
      check: ``check(stats)`` raises on the host when a chunk's statistics (leading step
        axis) flag a problem (e.g. :func:`pavejax.privacy.check_step`); it runs before the
        chunk's state is kept, saved or returned.
      host: optional host phase ``host(host_state, state, stats, t) -> (host_state, state,
        Charge)`` run after each step (needs ``steps_per_call == 1``), for releases computed on
        the host (PACZero-MI's float64 posterior).
      host_state: the host phase's initial state (checkpointed with the state).
      metric: ``metric(stats) -> array`` (one value per step of a chunk) kept as host floats in
        ``RunResult.metrics`` (e.g. the batch loss); not a release.
      callback: ``callback(t, state)`` after each call (t = steps done).
      place: applied to the state (and to a restored one) before the first step, e.g. to
        replicate it on a mesh so every call reuses one compilation.
      progress: show a progress bar; desc: its label.
      donate: donate the state buffers to each call (saves memory; the caller's ``state``
        arrays are invalid afterwards).
    """
    from pavejax.checkpointing import Checkpoint, enforce_budget, resolve_budget

    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) \
            or steps_per_call < 1:
        raise ValueError(f"steps_per_call must be an int >= 1, got {steps_per_call!r}")
    if host is not None and steps_per_call != 1:
        raise ValueError("a host phase runs after every step: use steps_per_call=1")
    if not isinstance(ledger, Ledger):
        raise TypeError(f"ledger must be a pavejax.accounting.Ledger, got {type(ledger).__name__}")
    charge = charge_of(step, state, batch, _like_key(key))
    metrics: list[float] = []
    start, budget = 0, None
    if checkpointer is not None:
        if run_record is None:
            raise ValueError("a checkpointed run needs run_record (what makes a resumed run "
                             "the same run)")
        like = {"state": state, "host": host_state}
        ckpt = checkpointer.restore_latest(like, run=run_record, ledger=ledger,
                                           key_like=_like_key(key))
        budget = resolve_budget(ckpt and ckpt.budget, checkpointer.budget)
        if ckpt is not None:
            if ckpt.step > steps:
                raise ValueError(f"the checkpoint is at step {ckpt.step}, past steps={steps}; "
                                 "a run cannot be shortened after the fact")
            if ckpt.key is None:
                raise ValueError("the checkpoint holds no key, so the run cannot resume with "
                                 "the same noise stream; start a new checkpoint directory")
            if key is not None and not np.array_equal(jax.random.key_data(key),
                                                      jax.random.key_data(ckpt.key)):
                raise ValueError("the key differs from the key of the run in the checkpoint; "
                                 "pass key=None to resume that run")
            key, start = ckpt.key, ckpt.step
            state, host_state = ckpt.arrays["state"], ckpt.arrays["host"]
            metrics = [float(v) for v in ckpt.mechanism.get("metrics", [])]
            ledger = ckpt.ledger
        if charge.event is not None:  # a non-private step never fits a budget
            enforce_budget(ledger, budget, charge.event, steps - start)
    if key is None:
        from pavejax.privacy import fresh_key

        key = fresh_key()
    if place is not None:
        state = place(state)
    bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress or None, leave=False)
    t = start
    try:
        while t < steps:
            n = min(steps_per_call, steps - t)
            new_state, charges, stats = _compiled(step, n, donate)(state, batch, key,
                                                                   jnp.uint32(t))
            if check is not None:
                check(stats)
            new_host = host_state
            if host is not None:
                one = jax.tree.map(lambda x: x[0], stats)
                new_host, new_state, host_charge = host(host_state, new_state, one, t)
                record(ledger, host_charge)
            record(ledger, charge, None if charges.nats is None else np.asarray(charges.nats),
                   count=n)
            state, host_state = new_state, new_host
            if metric is not None:
                metrics.extend(float(v) for v in np.asarray(metric(stats)).reshape(-1))
                bar.set_postfix(metric=f"{metrics[-1]:.4f}", refresh=False)
            t += n
            bar.update(n)
            if callback is not None:
                callback(t, state)
            if checkpointer is not None and (t == steps or t // checkpointer.every
                                             > (t - n) // checkpointer.every):
                checkpointer.save(Checkpoint(t, {"state": state, "host": host_state}, key,
                                             ledger, run_record, {"metrics": metrics}, budget))
    finally:
        bar.close()
    return RunResult(state, host_state, ledger, metrics, t)


__all__: Sequence[str] = ("Charge", "RunResult", "charge_of", "record", "run", "scan_steps",
                          "step_keys")
