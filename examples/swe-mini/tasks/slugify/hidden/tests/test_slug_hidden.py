from textkit import slugify


def test_punctuation_and_spaces():
    assert slugify("Hello,  World!") == "hello-world"


def test_leading_and_trailing():
    assert slugify("  --Rollbus 2: the Return--  ") == "rollbus-2-the-return"


def test_plain():
    assert slugify("abc") == "abc"
