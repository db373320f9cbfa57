"""A Codex stream retry is answered with the rest of the turn the cut interrupted, not with a new sample.

A turn is committed and published before it is streamed, so a stream cut mid-response leaves the client with
the output items whose ``response.output_item.done`` arrived. Codex keeps those and retries with them
appended to the same history (docs/codex-wire.md). The rest of the turn was sampled for exactly that prompt
(the same history, then our own items), so the retry gets the remaining items of the recorded turn: nothing
is generated or published again, the turn trains once, and the next request echoes the whole turn and extends
the chain as usual. Anything else (another history, a turn since, all items already delivered) is an
ordinary request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answered:
    """The last turn streamed to an agent, as a retry of its request would show it."""

    request: tuple[Any, ...]  # the request's input items, parsed
    tools: Any  # the request's tools, as sent
    echoes: tuple[Any, ...]  # the output items sent, parsed as a request would echo them
    response: dict[str, Any]  # the completed response body (its ``output``: the items sent)
    chain_id: str
    turn_count: int  # the chain's turns once this one was committed


def rest(
    answered: Answered | None, items: Sequence[Any], tools: Any, chain_id: str, turn_count: int
) -> list[dict[str, Any]] | None:
    """The output items still owed when ``items`` is the answered request plus a strict prefix of its output
    (what a cut stream delivered), and the agent's chain has not moved since; None otherwise."""
    if answered is None or (chain_id, turn_count) != (answered.chain_id, answered.turn_count):
        return None
    if tools != answered.tools:
        return None
    asked = len(answered.request)
    if tuple(items[:asked]) != answered.request:
        return None
    delivered = tuple(items[asked:])
    if len(delivered) >= len(answered.echoes) or delivered != answered.echoes[: len(delivered)]:
        return None
    return list(answered.response["output"][len(delivered) :])
