"""Audit rows of benchmarks/pave_privacy.py: distinguishing games on a toy spec backbone.

The toy backbone is a two-layer ReLU network (5 -> 6 -> 2) with both kernels adapted at rank 2;
the spec recipe is the one the identification rows use (``"one_step"``: one full-batch step, so
DP-S-PAVE is a single Gaussian release with sensitivity 2C). Two canaries:

* disclosure (user side): an input of large norm labelled 0 vs the same input labelled 1, in a
  16-example few-shot set; the adversary sees the spec only;
* amplification (model side): a developer's fixed, public model ``h(x) = x @ H`` fits its own
  predictions on 16 inputs; the canary input vs its mirror image. The model is the same under
  both data sets, so its own advantage is 0 and the amplification is the advantage on
  (model, spec).

Each DP-S-PAVE row is played twice: on the whole ``B`` blocks and on coordinate specs
(``mechanism = "dp-s-pave (coordinates)"``: a public random subspace of ``k = 2`` columns per
kernel, :mod:`pavejax.pave.subspace`), with the same noise multiplier and the same claim.

Attacks: the adversary holds ``A`` and projects the release on the mean difference of shadow
runs (DP-S-PAVE's guarantee holds against everyone); for non-private PAVE also the secret-``A``
attack of :func:`pavejax.audit.sketch_covariance_scores`. The white-box rows use
:func:`pavejax.audit.dirac_whitebox_scores` (q = 1, ``steps`` Gaussian steps, replace-one).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pavejax import audit
from pavejax.accounting import Ledger, risk
from pavejax.pave import spec as S, subspace as sub_lib
from pavejax.privacy import DPConfig, SamplingConfig

N, D_IN, HIDDEN, K = 16, 5, 6, 2


def _logits(params, batch, aux):
    return jax.nn.relu(batch["x"] @ params["l1"]["kernel"]) @ params["l2"]["kernel"]


def _predicate(path, leaf):
    return path.endswith("kernel")


def toy_problem() -> dict[str, Any]:
    """Backbone, the two neighbouring worlds of each game, and the dock key."""
    rng = np.random.default_rng(0)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(D_IN, HIDDEN)) / math.sqrt(D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(HIDDEN, K)) / math.sqrt(HIDDEN),
                                           jnp.float32)}}
    x = (0.5 * rng.normal(size=(N, D_IN))).astype(np.float32)
    x[-1] = 4.0 * np.abs(rng.normal(size=D_IN)) + 2.0
    t_in = S.hard_targets(rng.integers(0, K, N), K)
    t_in[-1] = [1.0, 0.0]
    t_out = t_in.copy()
    t_out[-1] = [0.0, 1.0]
    h = np.random.default_rng(3).normal(size=(D_IN, K)).astype(np.float32)
    x_mirror = x.copy()
    x_mirror[-1] = -x[-1]
    return {"backbone": S.Backbone("toy-relu-mlp", params, S.backbone_hash(params)),
            "disclosure": (({"x": x}, t_in), ({"x": x}, t_out)),
            "amplification": (({"x": x}, S.soft_targets(x @ h)),
                              ({"x": x_mirror}, S.soft_targets(x_mirror @ h))),
            "a_key": jax.random.key(7)}


def _config(privacy: S.PrivacyConfig | None, subspace=None) -> S.SpecConfig:
    return S.SpecConfig.preset("one_step", rank=2, privacy=privacy, progress=False,
                               subspace=subspace)


def _games(toy, sampler, runs, delta, claimed, attack="projection") -> dict[str, audit.GameResult]:
    return {name: audit.spec_game(sampler, *toy[name], toy["a_key"], runs=runs, attack=attack,
                                  delta=delta, claimed_epsilon=claimed, seed=i)
            for i, name in enumerate(("disclosure", "amplification"))}


def _row(mechanism: str, epsilon: float, claimed: float | None, games, delta: float):
    dis, amp = games["disclosure"], games["amplification"]
    row = {"part": "audit", "mechanism": mechanism, "epsilon": epsilon,
           "claimed_epsilon": claimed,
           "audit_epsilon": max(dis.epsilon_lower, amp.epsilon_lower),
           "disclosure_adv": dis.advantage, "disclosure_adv_lower": dis.advantage_lower,
           # the model alone is identical under both data sets: its advantage is exactly 0
           "amplification_adv": amp.advantage, "amplification_adv_lower": amp.advantage_lower}
    if claimed is not None:
        row |= {"audit_over_claimed": row["audit_epsilon"] / claimed,
                "tv_bound": risk.tv_bound(claimed, delta),
                "disclosure_bound": risk.disclosure_bound(claimed, delta)}
    return row


def spec_audit_rows(sigmas: dict[float, float], *, runs: int, delta: float,
                    l2_clip: float = 1.0, coordinates: bool = True) -> list[dict[str, Any]]:
    """Per target epsilon a DP-S-PAVE row (the noise multiplier calibrated for it; the claim is
    the ledger's epsilon) and, with ``coordinates``, the same on coordinate specs; then two
    non-private rows (A held by the adversary; A secret and fresh per run)."""
    toy = toy_problem()
    rows = []
    coords = sub_lib.random_projection(toy["backbone"].params, _predicate, 2, seed=0)
    variants = [("dp-s-pave", None)] + ([("dp-s-pave (coordinates)", coords)]
                                        if coordinates else [])
    for eps, sigma in sigmas.items():
        priv = S.PrivacyConfig(l2_clip=l2_clip, noise_multiplier=float(sigma), delta=delta,
                               sampling="full")
        for mechanism, subspace in variants:
            sampler = audit.spec_sampler(_logits, toy["backbone"], _predicate,
                                         _config(priv, subspace))
            claimed = sampler.ledgers(N)[0].epsilon(delta)
            rows.append(_row(mechanism, float(eps), claimed,
                             _games(toy, sampler, runs, delta, claimed), delta)
                        | {"noise_multiplier": float(sigma),
                           "spec_dim": sampler.dim})
    sampler = audit.spec_sampler(_logits, toy["backbone"], _predicate, _config(None))
    rows.append(_row("pave (A known)", math.inf, None, _games(toy, sampler, runs, delta, None),
                     delta))
    rows.append(_row("pave (A secret)", math.inf, None,
                     _games(toy, sampler, runs, delta, None, attack="sketch"), delta))
    return rows


def whitebox_rows(sigmas: dict[float, float], *, runs: int, steps: int, delta: float,
                  l2_clip: float = 1.0) -> list[dict[str, Any]]:
    """Dirac-canary white-box game per target epsilon (replace-one, q = 1, ``steps`` steps).

    ``sigmas`` maps a target epsilon to the one-step noise multiplier calibrated for it; at q = 1
    ``steps`` Gaussian steps of ``sigma sqrt(steps)`` compose to that one step exactly, so the
    claim (the ledger's epsilon over the steps) is the target up to accountant discretisation.
    """
    rows = []
    for i, (eps, sigma1) in enumerate(sigmas.items()):
        sigma = float(sigma1) * math.sqrt(steps)
        s_in, s_out = audit.dirac_whitebox_scores(jax.random.key(100 + i), l2_clip=l2_clip,
                                                  noise_multiplier=sigma, steps=steps, runs=runs)
        ledger = Ledger("replace_one")
        event = DPConfig(l2_clip, sigma, SamplingConfig("full", dataset_size=8)).step_event()
        for _ in range(steps):
            ledger.record(event)
        claimed = ledger.epsilon(delta)
        g = audit.evaluate_game(s_in, s_out, delta=delta, claimed_epsilon=claimed)
        rows.append({"part": "whitebox", "mechanism": f"dirac canary, {steps} steps",
                     "epsilon": float(eps), "claimed_epsilon": claimed,
                     "audit_epsilon": g.epsilon_lower, "audit_over_claimed": g.over_claimed,
                     "noise_multiplier": sigma, "runs_per_side": runs})
    return rows
