"""Replay's formatting and argument handling: pure, no broker."""

from __future__ import annotations

import argparse
import json

import pytest
from aiokafka import ConsumerRecord

from rollbus.codec import CodecError, decode, encode
from rollbus.replay import add_replay_arguments, event_row, parse_since, plan_from, summarise
from tests.event_samples import SAMPLES, segment


def message(value: bytes, key: bytes | None = b"r-1") -> ConsumerRecord:
    return ConsumerRecord(
        topic="turns", partition=2, offset=41, timestamp=1_700_000_000_250, timestamp_type=0, key=key,
        value=value, checksum=None, serialized_key_size=3, serialized_value_size=len(value), headers=(),
    )  # fmt: skip


def test_long_token_arrays_are_summarised_short_ones_kept() -> None:
    record = summarise(
        {"prompt_ids": list(range(10, 20)), "output_ids": [1, 2, 3], "loss_mask": b"\x01\x01\x00\x01\x00"}
    )
    assert record["prompt_ids"] == "[10 ids: 10, 11, 12 … 19]"
    assert record["output_ids"] == [1, 2, 3]
    assert record["loss_mask"] == "[5 bytes: 1, 1, 0 … 0]"
    assert summarise([-0.25, -1.5, 0.0, -2.0, -0.123456]) == "[5 values: -0.25, -1.5, 0.0 … -0.1235]"


def test_full_keeps_every_id_and_bytes_as_base64() -> None:
    full = summarise({"ids": list(range(50)), "value": b"RB\x01"}, full=True)
    assert full == {"ids": list(range(50)), "value": "UkIB"}


def test_event_row_is_json_with_place_key_and_decoded_event() -> None:
    row = event_row(message(encode("segment", segment(2000))), decode(encode("segment", segment(2000))))
    line = json.loads(json.dumps(row))
    assert (line["topic"], line["partition"], line["offset"], line["key"]) == ("turns", 2, 41, "r-1")
    assert line["timestamp"] == "2023-11-14T22:13:20.250+00:00"
    assert line["event"]["type"] == "segment"
    assert line["event"]["record"]["response_ids"].startswith("[2000 ids: 0, 7919, 15838 … ")


def test_undecodable_message_becomes_an_error_row() -> None:
    row = event_row(message(b"junk-bytes", key=None), CodecError("bad magic"))
    assert row["error"] == "bad magic" and row["key"] is None and "event" not in row


def parse(*argv: str, command: str = "replay") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    args = parser.parse_args(argv)
    args.command = command
    return args


def test_positions_from_arguments() -> None:
    assert plan_from(parse("turns")).start == "beginning"
    assert plan_from(parse("turns", command="tail")).start == "end"
    assert plan_from(parse("turns", command="tail")).follow
    plan = plan_from(parse("turns", "--offset", "7", "--key", "r-9", "--limit", "3"))
    assert (plan.start, plan.offset, plan.key, plan.limit, plan.follow) == ("offset", 7, b"r-9", 3, False)
    since = plan_from(parse("turns", "--since", "2023-11-14T22:13:20Z"))
    assert (since.start, since.since_ms) == ("since", 1_700_000_000_000)


def test_since_without_zone_is_utc_and_garbage_is_refused() -> None:
    assert parse_since("2023-11-14T22:13:20") == 1_700_000_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="ISO time"):
        parse_since("yesterday")
    with pytest.raises(SystemExit):
        parse("turns", "--offset", "1", "--from-beginning")


def test_sample_records_all_render() -> None:
    for event_type, record in SAMPLES.items():
        decoded = decode(encode(event_type, record))
        assert json.dumps(event_row(message(encode(event_type, record)), decoded))
