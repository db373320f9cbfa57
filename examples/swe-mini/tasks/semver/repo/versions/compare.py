"""Comparing dotted version strings."""


def parse(version):
    """The parts of a dotted version string, for ordering."""
    return tuple(version.split("."))


def compare(a, b):
    """-1, 0 or 1 as version ``a`` is older than, equal to or newer than ``b``."""
    left, right = parse(a), parse(b)
    return (left > right) - (left < right)
