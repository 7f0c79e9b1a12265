"""Audit PAVE specifications: rerun the spec mechanism many times and score the releases.

:func:`spec_sampler` rebuilds the exact computation of :func:`pavejax.pave.spec.generate_spec`
(same loss, same ``A`` from the key, same per-example clipping and noise of
:func:`pavejax.privacy.noisy_gradient`, same sampling keys ``fold_in(key(seed), step)``, same
optimiser) as one jitted ``vmap`` over seeds of a ``lax.scan`` over steps, so thousands of
releases of a small model cost seconds instead of thousands of host loops. For a given seed it
returns the vector that ``generate_spec`` with ``noise_key=jax.random.key(seed)`` releases
(tested). A real release draws its key fresh from the OS; the audit plays the mechanism with
chosen keys, which is the same distribution.

Neighbouring data sets for the distinguishing game:

* replace-one (the relation of DP-S-PAVE's guarantee): two data sets that differ in one row
  (the canary vs an ordinary example);
* add/remove: the data set with the canary, and the same data set with ``absent`` marking the
  canary row, which then never enters a batch. The normaliser (the expected batch size) stays the
  public ``q n`` of the full data set: the add/remove game of a mechanism whose size is a fixed
  public parameter. Real specs are not that mechanism (a spec on n - 1 rows divides by n - 1 and
  records its size), which is why releases carry replace-one figures only; to measure what a
  real spec reveals under add/remove, run the sampler on the two data sets themselves.

Scores turn releases into one number per run (higher = "canary present"):
:func:`projection_scores` (the likelihood-ratio test of a Gaussian mean shift when the direction
is the true mean difference; :func:`mean_difference` estimates it from shadow runs of the
mechanism, which an adversary that knows ``A`` and the rest of the data can simulate) and
:func:`sketch_covariance_scores` (the likelihood ratio of the Gaussian sketch ``B = F(D) A^T``
when ``A`` is secret and fresh, the setting of the intrinsic guarantee: only the covariance of
``B``'s rows depends on the data). :mod:`pavejax.audit.games` turns scores into epsilon lower
bounds and attack advantages; :func:`spec_game` runs a whole game, and
:meth:`SpecSampler.ledgers` gives the epsilon the audited mechanism claims.

Sharp edge: the programs are compiled with XLA's backend optimisation off (they are tiny and
compile time dominates on CPU); do not use the sampler to time the mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax import lora
from pavejax.accounting import Ledger
from pavejax.audit.games import GameResult, evaluate_game
from pavejax.pave import spec as spec_lib
from pavejax.privacy import noisy_gradient, take_batch

__all__ = [
    "SpecSampler",
    "mean_difference",
    "projection_scores",
    "sketch_covariance_scores",
    "spec_game",
    "spec_sampler",
]

PyTree = Any
# Audit programs are tiny and run once per chunk: spend little time optimising them.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class SpecSampler:
    """Releases of one spec mechanism (backbone, loss, config), many seeds at a time.

    Build with :func:`spec_sampler`; call as ``sampler(inputs, targets, seeds, a_key)``:

    * ``inputs``, ``targets``: the spec data, as for ``generate_spec``;
    * ``seeds``: int sequence (R,), one release per seed: the run's noise and sampling key is
      ``jax.random.key(seed)`` (``generate_spec(noise_key=jax.random.key(seed))``);
    * ``a_key``: one PRNG key (the same ``A`` for every run: an adversary that holds the dock's
      key) or a key array (R,) (a fresh secret ``A`` per run: the intrinsic-sketch setting);
    * ``absent``: optional bool (n,): rows that never enter a batch (the add/remove neighbour of
      a DP-S-PAVE data set; the normaliser stays that of all n rows). DP-S-PAVE only.

    Returns the (R, dim) float32 spec vectors. Data sets of one size share one compiled program.

    Attributes:
      blocks: ``(rank, d_out)`` (coordinate specs: ``(rank, k)``) of each adapted leaf in spec
        order (a spec vector is the
        concatenation of these row-major blocks).
      private: whether the mechanism is DP-S-PAVE.
    """

    def __init__(self, logits_fn: spec_lib.LogitsFn, backbone: spec_lib.Backbone,
                 predicate: lora.Predicate, config: spec_lib.SpecConfig, aux: PyTree,
                 chunk: int):
        if not isinstance(config, spec_lib.SpecConfig):
            raise TypeError("config must be a pavejax.pave.spec.SpecConfig")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if config.privacy is not None and config.microbatch_size is not None:
            raise ValueError("set microbatch_size=None for audits (it changes memory, "
                             "not the mechanism)")
        self.logits_fn, self.backbone, self.predicate = logits_fn, backbone, predicate
        self.config, self.aux, self.chunk = config, aux, chunk
        self.private = config.privacy is not None
        lcfg = config.lora
        sub = config.subspace
        B0, _ = lora.init_lora(jax.random.key(0), backbone.params, predicate, lcfg)
        if sub is not None:  # coordinate specs: C (r, k) on the subspace's kernels
            sub.check_params(backbone.params, predicate)
            B0 = {p: jnp.zeros(shape, lcfg.dtype)
                  for p, shape in sub.coordinate_shapes(lcfg.rank).items()}
        self._B0 = B0
        self.blocks = tuple(tuple(int(d) for d in np.shape(B0[p])) for p in sorted(B0))

        def a_factors(key):
            A = lora.init_lora(key, backbone.params, predicate, lcfg)[1]
            return A if sub is None else {p: A[p] for p in sub.paths}

        self._a_one = jax.jit(a_factors, compiler_options=_FAST_COMPILE)
        self._a_many = jax.jit(jax.vmap(a_factors), compiler_options=_FAST_COMPILE)
        self._programs: dict[int, tuple[Callable, Callable, int]] = {}
        self._setups: dict[int, tuple[Any, float, Any]] = {}

    @property
    def dim(self) -> int:
        """Length of a spec vector."""
        return sum(r * d for r, d in self.blocks)

    def _dp(self, n: int):
        # generate_spec's (sampling, sigma, plan) for n rows (sigma calibrated once).
        if n not in self._setups:
            plan = spec_lib.spec_dp_plan(self.logits_fn, n, self.config)
            self._setups[n] = (plan.sampling, plan.noise_multiplier, plan)
        return self._setups[n]

    def noise_multiplier(self, n: int) -> float:
        """sigma of DP-S-PAVE on n rows (calibrated from ``target_epsilon`` if that was given)."""
        self._require_private()
        return self._dp(n)[1]

    def ledgers(self, n: int) -> tuple[Ledger, Ledger | None]:
        """(replace-one, add/remove) ledgers of one release on n rows. The replace-one ledger
        is the one ``generate_spec`` records: the claimed privacy of the audited mechanism.
        The add/remove ledger holds the same events: it is the claim of the add/remove game
        this sampler plays (``absent`` rows, normaliser and rate still those of n rows, as if
        n were a fixed public parameter), *not* a figure any release carries: a real spec on
        n - 1 rows divides by n - 1, and its size is published, so releases state replace-one
        only. It is None under fixed-size sampling (analysed under replace-one only)."""
        self._require_private()
        sampling, _, dp = self._dp(n)
        priv = self.config.privacy
        out = []
        for relation in ("replace_one", "add_remove"):
            if relation == "add_remove" and sampling.kind == "fixed":
                out.append(None)
                continue
            ledger = Ledger(relation, accountant=priv.accountant)
            # one entry of count T, as generate_spec's driver records a run
            ledger.record(dp.dp_config.step_event(), count=self.config.steps, label="dp-s-pave")
            out.append(ledger)
        return out[0], out[1]

    def _require_private(self) -> None:
        if not self.private:
            raise ValueError("a non-private spec mechanism has no noise and no ledger")

    def _program(self, n: int):
        if n not in self._programs:
            self._programs[n] = _build_program(self, n)
        return self._programs[n]

    def __call__(self, inputs: Mapping[str, Any], targets: np.ndarray,
                 seeds: Sequence[int] | np.ndarray, a_key: jax.Array, *,
                 absent: np.ndarray | None = None) -> np.ndarray:
        n = spec_lib._check_data(inputs, targets)
        data = {k: jnp.asarray(v) for k, v in inputs.items()}
        data["__target"] = jnp.asarray(targets, jnp.float32)
        present = np.ones((n,), bool)
        if absent is not None:
            absent = np.asarray(absent)
            if absent.shape != (n,) or absent.dtype != bool:
                raise ValueError(f"absent must be a bool array of shape ({n},), got "
                                 f"{absent.dtype} {absent.shape}")
            if not self.private:
                raise ValueError("absent rows are for the add/remove game of DP-S-PAVE; for a "
                                 "non-private spec pass the data set without the row")
            present = ~absent
        seeds = np.asarray(seeds)
        if seeds.ndim != 1 or seeds.size == 0 or not np.issubdtype(seeds.dtype, np.integer):
            raise ValueError(f"seeds must be a non-empty 1-D int array, got shape {seeds.shape} "
                             f"dtype {seeds.dtype}")
        if not jnp.issubdtype(getattr(a_key, "dtype", np.float32), jax.dtypes.prng_key):
            raise TypeError("a_key must be a typed PRNG key (jax.random.key) or an array of them")
        if a_key.ndim > 1 or (a_key.ndim == 1 and a_key.shape[0] != seeds.size):
            raise ValueError(f"a_key must be one key (fixed A) or one key per seed (fresh A); "
                             f"got key shape {a_key.shape} for {seeds.size} seeds")
        run_fixed, run_fresh, _ = self._program(n)
        fresh = a_key.ndim == 1
        fixed_a = None if fresh else self._a_one(a_key)
        present = jnp.asarray(present)
        out = []
        for i in range(0, seeds.size, self.chunk):
            s = seeds[i:i + self.chunk]
            pad = self.chunk - s.size  # one compiled shape for every chunk
            s_pad = jnp.asarray(np.pad(s, (0, pad)), jnp.int32)
            if fresh:
                k = a_key[i:i + self.chunk]
                k = jnp.concatenate([k, jnp.broadcast_to(k[:1], (pad,))]) if pad else k
                vec, overflow = run_fresh(s_pad, self._a_many(k), data, present)
            else:
                vec, overflow = run_fixed(s_pad, fixed_a, data, present)
            if bool(overflow):
                raise ValueError("a Poisson draw overflowed max_batch in an audit run; "
                                 "generate_spec would have refused that step. Use other seeds "
                                 "or a larger max_batch")
            out.append(np.asarray(vec)[:s.size])
        return np.concatenate(out)


def _build_program(sampler: SpecSampler, n: int):
    # (run with one A, run with one A per seed, max_batch) for data sets of n rows.
    config, lcfg = sampler.config, sampler.config.lora
    opt = spec_lib._optimizer(config)
    params, aux, B0 = sampler.backbone.params, sampler.aux, sampler._B0

    if config.privacy is None:
        if min(config.batch_size, n) != n:
            raise ValueError("the sampler replicates full-batch non-private specs only; set "
                             f"batch_size >= n ({n}) (e.g. the 'one_step' preset)")
        grad_fn = spec_lib._mean_grad(sampler.logits_fn, lcfg, config.subspace)
        max_batch = n

        def step_fn(B, A, data, present, key, t):
            return grad_fn(B, (A, params, aux), data)[1], jnp.zeros((), bool)
    else:
        sampling, _, dp = sampler._dp(n)
        max_batch = sampling.max_batch

        def step_fn(B, A, data, present, key, t):
            k_sample, k_noise = jax.random.split(jax.random.fold_in(key, t))
            idx, mask, overflow = sampling.sample(k_sample)
            mask = mask & jnp.take(present, idx)
            grad, _ = noisy_gradient(dp.example_loss, B, (A, params, aux), take_batch(data, idx),
                                     mask, k_noise, dp.dp_config)
            return grad, overflow

    def one_run(seed, A, data, present):
        B = jax.tree.map(jnp.zeros_like, B0)
        key = jax.random.key(seed)

        def body(carry, t):
            B, opt_state = carry
            grad, overflow = step_fn(B, A, data, present, key, t)
            B, opt_state = spec_lib._apply(B, grad, opt_state, opt, config)
            return (B, opt_state), overflow

        (B, _), flags = jax.lax.scan(body, (B, opt.init(B)), jnp.arange(config.steps))
        return _spec_vector(B, A, config), jnp.any(flags)

    def batched(a_axis):
        run = jax.vmap(one_run, in_axes=(0, a_axis, None, None))

        def f(seeds, A, data, present):
            vec, flags = run(seeds, A, data, present)
            return vec, jnp.any(flags)

        return jax.jit(f, compiler_options=_FAST_COMPILE)

    return batched(None), batched(0), max_batch


def _spec_vector(B: Mapping[str, jax.Array], A: Mapping[str, jax.Array],
                 config: spec_lib.SpecConfig) -> jax.Array:
    # jnp twin of generate_spec's host-side vector: sorted paths, optional fan-in scaling.
    blocks = []
    for p in sorted(B):
        b = B[p].astype(jnp.float32).ravel()
        if config.layer_scaling == "fan_in":
            b = b * jnp.float32(math.sqrt(A[p].shape[0] / config.rank))
        blocks.append(b)
    return jnp.concatenate(blocks)


def spec_sampler(logits_fn: spec_lib.LogitsFn, backbone: spec_lib.Backbone,
                 predicate: lora.Predicate, config: spec_lib.SpecConfig, *,
                 aux: PyTree = None, chunk: int = 512) -> SpecSampler:
    """A :class:`SpecSampler` of ``generate_spec(logits_fn, backbone, predicate, inputs,
    targets, a_key, config, aux=aux)`` over seeds (and optionally over ``A``).

    Args:
      logits_fn, backbone, predicate, config, aux: as for
        :func:`pavejax.pave.spec.generate_spec`.
      chunk: runs per compiled call (memory vs. dispatch overhead).

    For a seed ``s`` and a fixed key the sampler returns what ``generate_spec`` with
    ``noise_key=jax.random.key(s)`` releases (up to float summation order). Non-private specs
    are supported for full-batch training only (the non-private minibatch order comes from a
    host RNG that is not replicated); with ``steps=1`` and SGD this is the ``"one_step"``
    recipe, whose trajectory does not depend on ``A``. Raises ``ValueError`` on unsupported
    settings.
    """
    return SpecSampler(logits_fn, backbone, predicate, config, aux, chunk)


def mean_difference(in_releases: np.ndarray, out_releases: np.ndarray) -> np.ndarray:
    """Unit vector along ``mean(in) - mean(out)`` of two (R, dim) release samples (float64).

    Use shadow runs that are *not* the ones scored afterwards, so the direction does not
    overfit the evaluation sample.
    """
    a, b = np.asarray(in_releases, np.float64), np.asarray(out_releases, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"releases must be (R, dim) arrays of one dim, got {a.shape} and "
                         f"{b.shape}")
    d = a.mean(axis=0) - b.mean(axis=0)
    norm = np.linalg.norm(d)
    if not np.isfinite(norm) or norm == 0.0:
        raise ValueError("the two release samples have identical (or non-finite) means; there "
                         "is no direction to project on")
    return d / norm


def projection_scores(releases: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """Scores ``releases @ direction`` (R,) float64: the Gaussian mean-shift likelihood-ratio
    statistic when ``direction`` is the mean difference of the two worlds."""
    x, d = np.asarray(releases, np.float64), np.asarray(direction, np.float64)
    if x.ndim != 2 or d.shape != (x.shape[1],):
        raise ValueError(f"releases must be (R, dim) and direction (dim,), got {x.shape} and "
                         f"{d.shape}")
    return x @ d


def _rows(releases: np.ndarray, blocks: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    x = np.asarray(releases, np.float64)
    if x.ndim != 2 or x.shape[1] != sum(r * d for r, d in blocks):
        raise ValueError(f"releases of shape {x.shape} do not match the blocks {list(blocks)}")
    out, start = [], 0
    for r, d in blocks:
        out.append(x[:, start:start + r * d].reshape(x.shape[0], r, d))
        start += r * d
    return out


def sketch_covariance_scores(releases: np.ndarray, in_shadow: np.ndarray,
                             out_shadow: np.ndarray, blocks: Sequence[tuple[int, int]],
                             ridge: float = 1e-6) -> np.ndarray:
    """Gaussian-sketch log-likelihood ratio of each release (R,), float64, for a secret ``A``.

    With ``B_l = F_l(D) A_l^T``-type releases and ``A`` fresh per run, the r rows of each block
    are i.i.d. ``N(0, S_l(D))``: the data enter only through the row covariance. The covariances
    of both worlds are estimated from shadow releases (each (R_s, dim), fresh ``A``), ridge-
    regularised by ``ridge * mean eigenvalue``, and the exact Gaussian log-likelihood ratio
    ``log p_in(B) - log p_out(B)`` is summed over blocks and rows.
    """
    if not (isinstance(ridge, float | int) and ridge > 0):
        raise ValueError(f"ridge must be > 0, got {ridge!r}")
    total = np.zeros(np.shape(releases)[0])
    for x, si, so in zip(_rows(releases, blocks), _rows(in_shadow, blocks),
                         _rows(out_shadow, blocks), strict=True):
        covs = []
        for s in (si, so):
            c = np.einsum("sri,srj->ij", s, s) / (s.shape[0] * s.shape[1])
            covs.append(c)
        lam = ridge * max(np.trace(covs[0]), np.trace(covs[1])) / covs[0].shape[0]
        logp = []
        for c in covs:
            c = c + lam * np.eye(c.shape[0])
            _, logdet = np.linalg.slogdet(c)
            quad = np.einsum("nri,ij,nrj->n", x, np.linalg.inv(c), x)
            logp.append(-0.5 * quad - 0.5 * x.shape[1] * logdet)
        total += logp[0] - logp[1]
    return total


def spec_game(sampler: SpecSampler, world_in: tuple[Mapping[str, Any], np.ndarray],
              world_out: tuple[Mapping[str, Any], np.ndarray], a_key: jax.Array, *,
              runs: int, shadow_runs: int | None = None, attack: str = "projection",
              absent_out: np.ndarray | None = None, delta: float = 1e-5,
              claimed_epsilon: float | None = None, alpha: float = 0.05,
              seed: int = 0) -> GameResult:
    """One black-box distinguishing game on a spec mechanism; returns a :class:`GameResult`.

    Args:
      sampler: the mechanism (:func:`spec_sampler`).
      world_in, world_out: ``(inputs, targets)`` of the neighbouring data sets D (canary in) and
        D' (replace-one neighbour; for add/remove pass D again with ``absent_out``).
      a_key: the dock key. ``attack="projection"``: every run uses ``A`` from this key and the
        adversary knows it (the setting of DP-S-PAVE's guarantee, which holds against everyone);
        it projects each release on the mean difference of ``shadow_runs`` simulated releases
        per world. ``attack="sketch"``: every run draws a fresh secret ``A`` (keys split from
        ``a_key``, unknown to the adversary) and the score is
        :func:`sketch_covariance_scores` (the intrinsic-sketch setting of non-private PAVE).
      runs: scored releases per world (half select the threshold, half evaluate it).
      shadow_runs: simulated releases per world for the attack (default ``runs``); seeds and
        ``A`` keys are disjoint from the scored ones.
      delta, claimed_epsilon, alpha: as in :func:`pavejax.audit.evaluate_game`.
      seed: selects disjoint seed ranges (``seed * 10**7 + ...``) and the threshold split.
    """
    if attack not in ("projection", "sketch"):
        raise ValueError(f"attack must be 'projection' or 'sketch', got {attack!r}")
    shadow_runs = runs if shadow_runs is None else shadow_runs
    for name, v in (("runs", runs), ("shadow_runs", shadow_runs)):
        if isinstance(v, bool) or not isinstance(v, int) or not 4 <= v <= 2_000_000:
            raise ValueError(f"{name} must be an int in [4, 2e6], got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 200:
        raise ValueError(f"seed must be an int in [0, 200), got {seed!r}")
    base = seed * 10**7
    sizes = (shadow_runs, shadow_runs, runs, runs)
    starts = np.cumsum((0,) + sizes[:-1]) + base
    keys = jax.random.split(jax.random.fold_in(a_key, seed), 4 * max(sizes))
    releases = []
    for i, (world, start, size) in enumerate(zip((world_in, world_out, world_in, world_out),
                                                 starts, sizes, strict=True)):
        k = a_key if attack == "projection" else keys[i * max(sizes):i * max(sizes) + size]
        absent = absent_out if i % 2 else None
        releases.append(sampler(world[0], world[1], np.arange(start, start + size), k,
                                absent=absent))
    sh_in, sh_out, ev_in, ev_out = releases
    if attack == "projection":
        d = mean_difference(sh_in, sh_out)
        s_in, s_out = projection_scores(ev_in, d), projection_scores(ev_out, d)
    else:
        s_in = sketch_covariance_scores(ev_in, sh_in, sh_out, sampler.blocks)
        s_out = sketch_covariance_scores(ev_out, sh_in, sh_out, sampler.blocks)
    return evaluate_game(s_in, s_out, delta=delta, claimed_epsilon=claimed_epsilon, alpha=alpha,
                         seed=seed)
