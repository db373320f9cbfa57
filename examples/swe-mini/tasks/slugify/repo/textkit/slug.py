"""URL slugs from titles."""

import re


def slugify(title):
    """Lower-case alphanumeric words joined by single dashes: 'Hello,  World!' -> 'hello-world'."""
    words = re.split(r"[^a-z0-9]", title.lower())
    return "-".join(words)
