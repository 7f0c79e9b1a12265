"""DP-Merging: mergeable DP fine-tuning, merge operators and merge diagnostics."""

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
from pavejax.merging.train import (
    MODES as MODES,
    MergeTrainConfig as MergeTrainConfig,
    TrainResult as TrainResult,
    TrainState as TrainState,
    calibrate_mode_noise as calibrate_mode_noise,
    dp_sam_step as dp_sam_step,
    init_state as init_state,
    mode_epsilon as mode_epsilon,
    run_event as run_event,
    step_event as step_event,
    train_task as train_task,
)
