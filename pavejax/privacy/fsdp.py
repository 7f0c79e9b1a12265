"""Parameter-sharded (FSDP-style, optionally tensor-parallel) private gradients on a 2-D mesh.

A mesh with axes ``("data", "model")`` (:func:`model_mesh`) shards the batch over ``data`` and
every large parameter over ``model`` (:func:`fsdp_specs`; or any ``PartitionSpec`` per leaf the
caller passes, e.g. Megatron-style tensor parallelism). :func:`sharded_noisy_gradient` is the
one-device :func:`~pavejax.privacy.noisy_gradient` under ``jit`` with sharding constraints
(GSPMD): the computation is the same vmap-based :func:`~pavejax.privacy.clipped_sum`, and the
partitioner inserts the collectives:

* per-example gradient norms: each device holds a slice of every per-example gradient; the
  squared norms of the slices are summed across ``model`` (and over leaves) *before* the clip
  coefficients ``min(1, C / ||g_i||)`` are formed, so every example is clipped by its full joint
  norm, exactly as on one device;
* clipped sums: each device contracts its rows' coefficients with its gradient slices; the
  partial sums are reduced across ``data`` and stay sharded over ``model``;
* noise: drawn once from the replicated key, with the parameter sharding imposed on it. A
  partitioned program computes the same function, so the noise vector, and its variance
  ``(z * Delta)^2`` per coordinate, equal the one-device ones; JAX's partitionable threefry
  (``jax_threefry_partitionable``, the default) lets each device generate only its own slice
  (with it off the values are the same, but each device generates whole leaves).

The result equals the one-device ``noisy_gradient`` (same key) up to float summation order, and
the returned gradient carries the parameter sharding.

Sharp edges:
  * Never draw noise per device before the reduction over ``data``: independent per-device
    keys add ``n_data`` draws (variance times ``n_data``), one shared key adds the same draw
    ``n_data`` times (std times ``n_data``); either release differs from the accounted one.
    Here the noise is added once, after the ``data`` reduction.
  * Clipping each shard by the norm of its own slice bounds each slice, not the example: the
    joint sensitivity would become ``C * sqrt(n_model)``. GSPMD reduces the norms across
    ``model`` because it partitions the *one-device* program; a hand-written ``shard_map`` would
    have to ``psum`` the squared norms itself.
  * Do not use ``shard_map`` with parameters that are invariant across ``data`` (see
    :mod:`pavejax.privacy.sharding`): that path needs ``pcast`` to keep per-example gradients
    local. This module uses no ``shard_map``.
  * Mesh axes must be ``Auto`` (as :func:`model_mesh` builds them).
  * ``microbatch_size`` chunks the rows of each ``data`` shard (:func:`_microbatched`).
  * ``config.clip_method="ghost"`` works here too (the same traced program, partitioned).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from pavejax.privacy.clipping import ClipResult, LossFn, check_microbatch_size, clipped_sum
from pavejax.privacy.gradient import StepInfo, sample_padded
from pavejax.privacy.noise import privatize_sum

PyTree = Any

DEFAULT_MIN_SIZE = 1024


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def model_mesh(data: int, model: int) -> Mesh:
    """A 2-D mesh with Auto axes ``("data", "model")`` of shape ``(data, model)`` over the first
    ``data * model`` devices of ``jax.devices()`` (consecutive devices share a ``data`` row, so
    the ``model`` collectives stay between neighbours)."""
    data, model = _positive_int("data", data), _positive_int("model", model)
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices, but only "
                         f"{len(devices)} are available.")
    return jax.make_mesh((data, model), ("data", "model"),
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data * model])


def _axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _axis_size(mesh: Mesh, axis: str | Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in _axes(axis))


def _check_axes(mesh: Mesh, axes: Sequence[str], what: str) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see model_mesh), got "
                        f"{type(mesh).__name__}.")
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"{what} names the mesh axes {missing}, which the mesh (axes "
                         f"{tuple(mesh.axis_names)}) does not have; build it with "
                         "model_mesh(data, model).")


def fsdp_specs(tree: PyTree, mesh: Mesh, *, axis: str | Sequence[str] = "model",
               min_size: int = DEFAULT_MIN_SIZE) -> PyTree:
    """One ``PartitionSpec`` per leaf of ``tree`` (same structure): the FSDP sharding rule.

    Rule: let ``n`` be the size of ``axis`` in ``mesh`` (the product of the sizes when ``axis``
    is a tuple of axis names, e.g. ``("data", "model")`` for ZeRO-3-style full sharding). A leaf
    with at least ``min_size`` elements is sharded over ``axis`` along its largest dimension
    whose size is a multiple of ``n`` (the leading one among equals); every other leaf
    (scalars, leaves smaller than ``min_size``, leaves with no dimension divisible by ``n``,
    or any leaf when ``n == 1``) is replicated (``P()``). Small leaves are replicated because
    sharding them saves little memory and costs a collective each.
    """
    axes = _axes(axis)
    _check_axes(mesh, axes, "fsdp_specs' axis")
    n = _axis_size(mesh, axes)
    entry = axes[0] if len(axes) == 1 else axes

    def spec(leaf) -> P:
        shape = np.shape(leaf)
        if n == 1 or math.prod(shape) < min_size or not shape:
            return P()
        dims = [d for d, s in enumerate(shape) if s % n == 0 and s >= n]
        if not dims:
            return P()
        best = max(dims, key=lambda d: (shape[d], -d))
        return P(*([None] * best), entry)

    return jax.tree.map(spec, tree)


def _flat_specs(tree: PyTree, specs: PyTree) -> list[P]:
    treedef = jax.tree.structure(tree)
    try:
        flat = treedef.flatten_up_to(specs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"param_specs must have the structure of the parameters: {e}") from None
    return [s if isinstance(s, P) else P(*s) if s is not None else P() for s in flat]


def _check_specs(tree: PyTree, specs: list[P], mesh: Mesh) -> None:
    leaves = jax.tree.leaves(tree)
    for i, (leaf, s) in enumerate(zip(leaves, specs, strict=True)):
        shape = np.shape(leaf)
        if len(s) > len(shape):
            raise ValueError(f"param spec {s} of leaf {i} has more entries than the leaf has "
                             f"dimensions {shape}.")
        for dim, entry in enumerate(s):
            if entry is None:
                continue
            axes = _axes(entry)
            _check_axes(mesh, axes, f"param spec {s} of leaf {i}")
            k = _axis_size(mesh, axes)
            if shape[dim] % k:
                raise ValueError(f"param spec {s} of leaf {i} shards dimension {dim} of size "
                                 f"{shape[dim]} over {k} devices, which does not divide it.")


def shard_params(tree: PyTree, mesh: Mesh, specs: PyTree | None = None, *,
                 axis: str | Sequence[str] = "model",
                 min_size: int = DEFAULT_MIN_SIZE) -> PyTree:
    """``device_put`` of ``tree`` with a ``NamedSharding`` per leaf: ``specs`` (same structure),
    or :func:`fsdp_specs` of ``tree`` (``axis``, ``min_size``) by default."""
    specs = fsdp_specs(tree, mesh, axis=axis, min_size=min_size) if specs is None else specs
    flat = _flat_specs(tree, specs)
    _check_specs(tree, flat, mesh)
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.device_put(x, NamedSharding(mesh, s))
                                        for x, s in zip(leaves, flat, strict=True)])


def _constrain(tree: PyTree, mesh: Mesh, flat_specs: list[P]) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [
        jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))
        for x, s in zip(leaves, flat_specs, strict=True)])


def _check_mesh(mesh: Mesh, data_axis: str, model_axis: str) -> None:
    _check_axes(mesh, (data_axis, model_axis), "sharded_noisy_gradient")
    if AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())) or \
            AxisType.Manual in tuple(getattr(mesh, "axis_types", ())):
        raise ValueError("sharded_noisy_gradient needs a mesh with Auto axes (GSPMD decides "
                         "the collectives); build it with model_mesh(data, model) or "
                         "jax.make_mesh(..., axis_types=(AxisType.Auto,) * 2).")


def sharded_noisy_gradient(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, batch: PyTree,
                           mask: jax.Array | None, key: jax.Array, config, mesh: Mesh, *,
                           microbatch_size: int | None = None, param_specs: PyTree | None = None,
                           noise_multiplier: float | jax.Array | None = None,
                           data_axis: str = "data", model_axis: str = "model"):
    """:func:`~pavejax.privacy.noisy_gradient` with the batch sharded over ``data_axis`` and the
    trainable parameters sharded per ``param_specs`` (default: :func:`fsdp_specs` over
    ``model_axis``). Pure and jittable; returns ``(noisy mean gradient, StepInfo)``.

    Equals the one-device ``noisy_gradient`` with the same key up to float summation order (the
    module docstring says how norms, sums and noise are reduced); the gradient carries the
    parameter sharding. ``frozen`` keeps whatever sharding the caller placed it with
    (:func:`shard_params` it to shard it too). The batch size must be a multiple of the size of
    ``data_axis`` (pad and mask; :func:`sharded_private_gradient` does it). ``config`` is a
    :class:`~pavejax.privacy.DPConfig`; its clipping configuration is passed to
    :func:`~pavejax.privacy.clipped_sum` unchanged. ``microbatch_size`` chunks the rows *of
    each data shard* (memory only, never the result): the rows per shard must then be a
    multiple of it (or at most it: no chunking).
    """
    _check_mesh(mesh, data_axis, model_axis)
    check_microbatch_size(microbatch_size)
    n_data = mesh.shape[data_axis]
    bsz = jax.tree.leaves(batch)[0].shape[0]
    if bsz % n_data:
        raise ValueError(f"batch size {bsz} is not divisible by the {n_data} devices on axis "
                         f"{data_axis!r}; pad the batch to a multiple of {n_data} and mask the "
                         "padding (pavejax.privacy.pad_batch).")
    specs = param_specs if param_specs is not None else fsdp_specs(trainable, mesh,
                                                                   axis=model_axis)
    flat = _flat_specs(trainable, specs)
    _check_specs(trainable, flat, mesh)
    mask = jnp.ones((bsz,), bool) if mask is None else jnp.asarray(mask).astype(bool)
    rows = NamedSharding(mesh, P(data_axis))
    trainable = _constrain(trainable, mesh, flat)
    batch = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows), batch)
    mask = jax.lax.with_sharding_constraint(mask, rows)
    local = bsz // n_data
    if microbatch_size is None or microbatch_size >= local:
        r = clipped_sum(loss_fn, trainable, frozen, batch, mask, config.clip)
    else:
        r = _microbatched(loss_fn, trainable, frozen, batch, mask, config.clip, mesh, data_axis,
                          microbatch_size)
    grad_sum = _constrain(r.grad_sum, mesh, flat)
    z = config.noise_multiplier if noise_multiplier is None else noise_multiplier
    # The noise is drawn inside privatize_sum from the replicated key; the constraint on its
    # output (an elementwise function of the noise) makes each device draw only its slice.
    grad = privatize_sum(grad_sum, key, noise_multiplier=z,
                         sensitivity=config.sensitivity(len(jax.tree.leaves(trainable))),
                         expected_batch_size=config.sampling.expected_batch_size)
    grad = _constrain(grad, mesh, flat)
    return grad, StepInfo(r.losses, r.norms, mask, r.num_clipped, r.num_nonfinite)


def _microbatched(loss_fn, trainable, frozen, batch, mask, clip, mesh, data_axis, mb):
    """Microbatches within each ``data`` shard: the batch is viewed as (n_data, local rows) with
    the first axis sharded, ``clipped_sum`` (a ``lax.scan`` over chunks of ``mb`` local rows) is
    vmapped over it and the per-shard sums are added. A scan over chunks of the flat batch
    would instead gather the batch onto every device (each chunk then lives on one shard)."""
    n_data = mesh.shape[data_axis]
    bsz = mask.shape[0]
    local = bsz // n_data
    if local % mb:
        raise ValueError(f"the {local} rows per {data_axis!r} shard (batch {bsz} over {n_data} "
                         f"devices) are not a multiple of microbatch_size {mb}; pad the batch "
                         f"to a multiple of {n_data * mb} and mask the padding.")
    split = NamedSharding(mesh, P(data_axis))
    batch, mask = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x.reshape((n_data, local) + x.shape[1:]), split), (batch, mask))
    r = jax.vmap(lambda b, m: clipped_sum(loss_fn, trainable, frozen, b, m, clip,
                                          microbatch_size=mb))(batch, mask)
    return ClipResult(jax.tree.map(lambda g: jnp.sum(g, axis=0), r.grad_sum),
                      r.losses.reshape(bsz), r.norms.reshape(bsz), jnp.sum(r.num_clipped),
                      jnp.sum(r.num_nonfinite))


def sharded_private_gradient(loss_fn: LossFn, trainable: PyTree, frozen: PyTree, data: PyTree,
                             key: jax.Array, config, mesh: Mesh, *,
                             microbatch_size: int | None = None,
                             param_specs: PyTree | None = None,
                             noise_multiplier: float | jax.Array | None = None,
                             data_axis: str = "data", model_axis: str = "model"):
    """:func:`~pavejax.privacy.private_gradient` on a ``(data, model)`` mesh: samples the batch
    from ``data`` as the config says (same key split as ``private_gradient``, so the same draw
    and noise), pads it to a multiple of the ``data_axis`` size (times ``microbatch_size``),
    then :func:`sharded_noisy_gradient`. The caller checks ``overflow``/``num_nonfinite``
    (:func:`~pavejax.privacy.check_step`) before using the gradient.
    """
    _check_mesh(mesh, data_axis, model_axis)
    multiple = mesh.shape[data_axis] * (check_microbatch_size(microbatch_size) or 1)
    batch, mask, draw, k_noise = sample_padded(data, key, config, multiple)
    grad, info = sharded_noisy_gradient(loss_fn, trainable, frozen, batch, mask, k_noise, config,
                                        mesh, microbatch_size=microbatch_size,
                                        param_specs=param_specs,
                                        noise_multiplier=noise_multiplier,
                                        data_axis=data_axis, model_axis=model_axis)
    return grad, info._replace(overflow=draw.overflow)


__all__ = ["fsdp_specs", "model_mesh", "shard_params", "sharded_noisy_gradient",
           "sharded_private_gradient"]
