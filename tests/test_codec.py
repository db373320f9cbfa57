"""The wire codec: header, round-trips of random records, and clear errors on bad input."""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus import codec
from rollbus.codec import HEADER, MAGIC, CodecError, Decoded
from rollbus.events import EVENT_TYPES, TOPICS
from tests.avro_strategies import records
from tests.event_samples import SAMPLES, segment, turn

SEGMENT_TOKENS = 96_000
NUMBERS = ("int", "long", "float", "double")


def test_event_types_match_the_topic_catalogue():
    assert codec.EVENT_TYPES == EVENT_TYPES
    assert set(TOPICS) == set(EVENT_TYPES)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_header_names_event_type_and_schema_version(event_type):
    data = codec.encode(event_type, SAMPLES[event_type])
    version = codec.schema(event_type)["version"]
    assert data[:5] == b"RB" + bytes([EVENT_TYPES.index(event_type)]) + version.to_bytes(2, "big")


def test_read_header_leaves_the_body_alone():
    data = HEADER.pack(MAGIC, EVENT_TYPES.index("segment"), 1) + b"not avro at all"
    assert codec.read_header(data) == ("segment", 1)
    with pytest.raises(CodecError, match="segment v1 body is undecodable"):
        codec.decode(data)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_random_records_round_trip(event_type, data):
    record = data.draw(records(codec.schema(event_type)))
    decoded = codec.decode(codec.encode(event_type, record))
    assert decoded == Decoded(event_type, record["schema_version"], record)


token_ids = st.lists(st.integers(0, 2**18), max_size=3_000)
logprob = st.floats(max_value=0.0, width=32, allow_nan=False)


@settings(max_examples=30, deadline=None)
@given(prompt=token_ids, output=st.lists(st.tuples(st.integers(0, 2**18), logprob), max_size=3_000))
def test_token_arrays_round_trip(prompt, output):
    sampled = {"output_ids": [t for t, _ in output], "output_logprobs": [lp for _, lp in output]}
    record = turn(prompt_ids=prompt, **sampled)
    version = codec.schema("turn")["version"]
    assert codec.decode(codec.encode("turn", record)).record == {**record, "schema_version": version}


def test_segment_of_96k_tokens_round_trips_compactly():
    record = segment(SEGMENT_TOKENS)
    data = codec.encode("segment", record)
    assert codec.decode(data).record == {**record, "schema_version": codec.schema("segment")["version"]}
    # token ids < 2**20 take at most 3 varint bytes, logprobs 4, mask 1, versions 1: well under 10 per token
    assert len(data) < 10 * (SEGMENT_TOKENS + 2_000)


def test_encode_sets_schema_version_whatever_the_caller_says():
    decoded = codec.decode(codec.encode("turn", turn(schema_version=99)))
    assert decoded.record["schema_version"] == decoded.schema_version == codec.schema("turn")["version"]


def test_defaulted_fields_may_be_left_out():
    record = turn()
    del record["prompt_ref_turn"]
    assert codec.decode(codec.encode("turn", record)).record["prompt_ref_turn"] is None


def test_schema_returns_a_copy():
    codec.schema("turn")["fields"].clear()
    assert codec.schema("turn")["fields"]


def _turn_bytes() -> bytes:
    return codec.encode("turn", turn())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (None, "expected message bytes, got NoneType"),
        (b"", "shorter than the 5-byte header"),
        (b"RB\x01", "shorter than the 5-byte header"),
        (b"XX" + _turn_bytes()[2:], "bad magic"),
        (HEADER.pack(MAGIC, len(EVENT_TYPES), 1) + b"\x00", f"unknown event type id {len(EVENT_TYPES)}"),
        (HEADER.pack(MAGIC, 1, 99) + _turn_bytes()[5:], "unknown turn schema version 99"),
        (_turn_bytes() + b"\x00", "turn v4 message has 1 trailing bytes"),
    ],
    ids=["tombstone", "empty", "short-header", "bad-magic", "unknown-type", "unknown-version", "trailing"],
)
def test_decode_rejects_bad_bytes(data, message):
    with pytest.raises(CodecError, match=message):
        codec.decode(data)


def test_any_bytes_like_message_decodes():
    data = _turn_bytes()
    assert codec.decode(bytearray(data)) == codec.decode(memoryview(data)) == codec.decode(data)


def test_every_truncation_of_a_message_is_rejected():
    data = _turn_bytes()
    for length in range(len(data)):
        with pytest.raises(CodecError):
            codec.decode(data[:length])


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=80))
def test_arbitrary_bodies_decode_or_raise_codec_error(event_type, body):
    data = HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), 1) + body
    try:
        decoded = codec.decode(data)
    except CodecError as error:
        assert event_type in str(error)
    else:
        assert decoded.event_type == event_type


def _without(record: dict, field: str) -> dict:
    return {name: value for name, value in record.items() if name != field}


@pytest.mark.parametrize(
    ("record", "field"),
    [
        (_without(turn(), "request_id"), "request_id"),
        (turn(rollout_id=None), "rollout_id"),
        (turn(turn_index="1"), "turn_index"),
        (turn(turn_index=True), "turn_index"),
        (turn(turn_index=2**31), "turn_index"),
        (turn(output_ids=[1, 2.5]), "output_ids"),
        (turn(chain_kind="helper"), "chain_kind"),
        (turn(prompt_ref_turn="0"), "prompt_ref_turn"),
        (turn(timings={"started_at": 1, "generation_ms": 2}), "finished_at"),
        (turn(tokens=[1]), "tokens"),
    ],
    ids=["missing", "null", "str-for-int", "bool-for-int", "int32-overflow", "float-in-ids", "enum",
         "union", "nested-missing", "unknown-field"],
)
def test_encode_names_event_type_and_field_of_a_bad_record(record, field):
    with pytest.raises(CodecError, match=rf"^turn record .*{field}"):
        codec.encode("turn", record)


def test_unknown_event_type_and_version_are_codec_errors():
    with pytest.raises(CodecError, match="unknown event type 'turns'"):
        codec.encode("turns", turn())
    with pytest.raises(CodecError, match="unknown turn schema version 99"):
        codec.schema("turn", 99)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_every_field_of_every_event_is_checked_by_name(event_type):
    for field in codec.schema(event_type)["fields"][1:]:  # schema_version is the codec's to fill in
        name = field["name"]
        with pytest.raises(CodecError, match=rf"^{event_type} record .*'{name}': got object"):
            codec.encode(event_type, {**SAMPLES[event_type], name: object()})
        if "default" not in field:
            with pytest.raises(CodecError, match=rf"^{event_type} record is missing field\(s\) {name} "):
                codec.encode(event_type, _without(SAMPLES[event_type], name))


# --- the encode fast path: numpy writes vouched number arrays; bytes and errors stay fastavro's -----------


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    versions=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
    logprobs=st.lists(st.floats(width=32, allow_nan=False) | st.integers(-5, 5), max_size=20),
)
def test_the_fast_path_writes_what_fastavro_writes(ids, versions, logprobs):
    import fastavro

    record = {**SAMPLES["segment"], "response_ids": ids, "policy_versions": versions,
              "rollout_logprobs": logprobs, "loss_mask": bytes(len(ids))}  # fmt: skip
    expected = io.BytesIO()
    fastavro.schemaless_writer(expected, fastavro.parse_schema(codec.schema("segment")),
                               {**record, "schema_version": codec.schema("segment")["version"]})  # fmt: skip
    assert codec.encode("segment", record)[HEADER.size :] == expected.getvalue()


@pytest.mark.parametrize(
    ("value", "shown"),
    [([1, True, 3], "got bool True"), ([1, 2**31], "got int 2147483648"), ([1, "2"], "got str '2'"),
     ((1, 2.5), "got float 2.5")],
    ids=["bool-in-ids", "int32-overflow-in-ids", "str-in-ids", "float-in-tuple"],
)
def test_a_bad_number_in_a_long_array_is_still_named(value, shown):
    record = {**SAMPLES["segment"], "response_ids": [7] * 5000 + list(value)}
    with pytest.raises(CodecError, match=rf"^segment record .*'response_ids': {shown}"):
        codec.encode("segment", record)


@settings(max_examples=120, deadline=None)
@given(
    ids=st.lists(st.one_of(st.integers(-70, 70), st.integers(-(2**31), 2**31 - 1)), max_size=40),
    versions=st.lists(st.one_of(st.integers(-70, 70), st.integers(-(2**63), 2**63 - 1)), max_size=20),
    logprobs=st.lists(st.floats(width=32, allow_nan=False), max_size=20),
    id_type=st.sampled_from(["int64", "int32", "uint32", "int16", "uint16", "int8", "uint8"]),
    logprob_type=st.sampled_from(["float32", "float64"]),
)
def test_numpy_arrays_encode_as_the_lists_they_hold(ids, versions, logprobs, id_type, logprob_type):
    """The segmenter hands the codec numpy arrays: any integer dtype for ids, any float dtype for logprobs,
    the same bytes as the lists (an id a dtype cannot hold is left out of that draw). Values within -64..63
    (policy versions, context's -1) take a byte-wide path of their own."""
    import numpy as np

    ids = [i for i in ids if np.iinfo(id_type).min <= i <= np.iinfo(id_type).max]
    lists = {**SAMPLES["segment"], "response_ids": ids, "policy_versions": versions,
             "rollout_logprobs": logprobs, "loss_mask": bytes(len(ids))}  # fmt: skip
    arrays = {**lists, "response_ids": np.array(ids, id_type),
              "policy_versions": np.array(versions, np.int64),
              "rollout_logprobs": np.array(logprobs, logprob_type)}  # fmt: skip
    assert codec.encode("segment", arrays) == codec.encode("segment", lists)


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [("response_ids", lambda np: np.array([1, 2**31]), "got int 2147483648"),
     ("response_ids", lambda np: np.array([True, False]), "got bool True"),
     ("response_ids", lambda np: np.array([1.0, 2.5]), "got float 1.0"),
     ("response_ids", lambda np: np.array([[1, 2]]), "got list \\[1, 2\\]"),
     ("policy_versions", lambda np: np.array([2**64 - 1], np.uint64), "got int 18446744073709551615"),
     ("rollout_logprobs", lambda np: np.array(["a"]), "got str 'a'")],
    ids=["int32-overflow", "bools", "floats-as-ids", "two-dimensional", "uint64-overflow", "strings"],
)
def test_a_numpy_array_the_codec_cannot_vouch_for_is_judged_as_its_list(field, value, shown):
    """Never a silent cast: an array whose dtype or range does not fit is validated item by item, and the
    error names the field and the first bad item, as for a list."""
    import numpy as np

    record = {**SAMPLES["segment"], field: value(np)}
    with pytest.raises(CodecError, match=rf"^segment record .*'{field}': {shown}"):
        codec.encode("segment", record)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
    versions=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
)
def test_varints_encode_as_the_lists_they_hold(ids, versions):
    """Ids spliced as the bytes they arrived as write what the same ids as a list write, whatever their width
    (a varint wider than any value of the type needs is decoded and judged, then written as fastavro does)."""
    record = {**SAMPLES["segment"], "response_ids": ids, "policy_versions": versions,
              "loss_mask": bytes(len(ids))}  # fmt: skip
    spliced = {**record, "response_ids": codec.Varints(len(ids), codec.number_bytes(ids, "int")),
               "policy_versions": codec.Varints(len(versions),
                                                codec.number_bytes(versions, "long"))}  # fmt: skip
    assert codec.encode("segment", spliced) == codec.encode("segment", record)
    halves = [codec.Varints(len(part), codec.number_bytes(part, "int")) for part in (ids[:3], ids[3:])]
    assert codec.Varints.join(halves) == spliced["response_ids"]
    assert codec.Varints.join(halves).values().tolist() == ids


@pytest.mark.parametrize(
    ("varints", "shown"),
    [(codec.Varints(2, b"\x02\x04\x06"), "3 varints, not 2"),
     (codec.Varints(3, b"\x02\x04"), "2 varints, not 3"),
     (codec.Varints(1, b"\x82"), "do not decode: a varint runs past the end"),
     (codec.Varints(1, b"\xff" * 11 + b"\x01"), "do not decode: a varint is longer than 10 bytes"),
     (codec.Varints(1, b"\x80\x80\x80\x80\x10"), "got int 2147483648, expected int")],
    ids=["more-than-count", "fewer-than-count", "cut-short", "over-10-bytes", "past-int32"],
)
def test_varints_the_codec_cannot_vouch_for_are_refused_naming_the_field(varints, shown):
    """Spliced bytes get no trust the list would not get: a count that does not match, a varint cut short
    or over 10 bytes, a value past the field's range are each a CodecError naming the field."""
    record = {**SAMPLES["segment"], "response_ids": varints, "loss_mask": bytes(varints.count)}
    with pytest.raises(CodecError, match=rf"^segment record .*'response_ids'.*{shown}"):
        codec.encode("segment", record)


@pytest.mark.parametrize(
    "varints",
    [codec.Varints(1, b"\x02\x04"), codec.Varints(3, b"\x02\x04"), codec.Varints(1, b"\x82"),
     codec.Varints(1, b"\xff" * 11 + b"\x01"), codec.Varints(0, b"\x02")],
    ids=["trailing-bytes", "fewer-than-count", "cut-short", "over-10-bytes", "bytes-for-none"],
)
def test_decoding_varints_refuses_bytes_that_are_not_count_whole_varints(varints):
    with pytest.raises(CodecError, match="are not .* whole varints"):
        varints.values()


def test_a_wide_varint_of_a_small_value_is_judged_by_its_value():
    """Five bytes for 0 (non-minimal, as another writer may send it): in range, so written, minimally."""
    record = {**SAMPLES["segment"], "response_ids": codec.Varints(2, b"\x80\x80\x80\x80\x00\x02"),
              "loss_mask": bytes(2)}  # fmt: skip
    assert codec.decode(codec.encode("segment", record)).record["response_ids"] == [0, 1]


def test_tuples_and_other_sequences_still_encode_through_fastavro():
    record = {**SAMPLES["segment"], "response_ids": (1, 2, 3), "loss_mask": b"\x01\x01\x00"}
    assert codec.decode(codec.encode("segment", record)).record["response_ids"] == [1, 2, 3]


def _codecs() -> tuple[codec.Codec, codec.Codec]:
    """The same schemas read element by element (fastavro) and with numpy wherever possible."""
    slow, fast = codec.Codec(), codec.Codec()
    slow.fast_decode_from, fast.fast_decode_from = 2**62, 0
    return slow, fast


SLOW, FAST = _codecs()
NUMBERED = [e for e in EVENT_TYPES if any(f["type"] in ("int", "long", "float", "double") or (
    isinstance(f["type"], dict) and f["type"].get("items") in ("int", "long", "float", "double"))
    for f in codec.schema(e)["fields"])]  # fmt: skip


def _outcome(reader: codec.Codec, data: bytes) -> object:
    try:
        return reader.decode(data)
    except CodecError as error:
        return type(error)


@pytest.mark.parametrize("event_type", ["turn", "segment"])
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_the_numpy_decode_and_a_scan_equal_fastavros_on_random_records(event_type, data):
    record = data.draw(records(codec.schema(event_type)))
    encoded = codec.encode(event_type, record)
    expected = Decoded(event_type, record["schema_version"], record)
    assert FAST.decode(encoded) == SLOW.decode(encoded) == expected
    scanned = codec.scan(encoded)  # the arrays located, not in the record; decoded on demand, all the same
    assert scanned.arrays and not {n for n, _, _ in scanned.arrays} & set(scanned.record)
    assert _scan_outcome(FAST, encoded) == expected
    assert list(scanned.order) == [f["name"] for f in codec.schema(event_type)["fields"]]


def test_the_numpy_decode_reads_every_varint_width_and_sign():
    ids = [0, 1, -1, 63, 64, -65, 2**31 - 1, -(2**31), 151_000, *range(-300, 300, 7)]
    record = segment(3) | {"prompt_ids": ids, "policy_versions": [2**63 - 1, -(2**63), 0]}
    encoded = codec.encode("segment", record)
    assert FAST.decode(encoded).record["prompt_ids"] == ids == SLOW.decode(encoded).record["prompt_ids"]
    assert FAST.decode(encoded).record["policy_versions"] == [2**63 - 1, -(2**63), 0]


def test_the_numpy_decode_reads_blocks_with_a_negative_count_and_their_byte_size():
    """Other Avro writers may split an array into blocks (a negative count is followed by the block's byte
    size); ours write one block, but a reader must take any."""
    encoded = codec.encode("turn", turn(prompt_ids=[5, 6, 7]))
    one_block = b"\x06\x0a\x0c\x0e\x00"  # count 3, then zigzag 5, 6, 7, end
    assert one_block in encoded
    two_blocks = b"\x03\x04\x0a\x0c" + b"\x02\x0e\x00"  # count -2 (size 2 bytes): 5, 6; count 1: 7
    split = encoded.replace(one_block, two_blocks, 1)
    assert FAST.decode(split).record["prompt_ids"] == [5, 6, 7] == SLOW.decode(split).record["prompt_ids"]


@pytest.mark.parametrize("event_type", NUMBERED)
@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=120))
def test_the_numpy_decode_refuses_what_fastavro_refuses(event_type, body):
    data = HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), codec.schema(event_type)["version"]) + body
    assert _outcome(FAST, data) == _outcome(SLOW, data)  # the same record, or both a CodecError


def test_every_truncation_of_a_large_message_is_rejected_by_the_numpy_decode():
    data = codec.encode("turn", turn(prompt_ids=list(range(400)), output_ids=list(range(300, 0, -1))))
    for length in range(0, len(data), 7):
        with pytest.raises(CodecError):
            FAST.decode(data[:length])


# Scanning (arrays located, not decoded) and batch decoding: what the segmenter reads every event with.


def _scan_outcome(reader: codec.Codec, data: bytes) -> object:
    try:
        scanned = reader.scan(data)
    except CodecError as error:
        return type(error)
    return scanned.decoded()


@pytest.mark.parametrize("event_type", NUMBERED)
@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=120))
def test_a_scan_refuses_exactly_what_a_decode_refuses(event_type, body):
    """Poison is poison whether a reader scans or decodes: the segmenter dead-letters it at once, never
    later when a rollout's bodies are decoded for cutting."""
    data = HEADER.pack(MAGIC, EVENT_TYPES.index(event_type), codec.schema(event_type)["version"]) + body
    assert _scan_outcome(FAST, data) == _outcome(SLOW, data)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_scan_refuses_a_varint_over_10_bytes_anywhere_in_an_array(position):
    """fastavro reads an 11-byte varint as some number; a scan refuses it, wherever it sits in the array,
    since the numpy decode at the cut would shift its bits past 64. A well-formed message either side
    of it is read as before."""
    record = {**SAMPLES["turn"], "output_ids": [5, 300, 7], "output_logprobs": [-0.1, -0.2, -0.3]}
    data = codec.encode("turn", record)
    ((_, start, end),) = next(blocks for name, _, blocks in codec.scan(data).arrays if name == "output_ids")
    varints = [data[start : start + 1], data[start + 1 : start + 3], data[start + 3 : end]]
    varints[position] = b"\x80" * 10 + b"\x00"
    bad = data[:start] + b"".join(varints) + data[end:]
    with pytest.raises(CodecError, match="longer than 10 bytes"):
        codec.scan(bad)
    assert codec.scan(data).decoded().record["output_ids"] == [5, 300, 7]


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data(), count=st.integers(0, 6))
def test_decode_many_is_decode_one_by_one(data, count):
    """Many messages of several types (turns, segments, number-less events) in one batch: the same records,
    each array cut back to its own message."""
    kinds = data.draw(st.lists(st.sampled_from(["turn", "segment", "session", "reward"]), min_size=count,
                               max_size=count))  # fmt: skip
    messages = [codec.encode(kind, data.draw(records(codec.schema(kind)))) for kind in kinds]
    assert codec.decode_many(messages) == [SLOW.decode(m) for m in messages]
    as_arrays = codec.decode_many(messages, arrays=True)  # numbers as numpy arrays, everything else alike
    assert [_listed(d) for d in as_arrays] == [SLOW.decode(m) for m in messages]


def _listed(decoded: Decoded) -> Decoded:
    """``decoded`` with every numpy array (int64 ids, float32/64 logprobs) turned back into a list."""
    import numpy as np

    record = {name: value.tolist() if isinstance(value, np.ndarray) else value
              for name, value in decoded.record.items()}  # fmt: skip
    arrays = [v for v in decoded.record.values() if isinstance(v, np.ndarray)]
    assert all(v.dtype in (np.int64, np.float32, np.float64) for v in arrays)
    assert bool(arrays) == any(isinstance(f["type"], dict) and f["type"].get("items") in NUMBERS
                               for f in codec.schema(decoded.event_type)["fields"])  # fmt: skip
    return Decoded(decoded.event_type, decoded.schema_version, record)


def test_scan_and_decode_many_read_split_blocks_and_older_versions():
    import fastavro

    encoded = codec.encode("turn", turn(prompt_ids=[5, 6, 7]))
    split = encoded.replace(b"\x06\x0a\x0c\x0e\x00", b"\x03\x04\x0a\x0c" + b"\x02\x0e\x00", 1)
    v1 = codec.schema("turn", 1)
    sample = turn(prompt_ids=[9, 8])
    old_record = {f["name"]: sample[f["name"]] for f in v1["fields"] if f["name"] != "schema_version"}
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), {**old_record, "schema_version": 1})
    old = HEADER.pack(MAGIC, EVENT_TYPES.index("turn"), 1) + body.getvalue()
    batch = [split, old, encoded]
    assert codec.decode_many(batch) == [SLOW.decode(m) for m in batch]
    assert codec.scan(split).decoded().record["prompt_ids"] == [5, 6, 7]
    assert codec.scan(split).item_bytes("prompt_ids", "int") == (3, b"\x0a\x0c\x0e")  # no block framing
    scanned_old = codec.scan(old)  # an older version is decoded whole: its arrays are in the record
    assert scanned_old.arrays == () and scanned_old.decoded().record["prompt_ids"] == [9, 8]
    assert scanned_old.item_bytes("prompt_ids", "int") == (2, codec.number_bytes([9, 8], "int"))
