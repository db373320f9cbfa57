"""``rollbus ui``: serve the pages over a read model fed from the topics (live), or over a finished demo's.

With ``--demo`` it opens the last ``rollbus demo`` run of ``--state-dir``: starts that demo's embedded broker
(its data under ``<state-dir>/up``) unless it already runs and reads the run's namespace; the broker it
started stops with it.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack

from rollbus.policy_model import DEFAULT_TOKENIZER
from rollbus.settings import BusSettings, Field, SettingsError

UI_PORT = 8090


class UiSettings(BusSettings):
    """Settings of ``rollbus ui`` (flags --x-y, variables ROLLBUS_UI_X_Y)."""

    model_config = BusSettings.scoped("ui")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(UI_PORT, ge=0, le=65535, description="port to listen on (0: any free one)")
    demo: bool = Field(
        False, description="open the last `rollbus demo` run of --state-dir (its broker and namespace)"
    )
    tokenizer: str = Field(
        DEFAULT_TOKENIZER,
        description="tokenizer that decodes token ids (a name or a model directory); empty: show the ids",
    )


add_arguments = UiSettings.add_arguments


def say(line: str) -> None:
    print(f"ui: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from rollbus.kafka.reach import quiet_kafka_logs
    from rollbus.services.ui.app import Pages, create_app
    from rollbus.services.ui.feed import feed
    from rollbus.services.ui.model import ReadModel

    settings = UiSettings.from_args(args)
    quiet_kafka_logs()
    # a SIGTERM (and uvicorn re-raises it once it has shut down) is an exit that unwinds: the broker stops
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with ExitStack() as stack:
        bootstrap, namespace = settings.bootstrap_servers, settings.namespace
        if settings.demo:
            bootstrap, namespace = open_demo(settings, stack)
        model = ReadModel()
        source = f"{bootstrap} · {namespace or '(no namespace)'}"
        pages = Pages(model, source, decoder(settings.tokenizer))
        app = create_app(pages, lambda: feed(bootstrap, namespace, model, follow=True, on_status=say))
        say(f"reading {source}; serving http://{settings.host}:{settings.port}/")
        try:
            uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
        except KeyboardInterrupt:
            return 130
    return 0


def decoder(tokenizer: str) -> Callable[[list[int]], str] | None:
    """The tokenizer's decode (special tokens shown, so template tokens stay visible), or None for ids."""
    if not tokenizer:
        return None
    from rollbus.tokenizer import load_tokenizer, one_text

    loaded = load_tokenizer(tokenizer)
    return lambda ids: one_text(loaded.decode(ids, skip_special_tokens=False))


def open_demo(settings: UiSettings, stack: ExitStack) -> tuple[str, str]:
    """The demo's broker (started here if it is not running) and its namespace."""
    from rollbus.demo_runs import NoEarlierRun, last_demo
    from rollbus.kafka.broker import EmbeddedBroker, free_port

    state = settings.state_dir / "up"
    try:
        namespace = settings.namespace if "namespace" in settings.model_fields_set else last_demo(state)
    except NoEarlierRun:
        raise SettingsError(f"--demo: no demo run recorded in {state}") from None
    broker = EmbeddedBroker(state, port=free_port())
    if broker.is_running():
        bootstrap = f"127.0.0.1:{broker.record()['port']}"
    else:
        broker.start()
        stack.callback(broker.stop)
        bootstrap = broker.bootstrap_servers
    return bootstrap, namespace
