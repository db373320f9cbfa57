"""Small arithmetic helpers."""


def sum_to(n):
    """Sum of the integers 1..n inclusive (0 for n < 1)."""
    return sum(range(1, n))


def mean(values):
    """Arithmetic mean of a non-empty sequence."""
    values = list(values)
    if not values:
        raise ValueError("mean of an empty sequence")
    return sum(values) / len(values)
