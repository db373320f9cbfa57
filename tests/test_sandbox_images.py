"""Images and toolchains for local sandboxes (real tar, git, bwrap), and the adapter proxy's HTTP handling."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from rollbus.sandbox import (
    AdapterProxy,
    SandboxError,
    SandboxSpec,
    bwrap_usable,
    create_local,
    git_diff,
    resolve_image,
)
from rollbus.sandbox.adapter_proxy import BadRequest, stamp_head

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
needs_bwrap = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")


def tarball(tmp_path: Path, *, top_dir: bool) -> Path:
    out = tmp_path / ("top.tar.gz" if top_dir else "flat.tar")
    with tarfile.open(out, "w:gz" if top_dir else "w") as tar:
        if top_dir:
            tar.add(EXAMPLE_REPO, arcname="buggy_repo")
        else:
            for entry in EXAMPLE_REPO.iterdir():
                tar.add(entry, arcname=entry.name)
    return out


@needs_bwrap
@pytest.mark.parametrize("top_dir", [True, False])
async def test_a_tarball_image_is_the_repository_at_its_root_or_single_dir(
    tmp_path: Path, scratch: Path, top_dir: bool
) -> None:
    image = tarball(tmp_path, top_dir=top_dir)
    spec = SandboxSpec(image=resolve_image(image.name, tmp_path / "dataset.jsonl"))  # relative to the dataset
    async with await create_local(spec, scratch_root=scratch) as box:
        done = await box.run(["sh", "-c", "ls; git log --oneline | wc -l; python3 -m pytest --version"], ENV)
    assert "calc.py" in done.stdout.split() and "1" in done.stdout.split(), done.stderr
    assert "pytest" in done.stdout + done.stderr
    cached = sorted(p.name.split("-")[0] for p in (scratch / "images").iterdir())
    assert len(cached) == 2 and cached.count("agent") == 1  # unpacked once, agent repository built once


async def test_bad_images_are_named_failures_and_leave_nothing(tmp_path: Path, scratch: Path) -> None:
    with pytest.raises(SandboxError) as missing:
        resolve_image("nope.tar", tmp_path / "dataset.jsonl")
    (tmp_path / "junk.tar").write_bytes(b"not a tarball")
    with pytest.raises(SandboxError) as junk:
        await create_local(SandboxSpec(image=tmp_path / "junk.tar"), scratch_root=scratch)
    assert missing.value.failure_kind == junk.value.failure_kind == "image_error"
    assert [p.name for p in scratch.iterdir()] == []


async def test_a_tarball_cannot_write_outside_its_cache(tmp_path: Path, scratch: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../../escaped")
        info.size = 0
        tar.addfile(info)
    with pytest.raises(SandboxError):
        await create_local(SandboxSpec(image=evil), scratch_root=scratch)
    assert not (tmp_path / "escaped").exists()


def mini_rootfs(root: Path) -> Path:
    """A tiny root filesystem: a shell, coreutils we need, python3's absence, and its own marker."""
    for name in ("sh", "cat", "ls", "grep", "sleep", "id", "env"):
        binary = Path(shutil.which(name) or f"/bin/{name}").resolve()
        deps = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False).stdout
        for path in [str(binary), *(w for w in deps.split() if w.startswith("/"))]:
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                shutil.copy2(path, target)
        link = root / "usr" / "bin" / name
        if not link.exists():
            link.symlink_to(binary)
    (root / "bin").symlink_to("usr/bin")
    (root / "lib64").symlink_to("usr/lib64") if (root / "usr" / "lib64").exists() else None
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "rollbus-toolchain").write_text("mini\n")
    return root


@needs_bwrap
async def test_a_toolchain_rootfs_replaces_the_host_system_and_the_forwarder_starts(
    tmp_path: Path,
    scratch: Path,
) -> None:
    rootfs = mini_rootfs(tmp_path / "rootfs")
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    spec = SandboxSpec(
        image=EXAMPLE_REPO, toolchain=rootfs, adapter_url=url, base_url="http://127.0.0.1:4000"
    )
    async with await create_local(spec, scratch_root=scratch) as box:
        done = await box.run(
            ["sh", "-c", "cat /etc/rollbus-toolchain; ls /usr/bin | grep -c python3; id -un"], ENV
        )
        assert done.stdout.split() == ["mini", "0", "agent"], done.stderr
    server.close()


def test_stamp_head_replaces_a_spoofed_id_and_refuses_malformed_heads() -> None:
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Rollbus-Sandbox: evil\r\nContent-Length: 3\r\n"
    stamped, length, chunked = stamp_head(head, "sbx1")
    assert length == 3 and not chunked
    assert stamped.endswith(b"x-rollbus-sandbox: sbx1\r\nx-rollbus-peer: tool\r\n\r\n")
    assert b"evil" not in stamped
    for bad in (
        b"garbage\r\n",
        b"GET / HTTP/1.1\r\nno-colon\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: x\r\n",
        b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n",
        b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n",
        b"GET / HTTP/1.1\r\n X-Rollbus-Sandbox : evil\r\n",
    ):
        with pytest.raises(BadRequest):
            stamp_head(bad, "sbx1")


async def test_proxy_forwards_keepalive_and_chunked_requests_and_rejects_garbage(tmp_path: Path) -> None:
    received = bytearray()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            received.extend(chunk)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await AdapterProxy(tmp_path / "a.sock", f"http://127.0.0.1:{port}", "sbx9").start()
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "a.sock"))
    writer.write(b"POST /a HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello")
    writer.write(b"POST /b HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
    await writer.drain()
    assert await reader.readexactly(40) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    writer.close()
    for _ in range(100):
        if received.count(b"x-rollbus-sandbox: sbx9") == 2:
            break
        await asyncio.sleep(0.02)
    assert b"\r\n\r\nhello" in received and b"3\r\nabc\r\n0\r\n\r\n" in received
    assert received.count(b"x-rollbus-sandbox: sbx9") == 2 and proxy.requests == 2
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "a.sock"))
    writer.write(b"\x16\x03\x01 not http\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 400")
    await proxy.close()
    server.close()
    assert not (tmp_path / "a.sock").exists()


async def test_git_diff_of_a_sandbox_workspace_excludes_nothing_the_agent_wrote(
    tmp_path: Path, scratch: Path
) -> None:
    if not bwrap_usable():
        pytest.skip("bubblewrap cannot create namespaces here")
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO), scratch_root=scratch) as box:
        await box.run(["sh", "-c", "sed -i 's/range(1, n)/range(1, n + 1)/' calc.py; echo n > new.txt"], ENV)
        patch = git_diff(box.host_workdir)
    assert "+    return sum(range(1, n + 1))" in patch and "+++ b/new.txt" in patch


@needs_bwrap
async def test_a_toolchain_tarball_keeps_absolute_symlinks_and_drops_devices(
    tmp_path: Path, scratch: Path
) -> None:
    rootfs = mini_rootfs(tmp_path / "rootfs")
    (rootfs / "etc" / "marker-link").symlink_to("/etc/rollbus-toolchain")  # absolute, as in docker export
    out = tmp_path / "rootfs.tar"
    with tarfile.open(out, "w") as tar:
        tar.add(rootfs, arcname=".")
        device = tarfile.TarInfo("./dev-null-copy")
        device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3
        tar.addfile(device)
    async with await create_local(
        SandboxSpec(image=EXAMPLE_REPO, toolchain=out), scratch_root=scratch
    ) as box:
        done = await box.run(["cat", "/etc/marker-link"], ENV)
    assert done.stdout == "mini\n", done.stderr
    unpacked = [p for p in (scratch / "images").iterdir() if not p.name.startswith("agent-")]
    assert len(unpacked) == 1 and not (unpacked[0] / "dev-null-copy").exists()


async def test_proxy_caps_concurrent_connections(tmp_path: Path) -> None:
    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    proxy = await AdapterProxy(tmp_path / "a.sock", url, "sbx", max_connections=2).start()
    held = [await asyncio.open_unix_connection(str(tmp_path / "a.sock")) for _ in range(2)]
    await asyncio.sleep(0.1)
    reader, _ = await asyncio.open_unix_connection(str(tmp_path / "a.sock"))
    assert (await reader.read()).startswith(b"HTTP/1.1 503") and proxy.refused == 1
    for _, writer in held:
        writer.close()
    await proxy.close()
    server.close()
