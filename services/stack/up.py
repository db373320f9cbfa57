"""``rollbus up``: the whole pipeline on embedded defaults, as supervised processes, until Ctrl-C.

Broker (the embedded Apache Kafka of the state dir, unless a bootstrap address is given: then that cluster,
and no broker is started), engine, adapter, sandbox runner, grader, gym runner, segmenter and trainer, each
started as a user would (``python -m rollbus <service>``), all at once (the trainer once the engine, which it
pushes its first weights to, is ready); a crashed service
is restarted with backoff, and a dead embedded broker is started again on its data and port (the services
that died with it restart once it answers); Ctrl-C (or SIGTERM) stops everything, also during start-up,
leaving no process behind. Started again on the same state dir and namespace it continues that run, and
says so (:mod:`rollbus.services.stack.runs`).

Secrets (the engine's API key, the adapter's admin token and signing key) are made per run and handed to the
services that need them through their variables, never on a command line (``ps`` shows those) and never to a
sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rollbus.kafka.broker import EmbeddedBroker, free_port
from rollbus.policy_model import MoeSpec
from rollbus.services.stack.runs import checkpoint_version, run_line
from rollbus.services.stack.supervisor import ServiceSpec, Supervisor
from rollbus.settings import BusSettings
from rollbus.topics import TOPICS, create_topics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL = "rollbus-engine"
log = logging.getLogger("rollbus.up")


class StackSettings(BusSettings):
    """Settings of ``rollbus up`` (flags --x-y, variables ROLLBUS_UP_X_Y)."""

    model_config = BusSettings.scoped("up")
    embedded_broker: bool | None = Field(
        None,
        description="start the state dir's embedded broker; unset: yes, unless a bootstrap address is given "
        "(--bootstrap-servers or ROLLBUS_BOOTSTRAP_SERVERS): that cluster is used and no broker started",
    )
    policy: Literal["sample", "scripted"] = Field("scripted", description="the engine's policy")
    script: Path = Field(
        EXAMPLES / "swe-mini" / "scripts",
        description="scripted policy: a JSON file, or a directory of NAME.json per task (rollout-id prefix)",
    )
    codex_script: Path = Field(
        EXAMPLES / "swe-mini" / "scripts-codex",
        description="scripted policy of the rollouts the Codex CLI runs (its requests come through the "
        "adapter's Responses route); unset while --script is given: --script serves them too",
    )
    agent: Literal["claude_code", "codex"] = Field(
        "claude_code", description="the sandbox runner's agent harness for rows without metadata.agent"
    )
    engine_port: int = Field(0, ge=0, le=65535, description="engine port (0: a free one)")
    adapter_port: int = Field(0, ge=0, le=65535, description="adapter port (0: a free one)")
    group_size: int = Field(2, ge=1, description="rollouts per group the trainer waits for")
    rollout_batch_size: int = Field(1, ge=1, description="complete groups per training step")
    steps: int = Field(0, ge=0, description="training steps before the trainer stops (0: never)")
    runner_concurrency: int = Field(2, ge=1, description="rollouts the sandbox runner runs at once")
    gym: bool = Field(True, description="also run the gym runner (gym tasks)")
    moe: bool = Field(
        False, description="serve and train the small random Qwen3-MoE with rollout routing replay: the "
        "engine returns each turn's routed experts, the adapter stores them, the trainer replays them and "
        "measures its own routing beside"
    )
    external_plugins: str = Field(
        "", description="the gym runner's --external-plugins (.py files, comma-separated)"
    )
    gym_env: str | None = Field(None, description="the gym runner's --gym-env (env of rows without one)")
    ready_timeout: float = Field(180.0, gt=0, description="seconds each service may take to become ready")
    stop_grace: float = Field(20.0, gt=0, description="seconds a service may take to stop before SIGKILL")

    @model_validator(mode="after")
    def _gym_flags_need_the_gym_runner(self) -> StackSettings:
        """Plugins that no runner loads, or a missing file, would only show as episodes going wrong."""
        if (self.external_plugins or self.gym_env) and not self.gym:
            raise ValueError("--external-plugins and --gym-env go to the gym runner: add --gym")
        for path in plugin_paths(self):
            if path.suffix != ".py" or not path.is_file():
                raise ValueError(f"--external-plugins: {str(path)!r} is not a Python file")
        return self

    @model_validator(mode="after")
    def _one_broker(self) -> StackSettings:
        if self.embedded_broker and self.bootstrap_given():
            raise ValueError(
                f"--embedded-broker true and a bootstrap address ({self.bootstrap_servers}) name two "
                "brokers: give one (unset ROLLBUS_BOOTSTRAP_SERVERS to use the embedded broker)"
            )
        return self

    def bootstrap_given(self) -> bool:
        """A bootstrap address named by the user (flag or variable), not found in the state dir."""
        return "bootstrap_servers" in self.model_fields_set

    def starts_broker(self) -> bool:
        return self.embedded_broker if self.embedded_broker is not None else not self.bootstrap_given()

    def engine_scripts(self) -> list[str]:
        """The engine's script flags: ``--script`` for every request and, unless ``--script`` alone was given
        (one script for every harness), ``--codex-script`` for the Codex CLI's: each row runs under its own
        harness (``metadata.agent``), whose tools its script must call."""
        flags = ["--script", str(self.script)]
        if "codex_script" in self.model_fields_set or "script" not in self.model_fields_set:
            flags += ["--codex-script", str(self.codex_script)]
        return flags


@dataclass(frozen=True)
class Stack:
    """Where the running stack answers, for whoever drives it (the demo, a user's scripts)."""

    bootstrap: str
    namespace: str
    adapter_url: str
    engine_url: str
    admin_token: str = field(repr=False)
    log_dir: Path
    engine_key: str = field(repr=False)
    # one per run: an adapter restarted with a key of its own would refuse every session token in flight
    adapter_signing_key: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)


def service_specs(settings: StackSettings, stack: Stack) -> list[ServiceSpec]:
    engine_key = stack.engine_key
    bus = ["--bootstrap-servers", stack.bootstrap, "--namespace", stack.namespace]
    state = settings.state_dir / "up"
    engine_port = int(stack.engine_url.rsplit(":", 1)[1])
    adapter_port = int(stack.adapter_url.rsplit(":", 1)[1])
    moe = moe_flags(settings)
    specs = [
        ServiceSpec.rollbus(
            "engine",
            ["--port", str(engine_port), "--policy", settings.policy, *settings.engine_scripts(),
             *moe["engine"]],
            health_url=f"{stack.engine_url}/health", env={"ROLLBUS_ENGINE_API_KEY": engine_key},
        ),
        ServiceSpec.rollbus(
            "adapter",
            ["--port", str(adapter_port), "--sglang-url", stack.engine_url, "--state-dir", str(state), *bus,
             *moe["adapter"]],
            health_url=f"{stack.adapter_url}/healthz",
            env={"ROLLBUS_ADAPTER_ENGINE_API_KEY": engine_key,
                 "ROLLBUS_ADAPTER_ADMIN_TOKEN": stack.admin_token,
                 "ROLLBUS_ADAPTER_SIGNING_KEY": stack.adapter_signing_key},
        ),
        ServiceSpec.rollbus(
            "sandbox-runner",
            ["--adapter-url", stack.adapter_url, "--concurrency", str(settings.runner_concurrency),
             "--agent", settings.agent, "--state-dir", str(state), *bus],
            env={"ROLLBUS_SANDBOX_RUNNER_ADMIN_TOKEN": stack.admin_token}, settle=2.0,
        ),
        ServiceSpec.rollbus("grader", ["--state-dir", str(state), *bus], settle=2.0),
    ]  # fmt: skip
    if settings.gym:
        specs.append(ServiceSpec.rollbus(
            "gym-runner", ["--adapter-url", stack.adapter_url, "--state-dir", str(state), *bus,
                           *gym_flags(settings)],
            env={"ROLLBUS_GYM_RUNNER_ADMIN_TOKEN": stack.admin_token}, settle=2.0,
        ))  # fmt: skip
    specs += [
        ServiceSpec.rollbus("segmenter", ["--state-dir", str(state), *bus], settle=3.0),
        ServiceSpec.rollbus(
            "trainer",
            ["--group-size", str(settings.group_size),
             "--rollout-batch-size", str(settings.rollout_batch_size), "--steps", str(settings.steps),
             "--engine-url", stack.engine_url, "--state-dir", str(state), *bus, *moe["trainer"]],
            env={"ROLLBUS_TRAINER_ENGINE_API_KEY": engine_key}, settle=3.0,
            restart="on-failure" if settings.steps else "always", after=("engine",),  # it pushes v0 there
        ),
    ]  # fmt: skip
    return specs


def moe_flags(settings: StackSettings) -> dict[str, list[str]]:
    """With ``--moe``: the same random Qwen3-MoE on both sides (:class:`~rollbus.policy_model.MoeSpec`'s
    shape), its routes recorded by the engine, stored by the adapter (in the state dir the trainer reads)
    and replayed by the trainer, which also measures the mismatch on its own routing."""
    if not settings.moe:
        return {"engine": [], "adapter": [], "trainer": []}
    experts = ["--moe-experts", str(MoeSpec.experts)]
    return {
        "engine": [*experts, "--enable-return-routed-experts", "true"],
        "adapter": ["--routed-experts", "true"],
        "trainer": [*experts, "--routing-replay", "true", "--mismatch-unreplayed", "true"],
    }


def plugin_paths(settings: StackSettings) -> list[Path]:
    """``--external-plugins`` as absolute paths (the runner may start elsewhere)."""
    return [Path(p.strip()).expanduser().resolve() for p in settings.external_plugins.split(",") if p.strip()]


def gym_flags(settings: StackSettings) -> list[str]:
    flags = []
    if plugin_paths(settings):
        flags += ["--external-plugins", ",".join(map(str, plugin_paths(settings)))]
    if settings.gym_env:
        flags += ["--gym-env", settings.gym_env]
    return flags


@asynccontextmanager
async def running_stack(
    settings: StackSettings, on_event: Callable[[str, str], None] | None = None
) -> AsyncIterator[tuple[Stack, Supervisor]]:
    """The broker, the topics and every service, up; everything stopped on the way out, whatever happened."""
    broker = None
    bootstrap = settings.bootstrap_servers
    say = on_event or (lambda name, what: log.info("%s: %s", name, what))
    try:
        if settings.starts_broker():
            broker = EmbeddedBroker(settings.state_dir / "up", port=free_port())
            seconds = await asyncio.to_thread(broker.start)
            bootstrap = broker.bootstrap_servers
            say("broker", f"Apache Kafka (KRaft) on {bootstrap}, ready in {seconds:.1f}s")
        else:
            say("broker", f"the cluster at {bootstrap} (no embedded broker started)")
        created = await create_topics(bootstrap, namespace=settings.namespace)
        version = checkpoint_version(settings.state_dir / "up", settings.namespace)
        say("run", run_line(settings.namespace, len(created), len(TOPICS), version))
        engine_port = settings.engine_port or free_port()
        adapter_port = settings.adapter_port or free_port()
        stack = Stack(
            bootstrap, settings.namespace, f"http://127.0.0.1:{adapter_port}", f"http://127.0.0.1:{engine_port}",
            secrets.token_hex(16), settings.state_dir / "up" / "logs", secrets.token_hex(16),
        )  # fmt: skip
        supervisor = Supervisor(
            service_specs(settings, stack), stack.log_dir,
            ready_timeout=settings.ready_timeout, stop_grace=settings.stop_grace, on_event=say, broker=broker,
        )  # fmt: skip
        async with supervisor:
            yield stack, supervisor
    finally:
        if broker is not None:
            await asyncio.to_thread(broker.stop)


async def up(settings: StackSettings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running_stack(settings, lambda name, what: print(f"{name:15} {what}", flush=True)) as (
        stack,
        supervisor,
    ):
        print(f"rollbus is up: adapter {stack.adapter_url}, bus {stack.bootstrap}; logs in {stack.log_dir}")
        print("submit work with `rollbus submit DATASET.jsonl`; Ctrl-C stops everything", flush=True)
        watcher = asyncio.create_task(supervisor.watch())
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({watcher, stopped}, return_when=asyncio.FIRST_COMPLETED)
        print("stopping ...", flush=True)
        await supervisor.stop()
        await watcher
    return 0


add_arguments = StackSettings.add_arguments


def run(args: argparse.Namespace) -> int:
    settings = StackSettings.from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(up(settings))
