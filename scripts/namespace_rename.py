#!/usr/bin/env python3
"""Put ``services`` and ``trainer`` under the ``rollbus`` import namespace, mechanically and idempotently.

Installed as top-level packages, ``services`` and ``trainer`` collide with any other project's; a
wheel should install ``rollbus`` alone. The folders stay where they are: ``rollbus/services`` and
``rollbus/trainer`` become links to them (as ``rollbus/schemas`` links to ``schemas/``), so a clone
imports ``rollbus.services.adapter`` from ``services/adapter`` and a wheel carries the files under
``rollbus/``. What it rewrites, in the files git tracks:

* Python imports: ``from services.x import y`` / ``import trainer.z`` -> ``from rollbus.services.x ...``;
* module paths inside strings, docstrings and comments (``"services.segmenter.rebuild"``,
  ``:mod:`services.stack.runs```, ``"trainer.settings:TrainerSettings"``), only where the name after the dot
  is a module or package that exists in that folder (``trainer.counters``, an attribute, is left alone), and
  ``"-m", "trainer"`` / ``-m trainer`` (the package's ``__main__``);
* the same module paths and ``-m`` forms in Markdown, YAML, shell, Dockerfiles and the Makefile;
* ``pyproject.toml``: the wheel takes ``rollbus*`` only, and ruff does not lint the links twice.

Code outside strings is never rewritten by pattern (``trainer.settings`` there is an attribute of a variable).
A second run changes nothing. ``--check`` changes nothing and exits 1 if a run would.

    python scripts/namespace_rename.py            # in the repository root (or give the root as argument)
    ruff check --fix --select I rollbus services trainer tests bench examples   # re-sort the renamed imports
    ruff check rollbus services trainer tests bench examples   # E501: lines grown too long; wrap them
    git add -A rollbus/services rollbus/trainer                 # the two links

Then: a few tests; ``uv build --wheel``; the wheel in a fresh venv outside the clone; ``rollbus demo --help``
there, and ``rollbus demo --tasks <checkout>/examples/swe-mini/demo.jsonl --script
<checkout>/examples/swe-mini/scripts`` (``examples/`` is not package data: the demo's defaults point into a
checkout).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

PACKAGES = ("services", "trainer")
SKIP = (  # task data and patches (not our code), and this script's test (it quotes the old names on purpose)
    "examples/swe-mini/tasks/", "tests/cheats/", "uv.lock", "tests/test_namespace_rename.py",
)
TEXT_SUFFIXES = (".md", ".yml", ".yaml", ".sh", ".toml", ".cfg", ".txt", ".example")
TEXT_NAMES = ("Makefile", "Dockerfile", "run")


def modules_of(root: Path) -> dict[str, set[str]]:
    """For each package, the names a dotted path may continue with: its modules and subpackages."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        names = set()
        for entry in (root / package).iterdir():
            if entry.suffix == ".py" and entry.stem != "__init__":
                names.add(entry.stem)
            elif entry.is_dir() and (entry / "__init__.py").exists():
                names.add(entry.name)
        found[package] = names
    return found


def module_pattern(known: dict[str, set[str]]) -> re.Pattern[str]:
    """``services.<known>`` / ``trainer.<known>`` not already after a dot, a word, a slash or a dash."""
    alternatives = "|".join(
        f"{package}\\.(?:{'|'.join(sorted(map(re.escape, names)))})\\b"
        for package, names in known.items()
        if names
    )
    return re.compile(rf"(?<![\w./-])(?:{alternatives})")


RUN_MODULE = re.compile(rf"(?<=-m )(?P<package>{'|'.join(PACKAGES)})(?![\w/-]|\.\w)")
IMPORT = re.compile(rf"^(?P<head>\s*(?:from|import)\s+)(?P<package>{'|'.join(PACKAGES)})(?=[\s.,]|$)", re.M)


def rename_words(text: str, modules: re.Pattern[str]) -> str:
    """Module paths and ``-m package`` in prose or a string's contents."""
    text = modules.sub(lambda m: "rollbus." + m.group(0), text)
    return RUN_MODULE.sub(lambda m: "rollbus." + m.group("package"), text)


def rename_python(source: str, modules: re.Pattern[str]) -> str:
    """Imports anywhere (also in docstring examples), and module paths inside strings and comments."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    edits: list[tuple[int, int, str]] = []
    previous: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        begin = starts[token.start[0] - 1] + token.start[1]
        end = starts[token.end[0] - 1] + token.end[1]
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            text = rename_words(token.string, modules)
            runs = token.type == tokenize.STRING and _after_dash_m(previous)
            if runs and _literal(token.string) in PACKAGES:
                quote = token.string[-1]
                text = f"{quote}rollbus.{_literal(token.string)}{quote}"
            if text != token.string:
                edits.append((begin, end, text))
        previous = (previous + [token])[-2:]
    for begin, end, text in reversed(edits):
        source = source[:begin] + text + source[end:]
    return IMPORT.sub(lambda m: f"{m.group('head')}rollbus.{m.group('package')}", source)


def _literal(token: str) -> str:
    return token[1:-1] if token[:1] in "\"'" and token[-1:] == token[:1] else token


def _after_dash_m(previous: list[tokenize.TokenInfo]) -> bool:
    """``"-m", <this string>``: the string names a module to run."""
    return (
        len(previous) == 2
        and previous[0].type == tokenize.STRING
        and _literal(previous[0].string) == "-m"
        and previous[1].string == ","
    )


def rename_pyproject(text: str) -> str:
    text = text.replace('include = ["rollbus*", "services*", "trainer*"]', 'include = ["rollbus*"]')
    if '"rollbus/services"' not in text:
        text = re.sub(
            r"^extend-exclude = \[(?P<items>[^\]]*)\].*$",
            lambda m: f'extend-exclude = [{m.group("items")}, "rollbus/services", "rollbus/trainer", '
            '"rollbus/schemas"]  # task data; links to folders linted where they are',
            text,
            count=1,
            flags=re.M,
        )
    return text


def link(root: Path) -> list[str]:
    """``rollbus/<package>`` -> ``../<package>`` (a no-op when the link is there)."""
    made = []
    for package in PACKAGES:
        target = root / "rollbus" / package
        if target.with_suffix(".py").exists():  # a package of the same name would shadow this module
            raise SystemExit(f"{target}.py exists: rollbus.{package} would name two things")
        if target.is_symlink() and os.readlink(target) == f"../{package}":
            continue
        if target.exists() or target.is_symlink():
            raise SystemExit(f"{target} exists and is not the link ../{package}: refusing to replace it")
        target.symlink_to(f"../{package}")
        made.append(str(target.relative_to(root)))
    return made


def tracked(root: Path) -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    paths = [Path(p) for p in listing.decode().split("\0") if p]
    return [root / p for p in paths if not str(p).startswith(SKIP) and not (root / p).is_symlink()]


def rewrite(path: Path, modules: re.Pattern[str]) -> str | None:
    """The new text of ``path``, or None if it is not a file this script rewrites."""
    if path.name == "namespace_rename.py":
        return None  # its own docstring quotes the old names on purpose
    if path.suffix == ".py":
        return rename_python(path.read_text(encoding="utf-8"), modules)
    if path.name == "pyproject.toml":
        return rename_pyproject(rename_words(path.read_text(encoding="utf-8"), modules))
    if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
        return rename_words(path.read_text(encoding="utf-8"), modules)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path.cwd(), help="repository root")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a run would")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    modules = module_pattern(modules_of(root))
    changed = []
    for path in tracked(root):
        if not path.is_file():
            continue
        old = path.read_text(encoding="utf-8")
        new = rewrite(path, modules)
        if new is not None and new != old:
            changed.append(str(path.relative_to(root)))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    missing = [p for p in PACKAGES if not (root / "rollbus" / p).is_symlink()]
    if args.check:
        print(f"{len(changed)} files would change; links missing: {', '.join(missing) or 'none'}")
        return 1 if changed or missing else 0
    made = link(root)
    print(f"rewrote {len(changed)} files; linked {', '.join(made) or 'nothing (already there)'}")
    print("\n".join(f"  {name}" for name in changed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
