"""Canonical history against the real Qwen3.6 tokenizer and template, replaying Claude Code traffic."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rollbus.services.adapter.canonical import (
    AssistantMessage,
    CanonicalHistory,
    RerenderHistory,
    StalePlan,
    canonical_json,
    normalise_assistant,
    tool_defaults,
)
from rollbus.tokenizer import SpecialIds, load_tokenizer, tokenizer_dir
from rollbus.trajectory import fan_out, merge_turns_all, segment_chain

SYSTEM = (
    "You are Claude Code, Anthropic's official CLI for Claude.\n"
    "You are an interactive CLI tool that helps users with software engineering tasks."
)
REMINDER = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following context: ...\n"
    "</system-reminder>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "what to run"},
                    "timeout": {"type": "number"},
                    "options": {"type": "object", "properties": {"flag": {"type": "boolean"}}},
                },
                "required": ["command"],
            },
        },
    }
    for name in ("Bash", "Read", "Edit", "Task")
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3.6")


@pytest.fixture(scope="module")
def im_end(tok) -> int:
    return SpecialIds.from_tokenizer(tok).im_end


def sample(tok, message: dict, split_at: int | None = None) -> list[int]:
    """Token ids a model would sample for ``message``: its rendered turn after the generation prompt.

    ``split_at`` tokenizes the text in two pieces, as a model sometimes samples a non-canonical
    tokenization that a re-render cannot reproduce.
    """
    head = [{"role": "user", "content": "."}]
    prompt = tok.apply_chat_template(head, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(head + [message], tokenize=False)
    assert full.startswith(prompt)
    text = full[len(prompt) : full.rindex("<|im_end|>")]
    pieces = [text] if split_at is None else [text[: split_at % len(text)], text[split_at % len(text) :]]
    ids = [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]
    return ids + tok.encode("<|im_end|>", add_special_tokens=False)


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def echo(message: dict, *, keep_reasoning: bool) -> dict:
    """The assistant message as the Claude Code CLI sends it back: inputs re-serialised, maybe no thinking."""
    calls = [
        tool_call(c["id"], c["function"]["name"], dict(reversed(list(c["function"]["arguments"].items()))))
        for c in message.get("tool_calls", [])
    ]
    echoed = {"role": "assistant", "content": message.get("content") or ""}
    if keep_reasoning and message.get("reasoning_content"):
        echoed["reasoning_content"] = message["reasoning_content"]
    if calls:
        echoed["tool_calls"] = calls
    return echoed


class Conversation:
    """A scripted Claude Code conversation: the model's replies and what the client adds after each."""

    def __init__(self, rng: random.Random, history, reasoning_rate: float = 0.8):
        self.rng = rng
        self.reasoning_rate = reasoning_rate
        self.history = history
        self.messages: list[dict] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{REMINDER}\nFix the failing test in tests/test_foo.py"},
        ]
        self.as_sent = list(self.messages)  # the same conversation with our assistant messages as sent
        self.calls = 0

    def reply(self) -> dict:
        n = self.rng.choice([0, 1, 1, 2])
        calls = []
        for _ in range(n):
            self.calls += 1
            args = {"command": f"pytest -x tests/test_{self.calls}.py", "timeout": 120}
            if self.rng.random() < 0.3:
                args["options"] = {"flag": True}
            calls.append(
                tool_call(f"toolu_{self.calls:04d}", self.rng.choice(["Bash", "Read", "Edit"]), args)
            )
        message = {"role": "assistant", "content": self.rng.choice(["", "Let me look at the test.", "Done."])}
        if self.rng.random() < self.reasoning_rate:
            message["reasoning_content"] = f"The failure is in step {self.calls}; check the fixture first."
        if calls:
            message["tool_calls"] = calls
        return message

    def step(self, tok, version: int, split: bool = False):
        plan = self.history.plan(self.messages, TOOLS)
        message = self.reply()
        output = sample(tok, message, split_at=self.rng.randrange(1, 10_000) if split else None)
        logprobs = [-self.rng.random() for _ in output]
        turn = self.history.commit(plan, output, logprobs, "stop", version, message)
        self.messages.append(echo(message, keep_reasoning=self.rng.random() < 0.5))
        self.as_sent.append(message)
        added = [
            {"role": "tool", "tool_call_id": call["id"], "content": f"ok {call['id']}\n"}
            for call in message.get("tool_calls", [])
        ]
        if not added or self.rng.random() < 0.2:
            added.append({"role": "user", "content": f"{REMINDER}\nNow run the whole suite."})
        self.messages += added
        self.as_sent += added
        return plan, turn


def reference_suffix(tok, messages: list[dict], upto: int) -> list[int]:
    """Independently: the full render's text after message ``upto`` (this template is append-only)."""
    full = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    head = tok.apply_chat_template(messages[:upto], tools=TOOLS, tokenize=False)
    assert full.startswith(head)
    return tok.encode(full[len(head) :], add_special_tokens=False)


def test_claude_code_replay_has_zero_drift(tok, im_end):
    conversation = Conversation(random.Random(7), CanonicalHistory(tok))
    newline = tok.encode("\n", add_special_tokens=False)
    previous = None
    for version in range(12):
        before = list(conversation.messages)
        plan, turn = conversation.step(tok, version, split=version % 3 == 1)
        if previous is None:
            assert (plan.new_chain, plan.reason) == (True, "first")
            assert plan.prompt_ids == tok.encode(
                tok.apply_chat_template(before, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
        else:
            assert (plan.new_chain, plan.reason) == (False, None)
            stream = previous.prompt_ids + previous.output_ids + newline
            assert previous.output_ids[-1] == im_end
            last_assistant = max(i for i, m in enumerate(before) if m["role"] == "assistant")
            assert plan.prompt_ids == stream + reference_suffix(tok, before, last_assistant + 1)
            assert (plan.reused_tokens, plan.rendered_tokens) == (
                len(stream),
                len(plan.prompt_ids) - len(stream),
            )
        previous = turn
    history = conversation.history
    tokens = segment_chain(history.turns)
    sampled = sum(len(t.output_ids) for t in history.turns)
    assert sum(tokens.loss_mask) == sampled
    assert [t.chain_id for t in history.turns] == ["main"] * 12
    assert [t.turn_index for t in history.turns] == list(range(12))
    assert history.frozen == []


def test_canonical_prompt_equals_full_render_when_sampling_was_canonical(tok):
    # with empty reasoning the model samples "\n" after the prompt's "<think>\n", which a full render
    # merges into one "\n\n" token: the stream keeps what was sampled, so only compare with reasoning
    conversation = Conversation(random.Random(3), CanonicalHistory(tok), reasoning_rate=1.0)
    for version in range(6):
        conversation.step(tok, version)
    plan = conversation.history.plan(conversation.messages, TOOLS)
    full = tok.apply_chat_template(
        conversation.as_sent, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert plan.prompt_ids == tok.encode(full, add_special_tokens=False)


def test_rerender_mode_loses_what_canonical_keeps(tok):
    """Non-canonical sampled tokenization: re-rendering cannot reproduce it, the canonical stream can."""
    kept = {}
    for mode in (CanonicalHistory, RerenderHistory):
        conversation = Conversation(random.Random(11), mode(tok))
        for version in range(8):
            conversation.step(tok, version, split=True)
        kept[mode.history_mode] = kept_fraction(conversation.history)
    assert kept["canonical"] == 1.0
    assert kept["rerender"] < 1.0


def kept_fraction(history) -> float:
    """Share of sampled tokens that end up trained (mask 1) in the history's segments."""
    chains = history.all_chains()
    sequences = [seq for chain in chains for seq in chain.sequences()]
    sampled = sum(len(t.output_ids) for chain in chains for t in chain.turns)
    return sum(sum(s.loss_mask) for s in sequences) / sampled


def start(tok, rng_seed: int = 5, turns: int = 3, **history_options) -> Conversation:
    conversation = Conversation(random.Random(rng_seed), CanonicalHistory(tok, **history_options))
    for version in range(turns):
        conversation.step(tok, version)
    return conversation


def test_compaction_freezes_the_chain_as_a_wipe(tok):
    conversation = start(tok)
    old_turns = list(conversation.history.turns)
    conversation.messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": "This session is being continued from a previous conversation. Summary: ...",
        },
    ]
    plan, turn = conversation.step(tok, 9)
    assert (plan.new_chain, plan.reason, plan.reused_tokens, plan.chain_id) == (
        True,
        "compaction",
        0,
        "main.1",
    )
    assert turn.chain_id == "main.1" and turn.turn_index == 0
    assert [c.kind for c in conversation.history.frozen] == ["wipe"]
    assert conversation.history.frozen[0].turns == old_turns
    plan, _ = conversation.step(tok, 10)
    assert (plan.new_chain, plan.chain_id) == (False, "main.1")
    segments = fan_out(conversation.history.all_chains(), "rollout-1", 1.0)
    assert [(s.kind, s.chain_id) for s in segments] == [("wipe", "main"), ("final", "main.1")]
    trained = sum(sum(s.loss_mask) for s in segments)
    assert trained == sum(len(t.output_ids) for c in conversation.history.all_chains() for t in c.turns)


def test_claude_code_compaction_is_a_fork_then_a_rewritten_opening(tok):
    """The CLI's summary request branches off an earlier turn (our turns echoed, then new user/tool
    messages only); the conversation it then continues has a new opening."""
    conversation = start(tok, turns=4)
    m = conversation.messages
    assistants = [i for i, x in enumerate(m) if x["role"] == "assistant"]
    at = assistants[2]
    summary = {"role": "user", "content": "Your task is to create a detailed summary. <summary>"}
    for fork in (m[:at] + [summary], m[: at + 1] + [summary]):
        assert conversation.history.plan(fork, TOOLS).reason == "fork"
    edited = dict(m[assistants[1]], content="not what we sampled")
    not_a_prefix = m[: assistants[1]] + [edited] + m[assistants[1] + 1 : at] + [summary]
    assert conversation.history.plan(not_a_prefix, TOOLS).reason == "unmatched_assistant"
    assert conversation.history.plan([m[0], summary], TOOLS).reason == "compaction"
    conversation.messages = m[:at] + [summary]
    plan, _ = conversation.step(tok, 9)
    assert (plan.new_chain, plan.reason, plan.chain_id, plan.reused_tokens) == (True, "fork", "main.1", 0)
    conversation.messages = [
        m[0],
        {"role": "user", "content": "This session is being continued ... Summary: ..."},
    ]
    plan, _ = conversation.step(tok, 10)
    assert (plan.new_chain, plan.reason, plan.chain_id) == (True, "compaction", "main.2")
    assert [(c.kind, c.chain_id, len(c.turns)) for c in conversation.history.frozen] == [
        ("wipe", "main", 4),
        ("wipe", "main.1", 1),
    ]


def rewrites(conversation: Conversation) -> dict[str, list[dict]]:
    m = conversation.messages
    assistant = max(i for i, x in enumerate(m) if x["role"] == "assistant")
    first_tool = next(i for i, x in enumerate(m) if x["role"] in ("tool", "user") and i > 1)
    edited_assistant = dict(m[assistant], content="I changed my mind.")
    edited_context = dict(m[first_tool], content="rewritten result")
    return {
        "unmatched_assistant": m[:assistant] + [edited_assistant] + m[assistant + 1 :],
        "edited_history": m[:first_tool] + [edited_context] + m[first_tool + 1 :],
        "removed_messages": m[:2],
        "no_new_messages": m[: assistant + 1],
        "unsampled_assistant": m + [{"role": "assistant", "content": "prefill"}],
        "compaction": [m[0], {"role": "user", "content": "summary"}] + m[2:],
        "fork": m[:assistant] + [{"role": "user", "content": "Summarise the conversation so far."}],
    }


@pytest.mark.parametrize(
    "reason",
    [
        "unmatched_assistant",
        "edited_history",
        "removed_messages",
        "no_new_messages",
        "unsampled_assistant",
        "compaction",
        "fork",
        "tools_changed",
    ],
)
def test_history_rewrites_start_a_new_chain_from_a_full_render(tok, reason):
    conversation = start(tok)
    messages = rewrites(conversation).get(reason, conversation.messages)
    tools = TOOLS[:2] if reason == "tools_changed" else TOOLS
    assert conversation.history.continues(conversation.messages, TOOLS)
    assert not conversation.history.continues(messages, tools)
    plan = conversation.history.plan(messages, tools)
    assert (plan.new_chain, plan.reason) == (True, reason)
    full = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert plan.prompt_ids == tok.encode(full, add_special_tokens=False)


def test_plan_does_not_mutate_and_stale_plans_are_refused(tok):
    conversation = start(tok, turns=2)
    history = conversation.history
    stream = history.stream
    first = history.plan(conversation.messages, TOOLS)
    again = history.plan(conversation.messages, TOOLS)
    assert first.prompt_ids == again.prompt_ids and history.stream == stream
    history.commit(first, [1, 2], [-0.1, -0.2], "length", 5, {"role": "assistant", "content": "x"})
    with pytest.raises(StalePlan):
        history.commit(again, [3], [-0.3], "stop", 5, {"role": "assistant", "content": "y"})
    # a truncated output (no <|im_end|>) gets the whole closing appended after it
    assert history.stream[-4:] == [1, 2] + history.renderer.close_ids


def test_rerender_history_renders_everything_and_refuses_stale_plans(tok):
    conversation = Conversation(random.Random(6), RerenderHistory(tok))
    for version in range(3):
        before = list(conversation.messages)
        plan, turn = conversation.step(tok, version)
        full = tok.apply_chat_template(before, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert plan.prompt_ids == tok.encode(full, add_special_tokens=False)
        assert (plan.new_chain, turn.turn_index) == (version == 0, version)
    stale = conversation.history.plan(conversation.messages, TOOLS)
    conversation.history.commit(stale, [1], [-0.1], "stop", 3, {"role": "assistant", "content": "a"})
    with pytest.raises(StalePlan):
        conversation.history.commit(stale, [1], [-0.1], "stop", 3, {"role": "assistant", "content": "a"})
    assert [c.history_mode for c in conversation.history.all_chains()] == ["rerender"]


def test_output_ending_with_endoftext_keeps_it_verbatim(tok):
    ids = SpecialIds.from_tokenizer(tok)
    conversation = start(tok, turns=1, stop_token_ids=ids.stop_token_ids)
    plan = conversation.history.plan(conversation.messages, TOOLS)
    output = tok.encode("Done.", add_special_tokens=False) + [ids.endoftext]
    conversation.history.commit(
        plan, output, [-0.1] * len(output), "stop", 1, {"role": "assistant", "content": "Done."}
    )
    assert conversation.history.stream[-len(output) - 1 :] == output + tok.encode(
        "\n", add_special_tokens=False
    )


def test_subagent_chains_interleave_and_fan_out_in_freeze_order(tok):
    main = start(tok, rng_seed=1, turns=2)
    sub = Conversation(random.Random(2), CanonicalHistory(tok, chain_name="main/agent-1"))
    sub.messages = [
        {"role": "system", "content": "You are a sub-agent for Claude Code."},
        {"role": "user", "content": "Find where the fixture is defined."},
    ]
    for version in range(3):  # requests alternate; each goes to the history it continues
        for conversation in (sub, main):
            owners = [h for h in (main.history, sub.history) if h.continues(conversation.messages, TOOLS)]
            assert owners == ([conversation.history] if conversation.history.turns else [])
            plan, _ = conversation.step(tok, version)
            assert plan.new_chain == (plan.reason == "first")
    finished = sub.history.freeze("subagent")
    assert finished.chain_id == "main/agent-1" and len(finished.turns) == 3
    main.step(tok, 4)
    chains = [finished] + main.history.all_chains()
    segments = fan_out(chains, "r", 2.0)
    assert [s.kind for s in segments] == ["subagent", "final"]
    assert [s.reward for s in segments] == [1.0, 1.0]
    assert all(
        sum(s.loss_mask) == sum(len(t.output_ids) for t in c.turns)
        for s, c in zip(segments, chains, strict=True)
    )
    assert sub.history.plan(sub.messages, TOOLS).reason == "first"


def test_normalised_assistant_ignores_key_order_whitespace_and_dropped_reasoning():
    sent = normalise_assistant(
        {
            "role": "assistant",
            "content": "Running it.\n",
            "reasoning_content": "think",
            "tool_calls": [tool_call("toolu_1", "Bash", {"command": "ls", "timeout": 5})],
        }
    )
    echoed = normalise_assistant(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Running it."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{ "timeout": 5,  "command": "ls" }'},
                }
            ],
        }
    )
    assert sent.echoed_by(echoed)
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    other_reasoning = AssistantMessage(echoed.text, "other thoughts", echoed.tool_calls)
    assert not sent.echoed_by(other_reasoning)
    other_id = AssistantMessage(echoed.text, "", (("toolu_2",) + echoed.tool_calls[0][1:],))
    assert not sent.echoed_by(other_id)


def test_echoed_schema_defaults_match_but_other_added_or_changed_arguments_do_not():
    """Claude Code 2.1.197 echoes Edit with ``"replace_all": false`` filled in from the tool's schema."""
    edit = {"file_path": "/w/a.py", "old_string": "x", "new_string": "y"}
    defaults = tool_defaults([
        {"type": "function", "function": {"name": "Edit", "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string"}, "replace_all": {"type": "boolean", "default": False}}}}},
    ])  # fmt: skip
    assert defaults == {"Edit": {"replace_all": False}}

    def echo(arguments: dict) -> AssistantMessage:
        return normalise_assistant({"role": "assistant", "content": "", "tool_calls": [
            tool_call("toolu_1", "Edit", arguments)]})  # fmt: skip

    sent = echo(edit)
    assert sent.echoed_by(echo(edit | {"replace_all": False}), defaults)
    assert not sent.echoed_by(echo(edit | {"replace_all": False}))  # no schema, no leniency
    assert not sent.echoed_by(echo(edit | {"replace_all": True}), defaults)
    assert not sent.echoed_by(echo(edit | {"new_string": "z", "replace_all": False}), defaults)
    assert not sent.echoed_by(echo(edit | {"dry_run": False}), defaults)
    assert not sent.echoed_by(echo({"file_path": "/w/a.py", "old_string": "x"}), defaults)


def test_chain_continues_when_the_client_fills_in_schema_defaults(tok, im_end):
    tools = [{"type": "function", "function": {"name": "Edit", "description": "Edit a file.", "parameters": {
        "type": "object", "properties": {"file_path": {"type": "string"},
                                         "replace_all": {"type": "boolean", "default": False}},
        "required": ["file_path"]}}}]  # fmt: skip
    history = CanonicalHistory(tok, stop_token_ids=[im_end])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix it"}]
    plan = history.plan(messages, tools)
    output = tok.encode(
        "ok\n</think>\n\n<tool_call>\n<function=Edit>\n<parameter=file_path>\n/w/a.py\n</parameter>\n"
        "</function>\n</tool_call>"
    ) + [im_end]
    sent = tool_call("toolu_1", "Edit", {"file_path": "/w/a.py"})
    history.commit(
        plan,
        output,
        [-0.1] * len(output),
        "stop",
        1,
        {"role": "assistant", "content": "", "reasoning_content": "ok", "tool_calls": [sent]},
    )
    echoed = tool_call("toolu_1", "Edit", {"replace_all": False, "file_path": "/w/a.py"})
    messages += [{"role": "assistant", "content": "", "tool_calls": [echoed]},
                 {"role": "tool", "tool_call_id": "toolu_1", "content": "done"}]  # fmt: skip
    follow = history.plan(messages, tools)
    assert (follow.new_chain, follow.reason) == (False, None)
    assert follow.prompt_ids[: len(plan.prompt_ids) + len(output)] == plan.prompt_ids + output


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), turns=st.integers(1, 8), split=st.booleans())
def test_random_conversations_never_drift(tok, seed, turns, split):
    conversation = Conversation(random.Random(seed), CanonicalHistory(tok))
    for version in range(turns):
        plan, _ = conversation.step(tok, version, split=split)
        assert plan.new_chain == (version == 0)
    tokens = segment_chain(conversation.history.turns)
    assert sum(tokens.loss_mask) == sum(len(t.output_ids) for t in conversation.history.turns)
    assert merge_turns_all(conversation.history.turns) == [tokens]


# Like Qwen's own Qwen3 template: reasoning is rendered only after the last user message, so a
# re-render rewrites history as soon as the user speaks again.
QWEN3_STYLE = """
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.index0 > ns.last_query -%}
{{- '<think>\n' ~ (m.reasoning_content or '') ~ '\n</think>\n\n' -}}
{%- endif -%}
{{- m.content or '' -}}
{%- for c in m.tool_calls or [] -%}
{{- '\n<tool_call>\n' ~ {'name': c.function.name, 'arguments': c.function.arguments} | tojson -}}
{{- '\n</tool_call>' -}}
{%- endfor -%}
{{- CLOSE -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' ~ m.content ~ '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}{{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}
"""


def with_template(close: str):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokenizer.chat_template = QWEN3_STYLE.replace("CLOSE", close)
    return tokenizer


def test_template_that_drops_old_reasoning_does_not_drift_canonical_chains():
    qwen3 = with_template("'<|im_end|>\\n'")
    kept, new_chains = {}, {}
    for mode in (CanonicalHistory, RerenderHistory):
        conversation = Conversation(random.Random(4), mode(qwen3), reasoning_rate=1.0)
        plans = [conversation.step(qwen3, version)[0] for version in range(8)]
        assert any(m["role"] == "user" for m in conversation.messages[3:])  # the user spoke again
        new_chains[mode.history_mode] = sum(p.new_chain for p in plans)
        kept[mode.history_mode] = kept_fraction(conversation.history)
    assert (kept["canonical"], new_chains["canonical"]) == (1.0, 1)
    assert kept["rerender"] < 1.0


def test_template_whose_closing_depends_on_what_follows_falls_back_to_a_full_render():
    odd = with_template("('<|im_end|>\\n' if loop.last else '<|im_end|>\\n\\n')")
    conversation = Conversation(random.Random(4), CanonicalHistory(odd))
    conversation.step(odd, 0)
    before = list(conversation.messages)
    plan, _ = conversation.step(odd, 1)
    assert (plan.new_chain, plan.reason) == (True, "window_check_failed")
    full = odd.apply_chat_template(before, add_generation_prompt=True, tokenize=False)
    assert plan.prompt_ids == odd.encode(full, add_special_tokens=False)
    assert [c.kind for c in conversation.history.all_chains()] == ["wipe", "final"]
