"""``python -m rollbus.services.sandbox_runner``: the same as ``rollbus sandbox-runner``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["sandbox-runner", *sys.argv[1:]]))
