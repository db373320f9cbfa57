"""Shared fixtures: one real Kafka broker for the whole session, and fresh topics per test.

Which broker (``ROLLBUS_TEST_BROKER`` forces one):

* ``docker``   — testcontainers' ``KafkaContainer`` (KRaft) from the Kafka image built here, on the
  project's Docker engine; the default when ``DOCKER_HOST`` or the default socket answers, and what
  ``make test``'s second run forces for a share of the suite (``ROLLBUS_TEST_BROKER=docker``);
* ``local``    — the embedded broker (:class:`rollbus.kafka.broker.EmbeddedBroker`) in a temporary state
  directory on a free port, when ``java`` is on PATH;
* ``external`` — whatever ``ROLLBUS_BOOTSTRAP_SERVERS`` points at.

Tests never share topics: the ``topics`` fixture creates every rollbus topic under a namespace of its
own (``t-1a2b3c4d5e.turns``), so tests can run against one broker, in any order, and against an
external cluster without touching its real topics.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollbus.kafka.topics import TOPICS, create_topics, topic_name

BROKER_KINDS = ("docker", "local", "external")
TEST_PARTITIONS = 3  # fewer than the default: quicker to create, still exercises partitioning


GPU_ONLY = {"test_trainer_cuda.py"}


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """GPU checks run on a GPU machine (bench/gpu_session.sh); where there is none they are not collected
    at all, rather than collected and skipped, since CI counts every skip as an error. torch is imported
    only when such a file is about to be collected, not at every start of the suite."""
    if collection_path.name not in GPU_ONLY:
        return None
    import torch

    return None if torch.cuda.is_available() else True


# The longest files, longest first: under xdist (make test's ``--dist loadfile --no-loadscope-reorder``) the
# workers take files in collection order, so these start at once and the short ones fill in around them
# instead of one of these starting last and running alone. Figures: seconds of a CI run on 2 cores.
LONGEST_FIRST = (
    "tests/test_demo.py",
    "tests/test_compose_up.py",
    "tests/integration/test_pipeline_faults.py",
    "tests/test_bench_quick.py",
    "tests/test_demo_task_images.py",
    "tests/test_sandbox_runner_e2e.py",
    "tests/test_trainer_service.py",
    "tests/test_e2e_claude_code.py",
    "tests/test_trainer_fsdp.py",
    "tests/test_trainer_bench.py",
    "tests/test_adapter_turns.py",
)


# Each of these starts a whole stack (engine, adapter, runner, grader, segmenter, trainer, a broker) and keeps
# both cores busy: side by side they starve each other (the fault test's 900 s wait ran out with all three at
# once under load), so they run one after another on one worker while the others take the rest of the suite.
ONE_AT_A_TIME = (
    "tests/test_demo.py",
    "tests/test_compose_up.py",
    "tests/integration/test_pipeline_faults.py",
    "tests/test_demo_task_images.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the ONE_AT_A_TIME files as one unit of work rather than a unit each.

    Under xdist's private ``_split_scope``, since its public way is broken with the pytest pinned here:
    ``--dist loadgroup`` with an ``xdist_group`` mark per file groups nothing on pytest 9.2 (xdist 3.8.0
    writes the group into ``item._nodeid``, which pytest 9.2's ``nodeid`` no longer reads: pytest-xdist
    issue 1386, fix pending in its PR 1388; tried here: one file's three tests ran on three workers).
    Move to loadgroup once a fixed xdist is locked."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WholeStacksInTurn(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "whole-stack tests" if path in ONE_AT_A_TIME else path

    return WholeStacksInTurn(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under an xdist worker, the LONGEST_FIRST files move to the front (a stable sort: each file's tests keep
    their order, every other file its place). Every worker sorts alike, as xdist requires."""
    if not hasattr(config, "workerinput"):
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kafka: needs a real Kafka broker (the kafka_bootstrap fixture)")
    config.addinivalue_line("markers", "docker: a Docker engine (the project starts its own if none answers)")
    config.addinivalue_line("markers", "compose: brings the Compose stack up (alone: pytest -m compose)")
    config.addinivalue_line(
        "markers", "faults: the whole-pipeline fault test (part of make test; alone: make test-faults)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """On CI a skip is a failure: `make test` installs everything (bwrap, Java, the CLI), so a skipped test
    there means a missing install step, not an optional feature. Set ROLLBUS_ALLOW_SKIPS=1 to relax."""
    outcome = yield
    report = outcome.get_result()
    strict = os.environ.get("CI") == "true" and os.environ.get("ROLLBUS_ALLOW_SKIPS") != "1"
    if strict and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, which must run every test: {report.longrepr}"


def docker_reachable() -> bool:
    """True if a Docker engine answers a ping (the docker SDK comes with testcontainers)."""
    try:
        import docker
        import requests
    except ImportError:
        return False
    try:
        docker.from_env(timeout=3).ping()
    except (docker.errors.DockerException, requests.RequestException, OSError):
        return False
    return True


def broker_kind() -> str:
    forced = os.environ.get("ROLLBUS_TEST_BROKER")
    if forced:
        if forced not in BROKER_KINDS:
            expected = ", ".join(BROKER_KINDS)
            raise pytest.UsageError(f"ROLLBUS_TEST_BROKER={forced!r}; expected one of {expected}")
        return forced
    if docker_reachable():
        return "docker"
    if shutil.which("java"):
        return "local"
    if os.environ.get("ROLLBUS_BOOTSTRAP_SERVERS"):
        return "external"
    raise pytest.UsageError("no Kafka for the tests: no Docker engine, no java, no ROLLBUS_BOOTSTRAP_SERVERS")


def docker_broker() -> Iterator[str]:
    """A KRaft Kafka in a container: testcontainers' ``KafkaContainer`` on the project's Docker engine
    (started where none answers), from the Kafka image built here (:mod:`rollbus.kafka.image`: the
    embedded broker's jars on Debian's JRE), so no registry is needed.

    The container joins a network of its own (the engine runs without a default bridge) under the alias
    ``kafka``, which its controller quorum names; the host reaches the mapped port on loopback. Ryuk, the
    reaper testcontainers would pull from Docker Hub, is off: the ``with`` removes the container and network.
    """
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.network import Network

    from rollbus.kafka.image import ensure_kafka_image
    from rollbus.sandbox.docker_engine import client, docker_host
    from rollbus.sandbox.docker_images import ensure_base_image

    engine = client()
    image = ensure_kafka_image(engine, ensure_base_image(engine))
    testcontainers_config.ryuk_disabled = True
    testcontainers_config.tc_host_override = "127.0.0.1"
    engine_kw = {"environment": {"DOCKER_HOST": docker_host()}}
    with Network(docker_client_kw=engine_kw) as network:
        kafka = kafka_container(image, **engine_kw).with_network(network).with_network_aliases("kafka")
        with kafka:
            yield kafka.get_bootstrap_server()


def kafka_container(image: str, **docker_client_kw: Any) -> Any:
    """The testcontainers ``KafkaContainer`` the docker path starts, in KRaft mode.

    ``kraft_enabled`` is set rather than asked for through ``with_kraft()``, whose check reads the tag as a
    Confluent Platform version (7.0 or later); ours is Kafka's own (4.1.1), which has KRaft and nothing else.
    Kafka's defaults for the transaction log (3 replicas, min ISR 2) would never let a single broker start a
    transactional producer, so both are 1. Topics are created by the ``topics`` fixture with their own
    ``max.message.bytes``, so broker-wide defaults do not matter.
    """
    from testcontainers.community.kafka import KafkaContainer

    container = (
        KafkaContainer(image, docker_client_kw=docker_client_kw or None)
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
    )
    container.kraft_enabled = True
    return container


def local_broker(state_dir: os.PathLike[str], port: int | None = None, timeout: float = 120) -> Iterator[str]:
    from rollbus.kafka.broker import EmbeddedBroker, free_port

    broker = EmbeddedBroker(state_dir, port=port or free_port())
    broker.start(timeout=timeout)
    try:
        yield broker.bootstrap_servers
    finally:
        broker.stop()


# The whole suite on the embedded broker (``make test``: no paths given, so pytest collects its testpaths):
# the broker's JVM starts in a thread at the session's start, on the second core while pytest collects for
# half a minute on the first, so the first test that needs it does not wait for its start. A run of chosen
# files starts it on first use, as before; a run that turns out to use none stops it at the end.
_early_broker: dict[str, Any] = {}


# Under pytest-xdist (``make test`` runs ``-n``) the controller starts that one broker and names it to its
# workers through this variable (they inherit its environment), so all workers share one JVM; each test's
# topics are a namespace of its own, so they do not see each other there.
SHARED_BROKER_ENV = "ROLLBUS_TEST_SHARED_BROKER"


def xdist_controller(config: pytest.Config) -> bool:
    """True in the process that hands tests to pytest-xdist workers (and runs none itself)."""
    return config.pluginmanager.hasplugin("dsession")


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if os.environ.get(SHARED_BROKER_ENV) or config.option.collectonly:
        return  # a worker: the controller's broker serves it
    chosen_files = config.args_source is not pytest.Config.ArgsSource.TESTPATHS
    if chosen_files and not xdist_controller(config):
        return
    try:
        if broker_kind() != "local":
            return
    except pytest.UsageError:
        return  # the fixture says so where a test needs a broker
    from concurrent.futures import ThreadPoolExecutor

    from rollbus.kafka.broker import free_port

    state = Path(tempfile.mkdtemp(prefix="rollbus-test-broker-"))
    port = free_port()
    # three workers collecting on two cores slow the JVM's start: more time than a broker of one's own gets
    broker = local_broker(state, port, timeout=300)
    pool = ThreadPoolExecutor(1, thread_name_prefix="early-broker")
    started = pool.submit(next, broker)
    pool.shutdown(wait=False)  # the start runs on; the fixture waits for it
    _early_broker.update(broker=broker, state=state, started=started)
    if xdist_controller(config):
        # xdist starts its workers after this hook (its own is trylast), so they inherit the name
        os.environ[SHARED_BROKER_ENV] = f"127.0.0.1:{port}"


def stop_early_broker() -> None:
    if not _early_broker:
        return
    try:
        _early_broker["started"].exception()  # a start still running is waited for before its stop
        _early_broker["broker"].close()  # local_broker's finally: the broker stops
    finally:
        shutil.rmtree(_early_broker["state"], ignore_errors=True)
        _early_broker.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_early_broker()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of the session's Kafka broker (see the module docstring for which)."""
    if shared := os.environ.get(SHARED_BROKER_ENV):
        yield shared_broker(shared)
        return
    if _early_broker:
        try:
            yield _early_broker["started"].result()
        finally:
            stop_early_broker()
        return
    kind = broker_kind()
    if kind == "docker":
        yield from docker_broker()
    elif kind == "local":
        yield from local_broker(tmp_path_factory.mktemp("rollbus-state"))
    else:
        yield os.environ["ROLLBUS_BOOTSTRAP_SERVERS"]


def shared_broker(bootstrap_servers: str, timeout: float = 300) -> str:
    """The xdist controller's broker, once it answers (it may still be starting when a worker first asks)."""
    from rollbus.kafka.broker import answers_metadata
    from rollbus.polling import WaitTimeout, wait_until

    try:
        wait_until(lambda: answers_metadata(bootstrap_servers), timeout=timeout, interval=0.5, what="broker")
    except WaitTimeout:
        message = f"the session's broker {bootstrap_servers} did not answer in {timeout:.0f} s"
        raise pytest.UsageError(message) from None
    return bootstrap_servers


def unique_namespace() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def topics(kafka_bootstrap: str) -> dict[str, str]:
    """All rollbus topics created afresh for this test: base name -> real (namespaced) name."""
    namespace = unique_namespace()
    await create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace)
    return {spec.name: topic_name(spec.name, namespace) for spec in TOPICS}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A scratch root of its own (the sandbox uids must traverse it, so not under pytest's 0700 tmp)."""
    path = Path(tempfile.mkdtemp(prefix="rollbus-test-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The built-in Qwen3.6 tokenizer (loaded once per process; shared, so never mutated)."""
    from rollbus.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
async def namespace(kafka_bootstrap: str) -> str:
    """A topic namespace of the test module's own, so its rollouts are all its readers find."""
    name = unique_namespace()
    await create_topics(kafka_bootstrap, TEST_PARTITIONS, name)
    return name


@pytest.fixture(scope="session")
def session_rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The adapter and scripted engine that every module's ``rig`` is: started once per session (an
    adapter's start, loading its tokenizer and parsers, is the slow part of a module's set-up). It publishes
    to a topic namespace of its own; tests read back their own rollouts by rollout id and take the adapter's
    counters as differences, so modules sharing it do not see each other."""
    import asyncio

    from tests.e2e_support import Rig

    namespace = unique_namespace()
    asyncio.run(create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace))
    rig = Rig(kafka_bootstrap, namespace, tmp_path_factory.mktemp("e2e-services"))
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="module")
def rig(request: pytest.FixtureRequest, session_rig: Any) -> Any:
    """The session's adapter and scripted engine for end-to-end runs of a real agent CLI; the engine replays
    the module's ``RIG_SCRIPT`` if it names one. An adapter an earlier module left stopped (a test that
    killed it and failed before restarting it) is started again."""
    session_rig.ensure_adapter()
    if script := getattr(request.module, "RIG_SCRIPT", None):
        session_rig.use_script(script)
    return session_rig


@pytest.fixture(scope="module")
def engine_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scripted engine replaying the test module's ``SCRIPT``, started once per module."""
    from tests.test_adapter_support import engine_process

    with engine_process(request.module.SCRIPT, tmp_path_factory.mktemp("engine")) as url:
        yield url
