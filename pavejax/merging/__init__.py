"""DP-Merging: mergeable DP fine-tuning, merge operators and merge diagnostics.

The operators and diagnostics are pure JAX and load eagerly. The DP fine-tuning names
(:mod:`pavejax.merging.train`: ``train_task``, ``MergeTrainConfig``, ...) load on first access,
so ``import pavejax.merging`` pulls in neither the accountant (dp_accounting) nor the
checkpointer (Orbax).
"""

import importlib
from typing import Any

from pavejax.merging.diagnostics import (
    hessian_vector_product as hessian_vector_product,
    interpolation_path as interpolation_path,
    merge_gap as merge_gap,
    perturbed_loss_increase as perturbed_loss_increase,
    reference_drift as reference_drift,
    top_hessian_eigenvalue as top_hessian_eigenvalue,
)
from pavejax.merging.operators import (
    OPERATORS as OPERATORS,
    apply_task_vector as apply_task_vector,
    dare as dare,
    dare_masks as dare_masks,
    fisher as fisher,
    iso_c as iso_c,
    pcb as pcb,
    regmean as regmean,
    task_arithmetic as task_arithmetic,
    task_vectors as task_vectors,
    ties as ties,
    weight_average as weight_average,
    wudi as wudi,
)
from pavejax.merging.spectral import tsv_m as tsv_m

# Names re-exported from pavejax.merging.train, imported on first access (PEP 562).
_TRAIN_NAMES = frozenset({
    "MODES", "ManyResult", "MergeTrainConfig", "SamBatch", "StepStats", "TrainResult",
    "TrainState", "dp_sam_step", "init_state", "make_optimizer", "make_step", "train_many",
    "train_task",
})


def __getattr__(name: str) -> Any:
    if name in _TRAIN_NAMES:
        return getattr(importlib.import_module("pavejax.merging.train"), name)
    raise AttributeError(f"module 'pavejax.merging' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TRAIN_NAMES)
