"""Turn events on the bus <-> :class:`~rollbus.trajectory.Turn`: the prompt-reference encoding.

A chain's prompt at turn t usually extends the stream (prompt + output) of turn t-1, so a ``turn`` event
carries only the new suffix plus ``prompt_ref_turn``; bytes per rollout then grow with its tokens, not with
the square of its turns. Writers and readers share these two functions so the encoding has one definition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollbus.trajectory import FrozenChain, Turn


class UnresolvedTurn(ValueError):
    """A turn refers to a turn of its chain that was not seen (lost, or read out of order)."""


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


def resolve_turns(records: Iterable[Mapping[str, Any]]) -> list[Turn]:
    """Rebuild full turns from ``turn`` records in bus order (per chain, references point backwards)."""
    seen: dict[tuple[str, int], Turn] = {}
    turns: list[Turn] = []
    for record in records:
        chain, index, ref = record["chain_id"], record["turn_index"], record["prompt_ref_turn"]
        prompt = list(record["prompt_ids"])
        if ref is not None:
            base = seen.get((chain, ref))
            if base is None:
                raise UnresolvedTurn(f"turn {chain}#{index} refers to {chain}#{ref}, which was not seen")
            prompt = base.prompt_ids + base.output_ids + prompt
        if len(prompt) != record["prompt_tokens"]:
            raise UnresolvedTurn(
                f"turn {chain}#{index}: resolved prompt has {len(prompt)} tokens, record says "
                f"{record['prompt_tokens']}"
            )
        turn = Turn(
            prompt_ids=prompt,
            output_ids=list(record["output_ids"]),
            output_logprobs=[float(x) for x in record["output_logprobs"]],
            finish_reason=record["finish_reason"],
            policy_version=record["policy_version"],
            chain_id=chain,
            turn_index=index,
        )
        seen[(chain, index)] = turn
        turns.append(turn)
    return turns


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
        segment_kind = "subagent" if kind == "subagent" else "wipe"
        chains.append(FrozenChain(segment_kind, by_chain[chain], chain_id=chain))
    if final is not None:
        chains.append(FrozenChain("final", by_chain[final], chain_id=final))
    return chains
