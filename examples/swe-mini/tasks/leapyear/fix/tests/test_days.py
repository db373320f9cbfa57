from dates import days_in_month


def test_january():
    assert days_in_month(2023, 1) == 31


def test_february_leap():
    assert days_in_month(2024, 2) == 29
def test_february_century():
    assert days_in_month(1900, 2) == 28
