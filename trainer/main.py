"""Trainer: consumes the `segments` topic as a stream and publishes new weight versions to `policy`."""

from __future__ import annotations

import argparse

from rollbus.config import add_common_options, add_option
from services._stub import not_built_yet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    add_option(parser, "--batch-rollouts", default=8, type=int, help="rollouts per optimiser step")


def run(args: argparse.Namespace) -> int:
    return not_built_yet("trainer", "the segments consumer and the training step")
