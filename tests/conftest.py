"""Test harness: 8 virtual CPU devices, strict dtype promotion, rank promotion raises, and
XLA's CPU backend at optimisation level 0.

The tests run tiny models, so their time is mostly compilation; level 0 halves it (the DP-Merging
trainer's compile: 12 s to 6 s). Optimisation does not change what a program computes, only
float rounding, and the tests' tolerances are float32 ones. The flags go into the environment,
so subprocesses and notebook kernels started by the tests get them too. An
``--xla_backend_optimization_level`` already in ``XLA_FLAGS`` wins (set it to 2 to test the
optimised pipeline).
"""

import os

for _flag, _present in (("--xla_force_host_platform_device_count=8", None),
                        ("--xla_backend_optimization_level=0", "xla_backend_optimization_level")):
    if (_present or _flag) not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def key():
    """A fresh, fixed PRNG key for each test."""
    return jax.random.key(0)


@pytest.fixture
def getkey():
    """A callable returning a new independent key on every call (deterministic sequence)."""
    state = {"key": jax.random.key(1234)}

    def _next():
        state["key"], sub = jax.random.split(state["key"])
        return sub

    return _next
