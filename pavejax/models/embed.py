"""Frozen sentence features (all-MiniLM-L6-v2 or a BERT folder) for heads on precomputed
embeddings."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from pavejax.models.bert import mean_pool
from pavejax.models.loading import load_bert, load_minilm

__all__ = ["embed_texts"]

_EMBEDDINGS: dict[tuple[str | None, int, str], np.ndarray] = {}


@functools.cache
def _encoder(folder: str | None, max_length: int, pooling: str = "mean"
             ) -> tuple[nnx.GraphDef, nnx.State, Any, Callable]:
    if pooling not in ("mean", "cls"):
        raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
    if folder is None:
        encoder, tokenizer = load_minilm(max_length=max_length)
    else:
        encoder, tokenizer = load_bert(folder, max_length=max_length)
    graphdef, state = nnx.split(encoder)

    @jax.jit
    def pooled(state: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
        hidden = nnx.merge(graphdef, state)(ids, mask)
        return mean_pool(hidden, mask) if pooling == "mean" else hidden[:, 0]

    return graphdef, state, tokenizer, pooled


def embed_texts(texts: Sequence[str], *, max_length: int = 48, batch_size: int = 64,
                progress: bool = False, backbone: str | None = None,
                pooling: str = "mean") -> np.ndarray:
    """Frozen pooled embeddings (n, hidden) float32 (not L2-normalised) of
    all-MiniLM-L6-v2 (``backbone=None``, hidden 384) or of the BERT-family Hugging Face folder
    ``backbone`` (:func:`~pavejax.models.load_bert`); ``pooling="cls"`` takes the first
    token's hidden state instead of the masked mean.

    Each distinct text is encoded once per process (cache keyed by ``(backbone, pooling,
    max_length, text)``), in fixed ``batch_size`` batches so one compilation serves all. Equal to
    ``TextClassifier(encoder, k, pooling="mean").features`` on the same tokens. MiniLM needs
    the ``minilm`` asset (``pavejax assets``).
    """
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of str")
    folder = None if backbone is None else str(backbone)
    key = folder if pooling == "mean" else f"{folder}#{pooling}"
    missing = list(dict.fromkeys(t for t in texts if (key, max_length, t) not in _EMBEDDINGS))
    if missing:
        _, state, tokenizer, pooled = _encoder(folder, max_length, pooling)
        batches = range(0, len(missing), batch_size)
        for i in tqdm(batches, desc="embedding texts", disable=not progress):
            chunk = missing[i:i + batch_size]
            tokens = tokenizer(chunk + [""] * (batch_size - len(chunk)))
            emb = np.asarray(pooled(state, jnp.asarray(tokens.input_ids),
                                    jnp.asarray(tokens.attention_mask)))
            _EMBEDDINGS.update({(key, max_length, t): emb[j].copy()
                                for j, t in enumerate(chunk)})
    if not texts:
        return np.zeros((0, 384 if folder is None else _hidden(folder)), np.float32)
    return np.stack([_EMBEDDINGS[(key, max_length, t)] for t in texts])


def _hidden(folder: str) -> int:
    from pavejax.models.bert import BertConfig

    return BertConfig.from_json(f"{folder}/config.json").hidden_size
