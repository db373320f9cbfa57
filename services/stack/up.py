"""``rollbus up``: the whole pipeline on embedded defaults, as supervised processes, until Ctrl-C.

Broker (the embedded Apache Kafka of the state dir, unless a bootstrap address is given: then that cluster,
and no broker is started), engine, adapter, sandbox runner, grader, gym runner, segmenter and trainer, each
started as a user would (``python -m rollbus <service>``), all at once (the trainer once the engine, which it
pushes its first weights to, is ready); a crashed service
is restarted with backoff, and a dead embedded broker is started again on its data and port (the services
that died with it restart once it answers); Ctrl-C (or SIGTERM) stops everything, also during start-up,
leaving no process behind. Started again on the same state dir and namespace it continues that run, and
says so (:mod:`rollbus.demo_runs`).

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

from rollbus.demo_runs import checkpoint_version, run_line
from rollbus.kafka.broker import EmbeddedBroker, free_port
from rollbus.kafka.topics import TOPICS, create_topics
from rollbus.policy_model import MoeSpec
from rollbus.services.stack.settings import EXAMPLES, StackSettings, plugin_paths
from rollbus.services.stack.supervisor import ServiceSpec, Supervisor

MODEL = "rollbus-engine"
log = logging.getLogger("rollbus.up")


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
             "--agent", settings.agent, "--state-dir", str(state), *bus,
             *settings.backend_flags()["sandbox-runner"],
             *(["--inject-infra-failures", str(settings.inject_infra_failures)]
               if settings.inject_infra_failures else [])],
            env={"ROLLBUS_SANDBOX_RUNNER_ADMIN_TOKEN": stack.admin_token}, settle=2.0,
        ),
        ServiceSpec.rollbus(
            "grader", ["--state-dir", str(state), *bus, *settings.backend_flags()["grader"]], settle=2.0
        ),
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
            ["--group-size", str(settings.group_size), "--over-sample", str(settings.over_sample),
             "--rollout-batch-size", str(settings.rollout_batch_size), "--steps", str(settings.steps),
             "--engine-url", stack.engine_url, "--state-dir", str(state), *bus, *moe["trainer"],
             *(["--refill-dataset", str(settings.refill_dataset)] if settings.refill_dataset else [])],
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
__all__ = ["EXAMPLES", "StackSettings", "plugin_paths"]  # their home is settings.py (light, for --help)


def run(args: argparse.Namespace) -> int:
    settings = StackSettings.from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(up(settings))
