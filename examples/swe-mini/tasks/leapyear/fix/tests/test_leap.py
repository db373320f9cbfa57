from dates import is_leap


def test_ordinary_years():
    assert is_leap(2024)
    assert not is_leap(2023)
def test_centuries():
    assert not is_leap(1900)
    assert not is_leap(2100)
    assert is_leap(2000)


def test_other_centuries():
    assert not is_leap(1800)
    assert not is_leap(2200)
    assert is_leap(1600)
    assert is_leap(2400)
