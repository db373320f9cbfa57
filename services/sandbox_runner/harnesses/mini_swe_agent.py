"""mini-swe-agent: the real agent from PyPI (its ``mini`` entry point), on the adapter's OpenAI chat route.

A pinned install in a venv of its own under the cache (``python -m
rollbus.services.sandbox_runner.harnesses.mini_swe_agent fetch``; ``scripts/bootstrap.sh`` calls it), made
with the host's ``/usr/bin/python3`` and resolved as of a fixed date, so every machine gets the same packages.
The sandbox mounts the venv read-only at ``/opt/mini-swe-agent`` and runs an execute-only copy of the host's
interpreter there (non-dumpable, as the npm CLIs are), its standard library the sandbox's read-only ``/usr``
(so: bwrap on the host's system; a container whose own python differs cannot run it, and there is no E2B
install). It speaks OpenAI chat through litellm, its one bash tool called as a tool call; its token is
litellm's ``OPENAI_API_KEY``, through the pipe (it hands its environment to its commands, as Claude Code does,
so the adapter proxy's peer stamp is what keeps a tool's request from training). Its exit is read from what
``mini`` prints: one ``mini-swe-agent (step N, ...)`` header per model call, and ``LimitsExceeded`` when it
stopped at the step limit (``--max-turns``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rollbus.config import cache_dir
from rollbus.sandbox import Completed
from rollbus.services.sandbox_runner import outcome
from rollbus.services.sandbox_runner.harnesses import SANDBOX_ENV, Exit, Launch, NotInstalled, Where

if TYPE_CHECKING:
    from rollbus.sandbox import SandboxBase
    from rollbus.services.sandbox_runner.rollout import RunnerKit
    from rollbus.services.sandbox_runner.settings import RunnerSettings

PACKAGE, VERSION = "mini-swe-agent", "2.4.6"
RESOLVED_AS_OF = "2026-11-20T00:00:00Z"  # its dependencies as PyPI had them then (uv --exclude-newer)
PYTHON = "/usr/bin/python3"  # the venv's interpreter: the host's, which the sandbox sees at the same path
INSIDE = "/opt/mini-swe-agent"  # where the sandbox mounts the venv (read-only)
MARKER = ".rollbus-installed.json"
EXECUTE_ONLY = "bin/python-execute-only"  # the venv's interpreter as an execute-only copy (see fetch)
_STEP = re.compile(r"^mini-swe-agent \(step (\d+),", re.MULTILINE)


def install_dir(version: str = VERSION) -> Path:
    return cache_dir() / f"mini-swe-agent-{version}"


def fetch(version: str = VERSION) -> Path:
    """The pinned venv, made once (in a scratch directory, then renamed into place), with its interpreter's
    execute-only copy."""
    dest = install_dir(version)
    if (dest / MARKER).is_file():
        return execute_only_python(dest)
    uv = shutil.which("uv")
    if uv is None:
        raise NotInstalled("uv is not on PATH (scripts/bootstrap.sh installs it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        subprocess.run([uv, "venv", "-q", "--python", PYTHON, str(scratch)], check=True, timeout=300)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(scratch / "bin" / "python"),
             "--exclude-newer", RESOLVED_AS_OF, f"{PACKAGE}=={version}"],
            check=True, timeout=900,
        )  # fmt: skip
        (scratch / MARKER).write_text(json.dumps({"package": PACKAGE, "version": version}))
        scratch.chmod(0o755)
        os.rename(scratch, dest)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        if (dest / MARKER).is_file():  # another process made it meanwhile
            return execute_only_python(dest)
        raise
    return execute_only_python(dest)


def execute_only_python(venv: Path) -> Path:
    """The host's interpreter copied into the venv as mode 0111: the kernel makes the agent's process
    non-dumpable, so its tools (same uid) cannot ptrace it, read its memory or environment, or take its socket
    to send as the agent, as for the npm CLIs (``rollbus.npm_binary``). It finds the venv by its
    ``pyvenv.cfg``, the standard library by the ``home`` there. Made once, atomically."""
    dest = venv / EXECUTE_ONLY
    source = Path(os.path.realpath(PYTHON))
    if not dest.is_file() or dest.stat().st_size != source.stat().st_size:
        partial = dest.with_name(f".{dest.name}.{os.getpid()}")
        shutil.copyfile(source, partial)
        partial.chmod(0o111)
        os.replace(partial, dest)
    return venv


class MiniSweAgent:
    name = "mini_swe_agent"
    adapter_harness = "mini_swe_agent"
    installs_in_vm = False

    def host_files(self, settings: RunnerSettings) -> dict[str, str]:
        venv = install_dir()
        if not (venv / MARKER).is_file() or not (venv / EXECUTE_ONLY).is_file():
            raise NotInstalled(
                f"mini-swe-agent {VERSION} is not installed in {venv}; run "
                "`python -m rollbus.services.sandbox_runner.harnesses.mini_swe_agent fetch`"
            )
        return {str(venv): INSIDE}

    def launch(
        self, settings: RunnerSettings, where: Where, prompt: str, token: str, timeout: float
    ) -> Launch:
        config = {
            "agent.step_limit": settings.max_turns,
            "agent.cost_limit": 0,  # no price for the served model: turns are the limit
            "agent.wall_time_limit_seconds": int(timeout),
            "model.model_kwargs.max_tokens": settings.max_output_tokens,
        }
        cmd = [
            f"{INSIDE}/{EXECUTE_ONLY}", "-m", "minisweagent.run.mini", "--yolo", "--exit-immediately",
            "--model", f"openai/{settings.model}", "--environment-class", "local",
            "--output", f"{where.home}/trajectory.json", "--config", "mini.yaml",
            *(arg for key, value in config.items() for arg in ("--config", f"{key}={value}")),
            "--task", prompt,
        ]  # fmt: skip
        env = {
            "HOME": where.home, "PATH": where.path or "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "OPENAI_BASE_URL": f"{where.base_url}/v1", "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{where.home}/.config/mini-swe-agent",
            "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "NO_COLOR": "1", "COLUMNS": "200", **SANDBOX_ENV,
        }  # fmt: skip
        return Launch(cmd, env, {"OPENAI_API_KEY": token})

    def read_exit(self, completed: Completed) -> Exit:
        steps = [int(n) for n in _STEP.findall(completed.stdout)]
        failure = outcome.classify(completed)
        if failure is None and re.search(r"^LimitsExceeded\s*$", completed.stdout, re.MULTILINE):
            failure = outcome.MAX_TURNS
        return Exit(failure, max(steps, default=0))

    async def install_in_vm(self, kit: RunnerKit, sandbox: SandboxBase) -> str:
        raise NotImplementedError("no E2B install of mini-swe-agent")


HARNESS = MiniSweAgent()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("action", choices=["fetch", "path"], help="fetch: install if absent; path: print it")
    args = parser.parse_args(argv)
    try:
        venv = fetch() if args.action == "fetch" else install_dir()
    except (NotInstalled, subprocess.SubprocessError, OSError) as exc:
        print(f"mini_swe_agent: {exc}", file=sys.stderr)
        return 1
    print(venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
