"""Privacy accounting: a ledger of dp-accounting events (and PAC mutual-information charges),
the event builders of every mechanism (:mod:`pavejax.accounting.events`), one noise calibrator
(:func:`calibrate`), PAC-Privacy bounds (:mod:`pavejax.accounting.pac`), the
intrinsic Gaussian-sketch guarantee of compact PAVE (:mod:`pavejax.accounting.sketch`), its
data-dependent evaluation on a concrete spec (:mod:`pavejax.accounting.intrinsic`) and
disclosure/amplification risk bounds (:mod:`pavejax.accounting.risk`)."""

from pavejax.accounting import intrinsic, pac, risk, sketch
from pavejax.accounting._json import event_from_json, event_to_json
from pavejax.accounting.calibration import calibrate, calibrate_steps
from pavejax.accounting.events import (
    DP_SAM_MODES,
    dp_sam_step_event,
    dpzo_step_event,
    gaussian_step_event,
    run_event,
)
from pavejax.accounting.intrinsic import (
    clipped_average_query,
    intrinsic_record,
    query_bounds,
    renyi_gaussian,
    sketch_pair_rdp,
)
from pavejax.accounting.ledger import (
    BudgetExceededError,
    Ledger,
    LedgerEntry,
    MIEntry,
    Relation,
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
    "DP_SAM_MODES",
    "calibrate",
    "calibrate_steps",
    "dp_sam_step_event",
    "dpzo_step_event",
    "event_from_json",
    "event_to_json",
    "gaussian_step_event",
    "run_event",
    "clipped_average_query",
    "intrinsic_record",
    "query_bounds",
    "renyi_gaussian",
    "sketch_pair_rdp",
    "intrinsic",
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
