"""A seccomp filter that forbids new user namespaces, for bwrap builds without ``--disable-userns``.

A nested user namespace hands its creator every capability inside it, the first step of most container
escapes; bwrap >= 0.8 closes it with ``--disable-userns``. Older builds get this classic BPF program through
``--seccomp FD``: ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with EPERM, ``clone3`` (whose flags
live in memory a filter cannot read) fails with ENOSYS so libc falls back to ``clone``, and x32 system calls
are refused. Other architectures than x86-64 and aarch64 get no filter (and the sandbox reports it).
"""

from __future__ import annotations

import errno
import os
import platform
import struct

CLONE_NEWUSER = 0x10000000
X32_SYSCALL_BIT = 0x40000000
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
# (AUDIT_ARCH, unshare, clone, clone3) per machine
ARCHES = {
    "x86_64": (0xC000003E, 272, 56, 435),
    "aarch64": (0xC00000B7, 97, 220, 435),
}
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def nested_userns_filter(machine: str | None = None) -> bytes | None:
    """The compiled filter (``struct sock_filter`` array) for this machine, or None if unsupported."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit, unshare, clone, clone3 = arch
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    program = [
        _op(LD_W_ABS, 4),  # 0: arch
        _op(JEQ_K, audit, 1, 0),  # 1: ours? go on : refuse (a foreign ABI could bypass the numbers)
        _op(RET_K, eperm),  # 2
        _op(LD_W_ABS, 0),  # 3: syscall number
        _op(JGE_K, X32_SYSCALL_BIT, 6, 0),  # 4: x32 -> refuse (11)
        _op(JEQ_K, clone3, 6, 0),  # 5: -> ENOSYS (12)
        _op(JEQ_K, unshare, 1, 0),  # 6: -> flags (8)
        _op(JEQ_K, clone, 0, 2),  # 7: -> flags (8), else allow (10)
        _op(LD_W_ABS, 16),  # 8: low word of args[0] (the flags of both calls)
        _op(JSET_K, CLONE_NEWUSER, 1, 0),  # 9: NEWUSER -> refuse (11), else allow (10)
        _op(RET_K, RET_ALLOW),  # 10
        _op(RET_K, eperm),  # 11
        _op(RET_K, enosys),  # 12
    ]
    return b"".join(program)


def filter_fd(program: bytes) -> int:
    """A memory file holding ``program``, positioned at 0, for ``bwrap --seccomp FD``."""
    fd = os.memfd_create("rollbus-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
