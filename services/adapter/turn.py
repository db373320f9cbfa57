"""One turn of an agent: plan the prompt, generate, parse, commit and publish, in that order.

A turn is an async generator of :class:`Started`, :class:`Ping` and :class:`Done`, so the streaming and
the non-streaming routes share one path. Closing it early (the client went away) cancels the engine
call, which aborts it on the engine, and only then releases the agent; nothing is committed or
published then. A sampled turn is queued on the outbox and committed to the chain's history in one
step with no ``await`` between them, so memory and bus never disagree, whatever is cancelled when; the
turn waits (up to ``publish_wait``) for the bus to acknowledge it before :class:`Done` is yielded, so
normally no client sees a turn the bus has not got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rollbus.events import EventRecord, RoutedExperts, SessionEvent, TurnTimings
from rollbus.routed_experts import RoutesError, RoutesStore, from_sglang
from rollbus.services.adapter import records
from rollbus.services.adapter.assistant import AssistantTurn, stop_reason
from rollbus.services.adapter.errors import invalid_request, prompt_too_long, unauthenticated, upstream_failed
from rollbus.services.adapter.markup import ContentFormsMarkup
from rollbus.services.adapter.metrics import AdapterMetrics
from rollbus.services.adapter.provenance import TurnRef, signed_parts
from rollbus.services.adapter.publisher import Outbox
from rollbus.services.adapter.sessions import CONTESTED_CALL, SIDE, UNATTRIBUTED, Agent
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.sglang_client import (
    EngineError,
    EngineRejected,
    Generation,
    SGLangClient,
    TurnHeaders,
)
from rollbus.services.adapter.translate import ChatPrompt
from rollbus.trajectory import AMBIGUOUS, Turn
from rollbus.turn_log import prompt_reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnInput:
    """The translated request: what to render and how to sample."""

    chat: ChatPrompt
    model: str
    max_tokens: int
    sampling: dict[str, Any]  # temperature / top_p / top_k / stop, only those the request gave
    harness: str = ""  # the harness whose route it came through (its session token opens no other)


@dataclass(frozen=True)
class Started:
    turn: AssistantTurn  # no parts yet: its id, model and input_tokens


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Done:
    turn: AssistantTurn


TurnEvent = Started | Ping | Done


@dataclass
class TurnKit:
    """Everything a turn needs besides its agent: settings, engine, tokenizer, parser, bus, metrics."""

    settings: AdapterSettings
    engine: SGLangClient
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    parse: Callable[..., Any]  # rollbus.services.adapter.parsing.parse_output
    outbox: Outbox
    metrics: AdapterMetrics
    routes: RoutesStore | None = None  # set when the served model is an MoE whose routing is recorded


@dataclass
class Prepared:
    """A planned turn: the prompt (``rollbus.services.adapter.canonical.PromptPlan``) and how much it may
    generate."""

    plan: Any
    turn_id: str  # the AssistantTurn's id
    max_new_tokens: int
    routes_from: int | None = None  # the routed experts asked for start here (None: not asked)


async def run_turn(kit: TurnKit, agent: Agent, turn: TurnInput) -> AsyncGenerator[TurnEvent, None]:
    """Started (prompt planned) -> Ping... (engine working) -> Done (turn published)."""
    clock = time.monotonic()
    async with agent.lock:
        prepared = await prepare(kit, agent, turn)
        yield Started(AssistantTurn(prepared.turn_id, turn.model, input_tokens=len(prepared.plan.prompt_ids)))
        started_at = records.now_ms()
        generation = None
        # aclosing: a turn closed early cancels (and aborts) the engine call before the lock is let go
        async with contextlib.aclosing(generate(kit, agent, prepared, turn)) as steps:
            async for item in steps:
                if isinstance(item, Generation):
                    generation = item
                else:
                    yield item
        assert generation is not None, "generate() ends with the generation"
        answer = await finish(kit, agent, prepared, turn, generation, started_at)
        kit.metrics.turn_seconds.observe(time.monotonic() - clock)
        yield Done(answer)


async def prepare(kit: TurnKit, agent: Agent, turn: TurnInput) -> Prepared:
    """Plan the prompt and size the generation to what the context has left."""
    try:
        plan = await asyncio.to_thread(agent.history.plan, turn.chat.messages, turn.chat.tools)
    except ContentFormsMarkup as exc:  # content spelling chat markup with the template's text: refused
        raise invalid_request(str(exc)) from None
    prompt_len = len(plan.prompt_ids)
    context = kit.settings.context_length
    if prompt_len >= context:
        raise prompt_too_long(prompt_len, context)
    session, cap = agent.session, kit.settings.max_chains_per_rollout
    if plan.new_chain and session is not None and session.chains_opened >= cap:
        raise invalid_request(f"this rollout has opened {session.chains_opened} chains, the most allowed")
    max_new = min(kit.settings.max_new_tokens, turn.max_tokens, context - prompt_len)
    routes_from = routes_start(plan.prompt_ids, previous_turn(agent, plan)) if kit.routes else None
    return Prepared(plan, uuid.uuid4().hex, max_new, routes_from)


def previous_turn(agent: Agent, plan: Any) -> Turn | None:
    """The chain's last committed turn, which the planned prompt may extend (None on a new chain)."""
    return agent.history.turns[-1] if agent.history.turns and not plan.new_chain else None


def routes_start(prompt_ids: Any, previous: Turn | None) -> int:
    """The first position whose routed experts a turn must ask for: the rows its chain has not got yet.

    When the prompt extends the previous turn's prompt + output (what the turn event's reference encodes),
    that turn got rows up to its stream's second-to-last position (its last sampled token was never fed
    forward), so this one starts at that last token; otherwise from 0."""
    ref, _ = prompt_reference(prompt_ids, previous)
    if ref is None or previous is None:
        return 0
    return len(previous.prompt_ids) + len(previous.output_ids) - 1


async def generate(
    kit: TurnKit, agent: Agent, prepared: Prepared, turn: TurnInput
) -> AsyncGenerator[Ping | Generation, None]:
    """Wait for the engine, yielding a :class:`Ping` every ``ping_interval``; last, the generation."""
    params = {
        **turn.sampling,
        "max_new_tokens": prepared.max_new_tokens,
        "stop_token_ids": list(kit.stop_token_ids),
        "skip_special_tokens": False,
    }
    rid = f"rb-{uuid.uuid4().hex}"
    headers = TurnHeaders(agent.rollout_id, prepared.plan.chain_id, agent.kind, turn.harness)
    call = asyncio.create_task(
        kit.engine.generate(
            list(prepared.plan.prompt_ids),
            params,
            rid,
            headers,
            prepared.routes_from,
            kit.settings.top_logprobs,
        )  # fmt: skip
    )
    kit.metrics.in_flight.inc()
    try:
        with kit.metrics.engine_seconds.time():
            while not (await asyncio.wait({call}, timeout=kit.settings.ping_interval))[0]:
                yield Ping()
    finally:
        kit.metrics.in_flight.dec()
        if not call.done():
            call.cancel()
            await asyncio.wait({call})
    try:
        generation = call.result()
    except EngineRejected as exc:  # retrying cannot help: not a 500, which the CLI retries ten times
        raise invalid_request(f"the engine refused this request: {exc}") from exc
    except EngineError as exc:
        raise upstream_failed(str(exc)) from exc
    if generation.finish_type == "abort":
        raise upstream_failed(f"the engine aborted request {rid}")
    yield generation


async def finish(
    kit: TurnKit, agent: Agent, prepared: Prepared, turn: TurnInput, generation: Generation, started_at: int
) -> AssistantTurn:
    """Parse, sign the parts, commit the turn and publish it; returns the finished turn."""
    settings, plan = kit.settings, prepared.plan
    text = kit.tokenizer.decode(generation.output_ids, skip_special_tokens=False)
    parsed = await asyncio.to_thread(
        kit.parse,
        text,
        turn.chat.tools,
        tool_parser=settings.tool_parser,
        reasoning_parser=settings.reasoning_parser or None,
    )
    ref = TurnRef(agent.rollout_id, plan.chain_id, plan.turn_index)
    reasoning, text, calls = signed_parts(parsed, ref, settings.signing_key)
    stop, stop_sequence = stop_reason(generation.finish_type, bool(calls), generation.matched)
    answer = AssistantTurn(
        prepared.turn_id, turn.model, reasoning, text, calls, stop, stop_sequence,
        len(plan.prompt_ids), len(generation.output_ids),
    )  # fmt: skip
    sent = answer.chat_message()
    version = policy_version(generation.weight_version, settings.policy_version)
    sampled = Turn(
        plan.prompt_ids, generation.output_ids, generation.output_logprobs, generation.finish_type, version,
        chain_id=plan.chain_id, turn_index=plan.turn_index,
    )  # fmt: skip
    timings = TurnTimings(
        started_at=started_at, finished_at=records.now_ms(), generation_ms=generation.generation_ms
    )
    previous = previous_turn(agent, plan)
    routes = await store_routes(kit, prepared, generation)
    outbound: list[tuple[str, EventRecord]] = [("sessions", event) for event in chain_changes(agent, plan)]
    outbound.append(
        (
            "turns",
            records.turn_record(
                agent, sampled, previous, generation.rid, timings, routes, generation.top_logprobs
            ),
        )
    )
    if agent.kind == SIDE:  # a side call is one turn: its chain ends with it
        side_end = records.session_record(agent, plan.chain_id, "frozen", turn_count=1, reason="side")
        outbound.append(("sessions", side_end))
    if agent.closed:  # closed while generating: the bus already has its `closed` events
        raise unauthenticated("the session was closed while this turn was generating")
    # queue, then commit, with no await between: a record that cannot be queued leaves history as it was
    delivered = kit.outbox.enqueue((topic, record, agent.rollout_id) for topic, record in outbound)
    agent.history.commit(
        plan, generation.output_ids, generation.output_logprobs, generation.finish_type, version, sent
    )
    if plan.new_chain and agent.session is not None:
        agent.session.chains_opened += 1
    if agent.contested:  # claimed again while this turn generated: its chain ends here, with it
        _demote(kit, agent)
    kit.metrics.backlog.set(len(kit.outbox.backlog))
    await asyncio.wait({delivered}, timeout=settings.publish_wait)  # never cancels the delivery
    _count(kit.metrics, agent, plan, generation, stop)
    return answer


async def store_routes(kit: TurnKit, prepared: Prepared, generation: Generation) -> RoutedExperts | None:
    """The turn's routed experts put in the store; the reference its event carries. Routes that are missing
    or do not fit the sampled tokens are logged and left out: the turn still trains, on the trainer's own
    routing, rather than failing an agent over a side channel."""
    if kit.routes is None or prepared.routes_from is None:
        return None
    rows = len(prepared.plan.prompt_ids) + len(generation.output_ids) - 1 - prepared.routes_from
    try:
        if generation.routed_experts is None:
            raise RoutesError("the engine returned none (is it serving with --enable-return-routed-experts?)")
        ids = from_sglang(generation.routed_experts, rows)
        ref = await asyncio.to_thread(kit.routes.put, ids, prepared.routes_from)
    except (RoutesError, OSError) as exc:
        kit.metrics.routes_missing.inc()
        log.warning("request %s: routed experts not recorded: %s", generation.rid, exc)
        return None
    return RoutedExperts.from_dict(ref.as_record())


def chain_changes(agent: Agent, plan: Any) -> list[SessionEvent]:
    """Session events a committed plan implies: the live chain frozen (if rewritten), a chain opened."""
    if not plan.new_chain:
        return []
    events = []
    if agent.history.turns:
        events.append(
            records.session_record(
                agent,
                agent.history.chain_id,
                "frozen",
                turn_count=len(agent.history.turns),
                reason=plan.reason,
            )
        )
    events.append(records.session_record(agent, plan.chain_id, "opened", turn_count=0, reason=plan.reason))
    return events


def policy_version(reported: str | None, configured: int) -> int:
    """The engine's weight version when it reports a number, else the configured one."""
    if reported is not None and reported.lstrip("-").isdigit():
        return int(reported)
    return configured


def _count(
    metrics: AdapterMetrics, agent: Agent, plan: Any, generation: Generation, stop_reason: str
) -> None:
    metrics.turns.labels(agent.kind, stop_reason).inc()
    metrics.prompt_tokens.inc(len(plan.prompt_ids))
    metrics.reused_tokens.inc(plan.reused_tokens)
    metrics.output_tokens.inc(len(generation.output_ids))
    if plan.new_chain:
        metrics.new_chains.labels(plan.reason or "first").inc()


def hand_back(kit: TurnKit, agents: list[Agent]) -> None:
    """Freeze sub-agents whose results reached the main agent: their chains are complete segments.

    Queue and freeze happen together (no await), like a turn's queue and commit."""
    for agent in agents:
        if not agent.history.turns:
            continue
        chain_id, count = agent.history.chain_id, len(agent.history.turns)
        record = records.session_record(agent, chain_id, "frozen", turn_count=count, reason="subagent")
        kit.outbox.enqueue([("sessions", record, agent.rollout_id)])
        agent.history.freeze("subagent")


def settle_contests(kit: TurnKit, agents: list[Agent]) -> None:
    """End the chains of sub-agents whose Agent call another conversation claimed too (``ambiguous``:
    the segmenter never trains them); one with a turn in flight ends when that turn is committed."""
    for agent in agents:
        if not agent.lock.locked():
            _demote(kit, agent)


def _demote(kit: TurnKit, agent: Agent) -> None:
    """Queue and freeze together (no await), like a turn's queue and commit; later chains unattributed."""
    if agent.history.turns:
        chain_id, count = agent.history.chain_id, len(agent.history.turns)
        record = records.session_record(agent, chain_id, "frozen", turn_count=count, reason=AMBIGUOUS)
        kit.outbox.enqueue([("sessions", record, agent.rollout_id)])
        agent.history.freeze("subagent")
    agent.kind, agent.cause, agent.contested = UNATTRIBUTED, CONTESTED_CALL, False


def close_chains(kit: TurnKit, agents: Iterable[Agent], reason: str = "rollout_end") -> list[str]:
    """The rollout ended (or went idle): a ``closed`` event for every agent's live chain; their ids."""
    closed = []
    for agent in agents:
        if agent.history.turns:
            count = len(agent.history.turns)
            record = records.session_record(agent, agent.chain_id, "closed", turn_count=count, reason=reason)
            kit.outbox.enqueue([("sessions", record, agent.rollout_id)])
            closed.append(agent.chain_id)
    return closed
