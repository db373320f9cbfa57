"""The codec's one error, and the exceptions a body's bytes raise while they are read."""

from __future__ import annotations

import struct


class CodecError(ValueError):
    """Bytes that cannot be decoded, or a record that does not match its schema."""


BODY_ERRORS = (EOFError, ValueError, IndexError, OverflowError, struct.error)
