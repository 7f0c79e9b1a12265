"""Empirical privacy audits: lower bounds on epsilon from distinguishing games."""

from pavejax.audit.distinguish import (
    clopper_pearson as clopper_pearson,
    epsilon_lower_bound as epsilon_lower_bound,
)
