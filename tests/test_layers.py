"""The layers, executable: the library (``rollbus/``: core, the Kafka layer, the embedded broker, model and
tokenizer, sandboxes) never imports an application (a service under ``rollbus.services``, the trainer) nor the
command layer; no application imports another's code; the command layer (``rollbus.cli``, the table of
commands, ``rollbus.commands`` and every ``__main__``) sits on top and nothing below imports it. And no
circle: no module reaches itself through its imports. Every import counts, at module level or in a function,
``TYPE_CHECKING`` included: each is a dependency someone reading the code must follow."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"services": "rollbus.services", "trainer": "rollbus.trainer"}  # setup.py's packaging map
COMMANDS = ("rollbus.cli", "rollbus.commands", "rollbus.__main__")
# circles in code other work is rebuilding now (the sandbox contract, the runner's attempt flow, the trainer's
# lazy settings); a circle found must lie inside one of these, and none may grow
KNOWN_CIRCLES = (
    {"rollbus.sandbox.base", "rollbus.sandbox.capture", "rollbus.sandbox.process"},
    # the attempt flow and its harnesses: a harness names the runner's kit and settings (type-only and lazy
    # imports), the registry imports each harness, and each harness the protocol beside the registry
    {
        f"rollbus.services.sandbox_runner.{name}"
        for name in ("remote", "rollout", "settings", "harnesses", "harnesses.claude_code", "harnesses.codex",
                     "harnesses.mini_swe_agent")
    },
    {f"rollbus.trainer.{name}" for name in ("device", "settings", "sharding", "step")},
)


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    top = MAPPED.get(parts[0])
    name = ".".join(([top] if top else [parts[0]]) + list(parts[1:]))
    return name.removesuffix(".__init__")


def modules() -> dict[str, Path]:
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "rollbus", *MAPPED]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {module_name(p): ROOT / p for p in listed if p.endswith(".py") and (ROOT / p).exists()}


def imported(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a name imported from a package counts as its submodule when
    one exists), absolute and relative."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a.b.c; `from a import f`: a
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(f"{target}."):  # a package's own parents
                found.add(target)
    return found


def layer(name: str) -> str:
    """``command``, ``app:<service>`` or ``library``."""
    if name.startswith(COMMANDS) or name.endswith(".__main__"):
        return "command"
    parts = name.split(".")
    if parts[:2] == ["rollbus", "services"] and len(parts) > 2:
        return f"app:{parts[2]}"
    if parts[:2] == ["rollbus", "trainer"]:
        return "app:trainer"
    return "library"


def graph() -> dict[str, set[str]]:
    found = modules()
    names = set(found)
    return {n: imported(n, p.read_text(), p.name == "__init__.py", names) for n, p in found.items()}


def crossings(edges: dict[str, set[str]]) -> list[str]:
    """Each import that goes against the layers, as ``importer -> imported``."""
    wrong = []
    for name, targets in edges.items():
        mine = layer(name)
        for target in sorted(targets):
            theirs = layer(target)
            if mine == "command" or theirs == "library" or theirs == mine:
                continue
            wrong.append(f"{name} ({mine}) -> {target} ({theirs})")
    return wrong


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(group)
    return found


def test_the_checks_see_each_kind_of_wrong_import() -> None:
    edges = {
        "rollbus.codec": {"rollbus.services.adapter.app"},  # the library importing an application
        "rollbus.kafka.broker": {"rollbus.cli"},  # the library importing the command table
        "rollbus.services.ui.main": {"rollbus.services.stack.runs", "rollbus.kafka.topics"},  # a service's
        "rollbus.trainer.feed": {"rollbus.commands.replay"},  # an application importing a command
        "rollbus.cli": {"rollbus.services.adapter.main"},  # fine: the command table is on top
        "rollbus.services.adapter.__main__": {"rollbus.cli"},  # fine: an entry point is a command
    }
    assert crossings(edges) == [
        "rollbus.codec (library) -> rollbus.services.adapter.app (app:adapter)",
        "rollbus.kafka.broker (library) -> rollbus.cli (command)",
        "rollbus.services.ui.main (app:ui) -> rollbus.services.stack.runs (app:stack)",
        "rollbus.trainer.feed (app:trainer) -> rollbus.commands.replay (command)",
    ]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    source = "from rollbus.canonical import echo\nfrom . import history\nfrom .history import Message\n"
    known = {"rollbus.canonical", "rollbus.canonical.echo", "rollbus.canonical.history", "rollbus.codec"}
    assert imported("rollbus.canonical.render", source, False, known) == {
        "rollbus.canonical.echo", "rollbus.canonical.history"}  # fmt: skip
    lazy = "def f():\n    from rollbus.codec.avro import x\nif TYPE_CHECKING:\n    import rollbus.canonical\n"
    assert imported("rollbus.kafka.bus", lazy, False, known) == {"rollbus.codec", "rollbus.canonical"}


def test_no_import_goes_against_the_layers() -> None:
    edges = graph()
    assert len(edges) > 200
    assert {"rollbus.cli", "rollbus.services.adapter.app", "rollbus.trainer.main"} <= set(edges)
    assert crossings(edges) == []


def test_no_module_reaches_itself_through_its_imports() -> None:
    new = [sorted(group) for group in circles(graph()) if not any(group <= known for known in KNOWN_CIRCLES)]
    assert new == []
