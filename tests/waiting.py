"""The tests' one wait: poll a check until it holds, on the loop of :mod:`rollbus.polling` (the product's own,
tested in ``test_ops_units.py``), and fail naming what never came (and the tail of a log, when given).

The deadline only stops a broken run from hanging the suite; a loaded machine just takes longer. A check
may be sync or async (an async test polling a process, a topic or a fake alike); an exception it raises is
not retried but fails the wait at once (a process that died while it was waited for). Never wait a fixed
time before asserting that something did *not* happen: wait for a later event that proves it would have.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rollbus.kafka.in_flight import InFlightConsumer
from rollbus.polling import WaitTimeout, wait_until, wait_until_async

Check = Callable[[], object | Awaitable[object]]


async def until(
    check: Check, what: str, *, timeout: float = 60.0, interval: float = 0.05,
    log: Callable[[], str] | None = None,
) -> None:  # fmt: skip
    """Return once ``check()`` (awaited if it returns an awaitable) is truthy; AssertionError after
    ``timeout``."""

    async def holds() -> bool:
        done = check()
        return bool(await done if inspect.isawaitable(done) else done)

    try:
        await wait_until_async(holds, timeout=timeout, interval=interval, what=what)
    except WaitTimeout as exc:
        raise AssertionError(_why(exc, log)) from None


def until_sync(
    check: Callable[[], object], what: str, *, timeout: float = 60.0, interval: float = 0.05,
    log: Callable[[], str] | None = None,
) -> None:  # fmt: skip
    """:func:`until` for a sync test."""
    try:
        wait_until(lambda: bool(check()), timeout=timeout, interval=interval, what=what)
    except WaitTimeout as exc:
        raise AssertionError(_why(exc, log)) from None


def _why(exc: WaitTimeout, log: Callable[[], str] | None) -> str:
    return f"timed out waiting for {exc}" + (f":\n{log()[-6000:]}" if log is not None else "")


def count_polls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many polls the runners' loops (:class:`InFlightConsumer`) have ended, each with its commit step:
    the later event to wait for before asserting that a poll did not start or commit something."""
    ended = [0]
    commit = InFlightConsumer.commit

    async def counted(self: InFlightConsumer, partitions: Any) -> None:
        await commit(self, partitions)
        ended[0] += 1

    monkeypatch.setattr(InFlightConsumer, "commit", counted)
    return ended
