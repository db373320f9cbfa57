"""mypy over the product code (rollbus/, services/, trainer/) under its one import name; `make lint` runs it.

mypy finds modules by their folders, and cannot follow the editable install's import hook that maps
``services/`` to ``rollbus.services`` (setup.py's packaging map): run plainly over ``services/`` it would name
each module ``services.adapter.app`` and not find ``rollbus.services.adapter.app`` where the code imports it.
So this asks the import system where each mapped package lives (``importlib.util.find_spec``, which reads the
editable install's own map: this clone's folders), lets mypy collect the files and read ``[tool.mypy]`` from
pyproject.toml as usual, names each file by the package whose folder holds it, and runs mypy's build on that
list (``mypy.main.process_options`` and ``mypy.build.build``, what mypy's own command calls; mypy is pinned in
uv.lock, so a bump that moves them shows here first). The settings are all in pyproject.toml; arguments go to
mypy as they are (``--no-incremental``, ``--cache-dir DIR`` ...). Exit status: 0 clean, 1 errors, 2 blocked.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollbus", "rollbus.services", "rollbus.trainer")  # the product code, by import name


def package_folders() -> dict[Path, str]:
    """Each product package's folder, as Python imports it, to its import name."""
    folders = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"typecheck: {name} is not importable here: run `make bootstrap` first")
        folder = Path(next(iter(spec.submodule_search_locations))).resolve()
        if not folder.is_relative_to(ROOT):
            raise SystemExit(f"typecheck: {name} is {folder}, not this clone's: run with its .rollbus/venv")
        folders[folder] = name
    return folders


def module_name(path: str, folders: dict[Path, str]) -> str:
    """``services/adapter/app.py`` -> ``rollbus.services.adapter.app``, by the innermost mapped folder."""
    file = Path(path).resolve()
    for folder, package in sorted(folders.items(), key=lambda kv: -len(kv[0].parts)):
        if file.is_relative_to(folder):
            parts = file.relative_to(folder).with_suffix("").parts
            return ".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))
    raise SystemExit(f"typecheck: {path} is in no product package ({', '.join(PACKAGES)})")


def main(argv: list[str]) -> int:
    started = time.monotonic()
    os.chdir(ROOT)  # where pyproject.toml's [tool.mypy] and its relative cache_dir are
    folders = package_folders()
    fscache = FileSystemCache()
    targets = [os.path.relpath(folder) for folder in folders]
    found, options = process_options([*argv, *targets], fscache=fscache)
    sources = [BuildSource(s.path, module_name(s.path, folders), s.text) for s in found if s.path]
    messages: list[str] = []

    def show(_file: str | None, new: list[str], _serious: bool) -> None:
        messages.extend(new)
        for line in new:
            print(line, flush=True)

    try:
        build.build(sources, options, flush_errors=show, fscache=fscache)
    except CompileError as e:  # a blocking error (a syntax error ...): mypy stops at it
        if not messages:
            show(None, e.messages, True)
        return 2
    errors = sum(": error:" in m for m in messages)
    took = time.monotonic() - started
    print(f"mypy: {errors} errors in {len(sources)} modules of {', '.join(PACKAGES)} ({took:.1f} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # as mypy's own command does: freeing its graph on the way out takes longer than the check
