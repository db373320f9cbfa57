from finder import find


def test_first():
    assert find([1, 3, 5, 7], 1) == 0


def test_absent():
    assert find([1, 3, 5, 7], 4) == -1
    assert find([], 4) == -1
