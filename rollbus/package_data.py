"""Where the two data folders are: ``schemas/`` (the event schemas) and ``examples/`` (the demo's swe-mini).

They stay at the top of the repository and the wheel carries them as ``rollbus/schemas`` and
``rollbus/examples`` (the packaging map in setup.py). This one resolver finds each in both: inside the
installed package where a wheel put it, else at the top of the clone (an editable install), beside
``rollbus/``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

PACKAGE = Path(__file__).resolve().parent


def data_dir(name: Literal["schemas", "examples"]) -> Path:
    """The folder ``name``: ``rollbus/<name>`` in a wheel, ``<clone>/<name>`` in a clone."""
    inside = PACKAGE / name
    return inside if inside.is_dir() else PACKAGE.parent / name
