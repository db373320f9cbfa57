"""Hypothesis strategies derived from Avro schemas, so every event schema gets random records.

Floats are drawn at 32-bit width for Avro ``float`` (the wire keeps 32 bits, so wider values would not
round-trip) and without NaN (NaN != NaN would make equality checks meaningless).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
MAX_ARRAY = 64

_PRIMITIVES: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "int": st.integers(*INT32),
    "long": st.integers(*INT64),
    "float": st.floats(width=32, allow_nan=False),
    "double": st.floats(allow_nan=False),
    "string": st.text(max_size=200),
    "bytes": st.binary(max_size=200),
}


def values(avro_type: Any, named: dict[str, Any] | None = None) -> st.SearchStrategy[Any]:
    """Values valid for ``avro_type`` (a declared schema fragment, as in a .avsc file)."""
    named = {} if named is None else named
    if isinstance(avro_type, list):
        return st.one_of([values(branch, named) for branch in avro_type])
    if isinstance(avro_type, str):
        return _PRIMITIVES[avro_type] if avro_type in _PRIMITIVES else values(named[avro_type], named)
    kind = avro_type["type"]
    if kind == "record":
        named[avro_type["name"]] = avro_type
        return st.fixed_dictionaries({f["name"]: values(f["type"], named) for f in avro_type["fields"]})
    if kind == "enum":
        named[avro_type["name"]] = avro_type
        return st.sampled_from(avro_type["symbols"])
    if kind == "array":
        return st.lists(values(avro_type["items"], named), max_size=MAX_ARRAY)
    return values(kind, named)


def records(declared: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Records of an event schema, ``schema_version`` set to the schema's own version."""
    return values(declared).map(lambda record: {**record, "schema_version": declared["version"]})
