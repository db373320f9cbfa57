"""Segmenter: a Faust app joining `turns`, `sessions`, `diffs`, `rewards` per rollout into `segments`."""

from __future__ import annotations

import argparse

from rollbus.config import add_common_options, add_option
from services._stub import not_built_yet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    add_option(
        parser, "--loss-scope", default="all_turns", choices=["all_turns", "last_turn"], help="loss scope"
    )


def run(args: argparse.Namespace) -> int:
    return not_built_yet("segmenter", "the Faust join; the pure segmentation lives in rollbus.trajectory")
