"""DP fine-tuning that keeps task models mergeable: DP-SGD/AdamW, DP-SAM and the anchor.

One step on task data with trainable parameters w and the public starting point w0:

```
e  = rho * a / (||a|| + 1e-12)      # ascent direction a, by mode (below); e = 0 for "none"
g  = priv(B, w + e)                 # clipped per-example gradients, Gaussian noise, / (q N)
g += 2 * anchor * (w - w0)          # reference anchor: no data, added after privatisation
w  = optimiser(w, g)                # AdamW by default (decoupled weight decay toward 0)
```

Modes of the ascent direction ``a`` and their privacy (K steps, sampling rate q, multiplier z;
each mode: its ascent, then the event of one run):

- ``"none"``: no ascent (plain DP-SGD / DP-AdamW);
  ``SelfComposed(PoissonSampled(q, G(z)), K)``.
- ``"fresh"``: ``priv(B', w)`` on a *new* Poisson batch B';
  ``SelfComposed(PoissonSampled(q, G(z)), 2K)``.
- ``"same"``: ``priv(B, w)`` on the *same* batch as the descent;
  ``SelfComposed(PoissonSampled(q, Composed[G(z), G(z)]), K)``.
- ``"reuse"``: the previous step's private descent gradient (DPSAT); same as ``"none"``
  (post-processing of past releases).
- ``"random"``: an ``N(0, I)`` direction (ablation); same as ``"none"`` (uses no data).

Formal guarantee:
  The released parameters after K steps are post-processing of the listed Gaussian queries, so
  the run satisfies the DP guarantee of :meth:`MergeTrainConfig.run_event` (noise multiplier
  relative to the add/remove sensitivity C; a :class:`pavejax.accounting.Ledger` doubles it for
  replace-one).

Sharp edges:
  * In "same" mode one Poisson draw decides whether an example is in *both* queries; counting
    it as 2K independent subsampled Gaussians (as a per-query accountant call does) under-counts
    epsilon by a large factor. :func:`pavejax.accounting.dp_sam_step_event` returns the
    composed event for this reason.
  * Normalisation is by the expected batch size q N, never the realised one.
  * The anchor and the weight decay see only parameters, never data: they cost no privacy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from dp_accounting import dp_event

from pavejax.accounting import (
    DP_SAM_MODES,
    Ledger,
    calibrate,
    dp_sam_step_event,
    run_event,
)
from pavejax.checkpointing import (
    Checkpoint,
    TrainCheckpointer,
    enforce_budget,
    resolve_budget,
    run_record,
    tree_fingerprint,
)
from pavejax.distributed import pad_batch
from pavejax.optim import promotion_safe
from pavejax.recipes import SCHEDULES, Recipe, schedule
from pavejax.privacy import (
    ClipConfig,
    DPConfig,
    SamplingConfig,
    StepInfo,
    clipped_sum,
    data_parallel_clipped_sum,
    gaussian_noise_like,
    noisy_gradient,
    replicate,
    take_batch,
)

PyTree = Any
LossFn = Callable[[PyTree, PyTree, PyTree], jax.Array]
MODES = DP_SAM_MODES
_OPTIMIZERS = ("adamw", "sgd")
_TINY = 1e-12


@dataclasses.dataclass(frozen=True)
class MergeTrainConfig:
    """Hyper-parameters of DP(-SAM) fine-tuning; defaults follow the DP-Merging paper.

    Attributes:
      dataset_size: N, number of private training examples of the task (public).
      steps: K, number of optimiser steps.
      mode: ascent mode, one of ``MODES`` (see the module docstring).
      noise_multiplier: z (std / C); ``None`` means calibrate it to ``target_epsilon``.
      target_epsilon: the budget at ``delta`` when ``noise_multiplier`` is ``None``
        (``math.inf`` trains without noise).
      delta: the delta of the guarantee.
      l2_clip: per-example clip norm C (joint over all trainable leaves).
      batch_size: expected Poisson batch size (q = batch_size / dataset_size).
      learning_rate, weight_decay, b1, b2, adam_eps: AdamW (``optimizer="adamw"``; ``adam_eps``
        is its denominator's epsilon, not a privacy parameter) or SGD (lr only).
      schedule, warmup_fraction: the learning rate's course over the ``steps`` (see
        :func:`pavejax.recipes.schedule`): ``"constant"`` (default) or a linear warm-up over
        ``warmup_fraction`` of the steps then ``"cosine"`` or ``"linear"`` decay to zero.
        :meth:`from_recipe` takes them, the rates and the batch size from a tuned recipe.
      rho: SAM radius (global L2 norm of the perturbation).
      anchor: lambda of the anchor lambda * ||w - w0||^2 (0 disables it).
      relation: ``"add_remove"`` or ``"replace_one"`` neighbouring. A model that is released
        with its data set's size (as ``pavejax train`` and the demo do) needs ``"replace_one"``
        (with ``accountant="pld"``): add/remove neighbours differ in that size.
      accountant: ``"rdp"`` (default; analyses the composed "same" event) or ``"pld"`` (which
        analyses "same" as one Gaussian of multiplier ``z / sqrt(2)``, exactly).
    """

    dataset_size: int
    steps: int
    mode: str = "same"
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    l2_clip: float = 0.2
    batch_size: int = 16
    learning_rate: float = 1e-5
    weight_decay: float = 1e-2
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    rho: float = 0.05
    anchor: float = 0.05
    optimizer: str = "adamw"
    relation: str = "add_remove"
    accountant: str = "rdp"
    schedule: str = "constant"
    warmup_fraction: float = 0.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        if not (isinstance(self.warmup_fraction, int | float)
                and 0 <= self.warmup_fraction < 1):
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}.")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}.")
        for name in ("dataset_size", "steps", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if self.batch_size > self.dataset_size:
            raise ValueError(f"batch_size ({self.batch_size}) must not exceed dataset_size "
                             f"({self.dataset_size}).")
        for name in ("learning_rate", "weight_decay", "rho", "anchor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}.")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier (z) or target_epsilon "
                             "(z is then calibrated for this mode).")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0 (math.inf for no noise), got "
                             f"{self.target_epsilon!r}.")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}.")

    @classmethod
    def from_recipe(cls, recipe: Recipe, *, dataset_size: int, steps: int,
                    learning_rate: float | None = None, **privacy: Any) -> MergeTrainConfig:
        """The private counterpart of a non-private ``recipe``: its schedule, warm-up, weight
        decay and batch size (now the expected Poisson batch), with ``learning_rate`` re-tuned
        under noise (default: the recipe's head rate for a ``"head"`` recipe, else its body
        rate) and the privacy fields (``mode``, ``target_epsilon``, ``l2_clip``, ...) in
        ``privacy`` (which may also override the batch size or weight decay)."""
        if learning_rate is None:
            learning_rate = (recipe.head_learning_rate if recipe.trained == "head"
                             else recipe.learning_rate)
        fields = dict(dataset_size=dataset_size, steps=steps, learning_rate=learning_rate,
                      weight_decay=recipe.weight_decay, batch_size=recipe.batch_size,
                      schedule=recipe.schedule, warmup_fraction=recipe.warmup_fraction)
        return cls(**(fields | privacy))

    @property
    def q(self) -> float:
        """Poisson sampling rate."""
        return self.batch_size / self.dataset_size

    @functools.cached_property
    def resolved_noise_multiplier(self) -> float:
        """The noise multiplier z actually used (calibrated once if a target epsilon is given)."""
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        if math.isinf(self.target_epsilon):
            return 0.0
        return calibrate(self.run_event, self.target_epsilon, self.delta,
                         relation=self.relation, accountant=self.accountant)

    def step_event(self, noise_multiplier: float | None = None) -> dp_event.DpEvent:
        """The ``DpEvent`` of one step (:func:`pavejax.accounting.dp_sam_step_event` in this
        mode at rate q) at ``noise_multiplier`` (default: `resolved_noise_multiplier`)."""
        z = self.resolved_noise_multiplier if noise_multiplier is None else noise_multiplier
        return dp_sam_step_event(self.mode, z, q=self.q)

    def run_event(self, noise_multiplier: float | None = None) -> dp_event.DpEvent:
        """The ``DpEvent`` of the whole run of ``steps`` steps (what `calibrate` solves)."""
        return run_event(self.step_event(noise_multiplier), self.steps)

    def dp_config(self) -> DPConfig:
        """The per-query :class:`DPConfig` (Poisson sampling at rate q)."""
        return DPConfig(self.l2_clip, self.resolved_noise_multiplier,
                        SamplingConfig("poisson", self.dataset_size, self.batch_size),
                        relation=self.relation)


# ------------------------------------------------------------------ pure pieces of a step


def global_norm(tree: PyTree) -> jax.Array:
    """Joint L2 norm over all leaves (float32 scalar)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def ascent_perturbation(direction: PyTree, rho: float) -> PyTree:
    """``rho * a / (||a|| + 1e-12)``: norm ``rho`` (0 when ``a`` is 0), same structure as ``a``."""
    scale = jnp.float32(rho) / (global_norm(direction) + jnp.float32(_TINY))
    return jax.tree.map(lambda a: (a.astype(jnp.float32) * scale).astype(a.dtype), direction)


def anchor_gradient(params: PyTree, anchor_params: PyTree,
                    strength: float | jax.Array) -> PyTree:
    """Gradient ``2 * strength * (w - w0)`` of the anchor ``strength * ||w - w0||^2``.

    ``strength`` may be a traced scalar (one compilation for several anchors).
    """
    c = jnp.float32(2.0) * jnp.asarray(strength, jnp.float32)
    return jax.tree.map(lambda w, w0: (w - w0) * c.astype(w.dtype), params, anchor_params)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a + b``."""
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def _flat_rate(cfg: MergeTrainConfig) -> bool:
    """Whether the rate is the same at every step: ``"constant"`` without warm-up (the
    ``"constant"`` schedule of :func:`pavejax.recipes.schedule` warms up too)."""
    return cfg.schedule == "constant" and cfg.warmup_fraction == 0


def make_optimizer(cfg: MergeTrainConfig) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay toward 0) or plain SGD with ``cfg``'s learning-rate
    schedule over ``cfg.steps``, promotion-safe."""
    lr = (cfg.learning_rate if _flat_rate(cfg)
          else schedule(cfg.schedule, cfg.learning_rate, cfg.steps, cfg.warmup_fraction))
    if cfg.optimizer == "sgd":
        return promotion_safe(optax.sgd(lr))
    return promotion_safe(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps,
                                      weight_decay=cfg.weight_decay))


class TrainState(NamedTuple):
    """Everything a step carries: parameters, optimiser state, last private gradient (reuse)."""

    params: PyTree
    opt_state: Any
    prev_grad: PyTree


class StepStats(NamedTuple):
    """Local per-step statistics (not privatised: do not release them)."""

    loss: jax.Array
    num_clipped: jax.Array
    num_nonfinite: jax.Array


def init_state(params: PyTree, cfg: MergeTrainConfig) -> TrainState:
    """Initial :class:`TrainState` (zero previous gradient: the first "reuse" step has e = 0)."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    return TrainState(params, make_optimizer(cfg).init(params), zeros)


def _private_mean(loss_fn: LossFn, w: PyTree, frozen: PyTree, batch: PyTree, mask: jax.Array,
                  key: jax.Array, cfg: MergeTrainConfig, sigma: jax.Array | None, mesh=None):
    if sigma is None:
        return noisy_gradient(loss_fn, w, frozen, batch, mask, key, cfg.dp_config(), mesh=mesh)
    # Traced multiplier (one compilation for many budgets): same mechanism as privatize_sum.
    if mesh is None:
        r = clipped_sum(loss_fn, w, frozen, batch, mask, ClipConfig(cfg.l2_clip))
    else:
        r = data_parallel_clipped_sum(loss_fn, w, frozen, batch, mask, ClipConfig(cfg.l2_clip),
                                      mesh)
    std = jnp.asarray(sigma, jnp.float32) * jnp.float32(cfg.l2_clip)
    noise = gaussian_noise_like(key, r.grad_sum, 1.0)
    inv = jnp.float32(1.0 / cfg.batch_size)
    grad = jax.tree.map(lambda s, n: (s + n * std.astype(s.dtype)) * inv.astype(s.dtype),
                        r.grad_sum, noise)
    return grad, StepInfo(r.losses, r.norms, mask, r.num_clipped, r.num_nonfinite)


def dp_sam_step(loss_fn: LossFn, cfg: MergeTrainConfig, state: TrainState, frozen: PyTree,
                anchor_params: PyTree, batch: PyTree, mask: jax.Array, ascent_batch: PyTree,
                ascent_mask: jax.Array, key: jax.Array,
                noise_multiplier: jax.Array | None = None, anchor: jax.Array | None = None, *,
                mesh: jax.sharding.Mesh | None = None,
                lr_scale: jax.Array | None = None) -> tuple[TrainState, StepStats]:
    """One pure, jittable step (see the module docstring); batches are padded with masks.

    ``ascent_batch``/``ascent_mask`` are used only in "fresh" mode (pass the descent batch
    otherwise). ``anchor_params`` is w0 (same structure as ``state.params``).
    ``noise_multiplier`` overrides ``cfg.resolved_noise_multiplier`` with a traced multiplier
    (one compilation for several budgets); the caller must then account with
    ``cfg.step_event(noise_multiplier)`` itself.
    ``anchor`` likewise overrides ``cfg.anchor`` with a traced lambda (it costs no privacy).
    ``lr_scale`` multiplies the optimiser's update (a traced learning-rate factor: with
    ``cfg.learning_rate = 1`` it is the learning rate, so a vmapped sweep compiles once).
    With ``mesh`` (a 1-D ``'data'`` mesh) each device clips its share of the batch (whose size
    must be a multiple of the device count) and one ``psum`` joins them before the noise.
    """
    k_asc, k_desc = jax.random.split(key)
    w = state.params
    if cfg.mode in ("same", "fresh"):
        b, m = (ascent_batch, ascent_mask) if cfg.mode == "fresh" else (batch, mask)
        direction, _ = _private_mean(loss_fn, w, frozen, b, m, k_asc, cfg, noise_multiplier,
                                     mesh)
    elif cfg.mode == "reuse":
        direction = state.prev_grad
    elif cfg.mode == "random":
        leaves, treedef = jax.tree.flatten(w)
        direction = jax.tree.unflatten(treedef, [
            jax.random.normal(jax.random.fold_in(k_asc, i), x.shape, jnp.float32).astype(x.dtype)
            for i, x in enumerate(leaves)])
    if cfg.mode == "none" or cfg.rho == 0:
        w_eval = w
    else:
        w_eval = tree_add(w, ascent_perturbation(direction, cfg.rho))
    grad, info = _private_mean(loss_fn, w_eval, frozen, batch, mask, k_desc, cfg,
                               noise_multiplier, mesh)
    if anchor is not None or cfg.anchor:
        strength = cfg.anchor if anchor is None else anchor
        total = tree_add(grad, anchor_gradient(w, anchor_params, strength))
    else:
        total = grad
    updates, opt_state = make_optimizer(cfg).update(total, state.opt_state, w)
    if lr_scale is not None:
        updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates)
    new = TrainState(optax.apply_updates(w, updates), opt_state, grad)
    mf = mask.astype(jnp.float32)
    loss = jnp.sum(jnp.where(mask, info.losses, 0.0)) / jnp.maximum(jnp.sum(mf), 1.0)
    return new, StepStats(loss, info.num_clipped, info.num_nonfinite)


def _shape_config(cfg: MergeTrainConfig) -> MergeTrainConfig:
    """``cfg`` with the fields the step receives traced (z, lambda) or never reads (K, unless a
    schedule spans it) fixed."""
    steps = 1 if _flat_rate(cfg) else cfg.steps
    return dataclasses.replace(cfg, noise_multiplier=1.0, target_epsilon=None, steps=steps,
                               anchor=1.0)


@functools.lru_cache(maxsize=32)
def _compiled_step(loss_fn: LossFn, cfg: MergeTrainConfig, mesh: jax.sharding.Mesh | None):
    # Runs that differ only in budget, anchor or length share one compilation.
    return jax.jit(functools.partial(dp_sam_step, loss_fn, cfg, mesh=mesh))


class TrainResult(NamedTuple):
    """Outcome of :func:`train_task`: final parameters, the run's ledger, mean loss per step."""

    params: PyTree
    ledger: Ledger
    losses: list[float]


def _ledger(cfg: MergeTrainConfig, event: dp_event.DpEvent, steps: int) -> Ledger:
    # One entry of count k: composes identically to k entries and is k times cheaper to query.
    ledger = Ledger(cfg.relation, accountant=cfg.accountant)
    if steps:
        ledger.record(event, count=steps, label=f"dp-merging/{cfg.mode}")
    return ledger


def _run(cfg: MergeTrainConfig, params: PyTree, anchor_params: PyTree) -> dict[str, Any]:
    # What makes a resumed run the same run; K may grow (the budget check guards it) unless a
    # schedule spans the K steps.
    exclude = ("steps",) if _flat_rate(cfg) else ()
    return run_record("dp-merging", cfg, exclude=exclude,
                      resolved_noise_multiplier=cfg.resolved_noise_multiplier,
                      params=tree_fingerprint(params), anchor=tree_fingerprint(anchor_params))


def train_task(loss_fn: LossFn, params: PyTree, frozen: PyTree, data: PyTree, key: jax.Array,
               cfg: MergeTrainConfig, *, anchor_params: PyTree | None = None,
               callback: Callable[[int, TrainState], None] | None = None,
               checkpointer: TrainCheckpointer | None = None,
               mesh: jax.sharding.Mesh | None = None) -> TrainResult:
    """Fine-tunes ``params`` on ``data`` (leaves with leading axis N) for ``cfg.steps`` steps.

    ``params`` may be full weights or LoRA factors (any pytree the loss differentiates).
    ``anchor_params`` defaults to the initial ``params`` (w0). The returned ledger holds
    ``cfg.step_event()`` times ``cfg.steps`` (label ``"dp-merging/<mode>"``), so
    ``result.ledger.epsilon(cfg.delta)`` is the run's guarantee. Raises ``ValueError`` if a
    real example produced a non-finite loss or gradient.

    With ``checkpointer`` the run resumes from its latest checkpoint (parameters, optimiser
    state, PRNG key, ledger, losses) and saves every ``checkpointer.every`` steps, so a killed
    and resumed run ends bit-identical to an uninterrupted one; a checkpointer budget is
    enforced before the first step (``BudgetExceededError``). With ``mesh`` (a 1-D ``'data'``
    mesh, e.g. :func:`pavejax.privacy.data_mesh`) the batch is sharded over the devices and
    per-example clipping runs on each shard; the result equals one device up to float
    summation order.
    """
    n = jax.tree.leaves(data)[0].shape[0]
    if n != cfg.dataset_size:
        raise ValueError(f"data has {n} examples but cfg.dataset_size={cfg.dataset_size}; the "
                         "sampling rate depends on it, so rebuild the config for this data.")
    anchor_params = params if anchor_params is None else anchor_params
    sampling = cfg.dp_config().sampling
    step = _compiled_step(loss_fn, _shape_config(cfg), mesh)
    z, anchor = jnp.float32(cfg.resolved_noise_multiplier), jnp.float32(cfg.anchor)
    event = cfg.step_event()
    multiple = 1 if mesh is None else mesh.size
    state, losses, start, run, budget = init_state(params, cfg), [], 0, None, None
    if checkpointer is not None:
        run = _run(cfg, params, anchor_params)
        ckpt = checkpointer.restore_latest(state, run=run, key_like=key)
        budget = resolve_budget(ckpt and ckpt.budget, checkpointer.budget)
        if ckpt is not None:
            if ckpt.step > cfg.steps:
                raise ValueError(f"the checkpoint is at step {ckpt.step}, past cfg.steps="
                                 f"{cfg.steps}; a run cannot be shortened after the fact")
            state, key, start = TrainState(*ckpt.arrays), ckpt.key, ckpt.step
            losses = list(ckpt.mechanism["losses"])
        enforce_budget(_ledger(cfg, event, start), budget, event, cfg.steps - start)
    if mesh is not None:  # placed once: a step's inputs keep one sharding, so one compilation
        state, frozen, anchor_params = replicate((state, frozen, anchor_params), mesh)
    for k in range(start, cfg.steps):
        key, k_s1, k_s2, k_step = jax.random.split(key, 4)
        idx, mask = sampling.sample(k_s1)
        batch, mask = pad_batch(take_batch(data, idx), mask, multiple)
        if cfg.mode == "fresh":
            idx2, mask2 = sampling.sample(k_s2)
            batch2, mask2 = pad_batch(take_batch(data, idx2), mask2, multiple)
        else:
            batch2, mask2 = batch, mask
        state, stats = step(state, frozen, anchor_params, batch, mask, batch2, mask2, k_step,
                            z, anchor)
        if int(stats.num_nonfinite):
            raise ValueError(f"step {k}: {int(stats.num_nonfinite)} example(s) gave a NaN/Inf "
                             "loss or gradient; check the inputs and lower the learning rate.")
        losses.append(float(stats.loss))
        if callback is not None:
            callback(k, state)
        if checkpointer is not None and checkpointer.should_save(k + 1, k + 1 == cfg.steps):
            checkpointer.save(Checkpoint(k + 1, state, key, _ledger(cfg, event, k + 1), run,
                                         {"losses": losses}, budget))
    return TrainResult(state.params, _ledger(cfg, event, cfg.steps), losses)
