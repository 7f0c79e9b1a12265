"""Byte-level BPE tokenizer of Llama-family causal LMs, from GGUF metadata or ``tokenizer.json``.

The vocabulary and merges stored in a GGUF file (``tokenizer.ggml.tokens`` / ``merges``) become a
``tokenizers`` BPE model; the pre-tokenizer is chosen by ``tokenizer.ggml.pre``. Control tokens
(token type 3, e.g. ``<|im_start|>``) are registered as special tokens so chat markers stay whole
and ``decode`` can skip them; user-defined tokens (type 4) stay whole but are decoded.
:func:`gguf_metadata` reads a GGUF file's metadata (the loaders use it too).

Conventions for scoring prompts: nothing is added to a text unless asked (SmolLM2 adds no BOS),
and a word keeps its leading space, so a prompt ``"... It was"`` is followed by the candidates
``" great"`` / ``" terrible"`` (one token each for SmolLM2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

__all__ = ["LlamaTokenizer", "gguf_metadata"]

# GGUF token types (llama.cpp ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4

# ``tokenizer.ggml.pre`` -> does the pre-tokenizer split digits one by one before the byte-level
# regex. Other pre-tokenizers use regexes of their own that are not reproduced here.
_PRE_TOKENIZERS = {"smollm": True, "gpt-2": False, "default": False}


def _pre_tokenizer(split_digits: bool, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if not split_digits:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def _token_id(tok: tokenizers.Tokenizer, token: Any, what: str) -> int | None:
    """A special token given as a string, an ``{"content": ...}`` record or None -> its id."""
    if isinstance(token, Mapping):
        token = token.get("content")
    if token is None:
        return None
    found = tok.token_to_id(token)
    if found is None:
        raise ValueError(f"{what} token {token!r} is not in the vocabulary")
    return found


def _open_gguf(path: str | os.PathLike[str]):
    import gguf  # the ``text`` extra

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {os.fspath(path)}")
    try:
        return gguf.GGUFReader(path)
    except ValueError as err:
        raise ValueError(f"{os.fspath(path)} is not a readable GGUF file: {err}") from None


def gguf_metadata(source: Any) -> dict[str, Any]:
    """All metadata of a GGUF file (a path or an open ``gguf.GGUFReader``) as plain Python values:
    key -> int, float, bool, str or list (e.g. ``"llama.block_count"``, the token list)."""
    reader = source if hasattr(source, "fields") else _open_gguf(source)
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


class LlamaTokenizer:
    """Byte-level BPE tokenizer with the special ids and chat template of a causal LM.

    Build it with :meth:`from_gguf` (a GGUF file), :meth:`from_gguf_metadata` (its metadata as a
    dict) or :meth:`from_file` (a Hugging Face ``tokenizer.json``).

    Attributes:
      bos_id, eos_id, pad_id: special ids (``bos_id`` may be None); ``pad_id`` falls back to
        ``eos_id`` when the source names no padding token.
      add_bos: whether ``encode(..., add_special_tokens=True)`` prepends ``bos_id``.
      chat_template: the Jinja chat template string, or None.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_id: int, pad_id: int | None = None,
                 bos_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None):
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside the vocabulary (size {size})")
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True needs a bos_id")
        self._tok = tokenizer
        self.eos_id = int(eos_id)
        self.pad_id = int(eos_id if pad_id is None else pad_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> LlamaTokenizer:
        """The tokenizer stored in a GGUF file's metadata (reads the metadata only)."""
        return cls.from_gguf_metadata(gguf_metadata(path))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> LlamaTokenizer:
        """Build from GGUF metadata (key -> value, as :func:`~pavejax.models.gguf_metadata`).

        Needs ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE), ``tokens``, ``merges`` and
        ``eos_token_id``; reads ``token_type``, ``pre``, ``add_space_prefix``, ``bos_token_id``,
        ``padding_token_id``, ``add_bos_token`` and ``tokenizer.chat_template`` when present.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
                             "is supported; load the model's tokenizer.json with "
                             "LlamaTokenizer.from_file instead")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (known: "
                             f"{sorted(_PRE_TOKENIZERS)}); load the model's tokenizer.json "
                             "with LlamaTokenizer.from_file instead")
        for key in ("tokens", "merges", "eos_token_id"):
            if f"tokenizer.ggml.{key}" not in metadata:
                raise ValueError(f"the GGUF metadata lacks tokenizer.ggml.{key}")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        if len(set(tokens)) != len(tokens):
            raise ValueError("tokenizer.ggml.tokens holds duplicate tokens; ids would be "
                             "ambiguous")
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
        try:
            bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             fuse_unk=False, byte_fallback=False)
        except Exception as err:  # tokenizers raises a bare Exception
            raise ValueError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {err}") \
                from None
        tok = tokenizers.Tokenizer(bpe)
        tok.pre_tokenizer = _pre_tokenizer(
            _PRE_TOKENIZERS[pre], bool(metadata.get("tokenizer.ggml.add_space_prefix", False)))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
        tok.add_tokens([AddedToken(t, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(tok, eos_id=metadata["tokenizer.ggml.eos_token_id"],
                   pad_id=metadata.get("tokenizer.ggml.padding_token_id"), bos_id=bos,
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LlamaTokenizer:
        """Load a Hugging Face ``tokenizer.json``.

        Special tokens, ``add_bos_token`` and the chat template come from the
        ``tokenizer_config.json`` next to it (Hugging Face's layout); without one, the EOS token
        must be ``<|endoftext|>``, ``</s>`` or ``<|end_of_text|>``.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        tok = tokenizers.Tokenizer.from_file(os.fspath(path))
        tok.no_padding()
        tok.no_truncation()
        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos = _token_id(tok, config.get("eos_token"), "eos")
        if eos is None:
            eos = next((i for t in ("<|endoftext|>", "</s>", "<|end_of_text|>")
                        if (i := tok.token_to_id(t)) is not None), None)
        if eos is None:
            raise ValueError(f"cannot tell the EOS token of {path}: add a tokenizer_config.json "
                             "with an eos_token next to it")
        return cls(tok, eos_id=eos, pad_id=_token_id(tok, config.get("pad_token"), "pad"),
                   bos_id=_token_id(tok, config.get("bos_token"), "bos"),
                   add_bos=bool(config.get("add_bos_token", False)),
                   chat_template=config.get("chat_template"))

    # --- encoding ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (byte-level spelling, e.g. ``"Ġgreat"``), or None."""
        return self._tok.token_to_id(token)

    def _prefix(self, add_special_tokens: bool) -> list[int]:
        return [self.bos_id] if add_special_tokens and self.add_bos else []

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (``<|im_start|>``) become their
        ids; ``add_special_tokens=True`` prepends BOS when the model asks for it (``add_bos``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._prefix(add_special_tokens) + self._tok.encode(text).ids

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """Text of a sequence of ids (1-D); control tokens are dropped unless
        ``skip_special_tokens=False``."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch(self, texts: Sequence[str], *, max_length: int, padding_side: str = "left",
              add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a batch to fixed-shape arrays.

        Texts longer than ``max_length`` tokens keep their LAST ``max_length`` tokens (the end
        of a prompt is what the next token depends on). Shorter ones are padded with ``pad_id``
        on ``padding_side`` ("left" for generation, "right" for scoring).

        Returns:
          ``(input_ids, attention_mask)``, both int32 numpy arrays of shape (N, max_length); the
          mask is 1 on real tokens.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a sequence of str (wrap a single text in a list)")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        ids = np.full((len(texts), max_length), self.pad_id, np.int32)
        mask = np.zeros((len(texts), max_length), np.int32)
        prefix = self._prefix(add_special_tokens)
        for row, enc in enumerate(self._tok.encode_batch(list(texts))):
            seq = (prefix + enc.ids)[-max_length:]
            span = slice(max_length - len(seq), None) if padding_side == "left" else \
                slice(0, len(seq))
            ids[row, span] = seq
            mask[row, span] = 1
        return ids, mask

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": "user", "content": "..."}, ...]``) with the model's
        chat template, as Hugging Face does (sandboxed Jinja, trimmed blocks); with
        ``add_generation_prompt`` the text ends where the assistant's reply begins. Encode the
        result with :meth:`encode` (the markers are special tokens)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in its source)")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as err:  # pragma: no cover - jinja2 ships with the test tools
            raise ImportError("apply_chat_template needs jinja2 (`pip install jinja2`)") from err

        def raise_exception(message: str):
            raise ValueError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        tokens = {f"{name}_token": None if i is None else self._tok.id_to_token(i)
                  for name, i in (("bos", self.bos_id), ("eos", self.eos_id),
                                  ("pad", self.pad_id))}
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **tokens)
