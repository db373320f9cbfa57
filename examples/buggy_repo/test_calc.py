"""Runs under ``python -m unittest`` or pytest."""

import unittest

from calc import mean, sum_to


class SumToTest(unittest.TestCase):
    def test_includes_n(self) -> None:
        self.assertEqual(sum_to(4), 10)

    def test_one(self) -> None:
        self.assertEqual(sum_to(1), 1)

    def test_below_one(self) -> None:
        self.assertEqual(sum_to(0), 0)


class MeanTest(unittest.TestCase):
    def test_mean(self) -> None:
        self.assertEqual(mean([1.0, 2.0, 6.0]), 3.0)

    def test_empty(self) -> None:
        with self.assertRaises(ValueError):
            mean([])


if __name__ == "__main__":
    unittest.main()
