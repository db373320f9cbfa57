"""bwrap's ``--info-fd`` object arrives in several writes; :class:`BwrapInfo` reports the pid only once the
whole object is there, never raising on a part (a raise made the adapter proxy stamp the agent's own request
as a tool's, so its turns did not train)."""

from __future__ import annotations

import os

from rollbus.sandbox.bwrap_host import BwrapInfo


def pipe() -> tuple[int, int]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    return read, write


def test_the_pid_is_reported_once_the_object_written_in_parts_is_whole() -> None:
    read, write = pipe()
    info = BwrapInfo(read)
    assert info.child_pid() is None  # nothing written yet
    for part in (b'{\n    "child-pid": ', b"4321", b',\n    "cgroup-namespace": 4026531835', b"\n}\n"):
        assert info.child_pid() is None
        os.write(write, part)
    assert info.child_pid() == 4321
    os.close(write)
    assert info.child_pid() == 4321  # read once, kept
    os.close(read)


def test_a_bwrap_that_closed_its_end_mid_object_or_said_nothing_reports_no_pid() -> None:
    for written in (b'{\n    "child-pid": 12', b""):
        read, write = pipe()
        os.write(write, written)
        os.close(write)
        assert BwrapInfo(read).child_pid() is None
        os.close(read)
