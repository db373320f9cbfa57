"""Roman numerals."""

SYMBOLS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(number):
    """Roman numeral of 1 <= number < 4000."""
    if not 0 < number < 4000:
        raise ValueError(f"{number} is out of range")
    out = []
    for value, symbol in SYMBOLS:
        count, number = divmod(number, value)
        out.append(symbol * count)
    return "".join(out)
