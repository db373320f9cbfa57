"""What the adapter holds per session, and how long a restart takes to rebuild its sessions.

Run: ``python bench/adapter_overhead.py --state [--quick]`` (or this file directly).

* Memory: live sessions driven the way the CLI drives them (a main agent, 100 turns of a Read call and a
  tool result, the echoed history growing to the context size) through the adapter's real history (real
  tokenizer and chat template, canonical mode), in this process. Reports RSS growth per session, the
  tokens it holds, and the growth beyond those tokens at 4 bytes each.
* Restart: a bus of N finished and M open rollouts (session and turn records shaped as the adapter
  publishes them, kept in memory and read as the broker would: the session topic whole, the turn topic
  from the oldest open chain's timestamp) folded into live sessions by
  :mod:`rollbus.services.adapter.restore`. Reading from Kafka adds the fetch time of the same records; the
  fold is what grows with the topics.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollbus.events import SessionEvent, TurnEvent, TurnTimings  # noqa: E402
from rollbus.services.adapter.canonical import CanonicalHistory  # noqa: E402
from rollbus.services.adapter.restore import load, restore  # noqa: E402
from rollbus.services.adapter.settings import AdapterSettings  # noqa: E402
from rollbus.tokenizer import SpecialIds, load_tokenizer  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Read",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        },
    }
]


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def drive_session(history: CanonicalHistory, tokenizer: Any, turns: int, context: int) -> int:
    """One main agent through ``turns`` turns reaching about ``context`` tokens; returns its tokens."""
    per_turn = max(1, context // turns)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are Claude Code, a coding agent."},
        {"role": "user", "content": "Fix the bug."},
    ]
    filler = "x = 1  # line of code\n"
    for i in range(turns):
        plan = history.plan(messages, TOOLS)
        call = {
            "id": f"toolu_{i}",
            "type": "function",
            "function": {"name": "Read", "arguments": {"file_path": f"/f{i}"}},
        }
        text = f"<tool_call>\n<function=Read>\n<parameter=file_path>\n/f{i}\n</parameter>\n"
        text += "</function>\n</tool_call>"
        output = tokenizer.encode(text, add_special_tokens=False)
        sent = {"role": "assistant", "content": "", "tool_calls": [call]}
        history.commit(plan, output, [-0.5] * len(output), "stop", 0, sent)
        result = filler * max(1, (per_turn - len(output) - 10) // 7)
        messages += [sent, {"role": "tool", "tool_call_id": f"toolu_{i}", "content": result}]
    return len(history.stream)


def memory(sessions: int, turns: int, context: int) -> None:
    tokenizer = load_tokenizer("qwen3.6")
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    warm = CanonicalHistory(tokenizer, stop_token_ids=stops, keep_frozen=False)
    drive_session(warm, tokenizer, 3, 3000)  # template and tokenizer caches, not sessions
    del warm
    before = rss()
    kept, tokens = [], 0
    started = time.perf_counter()
    for _ in range(sessions):
        history = CanonicalHistory(tokenizer, stop_token_ids=stops, keep_frozen=False)
        tokens += drive_session(history, tokenizer, turns, context)
        kept.append(history)
    elapsed = time.perf_counter() - started
    grown = rss() - before
    per_session, per_tokens = grown / sessions, tokens / sessions
    print(
        f"memory: {sessions} live sessions of {turns} turns, {per_tokens:,.0f} tokens each ({elapsed:.1f} s)"
    )
    print(f"  RSS growth per session      {per_session / 2**20:8.2f} MiB")
    print(f"  its tokens at 4 bytes       {per_tokens * 4 / 2**20:8.2f} MiB")
    print(f"  beyond the tokens           {(per_session - per_tokens * 4) / 2**20:8.2f} MiB (aim: < 1 MiB)")
    print(f"  ratio RSS growth / tokens at 4 bytes: {per_session / max(per_tokens * 4, 1):.2f}x")


def bus(
    finished: int, open_rollouts: int, turns: int, prompt: int
) -> tuple[dict[str, list], dict[str, list]]:
    """Session and turn events, oldest first; each stamped with the time the broker got it."""
    sessions: list[tuple[int, SessionEvent]] = []
    turn_records: list[tuple[int, TurnEvent]] = []
    clock = 1_700_000_000_000
    for n in range(finished + open_rollouts):
        rollout, at = f"r-{n}", clock + n * 1000
        base = {"rollout_id": rollout, "chain_id": "main", "chain_kind": "main", "attempt_id": "", "at": at,
                "turn_count": 0}  # fmt: skip
        sessions.append((at, SessionEvent.from_dict({**base, "kind": "opened"})))
        timings = TurnTimings(started_at=at, finished_at=at, generation_ms=0)
        for i in range(turns):
            suffix = list(range(prompt if i == 0 else 40))
            output = list(range(100, 130))
            record = TurnEvent(
                rollout_id=rollout, chain_id="main", chain_kind="main", turn_index=i,
                prompt_ref_turn=None if i == 0 else i - 1, prompt_ids=suffix, prompt_tokens=len(suffix),
                output_ids=output, output_logprobs=[-0.5] * 30, finish_reason="stop", policy_version=0,
                request_id=f"{rollout}-{i}", timings=timings,
            )  # fmt: skip
            turn_records.append((at + i, record))
        if n < finished:
            closed = {**base, "kind": "closed", "at": at + turns, "turn_count": turns}
            sessions.append((at + turns, SessionEvent.from_dict(closed)))
    return {"sessions": sessions, "turns": turn_records}, {}


async def restart(finished: int, open_rollouts: int) -> None:
    from rollbus.services.adapter.state import AdapterState, build_state

    topics, _ = bus(finished, open_rollouts, turns=5, prompt=2000)
    read = {"sessions": 0, "turns": 0}

    async def records(topic: str, since_ms: int | None):
        for stamp, record in topics[topic]:
            if since_ms is None or stamp >= since_ms:
                read[topic] += 1
                yield record

    settings = AdapterSettings(signing_key=b"k" * 32)
    state: AdapterState = build_state(
        settings, _NoBus(), tokenizer=None, http=None, parse=lambda *a, **k: None
    )
    started = time.perf_counter()
    log = await load(records)
    loaded = time.perf_counter()
    count = restore(state, log)
    done = time.perf_counter()
    total = sum(len(v) for v in topics.values())
    print(f"restart: {finished:,} finished + {open_rollouts} open rollouts, {total:,} records on the bus")
    print(
        f"  read {read['sessions']:,} session and {read['turns']:,} turn records in {loaded - started:.3f} s"
    )
    print(f"  rebuilt {count} open sessions in {done - loaded:.3f} s; total {done - started:.3f} s")
    await state.kit.engine.http.aclose()


class _NoBus:
    async def publish_bytes(self, topic: str, value: bytes, *, key: Any) -> None:
        raise AssertionError("a rebuild publishes nothing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few sessions, a smaller bus")
    args = parser.parse_args(argv)
    if args.quick:  # a smoke run: the figures of the docs come from the full one
        memory(sessions=2, turns=10, context=4_000)
        asyncio.run(restart(finished=100, open_rollouts=2))
    else:
        memory(sessions=10, turns=100, context=64_000)
        asyncio.run(restart(finished=10_000, open_rollouts=100))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
