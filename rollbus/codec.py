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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import SchemaParseException
from fastavro.validation import ValidationError, validate

from rollbus.events import EVENT_TYPES

__all__ = ["EVENT_TYPES", "Codec", "CodecError", "Decoded", "decode", "encode", "read_header", "schema"]

MAGIC = b"RB"
HEADER = struct.Struct(">2sBH")  # magic, event type id (index in EVENT_TYPES), schema version
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
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


@dataclass(frozen=True)
class _Schema:
    version: int
    declared: dict[str, Any]  # the JSON as written in the .avsc file
    parsed: dict[str, Any]  # fastavro's parsed form, reused for every message


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
        return {v: _Schema(v, d, fastavro.parse_schema(copy.deepcopy(d))) for v, d in versions.items()}
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
        self._check(event_type, current, datum)
        buffer = io.BytesIO()
        buffer.write(HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), current.version))
        fastavro.schemaless_writer(buffer, current.parsed, datum)
        return buffer.getvalue()

    def decode(self, data: bytes | bytearray | memoryview) -> Decoded:
        """The event in ``data``, resolved against the latest schema of its type."""
        event_type, version = read_header(data)
        writer, reader = self._get(event_type, version), self._get(event_type, None)
        body = io.BytesIO(data)
        body.seek(HEADER.size)
        try:
            record = fastavro.schemaless_reader(body, writer.parsed, reader.parsed)
        except _BODY_ERRORS as exc:
            raise CodecError(f"{event_type} v{version} body is undecodable: "
                             f"{type(exc).__name__}: {exc}") from exc
        if body.tell() != len(data):
            raise CodecError(f"{event_type} v{version} message has {len(data) - body.tell()} trailing bytes")
        return Decoded(event_type, version, record)

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

    def _check(self, event_type: str, current: _Schema, datum: dict[str, Any]) -> None:
        """Reject records fastavro would silently coerce or truncate, naming the offending field."""
        fields = current.declared["fields"]
        missing = [field["name"] for field in fields if field["name"] not in datum and "default" not in field]
        if missing:
            raise CodecError(f"{event_type} record is missing field(s) {', '.join(missing)} "
                             f"(schema v{current.version})")
        unknown = sorted(set(datum) - {field["name"] for field in fields})
        if unknown:
            raise CodecError(f"{event_type} record has field(s) {', '.join(unknown)} "
                             f"that schema v{current.version} does not define")
        try:
            validate(datum, current.parsed, raise_errors=True)
        except ValidationError as exc:
            problems = _describe(exc, current.declared["name"])
            message = f"{event_type} record does not match schema v{current.version}: {problems}"
            raise CodecError(message) from exc


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
    """The codec over the repository's ``schemas/`` directory, loaded on first use."""
    return Codec()


def encode(event_type: str, record: Mapping[str, Any]) -> bytes:
    return default_codec().encode(event_type, record)


def decode(data: bytes | bytearray | memoryview) -> Decoded:
    return default_codec().decode(data)


def schema(event_type: str, version: int | None = None) -> dict[str, Any]:
    return default_codec().schema(event_type, version)
