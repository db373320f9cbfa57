"""Replay's formatting and argument handling: pure, no broker."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from aiokafka import ConsumerRecord

from rollbus.codec import CodecError, decode, encode
from rollbus.commands.replay import add_replay_arguments, plan_from, table_row, where
from rollbus.kafka.replay import ReadPlan, event_row, parse_since, summarise
from rollbus.tables import TableWriter, cells, header
from tests.event_samples import AT, SAMPLES, segment


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


LONG_ID = "rollout-[list[float]]-" + "0123456789abcdef" * 4  # longer than any column, with brackets
TABLE_EXPECTATIONS = {  # event type -> (columns that must be there, cells that must be in its row)
    "turn": (("rollout", "chain", "turn", "prompt tokens", "new suffix", "sampled", "finish", "policy"),
             (LONG_ID, "a-1", "main", "40", "3", "stop")),
    "session": (("rollout", "chain", "event", "chain kind", "reason", "turns", "parent chain"),
                (LONG_ID, "sub-1", "frozen", "subagent", "5", "main")),
    "diff": (("rollout", "exit", "turns", "wall s", "patch", "failure kind"), (LONG_ID, "81.2", "2 lines")),
    "reward": (("rollout", "reward", "solved", "applied", "failure kind", "flags", "tests passed"),
               (LONG_ID, "1", "yes", "1/1")),
    "segment": (("segment", "rollout", "chain", "index/K", "kind", "prompt", "response", "trained", "reward"),
                ("r-1/0", LONG_ID, "0/2", "wipe", "0.5")),
    "task": (("rollout", "group", "sample", "label", "prompt"), (LONG_ID, "g-1", "0/4")),
    "policy": (("version", "location", "published (UTC)"),
               ("8", "/ckpt/policy-8", "2023-11-14T22:13:20.000")),
    "train_step": (("step", "version", "groups", "segments", "tokens", "reward", "loss", "stale max",
                    "|dlogp| max", "kl"), ("8", "1", "3", "900", "0.5", "-0.0125", "0.0005")),
    "dead_letter": (("source", "partition", "offset", "key", "service", "error"),
                    ("turns", "12345", "r-1", "segmenter", "CodecError: turn v1 body is undecodable")),
}  # fmt: skip


def render_table(event_type: str, records: list[dict], stream: bool = False) -> list[str]:
    out = io.StringIO()
    table = TableWriter(out, header(event_type), stream=stream)
    for offset, record in enumerate(records):
        decoded = decode(encode(event_type, record))
        key = record.get("rollout_id")
        table.add(cells(event_type, (0, offset, AT), key, decoded.event_type, decoded.record))
    table.close()
    return out.getvalue().splitlines()


@pytest.mark.parametrize("event_type", sorted(SAMPLES))
def test_every_topic_has_a_table_showing_what_matters_with_ids_whole(event_type: str) -> None:
    record = {**SAMPLES[event_type]}
    if "rollout_id" in record:
        record["rollout_id"] = LONG_ID
    head, row = render_table(event_type, [record])
    columns, values = TABLE_EXPECTATIONS[event_type]
    for column in ("p", "offset", "time (UTC)", *columns):
        assert column in head, f"{event_type} table lacks column {column!r}"
    for value in values:
        assert f" {value} " in f" {row} ", f"{event_type} row lacks {value!r}: {row}"
    assert "…" not in row.replace(record.get("prompt", ""), "")


@pytest.mark.parametrize("stream", [False, True])
def test_rows_line_up_under_their_header_and_never_wrap(stream: bool) -> None:
    records = [SAMPLES["turn"], {**SAMPLES["turn"], "rollout_id": LONG_ID, "chain_id": "c-" + "9" * 150}]
    lines = render_table("turn", records, stream=stream)
    assert len(lines) == 3  # header + one line per event, however long
    assert lines[2].count("c-" + "9" * 150) == 1
    if not stream:  # held rows are aligned as a whole: every column starts where its header does
        start = lines[0].index("finish")
        assert lines[1][start:].startswith("stop") and lines[2][start:].startswith("stop")


BRACKETED = "list[float] [bold]not bold[/bold] [red]x[/red] [/]"  # shorter than a cut


def test_brackets_survive_every_output_format() -> None:
    """Event text is data: neither the JSON lines nor any topic's table interprets it as markup."""
    task = {**SAMPLES["task"], "rollout_id": "r-[1]", "prompt": BRACKETED}
    value = encode("task", task)
    row = event_row(message(value, key=b"r-[1]"), decode(value))
    assert json.loads(json.dumps(row))["event"]["record"]["prompt"] == BRACKETED
    (_, line) = render_table("task", [task])
    assert BRACKETED in line and "r-[1]" in line
    for event_type in SAMPLES:  # a bracketed key on every topic's table, and in the generic fallback
        record = {**SAMPLES[event_type]}
        if "rollout_id" in record:
            record["rollout_id"] = "[bold]r[/bold]"
            assert "[bold]r[/bold]" in render_table(event_type, [record])[1]
    generic = cells("unknown", (0, 0, AT), "[k]", "turn", {"note": "[i]x[/i]"})
    assert generic[3:] == ["[k]", "turn", "note=[i]x[/i]"]


def test_undecodable_message_in_a_table_says_why_and_keeps_its_key() -> None:
    row = table_row(message(b"junk", key=b"r-[9]"), CodecError("bad magic [x]"), "turn")
    assert row[:2] == ["2", "41"] and row[3] == "undecodable (key r-[9]): bad magic [x]"


def test_reading_plan_is_said_in_words_for_stderr() -> None:
    assert where(ReadPlan("turns")) == "turns from the beginning"
    assert where(ReadPlan("turns", "end", key=b"r-1")) == "turns from the end with key r-1"
    assert where(ReadPlan("t.turns", "offset", offset=7)) == "t.turns from offset 7"
