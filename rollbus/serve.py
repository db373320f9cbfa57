"""How a service starts and stops, written once for all of them.

Every long-running service (``rollbus adapter``, ``grader``, ``gym-runner``, ``sandbox-runner``,
``segmenter``, ``trainer``) starts through here, so each refuses the same things the same way: missing topics
or topics on mismatched partition counts, a broker that is not there, and the service's own known errors
(a refill dataset that cannot be read, an unproven upstream) are each one line ``rollbus NAME: why`` on
stderr and exit 1, before anything ran. A bad flag or variable is refused earlier, by :mod:`rollbus.cli`
(exit 2). Anything else is a bug and keeps its traceback. SIGTERM and SIGINT set the service's ``stop``
event: it finishes or hands back what it holds and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator

from aiokafka.errors import KafkaError

from rollbus.kafka.reach import BrokerUnreachable, require_broker
from rollbus.kafka.topics import TopicsError, check_topics
from rollbus.settings import BusSettings

# what a service may meet at start-up through no fault of its own code: said in one line, not a traceback
KNOWN_ERRORS: tuple[type[Exception], ...] = (TopicsError, BrokerUnreachable, KafkaError)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# how long a broker may take to answer the start-up probe (one refusing connections fails at once)
PROBE_TIMEOUT_S = 30.0

Main = Callable[[asyncio.Event], Awaitable[int | None]]


def refusal(error: Exception, bus: BusSettings | None = None) -> str:
    """What to say about a known error: a broker's own error names the address it was asked at."""
    if isinstance(error, KafkaError) and bus is not None:
        return f"{bus.bootstrap_servers}: {error}"
    return str(error)


@contextlib.contextmanager
def one_line_errors(name: str, *known: type[Exception], bus: BusSettings | None = None) -> Iterator[None]:
    """Inside, a known error (:data:`KNOWN_ERRORS` and ``known``) becomes ``rollbus NAME: why`` on stderr
    and ``SystemExit(1)``; any other exception passes untouched."""
    try:
        yield
    except (*KNOWN_ERRORS, *known) as error:
        print(f"rollbus {name}: {refusal(error, bus)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (in the running loop; the handlers go when the loop closes)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)


async def ready_topics(bus: BusSettings) -> dict[str, int]:
    """The topics' partition counts once a broker answers at ``bus`` and its topics are all there, on one
    count (:func:`~rollbus.kafka.topics.check_topics`); else :class:`BrokerUnreachable` or
    :class:`TopicsError`. The probe is quiet: aiokafka's own lines about a refused connection would precede
    the one line said about it."""
    chatter = logging.getLogger("aiokafka")
    level = chatter.level
    chatter.setLevel(logging.CRITICAL + 1)
    try:
        await require_broker(bus.bootstrap_servers, PROBE_TIMEOUT_S)
    finally:
        chatter.setLevel(level)
    return await check_topics(bus.bootstrap_servers, bus.namespace)


def check_topics_now(bus: BusSettings) -> dict[str, int]:
    """:func:`ready_topics` from synchronous code (before a slow start-up: torch, a model, a Faust worker),
    so a wrong bus is refused in seconds, not after minutes."""
    return asyncio.run(ready_topics(bus))


def run_service(
    name: str,
    main: Main,
    *,
    bus: BusSettings | None,
    known: tuple[type[Exception], ...] = (),
    signals: bool = True,
) -> int:
    """Check ``bus``'s topics (None: checked already), then run ``main(stop)`` in a fresh event loop until it
    returns; SIGTERM/SIGINT set ``stop`` unless ``signals`` is False (a server that owns them, uvicorn).
    ``main``'s return value is the exit status (None: 0); a known error is one line and exit 1."""
    with one_line_errors(name, *known, bus=bus):
        return asyncio.run(_started(main, bus, signals)) or 0


async def _started(main: Main, bus: BusSettings | None, signals: bool) -> int | None:
    if bus is not None:  # refuse missing or mismatched topics: a rollout's events must meet in one partition
        await ready_topics(bus)
    stop = asyncio.Event()
    if signals:
        stop_on_signals(stop)
    return await main(stop)
