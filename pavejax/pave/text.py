"""A BERT-family encoder (all-MiniLM-L6-v2 by default) as the shared PAVE backbone for text.

``g`` is :func:`pavejax.models.label_space_head` on the masked-mean pooled last hidden
state: public, keyed by class name, so sentiment tasks (``negative``/``positive``) and topic
tasks (``business``/``sport``/...) all produce specs in one space, the ``B`` factors of the
adapted attention kernels.

Centring (default): ``g_x(z) = (z - f(x; theta_0)) W``, i.e. the pooled features of the adapted
backbone minus those of the frozen backbone on the same text. Every spec then starts from
uniform predictions, so its gradient is driven by the targets alone; without it, a random head's
own preferences add a target-independent component shared by all specs of one label space,
which pulls uninformative (undertrained) models towards every user.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax import lora
from pavejax.models.bert import BertEncoder, mean_pool
from pavejax.models.heads import label_space_head
from pavejax.pave.spec import (
    Backbone,
    SpecConfig,
    SpecResult,
    backbone_hash,
    model_spec,
    user_spec,
)
from pavejax.pave.subspace import Subspace, calibrated, random_targets

__all__ = ["MINILM_ID", "POOLINGS", "TextSpecBackbone", "attention_predicate"]

MINILM_ID = "all-MiniLM-L6-v2"
POOLINGS = ("mean", "cls")


def attention_predicate(layers: Sequence[int] | None = None,
                        targets: Sequence[str] = ("query", "value")) -> lora.Predicate:
    """Select ``attention/<target>/kernel`` of the given encoder layers (None: every layer)."""
    suffixes = tuple(f"attention/{t}/kernel" for t in targets)
    wanted = None if layers is None else {int(i) for i in layers}

    def predicate(path: str, leaf: Any) -> bool:
        if not path.endswith(suffixes):
            return False
        if wanted is None:
            return True
        parts = path.split("/")
        return "layers" in parts and int(parts[parts.index("layers") + 1]) in wanted

    return predicate


class TextSpecBackbone:
    """Spec generation on a BERT encoder for texts with named classes.

    Example (needs the real MiniLM weights, so it is shown, not run)::

      tb = TextSpecBackbone()                      # real all-MiniLM-L6-v2
      res = tb.user_spec(texts, labels, ("negative", "positive"), dock.a_key(),
                         SpecConfig.preset("quick"))
      res.spec                                     # a PaveSpec, ready for dock.search

    Args:
      encoder, tokenizer: a :class:`BertEncoder` and a tokenizer with fixed ``max_length``
        (None: load all-MiniLM-L6-v2 with ``max_length`` tokens from the installed asset).
      backbone_id: public name recorded in the signature.
      layers: encoder layers whose attention ``query``/``value`` kernels are adapted (None: all).
      head_seed: public seed of ``g`` (must be the same for every party of one dock).
      centered: subtract the frozen backbone's pooled features (see the module docstring).
      pooling: ``"mean"`` (masked mean of the last hidden states; all-MiniLM-L6-v2's sentence
        embedding) or ``"cls"`` (the first token's hidden state).
    """

    def __init__(self, encoder: BertEncoder | None = None, tokenizer: Any = None, *,
                 backbone_id: str = MINILM_ID, max_length: int = 48,
                 layers: Sequence[int] | None = None, head_seed: int = 0,
                 centered: bool = True, pooling: str = "mean"):
        if encoder is None:
            from pavejax.models import load_minilm

            encoder, tokenizer = load_minilm(max_length=max_length)
        if tokenizer is None:
            raise ValueError("pass the tokenizer that goes with the encoder")
        graphdef, state = nnx.split(encoder)
        params = nnx.to_pure_dict(state)
        self.tokenizer = tokenizer
        self.hidden = encoder.config.hidden_size
        self.head_seed = head_seed
        self.backbone = Backbone(backbone_id, params, backbone_hash(params))
        self.predicate = attention_predicate(layers)

        self.centered = bool(centered)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        pool = mean_pool if pooling == "mean" else (lambda hidden, mask: hidden[:, 0])

        def logits_fn(p, batch, head):
            ids, mask = batch["input_ids"], batch["attention_mask"]
            pooled = pool(nnx.merge(graphdef, p)(ids, mask), mask)
            if "base_pooled" in batch:
                pooled = pooled - batch["base_pooled"]
            return pooled @ head

        self.logits_fn = logits_fn
        self._pooled = jax.jit(lambda p, ids, mask: pool(nnx.merge(graphdef, p)(ids, mask),
                                                         mask))

    def encode(self, texts: Sequence[str], *, batch_size: int = 64) -> dict[str, np.ndarray]:
        """Token ids and attention mask (n, max_length) int32, and (centred) the frozen
        backbone's pooled features ``base_pooled`` (n, hidden) float32."""
        texts = list(texts)
        if not texts:
            raise ValueError("no texts given: a spec needs at least one example")
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be strings")
        tok = self.tokenizer(texts)
        out = {"input_ids": np.asarray(tok.input_ids, np.int32),
               "attention_mask": np.asarray(tok.attention_mask, np.int32)}
        if self.centered:
            out["base_pooled"] = self.pooled(out, batch_size=batch_size)
        return out

    def pooled(self, encoded: dict[str, np.ndarray], *, batch_size: int = 64) -> np.ndarray:
        """Frozen-backbone mean-pooled features (n, hidden) float32, in fixed-size batches."""
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        n, chunks = ids.shape[0], []
        for i in range(0, n, batch_size):
            pad = batch_size - min(batch_size, n - i)
            pi = np.pad(ids[i:i + batch_size], ((0, pad), (0, 0)))
            pm = np.pad(mask[i:i + batch_size], ((0, pad), (0, 0)))
            pm[pm.sum(axis=1) == 0, 0] = 1  # padding rows: one visible token, no NaN
            chunks.append(np.asarray(self._pooled(self.backbone.params, pi, pm))[:batch_size - pad])
        return np.concatenate(chunks).astype(np.float32)

    def head(self, classes: Sequence[str]) -> jax.Array:
        """The public mapping ``g`` for these class names: (hidden, k) float32."""
        return jnp.asarray(label_space_head(self.hidden, tuple(classes), self.head_seed))

    def model_spec(self, texts: Sequence[str], model_logits: np.ndarray,
                   classes: Sequence[str], a_key: jax.Array, config: SpecConfig = SpecConfig(),
                   *, noise_key: jax.Array | None = None, **info: Any) -> SpecResult:
        """Developer side: fit ``model_logits`` (n, len(classes)) of the model on ``texts``.

        ``noise_key``: as in :func:`pavejax.pave.spec.generate_spec` (None: fresh and secret).
        """
        logits = np.asarray(model_logits)
        if logits.shape != (len(texts), len(classes)):
            raise ValueError(f"model_logits must have shape ({len(texts)}, {len(classes)}) "
                             f"(texts x classes), got {logits.shape}")
        return model_spec(self.logits_fn, self.backbone, self.predicate, self.encode(texts),
                          logits, a_key, config, aux=self.head(classes),
                          info={"classes": list(classes), **info}, noise_key=noise_key)

    def calibrated_subspace(self, texts: Sequence[str], label_sets: Sequence[Sequence[str]],
                            k: int, *, seed: int = 0, microbatch: int = 16,
                            info: dict[str, Any] | None = None) -> Subspace:
        """A :func:`pavejax.pave.subspace.calibrated` subspace of this backbone's adapted
        kernels from PUBLIC ``texts`` (never market or private data: the subspace is
        published): the texts under the head ``g`` of every public label set of
        ``label_sets`` (e.g. ``[("negative", "positive"), ("business", "sport", ...)]``), with
        public random labels from ``seed`` (at ``B = 0`` the centred head predicts uniformly,
        so the labels carry no task information either way)."""
        if not label_sets:
            raise ValueError("give at least one public label set, e.g. [('negative', 'positive')]")
        enc = self.encode(texts)
        groups = [(enc, random_targets(len(texts), len(c), seed + i), self.head(c))
                  for i, c in enumerate(label_sets)]
        record = {"num_texts": len(texts), "label_sets": [list(c) for c in label_sets],
                  "label_seed": seed, "backbone": self.backbone.id, **(info or {})}
        return calibrated(self.logits_fn, self.backbone.params, self.predicate, groups[0][0],
                          groups[0][1], k, aux=groups[0][2], more=groups[1:],
                          microbatch=microbatch, info=record)

    def user_spec(self, texts: Sequence[str], labels: np.ndarray, classes: Sequence[str],
                  a_key: jax.Array, config: SpecConfig = SpecConfig(),
                  *, noise_key: jax.Array | None = None, **info: Any) -> SpecResult:
        """User side: fit few-shot ``labels`` (n,) indexing ``classes`` (``noise_key`` as
        for :meth:`model_spec`)."""
        return user_spec(self.logits_fn, self.backbone, self.predicate, self.encode(texts),
                         np.asarray(labels), len(classes), a_key, config,
                         aux=self.head(classes), info={"classes": list(classes), **info},
                         noise_key=noise_key)
