"""Fixed-shape tokenization over a Hugging Face ``tokenizer.json`` (no torch, no network).

``tokenizer.json`` files often ship with their own truncation/padding switched on (the MiniLM one
pads every text to 128). This wrapper discards those settings and imposes one ``max_length`` so
every batch has the static shape (N, max_length) that ``jax.jit`` wants.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import tokenizers

__all__ = ["TokenBatch", "Tokenizer"]


class TokenBatch(NamedTuple):
    """Token arrays of shape (N, max_length), all numpy int32; mask is 1 on real tokens."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray


class Tokenizer:
    """Deterministic WordPiece tokenizer returning fixed-shape int32 arrays.

    Texts longer than ``max_length`` tokens (special tokens included) are truncated, keeping
    ``[CLS] ... [SEP]``; shorter ones are padded on the right with ``pad_id`` and mask 0.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_length: int = 128, pad_id: int = 0):
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise ValueError(
                f"max_length must be an int >= 2 (room for [CLS] and [SEP]), got {max_length!r}"
            )
        pad_token = tokenizer.id_to_token(pad_id)
        if pad_token is None:
            raise ValueError(f"pad_id {pad_id} is not in the tokenizer's vocabulary")
        # Work on a private copy so the caller's tokenizer keeps its own settings.
        tok = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        tok.no_truncation()
        tok.no_padding()
        tok.enable_truncation(max_length)
        tok.enable_padding(length=max_length, pad_id=pad_id, pad_token=pad_token, pad_type_id=0)
        self._tok = tok
        self._source = tokenizer
        self.max_length = max_length
        self.pad_id = pad_id

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], max_length: int = 128,
                  pad_id: int = 0) -> Tokenizer:
        """Load a ``tokenizer.json`` file."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {os.fspath(path)}")
        return cls(tokenizers.Tokenizer.from_file(os.fspath(path)), max_length, pad_id)

    def with_max_length(self, max_length: int) -> Tokenizer:
        """The same vocabulary with another fixed length."""
        return Tokenizer(self._source, max_length, self.pad_id)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (special tokens included)."""
        return self._tok.get_vocab_size()

    def __call__(self, texts: str | Sequence[str]) -> TokenBatch:
        """Tokenize ``texts`` (a string or a sequence of strings) to (N, max_length) int32 arrays.

        A single string gives N = 1.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a str or a sequence of str")
        encodings = self._tok.encode_batch(list(texts))
        shape = (len(encodings), self.max_length)

        def stack(field: str) -> np.ndarray:
            rows = [getattr(e, field) for e in encodings]
            return np.asarray(rows, dtype=np.int32).reshape(shape)

        return TokenBatch(stack("ids"), stack("attention_mask"), stack("type_ids"))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, max_length={self.max_length})"
