"""What the adapter adds per turn: latency and CPU, against the engine alone on the same prompts.

Run: ``python bench/adapter_overhead.py [--turns 10 50 100] [--engine-flags "..."]``.

Starts the rollbus engine (scripted policy: every turn a Read tool call, real logprobs) and the adapter
(real tokenizer, chat template, SGLang parsers, canonical history; turns encoded with the real codec and
written to a local file instead of Kafka), each in its own process. For each size it drives one CLI-shaped
conversation of that many turns through the adapter (history echoed back with tool results each turn),
and right after each turn sends the *same* prompt ids straight to the engine's ``/generate`` (interleaved,
so both see the same machine load). Prints per-turn wall time (median) and CPU time of the process that
served it (mean), the added latency, and the ratios adapter/engine. The direct call finds its prompt in the
engine's prefix cache, so the added latency is an upper bound.
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
TINY_ENGINE = "--hidden-size 64 --layers 2 --heads 2 --kv-heads 1 --intermediate-size 128"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cmd: list[str], health: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[2:4]} exited early; see {log}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return proc
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


def conversation(
    adapter_url: str, adapter: subprocess.Popen, direct: DirectEngine, log: TurnLog, turns: int
) -> list[Sample]:
    """One CLI-shaped conversation through the adapter; after each turn, its prompt to the engine alone."""
    rollout = f"bench-{uuid.uuid4().hex[:8]}"
    messages: list[dict] = [{"role": "user", "content": "Read every module under /repo/src."}]
    samples = []
    direct.new_conversation()
    with httpx.Client(base_url=adapter_url, timeout=300, headers={"x-api-key": rollout}) as client:
        for _ in range(turns):
            body = {
                "model": "bench",
                "max_tokens": 256,
                "system": SYSTEM,
                "tools": TOOLS,
                "messages": messages,
                "stream": False,
            }
            cpu, started = cpu_seconds(adapter), time.perf_counter()
            response = client.post("/v1/messages?beta=true", json=body)
            wall, cpu = time.perf_counter() - started, cpu_seconds(adapter) - cpu
            response.raise_for_status()
            samples.append(Sample(wall, cpu, *direct.generate(log.last_prompt(rollout))))
            message = response.json()
            call = next(b for b in message["content"] if b["type"] == "tool_use")
            result = f"print('{call['input']['file_path']}')\n" * 3
            messages += [
                {"role": "assistant", "content": message["content"]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}],
                },
            ]
    return samples


def report(turns: int, samples: list[Sample]) -> None:
    """Wall time as medians (robust to other load); CPU as means (the clock ticks in 10 ms steps)."""

    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    def mean_ms(values: list[float]) -> float:
        return 1000 * statistics.fmean(values)

    a_wall, e_wall = median_ms([s.adapter_wall for s in samples]), median_ms([s.engine_wall for s in samples])
    added = median_ms([s.adapter_wall - s.engine_wall for s in samples])
    a_cpu, e_cpu = mean_ms([s.adapter_cpu for s in samples]), mean_ms([s.engine_cpu for s in samples])
    wall = f"wall/turn (median): via adapter {a_wall:6.1f} ms, engine alone {e_wall:6.1f} ms"
    cpu = f"CPU/turn (mean): adapter {a_cpu:5.1f} ms, engine {e_cpu:6.1f} ms"
    print(
        f"{turns:>4} turns | {wall}, added {added:6.1f} ms, ratio {a_wall / e_wall:4.2f} | "
        f"{cpu}, ratio {a_cpu / max(e_cpu, 1e-9):4.2f}"
    )


def serve_adapter(port: int, engine_url: str, records_file: str) -> None:
    """Child mode: the adapter app with a publisher that encodes (real codec) and appends to a file."""
    import asyncio

    import uvicorn

    from rollbus.codec import decode, encode
    from services.adapter.app import create_app
    from services.adapter.settings import AdapterSettings

    out = open(records_file, "a")  # noqa: SIM115 - lives as long as the process

    class FilePublisher:
        async def publish(self, topic: str, record: dict, *, key: str) -> None:
            data = encode({"turns": "turn", "sessions": "session"}[topic], record)
            if topic == "turns":
                out.write(json.dumps(decode(data).record) + "\n")
                out.flush()

    settings = AdapterSettings(sglang_url=engine_url, open_sessions=True, context_length=65536)
    app = create_app(settings, FilePublisher())
    asyncio.run(uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning")).serve())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--engine-flags", default=TINY_ENGINE, help="model shape flags for the engine")
    parser.add_argument(
        "--serve-adapter", nargs=3, metavar=("PORT", "ENGINE_URL", "RECORDS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_adapter:
        serve_adapter(int(args.serve_adapter[0]), args.serve_adapter[1], args.serve_adapter[2])
        return 0
    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "script.json").write_text(
            json.dumps({"turns": [READ.format(i=i) for i in range(max(args.turns))]})
        )
        engine_port, adapter_port = free_port(), free_port()
        engine_url, adapter_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{adapter_port}"
        records_file = tmp / "turns.jsonl"
        engine = start(
            [
                sys.executable,
                "-m",
                "services.engine",
                "--policy",
                "scripted",
                "--script",
                str(tmp / "script.json"),
                "--port",
                str(engine_port),
                "--threads",
                "1",
                *shlex.split(args.engine_flags),
            ],
            f"{engine_url}/health",
            tmp / "engine.log",
        )
        adapter = start(
            [sys.executable, __file__, "--serve-adapter", str(adapter_port), engine_url, str(records_file)],
            f"{adapter_url}/healthz",
            tmp / "adapter.log",
        )
        try:
            print(f"engine flags: {args.engine_flags}; CPU cores: {os.cpu_count()}")
            direct, log = DirectEngine(engine_url, engine), TurnLog(records_file)
            for turns in args.turns:
                report(turns, conversation(adapter_url, adapter, direct, log, turns))
        finally:
            for proc in (adapter, engine):
                proc.terminate()
                proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
