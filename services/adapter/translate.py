"""Anthropic conversation -> Hugging Face chat messages and tools, the input of the chat template.

Ids are kept verbatim (tool_use ids, thinking text), so a history the CLI echoes back renders to the
same tokens the model produced; cache markers are dropped; ``role: system`` messages in the middle of a
conversation are folded into an adjacent user turn as ``<system-reminder>`` text, as the CLI does itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollbus.services.adapter.anthropic import (
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    system_text,
)

IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


@dataclass(frozen=True)
class ChatPrompt:
    """What the chat template renders: messages and tool functions."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    system: str = ""


def to_chat(system: Any, messages: list[Message], tools: list[Tool] | None) -> ChatPrompt:
    text = system_text(system)
    chat: list[dict[str, Any]] = [{"role": "system", "content": text}] if text else []
    for message in fold_system_messages(messages):
        if message.role == "assistant":
            chat.append(assistant_message(message))
        else:
            chat.extend(user_messages(message))
    return ChatPrompt(chat, [tool_function(tool) for tool in tools or []], text)


def fold_system_messages(messages: list[Message]) -> list[Message]:
    """Mid-history system messages become ``<system-reminder>`` text in a user turn, chosen so that a
    growing conversation folds the same way every time (the canonical history depends on it):

    * right after a user message: appended to it (the CLI sends ``[user, system]``, then the same two
      followed by the assistant's turn);
    * otherwise: put in the next user message, after its tool results;
    * with no user message after it yet: a user message of its own.
    """
    folded: list[Message] = []
    waiting: list[str] = []
    for message in messages:
        if message.role == "system":
            if folded and folded[-1].role == "user" and not waiting:
                folded[-1] = _with_text(folded[-1], [reminder(message)], before=False)
            else:
                waiting.append(reminder(message))
        elif message.role == "user" and waiting:
            folded.append(_with_text(message, waiting, before=True))
            waiting = []
        else:
            if waiting:  # an assistant turn right after reminders: they stand alone
                folded.append(Message(role="user", content="\n\n".join(waiting)))
                waiting = []
            folded.append(message)
    if waiting:
        folded.append(Message(role="user", content="\n\n".join(waiting)))
    return folded


def reminder(message: Message) -> str:
    body = "\n\n".join(b.text for b in message.blocks() if isinstance(b, TextBlock))
    return f"<system-reminder>\n{body}\n</system-reminder>"


def _with_text(message: Message, texts: list[str], *, before: bool) -> Message:
    extra = [TextBlock(type="text", text=t) for t in texts]
    blocks = message.blocks()
    if before:
        # tool results must stay first: they answer the assistant turn just before
        n = sum(1 for _ in _leading_tool_results(blocks))
        blocks = blocks[:n] + extra + blocks[n:]
    else:
        blocks = blocks + extra
    return Message(role="user", content=blocks)


def _leading_tool_results(blocks: list[Any]):
    for block in blocks:
        if not isinstance(block, ToolResultBlock):
            return
        yield block


def user_messages(message: Message) -> list[dict[str, Any]]:
    """A user turn: each tool_result is a ``tool`` message; runs of text become one ``user`` message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.blocks():
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            out.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": tool_result_text(block)}
            )
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            texts.append(IMAGE_PLACEHOLDER)
    if texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def tool_result_text(block: ToolResultBlock) -> str:
    if isinstance(block.content, str):
        return block.content
    return "\n\n".join(b.text if isinstance(b, TextBlock) else IMAGE_PLACEHOLDER for b in block.content)


def assistant_message(message: Message) -> dict[str, Any]:
    """Thinking -> ``reasoning_content``; text -> ``content``; tool_use -> ``tool_calls`` (ids kept)."""
    blocks = message.blocks()
    reasoning = "\n\n".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    text = "\n\n".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out


def tool_function(tool: Tool) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
    }
