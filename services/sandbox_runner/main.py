"""Sandbox runner: consumes `tasks`, runs the agent in a fresh sandbox per sample, publishes `diffs`."""

from __future__ import annotations

import argparse

from rollbus.config import add_common_options, add_option
from services._stub import not_built_yet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    add_option(parser, "--adapter-url", default="http://127.0.0.1:8080", help="adapter the agent talks to")
    add_option(
        parser, "--sandbox", default="bwrap", choices=["bwrap", "local", "e2b"], help="sandbox backend"
    )
    add_option(parser, "--concurrency", default=2, type=int, help="samples run at once")


def run(args: argparse.Namespace) -> int:
    return not_built_yet(
        "sandbox-runner", "the task consumer; the sandbox and CLI launcher exist in rollbus.sandbox"
    )
