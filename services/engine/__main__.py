"""``python -m rollbus.services.engine``: the same as ``rollbus engine``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["engine", *sys.argv[1:]]))
