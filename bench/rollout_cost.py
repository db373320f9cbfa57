"""rollbus's own CPU per rollout: adapter, sandbox runner, grader, segmenter (each with its bus clients),
from process CPU counters over a scripted run, beside the agent CLI's own CPU in the same run.

Run: ``python bench/rollout_cost.py [--rollouts 4] [--turns 50] [--idle 20]``; ``--quick``: 1 rollout of 5
turns after 3 s idle. Starts the stack of ``rollbus up`` (embedded broker, scripted engine, adapter, sandbox
runner, grader, segmenter, trainer; no gym runner) in a temporary state dir, with a script that makes every
rollout of swe-mini's first row ``--turns`` turns of real Claude Code tool calls (Read, then a final answer).
First each service's CPU is read over ``--idle`` seconds of the stack up with nothing submitted: its idle
rate (bus clients' fetches and heartbeats, uvicorn's and Faust's timers). Then it submits ``--rollouts``
samples of the row and waits until each is graded and segmented. Measured between the submit and the last
segment, from each service's process CPU counters (user + system of its own process, threads included, not
its children), split into idle (the idle rate times the run's wall time: it grows with a loaded machine or a
slow engine, and shrinks per rollout as rollouts run side by side) and work (the rest: what the rollouts
themselves cost). The agent CLI (Claude Code's node process and what it starts, in the runner's sandboxes)
is measured from its processes' counters, sampled every 0.1 s, and the engine (the model's forward passes)
and trainer (a group without reward variance trains nothing) are shown apart, not counted. Prints the split
per service per 50-turn rollout (a run of fewer turns is scaled, per-rollout costs such as the first turn's
full render and the sandbox's boot with it: ``--quick`` overstates), the totals (the issue's aim: at most
0.2 CPU-s) and their ratio to the agent CLI's own CPU.

Measured on the shared 2-core machine (load ~12 from other work), 2 rollouts of 50 turns, ``--idle 20``, main
(2cec57e) and this branch run side by side so both saw the same load; CPU-s per 50-turn rollout, work + idle:
  main:   adapter 1.17 + 0.17, runner 0.68 + 0.34, grader 0.10 + 0.26, segmenter 0.28 + 0.60;
          rollbus 2.24 + 1.36 = 3.60, agent CLI 4.89, ratio 0.46 (work), 0.74 (with idle).
  branch: adapter 1.11 + 0.21, runner 0.27 + 0.34, grader 0.06 + 0.29, segmenter 0.35 + 0.55;
          rollbus 1.78 + 1.39 = 3.17, agent CLI 4.72, ratio 0.38 (work), 0.67 (with idle).
  The runner's work fell by the proxy reading the agent's TCP tables once per connection instead of both on
  every request (~8 ms of system time each: :mod:`rollbus.sandbox.peer`). Idle rates, CPU-ms per s: adapter
  ~2, runner ~4, grader ~3, segmenter ~6.5 (Faust); the same on both. Runs apart vary by 20-40% per service
  with the machine's load, so compare only runs made side by side.

Then (h5/cost), same command, before (b9d5515) and after back to back, load 21-39 (a CI clone and tests
running beside it, so walls of ~5 min and idle shares larger than above):
  before: adapter 1.00 + 0.26, runner 0.10 + 0.60, grader 0.02 + 0.52, segmenter 0.28 + 0.95;
          rollbus 1.40 + 2.32 = 3.72, agent CLI 4.63, ratio 0.30 (work), 0.80 (with idle); 344 s.
  after:  adapter 0.79 + 0.30, runner 0.29 + 0.38, grader 0.03 + 0.30, segmenter 0.32 + 0.75;
          rollbus 1.44 + 1.73 = 3.17, agent CLI 4.46, ratio 0.32 (work), 0.71 (with idle); 301 s.
  A second pair, load 13-20: before rollbus 1.43 + 1.34 = 2.78 (adapter 0.90 + 0.18, runner 0.18 + 0.35,
  grader 0.05 + 0.29, segmenter 0.31 + 0.53; 233 s), after 1.38 + 0.93 = 2.32 (adapter 0.84 + 0.12, runner
  0.28 + 0.20, grader 0.04 + 0.16, segmenter 0.22 + 0.45; 162 s); agent CLI 3.83 and 3.73.
  The adapter's work fell 6-21% (the two pairs): the engine request's JSON (the whole prompt's ids, every
  turn) by orjson, and a Messages stream's finished answer sent as one chunk. The grader's and runner's idle
  rates fell by 0.5-1 CPU-ms/s each (3.0 -> 2.0 and 3.5 -> 2.5; 2.5 -> 2.0 and 3.0 -> 2.5): their
  consumers' empty fetches wait 2 s on the broker, not 0.5 s (their ``--fetch-wait-ms``). (The runner's
  work rose only on paper: its lower idle rate leaves more of a lower total to work.) Still far from the
  aim. Profiled (py-spy on each service over a run), what is left: the adapter's ~16 ms per turn is
  rendering and tokenizing (a full render for every new chain, each of Claude Code's side calls included),
  Starlette and httpx per request, the bus record; the segmenter's is Faust's and aiokafka's own machinery
  (changelog writes, fetches, commits), and its idle rate (~5 CPU-ms/s) is the largest.

Then (h6/cost), ``--rollouts 4 --turns 50 --idle 20``, before (981a9cf) and after alternated, two pairs:
  pair 1, load 6-9:  before rollbus 1.17 + 0.45 = 1.62 (adapter 0.75 + 0.08, runner 0.23 + 0.08, grader
          0.02 + 0.08, segmenter 0.17 + 0.21; 155 s), after 1.16 + 0.23 = 1.39 (adapter 0.76 + 0.03, runner
          0.22 + 0.05, grader 0.01 + 0.05, segmenter 0.17 + 0.10; 91 s); agent CLI 2.98 and 2.68.
  pair 2, load 5-18: before 1.25 + 0.71 = 1.95 (segmenter 0.14 + 0.37; 225 s), after 1.21 + 0.73 = 1.94
          (segmenter 0.17 + 0.33; 264 s); agent CLI 3.24 and 3.25; ratio 0.38 / 0.60 and 0.37 / 0.60.
  The segmenter's idle rate fell 5.5 -> 4.5 and 6.5 -> 5.0 CPU-ms/s (and 5.75 -> 5.25 twice over, an idle
  segmenter alone): offsets committed every 3 s, not 1 s (``--commit-interval``). A tick every 30 s
  instead of 10 s changed nothing measurable (5.75 both), so it stays. The adapter's work did not move
  beyond the noise: this run has no side calls and one new chain per rollout (the adapter's metrics: 100
  ``/v1/messages`` requests, 100 turns, 2 chains, all ``first``), so the render kept across chains and
  rollouts (``services/adapter/markup.py``: the ~90k characters of system prompt and tools encoded once,
  a first prompt's ~55 ms -> ~6 ms) saves ~40 ms of ~800 per rollout here; it pays where side calls and
  compactions open chains. What the adapter's ~15 ms a turn is, from cProfile (main thread, CPU clock) and
  timed apart: the engine call through httpx (the largest single part under the profiler, ~1/3 of the
  main thread's run time), the request (decode + the Python check of every JSON node + validation +
  translation: 0.8-2 ms at 20-100 messages), the SSE response through Starlette, the turn record (its
  prompt-reference check 0.7 ms, Avro, the producer), and the plan and the parse in worker threads; no part
  above ~1/3, so the aim needs the request path rebuilt (raw HTTP to the engine, the body checked once per
  new message), not one fix.

Then (h7/runner), ``--rollouts 2 --turns 50 --idle 10``, main (697171c) and this branch alternated, load 7-13,
work + idle = total (the idle rate in CPU-ms/s), the run's wall, the agent CLI's CPU:
  pair 1: main    runner 0.24 + 0.13 = 0.36 (2.0), segmenter 0.17 + 0.31; rollbus 1.33 + 0.63; 125 s; 3.14.
          branch  runner 0.28 + 0.07 = 0.35 (1.0), segmenter 0.24 + 0.35; rollbus 1.41 + 0.84; 140 s; 3.95.
  pair 2: main    runner 0.30 + 0.19 = 0.48 (2.0), segmenter 0.26 + 0.46; rollbus 1.62 + 1.02; 185 s; 4.11.
          branch  runner 0.28 + 0.08 = 0.37 (1.0), segmenter 0.29 + 0.41; rollbus 1.53 + 0.97; 165 s; 4.09.
  pair 3: main    runner 0.35 + 0.16 = 0.51 (2.0), segmenter 0.24 + 0.48; rollbus 1.71 + 1.02; 160 s; 4.47.
          branch  runner 0.27 + 0.03 = 0.30 (1.0), segmenter 0.19 + 0.22; rollbus 1.58 + 0.40; 63 s; 3.55
          (the load fell from 12.7 to 6.7 during it).
  Ten seconds of idle read in 10 ms ticks is coarse; each service's threads read over 40 s of an idle stack
  (``/proc/<pid>/task/*/stat`` and ``voluntary_ctxt_switches``), main then branch: the runner 2.5 -> 1.5
  CPU-ms/s and 7.7 -> 3.7 wake-ups/s (an earlier pair: 2.5 -> 2.0). Its consumer's background fetcher
  (aiokafka) looked at its partitions every 200 ms whatever happened; now every 2 s
  (``--consumer-timeout-ms``), since every event that needs a fetch (records taken, a resume, a seek, a
  rebalance) wakes it at once. The runner and the segmenter also load the codec's schemas at start, not on
  their first event (a one-time ~0.1 CPU-s each, cProfile, that this bench counted as the first rollouts'
  work); the work figures above move less than their noise (+-0.05). Profiled (cProfile on a thread-CPU
  clock, py-spy), what is left: the runner's ~0.25 CPU-s a rollout is mostly the sandbox's life (the
  workspace copied and removed; bwrap, for the probe, the agent and the git capture, started with a
  ``preexec_fn`` that joins its cgroups, so forked, not spawned; the sessions API over httpx) plus ~1 ms a
  turn in the proxy (~0.9 ms on the event loop, and the peer check's walk of the host's ``/proc`` in a
  thread: a readlink of each process's PID namespace, ~0.65 ms with ~150 processes); the segmenter's rollbus
  code is ~1 ms a fact (decode ~0.45 ms, the state machine and its two table writes), the rest Faust's and
  aiokafka's own. The segmenter's idle ~6 CPU-ms/s (main thread ~2, consumer thread ~4.5 at ~10 wake-ups/s)
  is theirs and out of reach of Faust's settings: aiokafka's same 200 ms fetcher timer (half the consumer
  thread's wake-ups; Faust builds the consumer without ``consumer_timeout_ms``), Faust's 1 s drain and
  mode's 1.1 s thread keep-alive, each crossing between the two threads, and the commit livelock check
  (every 2.5 commit intervals, ~7 ms over ~44 partitions each time).

Then (h7/adapter), ``--rollouts 2 --turns 50 --idle 5``, main (697171c) and this branch alternated, two pairs
(``--idle 5`` makes the idle rates coarse: compare work and totals):
  pair 1, load 7.5-10.3: adapter before 1.04 + 0.19 = 1.23, after 0.70 + 0.10 = 0.81 (97 s and 102 s);
  pair 2, load 10.3-13.2: adapter before 1.14 + 0.15 = 1.30, after 0.80 + 0.18 = 0.98 (151 s and 179 s);
  rollbus work 1.11 -> 1.26 and 1.78 -> 1.42 (the other services unchanged, their work as noisy as ever).
  The adapter's work fell by 30-32% (21-23 -> 14-16 ms a turn on this loaded machine): the engine
  called over a lean keep-alive HTTP/1.1 client instead of httpx (``services/adapter/engine_http.py``:
  ~1.4 -> ~0.25 ms of CPU a call at a 20k-token prompt), the request body read by orjson (~0.4 -> ~0.17
  ms for Claude Code's ~100 KB), its nesting check visiting containers only, and the long-number guard
  before orjson a translate, not a regex (a regex over 100 KB cost ~1 ms). Measured apart too: the 50
  turns of one real rollout's captured bodies replayed to an adapter alone (real uvicorn and Avro, no
  broker, a stub engine), 3 rollouts each, alternated twice, load ~2: main 12.0 ms a turn at best (means
  15.1 and 16.1: its third rollout ran at ~21 ms both times), this branch 9.6-11.4 (means 12.3 and 10.3);
  the turn and session events of both byte-identical but for timings and request ids. What is left,
  timed per part on the main thread (thread CPU clock) in that replay: request parse ~1 ms at 100
  messages (validation, conversation check, translation), the turn record ~0.8 ms (``prompt_reference``
  ~0.6 ms: the 20k-token stream built as a list from the chain's array to compare), Avro + queueing ~0.8
  ms, Starlette/FastAPI/uvicorn (h11) around the route and the SSE stream ~2.5 ms, attribution ~0.3 ms,
  and in a worker thread the plan (the prompt as a list from the chain's array) and the parse ~1-2 ms.
  Next: the prompt kept as the list the engine is sent instead of rebuilt thrice from the array (at a
  memory cost per live chain), the request's messages validated once per chain, and a faster HTTP parser
  for uvicorn (httptools).

Then both merged (e15d033) against stop 40's tree (3718097), clean clones, ``--rollouts 2 --turns 50 --idle
10``, alternated, a quiet machine (load 2.6-3.4): adapter work 1.03 -> 0.72 and 1.01 -> 0.80, runner
0.26 -> 0.23 and 0.25 -> 0.28, segmenter 0.23 -> 0.23 and 0.22 -> 0.26; rollbus work 1.54 -> 1.18 and
1.47 -> 1.35 (with idle 1.76 -> 1.39 and 1.70 -> 1.56); agent CLI 3.1-3.4; ratio (work) 0.49 -> 0.37 and
0.48 -> 0.39. Still 6-7x the aim.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollbus.services.stack.demo import prepare  # noqa: E402
from rollbus.services.stack.progress import Progress, watch  # noqa: E402
from rollbus.services.stack.settings import EXAMPLES, StackSettings  # noqa: E402
from rollbus.services.stack.up import running_stack  # noqa: E402

ROLLBUS = ("adapter", "sandbox-runner", "grader", "segmenter")  # what a rollout costs rollbus
APART = ("engine", "trainer")  # the model's forward passes; the learner
DATASET = EXAMPLES / "swe-mini" / "demo.jsonl"


def script(turns: int) -> dict:
    """``turns`` turns of Claude Code tool calls: Read a file of the task's repository, then an answer."""
    read = (
        "Read the code once more.\n</think>\n\n<tool_call>\n<function=Read>\n<parameter=file_path>\n"
        "/workspace/tests/test_search.py\n</parameter>\n</function>\n</tool_call>"
    )
    return {"turns": [read] * (turns - 1) + ["Done reading.\n</think>\n\nNothing to change."]}


def own_cpu(pid: int) -> float:
    """User + system seconds of the process itself (its threads, not its children)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


class AgentMeter:
    """The agent CLI's CPU: every process whose command line names the CLI, and their descendants, under the
    runner; each process's last seen counters, sampled (a process's final fraction of a sample is lost)."""

    def __init__(self, runner_pid: int) -> None:
        self.runner_pid = runner_pid
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> user + system

    def sample(self) -> None:
        try:
            tree = psutil.Process(self.runner_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        agents = set()
        for proc in tree:
            try:
                if "claude" in " ".join(proc.cmdline()).lower():
                    agents.add(proc.pid)
                    agents.update(p.pid for p in proc.children(recursive=True))
            except psutil.Error:
                continue
        for proc in tree:
            if proc.pid not in agents:
                continue
            try:
                times, born = proc.cpu_times(), proc.create_time()
            except psutil.Error:
                continue
            self.seen[(proc.pid, born)] = times.user + times.system

    def total(self) -> float:
        return sum(self.seen.values())


async def run(rollouts: int, turns: int, idle: float) -> dict:
    """The measured run; SIGTERM or SIGINT cancels it, so the stack is stopped on the way out."""
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    with tempfile.TemporaryDirectory(prefix="rollout-cost-") as tmp:
        scripts = Path(tmp) / "scripts"
        scripts.mkdir()
        row = json.loads(DATASET.read_text().splitlines()[0])
        task_name = row["metadata"]["instance_id"]
        (scripts / f"{task_name}.json").write_text(json.dumps(script(turns)))
        image = row["metadata"]["image"]  # relative to the dataset it came from
        row["metadata"]["image"] = str((DATASET.parent / image).resolve())
        dataset = Path(tmp) / "one-row.jsonl"
        dataset.write_text(json.dumps(row) + "\n")
        await asyncio.to_thread(prepare, DATASET)
        settings = StackSettings(
            state_dir=Path(tmp) / "state", script=scripts, gym=False, group_size=rollouts,
            runner_concurrency=2, namespace="cost",
        )  # fmt: skip
        async with running_stack(settings, lambda name, what: None) as (stack, supervisor):
            pids = {child.spec.name: child.proc.pid for child in supervisor.children if child.proc}
            progress, stop = Progress(), asyncio.Event()
            watcher = asyncio.create_task(watch(stack.bootstrap, stack.namespace, progress, stop))
            quiet = {name: own_cpu(pid) for name, pid in pids.items()}
            await asyncio.sleep(idle)  # the stack up, nothing submitted: what each service burns waiting
            before = {name: own_cpu(pid) for name, pid in pids.items()}
            idle_rate = {name: (before[name] - quiet[name]) / idle for name in pids}
            agent = AgentMeter(pids["sandbox-runner"])
            started = time.monotonic()
            bus = ["--bootstrap-servers", stack.bootstrap, "--namespace", stack.namespace]
            argv = [sys.executable, "-m", "rollbus", "submit", str(dataset), "--n-samples-per-prompt",
                    str(rollouts), *bus]  # fmt: skip
            subprocess.run(argv, check=True, capture_output=True)
            while len(progress.rewards) < rollouts or len(progress.segment_ids) < rollouts:
                failed = [r for r in progress.rewards.values() if r.failure_kind == "rollout_failed"]
                if failed or time.monotonic() - started > 60 * turns * rollouts:
                    raise SystemExit(f"rollout_cost: the run went wrong: {progress.line()}")
                agent.sample()
                await asyncio.sleep(0.1)
            wall = time.monotonic() - started
            after = {name: own_cpu(pid) for name, pid in pids.items()}
            stop.set()
            await asyncio.gather(watcher, return_exceptions=True)
            restarts = {child.spec.name: child.restarts for child in supervisor.children if child.restarts}
    return {
        "cpu": {name: after[name] - before[name] for name in pids}, "idle_rate": idle_rate,
        "agent": agent.total(), "wall": wall, "turns_served": progress.turns, "restarts": restarts,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=4, help="samples of the row (one group)")
    parser.add_argument("--turns", type=int, default=50, help="turns per rollout")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle stack measured first")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 rollout of 5 turns, 3 s idle")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.turns, args.idle = 1, 5, 3.0
    result = asyncio.run(run(args.rollouts, args.turns, args.idle))
    cpu, rate, n = result["cpu"], result["idle_rate"], args.rollouts
    per_50 = 50 / args.turns  # the figures are per 50-turn rollout, scaled from the turns run
    served, wall = result["turns_served"], result["wall"]
    # idle: what the service would have burnt over the run's wall time with nothing to do (its rate over the
    # idle window); work: the rest, what the rollouts themselves cost. Idle scales with wall time (a loaded
    # machine, a slow engine), work does not.
    idle = {name: min(cpu[name], rate[name] * wall) for name in cpu}
    work = {name: cpu[name] - idle[name] for name in cpu}
    print(f"{n} rollouts of {args.turns} turns ({served} turns served) in {wall:.0f}s")
    print("CPU seconds per 50-turn rollout:      work    idle   total   (idle rate, CPU-ms per s)")
    for name in ROLLBUS:
        line = [work[name] / n * per_50, idle[name] / n * per_50, cpu[name] / n * per_50]
        print(f"  {name:15} " + " ".join(f"{x:7.3f}" for x in line) + f"   ({rate[name] * 1000:5.1f})")
    ours = sum(work[name] for name in ROLLBUS) / n * per_50
    total = sum(cpu[name] for name in ROLLBUS) / n * per_50
    agent = result["agent"] / n * per_50
    print(f"  {'rollbus':15} {ours:7.3f} {total - ours:7.3f} {total:7.3f}   (aim: work <= 0.2)")
    print(f"  {'agent CLI':15} {agent:7.3f}  (Claude Code's processes, sampled)")
    for name, what in zip(APART, ("model forward passes", "learner"), strict=True):
        print(f"  {name:15} {cpu[name] / n * per_50:7.3f}  (not counted: {what})")
    if result["restarts"]:
        print(f"  restarts during the run: {result['restarts']}")
    if agent:
        print(f"ratio rollbus / agent CLI CPU = {ours / agent:.3f} (work), {total / agent:.3f} (with idle)")
    else:
        print("ratio: no agent CPU seen")


if __name__ == "__main__":
    main()
