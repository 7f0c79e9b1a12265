"""Multi-host: two processes on loopback (gloo collectives), 2 CPU devices each, run a DP
gradient and a DP-SAM step on one global mesh and get the single-process result."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pavejax import distributed
from pavejax.merging import train as mt
from tests import _multihost_worker as W

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kwargs, match", [
    ({"num_processes": 2}, "give both num_processes and process_id"),
    ({"num_processes": 2, "process_id": 2}, r"process_id must be an int in \[0, 2\)"),
    ({"num_processes": 0, "process_id": 0}, "num_processes must be an int >= 1"),
    ({"local_device_count": 0}, "local_device_count must be an int >= 1"),
])
def test_initialize_validates_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distributed.initialize("127.0.0.1:1", **kwargs)


def test_initialize_after_jax_started_is_refused():
    jax.devices()  # this test process runs JAX already
    with pytest.raises(RuntimeError, match="before any other JAX call"):
        distributed.initialize("127.0.0.1:1", num_processes=1, process_id=0)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # devices from initialize
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)  # the rest (conftest) carries over
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    procs = [subprocess.Popen([sys.executable, "-m", "tests._multihost_worker", str(pid),
                               str(port), str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for pid in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]

    data, mask, params = W.problem()
    state = mt.init_state(jax.tree.map(jnp.asarray, params),
                          mt.MergeTrainConfig(dataset_size=64, steps=1, noise_multiplier=1.0))
    ref = W.compute(None, jax.tree.map(jnp.asarray, data), jnp.asarray(mask),
                    jax.tree.map(jnp.asarray, params), state,
                    jnp.asarray([0, 42], jnp.uint32))
    assert int(ref["clipped"]) == int(mask.sum())  # every real example clipped, padding not
    for pid in (0, 1):
        with np.load(tmp_path / f"proc{pid}.npz") as got:
            assert sorted(got.files) == sorted(ref)
            for name, value in ref.items():
                np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7,
                                           err_msg=f"process {pid}: {name}")
