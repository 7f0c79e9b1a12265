"""Privacy accounting: a ledger of dp-accounting events, event builders and noise calibration."""

from pavejax.accounting._json import event_from_json, event_to_json
from pavejax.accounting.ledger import (
    BudgetExceededError,
    Ledger,
    LedgerEntry,
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
    "Relation",
    "calibrate_noise",
    "calibrate_steps",
    "dp_sgd_event",
    "event_from_json",
    "event_to_json",
    "gaussian_step_event",
]
