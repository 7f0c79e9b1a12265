"""Privacy ledger over `dp_accounting` events, with RDP and PLD accountants.

Event convention: a Gaussian step is ``GaussianDpEvent(s)`` with ``s = noise std / C``, where C is
the per-record L2 bound (the add/remove sensitivity), whatever the neighbouring relation. Under
replace-one the sensitivity is 2C, and dp-accounting 0.6 is inconsistent about it:

* ``PLDAccountant(REPLACE_ONE)`` doubles the sensitivity itself, so events go in unchanged;
* ``RdpAccountant`` ignores the relation for a Gaussian and analyses
  ``SampledWithoutReplacementDpEvent`` with ``s`` relative to the replace-one sensitivity, so every
  Gaussian multiplier is halved before it reaches RDP (otherwise ε is badly under-counted);
* ``RdpAccountant`` has no Poisson analysis under replace-one; that combination is refused.

All numbers here are host-side Python floats (float64); nothing in this module touches JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

import dp_accounting as dpa
from dp_accounting import dp_event

from pavejax.accounting._json import event_from_dict, event_to_dict

__all__ = ["BudgetExceededError", "Ledger", "LedgerEntry", "MIEntry", "Relation"]

_ACCOUNTANTS = ("pld", "rdp")
_FORMAT, _VERSION = "pavejax.ledger", 1


class BudgetExceededError(RuntimeError):
    """Raised by `Ledger.check_budget` when the spent ε exceeds the target."""


class Relation(str, enum.Enum):  # noqa: UP042 - plain str comparisons must keep working
    """Neighbouring relation: ``"add_remove"`` (sensitivity C) or ``"replace_one"`` (2C)."""

    ADD_REMOVE = "add_remove"
    REPLACE_ONE = "replace_one"

    @classmethod
    def parse(cls, value: Relation | str | dpa.NeighboringRelation) -> Relation:
        """Normalises a string, a `Relation` or a `dp_accounting.NeighboringRelation`."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dpa.NeighboringRelation):
            for rel in cls:
                if rel.neighboring_relation is value:
                    return rel
            raise ValueError(f"neighbouring relation {value.name} is not supported; use "
                             "'add_remove' or 'replace_one'")
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"unknown neighbouring relation {value!r}; use 'add_remove' or "
                         "'replace_one' (or a dp_accounting.NeighboringRelation)")

    @property
    def neighboring_relation(self) -> dpa.NeighboringRelation:
        """The matching `dp_accounting.NeighboringRelation`."""
        if self is Relation.ADD_REMOVE:
            return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        return dpa.NeighboringRelation.REPLACE_ONE


# ---------------------------------------------------------------- validation helpers


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_delta(delta: Any) -> float:
    delta = _check_real("delta", delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; typical values are below "
                         "1/dataset_size, e.g. 1e-5")
    return delta


def _check_epsilon(name: str, epsilon: Any) -> float:
    epsilon = _check_real(name, epsilon)
    if epsilon <= 0.0:
        raise ValueError(f"{name} must be > 0, got {epsilon!r}")
    return epsilon


def _check_count(name: str, count: Any) -> int:
    if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {count!r}")
    return int(count)


def _check_accountant(accountant: Any) -> str:
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; use 'pld' or 'rdp'")
    return accountant


# ---------------------------------------------------------------- event translation

_POISSON_REPLACE_RDP = (
    "the RDP accountant has no analysis of Poisson sampling under replace-one neighbouring "
    "(dp-accounting refuses it, and its Gaussian analysis ignores the doubled sensitivity 2C); "
    "use relation='add_remove', fixed-size sampling without replacement (sampling='fixed'), "
    "or accountant='pld'")
_FIXED_ADD_REMOVE = (
    "fixed-size sampling without replacement is analysed only under replace-one neighbouring "
    "(RDP); use relation='replace_one' or Poisson sampling (sampling='poisson')")
_FIXED_PLD = (
    "the PLD accountant has no analysis of fixed-size sampling without replacement; use "
    "accountant='rdp' with relation='replace_one', or Poisson sampling (sampling='poisson')")
_WITH_REPLACEMENT = (
    "sampling with replacement is supported by neither accountant; use Poisson sampling or "
    "fixed-size sampling without replacement")


def _halve_for_rdp(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrites multipliers relative to C into multipliers relative to 2C (replace-one RDP)."""
    if isinstance(event, dp_event.GaussianDpEvent):
        # float(): RDP's effective-multiplier reduction rejects int multipliers.
        return dp_event.GaussianDpEvent(float(event.noise_multiplier) / 2.0)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_halve_for_rdp(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([_halve_for_rdp(e) for e in event.events])
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        return dp_event.SampledWithoutReplacementDpEvent(
            event.source_dataset_size, event.sample_size, _halve_for_rdp(event.event))
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        raise ValueError(_POISSON_REPLACE_RDP)
    if isinstance(event, (dp_event.NoOpDpEvent, dp_event.NonPrivateDpEvent,
                          dp_event.RandomizedResponseDpEvent)):
        return event  # relation-free, or analysed per relation by RDP itself
    raise ValueError(
        f"{type(event).__name__} cannot be translated for the RDP accountant under replace-one "
        "neighbouring (its parameter convention there is ambiguous); use accountant='pld' or "
        "relation='add_remove'")


def _merge_gaussians_for_pld(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrites a composition of Gaussian queries into the one Gaussian it equals.

    Gaussian queries of multipliers s_i on the same data (adaptively chosen or not) are exactly
    as private as one Gaussian of multiplier (sum_i s_i^-2)^-1/2: both are mu-GDP with
    mu^2 = sum_i s_i^-2, and N(0, 1) vs N(mu, 1) is a tight dominating pair of each. PLD analyses
    a Poisson-sampled Gaussian but not a Poisson-sampled composition (DP-SAM's "same" mode)."""
    if isinstance(event, dp_event.ComposedDpEvent) and event.events and all(
            isinstance(e, dp_event.GaussianDpEvent) for e in event.events):
        if any(e.noise_multiplier == 0 for e in event.events):
            return dp_event.NonPrivateDpEvent()
        return dp_event.GaussianDpEvent(
            math.fsum(float(e.noise_multiplier) ** -2 for e in event.events) ** -0.5)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return dp_event.PoissonSampledDpEvent(event.sampling_probability,
                                              _merge_gaussians_for_pld(event.event))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_merge_gaussians_for_pld(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([_merge_gaussians_for_pld(e) for e in event.events])
    return event


def _contains(event: dp_event.DpEvent, kind: type) -> bool:
    if isinstance(event, kind):
        return True
    children = list(getattr(event, "events", None) or [])
    if isinstance(getattr(event, "event", None), dp_event.DpEvent):
        children.append(event.event)
    return any(_contains(child, kind) for child in children)


def _for_accountant(event: dp_event.DpEvent, relation: Relation,
                    accountant: str) -> dp_event.DpEvent:
    """The event that `accountant` must see for a pavejax ``event`` under ``relation``."""
    if _contains(event, dp_event.SampledWithReplacementDpEvent):
        raise ValueError(_WITH_REPLACEMENT)
    if _contains(event, dp_event.SampledWithoutReplacementDpEvent):
        if relation is Relation.ADD_REMOVE:
            raise ValueError(_FIXED_ADD_REMOVE)
        if accountant == "pld":
            raise ValueError(_FIXED_PLD)
    if accountant == "rdp" and relation is Relation.REPLACE_ONE:
        return _halve_for_rdp(event)
    if accountant == "pld":
        return _merge_gaussians_for_pld(event)
    return event


def _fresh_accountant(accountant: str, relation: Relation,
                      pld_discretization: float) -> dpa.PrivacyAccountant:
    if accountant == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=relation.neighboring_relation)
    return dpa.pld.PLDAccountant(relation.neighboring_relation,
                                 value_discretization_interval=pld_discretization)


def _compose(acc: dpa.PrivacyAccountant, event: dp_event.DpEvent, count: int) -> None:
    try:
        acc.compose(event, count)
    except dpa.UnsupportedEventError as err:
        raise ValueError(f"the accountant cannot analyse this event: {err}") from err


def _runs(events: Iterable[tuple[dp_event.DpEvent, int]]) -> list[tuple[dp_event.DpEvent, int]]:
    """Consecutive equal events merged into one ``(event, total count)``: the accountant then
    builds one privacy-loss distribution and self-composes it, instead of building one per
    recorded step (a T-step training records T equal events; PLD cost drops from T builds to
    one). The composition is the same; only the accountant's work changes."""
    out: list[tuple[dp_event.DpEvent, int]] = []
    for event, count in events:
        if out and out[-1][0] == event:
            out[-1] = (event, out[-1][1] + count)
        else:
            out.append((event, count))
    return out


def _unwrapped(event: dp_event.DpEvent, count: int) -> tuple[dp_event.DpEvent, int]:
    """``SelfComposed(e, k)`` counted ``count`` times is ``e`` counted ``k * count`` times (what
    every accountant does with it): one form for a run however it was written."""
    while isinstance(event, dp_event.SelfComposedDpEvent):
        event, count = event.event, event.count * count
    return event, count


_EPSILON_MEMO: collections.OrderedDict[tuple, float] = collections.OrderedDict()
_EPSILON_MEMO_SIZE = 4096


def _epsilon_of_runs(events: Iterable[tuple[dp_event.DpEvent, int]], delta: float,
                     relation: Relation, accountant: str, pld_discretization: float) -> float:
    """ε at ``delta`` of the adaptive composition of ``(event, count)`` pairs, as a fresh
    accountant computes it, memoised on the events' text (events are immutable). A PLD build
    takes seconds; a run is often analysed again, e.g. the ledger of a calibrated run after the
    calibration evaluated its noise multiplier, or one of several equal developers' ledgers."""
    runs = _runs(_unwrapped(e, c) for e, c in events)
    key = (tuple((repr(e), c) for e, c in runs), delta, relation.value, accountant,
           pld_discretization)
    if key in _EPSILON_MEMO:
        _EPSILON_MEMO.move_to_end(key)
        return _EPSILON_MEMO[key]
    acc = _fresh_accountant(accountant, relation, pld_discretization)
    for event, count in runs:
        _compose(acc, _for_accountant(event, relation, accountant), count)
    value = float(acc.get_epsilon(delta))
    _EPSILON_MEMO[key] = value
    if len(_EPSILON_MEMO) > _EPSILON_MEMO_SIZE:
        _EPSILON_MEMO.popitem(last=False)
    return value


def _ensure_supported(acc: dpa.PrivacyAccountant, event: dp_event.DpEvent) -> None:
    if not acc.supports(event):
        _compose(acc, event, 1)  # raises with dp-accounting's reason


# ---------------------------------------------------------------- the ledger


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """One recorded release: ``event`` happened ``count`` times; ``label`` names the artefact."""

    event: dp_event.DpEvent
    count: int = 1
    label: str = ""


@dataclasses.dataclass(frozen=True)
class MIEntry:
    """One PAC-Privacy charge: ``nats`` of mutual information, ``count`` times, for ``label``."""

    nats: float
    count: int = 1
    label: str = ""


class Ledger:
    """Append-only record of privacy events, composed on demand by RDP or PLD.

    Args:
      relation: neighbouring relation of every recorded event (``"add_remove"`` or
        ``"replace_one"``, or a `dp_accounting.NeighboringRelation`).
      accountant: default accountant for ε/δ queries, ``"pld"`` (tight) or ``"rdp"`` (fast).
      pld_discretization: PLD value discretisation interval (smaller is tighter and slower).

    Guarantee: ``epsilon(delta)`` is an upper bound on the (ε, δ)-DP of the adaptive composition
    of all recorded events under ``relation``, as computed by dp-accounting with the
    translation rules in the module docstring. An empty ledger has ε = 0.

    The ledger also holds PAC-Privacy charges in nats (`record_mi`, `mutual_information`), kept
    apart from the DP events: the two guarantees are of different kinds and are never combined.
    ``len(ledger)`` and ``entries`` count the DP events only; ``mi_entries`` lists the charges.

    Example:
        >>> from pavejax.accounting import gaussian_step_event, run_event
        >>> ledger = Ledger("add_remove", "rdp")
        >>> step = gaussian_step_event(1.0, q=256 / 50_000)
        >>> _ = ledger.record(run_event(step, 2_000), label="model")
        >>> round(ledger.epsilon(1e-5), 2)
        1.49
    """

    def __init__(self, relation: Relation | str | dpa.NeighboringRelation = "add_remove",
                 accountant: str = "pld", *, pld_discretization: float = 1e-4) -> None:
        self.relation = Relation.parse(relation)
        self.accountant = _check_accountant(accountant)
        self.pld_discretization = _check_epsilon("pld_discretization", pld_discretization)
        self._entries: list[LedgerEntry] = []
        self._mi_entries: list[MIEntry] = []

    def __repr__(self) -> str:
        return (f"Ledger(relation={self.relation.value!r}, accountant={self.accountant!r}, "
                f"entries={len(self._entries)})")

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return (self.relation, self.accountant, self.pld_discretization, self._entries,
                self._mi_entries) == (other.relation, other.accountant, other.pld_discretization,
                                      other._entries, other._mi_entries)

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """The recorded entries, oldest first."""
        return tuple(self._entries)

    @property
    def mi_entries(self) -> tuple[MIEntry, ...]:
        """The recorded mutual-information charges, oldest first."""
        return tuple(self._mi_entries)

    def record_mi(self, nats: float, count: int = 1, *, label: str = "",
                  coalesce: bool = False) -> MIEntry:
        """Appends a PAC-Privacy charge of ``nats`` (>= 0, finite) repeated ``count`` times
        (with ``coalesce``, extends the last entry when it has the same nats and label).

        Charges compose by the chain rule of mutual information: `mutual_information` is their
        sum. Raises ValueError for a negative or non-finite charge or a bad count.
        """
        if not isinstance(label, str):
            raise TypeError(f"label must be a string, got {type(label).__name__}")
        nats = _check_real("nats", nats)
        if nats < 0.0:
            raise ValueError(f"a mutual-information charge must be >= 0 nats, got {nats!r}")
        count = _check_count("count", count)
        if coalesce and self._mi_entries and self._mi_entries[-1].nats == nats \
                and self._mi_entries[-1].label == label:
            self._mi_entries[-1] = MIEntry(nats=nats, count=self._mi_entries[-1].count + count,
                                           label=label)
            return self._mi_entries[-1]
        entry = MIEntry(nats=nats, count=count, label=label)
        self._mi_entries.append(entry)
        return entry

    def mutual_information(self, label: str | None = None) -> float:
        """Total mutual information charged (nats), optionally only for one ``label``."""
        return math.fsum(e.nats * e.count for e in self._mi_entries
                         if label is None or e.label == label)

    def _translated(self, event: dp_event.DpEvent, accountant: str) -> dp_event.DpEvent:
        return _for_accountant(event, self.relation, accountant)

    def record(self, event: dp_event.DpEvent, count: int = 1, *, label: str = "",
               coalesce: bool = False) -> LedgerEntry:
        """Appends ``event`` (repeated ``count`` times) and returns the new entry.

        With ``coalesce``, an event equal to the last entry's (same label) extends that entry's
        count instead (the same composition, one entry: a run of K identical steps is stored
        as one entry of count K, as a checkpointed trainer records it chunk by chunk).

        Raises TypeError for a non-DpEvent or non-string label, and ValueError when ``count`` is
        not an integer >= 1 or the default accountant cannot analyse the event under this
        ledger's relation (the message says which accountant/relation/sampling to use instead).
        """
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting.DpEvent (e.g. from "
                            f"gaussian_step_event), got {type(event).__name__}")
        if not isinstance(label, str):
            raise TypeError(f"label must be a string, got {type(label).__name__}")
        count = _check_count("count", count)
        if coalesce and self._entries and self._entries[-1].event == event \
                and self._entries[-1].label == label:
            last = self._entries[-1]
            self._entries[-1] = LedgerEntry(event=event, count=last.count + count, label=label)
            return self._entries[-1]
        probe = _fresh_accountant(self.accountant, self.relation, self.pld_discretization)
        translated = self._translated(event, self.accountant)
        _ensure_supported(probe, translated)
        entry = LedgerEntry(event=event, count=count, label=label)
        self._entries.append(entry)
        return entry

    def _accountant_for(self, accountant: str | None,
                        entries: list[LedgerEntry]) -> dpa.PrivacyAccountant:
        name = self.accountant if accountant is None else _check_accountant(accountant)
        acc = _fresh_accountant(name, self.relation, self.pld_discretization)
        for event, count in _runs((self._translated(e.event, name), e.count) for e in entries):
            _compose(acc, event, count)
        return acc

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """ε spent at ``delta`` in (0, 1); ``accountant`` overrides the default. inf if any
        non-private event was recorded."""
        delta = _check_delta(delta)
        return self._epsilon(delta, accountant, self._entries)

    def _epsilon(self, delta: float, accountant: str | None,
                 entries: list[LedgerEntry]) -> float:
        name = self.accountant if accountant is None else _check_accountant(accountant)
        return _epsilon_of_runs(((e.event, e.count) for e in entries), delta, self.relation,
                                name, self.pld_discretization)

    def delta(self, epsilon: float, accountant: str | None = None) -> float:
        """δ spent at ``epsilon`` > 0; ``accountant`` overrides the default."""
        epsilon = _check_epsilon("epsilon", epsilon)
        return float(self._accountant_for(accountant, self._entries).get_delta(epsilon))

    def epsilon_by_label(self, delta: float, accountant: str | None = None) -> dict[str, float]:
        """ε at ``delta`` of each label's entries composed on their own (who spent what)."""
        delta = _check_delta(delta)
        labels = dict.fromkeys(e.label for e in self._entries)
        return {lab: self._epsilon(delta, accountant, [e for e in self._entries if e.label == lab])
                for lab in labels}

    def summary(self, delta: float) -> dict[str, Any]:
        """ε at ``delta`` by both accountants (None, with the reason, where one cannot analyse
        the entries), plus relation, default accountant and number of entries."""
        delta = _check_delta(delta)
        epsilons: dict[str, float | None] = {}
        unsupported: dict[str, str] = {}
        for name in _ACCOUNTANTS:
            try:
                epsilons[name] = self.epsilon(delta, name)
            except ValueError as err:
                epsilons[name], unsupported[name] = None, str(err)
        out = {"epsilon": epsilons, "delta": delta, "relation": self.relation.value,
               "accountant": self.accountant, "num_entries": len(self._entries)}
        if unsupported:
            out["unsupported"] = unsupported
        return out

    def check_budget(self, epsilon: float, delta: float, *,
                     pending: dp_event.DpEvent | None = None, pending_count: int = 1,
                     accountant: str | None = None) -> float:
        """Returns the ε at ``delta`` (including an optional ``pending`` event not yet recorded)
        and raises BudgetExceededError if it exceeds the budget ``epsilon``."""
        epsilon = _check_epsilon("epsilon", epsilon)
        trial = self.compose(Ledger(self.relation, self.accountant,
                                    pld_discretization=self.pld_discretization))
        if pending is not None:
            trial.record(pending, pending_count, label="pending")
        spent = trial.epsilon(delta, accountant)
        if spent > epsilon:
            what = "this release would exceed it" if pending is not None else "already spent"
            raise BudgetExceededError(f"budget {what}: ε={spent:.6g} > target {epsilon:g} "
                                      f"at δ={delta:g}; stop releasing or raise the target")
        return spent

    def compose(self, other: Ledger) -> Ledger:
        """A new ledger holding this ledger's entries followed by ``other``'s (same relation)."""
        if not isinstance(other, Ledger):
            raise TypeError(f"can only compose with another Ledger, got {type(other).__name__}")
        if other.relation is not self.relation:
            raise ValueError(f"cannot merge ledgers with different neighbouring relations "
                             f"({self.relation.value} vs {other.relation.value}); account them "
                             "separately or re-record the events under one relation")
        merged = Ledger(self.relation, self.accountant, pld_discretization=self.pld_discretization)
        merged._entries = [*self._entries, *other._entries]
        merged._mi_entries = [*self._mi_entries, *other._mi_entries]
        return merged

    merge = compose

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible dict (format ``pavejax.ledger`` v1) for embedding in metadata.

        Mutual-information charges appear under ``"mi_entries"`` only when there are some, so a
        DP-only ledger serialises exactly as before."""
        out = {"format": _FORMAT, "version": _VERSION, "relation": self.relation.value,
               "accountant": self.accountant, "pld_discretization": self.pld_discretization,
               "entries": [{"label": e.label, "count": e.count, "event": event_to_dict(e.event)}
                           for e in self._entries]}
        if self._mi_entries:
            out["mi_entries"] = [{"label": e.label, "count": e.count, "nats": e.nats}
                                 for e in self._mi_entries]
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Ledger:
        """Rebuilds a ledger from `to_dict` output; refuses other formats and unknown events."""
        if not isinstance(obj, dict) or obj.get("format") != _FORMAT:
            raise ValueError(f"not a pavejax ledger record (expected format {_FORMAT!r})")
        if obj.get("version") != _VERSION:
            raise ValueError(f"unsupported ledger version {obj.get('version')!r}; this version "
                             f"of pavejax reads version {_VERSION}")
        try:
            ledger = cls(obj["relation"], obj["accountant"],
                         pld_discretization=obj["pld_discretization"])
            for item in obj["entries"]:
                ledger._entries.append(LedgerEntry(event=event_from_dict(item["event"]),
                                                   count=_check_count("count", item["count"]),
                                                   label=str(item["label"])))
            for item in obj.get("mi_entries", []):
                ledger.record_mi(item["nats"], item["count"], label=str(item["label"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed ledger record (missing or wrong field {err})") from err
        return ledger

    def to_json(self) -> str:
        """Strict JSON text; `Ledger.from_json` rebuilds an equal ledger (floats exact)."""
        return json.dumps(self.to_dict(), allow_nan=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Ledger:
        """Parses `to_json` output (no pickle; only whitelisted dp_accounting events)."""
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"ledger JSON could not be parsed: {err}") from err
        return cls.from_dict(obj)
