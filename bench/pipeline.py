"""Load generator -> broker -> segmenter -> consumer of ``segments``, against raw aiokafka in the same run.

Run: ``python bench/pipeline.py --quick`` (a few rollouts at one rate, one worker: a smoke-sized figure),
``python bench/pipeline.py [--rates 2,4,8,16] [--rollouts 200] [--workers 2]`` for rising rates and 1 vs 2
workers, ``python bench/pipeline.py --soak 600 --in-flight 1000`` for the segmenter's RSS over time,
``python bench/pipeline.py --drain 1,2 --rollouts 200`` for what a second worker buys with no load generator
running beside the workers.

Synthetic rollouts are sized like Claude Code traffic: a ~19k-token opening prompt, 50-150-token suffixes,
50-500 sampled tokens a turn, 10-100 turns, some sub-agents and compactions. Each rollout's events are
published (turns, sessions, diff, then the reward) at the offered rate; a consumer reads ``segments`` and
records, per rollout, the time from its reward's ack to its last segment. The baseline is the same event
bytes produced by aiokafka to a plain topic and consumed back, in the same run on the same broker. Both
paths send bytes encoded before their clock starts, and neither consumer decodes: the load generator shares
the machine, and its own encoding and decoding are not what is measured.
Reported: rollouts sent per second (the load generator waits for each rollout's acks, so on a saturated
machine it sends fewer than offered), tokens/s, p50/p99 latency, the segmenter's RSS before and after, and
tokens per second of the worker's own CPU time (user + system), which other load on the machine disturbs far
less than tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollbus.codec import encode  # noqa: E402
from rollbus.kafka import clients  # noqa: E402
from rollbus.kafka.broker import EmbeddedBroker, free_port  # noqa: E402
from rollbus.kafka.bus import Publisher  # noqa: E402
from rollbus.kafka.topics import create_topics, spec_for, topic_name  # noqa: E402
from rollbus.services.segmenter.app import app_id  # noqa: E402
from rollbus.services.stack.supervisor import stop_group  # noqa: E402

PARTITIONS = 6
Event = tuple[str, dict[str, Any]]


@dataclass
class Rollout:
    """One synthetic rollout's events (topic, record) in publish order, and how many tokens they carry."""

    rollout_id: str
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    tokens: int = 0


def synth(rng: random.Random, rollout_id: str, *, turns: tuple[int, int], opening: int) -> Rollout:
    """A rollout written like the adapter writes it (prompt references), linear in its tokens."""
    rollout = Rollout(rollout_id, list(rollout_events(rng, rollout_id, turns=turns, opening=opening)))
    rollout.tokens = sum(tokens_of(topic, record) for topic, record in rollout.events)
    return rollout


def tokens_of(topic: str, record: dict[str, Any]) -> int:
    return len(record["prompt_ids"]) + len(record["output_ids"]) if topic == "turns" else 0


def rollout_events(
    rng: random.Random, rollout_id: str, *, turns: tuple[int, int], opening: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rollout's events, made one at a time (a soak keeps a thousand of these open at little cost)."""
    now, attempt = int(time.time() * 1000), "a1"

    def session(chain: str, kind: str, chain_kind: str, count: int, reason: str | None = None) -> Event:
        return ("sessions", {
            "rollout_id": rollout_id, "chain_id": chain, "kind": kind, "chain_kind": chain_kind,
            "reason": reason,
            "turn_count": count, "parent_chain_id": None, "at": now, "attempt_id": attempt,
        })  # fmt: skip

    def chain(name: str, kind: str, first_prompt: int, count: int) -> Iterator[Event]:
        yield session(name, "opened", kind, 0)
        stream = 0
        for index in range(count):
            new = first_prompt if index == 0 else rng.randint(50, 150)
            out = rng.randint(50, 500)
            yield ("turns", {
                "rollout_id": rollout_id, "chain_id": name, "chain_kind": kind, "turn_index": index,
                "prompt_ref_turn": None if index == 0 else index - 1,
                "prompt_ids": [rng.randrange(151_000) for _ in range(new)], "prompt_tokens": stream + new,
                "output_ids": [rng.randrange(151_000) for _ in range(out)],
                "output_logprobs": [-rng.random() for _ in range(out)], "finish_reason": "stop",
                "policy_version": 1, "request_id": f"{name}-{index}",
                "timings": {"started_at": now, "finished_at": now, "generation_ms": 1}, "attempt_id": attempt,
            })  # fmt: skip
            stream += new + out

    total = rng.randint(*turns)
    main_turns = total
    if rng.random() < 0.3:  # a sub-agent
        sub = max(1, total // 5)
        yield from chain("agent-1", "subagent", 3_000, sub)
        yield session("agent-1", "frozen", "subagent", sub, "subagent")
        main_turns -= sub
    if rng.random() < 0.2 and main_turns > 4:  # a compaction
        before = main_turns // 2
        yield from chain("main", "main", opening, before)
        yield session("main", "frozen", "main", before, "compaction")
        yield from chain("main.1", "main", 5_000, main_turns - before)
        yield session("main.1", "closed", "main", main_turns - before, "rollout_end")
    else:
        yield from chain("main", "main", opening, main_turns)
        yield session("main", "closed", "main", main_turns, "rollout_end")
    yield ("diffs", {
        "rollout_id": rollout_id, "patch": b"", "exit_status": 0, "wall_time_s": 1.0, "turns": total,
        "error": None,
        "at": now, "attempt_id": attempt, "group_id": "g", "group_size": 1,
    })  # fmt: skip
    yield ("rewards", {
        "rollout_id": rollout_id, "reward": 1.0, "solved": True, "applied_cleanly": True, "details": "{}",
        "failure_kind": None, "at": now, "attempt_id": attempt, "group_id": "g", "group_size": 1,
    })  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


Payload = list[tuple[str, bytes, bytes]]  # one rollout's (base topic, key, encoded event), reward last


def encoded(rollouts: list[Rollout]) -> list[Payload]:
    """Every rollout's events encoded once, before either clock starts: both paths send the same bytes and
    neither pays for making them (the load generator is not what is measured)."""
    return [
        [(t, r.rollout_id.encode(), encode(spec_for(t).event_type, rec)) for t, rec in r.events]
        for r in rollouts
    ]


def segments_expected(rollout: Rollout) -> int:
    """One segment per main or sub-agent chain that ended (frozen or closed): what fan_out cuts here."""
    return sum(
        1
        for topic, record in rollout.events
        if topic == "sessions" and record["kind"] != "opened" and record["chain_kind"] in ("main", "subagent")
    )


def producer(bootstrap: str) -> AIOKafkaProducer:
    """The load generator's producer, one for both paths (the adapter's settings: acks=all, idempotent)."""
    return clients.producer(bootstrap, client_id="rollbus-bench", acks="all", enable_idempotence=True,
                            max_request_size=9 * 2**20)  # fmt: skip


async def through_segmenter(
    bootstrap: str, ns: str, rollouts: list[Rollout], payloads: list[Payload], rate: float
) -> dict[str, float]:
    """Publish at ``rate`` rollouts/s (each rollout's events, acked, then its reward); latency = reward acked
    -> the rollout's last segment consumed. The consumer counts segments by key and decodes nothing, like
    the raw path's."""
    rewarded: dict[str, float] = {}
    done: dict[bytes, float] = {}
    expected = {r.rollout_id.encode(): segments_expected(r) for r in rollouts}
    consumer = clients.consumer(bootstrap, topic_name("segments", ns), client_id="rollbus-bench",
                                auto_offset_reset="earliest", fetch_max_bytes=64 * 2**20,
                                max_partition_fetch_bytes=16 * 2**20)  # fmt: skip
    await consumer.start()
    seen: dict[bytes, int] = {}

    async def consume() -> None:
        while len(done) < len(rollouts):
            batch = await consumer.getmany(timeout_ms=200)
            for message in (m for ms in batch.values() for m in ms):
                seen[message.key] = seen.get(message.key, 0) + 1
                if seen[message.key] == expected[message.key]:
                    done.setdefault(message.key, time.perf_counter())

    reader = asyncio.create_task(consume())
    load = producer(bootstrap)
    await load.start()
    start = time.perf_counter()
    try:
        for number, (rollout, messages) in enumerate(zip(rollouts, payloads, strict=True)):
            await asyncio.sleep(max(0.0, start + number / rate - time.perf_counter()))
            *events, (reward_topic, key, reward) = messages
            await asyncio.gather(*[await load.send(topic_name(t, ns), v, key=k) for t, k, v in events])
            await (await load.send(topic_name(reward_topic, ns), reward, key=key))
            rewarded[rollout.rollout_id] = time.perf_counter()
        await asyncio.wait_for(reader, timeout=600)
    finally:
        await load.stop()
        await consumer.stop()
    latencies = [done[r.encode()] - rewarded[r] for r in rewarded]
    elapsed = max(done.values()) - start
    return {"tokens_per_s": sum(r.tokens for r in rollouts) / elapsed, "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99), "elapsed": elapsed,
            "published_per_s": len(rollouts) / (max(rewarded.values()) - start)}  # fmt: skip


async def raw_aiokafka(
    bootstrap: str, ns: str, rollouts: list[Rollout], payloads: list[Payload], rate: float
) -> dict[str, float]:
    """The same encoded bytes produced to a plain topic and consumed back: what the bus alone costs."""
    topic = topic_name(f"raw-{uuid.uuid4().hex[:6]}", ns)
    async with clients.admin(bootstrap, client_id="rollbus-bench") as admin:
        await admin.create_topics(
            [NewTopic(topic, PARTITIONS, 1, topic_configs={"max.message.bytes": str(8 * 2**20)})]
        )
    load = producer(bootstrap)
    consumer = clients.consumer(bootstrap, topic, client_id="rollbus-bench",
                                auto_offset_reset="earliest",
                                fetch_max_bytes=64 * 2**20, max_partition_fetch_bytes=16 * 2**20)  # fmt: skip
    await load.start()
    await consumer.start()
    sent: dict[bytes, float] = {}
    arrived: dict[bytes, float] = {}
    total = sum(len(p) for p in payloads)

    async def consume() -> None:
        count = 0
        while count < total:
            batch = await consumer.getmany(timeout_ms=200)
            for message in (m for ms in batch.values() for m in ms):
                count += 1
                arrived[message.key] = time.perf_counter()  # the rollout's last message wins

    reader = asyncio.create_task(consume())
    start = time.perf_counter()
    for number, messages in enumerate(payloads):
        await asyncio.sleep(max(0.0, start + number / rate - time.perf_counter()))
        futures = [await load.send(topic, value, key=key) for _, key, value in messages]
        await asyncio.gather(*futures)
        sent[messages[0][1]] = time.perf_counter()
    await asyncio.wait_for(reader, timeout=600)
    await load.stop()
    await consumer.stop()
    latencies = [arrived[k] - sent[k] for k in sent]
    elapsed = max(arrived.values()) - start
    return {"tokens_per_s": sum(r.tokens for r in rollouts) / elapsed, "p50": percentile(latencies, 0.5),
            "p99": percentile(latencies, 0.99), "elapsed": elapsed,
            "published_per_s": len(payloads) / (max(sent.values()) - start)}  # fmt: skip


async def group_stable(bootstrap: str, group: str, members: int, timeout: float = 180) -> None:
    """Wait until the workers' consumer group is ``Stable`` with ``members`` members: a worker that joins
    while the clock runs makes a rebalance (and a recovery) part of the figure."""
    deadline = time.monotonic() + timeout
    async with clients.admin(bootstrap, client_id="rollbus-bench") as admin:
        while time.monotonic() < deadline:
            try:
                [response] = await admin.describe_consumer_groups([group])
                _, _, status, _, _, found, *_ = response.groups[0]
                if status == "Stable" and len(found) == members:
                    return
            except Exception:  # the group does not exist yet, its coordinator is still loading
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"consumer group {group} not stable with {members} member(s) after {timeout:.0f} s")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the worker runs in the ``rollbus`` process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ``rollbus`` under cProfile timed by the process's CPU clock (a wall-clock profile of a worker sharing two
# cores counts every moment another process ran as the worker's); stats written when Faust exits.
PROFILED = """
import cProfile, runpy, sys, time
out, sys.argv = sys.argv[1], ["rollbus", *sys.argv[2:]]
profile = cProfile.Profile(time.process_time)
profile.enable()
try:
    runpy.run_module("rollbus", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used: what the segmenter costs whatever else runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def start_workers(
    bootstrap: str, ns: str, state: Path, args: argparse.Namespace
) -> list[subprocess.Popen[bytes]]:
    """``args.workers`` workers in one group, given ``args.segmenter_args``; with ``args.profile`` each runs
    under cProfile, its stats written to ``<profile>/segmenter-<ns>-<n>.prof`` when it is terminated (Faust
    exits through SystemExit)."""
    count, profile = args.workers, args.profile
    workers = []
    for number in range(count):
        log = (state / f"segmenter-{number}.log").open("wb")
        python = [sys.executable]
        if profile:
            Path(profile).mkdir(parents=True, exist_ok=True)
            python += ["-c", PROFILED, str(Path(profile) / f"segmenter-{ns}-{number}.prof")]
        workers.append(subprocess.Popen(
            [*python, *([] if profile else ["-m", "rollbus"]), "segmenter", "--bootstrap-servers", bootstrap,
             "--namespace", ns,
             "--state-dir", str(state / f"w{number}"), "--log-level", "warning",
             *shlex.split(args.segmenter_args)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,  # its own process group, which stop_workers signals
        ))  # fmt: skip
    return workers


def stop_workers(workers: list[subprocess.Popen[bytes]], grace: float = 30) -> None:
    """Stop each worker as ``rollbus up`` does (SIGTERM to its group, SIGKILL after ``grace``): a worker far
    behind its input can take longer than that, and a bench never leaves one behind."""
    for worker in workers:
        stop_group(worker, grace)


async def bench(args: argparse.Namespace, bootstrap: str, state: Path) -> None:
    rng = random.Random(7)
    turns = (10, 20) if args.quick else (10, 100)
    results = []
    print(f"{'rate/s':>7} {'path':<10} {'sent/s':>7} {'tokens/s':>11} {'p50 s':>7} {'p99 s':>7} "
          f"{'RSS MB':>13} {'tokens/CPU s':>13}")  # fmt: skip
    for rate in args.rates:
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        await create_topics(bootstrap, PARTITIONS, ns)
        rollouts = [synth(rng, f"r{rate}-{i}", turns=turns, opening=19_000) for i in range(args.rollouts)]
        payloads = encoded(rollouts)
        workers = start_workers(bootstrap, ns, state, args)
        await group_stable(bootstrap, app_id(ns), len(workers))  # the clock starts after the join, not in it
        await asyncio.sleep(3)  # ...and after the tables' (empty) recovery
        before = sum(rss_mb(w.pid) for w in workers)
        cpu = sum(cpu_seconds(w.pid) for w in workers)
        try:
            ours = await through_segmenter(bootstrap, ns, rollouts, payloads, rate)
            after = sum(rss_mb(w.pid) for w in workers)
            cpu = sum(cpu_seconds(w.pid) for w in workers) - cpu
        finally:
            stop_workers(workers)
        raw = await raw_aiokafka(bootstrap, ns, rollouts, payloads, rate)
        tokens = sum(r.tokens for r in rollouts)
        rss = f"{before:.0f} -> {after:.0f}"
        rows = (("segmenter", ours, rss, f"{tokens / cpu:,.0f}"), ("raw", raw, "", ""))
        for name, row, rss, per_cpu in rows:
            print(f"{rate:>7g} {name:<10} {row['published_per_s']:>7.1f} {row['tokens_per_s']:>11,.0f} "
                  f"{row['p50']:>7.2f} "
                  f"{row['p99']:>7.2f} "
                  f"{rss:>13} {per_cpu:>13}")  # fmt: skip
        ratio = ours["tokens_per_s"] / raw["tokens_per_s"]
        print(
            f"{'':>7} ratio      {'':>7} {ratio:>11.2f} of raw throughput "
            f"({len(rollouts)} rollouts, {sum(r.tokens for r in rollouts):,} tokens, "
            f"{args.workers} worker(s))"
        )
        results.append((rate, ours, raw))
    print(summary(results))


async def drain(args: argparse.Namespace, bootstrap: str, state: Path) -> None:
    """For each W in ``--drain``: a group of W workers, stable before anything is sent, then every rollout
    published at once, as fast as the producer goes; tokens per second from the group's first segment to its
    last. No rate paces the load, so what one worker more buys is the workers' own figure."""
    rng = random.Random(13)
    turns = (10, 20) if args.quick else (10, 100)
    rollouts = [synth(rng, f"d-{i}", turns=turns, opening=19_000) for i in range(args.rollouts)]
    payloads = encoded(rollouts)
    tokens = sum(r.tokens for r in rollouts)
    expected = {r.rollout_id.encode(): segments_expected(r) for r in rollouts}
    print(f"{'workers':>7} {'tokens/s':>11} {'elapsed s':>10} {'tokens/CPU s':>13}")
    figures: dict[int, float] = {}
    for count in args.drain:
        ns = f"drain-{uuid.uuid4().hex[:6]}"
        await create_topics(bootstrap, PARTITIONS, ns)
        workers = start_workers(bootstrap, ns, state, argparse.Namespace(**{**vars(args), "workers": count}))
        consumer = clients.consumer(bootstrap, topic_name("segments", ns), client_id="rollbus-bench",
                                    auto_offset_reset="earliest", fetch_max_bytes=64 * 2**20,
                                    max_partition_fetch_bytes=16 * 2**20)  # fmt: skip
        load = producer(bootstrap)
        try:
            await group_stable(bootstrap, app_id(ns), count)
            await asyncio.sleep(3)  # the tables' (empty) recovery, as in the rate runs
            await consumer.start()
            await load.start()
            cpu = sum(cpu_seconds(w.pid) for w in workers)
            every = [message for messages in payloads for message in messages]
            sent = [await load.send(topic_name(t, ns), v, key=k) for t, k, v in every]
            seen: dict[bytes, int] = {}
            first = last = 0.0
            async with asyncio.timeout(900):
                while sum(seen.get(k, 0) >= n for k, n in expected.items()) < len(expected):
                    batch = await consumer.getmany(timeout_ms=200)
                    for message in (m for ms in batch.values() for m in ms):
                        first = first or time.perf_counter()
                        last = time.perf_counter()
                        seen[message.key] = seen.get(message.key, 0) + 1
            await asyncio.gather(*sent)
            cpu = sum(cpu_seconds(w.pid) for w in workers) - cpu
        finally:
            await load.stop()
            await consumer.stop()
            stop_workers(workers)
        elapsed = max(last - first, 1e-9)
        figures[count] = tokens / elapsed
        print(f"{count:>7} {figures[count]:>11,.0f} {elapsed:>10.1f} {tokens / cpu:>13,.0f}")
    one, most = min(figures), max(figures)
    print(f"ratio {most} workers / {one}: {figures[most] / figures[one]:.2f} of the tokens/s "
          f"({len(rollouts)} rollouts, {tokens:,} tokens, {os.cpu_count()} cores)")


def summary(results: list[tuple[float, dict[str, float], dict[str, float]]]) -> str:
    """The issue's two figures: best segmenter throughput over raw's best in the run, and the highest rate
    whose p99 stayed under a second: the rate rollouts were sent at, which falls short of the one offered
    once the load generator, which waits for each rollout's acks, shares a saturated machine."""
    best = max(ours["tokens_per_s"] for _, ours, _ in results)
    best_raw = max(raw["tokens_per_s"] for _, _, raw in results)
    under = [ours["published_per_s"] for _, ours, _ in results if ours["p99"] < 1.0]
    return (
        f"best: segmenter {best:,.0f} tokens/s, raw {best_raw:,.0f} (raw's best at these rates; its ceiling "
        f"may be higher): {best / best_raw:.2f}; p99 under 1 s up to "
        + (f"{max(under):.1f} rollouts/s sent" if under else "none of these rates")
    )


async def soak(args: argparse.Namespace, bootstrap: str, state: Path) -> None:
    """``--in-flight`` rollouts open at once, their events interleaved, for ``--soak`` seconds: the
    segmenter's RSS sampled every 10 s should stay flat (state is bounded by rollouts in flight)."""
    ns, rng = f"soak-{uuid.uuid4().hex[:6]}", random.Random(11)
    await create_topics(bootstrap, PARTITIONS, ns)
    workers = start_workers(bootstrap, ns, state, args)
    await group_stable(bootstrap, app_id(ns), len(workers))
    consumer = clients.consumer(bootstrap, topic_name("segments", ns), client_id="rollbus-bench",
                                auto_offset_reset="earliest",
                                max_partition_fetch_bytes=16 * 2**20)  # fmt: skip
    await consumer.start()
    segments = 0

    async def consume() -> None:
        nonlocal segments
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            segments += sum(len(ms) for ms in batch.values())

    reader = asyncio.create_task(consume())
    open_rollouts: list[Iterator[Event]] = []
    started = tokens = 0
    start = next_sample = time.perf_counter()
    print(f"{'t s':>5} {'RSS MB':>8} {'rollouts started':>17} {'segments out':>13} {'tokens/s in':>12}")
    samples: list[tuple[float, float]] = []
    try:
        async with Publisher(bootstrap, client_id="bench-soak") as publisher:
            while time.perf_counter() - start < args.soak:
                while len(open_rollouts) < args.in_flight:
                    seed = rng.randrange(2**32)
                    open_rollouts.append(rollout_events(random.Random(seed), f"s-{started}", turns=(10, 100),
                                                        opening=19_000))  # fmt: skip
                    started += 1
                pick = rng.randrange(len(open_rollouts))
                event = next(open_rollouts[pick], None)
                if event is None:
                    open_rollouts[pick] = open_rollouts[-1]
                    open_rollouts.pop()
                    continue
                await publisher.publish(topic_name(event[0], ns), event[1])
                tokens += tokens_of(*event)
                if time.perf_counter() >= next_sample:
                    elapsed = time.perf_counter() - start
                    rss = sum(rss_mb(w.pid) for w in workers)
                    rate = tokens / max(elapsed, 1e-9)
                    print(f"{elapsed:>5.0f} {rss:>8.0f} {started:>17} {segments:>13} {rate:>12,.0f}")
                    samples.append((elapsed, rss))
                    next_sample += 10
    finally:
        reader.cancel()
        await consumer.stop()
        stop_workers(workers)
    print(f"RSS slope over the second half: {slope(samples[len(samples) // 2 :]):.2f} MB/min")


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares MB per minute of (seconds, MB) samples; NaN with fewer than two."""
    if len(samples) < 2:
        return float("nan")
    mean_t = sum(t for t, _ in samples) / len(samples)
    mean_m = sum(m for _, m in samples) / len(samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rollouts at one rate (a smoke figure)")
    parser.add_argument("--rates", default="1,4,16", help="offered rollouts per second, comma-separated")
    parser.add_argument("--rollouts", type=int, default=100, help="rollouts per rate")
    parser.add_argument("--workers", type=int, default=1, help="segmenter workers in one consumer group")
    parser.add_argument("--soak", type=float, default=0, help="instead: a soak of this many seconds")
    parser.add_argument("--in-flight", type=int, default=1000, help="rollouts open at once in the soak")
    parser.add_argument("--segmenter-args", default="", help="more worker flags: '--forget-after 60'")
    parser.add_argument("--profile", default="", help="workers run under cProfile, stats here")
    parser.add_argument("--drain", default="", help="instead: fill the topics, then time groups of these "
                        "many workers draining them, comma-separated: '1,2'")
    parser.add_argument(
        "--bootstrap-servers", default="", help="use this cluster instead of an embedded broker"
    )
    args = parser.parse_args()
    args.rates = [8.0] if args.quick else [float(r) for r in args.rates.split(",")]
    args.rollouts = 12 if args.quick else args.rollouts
    args.drain = [int(w) for w in args.drain.split(",")] if args.drain else []
    with tempfile.TemporaryDirectory(prefix="rollbus-bench-") as scratch:
        state = Path(scratch)
        broker = None
        bootstrap = args.bootstrap_servers
        if not bootstrap:
            broker = EmbeddedBroker(state / "broker", port=free_port())
            broker.start(timeout=120)
            bootstrap = broker.bootstrap_servers
        try:
            run = soak if args.soak else drain if args.drain else bench
            asyncio.run(run(args, bootstrap, state))
        finally:
            if broker is not None:
                broker.stop()


if __name__ == "__main__":
    main()
