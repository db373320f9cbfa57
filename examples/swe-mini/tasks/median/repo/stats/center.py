"""Measures of central tendency."""


def median(values):
    """Middle value of ``values`` (the mean of the two middle ones for an even count)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of an empty sequence")
    mid = len(ordered) // 2
    return ordered[mid]
