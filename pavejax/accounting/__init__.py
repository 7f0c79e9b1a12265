"""Privacy accounting: a ledger of dp-accounting events (and PAC mutual-information charges),
event builders, noise calibration, and PAC-Privacy bounds (:mod:`pavejax.accounting.pac`)."""

from pavejax.accounting import pac
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
]
