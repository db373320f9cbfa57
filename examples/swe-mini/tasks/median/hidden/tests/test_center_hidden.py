from stats import median


def test_even():
    assert median([1, 2, 3, 4]) == 2.5
    assert median([4, 1]) == 2.5


def test_odd_still():
    assert median([5]) == 5
