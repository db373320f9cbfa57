"""``rollbus adapter``: the Anthropic Messages API over an SGLang server; every turn goes to the bus.

On SIGTERM/SIGINT it drains first (new turns get 503, turns in flight finish and are published), then
stops serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from types import FrameType

import uvicorn

from rollbus.serve import run_service
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.state import AdapterState

add_arguments = AdapterSettings.add_arguments


def settings_from(args: argparse.Namespace) -> AdapterSettings:
    """The settings the flags and ``ROLLBUS_ADAPTER_*`` variables describe; a bad value raises
    :class:`~rollbus.settings.SettingsError` (one line naming it, exit 2 from ``rollbus``)."""
    return AdapterSettings.from_args(args)


async def serve(settings: AdapterSettings) -> None:
    """Publish and serve until uvicorn stops (the topics are checked already: :func:`run`)."""
    from rollbus.kafka.bus import Publisher
    from rollbus.services.adapter.app import create_app
    from rollbus.services.adapter.restore import bus_records

    timeout_ms = int(settings.bus_request_timeout * 1000)
    records = await bus_records(settings.bootstrap_servers) if settings.restore_sessions else None
    async with Publisher(
        settings.bootstrap_servers, client_id="rollbus-adapter", request_timeout_ms=timeout_ms
    ) as publisher:
        app = create_app(settings, publisher, records=records)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
        server = uvicorn.Server(config)
        install_drain(server, app.state.adapter, settings.drain_timeout)
        await server.serve()


def install_drain(server: uvicorn.Server, state: AdapterState, timeout: float) -> None:
    """First signal: refuse new turns, and stop uvicorn once those in flight are done. Second: stop now."""
    stop = server.handle_exit
    loop = asyncio.get_running_loop()

    def drain_then_exit(sig: int, frame: FrameType | None) -> None:
        if state.draining:
            stop(sig, frame)
            return
        state.draining = True  # from here every new turn gets 503

        def start() -> None:
            drained = loop.create_task(state.drain(timeout))
            drained.add_done_callback(lambda _: stop(sig, frame))

        loop.call_soon_threadsafe(start)  # signal handlers run between bytecodes: wake the loop properly

    server.handle_exit = drain_then_exit  # type: ignore[method-assign]  # uvicorn's signal hook, replaced


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)  # before logging, a port or the bus: a bad value is one line, exit 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # topics checked first; uvicorn owns the signals (install_drain): no stop event
    return run_service("adapter", lambda _stop: serve(settings), bus=settings, signals=False)
