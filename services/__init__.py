"""``rollbus.services``: this folder's one import name (the packaging map in setup.py). Imported as
``services`` (the repository root on ``sys.path``) it would be a second copy of every module, with its own
classes and metrics registry; it refuses instead."""

if __name__ != "rollbus.services":
    raise ImportError(f"import rollbus.services, not {__name__}: the folder services/ has one import name")
