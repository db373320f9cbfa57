"""``python -m rollbus.services.grader``: the same as ``rollbus grader``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["grader", *sys.argv[1:]]))
