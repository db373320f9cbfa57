"""``python -m rollbus.services.gym_runner``: the same as ``rollbus gym-runner``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["gym-runner", *sys.argv[1:]]))
