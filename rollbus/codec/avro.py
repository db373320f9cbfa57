"""The rollbus wire format: Avro binary records behind a five-byte header.

Every message value is ``b"RB" + u8 event type id + u16 schema version (big-endian)`` followed by
the record, encoded schemaless with the writer's schema version. Carrying the version in each
message (rather than in a registry service) lets any reader resolve old bytes against its newest
schema, so producers and consumers can be upgraded one at a time.

Schemas live in ``schemas/<event>.avsc`` (the current version, stated by its top-level
``"version"``) and ``schemas/history/<event>.v<N>.avsc`` (every earlier version, kept forever so
old bytes stay readable).
"""

from __future__ import annotations

import copy
import functools
import io
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fastavro
import numpy as np
from fastavro.validation import ValidationError, validate

from rollbus.codec.errors import BODY_ERRORS, CodecError
from rollbus.codec.number_arrays import (
    INT_RANGES,
    Blocks,
    Varints,
    as_varints,
    decode_numbers,
    listed,
    locate_numbers,
    number_bytes,
    split_numbers,
    varint_stops,
    vouch,
    write_number_block,
)
from rollbus.codec.registry import SCHEMA_DIR, Schema, as_record, load_versions
from rollbus.events import EVENT_TYPES, EventRecord, event_class

MAGIC = b"RB"


HEADER = struct.Struct(">2sBH")  # magic, event type id (index in EVENT_TYPES), schema version


E = TypeVar("E", bound=EventRecord)


@dataclass(frozen=True)
class Decoded:
    """A decoded message: what it is, which schema version wrote it, and its record: as its event class
    (:attr:`event`), or as the dict the codec read (``record``, the boundary for readers not yet typed)."""

    event_type: str
    schema_version: int
    record: dict[str, Any]

    @functools.cached_property
    def event(self) -> EventRecord:
        """The record as its :mod:`rollbus.events` class (built once, on first use)."""
        return event_class(self.event_type).from_dict(self.record)

    def event_as(self, cls: type[E]) -> E:
        """The record as ``cls``; :class:`CodecError` when the message is another event type."""
        if self.event_type != cls.event_type:
            raise CodecError(f"{self.event_type} event where a {cls.event_type} event was expected")
        event = self.event
        assert isinstance(event, cls)  # event_class(cls.event_type) is cls
        return event


ArraySpans = tuple[tuple[str, str, "Blocks"], ...]  # (field, item type, blocks) of each array of numbers


@dataclass(frozen=True)
class Scanned:
    """A message read all but its arrays of numbers, which are only located and checked: what a reader
    needs to route, deduplicate and keep an event costs no Python int per token. ``record`` holds every
    other field; :meth:`item_bytes` gives an array's bytes, :meth:`decoded` (or, for many messages at once,
    :meth:`Codec.decode_many`) the whole record."""

    event_type: str
    schema_version: int
    record: dict[str, Any]
    data: bytes = b""
    arrays: ArraySpans = ()
    order: tuple[str, ...] = ()  # every field's name, in the schema's order

    def decoded(self) -> Decoded:
        """The whole message, its arrays decoded: what :meth:`Codec.decode` returns for the same bytes."""
        record = _materialize([self])[0] if self.arrays else self.record
        return Decoded(self.event_type, self.schema_version, record)

    def item_bytes(self, name: str, items: str) -> tuple[int, bytes]:
        """One array of numbers as (item count, its items' Avro bytes back to back, no block framing): the
        bytes as they arrived, so hashing them decodes nothing; :func:`number_bytes` for a record's list."""
        for field, _, blocks in self.arrays:
            if field == name:
                return sum(n for n, _, _ in blocks), b"".join(self.data[a:b] for _, a, b in blocks)
        return len(self.record[name]), number_bytes(self.record[name], items)


def _field_name(path: str, record_name: str) -> str:
    """``rollbus.Turn.request_id`` -> ``request_id``; nested ones keep their record: ``TurnTimings.x``."""
    name = path.removeprefix("rollbus.")
    return name.removeprefix(record_name + ".") or "<record>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected(avro_type: Any) -> str:
    """A schema fragment in a few words: ``int``, ``enum main|subagent|side``, ``null|string``."""
    if isinstance(avro_type, list):
        return "|".join(_expected(branch) for branch in avro_type)
    if isinstance(avro_type, dict):
        if avro_type.get("type") == "enum":
            return "enum " + "|".join(avro_type["symbols"])
        if avro_type.get("type") == "array":
            return f"array<{_expected(avro_type['items'])}>"
        return str(avro_type.get("name") or avro_type.get("type"))
    return str(avro_type)


def read_header(data: bytes | bytearray | memoryview) -> tuple[str, int]:
    """The event type and schema version a message claims, without touching its body."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected message bytes, got {type(data).__name__} (a tombstone?)")
    if len(data) < HEADER.size:
        raise CodecError(f"message of {len(data)} bytes is shorter than the {HEADER.size}-byte header")
    magic, type_id, version = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}: not a rollbus message (expected {MAGIC!r})")
    if type_id >= len(EVENT_TYPES):
        raise CodecError(f"unknown event type id {type_id} (known: 0..{len(EVENT_TYPES) - 1})")
    return EVENT_TYPES[type_id], version


class Codec:
    """Encodes and decodes rollbus events using the schemas found in one directory."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        self.schema_dir = schema_dir
        self._schemas = {event_type: load_versions(schema_dir, event_type) for event_type in EVENT_TYPES}

    def latest_version(self, event_type: str) -> int:
        return max(self._versions(event_type))

    def schema(self, event_type: str, version: int | None = None) -> dict[str, Any]:
        """The schema of ``event_type`` as declared (a copy); the latest version unless one is asked."""
        return copy.deepcopy(self._get(event_type, version).declared)

    def encode(self, event_type: str, record: Mapping[str, Any] | EventRecord) -> bytes:
        """Header plus ``record`` in Avro binary under the latest schema; ``schema_version`` is filled in.
        ``record`` is an event (:mod:`rollbus.events`) or its dict; either gives the same bytes."""
        if isinstance(record, EventRecord):
            if record.event_type != event_type:
                raise CodecError(f"a {record.event_type} event cannot be encoded as a {event_type} event")
            record = record.to_dict()
        current = self._get(event_type, None)
        datum = {**record, "schema_version": current.version}
        vouched = self._check(event_type, current, datum)
        buffer = io.BytesIO()
        buffer.write(HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), current.version))
        for step in current.plan:
            if step[0] == "numbers" and step[1] in vouched:
                write_number_block(buffer, vouched[step[1]])
            else:
                fastavro.schemaless_writer(buffer, step[-1], datum)
        return buffer.getvalue()

    def encode_event(self, event: EventRecord) -> bytes:
        """``event`` as its own event type: :meth:`encode` with the type the class declares."""
        return self.encode(event.event_type, event)

    #: messages at least this long, written with the latest schema, decode their number arrays with numpy
    fast_decode_from = 2048

    def decode(self, data: bytes | bytearray | memoryview) -> Decoded:
        """The event in ``data``, resolved against the latest schema of its type."""
        event_type, version = read_header(data)
        writer, reader = self._get(event_type, version), self._get(event_type, None)
        if writer is reader and len(data) >= self.fast_decode_from and writer.number_arrays:
            return self.scan(data).decoded()
        body = io.BytesIO(data)
        body.seek(HEADER.size)
        try:
            record = as_record(fastavro.schemaless_reader(body, writer.parsed, reader.parsed))
        except BODY_ERRORS as exc:
            raise _undecodable(event_type, version, exc) from exc
        _check_consumed(event_type, version, body, data)
        return Decoded(event_type, version, record)

    def scan(self, data: bytes | bytearray | memoryview) -> Scanned:
        """``data`` read but for its arrays of numbers (see :class:`Scanned`); refused exactly as
        :meth:`decode` refuses. A message of an older schema version is decoded whole (no arrays located)."""
        event_type, version = read_header(data)
        writer, reader = self._get(event_type, version), self._get(event_type, None)
        if writer is not reader or not writer.number_arrays:
            decoded = self.decode(data)
            return Scanned(event_type, version, decoded.record, order=tuple(decoded.record))
        data = bytes(data) if not isinstance(data, bytes) else data
        body = io.BytesIO(data)
        body.seek(HEADER.size)
        try:
            record, arrays = _scan_plan(data, body, writer)
        except BODY_ERRORS as exc:
            raise _undecodable(event_type, version, exc) from exc
        _check_consumed(event_type, version, body, data)
        return Scanned(event_type, version, record, data, arrays, writer.field_names)

    def decode_many(
        self, messages: Sequence[bytes | bytearray | memoryview], *, arrays: bool = False
    ) -> list[Decoded]:
        """``[decode(m) for m in messages]``, with every array of numbers of every message decoded in one
        numpy pass per item type: a rollout's turns cost a few passes, not a few per turn. ``arrays`` leaves
        those arrays as numpy arrays (int64, or the float type's width) instead of lists: no Python object
        per item, for a reader that computes on them (messages of older schema versions still give lists)."""
        return decode_scans([self.scan(m) for m in messages], arrays=arrays)

    def _versions(self, event_type: str) -> dict[int, Schema]:
        try:
            return self._schemas[event_type]
        except KeyError:
            raise CodecError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}") from None

    def _get(self, event_type: str, version: int | None) -> Schema:
        versions = self._versions(event_type)
        key = max(versions) if version is None else version
        if key not in versions:
            raise CodecError(f"unknown {event_type} schema version {version} (known: {sorted(versions)})")
        return versions[key]

    def _check(
        self, event_type: str, current: Schema, datum: dict[str, Any]
    ) -> dict[str, np.ndarray | Varints]:
        """Reject records fastavro would silently coerce or truncate, naming the offending field; returns
        the number arrays a C-speed check vouched for (the validator never walked them)."""
        fields = current.declared["fields"]
        missing = [field["name"] for field in fields if field["name"] not in datum and "default" not in field]
        if missing:
            raise CodecError(f"{event_type} record is missing field(s) {', '.join(missing)} "
                             f"(schema v{current.version})")
        unknown = sorted(set(datum) - {field["name"] for field in fields})
        if unknown:
            raise CodecError(f"{event_type} record has field(s) {', '.join(unknown)} "
                             f"that schema v{current.version} does not define")
        arrays = {n: vouch(datum[n], items) for n, items in current.number_arrays if n in datum}
        vouched = {n: array for n, array in arrays.items() if array is not None}
        for name in arrays.keys() - vouched.keys():  # judged, and written, as the list it holds
            try:
                datum[name] = listed(datum[name])
            except CodecError as exc:
                raise CodecError(f"{event_type} record field {name!r}: {exc}") from exc
        try:  # the validator walks every element in Python: it only sees the arrays nobody vouched for
            validate({**datum, **dict.fromkeys(vouched, [])}, current.parsed, raise_errors=True)
        except ValidationError as exc:
            problems = _describe(exc, current.declared["name"])
            message = f"{event_type} record does not match schema v{current.version}: {problems}"
            raise CodecError(message) from exc
        return vouched


def _scan_plan(data: bytes, body: io.BytesIO, schema: Schema) -> tuple[dict[str, Any], ArraySpans]:
    """The record's ordinary fields read along the encode plan by fastavro (runs of fields), its arrays of
    numbers only located and checked (see :func:`locate_numbers`)."""
    record: dict[str, Any] = {}
    spans = []
    stops = varint_stops(data)
    for step in schema.plan:
        if step[0] == "run":
            record.update(as_record(fastavro.schemaless_reader(body, step[1], None)))
        else:
            blocks, end = locate_numbers(data, stops, body.tell(), step[2])
            spans.append((step[1], step[2], blocks))
            body.seek(end)
    return record, tuple(spans)


def _materialize(
    scans: list[Scanned], *, arrays: bool = False, varints: bool = False
) -> list[dict[str, Any]]:
    """Records with every located array decoded: one numpy pass per item type over all ``scans`` (a
    rollout's turn bodies decode in a few passes, not a few per turn), fields in the schema's order; as
    lists, or as numpy arrays with ``arrays``; with ``varints``, arrays of ints are not decoded at all but
    given as their bytes (:class:`Varints`)."""
    by_items: dict[str, list[tuple[bytes, Blocks]]] = {}
    for scan in scans:
        for _, items, blocks in scan.arrays:
            by_items.setdefault(items, []).append((scan.data, blocks))
    values: dict[str, Iterator[Any]] = {}
    for items, pieces in by_items.items():
        if varints and items in INT_RANGES:
            values[items] = map(as_varints, pieces)
        else:
            numbers = decode_numbers(items, pieces)
            values[items] = split_numbers(numbers if arrays else numbers.tolist(), pieces)
    records = []
    for scan in scans:
        decoded = {name: next(values[items]) for name, items, _ in scan.arrays}
        records.append({name: decoded[name] if name in decoded else scan.record[name] for name in scan.order})
    return records


def decode_scans(scans: Sequence[Scanned], *, arrays: bool = False, varints: bool = False) -> list[Decoded]:
    """The messages behind ``scans``, decoded as :meth:`Codec.decode_many` decodes them: for a reader that
    scanned them already (the segmenter, as each turn arrived) and keeps the scans. ``varints`` leaves their
    arrays of ints as bytes (:class:`Varints`) and implies ``arrays`` for the others."""
    records = iter(_materialize([s for s in scans if s.arrays], arrays=arrays or varints, varints=varints))
    return [Decoded(s.event_type, s.schema_version, next(records) if s.arrays else s.record)
            for s in scans]  # fmt: skip


def _undecodable(event_type: str, version: int, exc: Exception) -> CodecError:
    return CodecError(f"{event_type} v{version} body is undecodable: {type(exc).__name__}: {exc}")


def _check_consumed(event_type: str, version: int, body: io.BytesIO, data: Any) -> None:
    if body.tell() != len(data):
        raise CodecError(f"{event_type} v{version} message has {len(data) - body.tell()} trailing bytes")


def _describe(exc: ValidationError, record_name: str) -> str:
    """One phrase per offending field; a union's branches, reported one by one by fastavro, are merged."""
    by_field: dict[str, tuple[Any, list[str]]] = {}
    for error in exc.errors:
        datum, expected = by_field.setdefault(_field_name(error.field, record_name), (error.datum, []))
        expected.append(_expected(error.schema))
    return "; ".join(
        f"field {field!r}: got {type(datum).__name__} {_short(datum)}, expected {'|'.join(expected)}"
        for field, (datum, expected) in by_field.items()
    )


@functools.cache
def default_codec() -> Codec:
    """The codec over ``schemas/`` (:data:`SCHEMA_DIR`), loaded on first use."""
    return Codec()


def encode(event_type: str, record: Mapping[str, Any] | EventRecord) -> bytes:
    return default_codec().encode(event_type, record)


def encode_event(event: EventRecord) -> bytes:
    return default_codec().encode_event(event)


def decode(data: bytes | bytearray | memoryview) -> Decoded:
    return default_codec().decode(data)


def decode_as(cls: type[E], data: bytes | bytearray | memoryview) -> E:
    """The event in ``data`` as ``cls``; :class:`CodecError` if it is not one (or not decodable)."""
    return default_codec().decode(data).event_as(cls)


def decode_many(messages: Sequence[bytes | bytearray | memoryview], *, arrays: bool = False) -> list[Decoded]:
    return default_codec().decode_many(messages, arrays=arrays)


def scan(data: bytes | bytearray | memoryview) -> Scanned:
    return default_codec().scan(data)


def schema(event_type: str, version: int | None = None) -> dict[str, Any]:
    return default_codec().schema(event_type, version)
