"""``rollbus.trainer``: this folder's one import name (the packaging map in setup.py). Imported as
``trainer`` (the repository root on ``sys.path``) it would be a second copy of every module, with its own
classes and metrics registry; it refuses instead."""

if __name__ != "rollbus.trainer":
    raise ImportError(f"import rollbus.trainer, not {__name__}: the folder trainer/ has one import name")
