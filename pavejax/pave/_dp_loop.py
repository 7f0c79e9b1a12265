"""The DP-S-PAVE step loop, resumable from :class:`pavejax.checkpointing.TrainCheckpointer`.

Step t draws its batch and noise from ``fold_in(key, t)``, so a resumed run needs only the step,
the key, ``B``, the optimiser state and the ledger to continue exactly where it stopped. The key
is secret: fresh from the operating system unless a test or audit supplies one, and saved only
in the training checkpoint (never in a release).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from pavejax.accounting import Ledger
from pavejax.checkpointing import Checkpoint, TrainCheckpointer, enforce_budget, resolve_budget
from pavejax.privacy import DPGradient, fresh_key, replicate

PyTree = Any
_LABEL = "dp-s-pave"


class LoopResult(NamedTuple):
    B: dict[str, jax.Array]
    opt_state: Any
    ledger: Ledger
    losses: list[float]


def run_dp_steps(dp_grad: DPGradient, apply: Callable, B: dict, opt_state: Any, frozen: PyTree,
                 data: Mapping[str, jax.Array], key: jax.Array | None, steps: int, *,
                 accountant: str, checkpointer: TrainCheckpointer | None,
                 run: dict[str, Any], desc: str, progress: bool) -> LoopResult:
    """Runs DP-S-PAVE steps ``0 .. steps-1`` (or the remaining ones after a checkpoint).

    ``apply(B, grad, opt_state) -> (B, opt_state)`` is the post-processing update. The ledger is
    under replace-one: the release states its dataset size, so no add/remove figure would hold.
    ``key`` None: a fresh OS-random key, or the checkpoint's key when resuming.
    """
    ledger, losses, start, budget = Ledger("replace_one", accountant=accountant), [], 0, None
    event = dp_grad.config.step_event()
    if checkpointer is not None:
        ckpt = checkpointer.restore_latest({"B": B, "opt_state": opt_state}, run=run,
                                           ledger=ledger,
                                           key_like=jax.random.key(0) if key is None else key)
        budget = resolve_budget(ckpt and ckpt.budget, checkpointer.budget)
        if ckpt is not None:
            if ckpt.step > steps:
                raise ValueError(f"the checkpoint is at step {ckpt.step}, past steps={steps}; "
                                 "a run cannot be shortened after the fact")
            if ckpt.key is None:
                raise ValueError("the checkpoint holds no noise key, so the run cannot resume "
                                 "with the same noise stream; start a new checkpoint directory")
            if key is not None and not np.array_equal(jax.random.key_data(key),
                                                      jax.random.key_data(ckpt.key)):
                raise ValueError("noise_key differs from the key of the run in the checkpoint; "
                                 "leave noise_key None to resume that run")
            key = ckpt.key
            B, opt_state = ckpt.arrays["B"], ckpt.arrays["opt_state"]
            ledger, losses, start = ckpt.ledger, list(ckpt.mechanism["losses"]), ckpt.step
        enforce_budget(ledger, budget, event, steps - start)
    if key is None:
        key = fresh_key()
    if dp_grad.mesh is not None:  # placed once: every step then reuses one compilation
        B, opt_state, frozen = replicate((B, opt_state, frozen), dp_grad.mesh)
    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps,
               disable=not progress or None, leave=False)
    for step in bar:
        grad, stats, event = dp_grad(B, frozen, data, jax.random.fold_in(key, step))
        ledger.record(event, label=_LABEL)
        B, opt_state = apply(B, grad, opt_state)
        m = np.asarray(stats.mask)
        losses.append(float(np.sum(np.asarray(stats.losses) * m) / max(m.sum(), 1)))
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        if checkpointer is not None and checkpointer.should_save(step + 1, step + 1 == steps):
            checkpointer.save(Checkpoint(step + 1, {"B": B, "opt_state": opt_state}, key, ledger,
                                         run, {"losses": losses}, budget))
    return LoopResult(B, opt_state, ledger, losses)
