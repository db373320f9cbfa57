"""Round trip: a turn rendered by our chat template reads back through SGLang's real parsers."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus.services.adapter.parsing import ParsedOutput, ParsedToolCall, parse_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "background": {"type": "boolean"},
                    "env": {"type": "object"},
                    "args": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "Replace text in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
]
HISTORY = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix it."}]
# Text that would be read as chat/tool markup cannot round-trip; everything else must.
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
          "</parameter>", "<|im_end|>", "<|endoftext|>")  # fmt: skip


def completion(tokenizer, message: dict, *, enable_thinking: bool = True) -> str:
    """What the model would have sampled for ``message``: its rendering minus the generation prompt."""
    prompt = tokenizer.apply_chat_template(
        HISTORY, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    full = tokenizer.apply_chat_template(HISTORY + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt) :].removesuffix("\n")  # generation stops at <|im_end|>


def call(name: str, arguments: dict) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def expected(message: dict, *, thinking: bool = True) -> ParsedOutput:
    calls = [
        ParsedToolCall(c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls", [])
    ]
    reasoning = message.get("reasoning_content") or "" if thinking else None
    return ParsedOutput(reasoning=reasoning, text=message.get("content") or "", tool_calls=calls)


def test_reasoning_text_and_tricky_arguments_round_trip(tokenizer) -> None:
    message = {
        "role": "assistant",
        "reasoning_content": 'The test fails on line 3.\nLet me look at "foo" — 函数 🙂.',
        "content": "I'll patch it.\n",
        "tool_calls": [
            call("edit", {"path": "src/a.py", "old": 'x = "a"\n\n  y', "new": "\nx = 'b'\t# é\n"}),
            call(
                "bash",
                {
                    "command": "python -c 'import json; print(json.dumps({\"k\": 1}))'",
                    "timeout": 30,
                    "ratio": 0.5,
                    "background": False,
                    "env": {"LANG": "C.UTF-8", "nested": {"a": [1, None, "日本"]}},
                    "args": ["-v", '--x="y"'],
                },
            ),
        ],
    }
    assert parse_output(completion(tokenizer, message), TOOLS) == expected(message)


def test_plain_answer_round_trips(tokenizer) -> None:
    message = {"role": "assistant", "reasoning_content": "Easy.", "content": "It is 4."}
    assert parse_output(completion(tokenizer, message), TOOLS) == expected(message)


def test_thinking_disabled_round_trips_with_no_reasoning(tokenizer) -> None:
    message = {"role": "assistant", "content": "Done.", "tool_calls": [call("bash", {"command": "ls"})]}
    text = completion(tokenizer, message, enable_thinking=False)
    assert parse_output(text, TOOLS, thinking_started=False) == expected(message, thinking=False)


safe_text = st.text(
    alphabet=st.characters(codec="utf-8") | st.sampled_from(list("<>/=|\n\"'{}")), max_size=40
).filter(lambda text: not any(marker in text for marker in MARKUP))
string_values = safe_text.filter(lambda text: text.lower() != "null")  # SGLang reads "null" as None
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | safe_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(safe_text, inner, max_size=3),
    max_leaves=6,
)
bash_arguments = st.fixed_dictionaries(
    {"command": string_values},
    optional={
        "timeout": st.integers(),
        "ratio": st.floats(allow_nan=False, allow_infinity=False),
        "background": st.booleans(),
        "env": st.dictionaries(safe_text, json_values, max_size=3),
        "args": st.lists(json_values, max_size=3),
    },
)
edit_arguments = st.fixed_dictionaries({"path": string_values, "old": string_values, "new": string_values})
tool_calls = st.lists(
    st.builds(call, st.just("bash"), bash_arguments) | st.builds(call, st.just("edit"), edit_arguments),
    max_size=3,
)
assistant_messages = st.builds(
    lambda reasoning, content, calls: {
        "role": "assistant",
        "reasoning_content": reasoning,
        "content": content,
        **({"tool_calls": calls} if calls else {}),
    },
    safe_text,
    safe_text,
    tool_calls,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(message=assistant_messages)
def test_any_rendered_turn_parses_back(tokenizer, message: dict) -> None:
    assert parse_output(completion(tokenizer, message), TOOLS) == expected(message)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nno function here\n</tool_call>",
        "<tool_call>\n<function=bash>\n<parameter=command>\nrm -rf /tmp/bu",  # cut off by max_tokens
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n",  # unclosed
        "text <tool_call></tool_call> more",
    ],
)
def test_unparsable_call_markup_stays_text(text: str) -> None:
    assert parse_output(text, TOOLS, thinking_started=False) == ParsedOutput(None, text, [])


def test_call_markup_without_tools_is_text() -> None:
    text = "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
    assert parse_output(text, [], thinking_started=False) == ParsedOutput(None, text, [])


def test_reasoning_cut_off_before_its_end_is_all_reasoning() -> None:
    assert parse_output("Still thinking about", TOOLS) == ParsedOutput("Still thinking about", "", [])


def test_model_opening_its_own_think_block() -> None:
    parsed = parse_output("<think>\nHmm.\n</think>\n\nHi.<|im_end|>", TOOLS, thinking_started=False)
    assert parsed == ParsedOutput("Hmm.", "Hi.", [])


def test_no_reasoning_parser_keeps_everything_as_text() -> None:
    text = "Hmm.\n</think>\n\nHi."
    assert parse_output(text, TOOLS, reasoning_parser=None) == ParsedOutput(None, text, [])
