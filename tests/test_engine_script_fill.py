"""A scripted turn that quotes its prompt (``fill``): what only the run knows, such as the sub-agent id Codex
returned, taken from the decoded prompt by a regex; a script that asks for it wrongly is refused at load."""

from __future__ import annotations

import pytest

from rollbus.services.engine.policies import ChainRoute, ScriptedPolicy, parse_script
from rollbus.services.engine.protocol import BadRequest

WAIT = {"text": 'wait_agent(["{agent}"]) {agent}', "fill": {"agent": r'"agent_id":"([0-9a-f-]+)"'}}


def test_each_placeholder_takes_the_last_match_in_the_prompt() -> None:
    policy = ScriptedPolicy(parse_script({"turns": [WAIT]}))
    turn = policy.scripted_turn(ChainRoute("r", "main", "main"))
    prompt = '{"agent_id":"0a-1","nickname":"A"} ... {"agent_id":"0b-2","nickname":"B"}'
    assert turn.filled(prompt).text == 'wait_agent(["0b-2"]) 0b-2'
    assert turn.filled(prompt).complete and not turn.filled(prompt).fill


def test_a_turn_without_fill_is_left_as_written() -> None:
    (turn,) = parse_script({"turns": ["no {agent} here"]}).turns
    assert turn.fill == () and turn.filled("anything").text == "no {agent} here"


def test_a_prompt_without_the_value_is_a_bad_request() -> None:
    (turn,) = parse_script({"turns": [WAIT]}).turns
    with pytest.raises(BadRequest, match="matches nothing"):
        turn.filled("no id in this prompt")


@pytest.mark.parametrize(
    ("fill", "error"),
    [
        ({"agent": "no group"}, "exactly one group"),
        ({"agent": "(a)(b)"}, "exactly one group"),
        ({"agent": "(unclosed"}, "fill.agent"),
        ({"agent": 7}, "map names to regular expressions"),
        (["agent"], "map names to regular expressions"),
    ],
)
def test_a_bad_fill_is_refused_when_the_script_loads(fill, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_script({"turns": [{"text": "{agent}", "fill": fill}]})
