"""Docker backend: a task's own container image as the sandbox, for the agent and for the grader.

One sandbox is a workspace and HOME on the host and one command container from the image's digest (the same
bytes for the agent, its patch capture and the grader), started once at create, in which every command is
executed; it also holds the sandbox's volumes and, for an agent, the network namespace the adapter's
listener is in (one container start per sandbox: ``bench/sandbox_boot.py --backend docker``):

- **Workspace** (``workdir`` inside) and **HOME**: each a tmpfs volume of ``disk_bytes`` that the engine makes
  and the command container holds (:mod:`rollbus.sandbox.docker_disk`), so the disk written is bounded while
  it is written wherever the caller runs (a runner in a container beside the engine included); with no disk
  limit, host directories bind-mounted read-write. The workspace is prepared once on the host, before anything
  of the agent's runs: the image's ``workdir`` copied out of the image (a created container's archive: nothing
  of the image runs), and its repository re-made by host git (every configured program off) as a fresh
  repository holding the base commit alone (a shallow fetch of ``HEAD``): no other ref, tag, reflog, stash, or
  object of a later commit; the image's own repository is deleted (the command container, starting meanwhile,
  runs nothing but ``sleep`` and sees the image's workdir under the empty volume); then it goes into its
  volume through the engine, before the first command. The trusted baseline the patch is taken against is
  recorded beside it on the host and never mounted where the agent runs. A grader's prepared tree is
  bind-mounted as it is (its HOME a capped volume) where only trusted tools write it and the grader reads it
  back (``git apply``), and copied into the capped workspace volume (``copy_workspace``) where the code under
  test runs: what it writes never comes back to the host tree, which stays as it was, and the grader reads the
  results through the engine (:meth:`DockerSandbox.read_file`, :meth:`DockerSandbox.tree_digests`).
- **The command container**: ``network_mode=none``, a loopback of its own (for an agent, the host's
  :class:`~rollbus.sandbox.adapter_proxy.AdapterProxy` listens in that namespace on the loopback port the
  agent's base URL names: its only way out, nothing mounted for it), commands as an unprivileged uid (its
  init and the init's ``sleep``, which hold the container, with no capability as uid 0, or 65534 where the
  commands run as uid 0, and an ``oom_score_adj`` of -1000: no command can signal them or make them the OOM
  victim), ``cap_drop=ALL``,
  ``no-new-privileges``, the image's root read-only, a size-capped tmpfs ``/tmp``, ``pids_limit``,
  ``mem_limit`` (swap included), ``nano_cpus``, ``RLIMIT_CPU`` where asked, the engine's tini as pid 1; no
  Docker socket and no host path but the workspace, HOME and the named read-only binds (the agent CLI,
  which runs in any image without installing anything: it is a native binary mounted from the cache). The
  engine's default seccomp profile refuses new namespaces (nested user namespaces included). Each command
  is an exec; when it returns, whatever it left running is killed (from the container's pids cgroup, or
  ``kill -9 -1`` inside as the commands' uid where the host cannot see it), so every process it started is
  gone, as on bwrap.
- **Wall clock**: at the deadline every process the command started is killed the same way; the container
  lives on with its workspace, HOME, ``/tmp`` and listener for the next command (the whole container is
  killed only where that fails, and the sandbox with it). Limits hit come back named
  (:data:`~rollbus.sandbox.base.FailureKind`): ``timeout``, ``memory_limit`` and ``pids_limit`` (the
  container's cgroup counters around the command), ``cpu_limit``, ``disk_full`` (the workspace's, HOME's
  or ``/tmp``'s free space), ``output_truncated``.
- **Secrets** (the session token) go in on the command's standard input, read by
  :data:`~rollbus.sandbox.bwrap_layout.SECRET_READER`: never in the container's configuration, so neither
  ``docker inspect`` nor any process's environment but the command's own holds them.
- **Patch capture** runs git in a tool container (the image's git, the sandbox's limits, no network) over
  the workspace mounted read-only and the trusted baseline (:mod:`rollbus.sandbox.capture`).

The engine must share the host's filesystem (the default socket or the project's own engine,
:mod:`rollbus.sandbox.docker_engine`): bind mounts name host paths. Podman's Docker-compatible service
offers the same API and bind mounts; its rootless mode lacks the host-made listener in a container's
network namespace, so the agent role needs rootful Podman.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbus.sandbox import docker_disk
from rollbus.sandbox.adapter_proxy import AdapterProxy
from rollbus.sandbox.base import (
    Completed,
    FailureKind,
    Network,
    SandboxBase,
    SandboxError,
    read_host_file,
    write_host_file,
)
from rollbus.sandbox.bwrap_host import SCRATCH_ROOT, free_bytes, unmount
from rollbus.sandbox.bwrap_layout import AGENT_UID, HOME, WORKSPACE, secret_lines, with_secrets
from rollbus.sandbox.docker_disk import EngineDisk
from rollbus.sandbox.docker_run import Ran, run_container, run_exec
from rollbus.sandbox.limits import Cgroups, Limits, failure_from_counters
from rollbus.sandbox.netns import listener_in
from rollbus.sandbox.peer import AgentProcess, start_time
from rollbus.sandbox.process import CappedBytes
from rollbus.sandbox.repo import (
    GIT_IDENTITY,
    GitError,
    _git_env,
    pack_baseline,
    record_baseline,
    share_baseline,
)

LABEL = "rollbus.sandbox"  # every container and the holder carry it: a sweep finds what a dead runner left
OWNER_LABEL = "rollbus.owner"  # the making process's pid and start time
NETWORK_LABEL = "rollbus.network"  # a command container's: "adapter" where the host's listener is inside
DEFAULT_USER = f"{AGENT_UID}:{AGENT_UID}"
DISK_FULL_MARGIN = 64 << 10
OWNER = "owner"  # in a sandbox's host dir: its maker's pid and start time
WORKSPACE_LAYOUT = "v1"  # what a cached workspace entry holds; a new layout never reads an older one
LEFTOVER_KILL_S = 5.0  # past this, what a finished command left is killed with the whole container
ENGINE_THREADS = 512  # blocking engine calls and running commands, each on a thread of its own
# a command holds its thread while it runs (an agent's, minutes): asyncio's default pool (cpu count + 4
# threads) would queue every other sandbox's boot behind a handful of running agents
_POOL = ThreadPoolExecutor(ENGINE_THREADS, thread_name_prefix="rollbus-docker")


def _off(fn: Callable[..., Any], /, *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on the backend's own threads."""
    return asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


@dataclass(frozen=True)
class DockerLayout:
    """What every command container of one sandbox shares (the host config's inputs)."""

    image: str  # the image's id (sha256:...): every container of the sandbox runs these bytes
    workdir: str
    workspace: Path
    home: Path
    user: str
    limits: Limits
    network: str  # "none", or "adapter": the command container's own loopback, the host's listener in it
    ro_binds: Mapping[str, str] = field(default_factory=dict)  # host path -> inside path
    sandbox_id: str = ""
    rw_binds: Mapping[str, str] = field(default_factory=dict)  # host path -> inside path, writable
    disk: EngineDisk | None = None  # the capped volumes (workspace and HOME, or HOME alone) and their holder


def host_config(client: Any, layout: DockerLayout, *, tool: bool = False) -> dict[str, Any]:
    """The hardened host config of a command container (``tool``: the workspace read-only, no HOME)."""
    import docker

    limits = layout.limits
    volumes = layout.disk.volumes if layout.disk is not None else {}
    binds = {}
    if layout.workdir not in volumes:
        binds[str(layout.workspace)] = {"bind": layout.workdir, "mode": "ro" if tool else "rw"}
    if not tool and HOME not in volumes:
        binds[str(layout.home)] = {"bind": HOME, "mode": "rw"}
    binds |= {host: {"bind": inside, "mode": "ro"} for host, inside in layout.ro_binds.items()}
    if not tool:
        binds |= {host: {"bind": inside, "mode": "rw"} for host, inside in layout.rw_binds.items()}
    tmp = "mode=1777,nosuid,nodev" + (f",size={limits.tmp_bytes}" if limits.tmp_bytes else "")
    ulimits = []
    if limits.cpu_time_s is not None:
        ulimits.append(docker.types.Ulimit(name="cpu", soft=limits.cpu_time_s, hard=limits.cpu_time_s + 1))
    return client.api.create_host_config(
        binds=binds,
        mounts=docker_disk.mounts(volumes, read_only=tool, only={layout.workdir} if tool else None) or None,
        network_mode="none",  # a loopback of its own: an agent's listener is made in it by the host
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        read_only=True,
        tmpfs={"/tmp": tmp},
        pids_limit=limits.pids,
        mem_limit=limits.memory_bytes,
        memswap_limit=limits.memory_bytes,
        nano_cpus=int(limits.cpus * 1e9) if limits.cpus else None,
        ulimits=ulimits or None,
        log_config=docker.types.LogConfig(type="none"),
        ipc_mode="private",
    )


class DockerSandbox(SandboxBase):
    """A sandbox over a container image (see the module docstring for what holds and how)."""

    home = HOME

    def __init__(
        self, client: Any, layout: DockerLayout, data: Path, owner: tuple[int, int], mounted: list[Path]
    ) -> None:
        self.client = client
        self.layout = layout
        self.sandbox_id = layout.sandbox_id
        self.workdir = layout.workdir
        self.limits = layout.limits
        self.proxy: AdapterProxy | None = None
        self._data = data
        self._owner = owner
        self._mounted = mounted
        self._mounts = {layout.workdir: layout.workspace, HOME: layout.home}
        self._live: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._work: WorkContainer | None = None
        self._work_id: str | None = None
        self.enforced = self._report()

    @property
    def host_workdir(self) -> Path:
        return self.layout.workspace

    @property
    def owner(self) -> tuple[int, int]:
        """The (uid, gid) the commands run as, the workspace's and HOME's owner."""
        return self._owner

    @property
    def image(self) -> str:
        """The image's digest (id): the grader and a regrade run these bytes."""
        return self.layout.image

    @property
    def image_digest(self) -> str:  # type: ignore[override]  # the base's attribute, read-only here: the image's
        """What the diff records (:attr:`image`): the grader's container runs these bytes."""
        return self.layout.image

    def _report(self) -> dict[str, str]:
        limits = self.limits
        return {
            "memory": f"container memory+swap {limits.memory_bytes}" if limits.memory_bytes else "none",
            "pids": f"container pids {limits.pids}" if limits.pids else "none",
            "cpu": f"container {limits.cpus} cpus" if limits.cpus else "none",
            "cpu_time": f"RLIMIT_CPU {limits.cpu_time_s} s" if limits.cpu_time_s else "none",
            "disk": f"engine tmpfs volumes of {limits.disk_bytes} ({', '.join(self.layout.disk.volumes)})"
            if self.layout.disk is not None
            else "none",
            "tmp": f"tmpfs size {limits.tmp_bytes}" if limits.tmp_bytes else "tmpfs",
            "identity": f"uid {self.layout.user}, no capabilities, no new privileges",
            "network": "none" if self.layout.network == "none" else "loopback of its own, the adapter only",
            "nested_userns": "the engine's seccomp profile",
            "output": "head+tail capture",
            "wall_clock": "kill of every process the command started (the container's init spared)",
        }

    @classmethod
    async def create(
        cls,
        image: str,
        *,
        client: Any = None,
        workdir: str = WORKSPACE,
        limits: Limits | None = None,
        ro_binds: Mapping[str, str] | None = None,
        network: Network = "none",
        adapter_url: str | None = None,
        forward_port: int | None = None,
        user: str | None = None,
        sandbox_id: str | None = None,
        scratch_root: Path = SCRATCH_ROOT,
        workspace: Path | None = None,
        rw_binds: Mapping[str, str] | None = None,
        copy_workspace: bool = False,
    ) -> DockerSandbox:
        """A sandbox over ``image`` (a name or id the engine has). Its workspace is the image's ``workdir``,
        history scrubbed, unless ``workspace`` (a prepared host directory with its baseline) is given.
        ``rw_binds``: more host directories writable inside (the grader's: a Harbor verifier's logs), each
        the caller's to bound. ``copy_workspace``: with a disk limit, ``workspace`` is copied into the capped
        workspace volume rather than bind-mounted (the host tree stays as it was; read results back through
        :meth:`read_file` and :meth:`tree_digests`), and each ``rw_binds`` path is an empty capped volume
        instead of its host directory.
        ``network="adapter"`` needs ``adapter_url`` and ``forward_port``. Raises :class:`SandboxError`
        (``image_error`` when the engine lacks the image); nothing is left behind on failure."""
        if network == "loopback":
            raise SandboxError("the docker backend has no loopback (host network) mode")
        if client is None:
            from rollbus.sandbox import docker_engine

            try:
                client = await _off(docker_engine.client)
            except docker_engine.EngineUnavailable as exc:
                raise SandboxError(f"docker: {exc}") from exc
        sandbox_id = sandbox_id or secrets.token_hex(8)
        data = scratch_root / f"{sandbox_id}.docker"
        made = functools.partial(
            _prepare_host, client, image, data, workdir=workdir, limits=limits or Limits(),
            ro_binds=dict(ro_binds or {}), user=user or DEFAULT_USER, sandbox_id=sandbox_id,
            workspace=workspace, rw_binds=dict(rw_binds or {}), copy_workspace=copy_workspace,
        )  # fmt: skip
        if network == "adapter" and (adapter_url is None or forward_port is None):
            raise SandboxError("an adapter network needs the adapter's URL and the forwarded port")
        box: DockerSandbox | None = None
        try:
            box = cls(client, *await _off(made))
            # the workspace is made on the host while the command container starts, then goes into its volume
            filled = await asyncio.gather(
                _off(_fill, client, box.layout, box._data, workspace is not None, box._owner),
                box._boot(adapter_url if network == "adapter" else None, forward_port),
                return_exceptions=True,
            )
            for result in filled:
                if isinstance(result, BaseException):
                    raise result
            await _off(_fill_volume, client, box.layout, box._data, workspace is not None, box._owner)
            return box
        except BaseException as exc:
            if box is not None:
                await box.close()
            else:
                await _off(_remove_data, data, [data / "ws", data / "home"])
            import docker

            if isinstance(exc, docker.errors.DockerException):  # a boot failure: the runner tries again
                raise SandboxError(f"docker: {exc}") from exc
            raise

    async def _boot(self, adapter_url: str | None, port: int | None) -> None:
        """The command container started (it holds the volumes), then an agent's listener in its network
        namespace."""
        if adapter_url is not None and port is not None:
            self.layout = DockerLayout(**{**self.layout.__dict__, "network": "adapter"})
            self.enforced = self._report()
        work = await _off(self._work_container)
        if adapter_url is not None and port is not None:
            listener = await listener_in(f"/proc/{work.init}/ns/net", port)
            self.proxy = AdapterProxy(None, adapter_url, self.sandbox_id, listener=listener)
            await self.proxy.start()

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> Completed:
        """``cmd`` in the sandbox's container; ``secret_env`` through its standard input (never its config);
        ``agent``: what its process sends the adapter is stamped ``agent`` (anything it starts: ``tool``).
        ``pass_fds`` (bwrap's inherited descriptors, the grader's channel) cannot cross the Engine API: any
        is refused by name rather than dropped."""
        if pass_fds:
            raise SandboxError("the docker backend cannot pass host descriptors into a container (pass_fds)")
        stdin = b""
        if secret_env:
            stdin, cmd = secret_lines(secret_env), with_secrets(cmd)
        create = {"cmd": list(cmd), "environment": dict(env), "workdir": cwd or self.workdir,
                  "user": self.layout.user}  # fmt: skip
        pin: asyncio.Future[AgentProcess | None] | None = None
        started = None
        if agent and self.proxy is not None:
            loop = asyncio.get_running_loop()
            pin = loop.create_future()
            self.proxy.agent = pin

            def started(pid: int) -> None:
                loop.call_soon_threadsafe(_resolve, pin, AgentProcess.of(pid))

        try:
            return await self._in_thread(self._run_blocking, create, timeout, stdin, started)
        finally:
            if pin is not None and self.proxy is not None:
                pin.cancel()
                self.proxy.agent = None

    def _run_blocking(
        self,
        create: dict[str, Any],
        timeout: float,
        stdin: bytes,
        started: Callable[[int], None] | None,
        cancelled: threading.Event,
    ) -> Completed:
        work = self._work_container()
        before = work.cgroups.counters() if work.cgroups else {}
        ran = run_exec(
            self.client, work.id, create, timeout, stdin=stdin, output_limit=self.limits.output_bytes,
            kill=lambda: self._kill_commands(work), leftovers=lambda: self._kill_commands(work),
            started=started, cancelled=cancelled,
        )  # fmt: skip
        after = work.cgroups.counters() if work.cgroups else {}
        return _completed(ran, self._classify(ran, failure_from_counters(before, after), work))

    def _work_container(self) -> WorkContainer:
        """The running container commands are executed in, started once at create: it holds the sandbox's
        volumes and network namespace for the sandbox's whole life. Its init and the init's sleeping child
        run with no capability as a uid the commands' is not (no command can signal them:
        :func:`~rollbus.sandbox.docker_disk.init_user`) and are never the OOM victim; should it
        die all the same (the engine's doing), the sandbox is gone and every later command says so."""
        with self._lock:
            if self._work is not None:
                return self._work
            if self._work_id is not None:
                raise SandboxError("the sandbox's container is gone, its workspace, HOME and network with it")
            api = self.client.api
            config = host_config(self.client, self.layout)
            config["Init"] = True  # the engine's tini as pid 1 reaps what the commands orphan
            self._work_id = api.create_container(
                self.layout.image, ["sleep", "infinity"], user=docker_disk.init_user(self._owner[0]),
                working_dir=self.layout.workdir, host_config=config, entrypoint=[],
                labels={**labels(self.sandbox_id), NETWORK_LABEL: self.layout.network},
            )["Id"]  # fmt: skip
            start(api, self._work_id)
            work = work_container(self._work_id, int(api.inspect_container(self._work_id)["State"]["Pid"]))
            for pid in work.spare:  # the memory cgroup's OOM killer takes a command's process, never these
                with contextlib.suppress(OSError):
                    Path(f"/proc/{pid}/oom_score_adj").write_text("-1000")
            if self.layout.disk is not None:
                self.layout = DockerLayout(
                    **{**self.layout.__dict__, "disk": self.layout.disk.held_by(work.id, work.init)}
                )
            self._work = work
            return work

    def _kill_work(self, work: WorkContainer) -> None:
        """The last resort: the whole container dies, every process in it (and the sandbox with it)."""
        import docker

        with contextlib.suppress(docker.errors.APIError):
            self.client.api.kill(work.id)
        with self._lock:
            if self._work is work:
                self._work = None

    def _kill_commands(self, work: WorkContainer) -> None:
        """Every process the commands started (at the deadline, or what a finished command left running),
        so the command returns with nothing of it alive; the container's init and its sleep go on holding
        the sandbox's volumes and network. Killed from the container's pids cgroup until none is left; where
        the host cannot see it, by ``kill -9 -1`` run inside as the commands' uid (every process of that
        uid but itself: the init's are another uid)."""
        if work.cgroups is None:
            self._kill_as_user(work)
            return
        deadline = time.monotonic() + LEFTOVER_KILL_S
        while time.monotonic() < deadline:  # a process forking while it is killed: again until none is left
            pids = [p for p in work.processes() if p not in work.spare and not _zombie(p)]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        self._kill_work(work)

    def _kill_as_user(self, work: WorkContainer) -> None:
        import docker

        api = self.client.api
        try:
            for _ in range(2):  # a fork racing the first: its parent already had the signal, or the second
                made = api.exec_create(work.id, ["/bin/sh", "-c", "kill -9 -1"], user=self.layout.user)
                api.exec_start(made["Id"])
        except docker.errors.APIError:
            self._kill_work(work)

    async def run_tool(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        ro_binds: Mapping[Path, str] | None = None,
        stdout: CappedBytes | None = None,
        timeout: float = 600.0,
    ) -> Completed:
        """A program over this sandbox's files that the host must not run itself (git taking the patch): a
        fresh container from the same image, the workspace read-only, no network, the sandbox's limits,
        ``ro_binds`` (host path -> inside path) read-only, stdout into ``stdout``."""
        layout = DockerLayout(
            **{**self.layout.__dict__, "ro_binds": {str(h): i for h, i in (ro_binds or {}).items()}}
        )
        create = {
            "image": self.layout.image, "command": list(cmd), "environment": dict(env), "working_dir": "/",
            "user": layout.user, "host_config": host_config(self.client, layout, tool=True),
            "labels": labels(self.sandbox_id), "entrypoint": [],
        }  # fmt: skip

        def one_shot(cancelled: threading.Event) -> Completed:
            ran = run_container(self.client, create, timeout, output_limit=self.limits.output_bytes,
                                stdout=stdout, cancelled=cancelled)  # fmt: skip
            return _completed(ran, "timeout" if ran.timed_out else "memory_limit" if ran.oom_killed else None)

        return await self._in_thread(one_shot)

    async def _in_thread(self, job_fn: Callable[..., Completed], *args: Any) -> Completed:
        """``job_fn(*args, cancelled)`` off the loop; cancelling the caller sets ``cancelled`` (the job
        kills what it runs) and waits until it is gone."""
        cancelled = threading.Event()
        self._live.add(cancelled)
        job = asyncio.ensure_future(_off(job_fn, *args, cancelled))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancelled.set()
            with contextlib.suppress(Exception):
                await job
            raise
        except Exception as exc:
            import docker

            if isinstance(exc, docker.errors.ImageNotFound):
                raise SandboxError(f"docker: {exc}", "image_error") from exc
            if isinstance(exc, docker.errors.DockerException):
                raise SandboxError(f"docker: {exc}") from exc
            raise
        finally:
            self._live.discard(cancelled)

    def _classify(self, ran: Ran, counted: FailureKind | None, work: WorkContainer) -> FailureKind | None:
        if ran.timed_out:
            return "timeout"
        if counted:
            return counted
        if self.limits.cpu_time_s is not None and ran.exit_code == 128 + signal.SIGXCPU:
            return "cpu_limit"
        # whatever filesystem holds the workspace and HOME (its engine-made volumes, or the grader's capped
        # scratch the caller's workspace lies on), measured as bwrap measures it: full is the command's doing
        disk = self.layout.disk.free_paths() if self.layout.disk is not None else []
        with contextlib.suppress(OSError):
            if any(free_bytes(p) < DISK_FULL_MARGIN for p in {*self._mounted, *self._mounts.values(), *disk}):
                return "disk_full"
        with contextlib.suppress(OSError):
            if self.limits.tmp_bytes is not None and free_bytes(work.tmp) < DISK_FULL_MARGIN:
                return "disk_full"
        if ran.output_dropped:
            return "output_truncated"
        return None

    async def write_file(self, path: str, data: bytes | str) -> None:
        disk = self.layout.disk
        if disk is not None and disk.holds(path):
            raw = data.encode() if isinstance(data, str) else data
            await _off(docker_disk.write_file, self.client, disk, path, raw, self._owner)
            return
        write_host_file(self._mounts, path, data, owner=self._owner[0])

    async def read_file(self, path: str, limit: int | None = None) -> bytes:
        """The file's bytes (``limit``: its first ``limit`` bytes, so a huge file costs no memory)."""
        disk = self.layout.disk
        if disk is not None and disk.holds(path):
            return await _off(docker_disk.read_file, self.client, disk, path, limit)
        data = read_host_file(self._mounts, path)
        return data if limit is None else data[:limit]

    @property
    def workspace_copied(self) -> bool:
        """The workspace is the sandbox's capped volume, not a host tree (what is written there stays)."""
        return self.layout.disk is not None and self.workdir in self.layout.disk.volumes

    async def tree_digests(self, wanted: Callable[[str], bool]) -> dict[str, tuple[str, int, str]]:
        """The workspace volume's entries ``wanted`` takes (by path below the workdir), each its kind, size
        and content digest, read through the engine (:func:`rollbus.sandbox.docker_disk.tree_digests`)."""
        if self.layout.disk is None or not self.workspace_copied:
            raise SandboxError("the workspace is a host tree here: read it on the host")
        return await _off(docker_disk.tree_digests, self.client, self.layout.disk, self.workdir, wanted)

    async def close(self) -> None:
        for cancelled in list(self._live):
            cancelled.set()
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            with contextlib.suppress(Exception):
                await proxy.close()
        work, self._work_id, self._work = self._work_id, None, None
        volumes = list(self.layout.disk.volumes.values()) if self.layout.disk is not None else []
        containers = [work] if work else []
        await _off(_close, self.client, containers, self._data, self._mounted, volumes)


def labels(sandbox_id: str) -> dict[str, str]:
    """What every container of a sandbox carries: its sandbox, and its owner (so a sweep can tell a dead
    runner's from a live one's, a reused pid included)."""
    return {LABEL: sandbox_id, OWNER_LABEL: _owner_stamp(os.getpid())}


def _owner_stamp(pid: int) -> str:
    return f"{pid}:{start_time(pid)}"


def sweep_stale(client: Any, scratch_root: Path = SCRATCH_ROOT) -> list[str]:
    """Remove what docker sandboxes of dead processes left (a runner killed -9): their containers (the
    command container and the holder sleep forever otherwise) and their host side (tmpfs mounts, dirs).
    For a runner's start; returns the swept sandbox ids."""
    swept: set[str] = set()
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        stamp = container.labels.get(OWNER_LABEL, "")
        pid = stamp.partition(":")[0]
        if pid.isdigit() and _owner_stamp(int(pid)) == stamp:
            continue  # its owner lives
        with contextlib.suppress(Exception):
            container.remove(force=True)
        swept.add(container.labels.get(LABEL, ""))
    for owner in scratch_root.glob(f"*.docker/{OWNER}"):
        stamp = owner.read_text().strip()
        pid = stamp.partition(":")[0]
        if pid.isdigit() and _owner_stamp(int(pid)) == stamp:
            continue
        _remove_data(owner.parent, [owner.parent / "ws", owner.parent / "home"])
        swept.add(owner.parent.name.removesuffix(".docker"))
    for volume in client.volumes.list(filters={"label": LABEL}):  # capped disks, once no container holds them
        stamp = (volume.attrs.get("Labels") or {}).get(OWNER_LABEL, "")
        pid = stamp.partition(":")[0]
        if pid.isdigit() and _owner_stamp(int(pid)) == stamp:
            continue
        with contextlib.suppress(Exception):
            volume.remove(force=True)
        swept.add((volume.attrs.get("Labels") or {}).get(LABEL, ""))
    return sorted(swept - {""})


def _completed(ran: Ran, kind: FailureKind | None) -> Completed:
    return Completed(
        ran.exit_code, ran.stdout, ran.stderr, ran.wall_time_s, ran.timed_out, kind, ran.output_dropped
    )


@dataclass
class WorkContainer:
    """The running container of a sandbox: its id, its init's host pid, its cgroups (None where the host
    cannot see them: a remote engine) and the processes that were there before any command."""

    id: str
    init: int
    cgroups: Cgroups | None
    spare: set[int] = field(default_factory=set)

    @property
    def tmp(self) -> Path:
        return Path(f"/proc/{self.init}/root/tmp")

    def processes(self) -> list[int]:
        if self.cgroups is None:
            return []
        procs = next(iter(self.cgroups.dirs.values())) / "cgroup.procs"
        with contextlib.suppress(OSError, ValueError):
            return [int(pid) for pid in procs.read_text().split()]
        return []


def work_container(cid: str, init: int) -> WorkContainer:
    """Find the container's cgroups (v1 under ``docker/``, v2 under ``docker/`` or systemd's scope) and
    what runs in it before any command (the init and its sleeping child)."""
    dirs: dict[str, Path] = {}
    for controller in ("pids", "memory", "cpu"):
        path = Path(f"/sys/fs/cgroup/{controller}/docker/{cid}")
        if path.is_dir():
            dirs[controller] = path
    version = 1
    if not dirs:
        version = 2
        for path in (
            Path(f"/sys/fs/cgroup/docker/{cid}"),
            Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope"),
        ):
            if path.is_dir():
                dirs = {"pids": path, "memory": path, "cpu": path}
    work = WorkContainer(cid, init, Cgroups(version, dirs) if dirs else None)
    deadline = time.monotonic() + 5.0
    while work.cgroups is not None and time.monotonic() < deadline:
        work.spare = set(work.processes())
        if len(work.spare) >= 2:  # tini and its sleep
            break
        time.sleep(0.01)
    return work


def _zombie(pid: int) -> bool:
    """Dead and waiting for the init to reap it (it holds nothing, and killing it does nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return True  # gone already


def _resolve(pin: asyncio.Future[AgentProcess | None], process: AgentProcess | None) -> None:
    if not pin.done():
        pin.set_result(process)


def _prepare_host(
    client: Any,
    image: str,
    data: Path,
    *,
    workdir: str,
    limits: Limits,
    ro_binds: dict[str, str],
    user: str,
    sandbox_id: str,
    workspace: Path | None,
    rw_binds: dict[str, str] | None = None,
    copy_workspace: bool = False,
) -> tuple[DockerLayout, Path, tuple[int, int], list[Path]]:
    """The host side, off the loop: the image's digest, the capped workspace and HOME (filled by
    :func:`_fill`)."""
    import docker

    try:
        image_id = client.images.get(image).id
    except docker.errors.ImageNotFound as exc:
        raise SandboxError(f"no image {image!r} in the Docker engine", "image_error") from exc
    except docker.errors.DockerException as exc:
        raise SandboxError(f"docker: {exc}") from exc
    data.mkdir(parents=True, mode=0o700)
    (data / OWNER).write_text(_owner_stamp(os.getpid()))  # for sweep_stale after a kill -9
    for name in ("ws", "home") if workspace is None else ("home",):
        (data / name).mkdir(mode=0o755)  # the workspace's staging (or, with no disk limit, the binds)
    ws = data / "ws" if workspace is None else Path(workspace)
    layout = DockerLayout(image_id, workdir, ws, data / "home", user, limits, "none", ro_binds, sandbox_id,
                          rw_binds or {})  # fmt: skip
    owner = _owner_of(client, layout)  # a user name is looked up in the image
    if limits.disk_bytes is not None:
        paths = [workdir, HOME] if workspace is None or copy_workspace else [HOME]
        if workspace is not None and copy_workspace:  # the writable directories too: empty capped volumes
            paths += [inside for inside in layout.rw_binds.values() if inside not in paths]
            layout = DockerLayout(**{**layout.__dict__, "rw_binds": {}})
        name = f"rollbus-disk-{sandbox_id}"
        disk = docker_disk.create(client, paths, limits.disk_bytes, owner, labels(sandbox_id), name)
        layout = DockerLayout(**{**layout.__dict__, "disk": disk})
    os.chmod(data, 0o755)  # the agent's uid traverses to its binds
    return layout, data, owner, []


def _fill(client: Any, layout: DockerLayout, data: Path, prepared: bool, owner: tuple[int, int]) -> None:
    """The workspace from the image (its repository re-made from the base commit) and its trusted
    baseline, or a tree the host ``prepared`` (the grader's) handed to ``owner``, the sandbox's uid; HOME
    likewise."""
    if not prepared:  # into a volume, the entry goes in straight from the cache (_fill_volume): no host copy
        copy = layout.disk is None or layout.workdir not in layout.disk.volumes
        _cached_workspace(client, layout, layout.workspace, data.parent / "images", copy=copy)
    _chown_tree(layout.workspace, owner)
    os.chown(data / "home", *owner)


def _fill_volume(
    client: Any, layout: DockerLayout, data: Path, prepared: bool, owner: tuple[int, int]
) -> None:
    """The workspace into its capped volume (through the running container that holds it): the image's,
    from its cache entry, every file ``owner``'s (the host keeps the baseline alone), or a prepared tree
    with ``copy_workspace`` (the host's stays as it was)."""
    if layout.disk is None or layout.workdir not in layout.disk.volumes:
        return
    binds = [*layout.ro_binds.values(), *layout.rw_binds.values()]  # over the volume in the container
    covered = [posixpath.relpath(path, layout.workdir) for path in binds if _below(path, layout.workdir)]
    tree = layout.workspace if prepared else _entry(layout, data.parent / "images") / "ws"
    owned = None if prepared else owner
    docker_disk.put_tree(client, layout.disk, tree, layout.workdir, covered, owned, data)


def _below(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path != root and posixpath.commonpath([path, root]) == root


def _entry(layout: DockerLayout, cache: Path) -> Path:
    key = hashlib.sha256(f"{layout.image}\0{layout.workdir}".encode()).hexdigest()[:24]
    return cache / f"docker-{WORKSPACE_LAYOUT}-{key}"


def _cached_workspace(client: Any, layout: DockerLayout, ws: Path, cache: Path, *, copy: bool = True) -> None:
    """``ws`` filled from the image's scrubbed workspace (``copy``; else left for :func:`_fill_volume`) and
    given its trusted baseline, made once per image id and workdir (:func:`_prepare_workspace`) and copied
    from then on, as bwrap's workspace cache (:func:`rollbus.sandbox.images.cached_agent_workspace`). An
    image id is the digest of its content, so an entry never goes stale; the copy is never linked (the agent
    writes into it), the baseline its own."""
    from rollbus.sandbox.images import copy_entry

    entry = _entry(layout, cache)
    try:
        if not entry.exists():
            cache.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=cache))
            try:
                _prepare_workspace(client, layout, scratch / "ws")
                pack_baseline(record_baseline(scratch / "ws"))
                os.rename(scratch, entry)
            except OSError:  # another sandbox made it first (or the cache's disk failed: raised below)
                shutil.rmtree(scratch, ignore_errors=True)
                if not entry.exists():
                    raise
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
        if copy:
            copy_entry(entry / "ws", ws)
        share_baseline(entry / "ws", ws)
    except (GitError, OSError) as exc:
        kind: FailureKind = "disk_full" if "No space left" in str(exc) else "image_error"
        raise SandboxError(f"filling the workspace from {layout.workdir} of the image: {exc}", kind) from exc


def _prepare_workspace(client: Any, layout: DockerLayout, ws: Path) -> None:
    """The image's ``workdir`` copied out of it (nothing of the image runs), its repository re-made from the
    base commit alone by host git (a shallow fetch of ``HEAD`` into a fresh repository, every configured
    program off)."""
    from rollbus.sandbox.docker_images import ImageBuildError, export_tree

    source = ws.with_name("image.git")  # the image's repository, beside the workspace: never mounted
    try:
        export_tree(client, layout.image, layout.workdir, ws)
    except (ImageBuildError, OSError, tarfile.TarError) as exc:
        raise SandboxError(f"copying {layout.workdir} out of the image: {exc}", "image_error") from exc
    except Exception as exc:  # the engine's own errors (a workdir the image lacks: 404)
        raise SandboxError(f"copying {layout.workdir} out of the image: {exc}", "image_error") from exc
    try:
        if (ws / ".git").is_dir() and not (ws / ".git").is_symlink():
            shutil.move(ws / ".git", source)
            _rebase_repository(ws, source)
        else:
            if (ws / ".git").exists() or (ws / ".git").is_symlink():
                (ws / ".git").unlink()  # a gitfile (a submodule's or worktree's): its repository is not here
            _host_git(ws, "init", "-q", "--template=")
            _host_git(ws, "add", "-A")
            _host_git(ws, *GIT_IDENTITY, "commit", "-q", "--allow-empty", "-m", "base")
    except (GitError, OSError) as exc:
        kind: FailureKind = "disk_full" if "No space left" in str(exc) else "image_error"
        raise SandboxError(f"re-making {layout.workdir}'s repository: {exc}", kind) from exc
    finally:
        shutil.rmtree(source, ignore_errors=True)


def _rebase_repository(ws: Path, source: Path) -> None:
    """A fresh repository in ``ws`` holding the base commit (``source``'s ``HEAD``) alone, on its branch."""
    head = _host_git(ws, "--git-dir", str(source), "rev-parse", "--verify", "HEAD").strip()
    branch = _host_git(ws, "--git-dir", str(source), "symbolic-ref", "-q", "--short", "HEAD", check=False)
    _host_git(ws, "init", "-q", "--template=")
    _host_git(ws, "fetch", "-q", "--depth=1", "--no-tags", f"file://{source}", "HEAD")
    ref = f"refs/heads/{branch.strip() or 'main'}"
    _host_git(ws, "update-ref", ref, head)
    _host_git(ws, "symbolic-ref", "HEAD", ref)
    _host_git(ws, "reset", "-q")
    for left in (ws / ".git" / "FETCH_HEAD", ws / ".git" / "logs"):
        if left.is_dir():
            shutil.rmtree(left)
        elif left.exists():
            left.unlink()


def _host_git(cwd: Path, *args: str, check: bool = True) -> str:
    """git on the host over a tree copied from the image: no user or system config, no hooks, no fsmonitor,
    no reflog, no automatic gc."""
    settings = ("core.fsmonitor=false", "core.hooksPath=/dev/null", "core.logAllRefUpdates=false",
                "gc.auto=0", "maintenance.auto=false", "protocol.file.allow=always")  # fmt: skip
    off = [arg for setting in settings for arg in ("-c", setting)]
    done = subprocess.run(["git", *off, *args], cwd=cwd, env=_git_env(), capture_output=True, text=True,
                          check=False)  # fmt: skip
    if check and done.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {done.stderr.strip()[-400:]}")
    return done.stdout


def _owner_of(client: Any, layout: DockerLayout) -> tuple[int, int]:
    """The agent's (uid, gid): numeric as given, or a name looked up in the image's ``/etc/passwd``."""
    name, _, group = layout.user.partition(":")
    if name.isdigit() and (not group or group.isdigit()):
        return int(name), int(group or name)
    from rollbus.sandbox.docker_images import export_tree

    with tempfile.TemporaryDirectory(prefix="rollbus-passwd-") as tmp:
        export_tree(client, layout.image, "/etc", Path(tmp) / "etc")
        for line in (Path(tmp) / "etc" / "passwd").read_text(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) > 3 and fields[0] == name:
                return int(fields[2]), int(fields[3])
    raise SandboxError(f"the image has no user {name!r}", "image_error")


def _chown_tree(root: Path, owner: tuple[int, int]) -> None:
    os.chown(root, *owner, follow_symlinks=False)
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(top, name), *owner, follow_symlinks=False)


start = docker_disk.start  # a container start the engine failed transiently is tried again


def _close(client: Any, containers: list[str], data: Path, mounted: list[Path], volumes: list[str]) -> None:
    """Remove the sandbox's container, then its capped volumes (once no container holds them) and its host
    directories."""
    docker_disk.remove(client, containers, volumes)
    _remove_data(data, mounted)


def _remove_data(data: Path, mounted: list[Path]) -> None:
    for path in mounted:
        if os.path.ismount(path):
            unmount(path)
    shutil.rmtree(data, ignore_errors=True)
