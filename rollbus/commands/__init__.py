"""The commands that are tools over the library, not services (``rollbus topics``, ``rollbus replay``,
``rollbus tail``, ``rollbus export``): each parses its flags and prints or writes, over library modules
that do the work (:mod:`rollbus.kafka.topics`, :mod:`rollbus.kafka.replay`). The command table
(:mod:`rollbus.cli`) names them; nothing in the library imports them (``tests/test_layers.py``)."""
