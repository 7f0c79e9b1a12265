"""PACZero: PAC-private zeroth-order fine-tuning (ZPL and MI) with MeZO and DP-ZO baselines.

Modules: :mod:`~pavejax.paczero.perturb` (seeded directions, two-point differences),
:mod:`~pavejax.paczero.subsets` (candidate subsets, signs), :mod:`~pavejax.paczero.mechanisms`
(release rules), :mod:`~pavejax.paczero.train` (loop) and :mod:`~pavejax.paczero.checkpoint`
(resumable runs through the Orbax TrainCheckpointer).
"""

from pavejax.paczero.checkpoint import restore_state, save_state
from pavejax.paczero.mechanisms import (
    KINDS,
    MechanismState,
    Release,
    dpzo_release,
    init_mechanism_state,
    mezo_release,
    mi_release,
    per_step_budget,
    positive_mass,
    zpl_release,
)
from pavejax.paczero.perturb import (
    apply_directions,
    clip_differences,
    direction,
    direction_keys,
    mirror_point,
    per_example_losses,
    perturbed,
    two_point_differences,
    update_from_mirror,
)
from pavejax.paczero.subsets import (
    draw_secret,
    membership_matrix,
    subset_means,
    subset_signs,
    unanimous,
)
from pavejax.paczero.train import (
    DeviceFunctions,
    ZOConfig,
    ZOState,
    device_functions,
    init_state,
    learning_rate,
    train,
    zo_signals,
    zo_update,
)

__all__ = [
    "KINDS", "DeviceFunctions", "MechanismState", "Release", "ZOConfig", "ZOState",
    "apply_directions", "clip_differences", "device_functions", "direction", "direction_keys",
    "dpzo_release", "draw_secret", "init_mechanism_state", "init_state",
    "learning_rate", "membership_matrix", "mezo_release", "mi_release", "mirror_point",
    "per_example_losses", "per_step_budget", "perturbed", "positive_mass", "restore_state",
    "save_state", "subset_means", "subset_signs", "train", "two_point_differences", "unanimous",
    "update_from_mirror", "zo_signals", "zo_update", "zpl_release",
]
