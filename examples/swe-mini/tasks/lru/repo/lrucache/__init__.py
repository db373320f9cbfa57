from lrucache.core import LRU
