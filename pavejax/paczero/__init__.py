"""PACZero: PAC-private zeroth-order fine-tuning (ZPL and MI) with MeZO and DP-ZO baselines.

Modules: :mod:`~pavejax.paczero.perturb` (seeded directions, two-point differences,
pseudo-gradient), :mod:`~pavejax.paczero.subsets` (candidate subsets, signs),
:mod:`~pavejax.paczero.mechanisms` (release rules), :mod:`~pavejax.paczero.step` (the pytree
state, ``init`` and the pure steps, MI's two phases) and :mod:`~pavejax.paczero.train` (runs on
the one driver, `pavejax.training.run`: checkpoint/resume, budgets, dev selection).

Example: 100 ZPL steps under ``lax.scan`` inside your own ``jit`` (draw the secret ``key`` with
`pavejax.privacy.fresh_key` in a real run):

  >>> import jax, jax.numpy as jnp
  >>> from pavejax import paczero
  >>> pool = {"x": jnp.ones((8, 2)), "y": (jnp.arange(8) % 2).astype(jnp.float32)}
  >>> def loss_fn(params, frozen, ex):
  ...     logit = ex["x"] @ params["w"]
  ...     return jax.nn.softplus(logit) - ex["y"] * logit
  >>> cfg = paczero.ZOConfig("zpl", steps=100, learning_rate=0.1, num_subsets=4)
  >>> state = paczero.init(cfg, {"w": jnp.zeros(2)}, 8, key=jax.random.key(1),
  ...                      public_key=jax.random.key(0))
  >>> def body(s, _):
  ...     s, charge, stats = paczero.step(cfg, loss_fn, s, pool, paczero.step_key(s))
  ...     return s, stats["unanimous"]
  >>> state, unanimous = jax.jit(lambda s: jax.lax.scan(body, s, length=100))(state)
  >>> int(state.step), int(state.releases)
  (100, 100)
"""

from pavejax.paczero.mechanisms import (
    KINDS,
    ZPL_NATS,
    MIHostState,
    Release,
    dpzo_release,
    host_generator,
    mezo_release,
    mi_init_host,
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
    pseudo_gradient,
    two_point_differences,
    update_from_mirror,
)
from pavejax.paczero.step import (
    MIRelease,
    MISignals,
    ZOConfig,
    ZOState,
    dpzo_noise_multiplier,
    init,
    mi_apply,
    mi_device_phase,
    mi_host_release,
    schedule,
    step,
    step_charge,
    step_key,
)
from pavejax.paczero.subsets import (
    draw_secret,
    membership_matrix,
    subset_means,
    subset_signs,
    unanimous,
)
from pavejax.paczero.train import Selection, ZORun, train

__all__ = [
    "KINDS", "MIHostState", "MIRelease", "MISignals", "Release", "Selection", "ZOConfig",
    "ZORun", "ZOState", "ZPL_NATS", "apply_directions", "clip_differences", "direction",
    "direction_keys", "dpzo_noise_multiplier", "dpzo_release", "draw_secret",
    "host_generator", "init", "membership_matrix", "mezo_release", "mi_apply",
    "mi_device_phase", "mi_host_release", "mi_init_host", "mi_release", "mirror_point",
    "per_example_losses", "per_step_budget", "perturbed", "positive_mass", "pseudo_gradient",
    "schedule", "step", "step_charge", "step_key", "subset_means", "subset_signs", "train",
    "two_point_differences", "unanimous", "update_from_mirror", "zpl_release",
]
