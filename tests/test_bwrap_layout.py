"""The bubblewrap command line as pure data: what each layout choice puts on it, and what it never does."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollbus.sandbox.bwrap_layout import ADAPTER_SOCKET, HOME, WORKSPACE, BwrapLayout, bwrap_argv

STATE = Path("/state")


def layout(**changes: object) -> BwrapLayout:
    base = BwrapLayout(workdir=STATE / "ws", home=STATE / "home", etc=STATE / "etc")
    return BwrapLayout(**(base.__dict__ | changes))  # type: ignore[arg-type]


def argv(lay: BwrapLayout, **kw: object) -> list[str]:
    return bwrap_argv(lay, ["run", "--flag"], cwd=WORKSPACE, system=["--ro-bind", "/usr", "/usr"], **kw)


def pairs(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


NETWORKS = [("none", False), ("loopback", False), ("adapter", False), ("adapter", True)]  # (network, joined)


@pytest.mark.parametrize(("network", "joined"), NETWORKS)
@pytest.mark.parametrize("uid", [1000, None])
def test_every_layout_unshares_everything_drops_capabilities_and_ends_read_only(network, joined, uid) -> None:
    extra = {"adapter_socket": STATE / "a.sock", "forward_port": 7000} if network == "adapter" else {}
    args = argv(layout(network=network, uid=uid, netns_joined=joined, **extra))
    head = args[: args.index("--")]
    assert head[:2] == ["--unshare-all", "--die-with-parent"] and ["--cap-drop", "ALL"] == head[3:5]
    assert head[-2:] == ["--chdir", WORKSPACE]
    remount = head.index("--remount-ro")
    assert head[remount + 1] == "/" and head.count("--remount-ro") == 1
    mounts = ("--bind", "--ro-bind", "--tmpfs", "--proc", "--dev")
    assert max(i for i, a in enumerate(head) if a in mounts) < remount, "read-only after every mount"
    shares = "--share-net" in head
    assert shares == (network == "loopback" or joined), "only debugging or a joined namespace share a network"
    assert ("--unshare-user" in head) == (uid is not None)
    assert (str(STATE / "ws"), WORKSPACE) in pairs(head, "--bind")
    assert (str(STATE / "home"), HOME) in pairs(head, "--bind")


def test_the_forwarder_wraps_the_command_only_without_a_joined_namespace() -> None:
    sock = STATE / "a.sock"
    forwarded = argv(layout(network="adapter", adapter_socket=sock, forward_port=7000))
    cmd = forwarded[forwarded.index("--") + 1 :]
    assert cmd[:2] == ["/bin/sh", "-c"] and cmd[-2:] == ["run", "--flag"]
    assert (str(sock), ADAPTER_SOCKET) in pairs(forwarded, "--ro-bind")
    joined = argv(layout(network="adapter", netns_joined=True))
    assert joined[joined.index("--") + 1 :] == ["run", "--flag"]
    assert ADAPTER_SOCKET not in joined


def test_tmp_is_capped_or_the_hosts_measured_mount_and_extra_binds_are_read_only() -> None:
    capped = argv(layout(tmp_bytes=1 << 20))
    at = capped.index("--tmpfs")
    assert capped[at - 2 : at + 2] == ["--size", str(1 << 20), "--tmpfs", "/tmp"]
    hosted = argv(layout(tmp_dir=STATE / "tmp"))
    assert (str(STATE / "tmp"), "/tmp") in pairs(hosted, "--bind") and "--tmpfs" not in hosted
    binds = argv(layout(ro_binds={"/opt/cli": "/usr/local/bin/claude"}))
    assert ("/opt/cli", "/usr/local/bin/claude") in pairs(binds, "--ro-bind")
    assert "/opt/cli" not in [a for a, _ in pairs(binds, "--bind")]


def test_userns_guard_and_info_fd() -> None:
    guarded = argv(layout(disable_userns=True, seccomp_fd=9), info_fd=5)
    assert "--disable-userns" in guarded and guarded[guarded.index("--seccomp") + 1] == "9"
    assert guarded[guarded.index("--info-fd") + 1] == "5"
    assert "--disable-userns" not in argv(layout(disable_userns=False, uid=None))
