"""Empirical privacy audits: lower bounds on epsilon and attack advantages from distinguishing
games, for the DP engine and for PAVE specifications."""

from pavejax.audit.distinguish import (
    clopper_pearson as clopper_pearson,
    epsilon_lower_bound as epsilon_lower_bound,
)
from pavejax.audit.games import (
    Advantage as Advantage,
    GameResult as GameResult,
    attack_advantage as attack_advantage,
    dirac_whitebox_scores as dirac_whitebox_scores,
    evaluate_game as evaluate_game,
)
from pavejax.audit.spec_audit import (
    SpecSampler as SpecSampler,
    mean_difference as mean_difference,
    projection_scores as projection_scores,
    sketch_covariance_scores as sketch_covariance_scores,
    spec_game as spec_game,
    spec_sampler as spec_sampler,
)
