"""The segmenter's state machine: any interleaving of a rollout's events, with duplicates, cuts the same
segments (those fan_out cuts from the writer's own chains); conflicts, late events and timeouts are named."""

from __future__ import annotations

import io
import json
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollbus.codec import HEADER, MAGIC, Varints, decode, decode_many, decode_scans, encode, scan, schema
from rollbus.events import EVENT_TYPES, spec
from rollbus.services.segmenter.segmentation import (
    FACT_KINDS,
    ChainFacts,
    Fact,
    Options,
    RolloutState,
    Segmenter,
    apply,
    complete,
    decode_fact,
    missing,
    segment_id,
)
from rollbus.trajectory import ChainBroken, ChainTokens, apply_loss_scope, fan_out, trains
from rollbus.turn_log import ConflictingTurn, TurnResolver, chain_arrays, chain_tokens, resolve_turns
from tests.synthetic_rollouts import Event, RolloutWriter, simple_rollout

TOPIC_EVENT = {e.topic: e.event_type for e in (spec("turn"), spec("session"), spec("diff"), spec("reward"))}


def run(events: list[Event], segmenter: Segmenter | None = None) -> tuple[Segmenter, list[dict], list[str]]:
    """Feed events (at = position) through a dict-backed segmenter as the worker does (read off the wire by
    :func:`decode_fact`: turns scanned, not decoded); segments as published (decoded from the outcome's
    messages) and dead-letter reasons."""
    segmenter = segmenter or Segmenter({}, {})
    segments, dead = [], []
    for at, (topic, record) in enumerate(events):
        raw = record if isinstance(record, bytes) else encode(TOPIC_EVENT[topic], record)  # bytes: as forged
        key = decode(raw).record["rollout_id"].encode()
        outcome = segmenter.handle(decode_fact(topic, raw, key, at), raw)
        assert len(outcome.messages) == len(outcome.segments)
        segments += [decode(message).record for message in outcome.messages]
        dead += [outcome.dead_letter] if outcome.dead_letter else []
        segmenter.settle(outcome)
    return segmenter, segments, dead


def expected(writer: RolloutWriter, reward: float, scope: str = "all_turns") -> list[dict[str, Any]]:
    cut = fan_out(writer.expected_chains(), writer.rollout_id, reward, loss_scope=scope)  # type: ignore[arg-type]
    return [
        {"segment_id": segment_id(writer.rollout_id, writer.attempt_id, s.index), "kind": s.kind,
         "chain_id": s.chain_id, "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
         "loss_mask": bytes(s.loss_mask), "reward": s.reward, "trajectory_reward": reward,
         "policy_versions": s.policy_versions, "num_segments": s.num_segments}
        for s in cut
    ]  # fmt: skip


def comparable(segments: list[dict]) -> list[dict]:
    keys = ("segment_id", "kind", "chain_id", "prompt_ids", "response_ids", "loss_mask", "reward",
            "trajectory_reward", "policy_versions", "num_segments")  # fmt: skip
    return [{k: s[k] for k in keys} for s in segments]


def test_a_rollout_is_cut_like_fan_out_of_its_chains() -> None:
    writer = simple_rollout("r1")
    segmenter, segments, dead = run(writer.events)
    assert dead == []
    assert comparable(segments) == expected(writer, 1.0)
    assert [s["kind"] for s in segments] == ["subagent", "wipe", "final"]
    assert {s["group_id"] for s in segments} == {"g1"} and sum(
        s["reward"] for s in segments
    ) == pytest.approx(1)
    assert segmenter.bodies == {}  # bodies deleted once the segments are out
    assert RolloutState.from_bytes(segmenter.states["r1"]).status == "emitted"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[RolloutWriter, list[Event], float]:
    """One or two attempts of a rollout with random agent behaviour; the last attempt is rewarded."""
    events: list[Event] = []
    attempts = draw(st.integers(1, 2))
    for number in range(attempts):
        w = RolloutWriter("r", attempt_id=f"a{number}")
        w.turn(
            "main", "main", draw(st.lists(st.integers(0, 9), min_size=1, max_size=5)), draw(st.integers(0, 4))
        )
        chain = "main"
        for op in draw(
            st.lists(st.sampled_from(["main", "sub", "sub_live", "compact", "side", "curl"]), max_size=7)
        ):
            if op == "main":
                w.turn(chain, "main", draw(st.lists(st.integers(0, 9), max_size=3)), draw(st.integers(0, 4)))
            elif op in ("sub", "sub_live") and f"agent-{len(w.frozen)}" not in w.live:
                name = f"agent-{len(w.frozen)}"
                for _ in range(draw(st.integers(1, 3))):
                    w.turn(name, "subagent", [7], draw(st.integers(1, 3)))
                if op == "sub":
                    w.freeze(name, "subagent")
            elif op == "compact":
                w.freeze(chain, "compaction")
                chain = f"main.{len(w.frozen)}"
                w.turn(chain, "main", [1, 2], draw(st.integers(1, 3)), fresh=True)
            elif op == "side":
                w.turn(f"side-{len(w.events)}", "side", [9], 2)
            else:
                w.turn(f"curl-{len(w.events)}", "unattributed", [5], 1)
        w.close()
        w.diff()
        events += w.events
    reward = draw(st.sampled_from([0.0, 1.0, 0.5]))
    w.reward(reward)
    events.append(w.events[-1])
    return w, events, reward


def interleave(rng: random.Random, events: list[Event], duplicates: int) -> list[Event]:
    """A random merge of the per-topic streams (each keeps its order, as a Kafka partition does), then
    copies of random events placed anywhere after their original."""
    streams: dict[str, list[Event]] = {}
    for event in events:
        streams.setdefault(event[0], []).append(event)
    merged: list[Event] = []
    while streams:
        topic = rng.choice(sorted(streams))
        merged.append(streams[topic].pop(0))
        if not streams[topic]:
            del streams[topic]
    for _ in range(duplicates):
        at = rng.randrange(len(merged))
        merged.insert(rng.randint(at + 1, len(merged)), merged[at])
    return merged


@settings(max_examples=60, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 2**32), duplicates=st.integers(0, 6))
def test_any_interleaving_with_duplicates_cuts_the_same_segments(
    scenario, seed: int, duplicates: int
) -> None:
    writer, events, reward = scenario
    order = interleave(random.Random(seed), events, duplicates)
    segmenter, segments, dead = run(order)
    assert dead == []
    assert comparable(segments) == expected(writer, reward)  # only the rewarded (last) attempt trains
    assert {s["attempt_id"] for s in segments} <= {writer.attempt_id}
    assert segmenter.counts.get("duplicate", 0) == duplicates
    assert segmenter.bodies == {}


@settings(max_examples=40, deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_the_quick_completeness_check_agrees_with_what_is_missing_after_every_event(scenario, seed) -> None:
    """``complete`` (asked on every event, short-circuited) says yes exactly when ``missing`` names nothing,
    whatever the order, turns with gaps included (some turns held back to the end)."""
    _, events, _ = scenario
    order = interleave(random.Random(seed), events, 0)
    held = [e for i, e in enumerate(order) if e[0] == "turns" and i % 3 == 0]
    order = [e for e in order if e not in held] + held
    state = RolloutState(order[0][1]["rollout_id"])
    for at, (topic, record) in enumerate(order):
        raw = encode(TOPIC_EVENT[topic], record)
        apply(state, decode_fact(topic, raw, record["rollout_id"].encode(), at))
        assert complete(state) == (state.open and not missing(state))


def test_nothing_is_cut_before_the_attempt_closed_and_every_counted_turn_arrived() -> None:
    writer = simple_rollout("r2")
    turns = [e for e in writer.events if e[0] == "turns"]
    others = [e for e in writer.events if e[0] != "turns"]
    segmenter, segments, _ = run(others + turns[:-1])
    assert segments == []
    state = RolloutState.from_bytes(segmenter.states["r2"])
    assert state.status == "open"
    _, segments, _ = run(turns[-1:], segmenter)
    assert comparable(segments) == expected(writer, 1.0)


def test_a_conflicting_duplicate_dead_letters_the_rollout_and_keeps_no_body() -> None:
    writer = simple_rollout("r3")
    forged = dict(writer.events[1][1], output_ids=[1, 2, 3, 4, 5], output_logprobs=[0.0] * 5)
    assert writer.events[1][0] == "turns"
    segmenter, segments, dead = run([*writer.events[:3], ("turns", forged), *writer.events[3:]])
    assert segments == []
    assert "dead-lettered" in dead[0] and "different content" in dead[0]
    assert any("already dead" in reason for reason in dead[1:])  # its later turns and reward, too
    assert RolloutState.from_bytes(segmenter.states["r3"]).status == "dead"
    assert segmenter.bodies == {}


def test_after_emission_a_new_turn_or_reward_is_dead_lettered_a_redelivered_one_is_a_duplicate() -> None:
    writer = simple_rollout("r4")
    segmenter, _, _ = run(writer.events)
    _, again, dead = run([writer.events[1], writer.events[-1]], segmenter)  # a crash redelivers them
    assert again == [] and dead == []
    late = RolloutWriter("r4", attempt_id="a1")  # the emitted attempt grows a chain: the cut was wrong
    late.turn("main.9", "main", [1], 2)
    stale = RolloutWriter("r4", attempt_id="a0")  # an abandoned attempt lagging behind: never trains anyway
    stale.turn("main", "main", [1], 2)
    events = [e for e in late.events + stale.events if e[0] == "turns"] + [("rewards", late.reward(0.0))]
    _, _, dead = run(events, segmenter)
    assert len(dead) == 2 and all("already emitted" in reason for reason in dead)
    assert "main.9#0" in dead[0] and segmenter.counts["late"] == 3


def test_a_second_different_reward_is_dead_lettered_the_first_one_counts() -> None:
    writer = simple_rollout("r5")
    *events, (_, real) = writer.events
    close = next(i for i, (t, r) in enumerate(events) if t == "sessions" and r["kind"] == "closed")
    other = dict(real, reward=0.0, solved=False)
    _, segments, dead = run([*events[:close], ("rewards", other), ("rewards", real), *events[close:]])
    assert {s["trajectory_reward"] for s in segments} == {0.0}
    assert len(dead) == 1 and "already has a reward" in dead[0]


def test_a_reward_graded_again_after_a_grader_crash_is_a_duplicate_before_and_after_emission() -> None:
    """The grader published, crashed before committing, and graded the same diff again: a new ``at`` and
    new durations in ``details``, the same verdict. Neither copy is a second reward; a changed verdict is."""
    writer = simple_rollout("r5b")
    *events, (_, real) = writer.events
    regraded = dict(real, at=real["at"] + 60_000, details='{"durations": {"eval": 1.25}}')
    segmenter, segments, dead = run([*events, ("rewards", real), ("rewards", regraded)])
    assert dead == [] and segments and segmenter.counts["duplicate"] == 1
    _, again, dead = run([("rewards", dict(regraded, at=real["at"] + 120_000))], segmenter)  # sealed by now
    assert again == [] and dead == [] and segmenter.counts["duplicate"] == 2
    _, _, dead = run([("rewards", dict(regraded, reward=0.0, solved=False))], segmenter)
    assert len(dead) == 1


def test_only_the_rewarded_attempt_trains() -> None:
    first, second = simple_rollout("r6", attempt="x"), simple_rollout("r6", attempt="y", reward=0.25)
    events = [e for e in first.events if e[0] != "rewards"] + second.events
    _, segments, dead = run(events)
    assert dead == [] and {s["attempt_id"] for s in segments} == {"y"}
    assert comparable(segments) == expected(second, 0.25)


def test_an_idle_rollout_times_out_into_an_abort_with_a_reason_then_is_forgotten() -> None:
    writer = simple_rollout("r7")
    opts = Options(timeout_ms=1000, forget_after_ms=5000)
    segmenter = Segmenter({}, {}, opts)
    run([e for e in writer.events if e[0] == "turns"], segmenter)
    assert segmenter.bodies and segmenter.tick(now=500) == []
    aborted = segmenter.tick(now=2000)
    assert [s.status for s in aborted] == ["aborted"] and "no reward" in aborted[0].reason
    assert segmenter.bodies == {} and segmenter.counts["aborted"] == 1
    _, segments, dead = run([writer.events[-1]], segmenter)
    assert segments == [] and "already aborted" in dead[0]
    segmenter.tick(now=10_000)
    assert "r7" not in segmenter.states


def test_an_unresolvable_prompt_reference_dead_letters_the_rollout() -> None:
    writer = simple_rollout("r8")
    index = next(
        i for i, e in enumerate(writer.events) if e[0] == "turns" and e[1]["prompt_ref_turn"] is not None
    )
    broken = dict(writer.events[index][1], prompt_tokens=writer.events[index][1]["prompt_tokens"] + 1)
    events = [*writer.events[:index], ("turns", broken), *writer.events[index + 1 :]]
    segmenter, segments, dead = run(events)
    assert segments == [] and "cannot cut segments: UnresolvedTurn" in dead[-1]
    assert RolloutState.from_bytes(segmenter.states["r8"]).status == "dead"


def test_a_turn_the_codec_reads_but_no_segment_may_carry_dead_letters_the_rollout() -> None:
    """An output id past int32 reads (an Avro int is a varint, and a read does not range-check it), but no
    segment may carry it: the rollout is dead-lettered with the codec's reason, no segment goes out, and the
    next rollout is cut (the refused encode once came after the cut, in the worker, and stopped it)."""
    import fastavro

    writer = simple_rollout("r8b")
    index = next(i for i, (t, r) in enumerate(writer.events) if t == "turns" and r["chain_kind"] == "main")
    record = writer.events[index][1]
    version = schema("turn")["version"]
    forged = dict(record, output_ids=[2**31, *record["output_ids"][1:]], schema_version=version)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema("turn")), forged)  # no validation
    raw = HEADER.pack(MAGIC, EVENT_TYPES.index("turn"), forged["schema_version"]) + body.getvalue()
    assert decode(raw).record["output_ids"][0] == 2**31
    events = [*writer.events[:index], ("turns", raw), *writer.events[index + 1 :]]
    segmenter, segments, dead = run([*events, *simple_rollout("r8c").events])
    assert {s["rollout_id"] for s in segments} == {"r8c"}
    assert "cannot cut segments: CodecError" in dead[-1] and "'response_ids': got int 2147483648" in dead[-1]
    assert RolloutState.from_bytes(segmenter.states["r8b"]).status == "dead"


def test_chain_kind_disagreement_between_sessions_and_turns_is_a_conflict() -> None:
    writer = simple_rollout("r9")
    lying = [(t, dict(r, chain_kind="subagent")) if t == "sessions" and r["chain_id"] == "main" else (t, r)
             for t, r in writer.events]  # fmt: skip
    _, segments, dead = run(lying)
    assert segments == [] and "chain main is subagent in one event and main in another" in dead[0]


def test_the_resolver_drops_exact_duplicates_and_refuses_conflicts() -> None:
    writer = simple_rollout("r10")
    turns = [r for t, r in writer.events if t == "turns"]
    resolver = TurnResolver()
    resolved = [t for r in turns + turns[:2] if (t := resolver.add(r)) is not None]
    assert resolved == resolve_turns(turns) and resolver.duplicates == 2
    with pytest.raises(ConflictingTurn, match="different content"):
        resolver.add(dict(turns[0], finish_reason="length"))


@given(
    st.lists(st.tuples(st.lists(st.integers(0, 99), max_size=4), st.integers(0, 3)), min_size=1, max_size=6)
)
def test_stitching_from_references_equals_resolving_then_segmenting(steps) -> None:
    from rollbus.trajectory import segment_chain

    w = RolloutWriter("r")
    for new, output in steps:
        w.turn("main", "main", new, output)
    records = [r for t, r in w.events if t == "turns"]
    assert chain_tokens(records) == segment_chain(resolve_turns(records))


def as_lists(tokens: ChainTokens) -> ChainTokens:
    """The same tokens with every field a list of Python numbers, logprobs at the wire's 32 bits."""
    fields = {"prompt_ids": np.int64, "response_ids": np.int64, "loss_mask": np.uint8,
              "rollout_logprobs": np.float32, "policy_versions": np.int64}  # fmt: skip
    return replace(tokens, **{name: np.asarray(ids(getattr(tokens, name)), dtype).tolist()
                              for name, dtype in fields.items()})  # fmt: skip


def ids(values: object) -> object:
    return values.values() if isinstance(values, Varints) else values


@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 2**31 - 1), max_size=4), st.integers(0, 3), st.booleans(),
                  st.booleans()),
        min_size=1, max_size=6,
    ),
    st.sampled_from(["all_turns", "last_turn"]),
)  # fmt: skip
def test_stitching_into_arrays_equals_stitching_into_lists(steps, scope) -> None:
    """What the segmenter cuts (numpy arrays, from records decoded as arrays or as lists) is chain_tokens item
    for item, whatever the chain: linked or re-sent whole (fresh: broken unless it happens to extend the
    stream, and then broken for both), outputs empty, logprobs that do not line up (kept as untrained
    context), either loss scope."""
    w = RolloutWriter("r")
    for index, (new, output, fresh, short) in enumerate(steps):
        w.turn("main", "main", new, output, fresh=fresh and index > 0)
        if short and output:
            w.events[-1][1]["output_logprobs"] = w.events[-1][1]["output_logprobs"][:-1]
    records = [r for t, r in w.events if t == "turns"]
    messages = [encode("turn", r) for r in records]
    decoded = [d.record for d in decode_many(messages, arrays=True)]
    spliced = [d.record for d in decode_scans([scan(m) for m in messages], varints=True)]
    assert isinstance(decoded[0]["output_ids"], np.ndarray) and isinstance(spliced[0]["output_ids"], Varints)
    mixed = [r if i % 2 else spliced[i] for i, r in enumerate(records)]  # as bodies of two schema versions
    sources = (records, decoded, spliced, mixed)
    try:
        reference = apply_loss_scope(chain_tokens(records), scope)
    except ChainBroken:
        for source in sources:
            with pytest.raises(ChainBroken):
                chain_arrays(source)
        return
    for source in sources:
        tokens = apply_loss_scope(chain_arrays(source), scope)
        names = ("loss_mask", "rollout_logprobs", "policy_versions")
        assert [getattr(tokens, name).dtype for name in names] == [np.uint8, np.float32, np.int64]
        for ids in (tokens.prompt_ids, tokens.response_ids):  # spliced bytes, or decoded ids
            assert isinstance(ids, Varints) or ids.dtype == np.int64
        assert as_lists(tokens) == as_lists(reference)
        assert trains(tokens) == trains(reference) == any(reference.loss_mask)


@pytest.mark.parametrize(
    ("topic", "value", "key", "error"),
    [
        ("t.turns", b"\x00garbage", b"r1", "bad magic"),
        ("t.turns", None, b"r1", "expected message bytes|shorter than"),
        ("t.turns", "rewards", b"r1", "reward event on 't.turns'"),
        ("t.rewards", "rewards", b"someone-else", "is not its rollout id 'r1'"),
        ("t.turns", b"RB" + b"\x00" * (8 * 2**20), b"r1", "over the limit"),
    ],
    ids=["garbage", "tombstone", "wrong-topic", "wrong-key", "oversized"],
)
def test_poison_on_the_wire_is_a_codec_error_naming_why(topic, value, key, error) -> None:
    from rollbus.codec import CodecError
    from rollbus.services.segmenter.segmentation import decode_fact

    if value == "rewards":
        value = encode("reward", simple_rollout("r1").events[-1][1])
    with pytest.raises(CodecError, match=error):
        decode_fact(topic, value, key, 0)


def test_a_well_formed_event_becomes_a_fact_with_its_broker_time() -> None:
    from rollbus.services.segmenter.segmentation import decode_fact

    reward = simple_rollout("r1").events[-1][1]
    fact = decode_fact("ns.rewards", encode("reward", reward), b"r1", 1234)
    assert (fact.kind, fact.at, fact.record["reward"]) == ("reward", 1234, 1.0)


def test_a_bad_segmenter_setting_is_one_line_and_exit_2() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rollbus", "segmenter", "--rollout-timeout", "-1"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--rollout-timeout='-1'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("reward", "last_at"),
    [(0.5, 1), (float("nan"), 1), (float("-inf"), 1), (0.5, 2**70)],
    ids=["finite", "nan", "inf", "int-past-64-bits"],
)
def test_a_state_reads_back_as_it_was_written(reward, last_at) -> None:
    """orjson writes states, the standard encoder what orjson would get wrong (NaN as null) or refuses
    (an int past 64 bits): either way the state reads back equal, non-ASCII ids included."""
    state = RolloutState("r-é✓", partition=3, last_at=last_at, seq=7, closed=["a"])
    state.reward = {"digest": "d", "attempt_id": "a", "reward": reward, "group_id": "g", "group_size": 2}
    state.attempts = {"a": {"main": ChainFacts("main", {"0": "x" * 24}, "closed", 1, 2, 3)}}
    back = RolloutState.from_bytes(state.to_bytes())
    got = back.reward.pop("reward")
    assert got == reward or (got != got and reward != reward)  # NaN stays NaN, not None
    state.reward.pop("reward")
    assert back == state


@settings(max_examples=200, deadline=None)
@given(rollout=st.text(), attempt=st.text(), chain=st.text(), index=st.integers(-(2**40), 2**40))
def test_a_body_key_is_the_json_it_always_was(rollout, attempt, chain, index) -> None:
    """Keys already in turn-bodies changelogs must still be found: any characters, any index."""
    from rollbus.services.segmenter.segmentation import body_key

    assert body_key(rollout, (attempt, chain, index)) == json.dumps([rollout, attempt, chain, index])


def test_ids_with_separator_characters_never_share_a_body_or_session_slot() -> None:
    from rollbus.services.segmenter.segmentation import body_key

    assert body_key("r", ("x\x1fy", "z", 0)) != body_key("r", ("x", "y\x1fz", 0))
    first, second = simple_rollout("r\x1fa", attempt="b"), simple_rollout("r", attempt="a\x1fb")
    segmenter, _, _ = run(first.events[:-1] + second.events[:-1])
    _, segments, dead = run([first.events[-1], second.events[-1]], segmenter)
    assert dead == [] and len(segments) == 6


# --- the loss scope a reward names (gym --loss-scope) ------------------------------------------------


def gym_episode(rollout_id: str, details: str, turns: int = 3) -> RolloutWriter:
    """A gym episode as the gym runner writes it: one main chain, a user observation between replies."""
    w = RolloutWriter(rollout_id)
    w.turn("main", "main", [1, 2, 3], 4)
    for _ in range(turns - 1):
        w.turn("main", "main", [21, 22], 3)
    w.close()
    w.reward(1.0, details=details)
    return w


def trained(segment: dict) -> list[int]:
    return [t for t, m in zip(segment["response_ids"], segment["loss_mask"], strict=True) if m]


def test_a_reward_naming_last_turn_trains_only_the_last_reply_whatever_the_segmenter_default() -> None:
    writer = gym_episode("g1", '{"kind": "gym", "loss_scope": "last_turn"}')
    _, (segment,), dead = run(writer.events)  # the segmenter's own default: all_turns
    assert dead == [] and segment["kind"] == "final"
    last = writer.live["main"].turns[-1]
    assert trained(segment) == last.output_ids  # every earlier reply is context, not trained
    masked = [lp for lp, m in zip(segment["rollout_logprobs"], segment["loss_mask"], strict=True) if not m]
    assert set(masked) == {0.0}
    everything = fan_out(writer.expected_chains(), "g1", 1.0)[0]
    assert segment["response_ids"] == everything.response_ids  # same tokens, only the mask differs
    assert segment["reward"] == 1.0


def test_a_reward_naming_all_turns_overrides_a_last_turn_segmenter() -> None:
    writer = gym_episode("g2", '{"kind": "gym", "loss_scope": "all_turns"}')
    segmenter = Segmenter({}, {}, Options(loss_scope="last_turn"))
    _, (segment,), _ = run(writer.events, segmenter)
    replies = [t.output_ids for t in writer.live["main"].turns]
    assert trained(segment) == [t for reply in replies for t in reply]


@pytest.mark.parametrize(
    "details", ["{}", "", "graded by hand", "[1, 2]", '{"loss_scope": null}', '{"kind": "swe"}'],
    ids=["empty-object", "empty", "not-json", "json-list", "null", "no-key"],
)  # fmt: skip
@pytest.mark.parametrize("default", ["all_turns", "last_turn"])
def test_a_reward_naming_no_scope_gets_the_segmenters(details: str, default: str) -> None:
    writer = gym_episode("g3", details)
    segmenter = Segmenter({}, {}, Options(loss_scope=default))
    _, segments, dead = run(writer.events, segmenter)
    assert dead == []
    assert comparable(segments) == expected(writer, 1.0, default)


@pytest.mark.parametrize("scope", ["LAST_TURN", "some_turns", 3, ["last_turn"], ""])
def test_a_reward_naming_an_unknown_scope_dead_letters_the_rollout_with_the_reason(scope) -> None:
    import json

    writer = gym_episode("g4", json.dumps({"kind": "gym", "loss_scope": scope}))
    segmenter, segments, dead = run(writer.events)
    assert segments == []  # never trained with a guessed mask
    assert len(dead) == 1 and "details.loss_scope" in dead[0] and "all_turns, last_turn" in dead[0]
    assert RolloutState.from_bytes(segmenter.states["g4"]).status == "dead" and segmenter.bodies == {}


@settings(max_examples=40, deadline=None)
@given(
    scenario=scenarios(),
    named=st.sampled_from([None, "all_turns", "last_turn"]),
    default=st.sampled_from(["all_turns", "last_turn"]),
    seed=st.integers(0, 2**32),
)
def test_the_named_scope_else_the_default_cuts_like_fan_out_in_any_interleaving(
    scenario, named, default, seed: int
) -> None:
    import json

    writer, events, reward = scenario
    details = json.dumps({"loss_scope": named} if named else {})
    events = [*events[:-1], ("rewards", dict(events[-1][1], details=details))]
    segmenter = Segmenter({}, {}, Options(loss_scope=default))
    _, segments, dead = run(interleave(random.Random(seed), events, 2), segmenter)
    assert dead == []
    scope = named or default
    assert comparable(segments) == expected(writer, reward, scope)
    if scope == "last_turn":  # each segment trains its chain's last non-empty reply and nothing else
        replies = [[t.output_ids for t in c.turns if t.output_ids] for c in writer.expected_chains()]
        for segment, chain_replies in zip(segments, [r for r in replies if r], strict=True):
            assert trained(segment) == chain_replies[-1]


# --- the reward's gym info dicts (issue 12) -------------------------------------------------------


def test_the_rewards_infos_ride_verbatim_on_the_final_segment_only_and_replay_byte_identically() -> None:
    infos = '[{"reset": true}, {"step": 1, "note": "caf\\u00e9 \\"q\\""}, {}]'  # verbatim, never re-dumped
    writer = simple_rollout("r-infos")
    events = [*writer.events[:-1], ("rewards", dict(writer.events[-1][1], infos=infos))]
    _, segments, dead = run(events)
    assert dead == []
    carried = [(s["kind"], s["infos"]) for s in segments]
    assert carried == [("subagent", "[]"), ("wipe", "[]"), ("final", infos)]
    assert comparable(segments) == expected(writer, 1.0)  # the tokens and rewards are untouched
    _, again, _ = run(interleave(random.Random(7), events, 3))
    assert [encode("segment", s) for s in again] == [encode("segment", s) for s in segments]
    assert [decode(encode("segment", s)).record["infos"] for s in segments] == ["[]", "[]", infos]


@pytest.mark.parametrize("reward_infos", [None, "", "[]"], ids=["absent", "empty-string", "empty-list"])
def test_a_reward_without_infos_cuts_segments_with_an_empty_list(reward_infos) -> None:
    writer = gym_episode("g-no-infos", '{"kind": "gym"}')
    reward = dict(writer.events[-1][1])
    if reward_infos is not None:
        reward["infos"] = reward_infos
    _, (segment,), dead = run([*writer.events[:-1], ("rewards", reward)])
    assert dead == [] and segment["kind"] == "final" and segment["infos"] == "[]"


def test_a_state_kept_before_rewards_carried_infos_still_cuts_with_an_empty_list() -> None:
    """A rewarded rollout waiting for its close when the segmenter was upgraded: its stored reward has no
    ``infos`` key; the cut must not fail on it."""
    import json

    writer = gym_episode("g-old-state", '{"kind": "gym"}')
    close, reward = writer.events[-2], writer.events[-1]
    assert close[0] == "sessions" and close[1]["kind"] == "closed"
    segmenter, segments, _ = run([*writer.events[:-2], reward])
    assert segments == []  # the attempt never closed yet
    raw = json.loads(segmenter.states["g-old-state"])
    del raw["reward"]["infos"]
    segmenter.states["g-old-state"] = json.dumps(raw).encode()
    _, segments, dead = run([close], segmenter)
    assert dead == [] and [s["infos"] for s in segments] == ["[]"]


# --- sealed states and the clock ---------------------------------------------------------------------


def test_a_sealed_state_is_a_fraction_of_the_open_state_and_still_knows_every_redelivery() -> None:
    writer = simple_rollout("t1", turns=40)
    segmenter, _, _ = run(writer.events[:-1])
    open_size = len(segmenter.states["t1"])
    run(writer.events[-1:], segmenter)
    sealed = RolloutState.from_bytes(segmenter.states["t1"])
    assert sealed.status == "emitted" and sealed.attempts == {} and sealed.sessions == {}
    assert len(segmenter.states["t1"]) * 2.5 < open_size  # 8 bytes a fact instead of ~50
    _, again, dead = run(writer.events, segmenter)  # a crash or a replay redelivers every event
    assert again == [] and dead == [] and segmenter.counts["duplicate"] == len(writer.events)
    late = RolloutWriter("t1", attempt_id="a1")
    late.turn("main.1", "main", [1], 2)  # the emitted attempt's chain grows: the cut would have differed
    _, _, dead = run([e for e in late.events if e[0] == "turns"] + [("rewards", late.reward(0.5))], segmenter)
    assert len(dead) == 2 and all("already emitted" in reason for reason in dead)


def test_a_sealed_state_kept_before_compaction_still_tells_duplicates_from_late_events() -> None:
    """A segmenter upgraded over a changelog of full sealed states (digests per turn, no fingerprints)."""
    import json

    writer = simple_rollout("t2")
    segmenter, _, _ = run(writer.events[:-1])
    state = RolloutState.from_bytes(segmenter.states["t2"])
    *_, (_, reward) = writer.events
    apply(state, Fact("reward", decode(encode("reward", reward)).record, 99))
    state.status, state.reason = "emitted", "3 segment(s)"
    old = json.loads(state.to_bytes())
    del old["seen"]
    segmenter.states["t2"], segmenter.bodies = json.dumps(old).encode(), {}
    segmenter.reindex()  # the table was rewritten behind its back, as changelog recovery does
    _, again, dead = run(writer.events, segmenter)
    assert again == [] and dead == []
    stale = RolloutWriter("t2", attempt_id="a0")
    stale.turn("main", "main", [1], 2)  # another attempt's lagging turn: counted, then a duplicate
    _, _, dead = run([stale.events[1], stale.events[1], ("rewards", dict(reward, reward=0.0))], segmenter)
    assert len(dead) == 1 and "already emitted" in dead[0] and segmenter.counts["late"] == 2


def test_late_events_are_dead_lettered_within_forget_after_and_the_sealed_state_goes_after_it() -> None:
    writer = simple_rollout("t3")
    segmenter = Segmenter({}, {}, Options(forget_after_ms=5_000))
    run(writer.events, segmenter)  # events at 0..n-1
    last = len(writer.events) - 1
    assert segmenter.tick(now=last + 4_999) == [] and "t3" in segmenter.states
    *_, (_, reward) = writer.events
    _, _, dead = run([("rewards", dict(reward, reward=0.0))], segmenter)  # at 0: no younger sealed state
    assert len(dead) == 1 and "already emitted" in dead[0]
    segmenter.tick(now=last + 5_000)
    assert segmenter.states == {} and segmenter.bodies == {}


def open_rollout(segmenter: Segmenter, rollout_id: str, partition: int, at: int = 0) -> None:
    writer = RolloutWriter(rollout_id)
    writer.turn("main", "main", [1, 2], 3)
    for topic, record in writer.events:
        raw = encode(TOPIC_EVENT[topic], record)
        segmenter.handle(Fact(FACT_KINDS[topic], decode(raw).record, at), raw, partition)


def test_a_tick_aborts_only_its_partitions_idle_rollouts() -> None:
    segmenter = Segmenter({}, {}, Options(timeout_ms=1_000))
    open_rollout(segmenter, "p0", 0)
    open_rollout(segmenter, "p1", 1)
    assert segmenter.tick(now=999, partition=0) == []
    assert [s.rollout_id for s in segmenter.tick(now=1_000, partition=0)] == ["p0"]
    assert segmenter.tick(now=5_000, partition=0) == []  # p0 is sealed now, p1 is not its to judge
    assert [s.rollout_id for s in segmenter.tick(now=5_000, partition=1)] == ["p1"]


def test_states_recovered_behind_the_segmenters_back_are_ticked_after_reindex() -> None:
    """What the worker does on every partition assignment: Faust's changelog recovery writes the table
    directly, so the clock index, built from the table at the first tick, must be rebuilt."""
    states: dict[str, bytes] = {}
    segmenter = Segmenter(states, {}, Options(timeout_ms=1_000))
    assert segmenter.tick(now=0) == []  # the index is built (empty)
    other = Segmenter(states, {})  # another worker, via the changelog
    open_rollout(other, "moved", 3)
    segmenter.reindex()
    assert [s.rollout_id for s in segmenter.tick(now=1_000, partition=3)] == ["moved"]


@pytest.mark.parametrize("split", [0.3, 0.6, 0.9])
def test_a_restarted_segmenter_cuts_what_an_uninterrupted_one_cuts_and_keeps_no_scan(split) -> None:
    """The segmenter keeps each body's scan from its arrival to its cut; one that restarts (or takes over a
    partition) has only the table's bytes for the earlier bodies and scans them again: same segments. Once
    a rollout is out, nothing of it stays in memory but its sealed state."""
    events = simple_rollout("r-restart").events
    _, whole, _ = run(events)
    states, bodies = {}, {}
    cut_at = int(len(events) * split)
    first = Segmenter(states, bodies)
    run(events[:cut_at], first)
    assert len(first._scans) == len(bodies) > 0  # a scan per body kept
    second = Segmenter(states, bodies)  # the restart: the tables survive, the process memory does not
    again, again_segments, dead = run(events[cut_at:], second)
    assert dead == [] and again_segments == whole
    assert bodies == {} and again._scans == {}


def test_a_body_rewritten_behind_the_segmenters_back_is_read_from_the_table_after_reindex() -> None:
    """Changelog recovery may write a body the worker kept a scan of; the worker reindexes on every
    assignment, so the cut reads what the table holds, never a stale scan."""
    writer = simple_rollout("r-stale")
    turns = [i for i, (t, r) in enumerate(writer.events) if t == "turns" and r["chain_kind"] == "main"]
    segmenter = Segmenter({}, {})
    run(writer.events[: turns[0] + 1], segmenter)
    [key] = segmenter.bodies
    original = writer.events[turns[0]][1]
    changed = dict(original, output_ids=[i + 1 for i in original["output_ids"]])  # what the table now says
    segmenter.bodies[key] = encode("turn", changed)
    segmenter.reindex()
    _, segments, _ = run(writer.events[turns[0] + 1 :], segmenter)
    rewritten = [*writer.events[: turns[0]], ("turns", changed), *writer.events[turns[0] + 1 :]]
    _, expected_segments, _ = run(rewritten)
    _, stale, _ = run(writer.events)
    assert segments == expected_segments != stale


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_scanned_turns_digest_is_the_decoded_turns(data) -> None:
    """The worker digests a turn from its scanned bytes, a replay or a test from the decoded record: a
    redelivery is a duplicate, not a conflict, whichever way each copy was read."""
    from rollbus.codec import schema
    from rollbus.turn_log import turn_digest
    from tests.avro_strategies import records

    record = data.draw(records(schema("turn")))
    raw = encode("turn", record)
    fact = decode_fact("turns", raw, record["rollout_id"].encode(), 0)
    assert "prompt_ids" not in fact.record and fact.scanned is not None
    assert turn_digest(fact.record, fact.scanned) == turn_digest(decode(raw).record) == turn_digest(record)


def _as_v1(segmenter: Segmenter, rollout_id: str, events: list[Event]) -> None:
    """Rewrite the rollout's stored turn digests as a segmenter before turn digest v2 kept them."""
    import json

    from rollbus.turn_log import turn_digest_v1, turn_key

    v1 = {turn_key(r): turn_digest_v1(r) for t, r in events if t == "turns"}
    raw = json.loads(segmenter.states[rollout_id])
    for attempt, chains in raw["attempts"].items():
        for chain_id, chain in chains.items():
            chain["turns"] = {i: v1[(attempt, chain_id, int(i))] for i in chain["turns"]}
    segmenter.states[rollout_id] = json.dumps(raw).encode()
    segmenter.reindex()


def test_an_upgrade_over_states_with_v1_digests_still_tells_redeliveries_from_conflicts() -> None:
    """A worker upgraded while rollouts are in flight re-reads its uncommitted events against states whose
    turn digests are v1: they are duplicates, the rollout is cut as before, and a changed turn still kills
    it. Redelivered to the sealed state (fingerprints of v1 digests), a turn is still a duplicate."""
    writer = simple_rollout("up")
    *before, reward = writer.events
    segmenter, _, _ = run(before)
    _as_v1(segmenter, "up", before)
    _, segments, dead = run([*before, reward], segmenter)
    assert dead == [] and comparable(segments) == expected(writer, 1.0)
    assert segmenter.counts["duplicate"] == len(before)
    _, again, dead = run(before, segmenter)
    assert again == [] and dead == [] and segmenter.counts["duplicate"] == 2 * len(before)

    forged = simple_rollout("up2")
    *before, _ = forged.events
    segmenter, _, _ = run(before)
    _as_v1(segmenter, "up2", before)
    first = next(i for i, (t, r) in enumerate(before) if t == "turns" and r["chain_kind"] == "main")
    changed = dict(before[first][1], output_ids=[*before[first][1]["output_ids"][:-1], 4242])
    _, _, dead = run([("turns", changed)], segmenter)
    assert len(dead) == 1 and "different content" in dead[0]
