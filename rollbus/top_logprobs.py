"""Each sampled token's top-k alternatives (SGLang's ``top_logprobs_num``), stored compactly beside the
sampled logprobs: what objectives that need the sampler's support per token (score centering) read in the
trainer.

One Avro ``bytes`` value per turn (``turns.output_top_logprobs``) or segment (``segments.top_logprobs``):
``k`` as a little-endian uint32, then ``n x k`` token ids (int32) and ``n x k`` logprobs (float32), row-major,
``n`` the turn's output tokens or the segment's response tokens, each row best first. A position with fewer
than ``k`` alternatives (context tokens in a segment, a turn sampled without them) is padded with id -1 and
logprob 0.0. Null when no top-k was asked for: at k = 0 an event carries one byte more than before, nothing
else.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PAD_ID = -1
_K = struct.Struct("<I")


class BadTopLogprobs(ValueError):
    """A top-k value that does not fit its tokens; the message says why."""


def pack(ids: np.ndarray, logprobs: np.ndarray) -> bytes:
    """``ids`` and ``logprobs`` of shape ``[n, k]`` as one value."""
    if ids.ndim != 2 or ids.shape != logprobs.shape:
        raise BadTopLogprobs(f"ids {ids.shape} and logprobs {logprobs.shape} must be the same [n, k]")
    k = ids.shape[1]
    return _K.pack(k) + ids.astype("<i4").tobytes() + logprobs.astype("<f4").tobytes()


def unpack(value: bytes, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [tokens, k] int32, logprobs [tokens, k] float32)`` of a value; :class:`BadTopLogprobs` when its
    length does not hold ``tokens`` rows."""
    if len(value) < _K.size:
        raise BadTopLogprobs(f"{len(value)} bytes hold no k")
    (k,) = _K.unpack_from(value)
    if len(value) != _K.size + 8 * tokens * k:
        raise BadTopLogprobs(f"{len(value)} bytes are not {tokens} tokens x top {k}")
    cut = _K.size + 4 * tokens * k
    ids = np.frombuffer(value, "<i4", tokens * k, _K.size).reshape(tokens, k)
    logprobs = np.frombuffer(value, "<f4", tokens * k, cut).reshape(tokens, k)
    return ids, logprobs


def from_sglang(rows: Any, k: int, tokens: int) -> bytes:
    """SGLang's ``meta_info["output_top_logprobs"]`` (per output token, a list of ``[logprob, id, text]``)
    packed; rows shorter than ``k`` are padded. :class:`BadTopLogprobs` when it is not that shape."""
    if not isinstance(rows, list) or len(rows) != tokens:
        given = len(rows) if isinstance(rows, list) else "no"
        raise BadTopLogprobs(f"{given} rows for {tokens} output tokens")
    ids = np.full((tokens, k), PAD_ID, np.int64)
    logprobs = np.zeros((tokens, k), np.float64)
    try:
        for i, row in enumerate(rows):
            for j, item in enumerate((row or [])[:k]):
                logprobs[i, j], ids[i, j] = float(item[0]), int(item[1])
    except (TypeError, ValueError, IndexError) as exc:
        raise BadTopLogprobs(f"an entry is not [logprob, id, ...]: {exc}") from None
    return pack(ids, logprobs)


def chain_top_logprobs(records: Sequence[Mapping[str, Any]], response_tokens: int) -> bytes | None:
    """A canonical chain's turns' top-k laid over its segment's response (each turn's output starts at its
    ``prompt_tokens`` minus the first turn's; context between outputs is padding), or None when no turn
    carries any. ``k`` is the largest of the turns'; a turn without top-k, or whose value does not fit its
    output, is padding (its tokens still train on their sampled logprobs)."""
    found = [record.get("output_top_logprobs") for record in records]
    if not any(found):
        return None
    unpacked = []
    for record, value in zip(records, found, strict=True):
        try:
            unpacked.append(unpack(value, len(record["output_ids"])) if value else None)
        except BadTopLogprobs:
            unpacked.append(None)
    k = max((u[0].shape[1] for u in unpacked if u is not None), default=0)
    ids = np.full((response_tokens, k), PAD_ID, np.int32)
    logprobs = np.zeros((response_tokens, k), np.float32)
    base = int(records[0]["prompt_tokens"])
    for record, turn in zip(records, unpacked, strict=True):
        if turn is None:
            continue
        start = int(record["prompt_tokens"]) - base
        rows, width = turn[0].shape
        if start < 0 or start + rows > response_tokens:
            continue
        ids[start : start + rows, :width] = turn[0]
        logprobs[start : start + rows, :width] = turn[1]
    return pack(ids, logprobs)
