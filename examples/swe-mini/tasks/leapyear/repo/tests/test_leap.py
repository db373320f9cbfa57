from dates import is_leap


def test_ordinary_years():
    assert is_leap(2024)
    assert not is_leap(2023)
