"""Small MLP/CNN classifiers (digits 8x8, MNIST 28x28) and a cached, seeded backbone pretrainer.

Every model here is split into ``backbone`` (``features(x)``) and ``head`` (a ``nnx.Linear``), so
LoRA can target backbone kernels by path (e.g. ``backbone/layers/0/kernel``,
``backbone/convs/1/kernel``) while a task swaps the head (``with_new_head``). Inputs may carry any
leading batch shape, including none, so the models ``jax.vmap`` over single examples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pavejax.models import _init
from pavejax.optim import promotion_safe

__all__ = [
    "MLP",
    "SmallCNN",
    "PretrainConfig",
    "Pretrained",
    "build_model",
    "classification_loss",
    "fit_classifier",
    "pretrain_backbone",
    "with_new_head",
]

Array = jax.Array
_CACHE_FORMAT = 1  # part of the cache key: bump when architectures or training change


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, dtype=jnp.float32, kernel_init=_init.lecun_normal, rngs=rngs)


class MLPBackbone(nnx.Module):
    """``depth`` dense layers with ReLU: (..., in_features) -> (..., hidden)."""

    def __init__(self, in_features: int, hidden: int, depth: int, *, rngs: nnx.Rngs):
        dims = [in_features] + [hidden] * depth
        self.layers = nnx.List([_linear(a, b, rngs) for a, b in zip(dims[:-1], dims[1:])])

    def __call__(self, x: Array) -> Array:
        """(..., in_features) -> (..., hidden) float32."""
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class MLP(nnx.Module):
    """MLP classifier: ``head(backbone(x))``, (..., in_features) -> (..., out_features) float32."""

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int = 2, *,
                 rngs: nnx.Rngs):
        for name, value in (("in_features", in_features), ("hidden", hidden),
                            ("out_features", out_features), ("depth", depth)):
            _positive_int(name, value)
        self.in_features = in_features
        self.feature_dim = hidden
        self.backbone = MLPBackbone(in_features, hidden, depth, rngs=rngs)
        self.head = _linear(hidden, out_features, rngs)

    def features(self, x: Array) -> Array:
        """Backbone features: (..., in_features) -> (..., hidden)."""
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"MLP expects inputs of shape (..., {self.in_features}), "
                             f"got {tuple(x.shape)}")
        return self.backbone(x)

    def __call__(self, x: Array) -> Array:
        """Logits: (..., in_features) -> (..., out_features) float32."""
        return self.head(self.features(x))


def _avg_pool_2x2(x: Array) -> Array:
    """Non-overlapping 2x2 mean over (N, H, W, C); an odd last row/column is dropped."""
    n, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2, :]
    return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


class CNNBackbone(nnx.Module):
    """3x3 conv + ReLU + 2x2 average pool per stage, then a dense ReLU layer."""

    def __init__(self, image_shape: tuple[int, int, int], channels: tuple[int, ...], hidden: int,
                 *, rngs: nnx.Rngs):
        h, w, c = image_shape
        widths = (c, *channels)
        self.convs = nnx.List([
            nnx.Conv(a, b, kernel_size=(3, 3), padding="SAME", dtype=jnp.float32,
                     kernel_init=_init.lecun_normal, rngs=rngs)
            for a, b in zip(widths[:-1], widths[1:])
        ])
        for _ in channels:
            h, w = h // 2, w // 2
        self.dense = _linear(h * w * channels[-1], hidden, rngs)

    def __call__(self, images: Array) -> Array:
        """(N, H, W, C) -> (N, hidden)."""
        x = images
        for conv in self.convs:
            x = _avg_pool_2x2(jax.nn.relu(conv(x)))
        return jax.nn.relu(self.dense(x.reshape(x.shape[0], -1)))


class SmallCNN(nnx.Module):
    """CNN classifier for small grey images; inputs (..., H*W*C) flat or (..., H, W, C).

    ``image_shape`` is (H, W) or (H, W, C); each stage halves H and W (floor), so each must be
    at least ``2 ** len(channels)``.
    """

    def __init__(self, image_shape: tuple[int, ...], num_classes: int,
                 channels: tuple[int, ...] = (16, 32), hidden: int = 64, *, rngs: nnx.Rngs):
        shape = tuple(image_shape) + ((1,) if len(image_shape) == 2 else ())
        if len(shape) != 3 or any(not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"image_shape must be (H, W) or (H, W, C), got {image_shape!r}")
        if not channels:
            raise ValueError("channels must name at least one conv stage, e.g. (16, 32)")
        for ch in channels:
            _positive_int("every entry of channels", ch)
        _positive_int("num_classes", num_classes)
        _positive_int("hidden", hidden)
        if min(shape[:2]) < 2 ** len(channels):
            raise ValueError(f"image_shape {image_shape} is too small for {len(channels)} "
                             "pooling stages; use fewer channels entries")
        self.image_shape = shape
        self.feature_dim = hidden
        self.backbone = CNNBackbone(shape, tuple(channels), hidden, rngs=rngs)
        self.head = _linear(hidden, num_classes, rngs)

    def features(self, x: Array) -> Array:
        """Backbone features: (..., H*W*C) or (..., H, W, C) -> (..., hidden)."""
        flat = int(np.prod(self.image_shape))
        if x.shape[-3:] == self.image_shape:
            lead = x.shape[:-3]
        elif x.shape[-1:] == (flat,):
            lead = x.shape[:-1]
        else:
            dims = ", ".join(map(str, self.image_shape))
            raise ValueError(f"SmallCNN expects (..., {flat}) or (..., {dims}) inputs, "
                             f"got {tuple(x.shape)}")
        feats = self.backbone(x.reshape((-1, *self.image_shape)))
        return feats.reshape((*lead, self.feature_dim))

    def __call__(self, x: Array) -> Array:
        """Logits: (..., H*W*C) or (..., H, W, C) -> (..., num_classes) float32."""
        return self.head(self.features(x))


def with_new_head(model: MLP | SmallCNN, num_outputs: int, *, seed: int = 0) -> MLP | SmallCNN:
    """A copy of ``model`` with the same backbone and a fresh ``Linear(feature_dim, num_outputs)``
    head initialised from ``seed``; ``model`` is left unchanged."""
    _positive_int("num_outputs", num_outputs)
    new = nnx.clone(model)
    new.head = _linear(model.feature_dim, num_outputs, nnx.Rngs(seed))
    return new


def classification_loss(model: nnx.Module, x: Array, y: Array) -> Array:
    """Mean softmax cross-entropy in nats of ``model(x)`` against int labels ``y`` (scalar)."""
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --- training and cached pretraining ----------------------------------------------------------


def _batch_indices(n: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """(steps, batch) indices: consecutive slices of fresh seeded permutations (no repeats within
    an epoch)."""
    batch = min(batch_size, n)
    rng = np.random.default_rng(seed)
    epochs = -(-steps * batch // n)
    order = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    return order[: steps * batch].reshape(steps, batch).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "learning_rate"))
def _adam_scan(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, x: Array, y: Array,
               indices: Array, learning_rate: float) -> tuple[nnx.State, Array]:
    # Module-level jit keyed on (graphdef, learning_rate): repeated fits of one architecture on
    # same-shaped data reuse the compiled loop.
    tx = promotion_safe(optax.adam(learning_rate))

    def step(carry, idx):
        params, opt_state = carry

        def loss_fn(p):
            return classification_loss(nnx.merge(graphdef, p, rest), x[idx], y[idx])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), indices)
    return params, losses


def fit_classifier(model: nnx.Module, x: np.ndarray, y: np.ndarray, *, steps: int,
                   batch_size: int = 64, learning_rate: float = 3e-3,
                   seed: int = 0) -> tuple[nnx.Module, np.ndarray]:
    """Train every ``nnx.Param`` of ``model`` with Adam on cross-entropy (non-private).

    Minibatches are seeded permutations of the N examples; the whole loop is one jitted
    ``lax.scan``. Returns a trained copy (``model`` is unchanged) and the (steps,) float32
    minibatch losses in nats.
    """
    _positive_int("steps", steps)
    _positive_int("batch_size", batch_size)
    x, y = np.asarray(x, np.float32), np.asarray(y, np.int32)
    if x.shape[0] != y.shape[0] or y.ndim != 1:
        raise ValueError(f"x (N, ...) and y (N,) must share N, got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("cannot train on an empty dataset")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    indices = jnp.asarray(_batch_indices(len(y), steps, batch_size, seed))
    params, losses = _adam_scan(graphdef, params, rest, jnp.asarray(x), jnp.asarray(y), indices,
                                float(learning_rate))
    return nnx.merge(graphdef, params, rest), np.asarray(losses)


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Architecture and optimisation of ``pretrain_backbone``; hashed into the cache key.

    ``arch`` is ``"mlp"`` (inputs (N, D)) or ``"cnn"`` (inputs (N, H*W) flat, with
    ``image_shape=(H, W)``). ``depth`` is used by the MLP, ``channels`` by the CNN.
    """

    arch: str = "mlp"
    hidden: int = 64
    depth: int = 2
    channels: tuple[int, ...] = (16, 32)
    image_shape: tuple[int, ...] | None = None
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        # Lists would make the config unhashable and hash differently from equal tuples.
        object.__setattr__(self, "channels", tuple(self.channels))
        if self.image_shape is not None:
            object.__setattr__(self, "image_shape", tuple(self.image_shape))
        if self.arch not in ("mlp", "cnn"):
            raise ValueError(f"arch must be 'mlp' or 'cnn', got {self.arch!r}")
        if self.arch == "cnn" and self.image_shape is None:
            raise ValueError("arch='cnn' needs image_shape, e.g. (8, 8) for digits")
        for name in ("hidden", "depth", "steps", "batch_size"):
            _positive_int(name, getattr(self, name))
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")


def build_model(config: PretrainConfig, in_features: int, num_classes: int,
                seed: int | None = None) -> MLP | SmallCNN:
    """The model ``config`` describes, freshly initialised from ``seed`` (default: config.seed)."""
    rngs = nnx.Rngs(config.seed if seed is None else seed)
    if config.arch == "mlp":
        return MLP(in_features, config.hidden, num_classes, config.depth, rngs=rngs)
    model = SmallCNN(config.image_shape, num_classes, config.channels, config.hidden, rngs=rngs)
    if int(np.prod(model.image_shape)) != in_features:
        raise ValueError(f"image_shape {config.image_shape} does not match {in_features} "
                         "input features")
    return model


class Pretrained(NamedTuple):
    """Result of ``pretrain_backbone``; ``from_cache`` is True when no training ran."""

    model: MLP | SmallCNN
    from_cache: bool
    path: Path | None
    key: str


def _cache_key(config: PretrainConfig, x: np.ndarray, y: np.ndarray) -> str:
    record = {
        "format": _CACHE_FORMAT,
        "config": dataclasses.asdict(config),
        "x": [list(x.shape), str(x.dtype), hashlib.sha256(x.tobytes()).hexdigest()],
        "y": [list(y.shape), str(y.dtype), hashlib.sha256(y.tobytes()).hexdigest()],
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _param_leaves(model: nnx.Module) -> dict[str, Any]:
    """``"backbone/layers/0/kernel" -> array`` (or shape struct for an abstract model)."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
    return {_path_name(path): v for path, v in flat}


def _save(path: Path, model: nnx.Module, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"param:{k}": np.asarray(v) for k, v in _param_leaves(model).items()}
    arrays["key"] = np.frombuffer(key.encode(), np.uint8)
    fd, tmp = tempfile.mkstemp(suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load(path: Path, template: nnx.Module, key: str) -> nnx.Module | None:
    """The cached model, or None when the file is absent, foreign or does not fit ``template``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError):
        return None
    if bytes(stored.pop("key", np.zeros(0, np.uint8))).decode(errors="replace") != key:
        return None
    params = {k.removeprefix("param:"): v for k, v in stored.items()}
    expected = _param_leaves(template)
    if params.keys() != expected.keys() or any(
            params[k].shape != v.shape or params[k].dtype != v.dtype for k, v in expected.items()):
        return None
    graphdef, state, rest = nnx.split(template, nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    pure = jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(params[_path_name(p)]) for p, _ in leaves])
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)


def pretrain_backbone(x: np.ndarray, y: np.ndarray, config: PretrainConfig = PretrainConfig(), *,
                      cache: bool = True) -> Pretrained:
    """Train a small classifier on (x, y) (e.g. digits 0-4) and cache it for reuse.

    Args:
      x: (N, D) float inputs (flat images for ``arch="cnn"``).
      y: (N,) int labels in 0..K-1 with every class present; K sets the head width.
      config: architecture, optimisation and seed.
      cache: look up / store the result under ``pavejax.assets.cache_dir() / "backbones"``, keyed
        by a sha256 of the config and the data. A missing or unreadable file is recomputed.

    Returns:
      ``Pretrained(model, from_cache, path, key)``. Training is deterministic given the config
      and data (same platform), so a cache hit equals a retrain.
    """
    x, y = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(y, np.int32)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"expected x (N, D) and y (N,), got {x.shape} and {y.shape}")
    classes = np.unique(y)
    if classes.size == 0 or not np.array_equal(classes, np.arange(classes.size)):
        raise ValueError(f"labels must be 0..K-1 with every class present, got {classes.tolist()};"
                         " relabel the class subset first")
    template = nnx.eval_shape(lambda: build_model(config, x.shape[1], classes.size))
    key = _cache_key(config, x, y)
    path = None
    if cache:
        from pavejax import assets

        path = assets.cache_dir() / "backbones" / f"{config.arch}-{key[:24]}.npz"
        cached = _load(path, template, key)
        if cached is not None:
            return Pretrained(cached, True, path, key)
    model, _ = fit_classifier(build_model(config, x.shape[1], classes.size), x, y,
                              steps=config.steps, batch_size=config.batch_size,
                              learning_rate=config.learning_rate, seed=config.seed)
    if path is not None:
        _save(path, model, key)
    return Pretrained(model, False, path, key)
