"""Exact, pickle-free JSON serialisation of `dp_accounting` events.

An event becomes ``{"__class__": "<ClassName>", <field>: <value>, ...}``, nested events recurse.
Only the dp_accounting event classes listed in ``EVENT_CLASSES`` can be rebuilt, so decoding never
constructs arbitrary objects. Python's JSON writer prints floats with ``repr``, which round-trips
every finite float64 exactly; non-finite floats and tuples get small tagged objects so that the
output stays strict JSON and the decoded event compares equal to the original.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attr
import numpy as np
from dp_accounting import dp_event

__all__ = ["EVENT_CLASSES", "event_from_dict", "event_from_json", "event_to_dict", "event_to_json"]

EVENT_CLASSES: dict[str, type[dp_event.DpEvent]] = {
    cls.__name__: cls
    for cls in (
        dp_event.NoOpDpEvent,
        dp_event.NonPrivateDpEvent,
        dp_event.UnsupportedDpEvent,
        dp_event.GaussianDpEvent,
        dp_event.LaplaceDpEvent,
        dp_event.DiscreteLaplaceDpEvent,
        dp_event.RandomizedResponseDpEvent,
        dp_event.SelfComposedDpEvent,
        dp_event.ComposedDpEvent,
        dp_event.PoissonSampledDpEvent,
        dp_event.SampledWithReplacementDpEvent,
        dp_event.SampledWithoutReplacementDpEvent,
        dp_event.SingleEpochTreeAggregationDpEvent,
        dp_event.RepeatAndSelectDpEvent,
        dp_event.MixtureOfGaussiansDpEvent,
        dp_event.ZCDpEvent,
        dp_event.TruncatedSubsampledGaussianDpEvent,
    )
}

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode(value: Any) -> Any:
    if isinstance(value, dp_event.DpEvent):
        name = type(value).__name__
        if EVENT_CLASSES.get(name) is not type(value):
            raise TypeError(
                f"cannot serialise event class {type(value).__qualname__}: only the dp_accounting "
                f"event classes {sorted(EVENT_CLASSES)} are supported; describe the mechanism "
                "with one of them"
            )
        fields = attr.asdict(value, recurse=False)
        return {"__class__": name, **{k: _encode(v) for k, v in fields.items()}}
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    raise TypeError(
        f"cannot serialise a field value of type {type(value).__name__}: event fields must be "
        "numbers, strings, lists, tuples or nested events (convert arrays with .tolist())"
    )


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if set(obj) == {"__tuple__"} and isinstance(obj["__tuple__"], list):
        return tuple(_decode(v) for v in obj["__tuple__"])
    if set(obj) == {"__float__"}:
        if obj["__float__"] not in _NON_FINITE:
            raise ValueError(f"unknown non-finite float tag {obj['__float__']!r}; "
                             f"expected one of {sorted(_NON_FINITE)}")
        return _NON_FINITE[obj["__float__"]]
    if "__class__" not in obj:
        raise ValueError(f"cannot decode JSON object with keys {sorted(obj)}: an event object "
                         "needs a '__class__' entry")
    name = obj["__class__"]
    cls = EVENT_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"refusing to build unknown event class {name!r}: only "
                         f"{sorted(EVENT_CLASSES)} may be rebuilt from JSON")
    kwargs = {k: v for k, v in obj.items() if k != "__class__"}
    allowed = {f.name for f in attr.fields(cls)}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ValueError(f"{name} has no field(s) {sorted(unknown)}; its fields are "
                         f"{sorted(allowed)}")
    return cls(**{k: _decode(v) for k, v in kwargs.items()})


def event_to_dict(event: dp_event.DpEvent) -> dict[str, Any]:
    """Encodes ``event`` as a JSON-compatible dict (for embedding in larger JSON records)."""
    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"expected a dp_accounting.DpEvent, got {type(event).__name__}")
    return _encode(event)


def event_from_dict(obj: dict[str, Any]) -> dp_event.DpEvent:
    """Rebuilds an event from ``event_to_dict`` output; refuses classes outside the whitelist."""
    event = _decode(obj)
    if not isinstance(event, dp_event.DpEvent):
        raise ValueError(f"decoded a {type(event).__name__}, not an event: the JSON must be an "
                         "object with a '__class__' entry")
    return event


def event_to_json(event: dp_event.DpEvent) -> str:
    """Serialises a DpEvent to strict JSON text; ``event_from_json`` returns an equal event.

    Example:
        >>> import dp_accounting as dpa
        >>> e = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5), 10)
        >>> event_from_json(event_to_json(e)) == e
        True
    """
    return json.dumps(event_to_dict(event), allow_nan=False, sort_keys=True)


def event_from_json(text: str | bytes | dict[str, Any]) -> dp_event.DpEvent:
    """Parses JSON text (or an already-parsed dict) written by ``event_to_json``.

    Raises ValueError for malformed input or for any class name that is not a whitelisted
    dp_accounting event; no other object is ever constructed.
    """
    if isinstance(text, dict):
        return event_from_dict(text)
    if not isinstance(text, (str, bytes)):
        raise TypeError(f"expected JSON text (str or bytes), got {type(text).__name__}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON: {err}") from err
    return event_from_dict(obj)
