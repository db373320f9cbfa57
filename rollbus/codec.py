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
import json
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
from fastavro.schema import SchemaParseException
from fastavro.validation import ValidationError, validate

from rollbus.events import EVENT_TYPES

__all__ = [
    "EVENT_TYPES", "Codec", "CodecError", "Decoded", "Scanned", "Varints", "decode", "decode_many",
    "decode_scans", "encode", "number_bytes", "read_header", "scan", "schema",
]  # fmt: skip

MAGIC = b"RB"
HEADER = struct.Struct(">2sBH")  # magic, event type id (index in EVENT_TYPES), schema version
# the repository's schemas/, through the rollbus/schemas link in a clone and as package data in a wheel
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
_HISTORY_NAME = re.compile(r"^(?P<event>\w+)\.v(?P<version>\d+)\.avsc$")
_BODY_ERRORS = (EOFError, ValueError, IndexError, OverflowError, struct.error)


class CodecError(ValueError):
    """Bytes that cannot be decoded, or a record that does not match its schema."""


@dataclass(frozen=True)
class Decoded:
    """A decoded message: what it is, which schema version wrote it, and its record."""

    event_type: str
    schema_version: int
    record: dict[str, Any]


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


@dataclass(frozen=True)
class Varints:
    """``count`` ints as their Avro bytes: zigzag varints back to back, no block framing. What a reader that
    scanned messages (:meth:`Scanned.item_bytes`) hands a writer to copy arrays of ints from them into
    another message without decoding one (the segmenter's token ids). The encoder still checks them: each
    varint whole, ``count`` of them, every value within the field's range."""

    count: int
    data: bytes

    def __len__(self) -> int:
        return self.count

    @classmethod
    def join(cls, parts: Sequence[Varints]) -> Varints:
        """The arrays one after another (each part is whole varints, so their bytes simply concatenate)."""
        return cls(sum(part.count for part in parts), b"".join(part.data for part in parts))

    def values(self) -> np.ndarray:
        """The ints, decoded (int64); CodecError if the bytes are not ``count`` whole varints of at most 10
        bytes."""
        data = np.frombuffer(self.data, np.uint8)
        if not _whole_varints(data, self.count, 10):
            raise CodecError(f"{len(self.data)} bytes are not {self.count} whole varints")
        if not self.count:
            return np.empty(0, np.int64)
        return _varint_values(data, (data < 0x80).nonzero()[0])


_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}
_NUMBER_ITEMS = ("int", "long", "float", "double")
_VARINT_WIDTHS = {"int": 4, "long": 9}  # bytes a varint may take and hold any value of the type


@dataclass(frozen=True)
class _Schema:
    version: int
    declared: dict[str, Any]  # the JSON as written in the .avsc file
    parsed: dict[str, Any]  # fastavro's parsed form, reused for every message
    number_arrays: tuple[tuple[str, str], ...] = ()  # (field, item type) of top-level arrays of numbers
    plan: tuple[tuple[Any, ...], ...] = ()  # how encode writes the fields (see _encode_plan)
    field_names: tuple[str, ...] = ()  # in the schema's order


def _number_arrays(declared: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Top-level ``array<int|long|float|double>`` fields: token ids, logprobs, versions (a turn's bulk)."""
    found = []
    for field in declared["fields"]:
        kind = field["type"]
        if isinstance(kind, dict) and kind.get("type") == "array" and kind.get("items") in _NUMBER_ITEMS:
            found.append((field["name"], kind["items"]))
    return tuple(found)


def _encode_plan(declared: dict[str, Any]) -> tuple[tuple[Any, ...], ...]:
    """The record as steps: ``("run", schema)`` for consecutive ordinary fields, written by fastavro (an Avro
    record is its fields' encodings back to back, so a record of a run of fields writes exactly those
    bytes), and ``("numbers", field, items, schema)`` for an array of numbers, written by numpy when the
    check vouched for it (by fastavro with ``schema`` otherwise)."""
    named: dict[str, Any] = {}
    arrays = dict(_number_arrays(declared))
    steps: list[tuple[Any, ...]] = []
    run: list[dict[str, Any]] = []

    def part(fields: list[dict[str, Any]]) -> dict[str, Any]:
        name = f"{declared['name']}Part{len(steps)}"
        record = {"type": "record", "name": name, "namespace": declared.get("namespace"), "fields": fields}
        return fastavro.parse_schema(copy.deepcopy(record), named_schemas=named)

    for field in declared["fields"]:
        if field["name"] not in arrays:
            run.append(field)
            continue
        if run:
            steps.append(("run", part(run)))
            run = []
        steps.append(("numbers", field["name"], arrays[field["name"]], part([field])))
    if run:
        steps.append(("run", part(run)))
    return tuple(steps)


def _varints(values: np.ndarray) -> bytes:
    """Avro longs (zigzag, then 7 bits a byte, least significant first) of an integer array, vectorised."""
    if not len(values):
        return b""
    low, high = int(values.min()), int(values.max())
    if low >= -64 and high <= 63:  # policy versions, context's -1: a byte each, no int64 copy
        small = values.astype(np.int8, copy=False)
        return ((small << np.int8(1)) ^ (small >> np.int8(7))).view(np.uint8).tobytes()
    values = values.astype(np.int64, copy=False)
    zigzag = ((values << 1) ^ (values >> 63)).view(np.uint64)
    width = max(1, (int(zigzag.max()).bit_length() + 6) // 7)
    groups = np.empty((len(zigzag), width), np.uint8)
    lengths = np.ones(len(zigzag), np.int64)
    rest = zigzag.copy()
    for i in range(width):
        groups[:, i] = (rest & np.uint64(0x7F)).astype(np.uint8)
        rest >>= np.uint64(7)
        more = rest != 0
        groups[:, i] |= more.astype(np.uint8) << np.uint8(7)
        lengths += more
    return groups[np.arange(width) < lengths[:, None]].tobytes()


def _long(value: int) -> bytes:
    """One Avro long (a block's item count): no numpy call for a single number."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def _write_number_block(buffer: io.BytesIO, values: np.ndarray | Varints) -> None:
    """One Avro array block (count, items, end marker) of numbers :func:`_vouch` converted or vouched for,
    written piece by piece (a segment's arrays are copied once, into ``buffer``)."""
    if not len(values):
        buffer.write(b"\x00")
        return
    buffer.write(_long(len(values)))
    if isinstance(values, Varints):
        buffer.write(values.data)
    else:
        buffer.write(_varints(values) if values.dtype.kind in "iu" else values.tobytes())
    buffer.write(b"\x00")


_NUMBER_DTYPES = {"float": "<f4", "double": "<f8"}


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """One Avro long (zigzag varint) at ``pos``: (value, position after it)."""
    shift = result = 0
    while True:
        if pos >= len(data):
            raise EOFError("a varint runs past the end of the message")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint is longer than 10 bytes")


def _varint_ends(data: np.ndarray, pos: int, count: int) -> np.ndarray:
    """Offsets (from ``pos``) of the last byte of each of ``count`` Avro longs: each ends at the first byte
    below 0x80. Raises like fastavro on a message too short or a varint over 10 bytes."""
    ends = (data[pos : pos + 10 * count] < 0x80).nonzero()[0][:count]
    if len(ends) < count:
        raise EOFError(f"an array of {count} numbers runs past the end of the message")
    if ends[0] >= 10 or (int(ends[-1]) >= count + 9 and (ends[1:] - ends[:-1]).max() > 10):
        raise ValueError("a varint is longer than 10 bytes")  # (a span under count + 9 bytes has none)
    return ends


def _varint_values(data: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The int64 values of the varints of ``data`` that end at ``ends`` (checked by :func:`_varint_ends`)."""
    count = len(ends)
    starts = np.empty(count, np.int64)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    lengths = ends - starts + 1
    span = int(ends[-1]) + 1
    shifts = (np.arange(span) - np.repeat(starts, lengths)) * 7
    parts = (data[:span] & np.uint8(0x7F)).astype(np.uint64) << shifts.astype(np.uint64)
    zigzag = np.add.reduceat(parts, starts)  # the 7-bit groups never overlap: sum == or
    return (zigzag >> np.uint64(1)).view(np.int64) ^ -(zigzag & np.uint64(1)).view(np.int64)


Blocks = tuple[tuple[int, int, int], ...]  # an array's blocks: (item count, first item byte, end byte)


_MAX = np.maximum.reduce  # the ufunc itself: ndarray.max's Python wrappers cost more than a short array
Stops = tuple[np.ndarray, np.ndarray]  # a message's varint ends (bytes below 0x80) and the gaps between them


def _stops(data: bytes) -> Stops:
    """Where every varint of a message could end, found once for all its arrays (:func:`_varints_end`)."""
    stops = (np.frombuffer(data, np.uint8) < 0x80).nonzero()[0]
    return stops, stops[1:] - stops[:-1]


def _varints_end(stops: Stops, pos: int, count: int) -> int:
    """The position after ``count`` Avro longs from ``pos``, given the message's :func:`_stops`. Raises as
    :func:`_varint_ends` does."""
    ends, gaps = stops
    first = int(ends.searchsorted(pos))
    last = first + count - 1
    if last >= len(ends):
        raise EOFError(f"an array of {count} numbers runs past the end of the message")
    end = int(ends[last])
    if int(ends[first]) - pos >= 10 or (end - pos >= count + 9 and _MAX(gaps[first:last]) > 10):
        raise ValueError("a varint is longer than 10 bytes")  # (a span under count + 9 bytes has none)
    return end + 1


def _locate_numbers(data: bytes, stops: Stops, pos: int, items: str) -> tuple[Blocks, int]:
    """Where an Avro array of numbers lies (any number of blocks, a negative count carrying its byte size),
    checked as decoding it would check it but not decoded: (its blocks, the position after it)."""
    blocks = []
    while True:
        count, pos = _read_long(data, pos)
        if count == 0:
            return tuple(blocks), pos
        if count < 0:
            count = -count
            _, pos = _read_long(data, pos)
        if items in _NUMBER_DTYPES:
            end = pos + count * np.dtype(_NUMBER_DTYPES[items]).itemsize
            if end > len(data):
                raise EOFError(f"an array of {count} {items}s runs past the end of the message")
        else:
            end = _varints_end(stops, pos, count)
        blocks.append((count, pos, end))
        pos = end


def _joined(pieces: list[tuple[bytes, Blocks]]) -> tuple[bytes, int]:
    """The item bytes of several located arrays back to back, and their item count: one numpy pass then
    decodes them all (an array's blocks are whole items, so their concatenation is a valid run)."""
    parts = [data[start:end] for data, blocks in pieces for _, start, end in blocks]
    return b"".join(parts), sum(count for _, blocks in pieces for count, _, _ in blocks)


def _numbers(items: str, pieces: list[tuple[bytes, Blocks]]) -> np.ndarray:
    """The values of located arrays of one item type, concatenated: int64, or the float type's width."""
    raw, count = _joined(pieces)
    if items in _NUMBER_DTYPES:
        return np.frombuffer(raw, _NUMBER_DTYPES[items], count)
    if not count:
        return np.empty(0, np.int64)
    array = np.frombuffer(raw, np.uint8)
    return _varint_values(array, _varint_ends(array, 0, count))


def number_bytes(values: Sequence[int | float], items: str) -> bytes:
    """The Avro bytes of ``values``' items, back to back (zigzag varints, or little-endian floats): what a
    writer puts in an array block of ``array<items>``, and what :meth:`Scanned.item_bytes` reads back."""
    if items in _NUMBER_DTYPES:
        return np.asarray(values, _NUMBER_DTYPES[items]).tobytes()
    return _varints(np.asarray(values, np.int64)) if len(values) else b""


def _vouch(value: Any, items: str) -> np.ndarray | None:
    """``value`` as a numpy array if a C-speed check shows it valid for ``array<items>`` as fastavro's
    validator would judge it (ints, not bools, in range; ints or floats for float/double, a float within
    32 bits); None means "not sure": the caller then runs the full validation, which decides and names the
    problem, and fastavro writes the field. A numpy array (what the segmenter stitches) is judged by its
    dtype and range, so none of its items becomes a Python object."""
    if isinstance(value, np.ndarray):
        return _vouch_array(value, items)
    if isinstance(value, Varints):
        return _vouch_varints(value, items)
    if type(value) is not list:
        return None
    types = set(map(type, value))
    if items in _INT_RANGES:
        if value and types != {int}:
            return None
        try:
            array = np.asarray(value, dtype=np.int64)
        except OverflowError:
            return None
        low, high = _INT_RANGES[items]
        return array if not value or (low <= array.min() and array.max() <= high) else None
    if not types <= {int, float}:
        return None
    try:
        array = np.asarray(value, dtype="<f4" if items == "float" else "<f8")
    except OverflowError:
        return None
    return None if items == "float" and np.isinf(array).any() else array


def _vouch_array(value: np.ndarray, items: str) -> np.ndarray | None:
    """:func:`_vouch` for a one-dimensional numpy array: integer dtypes for ints, integer or float dtypes for
    float/double (never bool); None sends it, as a list, to the full validation."""
    kind = value.dtype.kind
    if value.ndim != 1 or kind not in ("iu" if items in _INT_RANGES else "iuf"):
        return None
    if items in _INT_RANGES:  # kept in its own dtype: the writer reads small ints a byte each
        low, high = _INT_RANGES[items]
        return value if not len(value) or (low <= int(value.min()) and int(value.max()) <= high) else None
    array = value.astype("<f4" if items == "float" else "<f8", copy=False)
    return None if items == "float" and np.isinf(array).any() else array


def _vouch_varints(value: Varints, items: str) -> Varints | None:
    """:func:`_vouch` for :class:`Varints`: ``count`` whole varints, none wider than what holds only values of
    the type (4 bytes for int, 9 for long); None (not sure) for anything else, which is then decoded and
    judged item by item."""
    if items not in _VARINT_WIDTHS:
        return None
    whole = _whole_varints(np.frombuffer(value.data, np.uint8), value.count, _VARINT_WIDTHS[items])
    return value if whole else None


def _whole_varints(data: np.ndarray, count: int, width: int) -> bool:
    """Whether ``data`` is exactly ``count`` varints, none over ``width`` bytes. Byte-wide boolean passes
    only: a segment's ids are checked at the cost of a few copies of their bytes, not of an int64 a token."""
    if not len(data):
        return not count
    more = data >= 0x80  # a byte another follows in its varint
    if more[-1] or len(data) - np.count_nonzero(more) != count:
        return False
    if len(data) < width:
        return True
    run = more[: len(data) - width + 1].copy()  # a run of ``width`` continuation bytes: a wider varint
    for shift in range(1, width):
        run &= more[shift : len(data) - width + 1 + shift]
    return not run.any()


def _listed(value: Any) -> Any:
    """What the full validation judges, and fastavro writes, for an array :func:`_vouch` was not sure of."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Varints):
        return _varints_as_list(value)
    return value


def _varints_as_list(value: Varints) -> list[int]:
    """Every varint of ``value``, read one by one as fastavro reads them (no width limit, so an out-of-range
    value is shown as it is); CodecError if the bytes are not ``count`` whole varints."""
    values, pos = [], 0
    try:
        while pos < len(value.data):
            number, pos = _read_long(value.data, pos)
            values.append(number)
    except _BODY_ERRORS as exc:
        raise CodecError(f"{value.count} varints in {len(value.data)} bytes do not decode: {exc}") from exc
    if len(values) != value.count:
        raise CodecError(f"{len(value.data)} bytes hold {len(values)} varints, not {value.count}")
    return values


def _load(path: Path) -> dict[str, Any]:
    try:
        declared = json.loads(path.read_text())
    except FileNotFoundError:
        raise CodecError(f"schema file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise CodecError(f"schema file {path} is not valid JSON: {exc}") from exc
    if not isinstance(declared.get("version"), int):
        raise CodecError(f"schema file {path} has no integer top-level \"version\"")
    return declared


def _history_paths(schema_dir: Path, event_type: str) -> list[Path]:
    history = schema_dir / "history"
    if not history.is_dir():
        return []
    named = ((path, _HISTORY_NAME.match(path.name)) for path in history.iterdir())
    return sorted(path for path, match in named if match and match["event"] == event_type)


def _load_versions(schema_dir: Path, event_type: str) -> dict[int, _Schema]:
    """Every version of ``event_type``'s schema in ``schema_dir``; the current file must be the newest."""
    current = _load(schema_dir / f"{event_type}.avsc")
    versions = {current["version"]: current}
    for path in _history_paths(schema_dir, event_type):
        declared = _load(path)
        version = declared["version"]
        if version != int(_HISTORY_NAME.match(path.name)["version"]):
            raise CodecError(f"{path} declares version {version}, its name says otherwise")
        if version in versions:
            raise CodecError(f"{event_type} schema version {version} is defined twice ({path})")
        if version > current["version"]:
            raise CodecError(f"{path} is newer than the current {event_type} schema (v{current['version']})")
        versions[version] = declared
    try:
        return {
            v: _Schema(v, d, fastavro.parse_schema(copy.deepcopy(d)), _number_arrays(d), _encode_plan(d),
                       tuple(f["name"] for f in d["fields"]))  # fmt: skip
            for v, d in versions.items()
        }
    except SchemaParseException as exc:
        raise CodecError(f"{event_type} schema in {schema_dir} is not valid Avro: {exc}") from exc


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
        self._schemas = {event_type: _load_versions(schema_dir, event_type) for event_type in EVENT_TYPES}

    def latest_version(self, event_type: str) -> int:
        return max(self._versions(event_type))

    def schema(self, event_type: str, version: int | None = None) -> dict[str, Any]:
        """The schema of ``event_type`` as declared (a copy); the latest version unless one is asked."""
        return copy.deepcopy(self._get(event_type, version).declared)

    def encode(self, event_type: str, record: Mapping[str, Any]) -> bytes:
        """Header plus ``record`` in Avro binary under the latest schema; ``schema_version`` is filled in."""
        current = self._get(event_type, None)
        datum = {**record, "schema_version": current.version}
        vouched = self._check(event_type, current, datum)
        buffer = io.BytesIO()
        buffer.write(HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), current.version))
        for step in current.plan:
            if step[0] == "numbers" and step[1] in vouched:
                _write_number_block(buffer, vouched[step[1]])
            else:
                fastavro.schemaless_writer(buffer, step[-1], datum)
        return buffer.getvalue()

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
            record = fastavro.schemaless_reader(body, writer.parsed, reader.parsed)
        except _BODY_ERRORS as exc:
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
        except _BODY_ERRORS as exc:
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

    def _versions(self, event_type: str) -> dict[int, _Schema]:
        try:
            return self._schemas[event_type]
        except KeyError:
            raise CodecError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}") from None

    def _get(self, event_type: str, version: int | None) -> _Schema:
        versions = self._versions(event_type)
        key = max(versions) if version is None else version
        if key not in versions:
            raise CodecError(f"unknown {event_type} schema version {version} (known: {sorted(versions)})")
        return versions[key]

    def _check(self, event_type: str, current: _Schema, datum: dict[str, Any]) -> dict[str, np.ndarray]:
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
        arrays = {n: _vouch(datum[n], items) for n, items in current.number_arrays if n in datum}
        vouched = {n: array for n, array in arrays.items() if array is not None}
        for name in arrays.keys() - vouched.keys():  # judged, and written, as the list it holds
            try:
                datum[name] = _listed(datum[name])
            except CodecError as exc:
                raise CodecError(f"{event_type} record field {name!r}: {exc}") from exc
        try:  # the validator walks every element in Python: it only sees the arrays nobody vouched for
            validate({**datum, **dict.fromkeys(vouched, [])}, current.parsed, raise_errors=True)
        except ValidationError as exc:
            problems = _describe(exc, current.declared["name"])
            message = f"{event_type} record does not match schema v{current.version}: {problems}"
            raise CodecError(message) from exc
        return vouched


def _scan_plan(data: bytes, body: io.BytesIO, schema: _Schema) -> tuple[dict[str, Any], ArraySpans]:
    """The record's ordinary fields read along the encode plan by fastavro (runs of fields), its arrays of
    numbers only located and checked (see :func:`_locate_numbers`)."""
    record: dict[str, Any] = {}
    spans = []
    stops = _stops(data)
    for step in schema.plan:
        if step[0] == "run":
            record.update(fastavro.schemaless_reader(body, step[1], None))
        else:
            blocks, end = _locate_numbers(data, stops, body.tell(), step[2])
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
        if varints and items in _INT_RANGES:
            values[items] = map(_as_varints, pieces)
        else:
            numbers = _numbers(items, pieces)
            values[items] = _split(numbers if arrays else numbers.tolist(), pieces)
    records = []
    for scan in scans:
        decoded = {name: next(values[items]) for name, items, _ in scan.arrays}
        records.append({name: decoded[name] if name in decoded else scan.record[name] for name in scan.order})
    return records


def _as_varints(piece: tuple[bytes, Blocks]) -> Varints:
    data, count = _joined([piece])
    return Varints(count, data)


def decode_scans(scans: Sequence[Scanned], *, arrays: bool = False, varints: bool = False) -> list[Decoded]:
    """The messages behind ``scans``, decoded as :meth:`Codec.decode_many` decodes them: for a reader that
    scanned them already (the segmenter, as each turn arrived) and keeps the scans. ``varints`` leaves their
    arrays of ints as bytes (:class:`Varints`) and implies ``arrays`` for the others."""
    records = iter(_materialize([s for s in scans if s.arrays], arrays=arrays or varints, varints=varints))
    return [Decoded(s.event_type, s.schema_version, next(records) if s.arrays else s.record)
            for s in scans]  # fmt: skip


def _split(values: Any, pieces: list[tuple[bytes, Blocks]]) -> Iterator[Any]:
    """``values`` cut back into the arrays of ``pieces``, in order."""
    start = 0
    for _, blocks in pieces:
        count = sum(n for n, _, _ in blocks)
        yield values[start : start + count]
        start += count


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


def encode(event_type: str, record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(event_type, record)


def decode(data: bytes | bytearray | memoryview) -> Decoded:
    return default_codec().decode(data)


def decode_many(messages: Sequence[bytes | bytearray | memoryview], *, arrays: bool = False) -> list[Decoded]:
    return default_codec().decode_many(messages, arrays=arrays)


def scan(data: bytes | bytearray | memoryview) -> Scanned:
    return default_codec().scan(data)


def schema(event_type: str, version: int | None = None) -> dict[str, Any]:
    return default_codec().schema(event_type, version)
