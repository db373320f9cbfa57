"""``python_tool``: a computation question; the model may call a ``python`` tool, then answers.

The code runs in a fresh network-less sandbox (:class:`rollbus.sandbox.BwrapSandbox`, ``network="none"``,
one per episode, removed by ``close``), never in the runner's process. Threat model: the code is the
policy's and hostile. It sees a read-only system, an empty scratch workspace and no network; each call is
killed (its whole PID namespace) after ``timeout`` seconds; memory, processes, CPU, /tmp and disk are capped
(:class:`rollbus.sandbox.Limits`: a cgroup where the host allows, else rlimits) and a hit is named in the
tool result and the step's info; what comes back is cut to ``max_output`` chars.

``env_config``: ``{"name": "python_tool", "seed": 3}`` (optional ``timeout``, ``max_output``, ``max_calls``,
``memory_mb``, ``pids``).
Reward 1 for the right ``<answer>``, else 0; the episode ends at the first answer.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import sympy

from rollbus.sandbox.limits import MIB, Limits
from rollbus.services.gym_runner.envs.answers import (
    extract_answer,
    last_assistant,
    message_text,
    parse_rational,
)
from rollbus.services.gym_runner.gym import Env, RolloutInferRequest, register_env

SYSTEM = (
    "You answer computation questions. You may run Python with the `python` tool (print what you need); "
    "then give the final answer as <answer>NUMBER</answer>."
)
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program in a sandbox without network; returns its stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    },
}


def question(seed: int) -> tuple[str, sympy.Rational]:
    rng = random.Random(seed)
    kind = rng.choice(("squares", "primes", "digits"))
    if kind == "squares":
        n = rng.randint(20, 60)
        return f"What is the sum of the squares of the integers 1 to {n}?", sympy.Rational(
            sum(i * i for i in range(1, n + 1))
        )
    if kind == "primes":
        n = rng.randint(100, 400)
        return f"How many primes are there below {n}?", sympy.Rational(len(list(sympy.primerange(2, n))))
    n = rng.randint(20, 40)
    return f"What is the sum of the decimal digits of 2**{n}?", sympy.Rational(sum(map(int, str(2**n))))


@register_env("python_tool")
class PythonToolEnv(Env):
    tools = [PYTHON_TOOL]

    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        self.question, self.answer = question(int(env_config.get("seed", 0)))
        self.timeout = float(env_config.get("timeout", 10.0))
        self.max_output = int(env_config.get("max_output", 4000))
        self.max_calls = int(env_config.get("max_calls", 4))
        self.limits = Limits(
            memory_bytes=int(env_config.get("memory_mb", 512)) * MIB, pids=int(env_config.get("pids", 64)),
            cpus=1.0, tmp_bytes=64 * MIB, disk_bytes=64 * MIB, output_bytes=max(self.max_output, 4096),
            wall_s=self.timeout,
        )  # fmt: skip
        self.limits_hit: list[str] = []
        self.calls = 0
        self._workdir: Path | None = None
        self._sandbox: Any = None

    async def reset(self, request: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        return self.question, {"question": self.question, "expected": str(self.answer)}, SYSTEM

    async def step(self, messages: list[dict[str, Any]]) -> tuple[Any, float, bool, dict[str, Any]]:
        reply = last_assistant(messages)
        calls = [c for c in reply.get("tool_calls") or () if c.get("function", {}).get("name") == "python"]
        given = extract_answer(message_text(reply))
        if given is not None or not calls:
            value = parse_rational(given) if given is not None else None
            solved = value is not None and value == self.answer
            info = {"given": given, "correct": solved, "solved": solved, "calls": self.calls}
            return "Correct." if solved else "Wrong.", 1.0 if solved else 0.0, True, info
        results = [await self._run(call) for call in calls]
        info = {"calls": self.calls, "exit_codes": [r[1] for r in results], "solved": False}
        if self.limits_hit:
            info["limits_hit"] = list(self.limits_hit)
        return (
            [
                {"role": "tool", "tool_call_id": c.get("id", ""), "content": r[0]}
                for c, r in zip(calls, results, strict=True)
            ],
            0.0,
            False,
            info,
        )

    async def _run(self, call: dict[str, Any]) -> tuple[str, int | None]:
        self.calls += 1
        if self.calls > self.max_calls:
            return f"refused: at most {self.max_calls} python calls per episode", None
        code = _code_of(call)
        if code is None:
            return 'refused: the python tool takes {"code": "..."}', None
        sandbox = await self._ensure_sandbox()
        await sandbox.write_file("/workspace/main.py", code)
        done = await sandbox.run(["python3", "-I", "/workspace/main.py"], env={"PATH": "/usr/bin:/bin"},
                                 timeout=self.timeout)  # fmt: skip
        out = done.stdout + (f"\n[stderr]\n{done.stderr}" if done.stderr else "")
        if done.timed_out:
            out += f"\n[killed after {self.timeout} s]"
        if done.failure_kind is not None:
            self.limits_hit.append(done.failure_kind)
            out += f"\n[sandbox limit: {done.failure_kind}]"
        return out[: self.max_output], done.exit_code

    async def _ensure_sandbox(self) -> Any:
        if self._sandbox is None:
            from rollbus.sandbox import BwrapSandbox  # bwrap checks at construction: only when code runs

            self._workdir = Path(tempfile.mkdtemp(prefix="rollbus-pytool-"))
            self._sandbox = await BwrapSandbox.create(self._workdir, network="none", limits=self.limits)
        return self._sandbox

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
            self._sandbox = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def _code_of(call: dict[str, Any]) -> str | None:
    import json

    arguments = call.get("function", {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    code = arguments.get("code") if isinstance(arguments, dict) else None
    return code if isinstance(code, str) else None
