"""Echo matching: an assistant message reduced to what survives a client round trip, and whether a
message a client sent back is the one we sampled (the client may drop reasoning, re-serialise tool inputs
and fill in schema defaults)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # one chat message as the client sent it (role, content, tool calls ...)


@dataclass(frozen=True)
class AssistantMessage:
    """An assistant message reduced to what survives a client round trip.

    Tool arguments are canonical JSON (sorted keys, no whitespace) because the Claude Code CLI
    re-serialises tool inputs; text and reasoning are stripped of surrounding whitespace.
    """

    text: str
    reasoning: str
    tool_calls: tuple[tuple[str, str, str], ...]  # (id, name, canonical JSON arguments)

    def echoed_by(self, echo: AssistantMessage, defaults: ToolDefaults | None = None) -> bool:
        """Whether ``echo`` is this message as sent back; the client may drop the reasoning.

        The Claude Code CLI validates tool inputs against their schemas and echoes them with schema
        defaults filled in (Edit comes back with ``"replace_all": false``): an echoed argument the model
        did not write is accepted when it equals that tool's schema default.
        """
        return (
            echo.text == self.text
            and echo.reasoning in ("", self.reasoning)
            and len(echo.tool_calls) == len(self.tool_calls)
            and all(
                _call_echoed(sent, back, defaults or {})
                for sent, back in zip(self.tool_calls, echo.tool_calls, strict=True)
            )
        )


ToolDefaults = dict[str, dict[str, Any]]  # tool name -> {argument: schema default}


def tool_defaults(tools: Sequence[dict] | None) -> ToolDefaults:
    """Each tool's JSON-schema ``default`` values, by tool and argument name."""
    found: ToolDefaults = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        defaults = {k: v["default"] for k, v in properties.items() if isinstance(v, dict) and "default" in v}
        if defaults:
            found[function["name"]] = defaults
    return found


def _call_echoed(sent: tuple[str, str, str], back: tuple[str, str, str], defaults: ToolDefaults) -> bool:
    if sent == back:
        return True
    if sent[:2] != back[:2]:
        return False
    ours, theirs = json.loads(sent[2]), json.loads(back[2])
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return False
    filled = defaults.get(sent[1], {})
    added = theirs.keys() - ours.keys()
    return (
        all(theirs[k] == ours[k] for k in ours.keys() & theirs.keys())
        and ours.keys() <= theirs.keys()
        and all(k in filled and theirs[k] == filled[k] for k in added)
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def canonical_json(value: Any) -> str:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def normalise_assistant(message: Message) -> AssistantMessage:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        calls.append((call.get("id", ""), function["name"], canonical_json(function.get("arguments", {}))))
    return AssistantMessage(
        text=_text(message.get("content")).strip(),
        reasoning=(message.get("reasoning_content") or "").strip(),
        tool_calls=tuple(calls),
    )
