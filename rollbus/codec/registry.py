"""The schemas: ``schemas/<event>.avsc`` (the current version, stated by its top-level ``"version"``) and
``schemas/history/<event>.v<N>.avsc`` (every earlier version, kept forever so old bytes stay readable),
loaded and checked once, each with the plan :class:`~rollbus.codec.avro.Codec` writes it by."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import SchemaParseException

from rollbus.codec.errors import CodecError
from rollbus.codec.number_arrays import NUMBER_ITEMS
from rollbus.package_data import data_dir

# the repository's schemas/: at the top of a clone, package data in a wheel
SCHEMA_DIR = data_dir("schemas")


_HISTORY_NAME = re.compile(r"^(?P<event>\w+)\.v(?P<version>\d+)\.avsc$")


@dataclass(frozen=True)
class Schema:
    version: int
    declared: dict[str, Any]  # the JSON as written in the .avsc file
    parsed: dict[str, Any]  # fastavro's parsed form, reused for every message
    number_arrays: tuple[tuple[str, str], ...] = ()  # (field, item type) of top-level arrays of numbers
    plan: tuple[tuple[Any, ...], ...] = ()  # how encode writes the fields (see _encode_plan)
    field_names: tuple[str, ...] = ()  # in the schema's order


def number_array_fields(declared: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Top-level ``array<int|long|float|double>`` fields: token ids, logprobs, versions (a turn's bulk)."""
    found = []
    for field in declared["fields"]:
        kind = field["type"]
        if isinstance(kind, dict) and kind.get("type") == "array" and kind.get("items") in NUMBER_ITEMS:
            found.append((field["name"], kind["items"]))
    return tuple(found)


def _encode_plan(declared: dict[str, Any]) -> tuple[tuple[Any, ...], ...]:
    """The record as steps: ``("run", schema)`` for consecutive ordinary fields, written by fastavro (an Avro
    record is its fields' encodings back to back, so a record of a run of fields writes exactly those
    bytes), and ``("numbers", field, items, schema)`` for an array of numbers, written by numpy when the
    check vouched for it (by fastavro with ``schema`` otherwise)."""
    named: dict[str, Any] = {}
    arrays = dict(number_array_fields(declared))
    steps: list[tuple[Any, ...]] = []
    run: list[dict[str, Any]] = []

    def part(fields: list[dict[str, Any]]) -> dict[str, Any]:
        name = f"{declared['name']}Part{len(steps)}"
        record = {"type": "record", "name": name, "namespace": declared.get("namespace"), "fields": fields}
        return as_record(fastavro.parse_schema(copy.deepcopy(record), named_schemas=named))

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


def as_record(value: object) -> dict[str, Any]:
    """What fastavro returns for a record (a parsed record schema, a record read): a dict, where its return
    types cover every Avro schema and datum."""
    if not isinstance(value, dict):
        raise CodecError(f"fastavro gave a {type(value).__name__} for a record")
    return value


def _history_paths(schema_dir: Path, event_type: str) -> list[Path]:
    history = schema_dir / "history"
    if not history.is_dir():
        return []
    named = ((path, _HISTORY_NAME.match(path.name)) for path in history.iterdir())
    return sorted(path for path, match in named if match and match["event"] == event_type)


def load_versions(schema_dir: Path, event_type: str) -> dict[int, Schema]:
    """Every version of ``event_type``'s schema in ``schema_dir``; the current file must be the newest."""
    current = _load(schema_dir / f"{event_type}.avsc")
    versions = {current["version"]: current}
    for path in _history_paths(schema_dir, event_type):
        declared = _load(path)
        version = declared["version"]
        named = _HISTORY_NAME.match(path.name)  # it matched to be listed
        if named is None or version != int(named["version"]):
            raise CodecError(f"{path} declares version {version}, its name says otherwise")
        if version in versions:
            raise CodecError(f"{event_type} schema version {version} is defined twice ({path})")
        if version > current["version"]:
            raise CodecError(f"{path} is newer than the current {event_type} schema (v{current['version']})")
        versions[version] = declared
    try:
        return {
            v: Schema(v, d, as_record(fastavro.parse_schema(copy.deepcopy(d))), number_array_fields(d),
                      _encode_plan(d), tuple(f["name"] for f in d["fields"]))  # fmt: skip
            for v, d in versions.items()
        }
    except SchemaParseException as exc:
        raise CodecError(f"{event_type} schema in {schema_dir} is not valid Avro: {exc}") from exc
