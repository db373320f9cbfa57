"""Arrays of numbers in Avro bytes, read and written with numpy: a turn's token ids and logprobs are its
bulk, and a Python object per token would cost more than the rest of the message together.

Writing: a C-speed check vouches for an array (:func:`vouch`) or sends it to fastavro's full validation;
vouched arrays are written as one block (:func:`write_number_block`). Reading: arrays are located and checked
without being decoded (:func:`locate_numbers`), and many messages' arrays decode in one pass per item type
(:func:`decode_numbers`). :class:`Varints` carries ints as their bytes, so a reader can copy them into
another message without decoding one.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollbus.codec.errors import BODY_ERRORS, CodecError


@dataclass(frozen=True)
class Varints:
    """``count`` ints as their Avro bytes: zigzag varints back to back, no block framing. What a reader that
    scanned messages (:meth:`Scanned.item_bytes`) hands a writer to copy arrays of ints from them into
    another message without decoding one (the segmenter's token ids). The encoder still checks them: each
    varint whole, ``count`` of them, every value within the field's range."""

    count: int
    data: bytes

    def __len__(self) -> int:
        return self.count

    @classmethod
    def join(cls, parts: Sequence[Varints]) -> Varints:
        """The arrays one after another (each part is whole varints, so their bytes simply concatenate)."""
        return cls(sum(part.count for part in parts), b"".join(part.data for part in parts))

    def values(self) -> np.ndarray:
        """The ints, decoded (int64); CodecError if the bytes are not ``count`` whole varints of at most 10
        bytes."""
        data = np.frombuffer(self.data, np.uint8)
        if not _whole_varints(data, self.count, 10):
            raise CodecError(f"{len(self.data)} bytes are not {self.count} whole varints")
        if not self.count:
            return np.empty(0, np.int64)
        return _varint_values(data, (data < 0x80).nonzero()[0])


INT_RANGES = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


NUMBER_ITEMS = ("int", "long", "float", "double")


_VARINT_WIDTHS = {"int": 4, "long": 9}  # bytes a varint may take and hold any value of the type


def _varints(values: np.ndarray) -> bytes:
    """Avro longs (zigzag, then 7 bits a byte, least significant first) of an integer array, vectorised."""
    if not len(values):
        return b""
    low, high = int(values.min()), int(values.max())
    if low >= -64 and high <= 63:  # policy versions, context's -1: a byte each, no int64 copy
        small = values.astype(np.int8, copy=False)
        return ((small << np.int8(1)) ^ (small >> np.int8(7))).view(np.uint8).tobytes()
    values = values.astype(np.int64, copy=False)
    zigzag = ((values << 1) ^ (values >> 63)).view(np.uint64)
    width = max(1, (int(zigzag.max()).bit_length() + 6) // 7)
    groups = np.empty((len(zigzag), width), np.uint8)
    lengths = np.ones(len(zigzag), np.int64)
    rest = zigzag.copy()
    for i in range(width):
        groups[:, i] = (rest & np.uint64(0x7F)).astype(np.uint8)
        rest >>= np.uint64(7)
        more = rest != 0
        groups[:, i] |= more.astype(np.uint8) << np.uint8(7)
        lengths += more
    return groups[np.arange(width) < lengths[:, None]].tobytes()


def _long(value: int) -> bytes:
    """One Avro long (a block's item count): no numpy call for a single number."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def write_number_block(buffer: io.BytesIO, values: np.ndarray | Varints) -> None:
    """One Avro array block (count, items, end marker) of numbers :func:`vouch` converted or vouched for,
    written piece by piece (a segment's arrays are copied once, into ``buffer``)."""
    if not len(values):
        buffer.write(b"\x00")
        return
    buffer.write(_long(len(values)))
    if isinstance(values, Varints):
        buffer.write(values.data)
    else:
        buffer.write(_varints(values) if values.dtype.kind in "iu" else values.tobytes())
    buffer.write(b"\x00")


_NUMBER_DTYPES = {"float": "<f4", "double": "<f8"}


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """One Avro long (zigzag varint) at ``pos``: (value, position after it)."""
    shift = result = 0
    while True:
        if pos >= len(data):
            raise EOFError("a varint runs past the end of the message")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint is longer than 10 bytes")


def _varint_ends(data: np.ndarray, pos: int, count: int) -> np.ndarray:
    """Offsets (from ``pos``) of the last byte of each of ``count`` Avro longs: each ends at the first byte
    below 0x80. Raises like fastavro on a message too short or a varint over 10 bytes."""
    ends = (data[pos : pos + 10 * count] < 0x80).nonzero()[0][:count]
    if len(ends) < count:
        raise EOFError(f"an array of {count} numbers runs past the end of the message")
    if ends[0] >= 10 or (int(ends[-1]) >= count + 9 and (ends[1:] - ends[:-1]).max() > 10):
        raise ValueError("a varint is longer than 10 bytes")  # (a span under count + 9 bytes has none)
    return ends


def _varint_values(data: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The int64 values of the varints of ``data`` that end at ``ends`` (checked by :func:`_varint_ends`)."""
    count = len(ends)
    starts = np.empty(count, np.int64)
    starts[0], starts[1:] = 0, ends[:-1] + 1
    lengths = ends - starts + 1
    span = int(ends[-1]) + 1
    shifts = (np.arange(span) - np.repeat(starts, lengths)) * 7
    parts = (data[:span] & np.uint8(0x7F)).astype(np.uint64) << shifts.astype(np.uint64)
    zigzag = np.add.reduceat(parts, starts)  # the 7-bit groups never overlap: sum == or
    return (zigzag >> np.uint64(1)).view(np.int64) ^ -(zigzag & np.uint64(1)).view(np.int64)


Blocks = tuple[tuple[int, int, int], ...]  # an array's blocks: (item count, first item byte, end byte)


_MAX = np.maximum.reduce  # the ufunc itself: ndarray.max's Python wrappers cost more than a short array


Stops = tuple[np.ndarray, np.ndarray]  # a message's varint ends (bytes below 0x80) and the gaps between them


def varint_stops(data: bytes) -> Stops:
    """Where every varint of a message could end, found once for all its arrays (:func:`_varints_end`)."""
    stops = (np.frombuffer(data, np.uint8) < 0x80).nonzero()[0]
    return stops, stops[1:] - stops[:-1]


def _varints_end(stops: Stops, pos: int, count: int) -> int:
    """The position after ``count`` Avro longs from ``pos``, given the message's :func:`varint_stops`.
    Raises as :func:`_varint_ends` does."""
    ends, gaps = stops
    first = int(ends.searchsorted(pos))
    last = first + count - 1
    if last >= len(ends):
        raise EOFError(f"an array of {count} numbers runs past the end of the message")
    end = int(ends[last])
    if int(ends[first]) - pos >= 10 or (end - pos >= count + 9 and _MAX(gaps[first:last]) > 10):
        raise ValueError("a varint is longer than 10 bytes")  # (a span under count + 9 bytes has none)
    return end + 1


def locate_numbers(data: bytes, stops: Stops, pos: int, items: str) -> tuple[Blocks, int]:
    """Where an Avro array of numbers lies (any number of blocks, a negative count carrying its byte size),
    checked as decoding it would check it but not decoded: (its blocks, the position after it)."""
    blocks: list[tuple[int, int, int]] = []
    while True:
        count, pos = _read_long(data, pos)
        if count == 0:
            return tuple(blocks), pos
        if count < 0:
            count = -count
            _, pos = _read_long(data, pos)
        if items in _NUMBER_DTYPES:
            end = pos + count * np.dtype(_NUMBER_DTYPES[items]).itemsize
            if end > len(data):
                raise EOFError(f"an array of {count} {items}s runs past the end of the message")
        else:
            end = _varints_end(stops, pos, count)
        blocks.append((count, pos, end))
        pos = end


def _joined(pieces: list[tuple[bytes, Blocks]]) -> tuple[bytes, int]:
    """The item bytes of several located arrays back to back, and their item count: one numpy pass then
    decodes them all (an array's blocks are whole items, so their concatenation is a valid run)."""
    parts = [data[start:end] for data, blocks in pieces for _, start, end in blocks]
    return b"".join(parts), sum(count for _, blocks in pieces for count, _, _ in blocks)


def decode_numbers(items: str, pieces: list[tuple[bytes, Blocks]]) -> np.ndarray:
    """The values of located arrays of one item type, concatenated: int64, or the float type's width."""
    raw, count = _joined(pieces)
    if items in _NUMBER_DTYPES:
        return np.frombuffer(raw, _NUMBER_DTYPES[items], count)
    if not count:
        return np.empty(0, np.int64)
    array = np.frombuffer(raw, np.uint8)
    return _varint_values(array, _varint_ends(array, 0, count))


def number_bytes(values: Sequence[int | float], items: str) -> bytes:
    """The Avro bytes of ``values``' items, back to back (zigzag varints, or little-endian floats): what a
    writer puts in an array block of ``array<items>``, and what :meth:`Scanned.item_bytes` reads back."""
    if items in _NUMBER_DTYPES:
        return np.asarray(values, _NUMBER_DTYPES[items]).tobytes()
    return _varints(np.asarray(values, np.int64)) if len(values) else b""


def vouch(value: Any, items: str) -> np.ndarray | Varints | None:
    """``value`` as a numpy array (:class:`Varints` as they are) if a C-speed check shows it valid for
    ``array<items>`` as fastavro's validator would judge it (ints, not bools, in range; ints or floats for
    float/double, a float within 32 bits); None means "not sure": the caller then runs the full validation,
    which decides and names the problem, and fastavro writes the field. A numpy array (what the segmenter
    stitches) is judged by its dtype and range, so none of its items becomes a Python object."""
    if isinstance(value, np.ndarray):
        return _vouch_array(value, items)
    if isinstance(value, Varints):
        return _vouch_varints(value, items)
    if type(value) is not list:
        return None
    types = set(map(type, value))
    if items in INT_RANGES:
        if value and types != {int}:
            return None
        try:
            array = np.asarray(value, dtype=np.int64)
        except OverflowError:
            return None
        low, high = INT_RANGES[items]
        return array if not value or (low <= array.min() and array.max() <= high) else None
    if not types <= {int, float}:
        return None
    try:
        array = np.asarray(value, dtype="<f4" if items == "float" else "<f8")
    except OverflowError:
        return None
    return None if items == "float" and np.isinf(array).any() else array


def _vouch_array(value: np.ndarray, items: str) -> np.ndarray | None:
    """:func:`vouch` for a one-dimensional numpy array: integer dtypes for ints, integer or float dtypes for
    float/double (never bool); None sends it, as a list, to the full validation."""
    kind = value.dtype.kind
    if value.ndim != 1 or kind not in ("iu" if items in INT_RANGES else "iuf"):
        return None
    if items in INT_RANGES:  # kept in its own dtype: the writer reads small ints a byte each
        low, high = INT_RANGES[items]
        return value if not len(value) or (low <= int(value.min()) and int(value.max()) <= high) else None
    array = value.astype("<f4" if items == "float" else "<f8", copy=False)
    return None if items == "float" and np.isinf(array).any() else array


def _vouch_varints(value: Varints, items: str) -> Varints | None:
    """:func:`vouch` for :class:`Varints`: ``count`` whole varints, none wider than what holds only values of
    the type (4 bytes for int, 9 for long); None (not sure) for anything else, which is then decoded and
    judged item by item."""
    if items not in _VARINT_WIDTHS:
        return None
    whole = _whole_varints(np.frombuffer(value.data, np.uint8), value.count, _VARINT_WIDTHS[items])
    return value if whole else None


def _whole_varints(data: np.ndarray, count: int, width: int) -> bool:
    """Whether ``data`` is exactly ``count`` varints, none over ``width`` bytes. Byte-wide boolean passes
    only: a segment's ids are checked at the cost of a few copies of their bytes, not of an int64 a token."""
    if not len(data):
        return not count
    more = data >= 0x80  # a byte another follows in its varint
    if more[-1] or len(data) - np.count_nonzero(more) != count:
        return False
    if len(data) < width:
        return True
    run = more[: len(data) - width + 1].copy()  # a run of ``width`` continuation bytes: a wider varint
    for shift in range(1, width):
        run &= more[shift : len(data) - width + 1 + shift]
    return not run.any()


def listed(value: Any) -> Any:
    """What the full validation judges, and fastavro writes, for an array :func:`vouch` was not sure of."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Varints):
        return _varints_as_list(value)
    return value


def _varints_as_list(value: Varints) -> list[int]:
    """Every varint of ``value``, read one by one as fastavro reads them (no width limit, so an out-of-range
    value is shown as it is); CodecError if the bytes are not ``count`` whole varints."""
    values, pos = [], 0
    try:
        while pos < len(value.data):
            number, pos = _read_long(value.data, pos)
            values.append(number)
    except BODY_ERRORS as exc:
        raise CodecError(f"{value.count} varints in {len(value.data)} bytes do not decode: {exc}") from exc
    if len(values) != value.count:
        raise CodecError(f"{len(value.data)} bytes hold {len(values)} varints, not {value.count}")
    return values


def as_varints(piece: tuple[bytes, Blocks]) -> Varints:
    data, count = _joined([piece])
    return Varints(count, data)


def split_numbers(values: Any, pieces: list[tuple[bytes, Blocks]]) -> Iterator[Any]:
    """``values`` cut back into the arrays of ``pieces``, in order."""
    start = 0
    for _, blocks in pieces:
        count = sum(n for n, _, _ in blocks)
        yield values[start : start + count]
        start += count
