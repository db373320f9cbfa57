"""An agent's patch, made safe to hand to ``git apply`` / ``patch``: split per file, binary hunks stripped.

The patch is hostile input. This module never applies anything: it decides what is *offered* to the apply
tools (text sections only, no preamble, no binary hunks) and rejects what no tool should see (oversized,
NUL bytes, paths that are absolute or climb out with ``..``). Which files really changed is measured after
applying, from the tree itself (:mod:`rollbus.grading.trees`), because ``patch -p1`` can find hunks a parser
would miss; the paths read here only name what was stripped and what the report shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

GIT_HEADER = "diff --git "
BINARY_MARKERS = ("GIT binary patch", "Binary files ")
PATH_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f", "r": "\r", "v": "\v"}


class PatchRejected(ValueError):
    """A patch that must not be applied at all; ``kind`` is the reward's failure kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class FileSection:
    """The part of a patch about one file."""

    paths: tuple[str, ...]  # every path the section names, without a/ b/ prefixes
    text: str
    binary: bool


@dataclass(frozen=True)
class Sanitized:
    """What is offered to the apply tools, and what was taken out."""

    patch: str  # "" for an empty patch
    sections: tuple[FileSection, ...]
    stripped_binary: tuple[str, ...] = field(default=())

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(sorted({p for s in self.sections for p in s.paths}))


def sanitize(text: str, max_bytes: int) -> Sanitized:
    """Split ``text`` into file sections, drop binary ones; :class:`PatchRejected` for unusable patches."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise PatchRejected("patch_too_large", f"patch is {size} bytes, over the cap of {max_bytes}")
    if "\x00" in text:
        raise PatchRejected("malformed_patch", "patch contains NUL bytes")
    if not text.strip():
        return Sanitized("", ())
    sections = split_sections(text)
    if not sections:
        raise PatchRejected("malformed_patch", "no file headers (diff --git / --- +++) in a non-empty patch")
    for section in sections:
        for path in section.paths:
            check_path(path)
    kept = tuple(s for s in sections if not s.binary)
    stripped = tuple(p for s in sections if s.binary for p in s.paths)
    return Sanitized("".join(s.text for s in kept), kept, stripped)


def split_sections(text: str) -> list[FileSection]:
    """Per-file sections of a git diff, or of a plain unified diff (``--- x`` followed by ``+++ y``)."""
    lines = [line for line in re.split(r"(?<=\n)", text) if line]  # only \n ends a line, as for git
    if any(line.startswith(GIT_HEADER) for line in lines):
        starts = [i for i, line in enumerate(lines) if line.startswith(GIT_HEADER)]
    else:
        starts = [
            i
            for i, line in enumerate(lines[:-1])
            if line.startswith("--- ") and lines[i + 1].startswith("+++ ")
        ]
    sections = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        body = lines[start:end]
        if not body[-1].endswith("\n"):
            body[-1] += "\n"
        sections.append(section_of(body))
    return sections


def section_of(lines: list[str]) -> FileSection:
    paths: set[str] = set()
    binary = False
    in_hunk = False
    for line in lines:
        if line.startswith("@@"):
            in_hunk = True
        if line.startswith(GIT_HEADER):
            paths.update(header_paths(line[len(GIT_HEADER) :].rstrip("\n")))
        elif not in_hunk and line.startswith(PATH_LINES):
            raw = line.split(" ", 2)[-1] if line.startswith(("rename", "copy")) else line[4:]
            path = strip_prefix(unquote(raw.rstrip("\n").split("\t")[0]))
            if path is not None:
                paths.add(path)
        elif line.startswith(BINARY_MARKERS):
            binary = True
    return FileSection(tuple(sorted(paths)), "".join(lines), binary)


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
        out += char.encode()
        i += 1
    return out.decode("utf-8", errors="replace")


def strip_prefix(path: str) -> str | None:
    """``a/x.py`` -> ``x.py``; ``/dev/null`` -> None."""
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def check_path(path: str) -> None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not path.strip():
        raise PatchRejected("malformed_patch", f"unsafe path in patch: {path!r}")


def added_lines(patch: str) -> list[str]:
    """Every line the patch adds (``+`` lines outside file headers)."""
    return [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++ ")]
