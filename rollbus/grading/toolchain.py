"""The top-level modules the grader's test toolchain imports, read from the installed distributions.

A patch that adds a module of one of these names where ``sys.path`` can find it first (the repository root,
``tests/``) replaces a piece of the test runner (``attr/``, ``iniconfig/``, ``packaging/``, ``pluggy.py``).
The set is pytest, every installed pytest plugin (``pytest11`` entry points: pytest loads them all), and their
requirements recursively (environment markers evaluated, extras left out), each distribution's modules from
its ``top_level.txt`` and its ``RECORD``. Read once per process, from the interpreter the tests run under
(``python3`` on the sandbox's ``PATH``, over the host's ``/usr``), not the grader's own.
"""

from __future__ import annotations

import functools
import json
import subprocess

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"

CLOSURE = r"""
import importlib.metadata as md, json, re, sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

dists = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name:
        dists.setdefault(norm(name), dist)
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None

def requirements(dist):
    for text in dist.requires or ():
        if Requirement is not None:
            try:
                req = Requirement(text)
            except Exception:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                yield norm(req.name)
        elif "extra" not in text.partition(";")[2]:
            yield norm(re.match(r"[A-Za-z0-9._-]*", text.strip()).group())

todo = ["pytest"] + [norm(ep.dist.name) for ep in md.entry_points(group="pytest11") if ep.dist]
seen = set()
while todo:
    name = todo.pop()
    if name in seen or name not in dists:
        continue
    seen.add(name)
    todo.extend(requirements(dists[name]))
modules = set()
for name in seen:
    dist = dists[name]
    modules.update((dist.read_text("top_level.txt") or "").split())
    for path in dist.files or ():
        top = path.parts[0] if path.parts else ""
        if len(path.parts) > 1:
            modules.add(top)
        elif top.endswith((".py", ".so", ".pyd")):
            modules.add(top.split(".")[0])
print(json.dumps(sorted(m for m in modules if m.isidentifier())))
"""


@functools.cache
def modules() -> frozenset[str]:
    """Every top-level module of the toolchain's import closure (computed once per process)."""
    return closure_of("python3")


def closure_of(python: str) -> frozenset[str]:
    """The toolchain's modules as the interpreter ``python`` has them installed; empty if it cannot say."""
    try:
        done = subprocess.run(
            [python, "-I", "-c", CLOSURE],
            env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        names = json.loads(done.stdout) if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str))
