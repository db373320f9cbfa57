from calc.core import mean, sum_to

__all__ = ["mean", "sum_to"]
