from spans import merge


def test_merges_overlapping():
    assert merge([(1, 4), (2, 6)]) == [(1, 6)]


def test_keeps_disjoint():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]
def test_merges_touching():
    assert merge([(1, 2), (2, 3)]) == [(1, 3)]
    assert merge([(3, 3), (1, 3)]) == [(1, 3)]
