"""Encode and decode a 96k-token segment: rollbus.codec (fastavro) against avro-python3, same run.

Run: ``python bench/codec.py [--tokens N] [--repeats N]``. Prints the median time of each side and
the ratio avro-python3 / rollbus.codec. The codec's encode includes its record checks and header,
so the comparison is what a service actually pays per message.
"""

from __future__ import annotations

import argparse
import io
import json

import avro.io
import avro.schema
import fastavro
from fastavro.validation import validate
from timing import median_seconds

from rollbus import codec
from rollbus.codec import HEADER


def segment(tokens: int) -> dict:
    """A segment like the segmenter cuts: long response, mostly sampled, tool output every fifth block."""
    mask = bytes(0 if (i // 500) % 5 == 4 else 1 for i in range(tokens))
    return {
        "segment_id": "r-1/0", "rollout_id": "r-1", "group_id": "g-1", "index": 0, "num_segments": 1,
        "kind": "final", "prompt_ids": [(i * 31) % 151_000 for i in range(2_000)],
        "response_ids": [(i * 7919) % 151_000 for i in range(tokens)], "loss_mask": mask,
        "rollout_logprobs": [-(i % 97) / 8 for i in range(tokens)], "reward": 1.0, "trajectory_reward": 1.0,
        "policy_versions": [12 if m else -1 for m in mask], "created_at": 1_700_000_000_000,
        "attempt_id": "a-1", "chain_id": "main", "infos": "[]",
        "schema_version": codec.schema("segment")["version"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96_000, help="response tokens in the segment")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions per operation")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8k tokens, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 8_000, 3

    record = segment(args.tokens)
    reference_schema = avro.schema.parse(json.dumps(codec.schema("segment")))
    writer, reader = avro.io.DatumWriter(reference_schema), avro.io.DatumReader(reference_schema)

    def reference_encode() -> bytes:
        buffer = io.BytesIO()
        writer.write(record, avro.io.BinaryEncoder(buffer))
        return buffer.getvalue()

    def reference_decode() -> dict:
        return reader.read(avro.io.BinaryDecoder(io.BytesIO(theirs)))

    ours = codec.encode("segment", record)
    theirs = reference_encode()
    assert ours[HEADER.size:] == theirs, "the two implementations disagree on the bytes"

    timings = {
        "encode": (median_seconds(lambda: codec.encode("segment", record), args.repeats),
                   median_seconds(reference_encode, args.repeats)),
        "decode": (median_seconds(lambda: codec.decode(ours), args.repeats),
                   median_seconds(reference_decode, args.repeats)),
    }
    parsed = fastavro.parse_schema(codec.schema("segment"))
    validation = median_seconds(lambda: validate(record, parsed), args.repeats)
    ours_codec = codec.default_codec()
    current = ours_codec._get("segment", None)
    check = median_seconds(lambda: ours_codec._check("segment", current, dict(record)), args.repeats)
    print(f"segment: {args.tokens} response tokens, {len(ours) / 1e6:.2f} MB on the wire, "
          f"median of {args.repeats} runs")
    print(f"{'op':<8}{'rollbus.codec':>16}{'avro-python3':>16}{'ratio':>10}")
    for op, (fast, reference) in timings.items():
        print(f"{op:<8}{fast * 1e3:>13.1f} ms{reference * 1e3:>13.1f} ms{reference / fast:>9.1f}x")
    print(f"(rollbus.codec encode includes {check * 1e3:.1f} ms of record checks; fastavro's validator "
          f"alone would take {validation * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
