"""Test harness: 8 virtual CPU devices, strict dtype promotion, rank promotion raises."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
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
