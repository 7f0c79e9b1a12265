"""Privacy accounting: a ledger of dp-accounting events (and PAC mutual-information charges),
event builders, noise calibration, PAC-Privacy bounds (:mod:`pavejax.accounting.pac`), the
intrinsic Gaussian-sketch guarantee of compact PAVE (:mod:`pavejax.accounting.sketch`) and
disclosure/amplification risk bounds (:mod:`pavejax.accounting.risk`)."""

from pavejax.accounting import pac, risk, sketch
from pavejax.accounting._json import event_from_json, event_to_json
from pavejax.accounting.ledger import (
    BudgetExceededError,
    Ledger,
    LedgerEntry,
    MIEntry,
    Relation,
    calibrate_noise,
    calibrate_steps,
    dp_sgd_event,
    gaussian_step_event,
)
from pavejax.accounting.risk import (
    amplification_bound,
    balanced_attack_success,
    disclosure_bound,
    risk_report,
    tv_bound,
)
from pavejax.accounting.sketch import (
    SketchConditionError,
    SketchConditions,
    SketchGuarantee,
    average_query_sensitivity,
    gamma_from_bounds,
    intrinsic_guarantee,
    sketch_epsilon,
    sketch_rdp,
)

__all__ = [
    "BudgetExceededError",
    "Ledger",
    "LedgerEntry",
    "MIEntry",
    "Relation",
    "calibrate_noise",
    "calibrate_steps",
    "dp_sgd_event",
    "event_from_json",
    "event_to_json",
    "gaussian_step_event",
    "pac",
    "risk",
    "sketch",
    "SketchConditionError",
    "SketchConditions",
    "SketchGuarantee",
    "amplification_bound",
    "average_query_sensitivity",
    "balanced_attack_success",
    "disclosure_bound",
    "gamma_from_bounds",
    "intrinsic_guarantee",
    "risk_report",
    "sketch_epsilon",
    "sketch_rdp",
    "tv_bound",
]
