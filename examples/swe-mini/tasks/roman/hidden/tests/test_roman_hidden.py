from numerals import to_roman


def test_subtractive():
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(40) == "XL"
    assert to_roman(944) == "CMXLIV"


def test_year():
    assert to_roman(1994) == "MCMXCIV"
