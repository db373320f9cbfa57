from finder import find


def test_last():
    assert find([1, 3, 5], 5) == 2


def test_single():
    assert find([9], 9) == 0


def test_every_position():
    items = list(range(0, 40, 2))
    assert [find(items, x) for x in items] == list(range(len(items)))
    assert find(items, 41) == -1
