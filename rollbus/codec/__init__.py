"""The rollbus wire format (:mod:`rollbus.codec.avro`): Avro records behind a five-byte header, their schemas
(:mod:`~rollbus.codec.registry`) and the numpy sub-codec of their arrays of numbers
(:mod:`~rollbus.codec.number_arrays`). It decodes to, and encodes from, the event classes of
:mod:`rollbus.events` (a decoded message's ``event``; ``encode_event``), their dicts as the boundary."""

from rollbus.codec.avro import (
    HEADER,
    MAGIC,
    Codec,
    Decoded,
    Scanned,
    decode,
    decode_as,
    decode_many,
    decode_scans,
    default_codec,
    encode,
    encode_event,
    read_header,
    scan,
    schema,
)
from rollbus.codec.errors import CodecError
from rollbus.codec.number_arrays import Varints, number_bytes
from rollbus.codec.registry import SCHEMA_DIR
from rollbus.events import EVENT_TYPES

__all__ = [
    "EVENT_TYPES", "HEADER", "MAGIC", "SCHEMA_DIR", "Codec", "CodecError", "Decoded", "Scanned", "Varints",
    "decode", "decode_as", "decode_many", "decode_scans", "default_codec", "encode", "encode_event",
    "number_bytes", "read_header", "scan", "schema",
]  # fmt: skip
