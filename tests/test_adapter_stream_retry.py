"""A cut Responses stream, retried as Codex retries it (the same history plus the items that arrived), is
answered with the rest of the recorded turn: nothing is sampled or published again, and the next request
extends the chain as if the stream had never been cut. Anything else that looks like it is an ordinary
request. Route tests run the real adapter against the scripted rollbus engine."""

from __future__ import annotations

import json

import pytest

from rollbus.services.adapter.responses import Item
from rollbus.services.adapter.stream_retry import Answered, rest
from tests.test_adapter_responses import TOOLS, done_items, open_session, opening, respond
from tests.test_adapter_support import engine_process, scripted_adapter

SCRIPT = {
    "turns": [
        "Look first.\n</think>\n\n<tool_call>\n<function=exec_command>\n<parameter=cmd>\ncat calc.py\n"
        "</parameter>\n</function>\n</tool_call>",
        "Second.\n</think>\n\nAll done.",
    ]
}

# ---------------------------------------------------------------- the rule, over plain data

ASKED = (Item(role="user", content="fix it"),)
SENT = (
    {
        "type": "reasoning",
        "id": "rs_1_0",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Hm."}],
    },
    {
        "type": "message",
        "id": "msg_1_1",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hi"}],
    },
    {"type": "function_call", "id": "fc_1_2", "call_id": "c1", "name": "ls", "arguments": "{}"},
)
ANSWERED = Answered(
    ASKED, TOOLS, tuple(Item.model_validate(i) for i in SENT), {"output": list(SENT)}, "main", 1
)


def echo(*indices: int) -> list[Item]:
    return [*ASKED, *(Item.model_validate(SENT[i]) for i in indices)]


@pytest.mark.parametrize("delivered", [(), (0,), (0, 1)])
def test_the_same_history_plus_a_prefix_of_the_turn_is_owed_the_rest(delivered: tuple[int, ...]) -> None:
    assert rest(ANSWERED, echo(*delivered), TOOLS, "main", 1) == list(SENT[len(delivered) :])


@pytest.mark.parametrize(
    ("items", "tools", "chain", "turns", "why"),
    [
        (echo(0, 1, 2), TOOLS, "main", 1, "every item arrived: nothing owed, an ordinary request"),
        (echo(1), TOOLS, "main", 1, "not a prefix of what was sent"),
        (echo(0, 2), TOOLS, "main", 1, "an item skipped"),
        ([Item(role="user", content="fix that"), Item.model_validate(SENT[0])], TOOLS, "main", 1, "edited"),
        (echo(0)[1:], TOOLS, "main", 1, "history shortened"),
        (echo(0), TOOLS[:1], "main", 1, "other tools"),
        (echo(0), TOOLS, "main", 2, "a turn was committed since"),
        (echo(0), TOOLS, "main.1", 1, "the chain was rewritten since"),
        ([*echo(0), Item(type="function_call_output", call_id="c1", output="x")], TOOLS, "main", 1, "more"),
    ],
)
def test_anything_else_is_an_ordinary_request(items, tools, chain, turns, why) -> None:
    assert rest(ANSWERED, items, tools, chain, turns) is None, why


def test_an_agent_never_answered_is_owed_nothing() -> None:
    assert rest(None, echo(), TOOLS, "main", 0) is None


def test_an_echo_with_other_content_is_not_our_item() -> None:
    edited = {**SENT[0], "content": [{"type": "reasoning_text", "text": "Hm!"}]}
    assert rest(ANSWERED, [*ASKED, Item.model_validate(edited)], TOOLS, "main", 1) is None


# ---------------------------------------------------------------- the route


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    with engine_process(SCRIPT, tmp_path_factory.mktemp("engine")) as url:
        yield url


@pytest.fixture
async def adapter(engine_url):
    async with scripted_adapter(engine_url, open_sessions=False) as client:
        yield client


@pytest.mark.parametrize("arrived", [0, 1])
async def test_a_retry_after_a_cut_gets_the_rest_of_the_turn_and_the_chain_goes_on(adapter, arrived) -> None:
    rollout, headers = await open_session(adapter)
    reasoning, call = done_items(await respond(adapter, opening(), headers))

    kept = [reasoning, call][:arrived]  # what the cut stream delivered before it broke
    retry = await respond(adapter, [*opening(), *kept], headers)
    assert [name for name, _ in retry][0] == "response.created"
    assert retry[-1][0] == "response.completed"
    assert done_items(retry) == [reasoning, call][arrived:]
    assert retry[-1][1]["response"]["output"] == done_items(retry)
    assert len(adapter.publisher.of("turns", rollout)) == 1  # nothing sampled for the retry

    ran = {"type": "function_call_output", "call_id": call["call_id"], "output": "Process exited with code 0"}
    message = done_items(await respond(adapter, [*opening(), *kept, *done_items(retry), ran], headers))[-1]
    assert message["content"][0]["text"] == "All done."  # the script's second turn: the first was not redone
    turns = adapter.publisher.of("turns", rollout)
    assert [(t["chain_id"], t["turn_index"], t["prompt_ref_turn"]) for t in turns] == [
        ("main", 0, None), ("main", 1, 0),
    ]  # fmt: skip
    assert [(s["kind"], s["chain_id"]) for s in adapter.publisher.of("sessions", rollout)] == [
        ("opened", "main")
    ]


async def test_a_retry_with_an_item_we_did_not_send_is_an_ordinary_request(adapter) -> None:
    """A 'delivered' item that differs from ours is no retry: the request is planned as any other (a new
    assistant message we never sampled starts a new chain) and sampled, never answered from the record."""
    rollout, headers = await open_session(adapter)
    reasoning, _ = done_items(await respond(adapter, opening(), headers))
    forged = {**reasoning, "content": [{"type": "reasoning_text", "text": json.dumps("something else")}]}

    await respond(adapter, [*opening(), forged], headers)
    turns = adapter.publisher.of("turns", rollout)
    assert len(turns) == 2 and turns[1]["chain_id"] != "main"
