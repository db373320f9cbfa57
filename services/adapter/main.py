"""``rollbus adapter``: the Anthropic Messages API over an SGLang server; every turn goes to the bus.

On SIGTERM/SIGINT it drains first (new turns get 503, turns in flight finish and are published), then
stops serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from types import FrameType

import uvicorn

from rollbus.config import add_common_options, add_option, parse_bool
from rollbus.topics import TopicsError, check_topics
from services.adapter.settings import HISTORY_MODES, MIN_SIGNING_KEY_BYTES, AdapterSettings
from services.adapter.state import AdapterState


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    defaults = AdapterSettings()
    add_option(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_option(parser, "--port", default=8082, type=int, help="port to listen on")
    add_option(
        parser, "--sglang-url", default=defaults.sglang_url, help="SGLang (or rollbus engine) base URL"
    )
    add_option(parser, "--tokenizer", default=defaults.tokenizer, help="built-in tokenizer name or directory")
    add_option(
        parser,
        "--context-length",
        default=defaults.context_length,
        type=int,
        help="model context in tokens; longer prompts get 'prompt is too long'",
    )
    add_option(
        parser,
        "--max-new-tokens",
        default=defaults.max_new_tokens,
        type=int,
        help="cap on sampled tokens per turn",
    )
    add_option(
        parser,
        "--history-mode",
        default=defaults.history_mode,
        choices=list(HISTORY_MODES),
        help="canonical: append-only token history; rerender: render every prompt whole",
    )
    add_option(parser, "--tool-parser", default=defaults.tool_parser, help="SGLang tool-call parser")
    add_option(
        parser,
        "--reasoning-parser",
        default=defaults.reasoning_parser,
        help="SGLang reasoning parser ('' for none)",
    )
    add_option(
        parser,
        "--max-concurrency",
        default=defaults.max_concurrency,
        type=int,
        help="turns generating at once; more get 529 + retry-after",
    )
    add_option(
        parser,
        "--body-limit",
        default=defaults.body_limit,
        type=int,
        help="largest request body in bytes (413 above)",
    )
    add_option(parser, "--admin-token", default=None, help="bearer token of the /admin API (off if unset)")
    add_option(
        parser,
        "--engine-api-key",
        default=None,
        help="the engine's --api-key, sent as a bearer token (prefer the variable; never give it to agents)",
    )
    add_option(
        parser,
        "--outbox-capacity",
        default=defaults.outbox_capacity,
        type=int,
        help="records waiting for the bus before new turns get 503",
    )
    add_option(
        parser,
        "--outbox-capacity-bytes",
        default=defaults.outbox_capacity_bytes,
        type=int,
        help="encoded bytes waiting for the bus before new turns get 503",
    )
    add_option(
        parser,
        "--publish-wait",
        default=defaults.publish_wait,
        type=float,
        help="seconds a turn waits for the bus to acknowledge it before answering (it stays queued)",
    )
    add_option(
        parser,
        "--bus-request-timeout",
        default=defaults.bus_request_timeout,
        type=float,
        help="seconds the producer retries one delivery before the outbox retries it",
    )
    add_option(
        parser,
        "--max-chains-per-rollout",
        default=defaults.max_chains_per_rollout,
        type=int,
        help="chains one rollout may open (main, sub-agents, side calls, rewrites); more get 400",
    )
    add_option(
        parser,
        "--token-ttl",
        default=defaults.token_ttl,
        type=float,
        help="seconds a session token stays valid",
    )
    add_option(
        parser,
        "--restore-sessions",
        default=defaults.restore_sessions,
        type=parse_bool,
        nargs="?",
        const=True,
        help="rebuild open rollouts from the bus at start, so their agents carry on across a restart",
    )
    add_option(
        parser,
        "--body-timeout",
        default=defaults.body_timeout,
        type=float,
        help="seconds a request body may take to arrive in full (408 after)",
    )
    add_option(
        parser,
        "--open-sessions",
        default=False,
        type=parse_bool,
        nargs="?",
        const=True,
        help="dev: accept any session token, as the rollout id itself",
    )
    add_option(
        parser,
        "--policy-version",
        default=defaults.policy_version,
        type=int,
        help="policy version recorded when the engine reports none",
    )
    add_option(
        parser,
        "--namespace",
        default=defaults.topic_namespace,
        help="prefix of the topics published to (tests, parallel demos); empty: the real topics",
        shared=True,
    )
    add_option(
        parser,
        "--ping-interval",
        default=defaults.ping_interval,
        type=float,
        help="seconds between SSE pings while a turn generates",
    )
    add_option(
        parser,
        "--session-idle-timeout",
        default=defaults.session_idle_timeout,
        type=float,
        help="seconds without a request after which a session's chains close and its token stops (0: never)",
    )
    add_option(
        parser,
        "--signing-key",
        default=None,
        help=f"HMAC key of thinking signatures, at least {MIN_SIGNING_KEY_BYTES} bytes; replicas and "
        "restarts sharing it recognise each other's signatures (unset: random per process; prefer the "
        "variable, flags show in ps)",
    )


def settings_from(args: argparse.Namespace) -> AdapterSettings:
    """The settings the flags describe; a bad value raises ValueError naming it."""
    key = {} if args.signing_key is None else {"signing_key": args.signing_key.encode()}
    return AdapterSettings(
        sglang_url=args.sglang_url,
        tokenizer=args.tokenizer,
        context_length=args.context_length,
        max_new_tokens=args.max_new_tokens,
        history_mode=args.history_mode,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        max_concurrency=args.max_concurrency,
        body_limit=args.body_limit,
        admin_token=args.admin_token,
        engine_api_key=args.engine_api_key or None,
        body_timeout=args.body_timeout,
        max_chains_per_rollout=args.max_chains_per_rollout,
        token_ttl=args.token_ttl,
        restore_sessions=args.restore_sessions,
        outbox_capacity=args.outbox_capacity,
        outbox_capacity_bytes=args.outbox_capacity_bytes,
        publish_wait=args.publish_wait,
        bus_request_timeout=args.bus_request_timeout,
        open_sessions=args.open_sessions,
        policy_version=args.policy_version,
        topic_namespace=args.namespace,
        ping_interval=args.ping_interval,
        session_idle_timeout=args.session_idle_timeout,
        state_dir=Path(args.state_dir),
        **key,
    )


async def serve(args: argparse.Namespace) -> None:
    from rollbus.bus import Publisher
    from services.adapter.app import create_app
    from services.adapter.restore import bus_records

    settings = settings_from(args)
    # refuse to run on missing or mismatched topics: a rollout's events must meet in one partition
    await check_topics(args.bootstrap_servers, settings.topic_namespace)
    timeout_ms = int(settings.bus_request_timeout * 1000)
    records = await bus_records(args.bootstrap_servers) if settings.restore_sessions else None
    async with Publisher(
        args.bootstrap_servers, client_id="rollbus-adapter", request_timeout_ms=timeout_ms
    ) as publisher:
        app = create_app(settings, publisher, records=records)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
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

    server.handle_exit = drain_then_exit  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        settings_from(args)
    except ValueError as exc:
        raise SystemExit(f"rollbus adapter: {exc}") from exc
    try:
        asyncio.run(serve(args))
    except TopicsError as exc:
        raise SystemExit(f"rollbus adapter: {exc}") from exc
    return 0
