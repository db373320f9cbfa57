from nest import flatten


def test_deep():
    assert flatten([1, [2, [3, [4]]]]) == [1, 2, 3, 4]


def test_empty_nested():
    assert flatten([[], [[]], 5]) == [5]
