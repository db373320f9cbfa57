"""The base of the typed events: a frozen dataclass per Avro record, with the dict boundary the codec speaks.

Faust's ``Record`` idiom (a class per message, its wire facts declared beside its fields) in plain stdlib
dataclasses: fields in the schema's order (keyword-only, so a field with a default may precede one without),
defaults equal to the schema's. :meth:`Record.from_dict` takes a decoded record (a field the schema gives a
default may be absent; ``schema_version`` is the codec's and is dropped), :meth:`Record.to_dict` gives the
record the codec encodes. Arrays of numbers are kept as given (lists, or numpy arrays from a bulk reader):
never copied per item.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

from rollbus.events.identity import Identity

CODEC_FIELDS = ("schema_version",)  # written by the codec, not by the event's author


class BadRecord(ValueError):
    """A record that is not one of the event's: a field missing, unknown, or of a nested record's shape."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A nested Avro record (a turn's timings, a reward's test result) or, through :class:`EventRecord`, an
    event."""

    @classmethod
    def from_dict(cls, record: Mapping[str, Any] | Self) -> Self:
        """``record`` as this class; :class:`BadRecord` names what does not fit."""
        if isinstance(record, cls):
            return record
        if not isinstance(record, Mapping):
            raise BadRecord(f"{cls.__name__}: expected a record, got {type(record).__name__}")
        names = _field_names(cls)
        unknown = sorted(set(record) - set(names) - set(CODEC_FIELDS))
        if unknown:
            raise BadRecord(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
        nested = _nested(cls)
        values = {}
        for name in names:
            if name not in record:
                continue
            value = record[name]
            inner = nested.get(name)
            if inner is not None and value is not None:
                record_class, many = inner
                value = [record_class.from_dict(v) for v in value] if many else record_class.from_dict(value)
            values[name] = value
        try:
            return cls(**values)
        except TypeError as exc:  # a field without a default is missing
            raise BadRecord(f"{cls.__name__}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The record the codec encodes: every field, nested records as dicts (arrays are not copied)."""
        return {name: _plain(getattr(self, name)) for name in _field_names(type(self))}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventRecord(Record):
    """An event: a record with its place on the bus declared beside its fields."""

    event_type: ClassVar[str]  # the schema's file name (schemas/<event_type>.avsc); its index is its type id
    topic: ClassVar[str]  # base topic name (a namespace prefixes it)
    key_field: ClassVar[str | None]  # the field used as the Kafka key; None: a constant or no key
    identity: ClassVar[Identity]  # what makes two events one fact (rollbus.events.identity)

    def identity_key(self) -> tuple[Any, ...]:
        """The values of :attr:`identity`'s key: equal keys, one fact."""
        return tuple(getattr(self, name) for name in self.identity.key)

    @classmethod
    def key_of(cls, record: Mapping[str, Any], *, within: tuple[str, ...] = ()) -> tuple[Any, ...]:
        """The identity key of ``record`` (an event's dict, for readers still on dicts), a field it lacks read
        as its schema default; ``within`` leaves out what the reader already groups by (``rollout_id``)."""
        defaults = _defaults(cls)
        return tuple(record[n] if n in record else defaults[n] for n in cls.identity.key if n not in within)


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list | tuple) and value and isinstance(value[0], Record):
        return [item.to_dict() for item in value]
    if isinstance(value, tuple):  # a default of () for an Avro array
        return list(value)
    return value


_FIELD_NAMES: dict[type[Record], tuple[str, ...]] = {}  # each class's, read once
_DEFAULTS: dict[type[Record], dict[str, Any]] = {}
_NESTED: dict[type[Record], dict[str, tuple[type[Record], bool]]] = {}


def _field_names(cls: type[Record]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _defaults(cls: type[Record]) -> dict[str, Any]:
    """The fields with a plain default (not a factory) and that default."""
    found = _DEFAULTS.get(cls)
    if found is None:
        found = _DEFAULTS[cls] = {
            f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        }
    return found


def _nested(cls: type[Record]) -> dict[str, tuple[type[Record], bool]]:
    """The fields holding nested records: name -> (their class, whether a list of them)."""
    found = _NESTED.get(cls)
    if found is None:
        found = {}
        for name, hint in typing.get_type_hints(cls).items():
            inner, many = _record_in(hint)
            if inner is not None:
                found[name] = (inner, many)
        _NESTED[cls] = found
    return found


def _record_in(hint: Any) -> tuple[type[Record] | None, bool]:
    """``X``, ``X | None``, ``Sequence[X]`` or ``Sequence[X] | None`` with ``X`` a :class:`Record`."""
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint, False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for branch in typing.get_args(hint):
            found = _record_in(branch)
            if found[0] is not None:
                return found
    elif origin in (list, tuple, Sequence):
        (item, *_) = typing.get_args(hint)
        if isinstance(item, type) and issubclass(item, Record):
            return item, True
    return None, False
