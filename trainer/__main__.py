"""``python -m rollbus.trainer``: the same as ``rollbus trainer``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["trainer", *sys.argv[1:]]))
