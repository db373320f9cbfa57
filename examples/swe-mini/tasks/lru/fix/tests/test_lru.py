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
def test_get_refreshes_recency():
    cache = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert cache.get("a") == 1
    assert cache.get("b") is None


def test_get_refreshes_any_key():
    cache = LRU(2)
    cache.put(10, "ten")
    cache.put(20, "twenty")
    assert cache.get(10) == "ten"
    cache.put(30, "thirty")
    assert cache.get(10) == "ten"
    assert cache.get(20) is None
