"""What the adapter adds per turn: latency and CPU, against the engine alone on the same prompts.

Run: ``python bench/adapter_overhead.py [--turns 10 50 100] [--final-context 64000] [--engine-flags "..."]``;
``--quick``: one 3-turn conversation to 4k tokens (a smoke run). ``--state [--quick]`` instead reports memory
per live 64k-token session and the restart rebuild time with 10k finished and 100 open rollouts on the bus
(:mod:`bench.adapter_state`).

Starts the rollbus engine (scripted policy: every turn a Read tool call, real logprobs) and the adapter
(real tokenizer, chat template, SGLang parsers, canonical history; turns encoded with the real codec and
written to a local file instead of Kafka), each in its own process. For each size it drives one CLI-shaped
conversation of that many turns through each route (history echoed back with tool results each turn):
Anthropic's ``/v1/messages`` as Claude Code sends it, and ``/v1/responses`` as Codex sends it (the whole item
history resent, output items echoed back, ``function_call_output`` results). Right after each turn it sends
the *same* prompt ids straight to the engine's ``/generate`` (interleaved, so both see the same machine
load). The direct calls go to a twin engine (same flags, same seed) that has seen the same prompts in the same
order, so its prefix cache is in the same state and both paths prefill the same new tokens. Prints per route
the per-turn wall time (median) and CPU time of the process that served it (mean), the added latency, and the
ratios adapter/engine; then the Responses route's added latency over the Anthropic route's (target: within
20%).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

READ = (
    "Next file.\n</think>\n\nReading file {i}.\n\n<tool_call>\n<function=Read>\n<parameter=file_path>\n"
    "/repo/src/module_{i}.py\n</parameter>\n</function>\n</tool_call>"
)
TOOLS = [
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
            "additionalProperties": False,
        },
    }
]
SYSTEM = [{"type": "text", "text": "You are Claude Code, a coding agent. " * 40}]
READ_FUNCTION = {"type": "function", "name": "Read", "description": TOOLS[0]["description"],
                 "parameters": TOOLS[0]["input_schema"], "strict": False}  # fmt: skip
TASK = "Read every module under /repo/src."
TINY_ENGINE = "--hidden-size 64 --layers 2 --heads 2 --kv-heads 1 --intermediate-size 128"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_up(proc: subprocess.Popen, health: str, log: Path) -> None:
    """Until ``health`` answers 200; exits if the process dies or 600 s pass (three start at once, on a
    loaded box too)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[2:4]} exited early; see {log}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{health} did not come up; see {log}")


def cpu_seconds(proc: subprocess.Popen) -> float:
    times = psutil.Process(proc.pid).cpu_times()
    return times.user + times.system


@dataclass
class Sample:
    """One turn measured both ways: wall seconds and CPU seconds of the process that served it."""

    adapter_wall: float
    adapter_cpu: float
    engine_wall: float
    engine_cpu: float


class DirectEngine:
    """Replays a turn's exact prompt straight to ``/generate``, as its own chain (same scripted output)."""

    def __init__(self, url: str, proc: subprocess.Popen) -> None:
        from rollbus.tokenizer import SpecialIds, load_tokenizer

        self.proc = proc
        self.stop_ids = list(SpecialIds.from_tokenizer(load_tokenizer("qwen3.6")).stop_token_ids)
        self.client = httpx.Client(base_url=url, timeout=300)
        self.headers: dict[str, str] = {}

    def new_conversation(self) -> None:
        """A fresh rollout id, so the scripted engine replays its turns from the first again."""
        rollout = f"direct-{uuid.uuid4().hex[:8]}"
        self.headers = {
            "X-Rollbus-Rollout": rollout,
            "X-Rollbus-Chain": "main",
            "X-Rollbus-Chain-Kind": "main",
        }

    def generate(self, prompt_ids: list[int]) -> tuple[float, float]:
        body = {
            "input_ids": prompt_ids,
            "return_logprob": True,
            "rid": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": 256, "stop_token_ids": self.stop_ids},
        }
        cpu, started = cpu_seconds(self.proc), time.perf_counter()
        self.client.post("/generate", json=body, headers=self.headers).raise_for_status()
        return time.perf_counter() - started, cpu_seconds(self.proc) - cpu


class TurnLog:
    """The turn records the adapter child wrote, resolved to whole prompts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.prompts: dict[tuple[str, str, int], list[int]] = {}
        self.records: dict[tuple[str, str, int], dict] = {}

    def last_prompt(self, rollout: str) -> list[int]:
        for line in self.path.read_text().splitlines():
            record = json.loads(line)
            key = (record["rollout_id"], record["chain_id"], record["turn_index"])
            if key in self.records:
                continue
            ids = record["prompt_ids"]
            if record["prompt_ref_turn"] is not None:
                ref = key[:2] + (record["prompt_ref_turn"],)
                ids = self.prompts[ref] + self.records[ref]["output_ids"] + ids
            assert len(ids) == record["prompt_tokens"], "prompt_ref_turn did not resolve to the prompt"
            self.prompts[key], self.records[key] = ids, record
        latest = max(k for k in self.records if k[0] == rollout)
        return self.prompts[latest]

    def last_prompt_tokens(self) -> int:
        """Length of the newest prompt read so far (the conversation's final context)."""
        newest = max(self.records, key=lambda k: self.records[k]["timings"]["finished_at"])
        return len(self.prompts[newest])


CODE_LINE = "    total = compute_value(index, scale=2.5)  # accumulate the running total\n"


def file_text(path: str, chars: int) -> str:
    """A Read result of about ``chars`` characters of code-like text (the CLI numbers its lines)."""
    lines = max(1, chars // (len(CODE_LINE) + 6))
    return f"# {path}\n" + "".join(f"{n:>6}\t{CODE_LINE}" for n in range(1, lines + 1))


class AnthropicChat:
    """A conversation as Claude Code holds it: ``/v1/messages``, tool results in user messages."""

    path = "/v1/messages?beta=true"

    def __init__(self, rollout: str) -> None:
        self.headers = {"x-api-key": rollout}
        self.messages: list[dict] = [{"role": "user", "content": TASK}]

    def body(self) -> dict:
        return {"model": "bench", "max_tokens": 256, "system": SYSTEM, "tools": TOOLS,
                "messages": self.messages, "stream": False}  # fmt: skip

    def answer(self, reply: dict, chars: int) -> None:
        call = next(b for b in reply["content"] if b["type"] == "tool_use")
        result = file_text(call["input"]["file_path"], chars)
        returned = {"type": "tool_result", "tool_use_id": call["id"], "content": result}
        self.messages += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": [returned]},
        ]


def message(role: str, text: str) -> dict:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


class ResponsesChat:
    """A conversation as Codex holds it: ``/v1/responses`` with ``store: false``, the whole item history
    resent each call (the output items as they came, then a ``function_call_output``)."""

    path = "/v1/responses"

    def __init__(self, rollout: str) -> None:
        self.headers = {"authorization": f"Bearer {rollout}"}
        self.items: list[dict] = [message("developer", SYSTEM[0]["text"]), message("user", TASK)]

    def body(self) -> dict:
        return {"model": "bench", "input": self.items, "tools": [READ_FUNCTION], "tool_choice": "auto",
                "store": False, "stream": False}  # fmt: skip

    def answer(self, reply: dict, chars: int) -> None:
        call = next(i for i in reply["output"] if i["type"] == "function_call")
        result = file_text(json.loads(call["arguments"])["file_path"], chars)
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": result}
        self.items += [*reply["output"], output]


ROUTES = {"anthropic": AnthropicChat, "responses": ResponsesChat}


def conversation(
    adapter_url: str,
    adapter: subprocess.Popen,
    direct: DirectEngine,
    log: TurnLog,
    turns: int,
    final_context: int,
    route: str = "anthropic",
) -> list[Sample]:
    """One CLI-shaped conversation through the adapter's ``route``; after each turn, its prompt to the engine
    alone.

    Each Read result is sized so the conversation reaches about ``final_context`` tokens by its last turn
    (about 3 characters per token for this code-like text), within the adapter's default context.
    """
    room = final_context - 2_000 - 120 * turns  # the system prompt and tools, then ~120 tokens a turn
    chars_per_result = max(60, int(3.0 * room / turns))
    rollout = f"bench-{uuid.uuid4().hex[:8]}"
    chat = ROUTES[route](rollout)
    samples = []
    direct.new_conversation()
    with httpx.Client(base_url=adapter_url, timeout=300, headers=chat.headers) as client:
        for _ in range(turns):
            body = chat.body()
            cpu, started = cpu_seconds(adapter), time.perf_counter()
            response = client.post(chat.path, json=body)
            wall, cpu = time.perf_counter() - started, cpu_seconds(adapter) - cpu
            response.raise_for_status()
            samples.append(Sample(wall, cpu, *direct.generate(log.last_prompt(rollout))))
            chat.answer(response.json(), chars_per_result)
    return samples


def added_ms(samples: list[Sample]) -> float:
    """Latency the adapter added per turn (median of each turn's difference)."""
    return 1000 * statistics.median(s.adapter_wall - s.engine_wall for s in samples)


def report(turns: int, samples: list[Sample], context: int, route: str = "anthropic") -> None:
    """Wall time as medians (robust to other load); CPU as means (the clock ticks in 10 ms steps)."""

    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    def mean_ms(values: list[float]) -> float:
        return 1000 * statistics.fmean(values)

    a_wall, e_wall = median_ms([s.adapter_wall for s in samples]), median_ms([s.engine_wall for s in samples])
    added = added_ms(samples)
    ratio = statistics.median(s.adapter_wall / s.engine_wall for s in samples)  # per turn, then the median
    a_cpu, e_cpu = mean_ms([s.adapter_cpu for s in samples]), mean_ms([s.engine_cpu for s in samples])
    wall = f"wall/turn (median): via adapter {a_wall:6.1f} ms, engine alone {e_wall:6.1f} ms"
    cpu = f"CPU/turn (mean): adapter {a_cpu:5.1f} ms, engine {e_cpu:6.1f} ms"
    print(
        f"{route:9} {turns:>4} turns to {context / 1000:4.1f}k tokens | {wall}, added {added:6.1f} ms, "
        f"ratio {ratio:4.3f} | "
        f"{cpu}, ratio {a_cpu / max(e_cpu, 1e-9):4.2f}"
    )


def compare(turns: int, added: dict[str, float]) -> str:
    """The Responses route's added latency against the Anthropic route's; no ratio when the Anthropic route
    added none (a difference within the noise, as on a quick run)."""
    responses, anthropic = added["responses"], added["anthropic"]
    line = f"{turns:>4} turns: added latency responses {responses:6.1f} ms, anthropic {anthropic:6.1f} ms"
    if anthropic < 1.0:
        return f"{line} (no ratio: the Anthropic route added under 1 ms)"
    return f"{line}, ratio responses/anthropic {responses / anthropic:4.3f}"


def serve_adapter(port: int, engine_url: str, records_file: str) -> None:
    """Child mode: the adapter app with a publisher that encodes (real codec) and appends to a file."""
    import asyncio

    import uvicorn

    from rollbus.codec import decode
    from rollbus.services.adapter.app import create_app
    from rollbus.services.adapter.settings import AdapterSettings

    out = open(records_file, "a")  # noqa: SIM115 - lives as long as the process

    class FilePublisher:
        """The adapter's publisher (``rollbus.services.adapter.publisher.Publisher``): takes the encoded
        records."""

        async def publish_bytes(self, topic: str, value: bytes, *, key: str | bytes | None) -> None:
            if topic == "turns":
                out.write(json.dumps(decode(value).record) + "\n")
                out.flush()

    settings = AdapterSettings(sglang_url=engine_url, open_sessions=True, context_length=65536)
    app = create_app(settings, FilePublisher())
    asyncio.run(uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning")).serve())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument(
        "--final-context", type=int, default=64_000, help="tokens the conversation reaches by its last turn"
    )
    parser.add_argument("--engine-flags", default=TINY_ENGINE, help="model shape flags for the engine")
    parser.add_argument(
        "--serve-adapter", nargs=3, metavar=("PORT", "ENGINE_URL", "RECORDS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--state", action="store_true", help="memory per session and restart time instead")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 3 turns to 4k tokens (--state: fewer sessions)"
    )
    args = parser.parse_args()
    if args.quick:
        args.turns, args.final_context = [3], 4_000
    if args.state:
        from bench.adapter_state import main as state_main

        return state_main(["--quick"] if args.quick else [])
    if args.serve_adapter:
        serve_adapter(int(args.serve_adapter[0]), args.serve_adapter[1], args.serve_adapter[2])
        return 0
    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "script.json").write_text(
            json.dumps({"turns": [READ.format(i=i) for i in range(max(args.turns))]})
        )
        engine_port, twin_port, adapter_port = free_port(), free_port(), free_port()
        engine_url, adapter_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{adapter_port}"
        twin_url = f"http://127.0.0.1:{twin_port}"
        records_file = tmp / "turns.jsonl"
        engine_cmd = [
            sys.executable, "-m", "rollbus.services.engine", "--policy", "scripted",
            "--script", str(tmp / "script.json"), "--threads", "1", *shlex.split(args.engine_flags),
        ]  # fmt: skip
        started: list[subprocess.Popen] = []  # stopped at the end, also when a later one never comes up
        try:
            # the three load at once (imports and tokenizer dominate a quick run); none is measured yet
            serve = ["--serve-adapter", str(adapter_port), engine_url, str(records_file)]
            engine = launch([*engine_cmd, "--port", str(engine_port)], tmp / "engine.log")
            started.append(engine)
            twin = launch([*engine_cmd, "--port", str(twin_port)], tmp / "twin.log")
            started.append(twin)
            adapter = launch([sys.executable, __file__, *serve], tmp / "adapter.log")
            started.append(adapter)
            wait_up(engine, f"{engine_url}/health", tmp / "engine.log")
            wait_up(twin, f"{twin_url}/health", tmp / "twin.log")
            wait_up(adapter, f"{adapter_url}/healthz", tmp / "adapter.log")
            print(f"engine flags: {args.engine_flags}; CPU cores: {os.cpu_count()}")
            direct, log = DirectEngine(twin_url, twin), TurnLog(records_file)
            for turns in args.turns:
                added = {}
                for route in ROUTES:
                    final = args.final_context
                    samples = conversation(adapter_url, adapter, direct, log, turns, final, route)
                    report(turns, samples, log.last_prompt_tokens(), route)
                    added[route] = added_ms(samples)
                print(compare(turns, added))
        finally:
            for proc in reversed(started):
                proc.terminate()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
