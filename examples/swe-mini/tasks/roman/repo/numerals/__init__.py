from numerals.roman import to_roman
