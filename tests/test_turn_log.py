"""The prompt-reference encoding of turn events: exact round trips, clear errors when a reference is lost."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollbus.trajectory import Turn
from rollbus.turn_log import UnresolvedTurn, prompt_reference, resolve_turns


def record(turn: Turn, previous: Turn | None) -> dict:
    ref, ids = prompt_reference(turn.prompt_ids, previous)
    return {
        "chain_id": turn.chain_id, "turn_index": turn.turn_index, "prompt_ref_turn": ref, "prompt_ids": ids,
        "prompt_tokens": len(turn.prompt_ids), "output_ids": turn.output_ids,
        "output_logprobs": turn.output_logprobs, "finish_reason": turn.finish_reason,
        "policy_version": turn.policy_version,
    }  # fmt: skip


def chain(name: str, prompt: list[int], steps: list[tuple[list[int], list[int]]], *, restart_at: int = -1):
    """Turns of one chain: each prompt = previous stream + new ids (or a fresh prompt at ``restart_at``)."""
    turns, stream = [], list(prompt)
    for index, (new, output) in enumerate(steps):
        prompt_ids = list(new) if index == restart_at else stream + new if index else stream
        turns.append(Turn(prompt_ids, output, [-0.5] * len(output), "stop", 1, name, index))
        stream = prompt_ids + output
    return turns


ids = st.lists(st.integers(0, 248_000), max_size=8)


@given(prompt=ids, steps=st.lists(st.tuples(ids, ids), min_size=1, max_size=6), restart=st.integers(-1, 5))
def test_round_trip_is_exact(prompt: list[int], steps: list, restart: int) -> None:
    turns = chain("main", prompt, steps, restart_at=restart)
    records = [record(t, turns[i - 1] if i else None) for i, t in enumerate(turns)]
    assert resolve_turns(records) == turns


def test_a_continued_turn_carries_only_its_suffix() -> None:
    turns = chain("main", [1, 2, 3], [([], [4, 5]), ([6], [7])])
    second = record(turns[1], turns[0])
    assert (second["prompt_ref_turn"], second["prompt_ids"]) == (0, [6])


def test_a_rewritten_prompt_is_sent_whole() -> None:
    first = Turn([1, 2], [3], [-1.0], "stop", 1, "main", 0)
    rewritten = Turn([1, 9, 3, 4], [5], [-1.0], "stop", 1, "main", 1)
    assert prompt_reference(rewritten.prompt_ids, first) == (None, [1, 9, 3, 4])


def test_interleaved_chains_resolve_independently() -> None:
    main = chain("main", [1], [([], [2]), ([3], [4])])
    sub = chain("sub-a", [10], [([], [11]), ([12], [13])])
    records = [record(main[0], None), record(sub[0], None), record(sub[1], sub[0]), record(main[1], main[0])]
    resolved = resolve_turns(records)
    assert resolved[3] == main[1] and resolved[2] == sub[1]


def test_a_lost_reference_is_a_clear_error() -> None:
    turns = chain("main", [1], [([], [2]), ([3], [4])])
    with pytest.raises(UnresolvedTurn, match="main#1 refers to main#0"):
        resolve_turns([record(turns[1], turns[0])])


def test_a_length_mismatch_is_caught() -> None:
    turns = chain("main", [1], [([], [2]), ([3], [4])])
    bad = record(turns[1], turns[0]) | {"prompt_tokens": 99}
    with pytest.raises(UnresolvedTurn, match="99"):
        resolve_turns([record(turns[0], None), bad])


def test_chains_freeze_in_order_with_their_kinds() -> None:
    from rollbus.turn_log import frozen_chains

    def turn(chain: str, index: int) -> Turn:
        return Turn([1], [2], [-0.1], "stop", 1, chain, index)

    # main runs, dispatches a sub-agent, is compacted (main -> main.1), a title request happens on the side
    order = [turn("main", 0), turn("agent-1", 0), turn("agent-1", 1), turn("main", 1), turn("title", 0),
             turn("main.1", 0), turn("main.1", 1)]  # fmt: skip
    kinds = {"main": "main", "agent-1": "subagent", "title": "side", "main.1": "main"}
    chains = frozen_chains(order, kinds)
    assert [(c.kind, c.chain_id, len(c.turns)) for c in chains] == [
        ("subagent", "agent-1", 2), ("wipe", "main", 2), ("final", "main.1", 2),
    ]  # fmt: skip


def test_no_main_chain_means_no_final_segment() -> None:
    from rollbus.turn_log import frozen_chains

    only_side = [Turn([1], [2], [-0.1], "stop", 1, "title", 0)]
    assert frozen_chains(only_side, {"title": "side"}) == []
