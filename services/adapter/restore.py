"""A restarted adapter picks up its rollouts from the bus: event sourcing applied to the adapter itself.

The ``sessions`` topic says which rollouts are still open (no ``closed`` event) and which of their chains
are live (``opened``, not yet ``frozen`` or ``closed``); the ``turns`` topic holds each live chain's
tokens. Only the turns since the oldest live chain opened are read (a seek by timestamp), so start-up
grows with what is open, not with every rollout the topics ever held. Tokens need no restoring (they are
signed); closed rollouts are revoked again so their tokens stay refused.

A restored chain knows its tokens but not the messages that produced them: the first request after the
restart continues it if that request's last assistant message carries the tool_use ids of the chain's
last turn (ids name their turn, see :mod:`rollbus.services.adapter.response`), else it starts a new chain.
Either way no turn is lost or duplicated, and every sampled token stays trainable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollbus.events import EventRecord, SessionEvent, TurnEvent
from rollbus.services.adapter.provenance import TurnRef, tool_use_id
from rollbus.services.adapter.sessions import MAIN, Agent, Session
from rollbus.trajectory import Turn

Records = Callable[[str, int | None], AsyncIterator[EventRecord]]  # (topic, since_ms) -> events
SINCE_SLACK_MS = 60_000  # clock skew between the adapter's `at` stamps and the broker's timestamps


@dataclass
class ChainLog:
    """What the bus says about one chain."""

    opened: SessionEvent  # its `opened` session event
    live: bool = True
    resumable: bool = True  # False: its turns on the bus conflict or start mid-chain; the next request
    # then starts the agent's next chain rather than continue this one
    last: Turn | None = None  # its newest turn, prompt resolved
    turns: int = 0


@dataclass
class BusLog:
    """The open rollouts' chains and when each closed rollout closed (ms)."""

    chains: dict[tuple[str, str], ChainLog] = field(default_factory=dict)
    closed: dict[str, int] = field(default_factory=dict)
    opened_chains: dict[str, int] = field(default_factory=dict)  # rollout -> chains it opened

    def live(self) -> dict[tuple[str, str], ChainLog]:
        return {key: chain for key, chain in self.chains.items() if chain.live and key[0] not in self.closed}

    def since_ms(self) -> int | None:
        live = self.live()
        if not live:
            return None
        return max(0, min(c.opened.at for c in live.values()) - SINCE_SLACK_MS)


def read_sessions(events: Iterable[EventRecord]) -> BusLog:
    """Fold ``session`` events (bus order) into the chains still live and the rollouts closed."""
    log = BusLog()
    for event in events:
        if not isinstance(event, SessionEvent):
            continue  # another event type on the topic: not ours
        rollout, chain = event.rollout_id, event.chain_id
        if event.kind == "opened":
            log.chains[(rollout, chain)] = ChainLog(event)
            log.opened_chains[rollout] = log.opened_chains.get(rollout, 0) + 1
        elif (rollout, chain) in log.chains:
            log.chains[(rollout, chain)].live = False
        if event.kind == "closed":
            log.closed[rollout] = max(log.closed.get(rollout, 0), event.at)
    for rollout in log.closed:  # only open rollouts are rebuilt: drop the rest now
        log.opened_chains.pop(rollout, None)
    log.chains = log.live()
    return log


def read_turns(log: BusLog, events: Iterable[EventRecord]) -> None:
    """Keep each live chain's newest turn, resolving prompt references against the one before it."""
    for turn in events:
        if not isinstance(turn, TurnEvent):
            continue  # another event type on the topic: not ours
        chain = log.chains.get((turn.rollout_id, turn.chain_id))
        if chain is None:
            continue
        seen = chain.last.turn_index if chain.last is not None else None
        if chain.last is not None and seen is not None and turn.turn_index <= seen:
            if turn.turn_index < seen or list(turn.output_ids) != chain.last.output_ids:
                chain.resumable = False  # a conflicting copy: which one the client saw is unknown
            continue  # an exact duplicate (a spill replayed after a crash): the same turn
        prompt = list(turn.prompt_ids)
        if turn.prompt_ref_turn is not None:
            base = chain.last
            if base is None or base.turn_index != turn.prompt_ref_turn:
                chain.resumable = False  # the chain's start is not on the bus: it cannot be continued
            else:
                prompt = base.prompt_ids + base.output_ids + prompt
        chain.last = Turn(
            prompt, list(turn.output_ids), [float(x) for x in turn.output_logprobs], turn.finish_reason,
            turn.policy_version, chain_id=turn.chain_id, turn_index=turn.turn_index,
        )  # fmt: skip
        chain.turns = turn.turn_index + 1


async def bus_records(bootstrap_servers: str) -> Records:
    """A :data:`Records` reader of the real bus (messages that do not decode are skipped: not ours)."""
    from rollbus.codec import CodecError
    from rollbus.kafka.replay import ReadPlan, read

    async def records(topic: str, since_ms: int | None) -> AsyncIterator[EventRecord]:
        plan = ReadPlan(topic, start="beginning" if since_ms is None else "since", since_ms=since_ms or 0)
        async for _, decoded in read(bootstrap_servers, plan):
            if not isinstance(decoded, CodecError):
                yield decoded.event

    return records


async def load(records: Records, namespace: str = "") -> BusLog:
    """Read the bus: every session event, then the turns since the oldest live chain opened."""
    from rollbus.kafka.topics import topic_name

    log = read_sessions([r async for r in records(topic_name("sessions", namespace), None)])
    since = log.since_ms()
    if since is not None:
        read_turns(log, [r async for r in records(topic_name("turns", namespace), since)])
    return log


def split_chain(chain_id: str) -> tuple[str, int]:
    """``main.2`` -> (``main``, 2); ``agent-ab12`` -> (``agent-ab12``, 0)."""
    name, _, number = chain_id.rpartition(".")
    return (name, int(number)) if name and number.isdigit() else (chain_id, 0)


def echoes_turn(rollout_id: str, chain_id: str, turn_index: int) -> Callable[[Mapping[str, Any]], bool]:
    """Whether an echoed assistant message is that turn's: its tool_use ids are the ones we minted."""
    ref = TurnRef(rollout_id, chain_id, turn_index)

    def check(message: Mapping[str, Any]) -> bool:
        ids = [call.get("id") for call in message.get("tool_calls") or ()]
        return bool(ids) and ids == [tool_use_id(ref, i) for i in range(len(ids))]

    return check


def restore(state: Any, log: BusLog) -> int:
    """Rebuild the open rollouts' sessions in ``state`` (an ``AdapterState``); returns how many."""
    for rollout, closed_at in log.closed.items():
        state.tokens.revoke(rollout, at=closed_at / 1000)
    sessions: dict[str, Session] = {}
    mains_first = sorted(log.chains.items(), key=lambda item: split_chain(item[0][1])[0] != MAIN)
    for (rollout, chain_id), chain in mains_first:
        if not chain.live or chain.last is None or chain.opened.chain_kind == "side":
            continue
        opened = chain.opened
        session = sessions.get(rollout)
        if session is None:
            session = sessions[rollout] = state.sessions.get(rollout, opened.attempt_id)
            session.chains_opened = log.opened_chains.get(rollout, 0)
        name, number = split_chain(chain_id)
        history = state.sessions.new_history(name)
        is_ours = echoes_turn(rollout, chain_id, chain.turns - 1) if chain.resumable else _never
        history.resume(_turns(chain), number, is_ours)
        parent = session.agents.get(MAIN) if name != MAIN else None
        agent = Agent(rollout, name, opened.chain_kind, history, None, parent, session=session)
        agent.agent_id, agent.parent_tool_use_id = opened.agent_id, opened.parent_tool_use_id
        if agent.parent_tool_use_id:
            session.claimed.add(agent.parent_tool_use_id)
        session.agents[name] = agent
    now = state.sessions.clock()
    for session in sessions.values():
        session.last_active = now
    return len(sessions)


def _never(message: Mapping[str, Any]) -> bool:
    return False


def _turns(chain: ChainLog) -> list[Turn]:
    """The chain's turns as the history holds them: the newest in full, the earlier ones as counts only
    (nothing reads them after a restart but their number)."""
    assert chain.last is not None
    placeholder = Turn([], [], [], "", 0, chain_id=chain.last.chain_id)
    return [placeholder] * (chain.turns - 1) + [chain.last]
