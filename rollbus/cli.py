"""The rollbus command: one subcommand per service and tool.

Subcommands are listed explicitly in :data:`COMMANDS` (name -> module); each module exposes
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when chosen, so
``rollbus --help`` stays fast and a service's heavy imports never slow another. A command whose flags are
one settings class names it in :data:`ARGUMENTS`: its parser is built from that (light) module alone and the
command module is imported only once the flags parsed, so ``--help`` imports neither the model libraries nor
the Kafka, HTTP and server clients the service runs on (``tests/test_cli_help.py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from rollbus.settings import SettingsError

COMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("rollbus.kafka.broker", "run the embedded Apache Kafka broker (start|stop|status|fetch)"),
    "topics": ("rollbus.commands.topics", "create or check the rollbus topics"),
    "images": ("rollbus.local_images.cli", "build the container images here (no registry needed)"),
    "replay": ("rollbus.commands.replay", "decode and print events from a topic"),
    "tail": ("rollbus.commands.replay", "follow a topic live"),
    "adapter": (
        "rollbus.services.adapter.main",
        "Anthropic, Responses and OpenAI chat APIs over SGLang; publishes turns",
    ),
    "engine": ("rollbus.services.engine.main", "local SGLang-compatible model server (CPU)"),
    "sandbox-runner": (
        "rollbus.services.sandbox_runner.main",
        "runs the coding agent per task; publishes diffs",
    ),
    "grader": ("rollbus.services.grader.main", "grades diffs in a clean sandbox; publishes rewards"),
    "gym-runner": (
        "rollbus.services.gym_runner.main",
        "runs gym episodes through the adapter; publishes rewards",
    ),
    "grade": ("rollbus.services.grader.cli", "grade one patch against one row exactly as the grader does"),
    "validate": (
        "rollbus.services.grader.validate",
        "check every task of a dataset: its gold scores 1 and the empty patch 0 (resumable, parallel)",
    ),
    "regrade": (
        "rollbus.services.grader.regrade",
        "grade every diff in the log again into a fresh rewards topic",
    ),
    "segmenter": ("rollbus.services.segmenter.main", "joins turns, sessions and rewards into segments"),
    "rebuild": (
        "rollbus.services.segmenter.rebuild",
        "replay the raw topics into a fresh derived topic (segments)",
    ),
    "trainer": ("rollbus.trainer.main", "consumes segments and trains the policy"),
    "submit": (
        "rollbus.services.sandbox_runner.submit",
        "submit a JSONL dataset as tasks (n samples per row)",
    ),
    "sandbox": ("rollbus.services.sandbox_runner.debug", "run a command in a row's agent or grader sandbox"),
    "gym-submit": ("rollbus.services.gym_runner.submit", "submit ms-swift gym rows (JSONL) as tasks"),
    "export": ("rollbus.commands.export", "write gym episodes from the topics as ms-swift-style JSON lines"),
    "up": ("rollbus.services.stack.up", "the whole pipeline on embedded defaults, supervised, until Ctrl-C"),
    "ui": ("rollbus.services.ui.main", "web pages over the topics: overview, rollouts, topic browser"),
    "demo": (
        "rollbus.services.stack.demo",
        "the closed loop on embedded defaults: roll out, grade, segment, train",
    ),
}


# command -> "module:Class" of the settings whose add_arguments is the whole parser (the command module's
# add_arguments is that class's; tests/test_cli_help.py checks both give the same flags)
ARGUMENTS: dict[str, str] = {
    "adapter": "rollbus.services.adapter.settings:AdapterSettings",
    "sandbox-runner": "rollbus.services.sandbox_runner.settings:RunnerSettings",
    "grader": "rollbus.services.grader.settings:GraderSettings",
    "gym-runner": "rollbus.services.gym_runner.settings:GymRunnerSettings",
    "trainer": "rollbus.trainer.settings:TrainerSettings",
    "up": "rollbus.services.stack.settings:StackSettings",
    "demo": "rollbus.services.stack.settings:DemoSettings",
}


def command_parser(name: str, module: Any) -> argparse.ArgumentParser:
    """The parser of ``rollbus <name>``, filled by add_<name>_arguments or add_arguments."""
    parser = argparse.ArgumentParser(prog=f"rollbus {name}", description=COMMANDS[name][1])
    add = getattr(module, f"add_{name.replace('-', '_')}_arguments", module.add_arguments)
    add(parser)
    return parser


def settings_class(name: str) -> Any:
    module, _, attribute = ARGUMENTS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rollbus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=COMMANDS[name][1], add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    try:
        if name in ARGUMENTS:  # --help exits in parse_args, before the command module is imported
            cmd_parser = argparse.ArgumentParser(prog=f"rollbus {name}", description=COMMANDS[name][1])
            settings_class(name).add_arguments(cmd_parser)
            args = cmd_parser.parse_args(argv[1:])
            module = importlib.import_module(COMMANDS[name][0])
        else:
            module = importlib.import_module(COMMANDS[name][0])
            args = command_parser(name, module).parse_args(argv[1:])  # options read their variables here
        args.command = name
        return int(module.run(args) or 0)
    except SettingsError as exc:  # a bad flag or variable: one line, before anything started
        print(f"rollbus {name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    raise SystemExit(main())
