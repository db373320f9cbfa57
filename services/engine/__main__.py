"""``python -m services.engine``: same as ``rollbus engine``."""

import argparse

from services.engine.main import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m services.engine", description=__doc__)
add_arguments(parser)
raise SystemExit(run(parser.parse_args()))
