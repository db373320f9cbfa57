"""Flattening nested lists."""


def flatten(items):
    """All non-list leaves of ``items``, nested lists flattened, in order."""
    out = []
    for item in items:
        if isinstance(item, list):
            out.extend(item)
        else:
            out.append(item)
    return out
