"""The event schemas: hygiene, agreement with the Apache reference implementation, and evolution."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import avro.io
import avro.schema
import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus import codec
from rollbus.codec import HEADER, MAGIC, SCHEMA_DIR, Codec, CodecError, Decoded
from rollbus.events import EVENT_TYPES
from tests.avro_strategies import records
from tests.event_samples import SAMPLES


def fields(declared: dict) -> list[dict]:
    """Every field of a record schema, nested records' fields included."""
    found = []
    for field in declared["fields"]:
        found.append(field)
        if isinstance(field["type"], dict) and field["type"]["type"] == "record":
            found += fields(field["type"])
    return found


def reference_read(body: bytes, writer: dict, reader: dict | None = None) -> dict:
    """Decode with avro-python3, the Apache reference implementation."""
    parse = avro.schema.parse
    datum_reader = avro.io.DatumReader(parse(json.dumps(writer)), parse(json.dumps(reader or writer)))
    return datum_reader.read(avro.io.BinaryDecoder(io.BytesIO(body)))


def reference_write(record: dict, declared: dict) -> bytes:
    buffer = io.BytesIO()
    avro.io.DatumWriter(avro.schema.parse(json.dumps(declared))).write(record, avro.io.BinaryEncoder(buffer))
    return buffer.getvalue()


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_schema_is_documented_and_versioned(event_type):
    declared = codec.schema(event_type)
    assert declared["namespace"] == "rollbus"
    assert declared["doc"]
    assert declared["fields"][0] == {**declared["fields"][0], "name": "schema_version", "type": "int"}
    undocumented = [field["name"] for field in fields(declared) if not field.get("doc")]
    assert undocumented == []


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_every_version_from_1_to_latest_is_loadable(event_type):
    latest = codec.schema(event_type)["version"]
    for version in range(1, latest + 1):
        assert codec.schema(event_type, version)["version"] == version


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_reference_implementation_agrees_on_the_sample(event_type):
    declared = codec.schema(event_type)
    record = {**SAMPLES[event_type], "schema_version": declared["version"]}
    body = codec.encode(event_type, record)[HEADER.size:]
    assert reference_read(body, declared) == record
    assert reference_write(record, declared) == body


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_reference_implementation_agrees_on_random_records(event_type, data):
    declared = codec.schema(event_type)
    record = data.draw(records(declared))
    ours = codec.encode(event_type, record)
    theirs = reference_write(record, declared)
    assert ours[HEADER.size:] == theirs
    assert reference_read(theirs, declared) == record
    assert codec.decode(ours[:HEADER.size] + theirs) == Decoded(event_type, declared["version"], record)


@pytest.mark.parametrize(
    ("event_type", "version"),
    [(event_type, version) for event_type in EVENT_TYPES
     for version in range(1, codec.schema(event_type)["version"] + 1)],
)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_every_historical_version_resolves_under_the_latest(event_type, version, data):
    old = codec.schema(event_type, version)
    record = data.draw(records(old))
    buffer = io.BytesIO(HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), version))
    buffer.seek(0, io.SEEK_END)
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(old), record)
    decoded = codec.decode(buffer.getvalue())
    assert decoded.schema_version == version
    assert set(decoded.record) == {field["name"] for field in codec.schema(event_type)["fields"]}


# Evolution, exercised with a next version of the turn schema that exists only in this test.

LATEST = codec.schema("turn")["version"]
NEXT = LATEST + 1

CACHED_TOKENS = {
    "name": "cached_tokens", "type": "int", "default": 0,
    "doc": "Prompt tokens served from the engine's prefix cache.",
}


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory) -> Path:
    """A schema directory where turn is at NEXT (one defaulted field more) and LATEST is history."""
    directory = tmp_path_factory.mktemp("schemas")
    shutil.copytree(SCHEMA_DIR, directory, dirs_exist_ok=True)
    (directory / "history").mkdir(exist_ok=True)
    shutil.move(directory / "turn.avsc", directory / "history" / f"turn.v{LATEST}.avsc")
    v1 = codec.schema("turn", LATEST)
    v2 = {**v1, "version": NEXT, "fields": [*v1["fields"], CACHED_TOKENS]}
    (directory / "turn.avsc").write_text(json.dumps(v2, indent=2))
    return directory


def test_v1_bytes_resolve_under_a_v2_reader(v2_dir):
    v1_bytes = codec.encode("turn", SAMPLES["turn"])
    decoded = Codec(v2_dir).decode(v1_bytes)
    expected = {**SAMPLES["turn"], "schema_version": LATEST, "cached_tokens": 0}
    assert decoded == Decoded("turn", LATEST, expected)
    v2 = Codec(v2_dir).schema("turn")
    assert reference_read(v1_bytes[HEADER.size:], codec.schema("turn"), v2) == decoded.record


def test_v2_bytes_round_trip_with_a_v2_reader(v2_dir):
    v2_codec = Codec(v2_dir)
    record = {**SAMPLES["turn"], "cached_tokens": 512}
    data = v2_codec.encode("turn", record)
    assert v2_codec.decode(data) == Decoded("turn", NEXT, {**record, "schema_version": NEXT})


def test_a_v1_reader_refuses_v2_bytes_by_name(v2_dir):
    data = Codec(v2_dir).encode("turn", {**SAMPLES["turn"], "cached_tokens": 512})
    known = re.escape(str(list(range(1, NEXT))))
    with pytest.raises(CodecError, match=rf"unknown turn schema version {NEXT} \(known: {known}\)"):
        codec.decode(data)


def test_history_file_must_agree_with_its_version(tmp_path):
    shutil.copytree(SCHEMA_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / "history").mkdir(exist_ok=True)
    (tmp_path / "history" / f"turn.v{NEXT + 1}.avsc").write_text(json.dumps(codec.schema("turn", 1)))
    with pytest.raises(CodecError, match="declares version 1, its name says otherwise"):
        Codec(tmp_path)


def test_a_version_cannot_be_defined_twice(tmp_path):
    shutil.copytree(SCHEMA_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / "history").mkdir(exist_ok=True)
    (tmp_path / "history" / "turn.v1.avsc").write_text(json.dumps({**codec.schema("turn"), "version": 1}))
    shutil.copy(tmp_path / "history" / "turn.v1.avsc", tmp_path / "history" / "turn.v01.avsc")
    with pytest.raises(CodecError, match="turn schema version 1 is defined twice"):
        Codec(tmp_path)
