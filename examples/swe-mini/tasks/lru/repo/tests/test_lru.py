from lrucache import LRU


def test_put_get():
    cache = LRU(2)
    cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("zz", 0) == 0


def test_evicts_oldest():
    cache = LRU(2)
    for key in "abc":
        cache.put(key, key)
    assert cache.get("a") is None
    assert len(cache) == 2
