"""``python -m rollbus.services.ui``: the same as ``rollbus ui``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["ui", *sys.argv[1:]]))
