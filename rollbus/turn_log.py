"""Turn events on the bus <-> :class:`~rollbus.trajectory.Turn`: the prompt-reference encoding.

A chain's prompt at turn t usually extends the stream (prompt + output) of turn t-1, so a ``turn`` event
carries only the new suffix plus ``prompt_ref_turn``; bytes per rollout then grow with its tokens, not with
the square of its turns. Writers and readers share these two functions so the encoding has one definition.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rollbus.codec import Scanned, Varints, number_bytes
from rollbus.events import TurnEvent
from rollbus.trajectory import (
    CONTEXT_VERSION,
    ChainTokens,
    FrozenChain,
    SegmentKind,
    Turn,
    aligned,
    segment_chain,
)

TurnKey = tuple[str, str, int]  # (attempt_id, chain_id, turn_index): a turn's identity within its rollout


class UnresolvedTurn(ValueError):
    """A turn refers to a turn of its chain that was not seen (lost, or read out of order)."""


class ConflictingTurn(ValueError):
    """Two turn events share an identity but not their content: a writer bug or a forged event."""


def prompt_reference(prompt_ids: Sequence[int], previous: Turn | None) -> tuple[int | None, list[int]]:
    """``(prompt_ref_turn, prompt_ids)``: only the suffix when ``previous``'s stream prefixes the prompt.

    Checked on the tokens themselves, so a reader that resolves the reference gets the exact prompt.
    """
    if previous is None or previous.turn_index is None:
        return None, list(prompt_ids)
    stream = [*previous.prompt_ids, *previous.output_ids]
    if len(stream) <= len(prompt_ids) and list(prompt_ids[: len(stream)]) == stream:
        return previous.turn_index, list(prompt_ids[len(stream) :])
    return None, list(prompt_ids)


def turn_key(record: Mapping[str, Any]) -> TurnKey:
    """A turn event's identity within its rollout (:class:`~rollbus.events.TurnEvent`'s declared key but its
    rollout id); two events with one key describe one model call."""
    attempt_id, chain_id, turn_index = TurnEvent.key_of(record, within=("rollout_id",))
    return attempt_id, chain_id, turn_index


TURN_NUMBERS = (("prompt_ids", "int"), ("output_ids", "int"), ("output_logprobs", "float"))


def turn_digest(record: Mapping[str, Any], scanned: Scanned | None = None) -> str:
    """A stable digest of what a turn event says (all but its schema version and timings).

    Stable across processes (it is kept in the segmenter's changelog) and cheap on long token lists: the
    token arrays are hashed as their Avro bytes (:func:`~rollbus.codec.number_bytes`), so the segmenter,
    which only scans a turn (``scanned``, whose ``record`` lacks them), hashes the bytes as they arrived
    and decodes no token; a decoded record gives the same digest. Timings are left out: a writer's retry
    of one call may stamp them again, the tokens cannot change. 24 hex digits (the v1 digest,
    :func:`turn_digest_v1`, has 32, so a state kept before this one is recognised): 96 bits, so passing a
    changed turn off as a retry would take a second preimage of blake2b.
    """
    h = _header_hash(record, digest_size=12)
    for name, items in TURN_NUMBERS:
        if scanned is None:
            count, raw = len(record[name]), number_bytes(record[name], items)
        else:
            count, raw = scanned.item_bytes(name, items)
        h.update(struct.pack(">q", count))
        h.update(raw)
    return h.hexdigest()


def _header_hash(record: Mapping[str, Any], digest_size: int) -> Any:
    """A blake2b fed with everything a turn digest covers but the token arrays."""
    h = hashlib.blake2b(digest_size=digest_size)
    ref = record.get("prompt_ref_turn")
    ref = -1 if ref is None else ref
    h.update(struct.pack(">qqq", ref, record["prompt_tokens"], record["policy_version"]))
    for text in (record.get("chain_kind", ""), record["finish_reason"], record.get("request_id", "")):
        h.update(text.encode() + b"\x00")
    routes = record.get("routed_experts")
    if routes is not None:  # absent (every turn before v3) hashes as before: kept digests stay valid
        h.update(b"routed_experts\x00" + routes["digest"].encode() + routes["dtype"].encode() + b"\x00")
        h.update(struct.pack(">qqq", routes["start"], routes["rows"], routes["width"]))
    top = record.get("output_top_logprobs")
    if top is not None:  # absent (k = 0, every turn before v4) hashes as before
        h.update(b"output_top_logprobs\x00" + struct.pack(">q", len(top)) + bytes(top))
    return h


def turn_digest_v1(record: Mapping[str, Any]) -> str:
    """The digest segmenter states kept before :func:`turn_digest` (numbers as int64/float32 machine
    bytes): only to recognise a redelivered turn against such a state after an upgrade."""
    h = _header_hash(record, digest_size=16)
    for ids in (record["prompt_ids"], record["output_ids"]):
        h.update(struct.pack(">q", len(ids)))
        h.update(array("q", ids).tobytes())
    h.update(array("f", record["output_logprobs"]).tobytes())
    return h.hexdigest()


class TurnResolver:
    """Streaming reader of turn events: full turns out, exact duplicates dropped (counted), conflicts raised.

    Every reader of ``turns`` goes through this so all agree on what a duplicate is. Identity is
    :func:`turn_key`; a second event with the same key and the same :func:`turn_digest` is a writer's
    retry and is dropped, one with another digest raises :class:`ConflictingTurn`.
    """

    def __init__(self) -> None:
        self.duplicates = 0
        self._digests: dict[TurnKey, str] = {}
        self._turns: dict[TurnKey, Turn] = {}

    def add(self, record: Mapping[str, Any]) -> Turn | None:
        """The resolved turn, or None for an exact duplicate of one already added."""
        key, digest = turn_key(record), turn_digest(record)
        known = self._digests.get(key)
        if known is not None:
            if known != digest:
                raise ConflictingTurn(f"turn {describe(key)} was sent twice with different content")
            self.duplicates += 1
            return None
        turn = self._resolve(key, record)
        self._digests[key] = digest
        self._turns[key] = turn
        return turn

    def _resolve(self, key: TurnKey, record: Mapping[str, Any]) -> Turn:
        attempt, chain, index = key
        ref = record["prompt_ref_turn"]
        prompt = list(record["prompt_ids"])
        if ref is not None:
            base = self._turns.get((attempt, chain, ref))
            if base is None:
                raise UnresolvedTurn(f"turn {chain}#{index} refers to {chain}#{ref}, which was not seen")
            prompt = base.prompt_ids + base.output_ids + prompt
        check_prompt_tokens(key, len(prompt), record["prompt_tokens"])
        return Turn(
            prompt_ids=prompt,
            output_ids=list(record["output_ids"]),
            output_logprobs=list(map(float, record["output_logprobs"])),
            finish_reason=record["finish_reason"],
            policy_version=record["policy_version"],
            chain_id=chain,
            turn_index=index,
        )


def describe(key: TurnKey) -> str:
    attempt, chain, index = key
    return f"{chain}#{index}" + (f" of attempt {attempt}" if attempt else "")


def check_prompt_tokens(key: TurnKey, resolved: int, recorded: int) -> None:
    if resolved != recorded:
        raise UnresolvedTurn(
            f"turn {describe(key)}: resolved prompt has {resolved} tokens, record says {recorded}"
        )


def iter_turns(records: Iterable[Mapping[str, Any]], resolver: TurnResolver | None = None) -> Iterator[Turn]:
    """Full turns from ``turn`` records in bus order, exact duplicates dropped (see :class:`TurnResolver`)."""
    resolver = resolver or TurnResolver()
    for record in records:
        turn = resolver.add(record)
        if turn is not None:
            yield turn


def resolve_turns(records: Iterable[Mapping[str, Any]]) -> list[Turn]:
    """Rebuild full turns from ``turn`` records in bus order (per chain, references point backwards)."""
    return list(iter_turns(records))


def chain_tokens(records: Sequence[Mapping[str, Any]]) -> ChainTokens:
    """One canonical chain's records (in turn order) stitched straight from the reference encoding.

    When every turn after the first refers to the one before it (what a canonical writer sends), the
    chain's response is the references' suffixes interleaved with the outputs: built in time linear in
    the chain's tokens, no prompt is ever resolved. Any other shape falls back to resolving and
    :func:`~rollbus.trajectory.segment_chain`. Equal to ``segment_chain(resolve_turns(records))``.
    """
    if not _linked(records):
        return segment_chain(resolve_turns(records))
    first = records[0]
    check_prompt_tokens(turn_key(first), len(first["prompt_ids"]), first["prompt_tokens"])
    tokens = ChainTokens(prompt_ids=list(first["prompt_ids"]))
    stream = len(tokens.prompt_ids)
    for index, record in enumerate(records):
        if index:
            check_prompt_tokens(turn_key(record), stream + len(record["prompt_ids"]), record["prompt_tokens"])
            tokens.append_context(record["prompt_ids"])
        tokens.append_output(_turn_view(record))
        stream = len(tokens.prompt_ids) + len(tokens.response_ids)
    return tokens


def _linked(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every turn after the first refers to the one before it (what a canonical writer sends)."""
    if not records:
        raise ValueError("a chain needs at least one turn")
    return records[0]["prompt_ref_turn"] is None and all(
        later["prompt_ref_turn"] == earlier["turn_index"]
        for earlier, later in zip(records, records[1:], strict=False)
    )


def chain_arrays(records: Sequence[Mapping[str, Any]]) -> ChainTokens:
    """:func:`chain_tokens` as numpy arrays (ids and versions int64, logprobs float32, mask uint8): what the
    segmenter cuts, so no token of a linked chain ever becomes a Python object. The records' token arrays
    may be lists, numpy arrays (``decode_many(..., arrays=True)``) or, for ids, :class:`Varints`
    (``decode_scans(..., varints=True)``): a linked chain's ids are then spliced as the bytes they arrived
    as, never decoded. Equal, item for item, to :func:`chain_tokens`; a chain that is not linked is
    stitched by it, then converted."""
    if not _linked(records):
        tokens = chain_tokens([_decoded_ids(record) for record in records])
        return _finished(
            _ids(tokens.prompt_ids),
            _ids(tokens.response_ids),
            np.asarray(tokens.loss_mask, np.uint8),
            np.asarray(tokens.rollout_logprobs, np.float32),
            np.asarray(tokens.policy_versions, np.int64),
            tokens.output_spans,
            tokens.misaligned_tokens,
        )
    first = records[0]
    prompt = _ids(first["prompt_ids"])
    check_prompt_tokens(turn_key(first), len(prompt), first["prompt_tokens"])
    # the response's pieces, each a run of one mask value and one policy version: the per-token arrays are
    # built once at the end (np.repeat), not a few small arrays a turn
    ids: list[Any] = []
    lengths: list[int] = []
    masks: list[int] = []
    versions: list[int] = []
    logprobs: list[Any] = []  # None: zeros (context, or an output whose logprobs do not line up)
    spans, length, misaligned = [], 0, 0  # length: of the response so far
    for index, record in enumerate(records):
        if index:
            context = _ids(record["prompt_ids"])
            length += len(context)
            check_prompt_tokens(turn_key(record), len(prompt) + length, record["prompt_tokens"])
            ids.append(context)
            lengths.append(len(context))
            masks.append(0)
            versions.append(CONTEXT_VERSION)
            logprobs.append(None)
        output = _ids(record["output_ids"])
        count = len(output)
        if not count:
            continue
        trained = aligned(count, len(record["output_logprobs"]), record["turn_index"], record["chain_id"])
        if not trained:
            misaligned += count
        ids.append(output)
        lengths.append(count)
        masks.append(int(trained))
        versions.append(record["policy_version"])
        logprobs.append(record["output_logprobs"] if trained else None)
        spans.append((length, length + count))
        length += count
    zeros = np.zeros(max(lengths, default=0), np.float32)
    as_read = zip(logprobs, lengths, strict=True)
    pieces = [zeros[:n] if lp is None else np.asarray(lp, np.float32) for lp, n in as_read]
    return _finished(
        prompt,
        _joined_ids(ids),
        np.repeat(np.array(masks, np.uint8), lengths),
        np.concatenate(pieces) if pieces else np.empty(0, np.float32),
        np.repeat(np.array(versions, np.int64), lengths),
        spans,
        misaligned,
    )


def _finished(
    prompt: Varints | np.ndarray,
    response: Varints | np.ndarray,
    mask: np.ndarray,
    logprobs: np.ndarray,
    versions: np.ndarray,
    spans: list[tuple[int, int]],
    misaligned: int,
) -> ChainTokens:
    """A finished :class:`ChainTokens`, whose fields are arrays (its docstring); the class annotates them as
    the lists a chain is built from turn by turn, which this form is never appended to."""
    fields = (prompt, response, mask, logprobs, versions, spans, misaligned)
    return ChainTokens(*fields)  # type: ignore[arg-type]  # the arrays above stand where lists are declared


def _ids(ids: Any) -> Varints | np.ndarray:
    """Token ids as they came if they are bytes (:class:`Varints`), else an int64 array."""
    return ids if isinstance(ids, Varints) else np.asarray(ids, np.int64)


def _joined_ids(pieces: list[Any]) -> Varints | np.ndarray:
    """Pieces of ids one after another: spliced as bytes when all are :class:`Varints` (a rollout's bodies of
    one schema version), else decoded and concatenated."""
    if pieces and all(isinstance(piece, Varints) for piece in pieces):
        return Varints.join(pieces)
    arrays = [p.values() if isinstance(p, Varints) else np.asarray(p, np.int64) for p in pieces]
    return np.concatenate(arrays) if arrays else np.empty(0, np.int64)


def _decoded_ids(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """``record`` with ids given as :class:`Varints` decoded (for the stitching that compares tokens)."""
    if not any(isinstance(value, Varints) for value in record.values()):
        return record
    return {name: value.values() if isinstance(value, Varints) else value for name, value in record.items()}


def _turn_view(record: Mapping[str, Any]) -> Turn:
    """A Turn carrying only what :meth:`ChainTokens.append_output` reads (no prompt)."""
    return Turn(
        prompt_ids=[],
        output_ids=list(record["output_ids"]),
        output_logprobs=list(map(float, record["output_logprobs"])),
        finish_reason=record["finish_reason"],
        policy_version=record["policy_version"],
        chain_id=record["chain_id"],
        turn_index=record["turn_index"],
    )


def frozen_chains(turns: list[Turn], chain_kinds: Mapping[str, str]) -> list[FrozenChain]:
    """A rollout's turns grouped into chains, in the order they froze, with their segment kind.

    ``chain_kinds`` maps chain id -> ``main|subagent|side`` (from the turn events). Sub-agent chains become
    ``subagent`` segments; every main chain but the newest was frozen by a history rewrite (``wipe``); the
    newest main chain is the ``final`` tail. Side chains (titles, token counts) never train. A chain froze
    when its last turn was taken, so that orders them; the final tail comes last.
    """
    by_chain: dict[str, list[Turn]] = {}
    last_seen: dict[str, int] = {}
    for position, turn in enumerate(turns):
        chain = turn.chain_id or "main"
        by_chain.setdefault(chain, []).append(turn)
        last_seen[chain] = position
    mains = [c for c in by_chain if chain_kinds.get(c, "main") == "main"]
    final = max(mains, key=last_seen.__getitem__) if mains else None
    chains = []
    for chain in sorted(by_chain, key=last_seen.__getitem__):
        kind = chain_kinds.get(chain, "main")
        if kind == "side" or chain == final:
            continue
        segment_kind: SegmentKind = "subagent" if kind == "subagent" else "wipe"
        chains.append(FrozenChain(segment_kind, by_chain[chain], chain_id=chain))
    if final is not None:
        chains.append(FrozenChain("final", by_chain[final], chain_id=final))
    return chains
