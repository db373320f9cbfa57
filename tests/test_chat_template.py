"""The Qwen3.6 chat template: structure, determinism and append-only (prefix-stable) rendering."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError

from rollbus.tokenizer import SpecialIds, chat_template_path, load_chat_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line."},
                    "timeout": {"type": "integer", "minimum": 1},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


def call(name: str, **arguments) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "reasoning_content": "I should run ls.",
        "content": "Listing.",
        "tool_calls": [call("bash", command="ls -la", timeout=5), call("read_file", path="README.md")],
    },
    {"role": "tool", "tool_call_id": "call_bash", "content": "a.py\nb.py"},
    {"role": "tool", "tool_call_id": "call_read_file", "content": "# readme"},
    {"role": "assistant", "reasoning_content": "Done.", "content": "Two files."},
    {"role": "user", "content": "Thanks."},
]


def render(tokenizer, messages, tools=TOOLS, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def turns(text: str) -> list[tuple[str, str]]:
    """(role, body) of every ``<|im_start|>role\\nbody<|im_end|>\\n`` turn; the whole text must be turns."""
    found = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", text, flags=re.DOTALL)
    assert "".join(f"<|im_start|>{role}\n{body}<|im_end|>\n" for role, body in found) == text
    return found


def test_turn_sequence_groups_tool_results_into_one_user_turn(tokenizer) -> None:
    roles = [role for role, _ in turns(render(tokenizer, CONVERSATION))]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]


def test_system_turn_lists_the_tools_after_the_system_prompt(tokenizer) -> None:
    system = turns(render(tokenizer, CONVERSATION))[0][1]
    assert system.startswith("You are a coding agent.\n\n# Tools")
    listing = system[system.index("<tools>") : system.index("</tools>")]
    assert re.findall(r"<name>(\w+)</name>", listing) == ["bash", "command", "timeout", "read_file", "path"]
    assert "<description>Run a shell command.</description>" in listing
    assert "<type>integer</type>\n<minimum>1</minimum>" in listing
    assert '<required>["command"]</required>' in listing
    assert "<tool_call>\n<function=" in system[system.index("</tools>") :]  # the format is instructed


def test_tools_without_system_prompt_still_get_a_system_turn(tokenizer) -> None:
    (role, body), *_ = turns(render(tokenizer, CONVERSATION[1:]))
    assert role == "system" and body.startswith("# Tools")
    assert [role for role, _ in turns(render(tokenizer, CONVERSATION[1:2], tools=None))] == ["user"]


def test_assistant_turn_has_reasoning_text_then_qwen3_coder_calls(tokenizer) -> None:
    assistant = turns(render(tokenizer, CONVERSATION))[2][1]
    first = "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
    first += "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>"
    second = "<tool_call>\n<function=read_file>\n<parameter=path>\nREADME.md\n</parameter>\n"
    second += "</function>\n</tool_call>"
    assert assistant == f"<think>\nI should run ls.\n</think>\n\nListing.\n\n{first}\n{second}"


def test_non_string_arguments_are_json(tokenizer) -> None:
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("bash", command="x", timeout=3, env={"A": "é", "B": [1, True, None]})],
    }
    body = turns(render(tokenizer, [message]))[1][1]
    assert "<parameter=timeout>\n3\n</parameter>" in body
    assert '<parameter=env>\n{"A": "é", "B": [1, true, null]}\n</parameter>' in body
    assert body.startswith("<think>\n\n</think>\n\n<tool_call>")  # no content: no blank line before the call


def test_reasoning_of_every_assistant_turn_is_kept(tokenizer) -> None:
    bodies = [body for role, body in turns(render(tokenizer, CONVERSATION)) if role == "assistant"]
    assert [body.split("\n</think>")[0] for body in bodies] == ["<think>\nI should run ls.", "<think>\nDone."]


def test_tool_results_render_as_tool_response_blocks(tokenizer) -> None:
    body = turns(render(tokenizer, CONVERSATION))[3][1]
    assert (
        body == "<tool_response>\na.py\nb.py\n</tool_response>\n<tool_response>\n# readme\n</tool_response>"
    )


def test_generation_prompt_opens_the_reasoning_block(tokenizer) -> None:
    prompt = render(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert prompt == render(tokenizer, CONVERSATION) + "<|im_start|>assistant\n<think>\n"
    closed = render(tokenizer, CONVERSATION, add_generation_prompt=True, enable_thinking=False)
    assert closed == render(tokenizer, CONVERSATION) + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_text_content_parts_render_like_a_string(tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(tokenizer, parts) == render(tokenizer, [{"role": "user", "content": "ab"}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only come first"),
        ([{"role": "robot", "content": "a"}], "unknown message role"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "only text content parts"),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                }
            ],
            "must be an object",
        ),
    ],
)
def test_malformed_conversations_are_rejected(tokenizer, messages, error: str) -> None:
    with pytest.raises(TemplateError, match=error):
        render(tokenizer, messages)


def test_rendering_is_deterministic_and_does_not_mutate_messages(tokenizer) -> None:
    snapshot = copy.deepcopy(CONVERSATION)
    assert render(tokenizer, CONVERSATION) == render(tokenizer, snapshot)
    assert CONVERSATION == snapshot


def test_chat_format_markers_tokenize_as_special_tokens(tokenizer) -> None:
    text = render(tokenizer, CONVERSATION, add_generation_prompt=True)
    after_system = text[text.index("<|im_start|>user") :]  # the system turn also shows the call format
    ids = tokenizer.encode(after_system, add_special_tokens=False)
    special = SpecialIds.from_tokenizer(tokenizer)
    assert ids.count(special.im_start) == 6 and ids.count(special.im_end) == 5
    assert ids.count(special.tool_call) == ids.count(special.tool_call_end) == 2
    assert ids.count(special.tool_response) == ids.count(special.tool_response_end) == 2
    assert ids.count(special.think) == 3 and ids[-2:] == [special.think, tokenizer.encode("\n")[0]]


def test_template_ships_in_the_tokenizer_and_loads_by_name_or_directory(tokenizer) -> None:
    source = chat_template_path().read_text()
    assert tokenizer.chat_template == source == load_chat_template("qwen3.6")
    assert load_chat_template(chat_template_path()) == source


# ---------------------------------------------------------------- append-only property

texts = st.text(max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=5,
)
tool_calls = st.lists(
    st.builds(call, st.sampled_from(["bash", "read_file"]), command=json_values, path=texts), max_size=3
)
user_messages = st.builds(lambda content: [{"role": "user", "content": content}], texts)
assistant_messages = st.builds(
    lambda reasoning, content, calls: [
        {
            "role": "assistant",
            "content": content,
            **({"reasoning_content": reasoning} if reasoning else {}),
            **({"tool_calls": calls} if calls else {}),
        }
    ],
    st.none() | texts,
    st.none() | texts,
    tool_calls,
)
tool_groups = st.lists(
    st.builds(lambda content: {"role": "tool", "tool_call_id": "c", "content": content}, texts),
    min_size=1,
    max_size=3,
)
conversations = st.builds(
    lambda system, steps: system + [message for step in steps for message in step],
    st.sampled_from([[], [{"role": "system", "content": "sys"}]]),
    st.lists(st.one_of(user_messages, assistant_messages, tool_groups), min_size=1, max_size=8),
)


def continues_tool_group(messages: list[dict], k: int) -> bool:
    return messages[k - 1]["role"] == "tool" and messages[k]["role"] == "tool"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations, with_tools=st.booleans())
def test_appending_messages_only_appends_text(tokenizer, messages: list[dict], with_tools: bool) -> None:
    """render(messages[:k]) is a prefix of render(messages) exactly at the boundaries k >= 1 that do not
    split a group of consecutive tool messages (that group's user turn closes after its last member).
    k = 0 is excluded when tools are given: the system prompt and the tool list form one turn."""
    tools = TOOLS if with_tools else None
    full = render(tokenizer, messages, tools=tools)
    assert render(tokenizer, copy.deepcopy(messages), tools=tools) == full
    full_ids = tokenizer.encode(full, add_special_tokens=False)
    for k in range(1, len(messages)):
        head = render(tokenizer, messages[:k], tools=tools)
        assert full.startswith(head) != continues_tool_group(messages, k), k
        if not continues_tool_group(messages, k):  # turns end "<|im_end|>\n": token ids are prefixes too
            head_ids = tokenizer.encode(head, add_special_tokens=False)
            assert full_ids[: len(head_ids)] == head_ids, k


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations)
def test_generation_prompt_is_a_prefix_of_the_rendered_reply(tokenizer, messages: list[dict]) -> None:
    for k, message in enumerate(messages):
        if message["role"] == "assistant" and k > 0:
            prompt = render(tokenizer, messages[:k], add_generation_prompt=True)
            assert render(tokenizer, messages[: k + 1]).startswith(prompt)
