"""Classification heads on pooled encoder outputs, and public seeded heads.

* :class:`ClassifierHead` / :class:`TextClassifier`: NNX modules (encoder + pooling + linear).
* :func:`public_random_head` / :func:`public_random_projection`: a fixed random head from a seed.
* :func:`label_space_head`: a public head keyed by class *names*, so tasks sharing classes share
  columns.
* :func:`head0`, :func:`apply_head`, :func:`example_loss`: a plain-dict linear head
  ``{"kernel": (hidden, k), "bias": (k,)}`` on frozen pooled features, the task model of the
  lifecycle and the command line (its public initial value, logits and per-example loss).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax.lora import LoraAdapters
from pavejax.models import _init
from pavejax.models.bert import BertEncoder, mean_pool

__all__ = ["POOLINGS", "ClassifierHead", "TextClassifier", "apply_head", "example_loss", "head0",
           "label_space_head", "public_random_head", "public_random_projection"]

POOLINGS: tuple[str, ...] = ("mean", "cls", "pooler")
_MAX_SEED = 2**63 - 1


class ClassifierHead(nnx.Module):
    """A linear layer on a pooled feature vector: (..., hidden) -> (..., num_labels) float32."""

    def __init__(self, hidden: int, num_labels: int, *, rngs: nnx.Rngs,
                 param_dtype: Any = jnp.float32):
        for name, value in (("hidden", hidden), ("num_labels", num_labels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.dense = nnx.Linear(hidden, num_labels, dtype=jnp.float32, param_dtype=param_dtype,
                                kernel_init=_init.lecun_normal, rngs=rngs)

    def __call__(self, pooled: jax.Array) -> jax.Array:
        """Logits ``pooled @ W + b``: (..., hidden) -> (..., num_labels) float32."""
        return self.dense(pooled).astype(jnp.float32)


class TextClassifier(nnx.Module):
    """Encoder + pooling + ``ClassifierHead``.

    Pooling: ``"mean"`` (masked mean of the last hidden state; default, as sentence-transformers),
    ``"cls"`` (hidden state of the first token) or ``"pooler"`` (BERT's tanh pooler on it, as
    Hugging Face ``BertForSequenceClassification``).

    LoRA: ``lora=LoraAdapters(B, A, config)`` with paths relative to the classifier
    (``"encoder/layers/0/attention/query/kernel"``, i.e. factors made by ``init_lora`` on the
    classifier's params) is applied factored inside the encoder; see ``BertEncoder``.
    """

    def __init__(self, encoder: BertEncoder, num_labels: int, *, rngs: nnx.Rngs,
                 pooling: str = "mean"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.encoder = encoder
        self.pooling = pooling
        self.head = ClassifierHead(encoder.config.hidden_size, num_labels, rngs=rngs)

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """Kernels that factored LoRA can adapt (paths relative to the classifier) -> shape."""
        return {f"encoder/{p}": s for p, s in self.encoder.lora_targets().items()}

    def features(self, input_ids: jax.Array, attention_mask: jax.Array,
                 token_type_ids: jax.Array | None = None, *,
                 lora: LoraAdapters | None = None) -> jax.Array:
        """Pooled features: (B, T) -> (B, hidden), or (T,) -> (hidden,) for one example.
        ``lora``: optional factored adapters, paths relative to the classifier."""
        if lora is not None:
            lora.check_targets(self.lora_targets(), "TextClassifier")
            lora = lora.under("encoder")
        hidden = self.encoder(input_ids, attention_mask, token_type_ids, lora=lora)
        if self.pooling == "mean":
            return mean_pool(hidden, attention_mask)
        if self.pooling == "cls":
            return hidden[..., 0, :]
        return self.encoder.pooled_cls(hidden)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
                 token_type_ids: jax.Array | None = None, *,
                 lora: LoraAdapters | None = None) -> jax.Array:
        """Logits: (B, T) -> (B, num_labels) float32, or (T,) -> (num_labels,). ``lora``:
        optional factored adapters (paths relative to the classifier), as :meth:`features`."""
        return self.head(self.features(input_ids, attention_mask, token_type_ids, lora=lora))


def _uniform01(seed: int, n: int) -> np.ndarray:
    # PCG64's raw 64-bit stream is fixed by its seed (numpy keeps bit-generator streams stable),
    # and the conversion below is exact integer/float arithmetic: identical on every platform.
    raw = np.random.PCG64(seed).random_raw(n)
    return (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def public_random_projection(hidden: int, num_outputs: int, seed: int) -> np.ndarray:
    """The (hidden, num_outputs) float32 weight of ``public_random_head``.

    Entries are i.i.d. U(-sqrt(3/hidden), sqrt(3/hidden)) (variance 1/hidden), drawn from
    ``numpy.random.PCG64(seed)``; a pure function of its arguments.
    """
    for name, value in (("hidden", hidden), ("num_outputs", num_outputs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")
    bound = np.sqrt(3.0 / hidden)
    u = _uniform01(seed, hidden * num_outputs)
    return ((2.0 * u - 1.0) * bound).astype(np.float32).reshape(hidden, num_outputs)


def public_random_head(hidden: int, num_outputs: int, seed: int) -> ClassifierHead:
    """A fixed random linear head, identical everywhere for the same ``seed`` (bias zero).

    Used to generate capability specifications when the models being compared have different
    label spaces: every party projects pooled features through the same public head, so the
    resulting gradients live in one shared space. The seed is public and is recorded in the
    release metadata; it carries no private information. Weight: ``public_random_projection``.
    """
    head = ClassifierHead(hidden, num_outputs, rngs=nnx.Rngs(0))
    head.dense.kernel[...] = jnp.asarray(public_random_projection(hidden, num_outputs, seed))
    head.dense.bias[...] = jnp.zeros((num_outputs,), jnp.float32)
    return head


def label_space_head(hidden: int, class_names: tuple[str, ...] | list[str],
                     seed: int = 0) -> np.ndarray:
    """The public mapping g: a (hidden, k) float32 kernel whose column for class ``c`` depends
    only on (``c``, ``seed``, ``hidden``).

    Keyed by label *name*, so tasks that share classes share columns, and specs of tasks with
    different label spaces still live in one parameter space (the backbone's ``B``). Columns are
    i.i.d. U(-sqrt(3/hidden), sqrt(3/hidden)), as :func:`public_random_projection`.
    """
    names = list(class_names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"class_names must be distinct and non-empty, got {names!r}")
    cols = []
    for name in names:
        digest = hashlib.sha256(f"pavejax.label.v1|{seed}|{name}".encode()).digest()
        cols.append(public_random_projection(hidden, 1, int.from_bytes(digest[:8], "big") >> 1))
    return np.concatenate(cols, axis=1)


def head0(hidden: int, classes: Sequence[str]) -> dict[str, jax.Array]:
    """The public initial head of a label space (label-keyed, so developers sharing classes
    share it and their models merge): ``{"kernel": (hidden, k), "bias": (k,)}`` float32, the
    kernel :func:`label_space_head` ``(hidden, classes, seed=1)`` and the bias zero."""
    return {"kernel": jnp.asarray(label_space_head(hidden, tuple(classes), seed=1)),
            "bias": jnp.zeros((len(classes),), jnp.float32)}


@jax.jit
def apply_head(params: dict, x: jax.Array) -> jax.Array:
    """Logits (n, k) of the head ``params`` on pooled features ``x`` (n, hidden)."""
    return x @ params["kernel"] + params["bias"][None, :]


def example_loss(params: dict, frozen: Any, ex: dict) -> jax.Array:
    """Per-example cross-entropy of the head ``params`` (``ex = {"x": (hidden,), "y": ()}``).

    The ``loss_fn(trainable, frozen, example)`` signature of the private trainers; ``frozen``
    is unused (the backbone's features are precomputed).
    """
    z = ex["x"] @ params["kernel"] + params["bias"]
    return -jax.nn.log_softmax(z)[ex["y"]]
