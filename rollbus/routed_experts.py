"""Routed experts (MoE routing replay, R3) as a claim check: the ids in a content-addressed store, a reference
on the wire.

SGLang returns, per request with ``return_routed_experts``, base64 of int32 ``[rows, layers, top_k]``
covering positions ``[routed_experts_start_len, seqlen - 1)`` of prompt + output
(``meta_info["routed_experts"]``). At the reference shape (96k tokens, 48 layers, top-8) that is 36.9 MB
even as uint8: over the bus's 8 MiB event limit, and a turn log kept forever would hold terabytes of it.
So the ids travel beside the events: narrowed to the smallest unsigned type that holds them, written once
to a directory under the name of their SHA-256 (:class:`RoutesStore`), and a turn event carries only a
:class:`RoutesRef` (digest, dtype, rows it covers). A segment carries its chain's turns' references; the
trainer fetches them, checks every digest and stitches the rows (:func:`cover`, :func:`load`).

Why a directory and not a compacted topic of chunks: a reader wants one rollout's ids by name, which a file
gives in one open and a topic only by scanning or by remembering offsets; a write is idempotent (a retry
writes the same bytes to the same name); identical ids are stored once; and the ids can be deleted once
trained without touching the raw topics, which are kept forever. Across hosts the directory is a shared
mount (what Dressage's transfer queue and NeMo's data plane are for their peers).

Rows are per token ``layers x top_k`` ids, kept flat (``width``): the adapter does not know the model's
shape, the trainer does and reshapes (:func:`load`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollbus.events import RoutedExperts

DTYPES = ("uint8", "uint16", "int32")  # narrowest first; int32 is SGLang's own
STORE_DIR = "routed-experts"  # under the state directory, unless a setting says where


class RoutesError(ValueError):
    """Routed experts that cannot be used; the message says why."""


class RoutesUnavailable(RoutesError):
    """The store has no ids under a reference's digest (never written, or deleted)."""


class RoutesCorrupt(RoutesError):
    """The store's bytes under a digest do not hash to it, or do not fit the reference's shape."""


@dataclass(frozen=True)
class RoutesRef:
    """Where one turn's routed experts are and which rows they are: rows ``[start, start + rows)`` of the
    turn's prompt + output, ``width`` ids a row (layers x top_k), as ``dtype``, stored under ``digest``."""

    digest: str  # SHA-256 of the stored bytes, hex
    dtype: str
    start: int
    rows: int
    width: int

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, record: Mapping[str, Any] | RoutedExperts) -> RoutesRef:
        """The reference in ``record``: a turn's or segment's ``routed_experts`` event field, or its dict."""
        if isinstance(record, RoutedExperts):
            record = record.to_dict()
        return cls(str(record["digest"]), str(record["dtype"]), int(record["start"]), int(record["rows"]),
                   int(record["width"]))  # fmt: skip


def narrow(ids: np.ndarray) -> np.ndarray:
    """``ids`` in the narrowest of :data:`DTYPES` that holds them; a negative id is refused."""
    if ids.size and int(ids.min()) < 0:
        raise RoutesError("a negative expert id")
    top = int(ids.max()) if ids.size else 0
    dtype = "uint8" if top < 2**8 else "uint16" if top < 2**16 else "int32"
    return np.ascontiguousarray(ids, dtype=dtype)


def from_sglang(encoded: str, rows: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` as ``[rows, width]`` int32; RoutesError if it is not base64 of
    ``rows`` whole rows of int32 (``rows`` is what the request's start and the tokens say it must hold)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise RoutesError(f"routed experts are not base64: {exc}") from None
    if len(raw) % 4:
        raise RoutesError(f"routed experts of {len(raw)} bytes are not int32s")
    flat = np.frombuffer(raw, np.int32)
    if rows <= 0:
        if flat.size:
            raise RoutesError(f"{flat.size} routed expert ids where no row was expected")
        return flat.reshape(0, 0)
    if flat.size % rows or not flat.size:
        raise RoutesError(f"{flat.size} routed expert ids do not make {rows} rows")
    return flat.reshape(rows, flat.size // rows)


class RoutesStore:
    """A directory of id arrays named by the SHA-256 of their bytes (``<dir>/<2 hex>/<64 hex>``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise RoutesUnavailable(f"routed experts reference {digest[:80]!r} is not a SHA-256 digest")
        return self.directory / digest[:2] / digest

    def put(self, ids: np.ndarray, start: int) -> RoutesRef:
        """Store ``[rows, width]`` ids (narrowed) covering rows from ``start``; their reference. Atomic and
        idempotent: a crash leaves no partial file under a digest, a second put of the same ids writes
        nothing."""
        ids = narrow(np.asarray(ids))
        if ids.ndim != 2:
            raise RoutesError(f"routed experts of shape {ids.shape}, expected [rows, width]")
        data = ids.tobytes()
        digest = hashlib.sha256(data).hexdigest()
        target = self.path(digest)
        try:  # stored before: its age restarts, so retention counts from its newest reference
            os.utime(target)
        except FileNotFoundError:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return RoutesRef(digest, str(ids.dtype), start, ids.shape[0], ids.shape[1])

    def prune(self, older_than: float, now: float | None = None) -> tuple[int, int]:
        """Delete the ids last stored more than ``older_than`` seconds before ``now`` (and abandoned
        partial writes as old); (files, bytes) deleted. Ids are content-addressed and may be shared by
        rollouts of the same prompt, so nothing is deleted because one reader is done with it: a reference
        lives as long as its newest ``put``. Set the age above the longest a segment may wait to train (the
        trainer's staleness bound): a segment whose ids were pruned is dead-lettered, not trained wrongly."""
        cutoff = (time.time() if now is None else now) - older_than
        files = size = 0
        for path in self.directory.glob("??/*"):
            try:
                stat = path.stat()
                if stat.st_mtime >= cutoff:
                    continue
                path.unlink()
            except FileNotFoundError:  # another pruner, or a rename in flight
                continue
            files, size = files + 1, size + stat.st_size
        return files, size

    def get(self, ref: RoutesRef) -> np.ndarray:
        """The ids of ``ref``, ``[rows, width]``, after checking their digest and size; the store is only
        read, so a refused reference loses nothing."""
        if ref.dtype not in DTYPES:
            raise RoutesCorrupt(f"routed experts dtype {ref.dtype!r}, expected one of {', '.join(DTYPES)}")
        if ref.rows < 0 or ref.width < 0 or ref.start < 0:
            raise RoutesCorrupt(f"routed experts reference with a negative size: {ref}")
        path = self.path(ref.digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            missing = f"no routed experts under digest {ref.digest} in {self.directory}"
            raise RoutesUnavailable(missing) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != ref.digest:
            raise RoutesCorrupt(f"routed experts under {ref.digest} hash to {actual}: the bytes changed")
        expected = ref.rows * ref.width * np.dtype(ref.dtype).itemsize
        if len(data) != expected:
            raise RoutesCorrupt(
                f"routed experts under {ref.digest} are {len(data)} bytes, the reference says "
                f"{ref.rows} x {ref.width} {ref.dtype} ({expected} bytes)"
            )
        return np.frombuffer(data, ref.dtype).reshape(ref.rows, ref.width)


def cover(refs: Sequence[RoutesRef], tokens: int) -> list[tuple[RoutesRef, int]] | None:
    """How a chain's turns' references (in turn order) give the rows of positions ``0..tokens-2`` of the
    chain's ``tokens``-token stream: ``(ref, first row of it to take)`` each, or None if they leave a gap,
    overrun the stream or disagree in width. A turn that asked from ``start = 0`` repeats rows an earlier turn
    gave; only its new rows are taken (the earlier turn's are the ones recorded when those tokens were
    computed)."""
    covered, parts, widths = 0, [], {ref.width for ref in refs if ref.rows}
    if len(widths) > 1:
        return None
    for ref in refs:
        if ref.start > covered or ref.start < 0 or ref.rows < 0:
            return None
        end = ref.start + ref.rows
        if end > covered:
            parts.append((ref, covered - ref.start))
            covered = end
    return parts if covered == tokens - 1 else None


def load(parts: Sequence[tuple[RoutesRef, int]], store: RoutesStore) -> np.ndarray:
    """The stitched ``[rows, width]`` ids of :func:`cover`'s ``parts``, each fetched and checked."""
    pieces = [store.get(ref)[skip:] for ref, skip in parts]
    if not pieces:
        return np.empty((0, 0), np.uint8)
    dtype = np.result_type(*(piece.dtype for piece in pieces))
    return np.concatenate([piece.astype(dtype, copy=False) for piece in pieces])
