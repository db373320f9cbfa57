from stats import median


def test_even():
    assert median([1, 2, 3, 4]) == 2.5
    assert median([4, 1]) == 2.5


def test_even_beyond_the_statement():
    assert median([3, 1, 10, 7]) == 5.0
    assert median([-2, 8]) == 3.0
    assert median([1.5, 0.5, 4.0, 2.0]) == 1.75


def test_odd_still():
    assert median([5]) == 5
