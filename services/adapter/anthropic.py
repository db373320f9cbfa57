"""The Anthropic Messages request, validated strictly so a malformed body is a clear 400, never a 500.

Only the fields the adapter acts on are modelled; unknown keys (``context_management``, ``output_config``,
``cache_control``, ...) are accepted and ignored, as the CLI adds new ones between versions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollbus.services.adapter.bodies import decode_json
from rollbus.services.adapter.errors import invalid_request

_STRICT = ConfigDict(strict=True, extra="ignore", frozen=True)
MAX_INT = 2**31 - 1  # what the engine's int fields hold; larger is a 400 here, not a failure there


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageBlock(BaseModel):
    """Accepted so a screenshot in history does not break the session; rendered as a placeholder."""

    model_config = _STRICT
    type: Literal["image", "document"]


class ThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultContent] = ""
    is_error: bool = False


ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[Any]:
        """Content as blocks: a bare string is one text block."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str = ""
    input_schema: dict[str, Any]


class MessagesRequest(BaseModel):
    model_config = _STRICT
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=MAX_INT)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT)  # 0: disabled, as Anthropic's API
    stop_sequences: list[str] | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling settings the request gave, under SGLang's names; the rest is the engine's."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,  # 0 is "no top-k"; the engine refuses 0
            "stop": self.stop_sequences,
        }
        return {name: value for name, value in given.items() if value is not None}


class CountTokensRequest(BaseModel):
    """``count_tokens`` takes the same conversation but no ``max_tokens``."""

    model_config = _STRICT
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None


def _describe(error: ValidationError) -> str:
    """The first few errors as ``path: reason``, the way API clients show them."""
    parts = []
    for item in error.errors(include_url=False)[:3]:
        path = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{path}: {item['msg']}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Validate a ``/v1/messages`` body: its schema, then the conversation rules the API enforces."""
    request = _validate(MessagesRequest, decode_json(body))
    check_conversation(request.messages)
    if request.messages[-1].role == "assistant":
        raise invalid_request(
            "messages: the last message must not be an assistant message (prefill is not supported)"
        )
    check_tools(request.tools or [])
    return request


def parse_count_tokens_request(body: bytes) -> CountTokensRequest:
    request = _validate(CountTokensRequest, decode_json(body))
    check_conversation(request.messages)
    check_tools(request.tools or [])
    return request


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(_describe(exc)) from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None


_ALLOWED = {
    "user": (TextBlock, ImageBlock, ToolResultBlock),
    "assistant": (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock),
    "system": (TextBlock,),
}


def check_conversation(messages: list[Message]) -> None:
    """Block kinds per role, and every tool_result answering a tool_use of the assistant turn before it."""
    pending: set[str] = set()
    seen_tool_use: set[str] = set()
    for i, message in enumerate(messages):
        for j, block in enumerate(message.blocks()):
            where = f"messages.{i}.content.{j}"
            if not isinstance(block, _ALLOWED[message.role]):
                raise invalid_request(
                    f"{where}: {block.type} blocks are not allowed in {message.role} messages"
                )
            if isinstance(block, ToolUseBlock):
                if block.id in seen_tool_use:
                    raise invalid_request(f"{where}: tool_use id {block.id!r} is used twice")
                seen_tool_use.add(block.id)
            if isinstance(block, ToolResultBlock) and block.tool_use_id not in pending:
                raise invalid_request(
                    f"{where}: tool_result for {block.tool_use_id!r} does not answer a tool_use block "
                    "of the previous assistant message"
                )
        if message.role == "assistant":
            pending = {b.id for b in message.blocks() if isinstance(b, ToolUseBlock)}
        elif message.role == "user":
            pending -= {b.tool_use_id for b in message.blocks() if isinstance(b, ToolResultBlock)}


def check_tools(tools: list[Tool]) -> None:
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise invalid_request(f"tools: tool names must be unique; repeated: {', '.join(duplicates)}")


def system_text(system: str | list[TextBlock] | None) -> str:
    """The system prompt as one string (blocks joined by blank lines, cache markers dropped)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(block.text for block in system)
