"""``pavejax audit``: an empirical distinguishing-game audit of a DP mechanism on a tiny model.

The adversary sees one release and guesses whether a canary example was in the data. From
``--trials`` releases per world, :func:`pavejax.audit.evaluate_game` gives an epsilon lower
bound that holds with probability 95 % (Clopper-Pearson); a correct mechanism never exceeds the
accountant's epsilon, a broken one does.

* ``dp-sgd``: the DP engine's noisy clipped-gradient step (:func:`pavejax.privacy.noisy_gradient`)
  in the white-box Dirac-canary game (:func:`pavejax.audit.dirac_whitebox_scores`).
* ``dp-s-pave``: the DP-S-PAVE spec mechanism on a toy two-layer ReLU backbone
  (:func:`pavejax.audit.spec_sampler`), black-box projection attack
  (:func:`pavejax.audit.spec_game`).

``--broken`` runs an **audit fixture**: a deliberately broken variant (:data:`BROKEN`), which
still claims the correct mechanism's epsilon. It exists only to show that the audit detects a
real bug; never use it to release anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from pavejax.commands import _shared as sh

# Audit fixtures: how each mechanism is deliberately broken under --broken (never for real use).
BROKEN = {
    "dp-sgd": "the noise std meant for the mean gradient is added to the sum (noise multiplier "
              "divided by the batch size), a classic bug",
    "dp-s-pave": "the noise multiplier divided by 10 while the calibrated epsilon is claimed",
}
_DEFAULT_RELATION = {"dp-sgd": "add_remove", "dp-s-pave": "replace_one"}
_N, _D_IN, _HIDDEN, _K = 16, 5, 6, 2  # the toy DP-S-PAVE problem
_DIRAC_EXAMPLES = 8

DESCRIPTION = (
    "Run an empirical privacy audit: the mechanism is run --trials times on two neighbouring "
    "data sets (with and without a canary example, or the canary replaced) and the best "
    "threshold attack gives an epsilon lower bound (95% confidence) at --delta. A correct "
    "mechanism's bound stays at or below the claimed epsilon (the accountant's, calibrated to "
    "--epsilon); a bound above it proves a privacy bug (exit status 3). --broken audits a "
    "deliberately broken variant, an audit fixture that must never be used for real releases.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sh.describe(p, DESCRIPTION, BROKEN, "--broken variants")
    p.add_argument("--mechanism", choices=tuple(BROKEN), required=True,
                   help="dp-sgd: the DP engine's Gaussian step (white-box Dirac canary); "
                        "dp-s-pave: the spec mechanism on a toy backbone (black-box)")
    p.add_argument("--epsilon", type=float, required=True,
                   help="the claimed budget: the noise is calibrated so that the mechanism is "
                        "(epsilon, --delta)-DP for the --relation neighbours")
    p.add_argument("--delta", type=float, default=1e-5,
                   help="delta of the claim and of the audit's bound (default %(default)g)")
    p.add_argument("--relation", choices=("add_remove", "replace_one"), default=None,
                   help="neighbouring relation: one example added/removed or replaced (default: "
                        "add_remove for dp-sgd, replace_one for dp-s-pave, the relation each "
                        "guarantee is stated for)")
    p.add_argument("--trials", type=int, default=None,
                   help="releases per world (default 20000 for dp-sgd, 4000 for dp-s-pave)")
    p.add_argument("--steps", type=int, default=1,
                   help="dp-sgd: noisy steps the adversary sees (default 1)")
    p.add_argument("--broken", action="store_true",
                   help="audit the deliberately broken variant (an audit fixture) to show that "
                        "the audit catches it")
    p.add_argument("--seed", type=int, default=0, help="seed of the audit's own randomness")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def audit_dp_sgd(epsilon: float, delta: float, *, relation: str, trials: int, steps: int,
                 broken: bool, seed: int) -> dict[str, Any]:
    """Dirac-canary game on ``steps`` full-batch noisy gradients (clip 1, 8 examples)."""
    import jax

    from pavejax.accounting import Ledger, calibrate, run_event
    from pavejax.audit import dirac_whitebox_scores, evaluate_game
    from pavejax.privacy import DPConfig, SamplingConfig

    def step_event(z: float):
        return DPConfig(1.0, z, SamplingConfig("full", dataset_size=_DIRAC_EXAMPLES)).step_event()

    sigma = calibrate(lambda z: run_event(step_event(z), steps), epsilon, delta,
                      relation=relation, accountant="pld")
    event = step_event(sigma)
    ledger = Ledger(relation, "pld")
    ledger.record(event, count=steps, label="audited")
    claimed = ledger.epsilon(delta)
    used = sigma / _DIRAC_EXAMPLES if broken else sigma  # BROKEN["dp-sgd"]
    s_in, s_out = dirac_whitebox_scores(jax.random.key(seed), l2_clip=1.0, noise_multiplier=used,
                                        steps=steps, runs=trials, relation=relation,
                                        num_examples=_DIRAC_EXAMPLES)
    game = evaluate_game(s_in, s_out, delta=delta, claimed_epsilon=claimed, seed=seed)
    return {"noise_multiplier_claimed": sigma, "noise_multiplier_used": used,
            "game": game.to_dict()}


def _toy_logits(params, batch, aux):
    import jax

    return jax.nn.relu(batch["x"] @ params["l1"]["kernel"]) @ params["l2"]["kernel"]


def _toy_predicate(path: str, leaf: Any) -> bool:
    return path.endswith("kernel")


def _toy_problem():
    # Two-layer ReLU backbone, 16 examples; the canary (last row) has a large input so its
    # gradient is clipped to exactly C; its replace-one neighbour carries the other label.
    import jax.numpy as jnp
    import numpy as np

    from pavejax.pave import spec as S

    rng = np.random.default_rng(0)
    params = {"l1": {"kernel": jnp.asarray(rng.normal(size=(_D_IN, _HIDDEN)) / math.sqrt(_D_IN),
                                           jnp.float32)},
              "l2": {"kernel": jnp.asarray(rng.normal(size=(_HIDDEN, _K)) / math.sqrt(_HIDDEN),
                                           jnp.float32)}}
    backbone = S.Backbone("toy-relu-mlp", params, S.backbone_hash(params))
    x = (0.5 * rng.normal(size=(_N, _D_IN))).astype(np.float32)
    x[-1] = 4.0 * np.abs(rng.normal(size=_D_IN)) + 2.0
    t_in = S.hard_targets(rng.integers(0, _K, _N), _K)
    t_in[-1] = [1.0, 0.0]
    t_out = t_in.copy()
    t_out[-1] = [0.0, 1.0]
    return backbone, {"x": x}, t_in, t_out


def audit_dp_s_pave(epsilon: float, delta: float, *, relation: str, trials: int,
                    broken: bool, seed: int) -> dict[str, Any]:
    """Projection attack on one-step full-batch DP-S-PAVE of a toy backbone (rank 2)."""
    import jax
    import numpy as np

    from pavejax.audit import spec_game, spec_sampler
    from pavejax.pave import spec as S

    backbone, inputs, t_in, t_out = _toy_problem()
    privacy = S.PrivacyConfig(l2_clip=1.0, target_epsilon=epsilon, delta=delta, sampling="full")
    config = S.SpecConfig.preset("one_step", rank=2, progress=False, privacy=privacy)
    sampler = spec_sampler(_toy_logits, backbone, _toy_predicate, config)
    sigma = sampler.noise_multiplier(_N)
    replace_one, add_remove = sampler.ledgers(_N)
    claimed = (replace_one if relation == "replace_one" else add_remove).epsilon(delta)
    used = sigma / 10 if broken else sigma  # BROKEN["dp-s-pave"]
    if broken:
        bad = dataclasses.replace(privacy, target_epsilon=None, noise_multiplier=used)
        sampler = spec_sampler(_toy_logits, backbone, _toy_predicate,
                               dataclasses.replace(config, privacy=bad))
    absent = None
    world_out = (inputs, t_out)
    if relation == "add_remove":
        absent = np.arange(_N) == _N - 1
        world_out = (inputs, t_in)
    game = spec_game(sampler, (inputs, t_in), world_out, jax.random.key(7 + seed),
                     runs=trials, shadow_runs=max(4, trials // 2), absent_out=absent,
                     delta=delta, claimed_epsilon=claimed, seed=seed)
    return {"noise_multiplier_claimed": sigma, "noise_multiplier_used": used,
            "game": game.to_dict()}


def run(ns: argparse.Namespace) -> int:
    import json

    if not (math.isfinite(ns.epsilon) and ns.epsilon > 0):
        raise ValueError(f"--epsilon must be a finite number > 0, got {ns.epsilon}")
    if not 0 < ns.delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {ns.delta}")
    relation = ns.relation or _DEFAULT_RELATION[ns.mechanism]
    trials = ns.trials or (20_000 if ns.mechanism == "dp-sgd" else 4_000)
    if trials < 8:
        raise ValueError(f"--trials must be >= 8 (half select the attack, half evaluate it), "
                         f"got {trials}")
    if ns.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {ns.steps}")
    if ns.mechanism == "dp-sgd":
        res = audit_dp_sgd(ns.epsilon, ns.delta, relation=relation, trials=trials,
                           steps=ns.steps, broken=ns.broken, seed=ns.seed)
    else:
        res = audit_dp_s_pave(ns.epsilon, ns.delta, relation=relation, trials=trials,
                              broken=ns.broken, seed=ns.seed)
    g = res["game"]
    violated = g["epsilon_lower"] > g["claimed_epsilon"]
    report = {"mechanism": ns.mechanism, "broken": ns.broken, "relation": relation,
              "trials": trials, "delta": ns.delta, "violated": violated, **res}
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        variant = f"BROKEN variant ({BROKEN[ns.mechanism]})" if ns.broken else "as implemented"
        verdict = ("VIOLATION: the audit proves the mechanism leaks more than claimed"
                   if violated else "consistent: the audit does not beat the claim")
        print("\n".join([
            f"audit of {ns.mechanism}, {variant}",
            f"  {trials} releases per world, {relation} neighbours, delta {ns.delta:g}",
            f"  claimed epsilon        {g['claimed_epsilon']:.4f} (accountant, noise multiplier "
            f"{res['noise_multiplier_claimed']:.4g})",
            f"  audit epsilon (>=, 95%) {g['epsilon_lower']:.4f}",
            f"  attack advantage       {g['advantage']:.4f} (lower bound "
            f"{g['advantage_lower']:.4f})",
            f"  {verdict}"]))
    return 3 if violated else 0
