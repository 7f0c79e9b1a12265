"""What may leave the process: the one check shared by every release and submit path.

:func:`pavejax.release.save_release`, :func:`pavejax.release.save_spec` and
:meth:`pavejax.pave.dock.Dock.submit` all call :func:`check_tensor_names` and
:func:`check_record`, so a thing refused by one is refused by all.

Refused:

* tensors or metadata entries named like a secret: ``A`` (case-sensitive), ``lora_a``,
  ``a_key``, PRNG keys, the PAC secret index, mechanism RNG state (matched per ``/``- or
  ``.``-separated component; plain ``key`` is BERT's attention projection and stays allowed);
* PRNG key arrays among the tensors (refused by dtype, whatever their name);
* DP figures under add/remove neighbouring: every release states its dataset sizes (sizes,
  sampling rates and example counts are public and not protected), and add/remove neighbours
  differ exactly in the size, so only replace-one figures hold against a reader of the release;
* anything marked ``"replayable": True``: a DP release made from a caller-supplied noise key
  (``generate_spec(noise_key=...)``). Whoever holds that key regenerates the noise and
  subtracts it, so such a release has no privacy at all.

Sharp edge: a secret stored under an innocent name passes the name check; the rule for callers
is "pass only what you mean to publish", and the tests scan the bytes of real releases.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["REPLAYABLE", "check_record", "check_replace_one", "check_tensor_names",
           "is_secret_name"]

REPLAYABLE = "replayable"
_SECRET_EXACT = {"A"}
_SECRET_NAMES = {"lora_a", "a_key", "prng_key", "rng_key", "key_data", "secret", "secret_key",
                 "secret_index", "mechanism_rng", "rng_state", "coin_state", "sampling_key",
                 "noise_key_data"}
_REPLAYABLE_HELP = (
    "it was made with a caller-supplied noise key (replayable): whoever knows that key can "
    "regenerate the noise and subtract it, so it is not private. Make it again without "
    "noise_key (a fresh key is then drawn from the operating system and never recorded)")


_SIZES_PUBLIC = (
    "releases state their dataset sizes (sizes, sampling rates and example counts are public "
    "and not protected), and add/remove neighbours differ exactly in that size, so no "
    "add/remove figure holds against a reader of the release. Account the run under "
    "replace-one neighbouring (Ledger('replace_one', accountant='pld'); for training, "
    "relation='replace_one', accountant='pld')")


def check_replace_one(ledger: Mapping[str, Any] | None, guarantee: Mapping[str, Any] | None,
                      where: str, error: type[Exception] = ValueError) -> None:
    """Raises ``error`` if a ledger dict with DP entries, or a guarantee, is add/remove.

    A ledger holding only mutual-information charges is relation-free and passes.
    """
    if ledger is not None and ledger.get("entries") and ledger.get("relation") == "add_remove":
        raise error(f"{where} accounts add/remove neighbouring: {_SIZES_PUBLIC}")
    guarantee = guarantee or {}
    if guarantee.get("relation") == "add_remove" or "epsilon_add_remove" in guarantee:
        raise error(f"{where} states an add/remove figure: {_SIZES_PUBLIC}")


def is_secret_name(name: str) -> bool:
    """True if a component of ``name`` is a name only a secret goes by."""
    return any(p in _SECRET_EXACT or p.lower() in _SECRET_NAMES for p in re.split(r"[/.]", name))


def check_record(obj: Any, where: str, error: type[Exception] = ValueError) -> None:
    """Raises ``error`` if the JSON-like ``obj`` names a secret or is marked replayable."""
    if isinstance(obj, Mapping):
        if obj.get(REPLAYABLE) is True:
            raise error(f"{where} cannot be released or submitted: {_REPLAYABLE_HELP}")
        for k, v in obj.items():
            if is_secret_name(str(k)):
                raise error(
                    f"{where} has an entry named {str(k)!r}: A, PRNG keys, the PAC secret index "
                    f"and mechanism RNG state never enter a release. Drop it; to identify A, "
                    f"release the a_hash instead (pavejax.lora.a_hash(A)).")
            check_record(v, f"{where}[{k!r}]", error)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            check_record(v, f"{where}[{i}]", error)


def check_tensor_names(tree: Any, where: str, error: type[Exception] = ValueError) -> None:
    """Raises ``error`` if a leaf of ``tree`` sits under a secret's name or is a PRNG key."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = jax.tree_util.keystr(keypath)
        for k in keypath:
            name = getattr(k, "key", getattr(k, "name", None))
            if isinstance(name, str) and is_secret_name(name):
                raise error(
                    f"{where}{path} is named like a secret ({name!r}): A and keys never enter "
                    f"a release; release the a_hash instead (pavejax.lora.a_hash(A)).")
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise error(f"{where}{path} is a PRNG key array: keys never enter a release "
                        f"(they regenerate A and the noise); drop it")
