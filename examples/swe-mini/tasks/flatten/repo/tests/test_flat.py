from nest import flatten


def test_flat_already():
    assert flatten([1, 2]) == [1, 2]


def test_one_level():
    assert flatten([1, [2, 3]]) == [1, 2, 3]
