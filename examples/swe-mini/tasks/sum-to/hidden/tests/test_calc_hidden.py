import unittest

from calc import sum_to


class SumToTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual(sum_to(1), 1)
        self.assertEqual(sum_to(3), 6)

    def test_larger(self):
        self.assertEqual(sum_to(100), 5050)

    def test_non_positive(self):
        self.assertEqual(sum_to(0), 0)
        self.assertEqual(sum_to(-4), 0)
