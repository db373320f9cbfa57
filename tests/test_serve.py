"""The one start-up every service shares (rollbus/serve.py): a known error is one line and exit 1, anything
else keeps its traceback, SIGTERM and SIGINT stop the service cleanly. No broker needed: ``bus=None``, or a
port where nothing listens."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
from aiokafka.errors import KafkaConnectionError

from rollbus.kafka.broker import free_port
from rollbus.kafka.reach import BrokerUnreachable
from rollbus.kafka.topics import TopicsError
from rollbus.serve import one_line_errors, refusal, run_service
from rollbus.settings import BusSettings


class RowsUnreadable(Exception):
    """A service's own known error."""


def failing(error: Exception):  # a service whose start fails with ``error``
    async def main(stop: asyncio.Event) -> int:
        raise error

    return main


@pytest.mark.parametrize(
    ("error", "known", "line"),
    [
        (TopicsError("missing topics ns.tasks: run `rollbus topics create`"), (),
         "rollbus grader: missing topics ns.tasks: run `rollbus topics create`"),
        (BrokerUnreachable("127.0.0.1:1", 3), (),
         "rollbus grader: no Kafka broker answers at 127.0.0.1:1 (waited up to 3s)"),
        (RowsUnreadable("rows.jsonl: line 3 is not JSON"), (RowsUnreadable,),
         "rollbus grader: rows.jsonl: line 3 is not JSON"),
    ],
)  # fmt: skip
def test_a_known_error_is_one_line_on_stderr_and_exit_1(capsys, error, known, line) -> None:
    with pytest.raises(SystemExit) as stopped:
        run_service("grader", failing(error), bus=None, known=known)
    assert stopped.value.code == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(line) and err.count("\n") == 1, err


def test_a_broker_error_names_the_address_it_was_asked_at(capsys) -> None:
    bus = BusSettings(bootstrap_servers="10.0.0.9:9092", namespace="t")
    assert refusal(KafkaConnectionError("Unable to bootstrap"), bus).startswith("10.0.0.9:9092: ")
    assert refusal(TopicsError("missing topics t.tasks"), bus) == "missing topics t.tasks"
    with pytest.raises(SystemExit) as stopped, one_line_errors("trainer", bus=bus):
        raise KafkaConnectionError("Unable to bootstrap")
    assert stopped.value.code == 1
    assert capsys.readouterr().err.startswith("rollbus trainer: 10.0.0.9:9092: ")


def test_no_broker_is_one_line_naming_the_address_and_the_service_never_starts(capsys, caplog) -> None:
    address = f"127.0.0.1:{free_port()}"  # nobody listens: connections are refused
    started: list[bool] = []

    async def main(stop: asyncio.Event) -> None:
        started.append(True)

    caplog.set_level(logging.DEBUG, logger="aiokafka")
    with pytest.raises(SystemExit) as stopped:
        run_service("grader", main, bus=BusSettings(bootstrap_servers=address, namespace="t"))
    assert stopped.value.code == 1 and started == []
    err = capsys.readouterr().err
    assert err.startswith(f"rollbus grader: no Kafka broker answers at {address}") and err.count("\n") == 1
    assert "rollbus broker start" in err
    assert not [r for r in caplog.records if r.name.startswith("aiokafka") and r.levelno >= logging.WARNING]
    assert logging.getLogger("aiokafka").level == logging.DEBUG  # the probe's silence ends with the probe


def test_an_unknown_error_keeps_its_traceback(capsys) -> None:
    with pytest.raises(ZeroDivisionError):  # not swallowed into a line: the interpreter prints it whole
        run_service("grader", failing(ZeroDivisionError("a bug")), bus=None)
    with pytest.raises(RowsUnreadable):  # another service's known error is not this one's
        run_service("grader", failing(RowsUnreadable("x")), bus=None, known=(TopicsError,))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_sets_stop_and_the_service_returns_its_status(sig) -> None:
    seen: list[str] = []

    async def main(stop: asyncio.Event) -> int:
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(stop.wait(), 10)  # set by the signal, not by a timeout (that would raise)
        seen.append("stopped")
        return 0

    # were the signal not handled, this stand-in sees it (and the wait times out) instead of pytest dying
    previous = signal.signal(sig, lambda *_: seen.append("not handled"))
    try:
        assert run_service("grader", main, bus=None) == 0
    finally:
        signal.signal(sig, previous)
    assert seen == ["stopped"]


def test_without_signals_the_server_keeps_them_and_none_is_left_installed() -> None:
    """``signals=False`` (uvicorn owns them) installs nothing; after a run the process's handlers are as
    before (the loop's handlers go with the loop)."""
    before = signal.getsignal(signal.SIGTERM)

    async def main(stop: asyncio.Event) -> None:
        assert signal.getsignal(signal.SIGTERM) == before

    assert run_service("adapter", main, bus=None, signals=False) == 0
    assert run_service("grader", returning(3), bus=None) == 3  # a service's own exit status passes
    assert signal.getsignal(signal.SIGTERM) == before


def returning(status: int):
    async def main(stop: asyncio.Event) -> int:
        return status

    return main
