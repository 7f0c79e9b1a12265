"""pavejax: the private learnware lifecycle in JAX.

The stable core is importable from the top level; each name loads its module on first use, so
``import pavejax`` stays light (no dp-accounting, Orbax or model code until asked for):

* DP engine (:mod:`pavejax.privacy`): ``DPConfig``, ``SamplingConfig``, ``ClipConfig``,
  ``clipped_sum``, ``privatize_sum``, ``gaussian_privatizer``, ``noisy_gradient``,
  ``private_gradient``, ``DPGradient``, ``check_step``, ``fresh_key``;
* accounting (:mod:`pavejax.accounting`): ``Ledger``, ``calibrate``, ``gaussian_step_event``;
* low-rank factors: :mod:`pavejax.lora`.

Methods live in their subpackages: :mod:`pavejax.pave` (specs, dock), :mod:`pavejax.merging`
(operators, DP-SAM), :mod:`pavejax.paczero`; :mod:`pavejax.training` is the one driver
behind every trainer. ``docs/composing.md`` shows the pieces inside your own ``jit``, ``scan``,
``shard_map`` and optax chain.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import pavejax as pj
  >>> plan = pj.DPConfig(l2_clip=1.0, noise_multiplier=1.0,
  ...                    sampling=pj.SamplingConfig("poisson", dataset_size=100, batch_size=10))
  >>> ledger = pj.Ledger("add_remove")
  >>> _ = ledger.record(plan.step_event(), count=100)
  >>> 0 < ledger.epsilon(1e-5) < 10
  True
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "pavejax.privacy": ("DPConfig", "SamplingConfig", "ClipConfig", "clipped_sum",
                        "privatize_sum", "gaussian_privatizer", "noisy_gradient",
                        "private_gradient", "DPGradient", "check_step", "fresh_key"),
    "pavejax.accounting": ("Ledger", "calibrate", "gaussian_step_event"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("accounting", "lora", "privacy")

__all__ = sorted(_WHERE) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pavejax.{name}")
    else:
        raise AttributeError(f"module 'pavejax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
