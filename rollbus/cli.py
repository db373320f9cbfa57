"""The rollbus command: one subcommand per service and tool.

Subcommands are listed explicitly in :data:`COMMANDS` (name -> module); each module exposes
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when chosen, so
``rollbus --help`` stays fast and a service's heavy imports never slow another.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rollbus.settings import SettingsError

COMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("rollbus.broker", "run the embedded Apache Kafka broker (start|stop|status|fetch)"),
    "topics": ("rollbus.topics", "create or check the rollbus topics"),
    "replay": ("rollbus.replay", "decode and print events from a topic"),
    "tail": ("rollbus.replay", "follow a topic live"),
    "adapter": ("services.adapter.main", "Anthropic Messages API over SGLang; publishes turns"),
    "engine": ("services.engine.main", "local SGLang-compatible model server (CPU)"),
    "sandbox-runner": ("services.sandbox_runner.main", "runs the coding agent per task; publishes diffs"),
    "grader": ("services.grader.main", "grades diffs in a clean sandbox; publishes rewards"),
    "gym-runner": ("services.gym_runner.main", "runs gym episodes through the adapter; publishes rewards"),
    "segmenter": ("services.segmenter.main", "joins turns, sessions and rewards into segments"),
    "trainer": ("trainer.main", "consumes segments and trains the policy"),
    "export": ("rollbus.export", "write gym episodes from the topics as ms-swift-style JSON lines"),
    "demo": ("rollbus.demo", "run the end-to-end slice on embedded defaults"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rollbus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"rollbus {name}", description=COMMANDS[name][1])
    add = getattr(module, f"add_{name.replace('-', '_')}_arguments", module.add_arguments)
    add(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except SettingsError as exc:  # a bad flag or variable: one line, before anything started
        cmd_parser.exit(2, f"{cmd_parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    raise SystemExit(main())
