from spans import merge


def test_merges_overlapping():
    assert merge([(1, 4), (2, 6)]) == [(1, 6)]


def test_keeps_disjoint():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]
