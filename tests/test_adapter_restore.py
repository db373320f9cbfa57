"""A restarted adapter carries on its open rollouts from the bus: no turn lost, none duplicated, every
sampled token still trainable. The bus here is the test publisher's record of what was published (the
real-broker path is the same reader over Kafka, exercised by the end-to-end test)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rollbus.events import SessionEvent, TurnEvent, TurnTimings, event_class
from rollbus.kafka.topics import spec_for
from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.restore import BusLog, read_sessions, read_turns, split_chain
from rollbus.tokenizer import load_tokenizer
from rollbus.trajectory import segment_chain
from rollbus.turn_log import resolve_turns
from tests.test_adapter_support import BusPublisher, StalledEngine, adapter_client, body, settings

KEY = b"s" * 32
ADMIN = {"authorization": "Bearer adm"}
READ_CALL = (
    "Look.\n</think>\n\n<tool_call>\n<function=Read>\n<parameter=file_path>\n/repo/app.py\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>"
)


def records_of(publisher: BusPublisher):
    async def records(topic: str, since_ms: int | None):
        for name, _, record in list(publisher.events):
            if name == topic:
                yield event_class(spec_for(topic).event_type).from_dict(record)

    return records


def echo_and_answer(history: list, message: dict) -> list:
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "def main(): ..."}
        for b in message["content"]
        if b["type"] == "tool_use"
    ]
    return history + [
        {"role": "assistant", "content": message["content"]},
        {"role": "user", "content": results},
    ]


async def test_a_restarted_adapter_continues_the_chain_with_the_same_token() -> None:
    tokenizer = load_tokenizer("qwen3.6")
    answer = tokenizer.encode(READ_CALL, add_special_tokens=False)
    publisher = BusPublisher()
    async with StalledEngine(answer, released=True) as engine:
        config = settings(engine.url, open_sessions=False, admin_token="adm", signing_key=KEY)
        async with adapter_client(config, publisher) as before:
            opened = await before.post(
                "/admin/sessions", json={"rollout_id": "r-1", "attempt_id": "a-1"}, headers=ADMIN
            )
            headers = {"x-api-key": opened.json()["token"]}
            history = body("Read /repo/app.py", stream=False)["messages"]
            first = (
                await before.post("/v1/messages", json=body(history, stream=False), headers=headers)
            ).json()
        # the old process is gone; a new one with the same key reads the bus
        app = create_app(config, publisher, records=records_of(publisher))
        async with adapter_client(config, publisher, app=app) as after:
            history = echo_and_answer(history, first)
            second = await after.post("/v1/messages", json=body(history, stream=False), headers=headers)
            assert second.status_code == 200, second.text
            history = echo_and_answer(history, second.json())
            third = await after.post("/v1/messages", json=body(history, stream=False), headers=headers)
            assert third.status_code == 200, third.text
            closed = await after.post("/admin/sessions/r-1/close", headers=ADMIN)
            assert closed.json()["closed"] == ["main"]
    turns = [r for t, _, r in publisher.events if t == "turns"]
    assert [(t["chain_id"], t["turn_index"], t["attempt_id"]) for t in turns] == [
        ("main", 0, "a-1"),
        ("main", 1, "a-1"),
        ("main", 2, "a-1"),
    ]
    assert turns[1]["prompt_ref_turn"] == 0  # an extension of the turn before the restart
    kinds = [(r["chain_id"], r["kind"]) for t, _, r in publisher.events if t == "sessions"]
    assert kinds == [("main", "opened"), ("main", "closed")]
    tokens = segment_chain(resolve_turns(turns))
    assert sum(tokens.loss_mask) == sum(len(t["output_ids"]) for t in turns)


async def test_a_closed_rollout_stays_closed_across_a_restart() -> None:
    publisher = BusPublisher()
    tokenizer = load_tokenizer("qwen3.6")
    answer = tokenizer.encode(READ_CALL, add_special_tokens=False)
    async with StalledEngine(answer, released=True) as engine:
        config = settings(engine.url, open_sessions=False, admin_token="adm", signing_key=KEY)
        async with adapter_client(config, publisher) as before:
            opened = await before.post("/admin/sessions", json={"rollout_id": "r-2"}, headers=ADMIN)
            headers = {"x-api-key": opened.json()["token"]}
            assert (
                await before.post("/v1/messages", json=body("hi", stream=False), headers=headers)
            ).status_code == 200
            await before.post("/admin/sessions/r-2/close", headers=ADMIN)
        app = create_app(config, publisher, records=records_of(publisher))
        async with adapter_client(config, publisher, app=app) as after:
            late = await after.post("/v1/messages", json=body("hi", stream=False), headers=headers)
            assert late.status_code == 401
            assert "r-2" not in after.app.state.adapter.sessions


def session_event(
    rollout: str, chain: str, kind: Any, at: int = 1000, chain_kind: Any = "main"
) -> SessionEvent:
    return SessionEvent(
        rollout_id=rollout, chain_id=chain, kind=kind, chain_kind=chain_kind, turn_count=0, at=at
    )


def turn_event(
    rollout: str, chain: str, index: int, prompt: list[int], output: list[int], ref=None
) -> TurnEvent:
    return TurnEvent(
        rollout_id=rollout, chain_id=chain, chain_kind="main", turn_index=index, prompt_ref_turn=ref,
        prompt_ids=prompt, prompt_tokens=len(prompt), output_ids=output, output_logprobs=[-0.5] * len(output),
        finish_reason="stop", policy_version=1, request_id=f"req-{index}",
        timings=TurnTimings(started_at=0, finished_at=0, generation_ms=0),
    )  # fmt: skip


def test_only_live_chains_of_open_rollouts_are_kept() -> None:
    log = read_sessions(
        [
            session_event("done", "main", "opened", at=10),
            session_event("done", "main", "closed", at=20),
            session_event("open", "main", "opened", at=500),
            session_event("open", "main", "frozen", at=600),
            session_event("open", "main.1", "opened", at=600),
            session_event("open", "agent-x", "opened", at=700, chain_kind="subagent"),
        ]
    )
    assert set(log.chains) == {("open", "main.1"), ("open", "agent-x")}
    assert log.closed == {"done": 20} and log.opened_chains == {"open": 3}
    assert log.since_ms() == 0  # 600 ms minus the clock-skew slack, floored at 0
    read_turns(
        log,
        [
            turn_event("open", "main.1", 0, [1, 2], [3]),
            turn_event("done", "main", 0, [9], [9]),
            turn_event("open", "main.1", 1, [4], [5, 6], ref=0),
        ],
    )
    chain = log.chains[("open", "main.1")]
    assert chain.turns == 2 and chain.last.prompt_ids == [1, 2, 3, 4] and chain.last.output_ids == [5, 6]
    assert BusLog().since_ms() is None


def test_a_duplicated_turn_is_read_once_and_a_conflicting_one_ends_the_chain() -> None:
    log = read_sessions([session_event("r", "main", "opened"), session_event("r", "agent-x", "opened")])
    first, second = turn_event("r", "main", 0, [1], [2]), turn_event("r", "main", 1, [3], [4], ref=0)
    read_turns(log, [first, second, second, turn_event("r", "main", 2, [5], [6], ref=1)])
    assert log.chains[("r", "main")].live and log.chains[("r", "main")].turns == 3
    other = turn_event("r", "agent-x", 0, [1], [2])
    read_turns(log, [other, dataclasses.replace(other, output_ids=[9])])
    assert not log.chains[("r", "agent-x")].resumable  # kept, so the agent's next chain is agent-x.1


def test_chain_names() -> None:
    assert split_chain("main") == ("main", 0)
    assert split_chain("main.12") == ("main", 12)
    assert split_chain("agent-ab12.1") == ("agent-ab12", 1)
    assert json.dumps(split_chain("side-3")) == '["side-3", 0]'
