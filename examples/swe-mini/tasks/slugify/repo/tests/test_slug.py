from textkit import slugify


def test_single_word():
    assert slugify("Hello") == "hello"


def test_simple_words():
    assert slugify("hello world") == "hello-world"
