"""``python -m rollbus.services.adapter``: the same as ``rollbus adapter``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["adapter", *sys.argv[1:]]))
