"""Gregorian calendar rules."""

DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year):
    """Whether ``year`` has a 29 February in the Gregorian calendar."""
    return year % 4 == 0


def days_in_month(year, month):
    """Days in ``month`` (1-12) of ``year``."""
    if month == 2 and is_leap(year):
        return 29
    return DAYS[month - 1]
