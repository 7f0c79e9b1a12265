"""Multi-host entry point and the few helpers a data-parallel private step needs on a mesh.

Every host runs the same program. Each calls :func:`initialize` once, before any other JAX
call, builds the same global mesh (:func:`global_mesh`), feeds its own rows of the batch
(:func:`global_batch`) and replicated parameters (:func:`replicate_global`), and calls the same
jitted private step: each device clips its own examples, one ``psum`` spans every process, and
the noise is drawn once from the replicated key, so the release is the single-process one.

On CPU (tests, laptops) cross-process collectives go over gloo on TCP; on GPU (NCCL) and TPU
(ICI) the platform's own collectives are used and :func:`initialize` only forwards its
arguments (``jax.distributed.initialize()`` with no arguments auto-detects TPU pods, SLURM and
Open MPI).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

__all__ = ["fetch", "global_batch", "global_mesh", "initialize", "replicate_global"]

PyTree = Any


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None, *,
               local_device_ids: Sequence[int] | None = None,
               timeout_s: int = 300) -> None:
    """Joins this process to a multi-process JAX run (call once, before any JAX computation).

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator (None: auto-detect on TPU
        pods, SLURM, Open MPI).
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: CPU only: how many virtual CPU devices this process exposes (sets
        ``jax_num_cpu_devices``). Leave None on GPU/TPU.
      local_device_ids: GPU only: which local accelerators this process drives.
      timeout_s: how long to wait for every process to join.

    Cross-process CPU collectives use gloo (set here before the backends start; it does not
    affect GPU or TPU computations). Raises ``ValueError`` on inconsistent arguments and
    ``RuntimeError`` if JAX already started its backends in this process.
    """
    if (num_processes is None) != (process_id is None):
        raise ValueError("give both num_processes and process_id, or neither (auto-detect)")
    if num_processes is not None:
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id must be an int in [0, {num_processes}), got "
                             f"{process_id!r}")
    if local_device_count is not None and (not isinstance(local_device_count, int)
                                           or local_device_count < 1):
        raise ValueError(f"local_device_count must be an int >= 1, got {local_device_count!r}")
    from jax._src import xla_bridge  # the public API has no "backends started?" query

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("JAX already started its backends in this process; call "
                           "pavejax.distributed.initialize before any other JAX call")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=timeout_s)


def global_mesh(axis: str = "data") -> jax.sharding.Mesh:
    """A 1-D Auto mesh over every device of every process (process-major order)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.make_mesh((len(devices),), (axis,), axis_types=(AxisType.Auto,),
                         devices=devices)


def global_batch(local_rows: PyTree, mesh: jax.sharding.Mesh, axis: str = "data") -> PyTree:
    """Assembles a batch sharded over ``axis`` from each process's own rows (same row count on
    every process; the global batch is the processes' rows in process order)."""
    n_proc = jax.process_count()

    def one(x):
        x = np.asarray(x)
        shape = (x.shape[0] * n_proc, *x.shape[1:])
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P(axis)), x, shape)

    return jax.tree.map(one, local_rows)


def replicate_global(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Places a host value that is identical on every process on every device of ``mesh``."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P())), tree)


def fetch(tree: PyTree) -> PyTree:
    """Host numpy copy of replicated (or process-local) arrays, readable on any process."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if
                        isinstance(x, jax.Array) and not x.is_fully_addressable
                        else np.asarray(x), tree)
