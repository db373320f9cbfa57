"""Wait until something holds: the polling loop the embedded broker's start-up and shutdown and new topics'
visibility share (other waits still loop by hand; docs/architecture.md lists them).

Built on tenacity so the loop (deadline, fixed interval, what counts as "not yet") is written once. A check
returns True when done and False for "not yet"; an exception from the check is not retried but raised at
once, so a check can fail fast (a JVM that died during start-up) instead of waiting out the deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed


class WaitTimeout(TimeoutError):
    """The condition did not hold within the deadline; the message says what was waited for."""


def _not_yet(done: object) -> bool:
    return not done


def wait_until(check: Callable[[], bool], *, timeout: float, interval: float = 0.1, what: str) -> None:
    """Call ``check`` every ``interval`` seconds until it returns True; :class:`WaitTimeout` after
    ``timeout``."""
    retrying = Retrying(
        stop=stop_after_delay(timeout), wait=wait_fixed(interval), retry=retry_if_result(_not_yet)
    )
    try:
        retrying(check)
    except RetryError:
        raise WaitTimeout(f"{what}: not within {timeout:g}s") from None


async def wait_until_async(
    check: Callable[[], Awaitable[bool]], *, timeout: float, interval: float = 0.1, what: str
) -> None:
    """:func:`wait_until` for a coroutine check, sleeping without blocking the event loop."""
    retrying = AsyncRetrying(
        stop=stop_after_delay(timeout), wait=wait_fixed(interval), retry=retry_if_result(_not_yet)
    )
    try:
        await retrying(check)
    except RetryError:
        raise WaitTimeout(f"{what}: not within {timeout:g}s") from None
