"""``python -m rollbus.services.stack``: the same as ``rollbus up``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["up", *sys.argv[1:]]))
