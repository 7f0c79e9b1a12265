"""PAVE specifications: train only the ``B`` factors of a shared backbone, release ``B``.

Model side (a developer's model ``h``): fit ``B`` so that ``g(f(x; W + s A B))`` reproduces the
model's own predictions ``h(x)`` on the developer's inputs (soft targets by default, hard argmax
as an option); the data labels are not used, so the spec encodes the model's *quality*. User
side: the same with the user's few-shot labels. ``g`` maps backbone outputs to the task's label
space (see :func:`pavejax.models.label_space_head` for a public, label-name keyed choice). The
spec is the concatenation of the trained ``B`` blocks in sorted path order (float32);
identification ranks models by ``cos(B_model, B_user)``.

Two mechanisms share one code path (:func:`generate_spec`):

* non-private (``config.privacy is None``): minibatch Adam (or SGD) on the mean loss, or, with
  ``config.example_clip``, on the mean of per-example gradients clipped jointly to that norm
  (the ``"one_step_clipped"`` preset: DP-S-PAVE's full-batch step without noise, so that a few
  large-gradient examples cannot dominate). No formal guarantee; with a secret ``A`` and a
  trajectory that does not depend on ``A`` (one full-batch, unclipped SGD step) the intrinsic
  sketch analysis of :mod:`pavejax.accounting.sketch` may apply, which
  :attr:`SpecResult.trajectory_independent_of_A` reports.
* **DP-S-PAVE** (``config.privacy`` set; Algorithm 1 of the PAVE privacy paper): per-example
  gradients with respect to ``B`` only, **joint** L2 clipping over all layers to ``C``, Gaussian
  noise ``sigma C`` added once to the clipped sum, Poisson (or fixed-size, or full-batch)
  sampling, normalisation by the expected batch size, then the optimiser (post-processing).
  Guarantee: (epsilon, delta)-DP of the released ``B`` (and everything computed from it:
  cosines, rankings, merged or reused models) with respect to replacing one example of the
  spec data (sensitivity ``2C``, Theorem 3.9), accounted by dp-accounting over the ``T`` steps.
  ``target_epsilon`` calibrates ``sigma``. The number of spec examples n is public: the spec
  records it, and Poisson's rate ``b / n`` and full batches' normaliser ``n`` reveal it anyway.
  That is why no add/remove figure is given: add/remove neighbours differ exactly in n (a
  full-batch spec divides by the real n, so its noise scale and mean tell n and n + 1 apart).

Sharp edges: ``A`` must be the dock's secret (from its key); never release ``A`` or the key
(:attr:`SpecResult.A` exists so the caller can merge or audit locally). A spec made with a
caller-supplied ``noise_key`` is marked ``replayable`` and every release and submit path refuses
it (whoever knows the key subtracts the noise). Per-layer clipping is
offered for comparison with the paper's pseudo-code; its sensitivity is ``C sqrt(L)`` and is
accounted as such.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from pavejax import lora, training
from pavejax._releasable import REPLAYABLE
from pavejax.accounting import Ledger, calibrate, gaussian_step_event, run_event
from pavejax.checkpointing import TrainCheckpointer, run_record
from pavejax.optim import promotion_safe
from pavejax.pave._loss import soft_cross_entropy
from pavejax.pave.subspace import Subspace
from pavejax.privacy import (
    ClipConfig,
    DPConfig,
    SamplingConfig,
    check_step,
    clipped_sum,
    private_gradient,
    replicate,
)
from pavejax.spec_types import PaveSpec, SpecSignature
from pavejax.training import Charge

__all__ = [
    "PRESETS",
    "Backbone",
    "PrivacyConfig",
    "SpecConfig",
    "SpecDPPlan",
    "SpecResult",
    "SpecStepStats",
    "backbone_hash",
    "generate_spec",
    "hard_targets",
    "model_spec",
    "soft_cross_entropy",
    "soft_targets",
    "spec_dp_plan",
    "spec_signature",
    "user_spec",
]

PyTree = Any
LogitsFn = Callable[[PyTree, Mapping[str, jax.Array], PyTree], jax.Array]


class Backbone(NamedTuple):
    """The shared backbone a spec is trained on: a public name, its params and their hash."""

    id: str
    params: PyTree
    hash: str


def backbone_hash(params: PyTree) -> str:
    """sha256 (hex) over every leaf's path, dtype, shape and bytes, in sorted path order."""
    h = hashlib.sha256(b"pavejax.backbone.v1")
    for path, leaf in sorted(lora.named_leaves(params).items()):
        a = np.asarray(leaf)
        h.update(f"{path}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _positive(name: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    ok_type = (isinstance(value, int) if integer else isinstance(value, int | float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or \
            (value < 0 if allow_zero else value <= 0):
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """DP-S-PAVE settings. Give exactly one of ``noise_multiplier`` and ``target_epsilon``.

    Attributes:
      l2_clip: C, the joint L2 clip of each example's gradient with respect to all ``B`` blocks.
      noise_multiplier: sigma; the noise std is ``sigma * C`` (Algorithm 1).
      target_epsilon: calibrate sigma so that the whole run meets (target_epsilon, delta) under
        replace-one neighbouring (the paper's relation).
      delta: the delta of the guarantee (default 1e-5; must be < 1/n to be meaningful).
      sampling: ``"poisson"`` (default), ``"fixed"`` (sampling without replacement) or
        ``"full"`` (q = 1, the closed form of Theorem 3.9).
      clipping: ``"joint"`` (default) or ``"per_layer"`` (sensitivity ``C sqrt(L)``).
      accountant: ``"pld"`` (default) or ``"rdp"``. dp-accounting's RDP has no analysis of
        Poisson sampling under replace-one neighbouring, so RDP needs ``sampling="fixed"`` or
        ``"full"``.
    """

    l2_clip: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    sampling: str = "poisson"
    clipping: str = "joint"
    accountant: str = "pld"

    def __post_init__(self) -> None:
        _positive("l2_clip", self.l2_clip)
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier and target_epsilon, e.g. "
                             "PrivacyConfig(target_epsilon=4.0)")
        if self.noise_multiplier is not None:
            _positive("noise_multiplier", self.noise_multiplier)
        if self.target_epsilon is not None:
            _positive("target_epsilon", self.target_epsilon)
        if not isinstance(self.delta, float | int) or not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}; use e.g. 1e-5 "
                             f"(below 1/n)")
        if self.sampling not in ("poisson", "fixed", "full"):
            raise ValueError(f"sampling must be 'poisson', 'fixed' or 'full', "
                             f"got {self.sampling!r}")
        if self.clipping not in ("joint", "per_layer"):
            raise ValueError(f"clipping must be 'joint' or 'per_layer', got {self.clipping!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"accountant must be 'rdp' or 'pld', got {self.accountant!r}")
        if self.accountant == "rdp" and self.sampling == "poisson":
            raise ValueError("the RDP accountant cannot analyse Poisson sampling under "
                             "replace-one neighbouring: use accountant='pld' (default) or "
                             "sampling='fixed'")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How a spec is trained. Defaults are the ``"pave"`` preset (see :data:`PRESETS`).

    Attributes:
      rank: LoRA rank r of every adapted leaf.
      a_init: ``"gaussian"`` (A ~ N(0, 1/r), the privacy paper) or ``"kaiming_uniform"``.
      alpha: LoRA scale numerator (None: alpha = r, scale 1).
      steps: optimiser steps T.
      batch_size: examples per step (expected size under Poisson sampling). Capped at n.
      learning_rate, optimizer (``"adam"``/``"adamw"``/``"sgd"``), weight_decay (adamw).
      l1: weight of ``sum_l |B_l|_1 / L`` (the learnware package's penalty; 0 = off). It uses no
        data, so it is added after privatisation.
      fit_target: model side, ``"soft"`` (softmax(h(x)/T), default) or ``"hard"`` (argmax).
      temperature: T of the soft targets.
      layer_scaling: ``"none"`` or ``"fan_in"`` (multiply layer l's block by sqrt(d_in/r), so
        that with Gaussian A the cosine weighs layers as cos(BA, B'A) does; post-processing).
      example_clip: non-private specs: clip each example's gradient with respect to all ``B``
        blocks (jointly) to this L2 norm before averaging, as DP-S-PAVE does but without noise
        (None: plain mean gradient). Every example whose gradient norm exceeds it then counts
        as a unit direction, so a few large-gradient examples (common in a handful of user
        shots) cannot dominate the spec. The clip coefficients depend on ``A``, so such a spec
        does not have an ``A``-independent trajectory. With ``privacy`` set it must be None or
        equal ``privacy.l2_clip``.
      seed: batch order of the non-private spec. Public and recorded in the spec. DP-S-PAVE
        never uses it: its sampling and noise come from a fresh OS-random key
        (``generate_spec(noise_key=...)``).
      privacy: None (non-private) or a :class:`PrivacyConfig` (DP-S-PAVE).
      microbatch_size: DP-S-PAVE: examples whose per-example gradients are held at once
        (memory only, never the result's distribution); None for the whole padded batch.
      progress: show a progress bar.
      subspace: None (default: the whole ``B`` blocks of every adapted kernel) or a public
        :class:`~pavejax.pave.subspace.Subspace`: the spec trains and releases the coordinates
        ``C = B U`` (``B = C U^T``) of the kernels the subspace keeps (the seed paper's Eq. 18);
        the subspace's hash enters the signature. Under DP-S-PAVE each example's gradient with
        respect to ``C`` (its ``B`` gradient projected on ``U``) is clipped and noised: same
        sensitivity, same accounting, ``r k`` noisy coordinates per kernel.
    """

    rank: int = 8
    a_init: str = "gaussian"
    alpha: float | None = None
    steps: int = 100
    batch_size: int = 32
    learning_rate: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    l1: float = 0.0
    fit_target: str = "soft"
    temperature: float = 1.0
    layer_scaling: str = "none"
    example_clip: float | None = None
    seed: int = 0
    privacy: PrivacyConfig | None = None
    microbatch_size: int | None = None
    progress: bool = True
    subspace: Subspace | None = None

    def __post_init__(self) -> None:
        lora.LoraConfig(self.rank, self.alpha, self.a_init)  # validates rank, alpha, init
        _positive("steps", self.steps, integer=True)
        _positive("batch_size", self.batch_size, integer=True)
        _positive("learning_rate", self.learning_rate)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("l1", self.l1, allow_zero=True)
        _positive("temperature", self.temperature)
        if self.optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adam', 'adamw' or 'sgd', got "
                             f"{self.optimizer!r}")
        if self.fit_target not in ("soft", "hard"):
            raise ValueError(f"fit_target must be 'soft' or 'hard', got {self.fit_target!r}")
        if self.layer_scaling not in ("none", "fan_in"):
            raise ValueError(f"layer_scaling must be 'none' or 'fan_in', got "
                             f"{self.layer_scaling!r}")
        if self.microbatch_size is not None:
            _positive("microbatch_size", self.microbatch_size, integer=True)
        if self.privacy is not None and not isinstance(self.privacy, PrivacyConfig):
            raise TypeError("privacy must be a PrivacyConfig or None")
        if self.subspace is not None and not isinstance(self.subspace, Subspace):
            raise TypeError("subspace must be a pavejax.pave.subspace.Subspace or None")
        if self.example_clip is not None:
            _positive("example_clip", self.example_clip)
            if self.privacy is not None and self.example_clip != self.privacy.l2_clip:
                raise ValueError(f"example_clip ({self.example_clip}) differs from privacy.l2_clip "
                                 f"({self.privacy.l2_clip}); DP-S-PAVE clips at privacy.l2_clip: "
                                 f"set example_clip=None")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SpecConfig:
        """A named preset from :data:`PRESETS`, with keyword overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @property
    def lora(self) -> lora.LoraConfig:
        return lora.LoraConfig(self.rank, self.alpha, self.a_init)


PRESETS: dict[str, SpecConfig] = {
    # B-only Adam for a few hundred steps: a choice for classification backbones (the ICLR
    # paper's exact values are unknown).
    "pave": SpecConfig(),
    # the learnware package's GenerativeModelSpecification (r=16, alpha=32, PEFT's A, AdamW
    # lr 1e-5, wd 0.5, L1 1/#tensors, 400 steps, batch 2); needs many steps to move B.
    "learnware_llm": SpecConfig(rank=16, alpha=32.0, a_init="kaiming_uniform", steps=400,
                                batch_size=2, learning_rate=1e-5, optimizer="adamw",
                                weight_decay=0.5, l1=1.0),
    # one full-batch gradient step: B is a Gaussian sketch of the full fine-tuning gradient
    # (the NTK view), and the trajectory does not depend on A.
    "one_step": SpecConfig(steps=1, batch_size=2**31 - 1, optimizer="sgd", learning_rate=1.0),
    # the same step on per-example gradients clipped to norm 1 (DP-S-PAVE's full-batch release
    # without the noise): every example counts as one direction. The identification benchmark's
    # recipe, for developers and users alike.
    "one_step_clipped": SpecConfig(steps=1, batch_size=2**31 - 1, optimizer="sgd",
                                   learning_rate=1.0, example_clip=1.0),
    # a cheap setting for CPUs and tests.
    "quick": SpecConfig(steps=30, batch_size=16, learning_rate=3e-3),
}


class SpecResult(NamedTuple):
    """What :func:`generate_spec` returns.

    ``spec`` is the release. ``B`` (dict path -> (r, d_out)) and ``A`` are for local use
    (merging, audits); ``A`` is secret. ``ledger`` is None for non-private specs. ``losses``
    holds the mean training loss per step (non-private) or the mean clipped-batch loss.
    """

    spec: PaveSpec
    B: dict[str, jax.Array]
    A: dict[str, jax.Array]
    ledger: Ledger | None
    losses: np.ndarray
    trajectory_independent_of_A: bool


def soft_targets(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(logits / T) as float32 (n, k): the model-side targets."""
    z = np.asarray(logits, np.float64) / float(temperature)
    if z.ndim != 2 or not np.isfinite(z).all():
        raise ValueError(f"model logits must be a finite (n, k) array, got shape {z.shape}")
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return (z / z.sum(axis=1, keepdims=True)).astype(np.float32)


def hard_targets(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """One-hot float32 (n, num_classes) of integer labels (or of argmax of logits if 2-D)."""
    y = np.asarray(labels)
    if y.ndim == 2:
        y = np.argmax(y, axis=1)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers (n,), got dtype {y.dtype} shape {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range "
                         f"[{y.min()}, {y.max()}]")
    return np.eye(num_classes, dtype=np.float32)[y]


def spec_signature(backbone: Backbone, B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
                   config: SpecConfig) -> SpecSignature:
    """The signature of specs made with these factors and config (with ``config.subspace``,
    ``B`` holds the coordinates ``C`` and ``A`` the subspace's kernels)."""
    layers = tuple(sorted(B))
    return SpecSignature(backbone_id=backbone.id, backbone_hash=backbone.hash, rank=config.rank,
                         layers=layers, layer_sizes=tuple(int(np.size(B[p])) for p in layers),
                         a_hash=lora.a_hash(A), a_init=config.a_init,
                         layer_scaling=config.layer_scaling,
                         subspace="identity" if config.subspace is None else config.subspace.hash)


def _check_data(inputs: Mapping[str, Any], targets: np.ndarray) -> int:
    if not isinstance(inputs, Mapping) or not inputs:
        raise TypeError("inputs must be a non-empty dict of arrays with a leading example axis")
    t = np.asarray(targets)
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] < 1:
        raise ValueError(f"targets must be (n, k) probabilities with n >= 1, got shape {t.shape}"
                         f"; a spec cannot be trained on empty data")
    if not np.isfinite(t).all() or (t < 0).any() or not np.allclose(t.sum(axis=1), 1.0,
                                                                     atol=1e-4):
        raise ValueError("targets must be finite probability rows (non-negative, summing to 1)")
    n = t.shape[0]
    for name, x in inputs.items():
        a = np.asarray(x)
        if a.shape[:1] != (n,):
            raise ValueError(f"inputs[{name!r}] has {a.shape[:1]} examples but targets have {n}")
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise ValueError(f"inputs[{name!r}] contains NaN or inf; clean the data first")
    return n


def _optimizer(config: SpecConfig) -> optax.GradientTransformation:
    if config.optimizer == "sgd":
        return promotion_safe(optax.sgd(config.learning_rate))
    if config.optimizer == "adamw":
        return promotion_safe(optax.adamw(config.learning_rate, weight_decay=config.weight_decay))
    return promotion_safe(optax.adam(config.learning_rate))


def _l1_grad(B: dict, weight: float) -> dict:
    # d/dB of weight * sum_l |B_l|_1 / L: data-free, so it may follow privatisation.
    scale = weight / len(B)
    return {p: scale * jnp.sign(b) for p, b in B.items()}


def _spec_vector(B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
                 config: SpecConfig) -> np.ndarray:
    blocks = []
    for p in sorted(B):
        b = np.asarray(B[p], np.float32).ravel()
        if config.layer_scaling == "fan_in":
            d_in = int(np.shape(A[p])[0])
            b = b * np.float32(math.sqrt(d_in / config.rank))
        blocks.append(b)
    return np.concatenate(blocks)


def generate_spec(logits_fn: LogitsFn, backbone: Backbone, predicate: lora.Predicate,
                  inputs: Mapping[str, Any], targets: np.ndarray, a_key: jax.Array,
                  config: SpecConfig = SpecConfig(), *, kind: str = "model", aux: PyTree = None,
                  info: Mapping[str, Any] | None = None,
                  checkpointer: TrainCheckpointer | None = None,
                  mesh: jax.sharding.Mesh | None = None,
                  noise_key: jax.Array | None = None) -> SpecResult:
    """Train ``B`` (A frozen, from ``a_key``) so that ``logits_fn`` fits ``targets``.

    Args:
      logits_fn: ``(params, batch, aux) -> (b, k)`` logits of ``g o f`` for a batch dict
        (leaves with a leading batch axis); ``params`` is ``backbone.params`` with the LoRA
        update applied; ``aux`` is passed through (e.g. the label-space head of ``g``). Reuse
        one ``logits_fn`` object across calls: compiled steps are cached per function.
      backbone: the shared backbone (see :class:`Backbone`); its hash goes into the signature.
      predicate: ``(path, leaf) -> bool`` selecting the adapted leaves (same for every party).
      inputs: dict of arrays, leading axis n (e.g. ``input_ids``, ``attention_mask``).
      targets: (n, k) probabilities: :func:`soft_targets` of the model's logits (model side) or
        :func:`hard_targets` of labels (user side).
      a_key: the dock's secret A key (never released; only ``a_hash`` is).
      config: a :class:`SpecConfig`; ``config.privacy`` switches to DP-S-PAVE.
      kind: ``"model"`` or ``"user"``.
      aux: any pytree handed to ``logits_fn`` unchanged (not trained).
      info: extra JSON-safe facts to record in the spec (e.g. class names, data size).
      checkpointer: DP-S-PAVE only: resume from its latest checkpoint (``B``, optimiser state,
        ledger, losses; ``A`` is rebuilt from ``a_key`` and never saved) and save every
        ``checkpointer.every`` steps; a killed and resumed run gives the bit-identical spec and
        an equal ledger. A checkpointer budget is enforced on the replace-one ledger before
        the first step (``BudgetExceededError``).
      mesh: DP-S-PAVE only: a 1-D ``'data'`` mesh; each device clips its share of the batch
        (equal to one device up to float summation order).
      noise_key: DP-S-PAVE only: the PRNG key of the sampling and the noise. Leave it None: a
        fresh key is then drawn from the operating system and never recorded (a resumed run
        takes the key from its checkpoint). Pass one only to replay a run in a test or an
        audit: whoever knows the key can regenerate the noise and subtract it, so the spec is
        marked ``info["replayable"] = True`` and ``save_spec``/``Dock.submit`` refuse it.

    Returns a :class:`SpecResult`. Raises ``ValueError`` on empty/NaN data and on training that
    diverges (a NaN spec is never returned).
    """
    n = _check_data(inputs, targets)
    if config.privacy is None and (checkpointer is not None or mesh is not None
                                   or noise_key is not None):
        raise ValueError("checkpointer, mesh and noise_key apply to DP-S-PAVE only; set "
                         "config.privacy (the non-private spec is cheap to recompute)")
    if noise_key is not None and not (isinstance(noise_key, jax.Array) and jax.dtypes.issubdtype(
            noise_key.dtype, jax.dtypes.prng_key) and noise_key.shape == ()):
        raise TypeError("noise_key must be one typed PRNG key (jax.random.key(...)); leave it "
                        "None for a fresh secret key")
    data = {k: jnp.asarray(v) for k, v in inputs.items()}
    data["__target"] = jnp.asarray(targets, jnp.float32)
    lcfg = config.lora
    B, A = lora.init_lora(a_key, backbone.params, predicate, lcfg)
    sub = config.subspace
    if sub is not None:  # train the coordinates C (r, k) of the kept kernels; B = C U^T
        sub.check_params(backbone.params, predicate)
        A = {p: A[p] for p in sub.paths}
        B = {p: jnp.zeros(shape, lcfg.dtype)
             for p, shape in sub.coordinate_shapes(lcfg.rank).items()}
    frozen = (A, backbone.params, aux)
    opt = _optimizer(config)
    opt_state = opt.init(B)
    desc = f"{kind} spec" + (" (DP-S-PAVE)" if config.privacy else "")
    losses = []
    ledger = None
    if config.privacy is None:
        bar = tqdm(range(config.steps), desc=desc, disable=not config.progress or None,
                   leave=False)
        batch_size = min(config.batch_size, n)
        full = batch_size == n
        if config.example_clip is None:
            grad_fn = _mean_grad(logits_fn, lcfg, sub)
        else:
            grad_fn = _clipped_mean_grad(logits_fn, lcfg, float(config.example_clip),
                                         min(_CLIP_MICROBATCH, batch_size), sub)
        rng = np.random.default_rng(config.seed)
        for _ in bar:
            batch = data if full else jax.tree.map(
                lambda v, i=rng.choice(n, batch_size, replace=False): v[i], data)
            loss, grad = grad_fn(B, frozen, batch)
            B, opt_state = _apply(B, grad, opt_state, opt, config)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        # clip coefficients are functions of A^T g: a clipped spec depends on A non-linearly
        independent = (config.optimizer == "sgd" and config.steps == 1 and full
                       and config.l1 == 0 and config.example_clip is None)
    else:
        priv = config.privacy
        plan = spec_dp_plan(logits_fn, n, config, mesh)
        sampling, sigma = plan.sampling, plan.noise_multiplier
        run = run_record("dp-s-pave", config, exclude=("steps", "progress", "subspace"),
                         sigma=sigma, kind=kind, num_examples=n, backbone=backbone.hash,
                         a_hash=lora.a_hash(A),
                         **({} if sub is None else {"subspace": sub.hash}))
        place = None if mesh is None else functools.partial(replicate, mesh=mesh)
        batch = (frozen, data) if mesh is None else (replicate(frozen, mesh), data)
        # The ledger is under replace-one: the release states its dataset size, so no
        # add/remove figure would hold.
        out = training.run(plan.step, plan.init(B), noise_key, config.steps, batch=batch,
                           ledger=Ledger("replace_one", accountant=priv.accountant),
                           checkpointer=checkpointer, run_record=run, check=check_step,
                           metric=lambda st: st.loss, place=place, desc=desc,
                           progress=config.progress)
        (B, _), ledger, losses = out.state, out.ledger, out.metrics
        key_origin = ("supplied by the caller (replayable: not for release)"
                      if noise_key is not None else
                      "fresh from the operating system, never recorded")
        independent = False
    coords = B
    if sub is not None:
        B = {p: jnp.asarray(b) for p, b in sub.lift(coords).items()}
    vec = _spec_vector(coords, A, config)
    if not np.isfinite(vec).all():
        raise ValueError("spec training diverged (NaN/inf in B); lower the learning rate")
    record = dict(info or {})
    record |= {"fit_target": config.fit_target if kind == "model" else "label",
               "num_examples": n, "num_classes": int(np.shape(targets)[1]),
               "config": _config_record(config)}
    if sub is not None:
        record["subspace"] = sub.describe()
    if config.privacy is not None:
        record |= _privacy_record(config, sampling, sigma, ledger, n)
        record["noise_key"] = key_origin
        record[REPLAYABLE] = noise_key is not None
    else:
        record |= {"mechanism": "pave", "guarantee": {
            "kind": "none", "trajectory_independent_of_A": independent,
            "note": "non-private spec; the intrinsic sketch analysis needs a secret A and a "
                    "trajectory that does not depend on A"}}
    spec = PaveSpec(vec, spec_signature(backbone, coords, A, config), kind, record)
    return SpecResult(spec, B, A, ledger, np.asarray(losses), independent)


def _example_losses(logits_fn: LogitsFn, lcfg: lora.LoraConfig, b: dict, frozen: tuple,
                    batch: Mapping[str, jax.Array], subspace: Subspace | None = None) -> jax.Array:
    A, params, aux = frozen
    if subspace is not None:
        b = subspace.lift(b)
    merged = lora.apply_lora(params, b, jax.lax.stop_gradient(A), lcfg)
    x = {k: v for k, v in batch.items() if k != "__target"}
    return soft_cross_entropy(logits_fn(merged, x, aux), batch["__target"])


@functools.cache
def _mean_grad(logits_fn: LogitsFn, lcfg: lora.LoraConfig,
               subspace: Subspace | None = None) -> Callable:
    def mean_loss(b, frozen, batch):
        return jnp.mean(_example_losses(logits_fn, lcfg, b, frozen, batch, subspace))

    return jax.jit(jax.value_and_grad(mean_loss))


_CLIP_MICROBATCH = 16  # per-example gradients held at once by an example_clip spec


def _clipped_mean_grad(logits_fn: LogitsFn, lcfg: lora.LoraConfig, l2_clip: float,
                       microbatch: int, subspace: Subspace | None = None) -> Callable:
    """``(B, frozen, batch) -> (mean loss, mean of per-example gradients clipped jointly to
    l2_clip)``; the batch is padded to a multiple of ``microbatch`` and the padding masked."""
    inner = _clipped_mean_grad_jit(logits_fn, lcfg, l2_clip, microbatch, subspace)

    def fn(b, frozen, batch):
        n = int(jax.tree.leaves(batch)[0].shape[0])
        pad = -n % microbatch
        if pad:
            batch = jax.tree.map(lambda v: jnp.concatenate([v, jnp.repeat(v[:1], pad, 0)]),
                                 batch)
        loss, grad, bad = inner(b, frozen, batch, jnp.arange(n + pad) < n)
        if int(bad):
            raise ValueError(f"{int(bad)} examples gave a non-finite loss or gradient; clean "
                             f"the data or the targets")
        return loss, grad

    return fn


@functools.cache
def _clipped_mean_grad_jit(logits_fn: LogitsFn, lcfg: lora.LoraConfig, l2_clip: float,
                           microbatch: int, subspace: Subspace | None = None) -> Callable:
    clip_cfg = ClipConfig(l2_clip)

    def example_loss(b, frozen, ex):
        return _example_losses(logits_fn, lcfg, b, frozen, jax.tree.map(lambda v: v[None], ex),
                               subspace)[0]

    @jax.jit
    def fn(b, frozen, batch, mask):
        res = clipped_sum(example_loss, b, frozen, batch, mask, clip_cfg,
                          microbatch_size=microbatch)
        count = jnp.sum(mask).astype(jnp.float32)
        loss = jnp.sum(jnp.where(mask, res.losses, 0.0)) / count
        return loss, jax.tree.map(lambda g: g / count, res.grad_sum), res.num_nonfinite

    return fn


def _apply(B, grad, opt_state, opt, config):
    if config.l1:
        grad = jax.tree.map(jnp.add, grad, _l1_grad(B, config.l1))
    updates, opt_state = opt.update(grad, opt_state, B)
    return optax.apply_updates(B, updates), opt_state


class SpecStepStats(NamedTuple):
    """Local statistics of one DP-S-PAVE step (not privatised: keep them local)."""

    loss: jax.Array
    num_nonfinite: jax.Array
    overflow: jax.Array


class SpecDPPlan(NamedTuple):
    """DP-S-PAVE as a pure step (the protocol of :mod:`pavejax.training`).

    ``state = (B, opt_state)`` (:meth:`init`); ``batch = (frozen, data)`` with ``frozen = (A,
    backbone params, aux)`` and ``data`` the spec inputs plus ``"__target"`` rows (what
    :func:`generate_spec` builds); :meth:`step` samples, clips, adds the noise, applies the
    optimiser and returns ``(state, Charge, SpecStepStats)``. ``generate_spec`` is this step
    under :func:`pavejax.training.run` with ``fold_in(noise_key, t)`` as step t's key. Any optax
    optimiser drives it: ``plan._replace(optimizer=optax.adamw(schedule))`` (the optimiser
    only post-processes the noisy gradient, so the charge is unchanged).
    """

    sampling: SamplingConfig
    noise_multiplier: float
    dp_config: DPConfig
    example_loss: Callable
    optimizer: optax.GradientTransformation
    l1: float
    microbatch_size: int | None
    mesh: jax.sharding.Mesh | None

    def init(self, B: PyTree) -> tuple[PyTree, Any]:
        """The initial state ``(B, optimiser state)``."""
        return B, self.optimizer.init(B)

    def step(self, state, batch, key):
        """One DP-S-PAVE step (pure, jittable; see the class docstring)."""
        B, opt_state = state
        frozen, data = batch
        grad, info = private_gradient(self.example_loss, B, frozen, data, key, self.dp_config,
                                      self.mesh, microbatch_size=self.microbatch_size)
        if self.l1:
            grad = jax.tree.map(jnp.add, grad, _l1_grad(B, self.l1))
        updates, opt_state = self.optimizer.update(grad, opt_state, B)
        m = info.mask.astype(jnp.float32)
        loss = jnp.sum(info.losses * m) / jnp.maximum(jnp.sum(m), 1.0)
        return ((optax.apply_updates(B, updates), opt_state),
                Charge(self.dp_config.step_event(), label="dp-s-pave"),
                SpecStepStats(loss, info.num_nonfinite, info.overflow))


@functools.cache
def spec_dp_plan(logits_fn: LogitsFn, n: int, config: SpecConfig,
                 mesh: jax.sharding.Mesh | None = None) -> SpecDPPlan:
    """The DP-S-PAVE plan of ``config`` on ``n`` spec examples: the sampling, the noise
    multiplier (calibrated once from ``target_epsilon`` if given), the per-step
    :class:`~pavejax.privacy.DPConfig` (whose ``step_event`` each step charges) and the step."""
    priv = config.privacy
    if priv is None:
        raise ValueError("spec_dp_plan needs config.privacy (a PrivacyConfig)")
    lcfg = config.lora
    kind = priv.sampling
    sampling = SamplingConfig(kind, dataset_size=n, batch_size=min(config.batch_size, n))
    if kind != "full" and sampling.batch_size == n:
        sampling = SamplingConfig("full", dataset_size=n)
    mb = config.microbatch_size
    if mb is not None:
        mb = min(mb, sampling.max_batch)  # a microbatch larger than any batch is one batch
        if sampling.max_batch % mb:
            sampling = dataclasses.replace(sampling, max_batch=-(-sampling.max_batch // mb) * mb)
    sigma = priv.noise_multiplier
    if sigma is None:
        fixed = sampling.kind == "fixed"
        step = functools.partial(gaussian_step_event, q=sampling.q,
                                 sampling="fixed" if fixed else "poisson",
                                 dataset_size=n if fixed else None,
                                 batch_size=sampling.batch_size if fixed else None)
        sigma = calibrate(lambda z: run_event(step(z), config.steps), priv.target_epsilon,
                          priv.delta, relation="replace_one", accountant=priv.accountant)
    # DPConfig's multiplier is relative to the add/remove sensitivity C (per-layer: C sqrt(L));
    # the replace-one ledger doubles the sensitivity, i.e. noise sigma C vs sensitivity 2C.
    dp_cfg = DPConfig(priv.l2_clip, float(sigma), sampling, relation="replace_one",
                      clipping=priv.clipping)

    def example_loss(b, frozen, ex):
        return _example_losses(logits_fn, lcfg, b, frozen, jax.tree.map(lambda v: v[None], ex),
                               config.subspace)[0]

    return SpecDPPlan(sampling, float(sigma), dp_cfg, example_loss, _optimizer(config),
                      float(config.l1), mb, mesh)


def _config_record(config: SpecConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
           if f.name not in ("privacy", "progress", "subspace")}
    if config.privacy is not None:
        out["privacy"] = dataclasses.asdict(config.privacy)
    if config.subspace is not None:
        out["subspace"] = config.subspace.hash
    return out


def _privacy_record(config: SpecConfig, sampling: SamplingConfig, sigma: float,
                    ledger: Ledger, n: int) -> dict[str, Any]:
    priv = config.privacy
    eps = ledger.epsilon(priv.delta)
    return {"mechanism": "dp-s-pave", "noise_multiplier": sigma, "sampling_rate": sampling.q,
            "ledger": ledger.to_dict(),
            "guarantee": {"kind": "dp", "relation": "replace_one", "epsilon": eps,
                          "delta": priv.delta, "accountant": priv.accountant,
                          "clipping": priv.clipping,
                          "public": f"the number of spec examples (n = {n}) and the sampling "
                                    f"rate are public and not protected; the relation is "
                                    f"replace-one because add/remove neighbours differ in n",
                          "conditions": ["A and its key are never released",
                                         "the noise key is fresh and secret (a spec made from "
                                         "a caller-supplied key is replayable and refused by "
                                         "every release path)",
                                         "per-example gradients of B clipped jointly to C"
                                         if priv.clipping == "joint" else
                                         "per-layer clipping, sensitivity C*sqrt(L) accounted"]}}


def model_spec(logits_fn: LogitsFn, backbone: Backbone, predicate: lora.Predicate,
               inputs: Mapping[str, Any], model_logits: np.ndarray, a_key: jax.Array,
               config: SpecConfig = SpecConfig(), **kwargs: Any) -> SpecResult:
    """Developer side: fit the model's own predictions (``model_logits`` (n, k) on ``inputs``;
    soft targets at ``config.temperature`` or hard argmax per ``config.fit_target``)."""
    logits = np.asarray(model_logits)
    targets = (soft_targets(logits, config.temperature) if config.fit_target == "soft"
               else hard_targets(logits, logits.shape[-1]))
    return generate_spec(logits_fn, backbone, predicate, inputs, targets, a_key, config,
                         kind="model", **kwargs)


def user_spec(logits_fn: LogitsFn, backbone: Backbone, predicate: lora.Predicate,
              inputs: Mapping[str, Any], labels: np.ndarray, num_classes: int,
              a_key: jax.Array, config: SpecConfig = SpecConfig(), **kwargs: Any) -> SpecResult:
    """User side: fit the user's few-shot ``labels`` (n,) ints in [0, num_classes)."""
    return generate_spec(logits_fn, backbone, predicate, inputs,
                         hard_targets(labels, num_classes), a_key, config, kind="user", **kwargs)
