"""One endpoint for every wire protocol the agents speak, and the small interface each protocol implements.

A protocol (Anthropic Messages, OpenAI chat, Responses) is one :class:`WireProtocol` object in a module of
its own: it parses its request into the turn core's neutral input (:class:`Call`), says which agent of the
rollout sent it, and renders the core's :class:`~rollbus.services.adapter.assistant.AssistantTurn` (a JSON
body or an SSE stream) and its own errors. :func:`endpoint` runs what every route does before and after:
draining, the session token (checked again once the body is in), the body limit, attribution, sub-agent
hand-back, admission and the turn. A new protocol is one module and one entry in
:data:`rollbus.services.adapter.app.PROTOCOLS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from rollbus.services.adapter import edge
from rollbus.services.adapter.assistant import AssistantTurn
from rollbus.services.adapter.attribution import one_per_token
from rollbus.services.adapter.errors import ApiError
from rollbus.services.adapter.replies import answer
from rollbus.services.adapter.sessions import MAIN, Agent, RequestShape, Session
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.state import AdapterState
from rollbus.services.adapter.translate import ChatPrompt
from rollbus.services.adapter.turn import Started, TurnEvent, TurnInput, hand_back, settle_contests

R = TypeVar("R")  # a protocol's own validated request


@dataclass(frozen=True)
class Call(Generic[R]):
    """A request as its protocol parsed it: its own body (what rendering needs back) and the core's input."""

    request: R
    turn: TurnInput
    stream: bool


class WireProtocol(ABC, Generic[R]):
    """One API the adapter serves, on one route, to the harnesses whose session token opens it."""

    path: ClassVar[str]  # its route (POST)
    harness: ClassVar[str]  # the harness it serves (sessions.ROUTES maps every harness to its route)

    @abstractmethod
    def parse(self, body: bytes, settings: AdapterSettings) -> Call[R]:
        """The body validated (a 400 that says where, otherwise) and translated to the core's input."""

    def agent(self, session: Session, call: Call[R], request: Request) -> Agent:
        """The conversation of the rollout the request belongs to; by default one per session token."""
        return one_per_token(session, shape(call.turn.chat, request))

    def finished_subagents(self, session: Session, call: Call[R]) -> list[Agent]:
        """Sub-agents whose result main's request carries (their chains are complete); none by default."""
        return []

    def replay(self, agent: Agent, call: Call[R]) -> Response | None:
        """The answer owed from a turn already recorded (a cut stream retried), if the request asks it."""
        return None

    @abstractmethod
    def body(self, call: Call[R], turn: AssistantTurn) -> dict[str, Any]:
        """The finished turn as the non-streaming reply."""

    @abstractmethod
    def events(
        self, call: Call[R], agent: Agent, events: AsyncIterator[TurnEvent], started: Started
    ) -> AsyncIterator[bytes]:
        """The turn as the protocol's SSE stream; an error after the status line travels as its event."""

    @abstractmethod
    def error(self, err: ApiError) -> Response:
        """An error before the status line, in the shape the protocol's clients read."""


def shape(chat: ChatPrompt, request: Request, agent_id: str | None = None) -> RequestShape:
    """What attribution looks at: the translated request, the client's agent id if any, its peer."""
    return RequestShape(agent_id, chat.system, chat.messages, chat.tools, edge.peer(request))


async def endpoint(protocol: WireProtocol[Any], request: Request) -> Response:
    """One turn on ``protocol``'s route; every error before the reply starts leaves in its shape."""
    state: AdapterState = request.app.state.adapter
    settings = state.kit.settings
    try:
        state.refuse_if_draining()
        edge.grant(request, state.tokens, protocol.harness)
        call = protocol.parse(
            await edge.read_body(request, settings.body_limit, settings.body_timeout), settings
        )
        granted = edge.grant(request, state.tokens, protocol.harness)  # again: it may have closed meanwhile
        session = state.sessions.get(granted.rollout_id, granted.attempt_id)
        agent = protocol.agent(session, call, request)
        settle_contests(state.kit, session.contenders())
        if agent.kind == MAIN:
            hand_back(state.kit, protocol.finished_subagents(session, call))
        state.kit.metrics.count_route(agent)
        owed = protocol.replay(agent, call)
        if owed is not None:
            state.kit.metrics.stream_retries.inc()
            return owed

        def stream(events: AsyncIterator[TurnEvent], started: Started) -> AsyncIterator[bytes]:
            return protocol.events(call, agent, events, started)

        def render(turn: AssistantTurn) -> dict[str, Any]:
            return protocol.body(call, turn)

        return await answer(
            state, request, agent, call.turn, stream=stream if call.stream else None, render=render
        )
    except ApiError as err:
        return protocol.error(err)


def route(protocol: WireProtocol[Any]) -> Callable[[Request], Awaitable[Response]]:
    """The route function serving ``protocol`` (a plain function, as FastAPI reads its signature)."""

    async def serve(request: Request) -> Response:
        return await endpoint(protocol, request)

    serve.__name__ = f"serve_{type(protocol).__name__}"
    return serve
