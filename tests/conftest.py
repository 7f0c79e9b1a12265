"""Test harness: 8 virtual CPU devices, strict dtype promotion, rank promotion raises, and
XLA's CPU backend at optimisation level 0 with its elemental (non-MLIR) fusion emitters.

The tests run tiny models, so their time is mostly compilation; level 0 halves it (the DP-Merging
trainer's compile: 12 s to 6 s), and the elemental emitters cut LLVM code generation by about
half again (a vmapped DP-SAM trainer: 6 s to 3 s of compile CPU time; test_merging_train.py:
115 s to 69 s). Neither changes what a program computes, only float rounding, and the tests'
tolerances are float32 ones. The flags go into the environment, so subprocesses and notebook
kernels started by the tests get them too. A flag already in ``XLA_FLAGS`` wins (set
``--xla_backend_optimization_level=2`` to test the optimised pipeline). An XLA that does not
know the emitter flag would abort on it, so it is tried in a subprocess first.
"""

import os
import subprocess
import sys


def _xla_knows(flag: str) -> bool:
    """Whether this XLA accepts ``flag`` in XLA_FLAGS (an unknown one aborts the process)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


for _flag, _present, _probe in (
        ("--xla_force_host_platform_device_count=8", None, False),
        ("--xla_backend_optimization_level=0", "xla_backend_optimization_level", False),
        ("--xla_cpu_use_fusion_emitters=false", "xla_cpu_use_fusion_emitters", True)):
    if (_present or _flag) not in os.environ.get("XLA_FLAGS", "") and (
            not _probe or _xla_knows(_flag)):
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
