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

Entry points, from the most composable to the most convenient:

- :func:`dp_sam_step`: the update on given padded batches (pure);
- :func:`make_step`: the step protocol of :mod:`pavejax.training`, ``step(state, SamBatch,
  key) -> (state, Charge, StepStats)``, sampling its batches inside (pure; any optax optimiser);
- :func:`train_task`: that step under :func:`pavejax.training.run` (checkpoints, budget);
- :func:`train_many`: R runs x T tasks in one compiled ``lax.scan`` (vmapped z, lambda and
  learning rate), for sweeps.

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
import numpy as np
import optax
from dp_accounting import dp_event

from pavejax import training
from pavejax.accounting import (
    DP_SAM_MODES,
    Ledger,
    calibrate,
    dp_sam_step_event,
    run_event,
)
from pavejax.checkpointing import TrainCheckpointer, run_record, tree_fingerprint
from pavejax.optim import promotion_safe
from pavejax.privacy import (
    ClipConfig,
    DPConfig,
    SamplingConfig,
    check_step,
    clipped_sum,
    data_parallel_clipped_sum,
    pad_batch,
    privatize_sum,
    replicate,
    take_batch,
)
from pavejax.recipes import SCHEDULES, Recipe, schedule
from pavejax.training import Charge

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
      max_batch: rows of the padded Poisson batch (default
        :func:`pavejax.privacy.max_batch_for`: an overflow is rarer than 1e-9 per step); a
        draw above it is refused (``BatchOverflowError``), never truncated.
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
    max_batch: int | None = None

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
        if self.max_batch is not None and (not isinstance(self.max_batch, int)
                                           or isinstance(self.max_batch, bool)
                                           or self.max_batch < 1):
            raise ValueError(f"max_batch must be None or a positive int, got {self.max_batch!r}.")
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

    @property
    def sampling(self) -> SamplingConfig:
        """The Poisson sampling of every query (rate q, padded to ``max_batch`` rows)."""
        return SamplingConfig("poisson", self.dataset_size, self.batch_size,
                              max_batch=self.max_batch)

    def dp_config(self) -> DPConfig:
        """The per-query :class:`DPConfig` (Poisson sampling at rate q)."""
        return DPConfig(self.l2_clip, self.resolved_noise_multiplier, self.sampling,
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


def make_optimizer(cfg: MergeTrainConfig, *,
                   learning_rate: float | jax.Array | None = None) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay toward 0) or plain SGD with ``cfg``'s learning-rate
    schedule over ``cfg.steps``, promotion-safe.

    ``learning_rate`` replaces ``cfg.learning_rate`` as the peak rate; it may be a traced value
    (a vmapped rate sweep compiles once, see :func:`train_many`).
    """
    peak = cfg.learning_rate if learning_rate is None else learning_rate
    lr = (peak if _flat_rate(cfg)
          else schedule(cfg.schedule, peak, cfg.steps, cfg.warmup_fraction))
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
    """Local per-step statistics (not privatised: do not release them). ``overflow`` and
    ``num_nonfinite`` are the flags :func:`pavejax.privacy.check_step` refuses a step on."""

    loss: jax.Array
    num_clipped: jax.Array
    num_nonfinite: jax.Array
    overflow: jax.Array


class SamBatch(NamedTuple):
    """What a DP-SAM step reads and does not carry (the ``batch`` of the step protocol).

    ``data``: the task's whole private data set (leaves with leading axis
    ``cfg.dataset_size``; the step samples its Poisson batches from it); ``frozen``: passed to
    the loss unchanged; ``anchor_params``: w0 of the anchor (same structure as the params).
    """

    data: PyTree
    frozen: PyTree
    anchor_params: PyTree


def init_state(params: PyTree, cfg: MergeTrainConfig,
               optimizer: optax.GradientTransformation | None = None) -> TrainState:
    """Initial :class:`TrainState` (zero previous gradient: the first "reuse" step has e = 0);
    ``optimizer`` (default :func:`make_optimizer` of ``cfg``) must be the step's."""
    opt = make_optimizer(cfg) if optimizer is None else optimizer
    return TrainState(params, opt.init(params), jax.tree.map(jnp.zeros_like, params))


def _private_mean(loss_fn: LossFn, w: PyTree, frozen: PyTree, batch: PyTree, mask: jax.Array,
                  key: jax.Array, cfg: MergeTrainConfig, noise_multiplier: float | jax.Array,
                  mesh=None):
    """(noisy mean gradient, ClipResult): clipped sum (sharded over ``mesh``), Gaussian noise
    of std ``noise_multiplier * C`` once, divided by the expected batch size q N."""
    clip = ClipConfig(cfg.l2_clip)
    if mesh is None:
        r = clipped_sum(loss_fn, w, frozen, batch, mask, clip)
    else:
        r = data_parallel_clipped_sum(loss_fn, w, frozen, batch, mask, clip, mesh)
    grad = privatize_sum(r.grad_sum, key, noise_multiplier=noise_multiplier,
                         sensitivity=cfg.l2_clip, expected_batch_size=cfg.batch_size)
    return grad, r


def dp_sam_step(loss_fn: LossFn, cfg: MergeTrainConfig, state: TrainState, frozen: PyTree,
                anchor_params: PyTree, batch: PyTree, mask: jax.Array, ascent_batch: PyTree,
                ascent_mask: jax.Array, key: jax.Array,
                noise_multiplier: float | jax.Array | None = None,
                anchor: float | jax.Array | None = None, *,
                optimizer: optax.GradientTransformation | None = None,
                mesh: jax.sharding.Mesh | None = None) -> tuple[TrainState, StepStats]:
    """The update of one step on *given* padded batches (pure, jittable; the module docstring's
    algebra). :func:`make_step` samples the batches and wraps this in the step protocol; call
    this one directly when the batches come from elsewhere (e.g. each host of a multi-host
    mesh feeding its rows of one global batch).

    ``ascent_batch``/``ascent_mask`` are used only in "fresh" mode (pass the descent batch
    otherwise). ``anchor_params`` is w0 (same structure as ``state.params``).
    ``noise_multiplier`` overrides ``cfg.resolved_noise_multiplier`` (it may be traced); the
    caller accounts for one ``cfg.step_event(noise_multiplier)`` per step.
    ``anchor`` overrides ``cfg.anchor`` (may be traced; it costs no privacy). ``optimizer``
    (default :func:`make_optimizer` of ``cfg``) must be the one ``state.opt_state`` was made by.
    With ``mesh`` (a 1-D ``'data'`` mesh) each device clips its share of the batch (whose size
    must be a multiple of the device count) and one ``psum`` joins them before the noise.
    ``StepStats.overflow`` is False (the batches are given).
    """
    z = cfg.resolved_noise_multiplier if noise_multiplier is None else noise_multiplier
    opt = make_optimizer(cfg) if optimizer is None else optimizer
    k_asc, k_desc = jax.random.split(key)
    w = state.params
    if cfg.mode in ("same", "fresh"):
        b, m = (ascent_batch, ascent_mask) if cfg.mode == "fresh" else (batch, mask)
        direction, _ = _private_mean(loss_fn, w, frozen, b, m, k_asc, cfg, z, mesh)
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
    grad, r = _private_mean(loss_fn, w_eval, frozen, batch, mask, k_desc, cfg, z, mesh)
    if anchor is not None or cfg.anchor:
        strength = cfg.anchor if anchor is None else anchor
        total = tree_add(grad, anchor_gradient(w, anchor_params, strength))
    else:
        total = grad
    updates, opt_state = opt.update(total, state.opt_state, w)
    new = TrainState(optax.apply_updates(w, updates), opt_state, grad)
    mf = mask.astype(jnp.float32)
    loss = jnp.sum(jnp.where(mask, r.losses, 0.0)) / jnp.maximum(jnp.sum(mf), 1.0)
    return new, StepStats(loss, r.num_clipped, r.num_nonfinite, jnp.zeros((), bool))


def _check_data(data: PyTree, cfg: MergeTrainConfig) -> None:
    leaves = jax.tree.leaves(data)
    n = leaves[0].shape[0] if leaves and leaves[0].ndim else None
    if n != cfg.dataset_size:
        raise ValueError(f"data has {n} examples but cfg.dataset_size={cfg.dataset_size}; the "
                         "sampling rate depends on it, so rebuild the config for this data.")


def make_step(loss_fn: LossFn, cfg: MergeTrainConfig, *,
              optimizer: optax.GradientTransformation | None = None,
              mesh: jax.sharding.Mesh | None = None,
              noise_multiplier: float | jax.Array | None = None,
              anchor: float | jax.Array | None = None):
    """DP-SAM in ``cfg.mode`` as a pure step ``step(state, batch, key) -> (state, Charge,
    StepStats)`` (the protocol of :mod:`pavejax.training`).

    ``state`` is a :class:`TrainState` (:func:`init_state` with the same ``optimizer``);
    ``batch`` a :class:`SamBatch` holding the whole data set. Each call samples its Poisson
    batch (and in "fresh" mode an independent ascent batch) from ``key``, pads it to a
    multiple of the mesh size, runs :func:`dp_sam_step` with the rest of ``key`` and returns
    the ``pavejax.training.Charge`` of the step (``cfg.step_event(z)``, label
    ``"dp-merging/<mode>"``) and its :class:`StepStats`, whose ``overflow`` and
    ``num_nonfinite`` the caller must check (:func:`pavejax.privacy.check_step`) before keeping
    the new state. :func:`train_task` is this step under :func:`pavejax.training.run`.

    Args:
      loss_fn: per-example loss ``(params, frozen, example) -> scalar``.
      cfg: the :class:`MergeTrainConfig` (mode, sampling, clipping, rho, anchor, optimiser).
      optimizer: any ``optax.GradientTransformation`` (default :func:`make_optimizer`); it sees
        the noisy gradient plus the anchor's gradient.
      mesh: a 1-D ``'data'`` mesh: each device clips its share of every batch.
      noise_multiplier: z (default ``cfg.resolved_noise_multiplier``). A traced z (e.g. the
        step built inside a ``jax.vmap`` over several z) makes the charge's event None: the
        caller then accounts for each z itself (``cfg.step_event(z)`` per step; see
        :func:`train_many`).
      anchor: lambda of the anchor (default ``cfg.anchor``; may be traced, costs no privacy).

    Example (your own loop; step t keyed ``fold_in(key, t)`` as :func:`train_task` does):
      >>> import jax, jax.numpy as jnp
      >>> from pavejax.accounting import Ledger
      >>> from pavejax.privacy import check_step
      >>> def loss_fn(params, frozen, example):
      ...     return 0.5 * jnp.sum(jnp.square(params["w"] - example["x"]))
      >>> data, params = {"x": jnp.ones((32, 3))}, {"w": jnp.zeros(3)}
      >>> cfg = MergeTrainConfig(dataset_size=32, steps=3, noise_multiplier=1.0, batch_size=8)
      >>> step, state = jax.jit(make_step(loss_fn, cfg)), init_state(params, cfg)
      >>> ledger, key = Ledger("add_remove"), jax.random.key(0)
      >>> for t in range(cfg.steps):
      ...     state, charge, stats = step(state, SamBatch(data, None, params),
      ...                                 jax.random.fold_in(key, t))
      ...     check_step(stats)  # raises on an overflow or a non-finite example
      ...     _ = ledger.record(charge.event, label=charge.label)
      >>> sum(e.count for e in ledger.entries), charge.label
      (3, 'dp-merging/same')
    """
    opt = make_optimizer(cfg) if optimizer is None else optimizer
    z = cfg.resolved_noise_multiplier if noise_multiplier is None else noise_multiplier
    event = None if isinstance(z, jax.core.Tracer) else cfg.step_event(float(z))
    sampling, label = cfg.sampling, f"dp-merging/{cfg.mode}"
    multiple = 1 if mesh is None else mesh.size

    def draw(key, data):
        d = sampling.sample(key)
        b, m = pad_batch(take_batch(data, d.indices), d.mask, multiple)
        return b, m, d.overflow

    def step(state: TrainState, batch: SamBatch, key: jax.Array):
        _check_data(batch.data, cfg)
        k_draw, k_ascent_draw, k_step = jax.random.split(key, 3)
        b, m, overflow = draw(k_draw, batch.data)
        if cfg.mode == "fresh":  # the ascent query gets its own, independent Poisson batch
            ab, am, ascent_overflow = draw(k_ascent_draw, batch.data)
            overflow = overflow | ascent_overflow
        else:
            ab, am = b, m
        state, stats = dp_sam_step(loss_fn, cfg, state, batch.frozen, batch.anchor_params, b, m,
                                   ab, am, k_step, z, anchor, optimizer=opt, mesh=mesh)
        return state, Charge(event, label=label), stats._replace(overflow=overflow)

    return step


class TrainResult(NamedTuple):
    """Outcome of :func:`train_task`: final parameters, the run's ledger, mean loss per step."""

    params: PyTree
    ledger: Ledger
    losses: list[float]


def _run(cfg: MergeTrainConfig, params: PyTree, anchor_params: PyTree) -> dict[str, Any]:
    # What makes a resumed run the same run; K may grow (the budget check guards it) unless a
    # schedule spans the K steps.
    exclude = ("steps",) if _flat_rate(cfg) else ()
    return run_record("dp-merging", cfg, exclude=exclude,
                      resolved_noise_multiplier=cfg.resolved_noise_multiplier,
                      params=tree_fingerprint(params), anchor=tree_fingerprint(anchor_params))


def _task_step(loss_fn: LossFn, cfg: MergeTrainConfig, mesh: jax.sharding.Mesh | None):
    # The driver caches a compilation per step object: runs whose steps are the same (equal
    # resolved z; the same length unless a schedule spans it) share one.
    steps = 1 if _flat_rate(cfg) else cfg.steps
    return _cached_step(loss_fn, dataclasses.replace(
        cfg, noise_multiplier=cfg.resolved_noise_multiplier, target_epsilon=None, steps=steps),
        mesh)


@functools.lru_cache(maxsize=32)
def _cached_step(loss_fn: LossFn, cfg: MergeTrainConfig, mesh: jax.sharding.Mesh | None):
    return make_step(loss_fn, cfg, mesh=mesh)


def train_task(loss_fn: LossFn, params: PyTree, frozen: PyTree, data: PyTree,
               key: jax.Array | None, cfg: MergeTrainConfig, *,
               anchor_params: PyTree | None = None,
               callback: Callable[[int, TrainState], None] | None = None,
               checkpointer: TrainCheckpointer | None = None,
               mesh: jax.sharding.Mesh | None = None, steps_per_call: int = 1,
               progress: bool = False) -> TrainResult:
    """Fine-tunes ``params`` on ``data`` (leaves with leading axis N) for ``cfg.steps`` steps:
    :func:`make_step` under :func:`pavejax.training.run` (step t's key is
    ``jax.random.fold_in(key, t)``).

    ``params`` may be full weights or LoRA factors (any pytree the loss differentiates).
    ``anchor_params`` defaults to the initial ``params`` (w0). The returned ledger holds
    ``cfg.step_event()`` for each of the ``cfg.steps`` steps (label ``"dp-merging/<mode>"``),
    so ``result.ledger.epsilon(cfg.delta)`` is the run's guarantee. Raises ``ValueError`` when
    ``data`` does not have ``cfg.dataset_size`` examples and when a real example produced a
    non-finite loss or gradient (:class:`pavejax.privacy.NonFiniteError`), and
    :class:`pavejax.privacy.BatchOverflowError` when a Poisson draw overflowed its padded batch
    (``cfg.max_batch``); nothing of the refused call is kept.

    With ``checkpointer`` the run resumes from its latest checkpoint (parameters, optimiser
    state, key, ledger, losses; pass the same key or None) and saves every
    ``checkpointer.every`` steps, so a killed and resumed run ends bit-identical to an
    uninterrupted one and its ledger never rewinds; a checkpointer budget is enforced before
    the first step (``BudgetExceededError``). With ``mesh`` (a 1-D ``'data'`` mesh, e.g.
    :func:`pavejax.privacy.data_mesh`) the batch is sharded over the devices and per-example
    clipping runs on each shard; the result equals one device up to float summation order.
    ``steps_per_call`` steps run in one compiled ``lax.scan``; ``callback(t, state)`` runs
    after each call (t = steps done). ``progress`` shows a progress bar.
    """
    _check_data(data, cfg)
    anchor_params = params if anchor_params is None else anchor_params
    batch, place = SamBatch(data, frozen, anchor_params), None
    if mesh is not None:  # placed once: every call keeps one sharding, so one compilation
        batch, place = replicate(batch, mesh), functools.partial(replicate, mesh=mesh)
    out = training.run(
        _task_step(loss_fn, cfg, mesh), init_state(params, cfg), key, cfg.steps, batch=batch,
        ledger=Ledger(cfg.relation, accountant=cfg.accountant), checkpointer=checkpointer,
        run_record=None if checkpointer is None else _run(cfg, params, anchor_params),
        steps_per_call=steps_per_call, check=check_step, metric=lambda st: st.loss,
        callback=callback, place=place, progress=progress, desc=f"dp-merging/{cfg.mode}")
    return TrainResult(out.state.params, out.ledger, out.metrics)


# ------------------------------------------------------------------ many runs in one program


class ManyResult(NamedTuple):
    """Outcome of :func:`train_many`: ``params`` with leading axes (R, T) (run, task),
    ``stats`` (:class:`StepStats`, leading axes (R, T, K)) and one ledger per run (the
    guarantee of each of its T task models, each on its own data set)."""

    params: PyTree
    stats: StepStats
    ledgers: list[Ledger]


@functools.lru_cache(maxsize=16)
def _many_program(loss_fn: LossFn, cfg: MergeTrainConfig, post: Callable | None):
    def one(key, frozen, data, params, anchor_params, z, anchor, lr):
        opt = make_optimizer(cfg, learning_rate=lr)
        inner = make_step(loss_fn, cfg, optimizer=opt, noise_multiplier=z, anchor=anchor)

        def step(state, batch, k):
            state, charge, stats = inner(state, batch, k)
            return (state if post is None else post(state, batch)), charge, stats

        state, _, stats = training.scan_steps(step, init_state(params, cfg, opt),
                                              SamBatch(data, frozen, anchor_params),
                                              training.step_keys(key, 0, cfg.steps))
        return state.params, stats

    tasks = jax.vmap(one, in_axes=(0, 0, 0, None, None, None, None, None))
    return jax.jit(jax.vmap(tasks, in_axes=(0, None, None, None, None, 0, 0, 0)))


def _per_run(name: str, values: Any, runs: int) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if v.shape != (runs,) or not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{name} must be {runs} finite numbers >= 0 (one per row of keys), "
                         f"got {values!r}")
    return v


def train_many(loss_fn: LossFn, cfg: MergeTrainConfig, params: PyTree, frozen: PyTree,
               data: PyTree, keys: jax.Array, *, noise_multipliers: Any = None,
               anchors: Any = None, learning_rates: Any = None,
               anchor_params: PyTree | None = None,
               post: Callable[[TrainState, SamBatch], TrainState] | None = None) -> ManyResult:
    """R runs x T tasks of ``cfg.steps`` DP-SAM steps each, in one compiled ``lax.scan``
    vmapped over runs and tasks (a sweep over budgets, anchors and learning rates compiles
    once). Run r, task t equals :func:`train_task` on task t's data with key ``keys[r, t]``
    and ``cfg`` with z, lambda and the peak rate of run r (same steps and keys; float
    rounding of the vmapped program aside).

    Args:
      loss_fn, cfg: as in :func:`make_step` (``cfg.noise_multiplier``, ``cfg.anchor`` and
        ``cfg.learning_rate`` are the defaults of the per-run values below).
      params: the initial parameters, shared by every run and task; ``anchor_params`` (w0 of
        the anchor) defaults to them.
      frozen: per-task frozen inputs of the loss, leaves with leading axis T (None for none).
      data: the T private data sets, leaves with leading axes (T, cfg.dataset_size).
      keys: (R, T) PRNG keys (use :func:`pavejax.privacy.fresh_key` for releases).
      noise_multipliers, anchors, learning_rates: (R,) per-run z, lambda and peak learning
        rate (traced in the program).
      post: optional pure ``post(state, batch) -> state`` applied after every step (e.g. to
        reset parameters a task does not own); it must not read data (it runs after the
        release, as post-processing).

    Returns a :class:`ManyResult`. Every step's flags are checked on the host once the program
    has run (:func:`pavejax.privacy.check_step`: ``BatchOverflowError`` or
    ``NonFiniteError``, and nothing is returned). ``ledgers[r]`` holds ``cfg.step_event(z_r)``
    for each of the ``cfg.steps`` steps: the guarantee of every model of run r.
    """
    if not (isinstance(keys, jax.Array) and jax.dtypes.issubdtype(keys.dtype,
                                                                  jax.dtypes.prng_key)
            and keys.ndim == 2):
        raise ValueError("keys must be an (R, T) array of typed PRNG keys (runs x tasks), got "
                         f"{getattr(keys, 'dtype', type(keys))} of shape {np.shape(keys)}")
    runs, tasks = keys.shape
    got = {leaf.shape[:2] for leaf in jax.tree.leaves(data)}
    if got != {(tasks, cfg.dataset_size)}:
        raise ValueError(f"every data leaf must have leading axes (T, N) = ({tasks}, "
                         f"{cfg.dataset_size}) (T from keys, N = cfg.dataset_size); got {got}")
    if noise_multipliers is None:
        noise_multipliers = [cfg.resolved_noise_multiplier] * runs
    zs = _per_run("noise_multipliers", noise_multipliers, runs)
    lams = _per_run("anchors", [cfg.anchor] * runs if anchors is None else anchors, runs)
    lrs = _per_run("learning_rates",
                   [cfg.learning_rate] * runs if learning_rates is None else learning_rates, runs)
    anchor_params = params if anchor_params is None else anchor_params
    out, stats = _many_program(loss_fn, cfg, post)(
        keys, frozen, data, params, anchor_params,
        *(jnp.asarray(v, jnp.float32) for v in (zs, lams, lrs)))
    check_step(stats)
    ledgers = []
    for z in zs:
        ledger = Ledger(cfg.relation, accountant=cfg.accountant)
        ledger.record(cfg.step_event(float(z)), count=cfg.steps, label=f"dp-merging/{cfg.mode}")
        ledgers.append(ledger)
    return ManyResult(out, stats, ledgers)
