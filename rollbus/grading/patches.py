"""An agent's patch, read strictly as bytes and made safe to hand to ``git apply``: split per file, binary
hunks stripped.

The patch is hostile input and is never decoded as text to be applied: a Latin-1 edit is as good as any. It is
parsed the way ``git apply`` reads unified diffs (file headers, then hunks of exactly the counted lines), and
what is offered to ``git apply`` is rebuilt from what was parsed, so nothing the parser skipped can reach the
tool. Every path on every file header, ``rename``/``copy`` line and ``diff --git`` line is checked (absolute
or climbing with ``..`` is ``malformed_patch``). Context, normal, ed and RCS diffs are refused with
``unsupported_patch_format``: only ``git apply`` applies, with no fuzz. Which files really changed is measured
after applying, from the tree itself (:mod:`rollbus.grading.trees`); the paths read here only name what was
stripped and what the report shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

MALFORMED = "malformed_patch"
UNSUPPORTED = "unsupported_patch_format"
TOO_LARGE = "patch_too_large"

GIT_HEADER = b"diff --git "
HUNK = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
PATH_LINES = (b"rename from ", b"rename to ", b"copy from ", b"copy to ", b"rename old ", b"rename new ")
GIT_EXTENDED = (
    b"old mode ", b"new mode ", b"deleted file mode ", b"new file mode ", b"similarity index ",
    b"dissimilarity index ", b"index ", *PATH_LINES,
)  # fmt: skip
BINARY_MARKERS = (b"GIT binary patch", b"Binary files ")
FOREIGN = (
    ("context diff", re.compile(rb"^(\*{15}\s*$|\*\*\* \d+(,\d+)? \*\*\*\*\s*$|--- \d+(,\d+)? ----\s*$)")),
    ("normal diff", re.compile(rb"^\d+(,\d+)?[acd]\d+(,\d+)?\s*$")),
    ("ed diff", re.compile(rb"^\d+(,\d+)?[acd]\s*$")),
    ("RCS diff", re.compile(rb"^[ad]\d+ \d+\s*$")),
)
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


class PatchRejected(ValueError):
    """A patch that must not be applied at all; ``kind`` is the reward's failure kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class FileSection:
    """The part of a patch about one file, as parsed."""

    paths: tuple[str, ...]  # every path the section names, without a/ b/ prefixes
    text: bytes
    binary: bool


@dataclass(frozen=True)
class Sanitized:
    """What is offered to ``git apply``, and what was taken out."""

    patch: bytes  # b"" for an empty patch
    sections: tuple[FileSection, ...]
    stripped_binary: tuple[str, ...] = field(default=())
    stripped_git: tuple[str, ...] = field(default=())  # sections aimed into .git/: never offered, flagged

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(sorted({p for s in self.sections for p in s.paths}))


def as_bytes(patch: bytes | str) -> bytes:
    """The patch's bytes; text (from a caller that decoded with ``surrogateescape``) back to its bytes."""
    if isinstance(patch, bytes):
        return patch
    try:
        return patch.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError:
        raise PatchRejected(MALFORMED, "patch text holds unpaired surrogates that are no bytes") from None


def sanitize(patch: bytes | str, max_bytes: int) -> Sanitized:
    """Parse ``patch`` into file sections, drop binary ones; :class:`PatchRejected` for unusable patches."""
    data = as_bytes(patch)
    if len(data) > max_bytes:
        raise PatchRejected(TOO_LARGE, f"patch is {len(data)} bytes, over the cap of {max_bytes}")
    if b"\x00" in data:
        raise PatchRejected(MALFORMED, "patch contains NUL bytes")
    if not data.strip():
        return Sanitized(b"", ())
    sections = parse(split_lines(data))
    for section in sections:
        for path in section.paths:
            check_path(path)
    into_git = [s for s in sections if any(in_git_dir(p) for p in s.paths)]
    kept = tuple(s for s in sections if not s.binary and s not in into_git)
    stripped = tuple(p for s in sections if s.binary and s not in into_git for p in s.paths)
    git = tuple(p for s in into_git for p in s.paths)
    return Sanitized(b"".join(s.text for s in kept), kept, stripped, git)


def in_git_dir(path: str) -> bool:
    """Whether ``path`` lies in the repository's git directory (``.GIT`` too, as git itself refuses it)."""
    parts = PurePosixPath(path).parts
    return bool(parts) and parts[0].lower() == ".git"


def split_lines(data: bytes) -> list[bytes]:
    """Lines as git reads them: only ``\\n`` ends one (a form feed or ``\\r`` inside a hunk line is content);
    a last line without one gets one."""
    lines = data.split(b"\n")
    tail = lines.pop()
    out = [line + b"\n" for line in lines]
    return [*out, tail + b"\n"] if tail else out


def parse(lines: list[bytes]) -> list[FileSection]:
    """Every file section, each exactly its headers and counted hunks; anything else after the first file
    header is refused (blank lines and a trailing ``-- `` mail signature excepted)."""
    start = next((i for i in range(len(lines)) if starts_section(lines, i)), None)
    if start is None:
        refuse_foreign(lines, 0, len(lines))
        raise PatchRejected(MALFORMED, "no file headers (diff --git / --- +++) in a non-empty patch")
    refuse_foreign(lines, 0, start)  # a preamble is dropped, but a diff of another format there is refused
    sections = []
    i = start
    while i < len(lines):
        if starts_section(lines, i):
            section, i = read_section(lines, i)
            sections.append(section)
        elif not lines[i].strip():
            i += 1
        elif lines[i] == b"-- \n" and not any(starts_section(lines, j) for j in range(i, len(lines))):
            break  # git format-patch's signature ends the patch
        else:
            raise unexpected(lines, i)
    return sections


def starts_section(lines: list[bytes], i: int) -> bool:
    line = lines[i]
    if line.startswith(GIT_HEADER):
        return True
    return line.startswith(b"--- ") and i + 1 < len(lines) and lines[i + 1].startswith(b"+++ ")


def read_section(lines: list[bytes], i: int) -> tuple[FileSection, int]:
    """One file's section from ``lines[i]``: git's extended headers, the ``---``/``+++`` pair, then either
    hunks or a binary patch; returns it and the index after it."""
    begin = i
    paths: list[str] = []
    binary = False
    if lines[i].startswith(GIT_HEADER):
        paths += header_paths(text_of(lines[i][len(GIT_HEADER) :].rstrip(b"\n")))
        i += 1
        while i < len(lines) and lines[i].startswith(GIT_EXTENDED):
            if lines[i].startswith(PATH_LINES):
                paths.append(path_of(lines[i].split(b" ", 2)[2]))
            i += 1
        if i < len(lines) and lines[i].startswith(BINARY_MARKERS):
            end = skip_binary(lines, i)
            return FileSection(tuple(sorted(set(paths))), b"".join(lines[begin:end]), True), end
    if i < len(lines) and lines[i].startswith(b"--- "):
        if i + 1 >= len(lines) or not lines[i + 1].startswith(b"+++ "):
            raise PatchRejected(MALFORMED, f"line {i + 1}: a '---' file header without its '+++'")
        paths += [p for p in (strip_prefix(path_of(lines[j][4:])) for j in (i, i + 1)) if p is not None]
        i += 2
    while i < len(lines) and lines[i].startswith(b"@@"):
        i = read_hunk(lines, i)
    if i < len(lines) and lines[i].startswith(BINARY_MARKERS):
        binary, i = True, skip_binary(lines, i)
    return FileSection(tuple(sorted(set(paths))), b"".join(lines[begin:i]), binary), i


def read_hunk(lines: list[bytes], i: int) -> int:
    """The index after the hunk at ``lines[i]``: exactly as many old and new lines as its header counts."""
    match = HUNK.match(lines[i])
    if match is None:
        raise PatchRejected(MALFORMED, f"line {i + 1}: a malformed hunk header")
    old = int(match[2]) if match[2] is not None else 1
    new = int(match[4]) if match[4] is not None else 1
    i += 1
    while old > 0 or new > 0:
        if i >= len(lines):
            raise PatchRejected(MALFORMED, "the patch ends inside a hunk")
        kind = lines[i][:1]
        if kind in (b" ", b"\n"):  # an empty line is an empty context line, as git reads it
            old, new = old - 1, new - 1
        elif kind == b"-":
            old -= 1
        elif kind == b"+":
            new -= 1
        elif kind != b"\\":
            raise unexpected(lines, i)
        if old < 0 or new < 0:
            raise PatchRejected(MALFORMED, f"line {i + 1}: more lines than the hunk header counts")
        i += 1
    if i < len(lines) and lines[i].startswith(b"\\"):  # "\ No newline at end of file" on the last line
        i += 1
    return i


def skip_binary(lines: list[bytes], i: int) -> int:
    """The index after a binary patch (its marker and base85 data, up to the next file header)."""
    i += 1
    while i < len(lines) and not starts_section(lines, i):
        i += 1
    return i


def refuse_foreign(lines: list[bytes], start: int, end: int) -> None:
    for i in range(start, end):
        kind = foreign_format(lines, i)
        if kind is not None:
            raise PatchRejected(UNSUPPORTED, f"line {i + 1}: a {kind}; only unified diffs are applied")


def foreign_format(lines: list[bytes], i: int) -> str | None:
    """The diff format other than unified that ``lines[i]`` belongs to, if it looks like one."""
    line = lines[i]
    if line.startswith(b"*** ") and i + 1 < len(lines) and lines[i + 1].startswith(b"--- "):
        return "context diff"  # its file header pair
    return next((name for name, pattern in FOREIGN if pattern.match(line)), None)


def unexpected(lines: list[bytes], i: int) -> PatchRejected:
    """The refusal of ``lines[i]``, a line no unified diff has there (named if another format has it)."""
    line = lines[i]
    foreign = foreign_format(lines, i) is not None or line[:2] in (b"! ", b"< ", b"> ")
    kind = UNSUPPORTED if foreign else MALFORMED
    what = "only unified diffs are applied" if kind == UNSUPPORTED else "outside any hunk or file header"
    return PatchRejected(kind, f"line {i + 1}: {text_of(line[:80]).rstrip()!r}: {what}")


def text_of(raw: bytes) -> str:
    return raw.decode("utf-8", errors="surrogateescape")


def path_of(raw: bytes) -> str:
    """The path on a header line's rest: up to a tab (timestamps follow one), git's quoting undone."""
    return unquote(text_of(raw.rstrip(b"\n").split(b"\t")[0]))


def header_paths(rest: str) -> list[str]:
    """The two paths of ``diff --git a/X b/Y`` (quoted or not; unquoted ones split where the halves agree)."""
    if rest.startswith('"') or rest.endswith('"'):
        tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\S+', rest)
        return [p for p in (strip_prefix(unquote(t)) for t in tokens) if p is not None]
    for at in [m.start() for m in re.finditer(" ", rest)]:
        old, new = rest[:at], rest[at + 1 :]
        if old[2:] == new[2:]:
            return [p for p in (strip_prefix(old), strip_prefix(new)) if p is not None]
    first, _, second = rest.partition(" ")
    return [p for p in (strip_prefix(first), strip_prefix(second)) if p is not None]


def unquote(token: str) -> str:
    """Git's C-style quoting (``"a/sp\\303\\251cial"``) back to the name."""
    if len(token) < 2 or not (token.startswith('"') and token.endswith('"')):
        return token
    out = bytearray()
    body, i = token[1:-1], 0
    while i < len(body):
        char = body[i]
        if char == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "01234567" and re.match(r"[0-7]{3}", body[i + 1 : i + 4]):
                out.append(int(body[i + 1 : i + 4], 8))
                i += 4
                continue
            out += _ESCAPES.get(nxt, nxt).encode()
            i += 2
            continue
        out += char.encode("utf-8", errors="surrogateescape")
        i += 1
    return out.decode("utf-8", errors="surrogateescape")


def strip_prefix(path: str) -> str | None:
    """``a/x.py`` -> ``x.py``; ``/dev/null`` -> None."""
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def check_path(path: str) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not path.strip():
        raise PatchRejected(MALFORMED, f"unsafe path in patch: {path!r}")


def added_lines(patch: bytes | str) -> list[str]:
    """Every line the patch adds (``+`` lines outside file headers), as text (undecodable bytes escaped)."""
    text = text_of(patch) if isinstance(patch, bytes) else patch
    return [line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++ ")]
