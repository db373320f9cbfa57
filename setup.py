"""The packaging map: one import name, ``rollbus``, for folders that stay at the top of the repository.

``services/``, ``trainer/``, ``schemas/`` and ``examples/`` are real folders where the design card puts them;
the wheel and the editable install (``scripts/clone_venv.sh``) both import them as ``rollbus.services``,
``rollbus.trainer`` ... through setuptools' ``package_dir``, so there is no link and no second name
(``services/__init__.py`` refuses to be imported as ``services``). The package list is computed here, not
written out in ``pyproject.toml``, so a new subpackage is packaged without anyone remembering to list it.
Everything else (metadata, dependencies, package data) is in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

# the import name of each top-level folder; package data of the two data folders is in pyproject.toml
MAPPED = {
    "rollbus.services": "services",
    "rollbus.trainer": "trainer",
    "rollbus.schemas": "schemas",  # data only: the .avsc files
    "rollbus.examples": "examples",  # data only: examples/swe-mini, the demo's defaults
}
CODE = ("rollbus.services", "rollbus.trainer")


def packages() -> list[str]:
    found = find_packages(include=["rollbus", "rollbus.*"])
    for name in CODE:
        found += [name] + [f"{name}.{sub}" for sub in find_packages(MAPPED[name])]
    # the data folders are packages without code; services/ui's templates and static files ride with it
    return found + [name for name in MAPPED if name not in CODE]


setup(packages=packages(), package_dir=MAPPED)
