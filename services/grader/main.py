"""Grader: consumes `diffs`, applies each patch in a clean sandbox, runs the tests, publishes `rewards`."""

from __future__ import annotations

import argparse

from rollbus.config import add_common_options, add_option
from services._stub import not_built_yet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    add_option(
        parser, "--sandbox", default="bwrap", choices=["bwrap", "local", "e2b"], help="sandbox backend"
    )
    add_option(parser, "--timeout", default=900.0, type=float, help="seconds allowed for one evaluation")


def run(args: argparse.Namespace) -> int:
    return not_built_yet("grader", "the clean-sandbox evaluation")
