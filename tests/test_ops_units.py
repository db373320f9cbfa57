"""Small operator-facing pieces, pure or nearly: the polling helper, where the bus is found by default,
the port `broker start` picks, the demo's closing hint, and the Makefile's targets."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from rollbus.config import recorded_bootstrap
from rollbus.events import RewardEvent
from rollbus.kafka.broker import DEFAULT_PORT, EmbeddedBroker, start_port
from rollbus.polling import WaitTimeout, wait_until, wait_until_async
from rollbus.services.stack.demo import failure_note, failure_shown, replay_hint
from tests.event_samples import SAMPLES
from tests.waiting import until, until_sync

ROOT = Path(__file__).resolve().parents[1]


def test_wait_until_returns_once_true_and_times_out_naming_what() -> None:
    answers = iter([False, False, True])
    wait_until(lambda: next(answers), timeout=30, interval=0.01, what="third time")
    with pytest.raises(WaitTimeout, match="never: not within 0.05s"):
        wait_until(lambda: False, timeout=0.05, interval=0.01, what="never")


def test_a_failing_check_is_raised_at_once_not_retried() -> None:
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("the process died")

    with pytest.raises(RuntimeError, match="the process died"):
        wait_until(broken, timeout=30, interval=0.01, what="x")
    assert calls == [1]


async def test_async_wait_until_polls_a_coroutine() -> None:
    answers = iter([False, True])

    async def check() -> bool:
        return next(answers)

    await wait_until_async(check, timeout=30, interval=0.01, what="second time")
    with pytest.raises(WaitTimeout):
        await wait_until_async(_never, timeout=0.05, interval=0.01, what="never")


async def _never() -> bool:
    return False


def record_broker(state: Path, port: int) -> None:
    (state / "kafka").mkdir(parents=True, exist_ok=True)
    (state / "kafka" / "broker.json").write_text(json.dumps({"pid": 1, "port": port, "controller_port": 2}))


def test_default_bootstrap_is_the_variable_then_the_recorded_broker_then_9092(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollbus.settings import BusSettings

    where = lambda: BusSettings.load({"state_dir": tmp_path}).bootstrap_servers  # noqa: E731
    monkeypatch.delenv("ROLLBUS_BOOTSTRAP_SERVERS", raising=False)
    assert recorded_bootstrap(tmp_path) is None
    assert where() == "127.0.0.1:9092"
    record_broker(tmp_path, 41234)
    assert where() == "127.0.0.1:41234"
    monkeypatch.setenv("ROLLBUS_BOOTSTRAP_SERVERS", "kafka:9092")
    assert where() == "kafka:9092"
    (tmp_path / "kafka" / "broker.json").write_text("{torn")  # a half-written record is no record
    monkeypatch.delenv("ROLLBUS_BOOTSTRAP_SERVERS")
    assert where() == "127.0.0.1:9092"


def test_the_cli_resolves_the_default_against_the_state_dir_given(tmp_path: Path, monkeypatch) -> None:
    from rollbus.cli import main
    from rollbus.commands.topics import TopicsSettings

    monkeypatch.delenv("ROLLBUS_BOOTSTRAP_SERVERS", raising=False)
    record_broker(tmp_path, 1)  # nothing listens on port 1: the error names the address it tried
    seen = []
    found = lambda args: seen.append(TopicsSettings.from_args(args).bootstrap_servers) or 0  # noqa: E731
    monkeypatch.setattr("rollbus.commands.topics.run", found)
    assert main(["topics", "list", "--state-dir", str(tmp_path)]) == 0
    assert main(["topics", "list", "--state-dir", str(tmp_path), "--bootstrap-servers", "b:1"]) == 0
    assert seen == ["127.0.0.1:1", "b:1"]


def test_broker_start_port_keeps_the_last_one_and_moves_off_a_taken_one(tmp_path: Path, capsys) -> None:
    broker = EmbeddedBroker(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        assert start_port(broker, busy) == busy  # asked for explicitly: EmbeddedBroker.start refuses it
        record_broker(tmp_path, busy)
        moved = start_port(broker, None)
        assert moved != busy
        assert f"port {busy} is taken; starting on 127.0.0.1:{moved}" in capsys.readouterr().err
    record_broker(tmp_path, busy)  # free again: the last start's port is kept, so clients keep finding it
    assert start_port(broker, None) == busy
    (tmp_path / "kafka" / "broker.json").unlink()
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", DEFAULT_PORT)) != 0:
            assert start_port(EmbeddedBroker(tmp_path), None) == DEFAULT_PORT


def test_demo_hint_names_the_broker_the_demo_used() -> None:
    own = replay_hint("demo-1", "127.0.0.1:40000", Path("/tmp/my state/demo"))
    assert "rollbus broker start --state-dir '/tmp/my state/demo'" in own
    assert "rollbus replay turns --key demo-1 --format table --state-dir '/tmp/my state/demo'" in own
    external = replay_hint("demo-1", "kafka.example:9093", None)
    assert external.endswith("--bootstrap-servers kafka.example:9093") and "broker start" not in external


def reward(**fields: Any) -> RewardEvent:
    return RewardEvent.from_dict({**SAMPLES["reward"], **fields})


def test_demo_names_the_runners_failure_and_its_last_words() -> None:
    """What failed: a CI demo showed only `rollout_failed` for a rollout the Codex CLI ended, and nothing of
    why. The table now names the runner's kind and prints the tail of what the CLI said."""
    said = "x" * 900 + " codex: stream disconnected\n  before completion"
    failed = reward(failure_kind="rollout_failed",
                    details=json.dumps({"note": f"the rollout ended with agent_crashed: {said}",
                                        "rollout_failure": "agent_crashed"}))  # fmt: skip
    assert failure_shown(failed) == "rollout_failed (agent_crashed)"
    note = failure_note(failed)
    assert note.endswith("codex: stream disconnected before completion") and len(note) == 600
    graded = reward(failure_kind="tests_failed", details=json.dumps({"note": "2 tests failed"}))
    assert (failure_shown(graded), failure_note(graded)) == ("tests_failed", "")
    for odd in (reward(details="not json"), reward(details="[1]"), reward(details="")):
        assert (failure_shown(odd), failure_note(odd)) == ("", "")


def test_every_phony_make_target_is_defined() -> None:
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M)
    assert phony is not None
    defined = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, re.M))
    assert {"broker-start", "broker-stop", "test", "demo"} <= set(phony.group(1).split())
    assert set(phony.group(1).split()) <= defined
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_service_stop_ends_the_service_and_what_it_started_even_if_it_ignores_sigterm(tmp_path) -> None:
    """``ServiceProcess.stop``: SIGTERM to the process tree, SIGKILL to what lingers; no orphans."""
    import subprocess

    import psutil

    from tests.service_process import ServiceProcess

    service = ServiceProcess("stubborn", [], health_url="http://127.0.0.1:1/", log_dir=tmp_path)
    service.proc = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300 & wait"], start_new_session=True)
    wait_until(lambda: bool(psutil.Process(service.proc.pid).children()), timeout=30, what="child started")
    child = psutil.Process(service.proc.pid).children()[0].pid
    service.stop(timeout=0.5)
    assert service.proc.poll() is not None and gone(child)
    service.stop()  # a second stop is a no-op


async def test_the_tests_one_wait_takes_sync_and_async_checks_and_names_what_never_came() -> None:
    answers = iter([0, [], "yes"])
    await until(lambda: next(answers), "a truthy answer", interval=0.01)

    async def ready() -> bool:
        return True

    await until(ready, "an async check")
    until_sync(lambda: True, "at once")
    never = "timed out waiting for the never: not within 0.05s:\nthe log's tail"
    with pytest.raises(AssertionError, match=never):
        await until(lambda: False, "the never", timeout=0.05, interval=0.01, log=lambda: "the log's tail")
    with pytest.raises(AssertionError, match="timed out waiting for the sync never"):
        until_sync(lambda: False, "the sync never", timeout=0.05, interval=0.01)
