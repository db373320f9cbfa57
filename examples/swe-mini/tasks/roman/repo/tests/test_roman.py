import pytest

from numerals import to_roman


def test_additive():
    assert to_roman(3) == "III"
    assert to_roman(2026 - 20) == "MMVI"


def test_range():
    with pytest.raises(ValueError):
        to_roman(0)
