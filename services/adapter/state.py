"""What one adapter process holds: the turn kit, sessions, admission (concurrency, drain, bus room)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from rollbus.routed_experts import RoutesStore
from rollbus.services.adapter.engine_http import EngineHTTP
from rollbus.services.adapter.errors import overloaded, unavailable
from rollbus.services.adapter.metrics import AdapterMetrics
from rollbus.services.adapter.publisher import BacklogFull, BytePublisher, Outbox
from rollbus.services.adapter.sessions import Sessions
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.sglang_client import SGLangClient
from rollbus.services.adapter.tokens import SessionTokens
from rollbus.services.adapter.turn import TurnKit

log = logging.getLogger(__name__)


@dataclass
class AdapterState:
    kit: TurnKit
    tokens: SessionTokens
    sessions: Sessions
    renderer: Any  # rollbus.services.adapter.canonical.TemplateRenderer, for count_tokens
    active: int = 0
    draining: bool = False
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise unavailable(
                "the adapter is shutting down; retry on another replica or later",
                self.kit.settings.retry_after,
            )

    def admit(self) -> None:
        """Take a generation slot and bus room for one turn, or refuse with a retryable error."""
        self.refuse_if_draining()
        settings = self.kit.settings
        if self.active >= settings.max_concurrency:
            raise overloaded(
                f"{self.active} turns are generating (limit {settings.max_concurrency})", settings.retry_after
            )
        try:
            self.kit.outbox.reserve()
        except BacklogFull as exc:
            raise unavailable(f"the event bus is unreachable: {exc}", settings.retry_after) from exc
        self.active += 1
        self._idle.clear()

    def release(self) -> None:
        self.kit.outbox.release()
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new turns and wait for those in flight; True if all finished in time."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def build_state(
    settings: AdapterSettings, publisher: BytePublisher, *, tokenizer: Any, http: Any, parse: Any
) -> AdapterState:
    """Load what was not given (tokenizer, parser, HTTP pool) and wire the turn kit."""
    from rollbus.services.adapter.canonical import CanonicalHistory, RerenderHistory, TemplateRenderer
    from rollbus.tokenizer import SpecialIds, load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(settings.tokenizer)
    if parse is None:
        from rollbus.services.adapter.parsing import parse_output as parse
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    history_class = CanonicalHistory if settings.history_mode == "canonical" else RerenderHistory
    http = http or EngineHTTP(
        settings.sglang_url,
        timeout=settings.engine_timeout,
        connect_timeout=settings.engine_connect_timeout,
        max_connections=settings.max_concurrency + 8,
        # idle connections are dropped before the engine's server drops them (uvicorn: 5 s): reusing one it
        # is closing loses the request (a ReadError, seen when Codex's spawn left the engine idle ~5 s)
        keepalive=settings.engine_keepalive,
    )
    outbox = Outbox(
        publisher,
        capacity=settings.outbox_capacity,
        capacity_bytes=settings.outbox_capacity_bytes,
        retry_interval=settings.bus_retry_interval,
        namespace=settings.topic_namespace,
        state_dir=settings.state_dir,
    )
    kit = TurnKit(
        settings,
        SGLangClient(http, settings.engine_api_key, abort_timeout=settings.abort_timeout),
        tokenizer,
        stops,
        parse,
        outbox,
        AdapterMetrics(),
        RoutesStore(settings.routes_dir()) if settings.routed_experts else None,
    )

    def new_history(name: str) -> Any:
        return history_class(tokenizer, stop_token_ids=stops, chain_name=name, keep_frozen=False)

    tokens = SessionTokens(settings.signing_key, open_sessions=settings.open_sessions, ttl=settings.token_ttl)
    sessions = Sessions(new_history, note=lambda cause: kit.metrics.ambiguous.labels(cause).inc())
    return AdapterState(kit, tokens, sessions, TemplateRenderer(tokenizer))


def warm_up(state: AdapterState) -> None:
    """Import SGLang's parsers now (seconds) rather than inside the first turn."""
    state.kit.parse(
        "",
        [],
        tool_parser=state.kit.settings.tool_parser,
        reasoning_parser=state.kit.settings.reasoning_parser or None,
    )


async def shutdown(state: AdapterState, *, close_http: bool) -> None:
    """Drain: finish turns in flight, get their records to the bus, keep on disk what could not go."""
    settings = state.kit.settings
    if not await state.drain(settings.drain_timeout):
        log.error("%d turns still running after %.0f s of drain", state.active, settings.drain_timeout)
    await state.kit.outbox.flush(settings.drain_timeout)
    spilled = state.kit.outbox.spill()
    if spilled:
        log.error("%d records never reached the bus; kept in %s", spilled, settings.state_dir)
    if close_http:
        await state.kit.engine.http.aclose()
