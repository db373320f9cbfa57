"""A secret (the session token) handed to a sandboxed command without bwrap holding it.

bwrap's pid 1 inside the sandbox keeps the environment and command line bwrap was started with, and it runs
as the agent's uid, so every tool can read ``/proc/1/environ``. A secret therefore reaches the command through
its standard input (a pipe the host wrote and closed), read by a shell that exports it and execs the command.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from rollbus.sandbox import bwrap_usable
from rollbus.sandbox.bwrap import BwrapSandbox
from rollbus.sandbox.bwrap_layout import SECRET_BYTES, BadSecret, secret_lines, with_secrets

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
SECRET = "rb-secret-7f3a9c"  # never in any command line of the sandbox: the probe below must not carry it
# the attacker's move, as a tool: every process's environment, command line and open files, into the workspace
DUMP = (
    "for p in /proc/[0-9]*; do echo \"== $p\"; tr '\\0' ' ' < $p/environ; tr '\\0' ' ' < $p/cmdline;"
    " for f in $p/fd/*; do timeout 1 cat $f; done; done > /workspace/leak 2>&1; true"
)


def test_secret_lines_carry_names_and_values_and_refuse_what_a_line_cannot() -> None:
    assert secret_lines({"A": "x y=z", "_B2": ""}) == b"A=x y=z\n_B2=\n"
    for bad in ({"1A": "x"}, {"A B": "x"}, {"A": "x\ny"}, {"A": "x\0"}, {"A": "x" * SECRET_BYTES}):
        with pytest.raises(BadSecret):
            secret_lines(bad)
    assert with_secrets(["codex", "exec"])[-2:] == ["codex", "exec"]


@pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")
async def test_the_command_gets_the_secret_and_no_tool_finds_it_in_bwrap() -> None:
    """What failed before: the token was in bwrap's environment, and a tool's ``cat /proc/1/environ`` read it.
    The command itself still gets it (here it hides it from its own child, as Codex does with its tools'
    environment), its input is /dev/null afterwards, and pid 1's environment, argv and files hold no trace."""
    command = f'test "$RB_TOKEN" = "$(printf %s {SECRET[:7]})$(printf %s {SECRET[7:]})" && echo got-it; ' \
              'cat; env -u RB_TOKEN sh -c "$DUMP"'  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        box = await BwrapSandbox.create(Path(tmp), network="none")
        try:
            env = {**ENV, "DUMP": DUMP}
            done = await box.run(["sh", "-c", command], env, timeout=60, secret_env={"RB_TOKEN": SECRET})
            leak = (box.host_workdir / "leak").read_text()
        finally:
            await box.close()
    assert done.exit_code == 0, done.stderr[-2000:]
    assert done.stdout == "got-it\n"  # and `cat` found nothing left on its input
    pid_1 = leak.split("== /proc/1\n", 1)[1].split("== /proc/", 1)[0]
    assert "/usr/bin/bwrap" in pid_1 and "PATH=/usr/bin:/bin" in pid_1  # the probe did read bwrap's process
    pid_2 = leak.split("== /proc/2\n", 1)[1].split("== /proc/", 1)[0]
    assert SECRET not in pid_1 and SECRET not in leak.replace(pid_2, "")  # only the command's own environ
