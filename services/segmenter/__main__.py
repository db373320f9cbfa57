"""``python -m rollbus.services.segmenter``: the same as ``rollbus segmenter``."""

import sys

from rollbus.cli import main

raise SystemExit(main(["segmenter", *sys.argv[1:]]))
