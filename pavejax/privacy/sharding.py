"""Data-parallel private gradients over a device mesh (batch sharded, params replicated).

Each device clips its own examples and sums them; one ``psum`` gives the global clipped sum;
noise is added once, afterwards, from a replicated key (never per device: independent keys
would multiply the noise variance by the device count, identical keys its std).

Sharp edge (why ``pcast``): inside ``shard_map`` with ``check_vma=True``, differentiating with
respect to parameters that are invariant across the data axis makes JAX transpose the implicit
broadcast into a ``psum`` *inside* each per-example gradient, so example i of every shard is
mixed before clipping and the per-example sensitivity bound is silently lost. Marking the
parameters as varying (``jax.lax.pcast(..., to="varying")``) keeps per-example gradients local.
A loose clip norm hides the bug; the tests compare against one device with clipping active.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pavejax.privacy.clipping import ClipConfig, ClipResult, LossFn, clipped_sum

PyTree = Any


def data_mesh(num_devices: int | None = None, axis: str = "data") -> jax.sharding.Mesh:
    """A 1-D mesh of ``num_devices`` devices (default: all) with an Auto axis ``axis``."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else int(num_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices must be in [1, {len(devices)}], got {num_devices!r}.")
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:n])


def shard_batch(batch: PyTree, mesh: jax.sharding.Mesh, axis: str = "data") -> PyTree:
    """Places the leading (batch) axis of every leaf across ``axis`` of ``mesh``."""
    return jax.device_put(batch, NamedSharding(mesh, P(axis)))


def replicate(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Replicates ``tree`` on every device of ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def data_parallel_clipped_sum(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                              mask: jax.Array, cfg: ClipConfig, mesh: jax.sharding.Mesh,
                              axis: str = "data", *,
                              microbatch_size: int | None = None) -> ClipResult:
    """:func:`~pavejax.privacy.clipped_sum` with the batch sharded over ``axis`` of ``mesh``.

    The batch size must be a multiple of the number of devices on ``axis`` (pad and mask). The
    result equals the single-device clipped sum up to float summation order. Meshes with Auto
    axes (:func:`data_mesh`) and with Explicit axes (``jax.make_mesh``'s default) both work;
    with Explicit axes the inputs are resharded to the specs first.
    """
    n = mesh.shape[axis]
    bsz = jax.tree.leaves(batch)[0].shape[0]
    if bsz % n:
        raise ValueError(f"batch size {bsz} is not divisible by the {n} devices on axis "
                         f"{axis!r}; pad the batch to a multiple of {n} and mask the padding.")

    def local(trainable, frozen, batch, mask):
        return clipped_sum(loss_fn, trainable, frozen, batch, mask, cfg,
                           microbatch_size=microbatch_size, axis_name=axis)

    if AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
        # Explicit axes: shard_map requires the inputs to carry the specs it is given.
        trainable, frozen = jax.reshard((trainable, frozen), NamedSharding(mesh, P()))
        batch, mask = jax.reshard((batch, mask), NamedSharding(mesh, P(axis)))
    specs_out = ClipResult(P(), P(axis), P(axis), P(), P())
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)),
                       out_specs=specs_out)
    return fn(trainable, frozen, batch, mask)
