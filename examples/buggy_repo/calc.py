"""Small arithmetic helpers."""


def sum_to(n: int) -> int:
    """Sum of the integers 1..n inclusive (0 when n < 1)."""
    return sum(range(1, n))


def mean(values: list[float]) -> float:
    """Arithmetic mean; raises ValueError on an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)
