"""Grade one patch against one row, in fresh network-less sandboxes over the row's base tree.

Order (SWE-bench Pro's, not slime's, so the patch can never win over the grading material):

1. sanitise the patch, as bytes (size cap, NUL bytes, unsafe paths, formats other than unified diffs: a named
   failure; binary hunks stripped);
2. make the base tree: the image's files and a fresh repository whose only commit holds them, scrubbed as the
   agent's workspace is (:func:`rollbus.sandbox.images.agent_workspace`), so no sandbox of the grade holds a
   commit, ref, tag, stash, reflog or object of the future; swepro's target tests are taken out of the
   image's later commit on the host (``before_repo_set_cmd``'s ``git checkout <ref> -- <paths>``, read,
   never run);
3. copy the base tree; apply in a sandbox: ``git apply --3way``, then ``git apply`` (an index-less apply, for
   files the base commit does not track), each on a fresh copy; never a fuzzy tool (an empty patch applies);
4. measure what really changed against the base tree and raise flags (:mod:`rollbus.grading.flags`, and the
   changed Python files' syntax trees, :mod:`rollbus.grading.tamper`); put the base tree's ``.git`` back, so
   nothing the patch did there runs in the grader's git commands;
5. copy eval-only files and swepro's target tests in, delete all bytecode (and run with
   ``PYTHONDONTWRITEBYTECODE``);
6. in a second sandbox: exactly one of swepro's run script, ``eval_cmd`` or ``f2p_script``, every pytest run
   carrying the grader's plugin, ``-m unittest`` run by the grader's runner, fresh canaries next to the row's
   tests; swepro's parser runs in a third sandbox that holds only the logs;
7. decide from the grader's report, judged first for tampering (:mod:`rollbus.grading.verdict`); zeroing
   flags score 0.

The whole grade has one deadline; the sandbox of whatever runs when it passes is killed.

Where the commands run is a :class:`Sandboxes` (the base tree, each sandbox, the report channel):
:class:`LocalSandboxes` (bwrap over host trees) here, :class:`rollbus.grading.container.ContainerSandboxes`
for the ``docker`` backend, which calls :func:`grade_in`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import re
import shlex
import shutil
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from rollbus.grading import canaries as canary
from rollbus.grading import flags as fl
from rollbus.grading import observed, report, second_run, tamper, toolchain, trees, verdict
from rollbus.grading.channel import Channel, ReportListener
from rollbus.grading.patches import PatchRejected, Sanitized, sanitize
from rollbus.grading.rows import EvalCmd, F2PScript, GradingSpec, Harbor, Swepro
from rollbus.grading.verdict import Evidence, GradeResult, Verdict, failed
from rollbus.sandbox import BwrapSandbox, Completed, SandboxError, SandboxUnavailable
from rollbus.sandbox.images import agent_workspace
from rollbus.sandbox.scratch import GRADE_SCRATCH_PREFIX, SCRATCH_BYTES, capped_scratch
from rollbus.tar_extract import extract_tar

EVAL_DIR = "/eval"  # read-only bind of the eval-only scripts inside the grading sandbox
PATCH_NAME = "rollbus.patch"
PLUGIN_DIR = f"{EVAL_DIR}/plugins"  # the grader's pytest plugin, unittest runner and canaries, read-only
PLUGIN_SOURCES = {
    "rollbus_report.py": "pytest_report.py",
    "rollbus_unittest.py": "unittest_report.py",
    "rollbus_channel.py": "sandbox_channel.py",
    "sitecustomize.py": "sandbox_site.py",  # the audit hook, installed when each interpreter starts
    "rollbus_launch.py": "sandbox_launch.py",  # a container's way onto the channel (a socket)
}
TEST_FILE = re.compile(r"test_.*\.py|.*_test\.py")  # pytest's default ``python_files``: a named file of tests
UNITTEST_MODULE = re.compile(r"(?<![\w.-])-m\s+unittest(?![\w.])")
APPLY_COMMANDS = (
    ("git-apply-3way", ["git", "apply", "--3way", "--whitespace=nowarn"]),
    ("git-apply", ["git", "apply", "--whitespace=nowarn"]),
)
REFRESH_INDEX = ["git", "update-index", "-q", "--refresh"]
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}


@dataclass(frozen=True)
class GradeConfig:
    """The grader's knobs (the service's settings map onto these)."""

    timeout_s: float = 600.0
    max_patch_bytes: int = 2**20
    zero_flagged: bool = True
    log_excerpt_bytes: int = 8192
    scratch_dir: Path | None = None
    scratch_bytes: int = SCRATCH_BYTES
    readonly_tests: bool = True
    backend: str = "local"  # the sandbox backend, by name (rollbus.grading.backends); this module is local
    observe: bool = True  # the audit hook in every interpreter of the tests (off: bench/grade.py's baseline)
    second_run: bool = True  # the required tests again under the second harness (off: bench's baseline)


class ReportChannel(Protocol):
    """The grader's channel into one test command (:class:`~rollbus.grading.channel.Channel`'s shape)."""

    text: str

    @property
    def env(self) -> dict[str, str]: ...

    @property
    def fds(self) -> tuple[int, ...]: ...

    def collect(self, wait_s: float = 5.0) -> str: ...

    def close(self) -> None: ...


class Sandboxes(Protocol):
    """Where a grade's commands run: the base tree it starts from, its sandboxes, its report channel."""

    def refusal(self, spec: GradingSpec) -> GradeResult | None: ...

    async def tree(self, spec: GradingSpec, dest: Path) -> Path: ...

    async def sandbox(
        self,
        repo: Path,
        workdir: str,
        binds: Mapping[Path, str],
        channel: ReportChannel | None = None,
        *,
        copy_tree: bool = False,
    ) -> Any: ...

    def channel(self, config: Mapping[str, Any], scratch: Path) -> ReportChannel: ...


class LocalSandboxes:
    """bwrap over host trees (a repository directory or tarball); the channel's descriptors inherited."""

    def refusal(self, spec: GradingSpec) -> GradeResult | None:
        if spec.container_image is not None:
            return failed(
                verdict.SANDBOX_FAILED,
                f"metadata.image {spec.container_image!r} is a container image: the local (bwrap) grader "
                "runs host repository directories and tarballs only (grade with a container backend)",
            )
        if isinstance(spec.grader, Harbor):
            return failed(verdict.SANDBOX_FAILED, "a Harbor verifier runs in its task's container image only")
        return None

    async def tree(self, spec: GradingSpec, dest: Path) -> Path:
        return materialize(spec.image, dest)

    async def sandbox(
        self,
        repo: Path,
        workdir: str,
        binds: Mapping[Path, str],
        channel: ReportChannel | None = None,
        *,
        copy_tree: bool = False,
    ) -> BwrapSandbox:
        """``copy_tree`` aside: ``repo`` lies on the grade's capped scratch, which bwrap mounts as it is."""
        return await BwrapSandbox.create(repo, network="none", ro_binds=dict(binds), inside_workdir=workdir)

    def channel(self, config: Mapping[str, Any], scratch: Path) -> ReportChannel:
        return Channel(config)


# the grade's sandboxes, set for the grade's task (:func:`grade_in`); bwrap's unless a backend says otherwise
SANDBOXES: contextvars.ContextVar[Sandboxes] = contextvars.ContextVar("grading_sandboxes")


async def grade(spec: GradingSpec, patch: bytes | str, config: GradeConfig | None = None) -> GradeResult:
    """Grade ``patch`` (its bytes; text is taken back to the bytes it was decoded from with
    ``surrogateescape``) against the row ``spec``; never raises: anything that goes wrong inside is the
    verdict ``grader_error`` (reward 0) with its cause."""
    return await grade_in(LocalSandboxes(), spec, patch, config)


async def grade_in(
    sandboxes: Sandboxes, spec: GradingSpec, patch: bytes | str, config: GradeConfig | None = None
) -> GradeResult:
    """:func:`grade` with every command of the grade in ``sandboxes`` (a backend's)."""
    SANDBOXES.set(sandboxes)
    config = config or GradeConfig()
    try:
        sanitized = sanitize(patch, config.max_patch_bytes)
    except PatchRejected as exc:
        return failed(exc.kind, str(exc))
    started = time.monotonic()
    timeout_s = min(config.timeout_s, spec.timeout_s or config.timeout_s)  # the row's own, under the cap
    try:
        async with asyncio.timeout(timeout_s):
            return await _grade(spec, sanitized, config, started + timeout_s)
    except TimeoutError:
        return failed(verdict.TIMEOUT, f"grading took longer than {timeout_s:g} s")
    except (SandboxUnavailable, SandboxError, OSError, tarfile.TarError) as exc:
        return failed(verdict.SANDBOX_FAILED, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # the grader always answers: a crash here is a verdict, never a dead letter
        return verdict.grader_error(exc)


async def _grade(
    spec: GradingSpec, sanitized: Sanitized, config: GradeConfig, deadline: float
) -> GradeResult:
    if (refused := _sandboxes().refusal(spec)) is not None:
        return refused
    missing = [str(p) for p in eval_material(spec) if not p.is_file()]
    if missing:
        return failed(verdict.BAD_ROW, f"eval-only files missing: {', '.join(missing)}")
    # a capped tmpfs: the host disk never grows
    with capped_scratch(GRADE_SCRATCH_PREFIX, config.scratch_dir, config.scratch_bytes) as tmp:
        scratch = Path(tmp)
        image = await _sandboxes().tree(spec, scratch / "image")
        try:
            restored = restore_tests(spec, image, scratch / "restored")
        except trees.RestoreFailed as exc:
            return failed(verdict.GRADING_SETUP_FAILED, f"before_repo_set_cmd: {exc}")
        base = await asyncio.to_thread(agent_workspace, image.resolve(), scratch / "base")
        pristine = trees.snapshot(base)
        repo = scratch / "repo"
        method, apply_log = await apply(base, repo, sanitized, deadline, spec.workdir)
        if method is None:
            return failed(verdict.PATCH_FAILED, apply_log[-2000:], flags=stripped_flags(sanitized))
        changed = trees.changes(base, pristine, repo)
        raised = raise_flags(spec, sanitized, changed, repo, base)
        restore_git(base, repo)
        for dest, src in spec.eval_files.items():
            trees.place_file(repo, dest, src.read_bytes())
        trees.overlay(scratch / "restored", repo, restored)
        if spec.test_patch and (why := await apply_test_patch(spec, base, repo, deadline)):
            return failed(verdict.GRADING_SETUP_FAILED, f"test_patch: {why}", applied=True, flags=raised)
        removed = trees.remove_bytecode(repo)
        eval_dir = scratch / "eval"
        eval_dir.mkdir()
        known = untouched_python_files(pristine, changed)
        outcome, log = await run_grader(
            spec, repo, eval_dir, scratch, deadline, config.readonly_tests, known,
            observed.untouched_files(pristine, changed), config.observe, config.second_run,
        )  # fmt: skip
        details = {
            "instance_id": spec.instance_id,
            "apply_method": method,
            "changed_files": sorted(p for p in changed if not p.startswith(".git/"))[:200],
            "bytecode_removed": removed,
            "stripped_binary": list(sanitized.stripped_binary),
            "stripped_git": list(sanitized.stripped_git),
            "log": log_excerpt(log, config.log_excerpt_bytes),
        }
        if outcome.wildcard_expected and fl.ALWAYS_EQUAL in raised and fl.ALWAYS_EQUAL not in outcome.flags:
            raised = raised - {fl.ALWAYS_EQUAL}  # the scan's guess; the tests were seen to expect it
            details["scan_overruled"] = [fl.ALWAYS_EQUAL]
        zeroing = fl.ZEROING if config.zero_flagged else frozenset()
        return verdict.final(outcome, raised, zeroing, details)


def eval_material(spec: GradingSpec) -> list[Path]:
    """Host files the row's grading needs (none of them ever enters an agent's sandbox)."""
    paths = list(spec.eval_files.values())
    if isinstance(spec.grader, Swepro):
        paths += [spec.grader.run_script, spec.grader.parser_script]
    return paths


def restore_tests(spec: GradingSpec, image: Path, dest: Path) -> list[str]:
    """swepro's target tests, out of the image's later commit, on the host (relative paths under ``dest``)."""
    if not isinstance(spec.grader, Swepro):
        return []
    dest.mkdir()
    return trees.checkout_files(image, spec.grader.restore_ref, spec.grader.restore_paths, dest)


def untouched_python_files(pristine: Mapping[str, trees.Entry], changed: Mapping[str, str]) -> set[str]:
    """The base tree's Python files the patch left as they were: a test collected from one of them was in the
    repository before the agent (a row's command may run a whole directory of them), never planted."""
    return {
        rel
        for rel, entry in pristine.items()
        if entry.kind == "file" and rel.endswith(".py") and rel not in changed and not rel.startswith(".git/")
    }


def raise_flags(
    spec: GradingSpec, sanitized: Sanitized, changed: Mapping[str, str], repo: Path, base: Path | None = None
) -> set[str]:
    """Flags from the tree the patch produced (what changed against the base tree: files added, modified,
    deleted, their modes and links), never from the patch text: paths, then the changed Python files' code."""
    packages = trees.package_dirs(repo)
    raised = fl.path_flags(changed, spec.test_files(), packages, toolchain.modules())
    raised |= tamper.scan(changed, repo, base)
    return raised | stripped_flags(sanitized)


def stripped_flags(sanitized: Sanitized) -> set[str]:
    """Flags for what sanitising took out: binary hunks (reported), sections into ``.git/`` (zeroing)."""
    binary = {fl.BINARY_STRIPPED} if sanitized.stripped_binary else set()
    return binary | ({fl.TOUCHES_GIT} if sanitized.stripped_git else set())


def materialize(image: Path, dest: Path) -> Path:
    """The image as a directory: itself, or a tarball unpacked (its root, or its single top-level dir)."""
    if image.is_dir():
        return image
    if not image.is_file():
        raise FileNotFoundError(f"image {image} does not exist (build it first?)")
    dest.mkdir(parents=True)
    with tarfile.open(image) as archive:
        extract_tar(archive, dest)
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


async def grading_sandbox(
    repo: Path,
    workdir: str,
    eval_dir: Path | None = None,
    protected: Sequence[str] = (),
    channel: ReportChannel | None = None,
    *,
    copy_tree: bool = False,
) -> BwrapSandbox:
    """A network-less sandbox over ``repo`` at the row's ``workdir``, eval scripts read-only at ``/eval``,
    and the ``protected`` repository paths mounted read-only over themselves; ``channel``: the report
    channel of the command it will run (a container backend mounts its socket); ``copy_tree``: the code
    under test runs here, and the host reads nothing of ``repo`` after (a container backend copies it into
    the sandbox's engine-capped disk; read the results with :func:`tree_code_files` and ``read_file``)."""
    binds: dict[Path, str] = {eval_dir: EVAL_DIR} if eval_dir is not None else {}
    binds |= {repo / rel: f"{workdir}/{rel}" for rel in protected}
    if copy_tree:
        return await _sandboxes().sandbox(repo, workdir, binds, channel, copy_tree=True)
    return await _sandboxes().sandbox(repo, workdir, binds, channel)


def _sandboxes() -> Sandboxes:
    return SANDBOXES.get(None) or LocalSandboxes()


async def apply(
    image: Path, repo: Path, sanitized: Sanitized, deadline: float, workdir: str
) -> tuple[str | None, str]:
    """Apply with each ``git apply`` in turn on a fresh copy of the base tree; (method, log), method None
    when none applied it."""
    trees.copy_tree(image, repo)
    if not sanitized.patch:
        return "empty", ""
    logs = []
    for attempt, (name, argv) in enumerate(APPLY_COMMANDS):
        if attempt:
            shutil.rmtree(repo)
            trees.copy_tree(image, repo)
        sandbox = await grading_sandbox(repo, workdir)
        env = BASE_ENV | {"HOME": sandbox.home}
        try:
            target = f"{sandbox.home}/{PATCH_NAME}"
            await sandbox.write_file(target, sanitized.patch)
            if name == "git-apply-3way":  # a copied index has stale stat data: "does not match index"
                await sandbox.run(REFRESH_INDEX, env, timeout=time_left(deadline))
            done = await sandbox.run([*argv, target], env, timeout=time_left(deadline))
        finally:
            await sandbox.close()
        logs.append(f"$ {name}: exit {done.exit_code}\n{done.stdout}{done.stderr}")
        if done.exit_code == 0 and not done.timed_out:
            return name, "".join(logs)
    return None, "".join(logs)


async def apply_test_patch(spec: GradingSpec, base: Path, repo: Path, deadline: float) -> str | None:
    """SWE-bench's order: the files ``test_patch`` touches go back to the base tree's (whatever the agent's
    patch did to them), then ``git apply`` puts the test patch on. Returns why it failed, or None."""
    assert spec.test_patch is not None
    for rel in spec.test_patch_files():
        if (base / rel).is_file() or (base / rel).is_symlink():
            trees.overlay(base, repo, [rel])
        elif (repo / rel).exists() or (repo / rel).is_symlink():
            trees.place_file(repo, rel, b"")
            (repo / rel).unlink()
    sandbox = await grading_sandbox(repo, spec.workdir)
    try:
        target = f"{sandbox.home}/test.patch"
        await sandbox.write_file(target, spec.test_patch.encode("utf-8", "surrogateescape"))
        env = BASE_ENV | {"HOME": sandbox.home}
        argv = ["git", "apply", "--whitespace=nowarn", target]
        done = await sandbox.run(argv, env, timeout=time_left(deadline))
    finally:
        await sandbox.close()
    if done.timed_out:
        raise TimeoutError
    return None if done.exit_code == 0 else f"git apply exit {done.exit_code}: {done.stderr.strip()[-500:]}"


def restore_git(base: Path, repo: Path) -> None:
    """Put the base tree's own ``.git`` back: the grader's git commands must read trusted config and refs
    only, and nothing but the base commit."""
    git = repo / ".git"
    if git.is_symlink() or git.is_file():
        git.unlink()
    elif git.exists():
        shutil.rmtree(git)
    if (base / ".git").is_dir():
        shutil.copytree(base / ".git", git, symlinks=True)


async def run_grader(
    spec: GradingSpec,
    repo: Path,
    eval_dir: Path,
    scratch: Path,
    deadline: float,
    readonly_tests: bool = True,
    known_files: set[str] | frozenset[str] = frozenset(),
    untouched: frozenset[str] | None = None,
    observe: bool = True,
    second: bool = True,
) -> tuple[Verdict, str]:
    """The row's one grader. The test sandbox mounts the row's test directories read-only: code under test
    that rewrites a test file not yet collected (or re-executes pytest on rewritten ones) fails to write.
    ``known_files``: files a reported test may also come from (:func:`untouched_python_files`);
    ``untouched``: the base tree's files the patch left as they were (what the audit hook sees them do is the
    repository's own behaviour; None: every file is taken as untouched); ``second``: a solved first run is
    checked by the second run (:mod:`.second_run`)."""
    grader = spec.grader
    if isinstance(grader, Swepro):
        shutil.copyfile(grader.run_script, eval_dir / "run_script.sh")
        shutil.copyfile(grader.parser_script, eval_dir / "parser.py")
    elif isinstance(grader, F2PScript):
        (eval_dir / "f2p.py").write_text(grader.script)
    canaries = place_plugins(eval_dir, observe)
    dirs = canary_dirs(repo, spec.test_files())
    protected = trees.protected_dirs(repo, spec.test_files()) if readonly_tests else []
    channel = _sandboxes().channel(channel_config(spec.workdir, canaries, dirs), scratch)
    try:
        sandbox = await grading_sandbox(repo, spec.workdir, eval_dir, protected, channel, copy_tree=True)
    except BaseException:
        channel.close()
        raise
    env = BASE_ENV | {"HOME": sandbox.home} | report_env(sandbox.workdir) | channel.env
    texts = []
    own_source = host_sources(repo)
    copied = bool(getattr(sandbox, "tree_copied", False))  # the tree is the sandbox's: read it there alone
    try:
        code_before = await tree_code_files(sandbox, repo) if second else {}
        if isinstance(grader, Swepro):
            outcome, log = await _run_swepro(
                spec, grader, sandbox, env, eval_dir, scratch, deadline, canaries, channel
            )
        else:
            outcome, log = await _run_command(spec, sandbox, env, deadline, canaries, channel, known_files)
        texts.append(channel.text)
        again = second and outcome.solved and bool(channel.text)
        after = await tree_code_files(sandbox, repo) if again or (copied and untouched is not None) else {}
        if copied:  # the run's own sources as the first run left them, listed before the copy is gone
            own_source = copied_sources(after)
        if again:
            outcome, more, text = await run_second(
                spec, sandbox, eval_dir, deadline, outcome, channel.text, canaries, observe,
                second_run.rewritten(code_before, after),
            )  # fmt: skip
            log, texts = log + more, [*texts, text]
    finally:
        channel.close()
        await sandbox.close()
    text = "\n".join(texts)
    return with_observed(outcome, text, sandbox.workdir, own_source, untouched, spec.test_files()), log


async def tree_code_files(sandbox: Any, repo: Path) -> Mapping[str, tuple[Any, ...]]:
    """The tree's code files and their state (:func:`.second_run.code_files`), read where the tree is: the
    sandbox's own capped copy through the sandbox (a container's: content digests), else the host's
    ``repo`` (inodes and change times)."""
    if getattr(sandbox, "tree_copied", False):
        return await sandbox.code_files()
    return second_run.code_files(repo)


def host_sources(repo: Path) -> Callable[[str], bool]:
    """Whether a repository path is a regular Python file of the tree on the host (links not followed)."""

    def own_source(rel: str) -> bool:
        path = repo / rel
        return rel.endswith(".py") and not path.is_symlink() and path.is_file()

    return own_source


def copied_sources(files: Mapping[str, tuple[Any, ...]]) -> Callable[[str], bool]:
    """:func:`host_sources` over the code files listed from a sandbox's copy of the tree."""
    return lambda rel: rel.endswith(".py") and files.get(rel, ("",))[0] == "file"


async def run_second(
    spec: GradingSpec,
    sandbox: BwrapSandbox,
    eval_dir: Path,
    deadline: float,
    first: Verdict,
    first_text: str,
    canaries: canary.Canaries,
    observe: bool = True,
    rewritten: Sequence[str] = (),
) -> tuple[Verdict, str, str]:
    """The second run of a first run that solved the row (:mod:`.second_run`): (the verdict both runs give,
    the second run's log, its report). ``rewritten``: code files the first run created or changed."""
    if rewritten:
        note = f"the first run rewrote code the second run would load: {list(rewritten)[:5]}"
        return dataclasses.replace(first, solved=False, failure_kind=verdict.TAMPERED, note=note), "", ""
    evidence = Evidence(0, tuple(report.parse(first_text)), canaries)
    grader = spec.grader
    names = grader.required if isinstance(grader, Swepro) else list(evidence.tests())
    required = second_run.required_tests(names, evidence.files_of)
    if isinstance(required, str):
        outcome = dataclasses.replace(first, solved=False, failure_kind=verdict.TESTS_FAILED, note=required)
        return outcome, "", ""
    log, texts, why = "", [], None
    for group in second_run.by_runner(required):  # one command per runner, each its own harness and socket
        harness, socket_path = second_run.place(eval_dir, EVAL_DIR, sandbox.workdir, observe)
        sink = ReportListener(socket_path)
        try:
            env = BASE_ENV | {"HOME": sandbox.home} | second_run.env(harness)
            command = shell(spec, second_run.command(harness, group, second_run.launch_of(row_command(spec))))
            ran = await sandbox.run(command, env, timeout=time_left(deadline))
            texts.append(sink.collect())
        finally:
            sink.close()
        log += f"\n$ second run\n{ran.stdout}{ran.stderr}"
        if ran.timed_out:
            raise TimeoutError
        if limit := sandbox_failure(ran):
            note = f"the second run hit a sandbox limit: {limit}"
            return Verdict(False, limit, first.tests, note), log, "\n".join(texts)
        if why := second_run.judge(texts[-1], ran.exit_code, group):
            break
    text = "\n".join(texts)
    if why is None:
        return first, log, text
    seen = second_run.statuses(texts[-1], required)  # each test's worse status of the two runs
    tests = tuple(
        t if seen.get(t.name, verdict.PASSED) == verdict.PASSED else verdict.TestResult(t.name, seen[t.name])
        for t in first.tests
    )
    outcome = dataclasses.replace(first, solved=False, failure_kind=verdict.TESTS_FAILED, note=why)
    return dataclasses.replace(outcome, tests=tests), log, text


def row_command(spec: GradingSpec) -> str:
    """The text that says how the row starts its tests: its eval command, its run script; an F2P script is
    Python run by ``python3``."""
    grader = spec.grader
    if isinstance(grader, EvalCmd):
        return grader.cmd
    if isinstance(grader, Swepro):
        return grader.run_script.read_text(errors="replace")
    return ""


def with_observed(
    outcome: Verdict,
    text: str,
    workdir: str,
    own_source: Callable[[str], bool],
    untouched: frozenset[str] | None,
    test_files: set[str],
) -> Verdict:
    """``outcome`` with the flags of what the changed code did while it ran (:mod:`.observed`);
    ``own_source``: whether a repository path is a Python file of the tree after the run."""
    if untouched is None:
        return outcome

    events = report.audit(text)
    raised, seen = observed.runtime_flags(events, workdir, untouched.__contains__, own_source, test_files)
    if observed.expects_wildcard(events, workdir, untouched.__contains__):
        outcome = dataclasses.replace(outcome, wildcard_expected=True)
    if not raised:
        return outcome
    return dataclasses.replace(outcome, flags=tuple(sorted({*outcome.flags, *raised})), observed=tuple(seen))


def place_plugins(eval_dir: Path, observe: bool = True) -> canary.Canaries:
    """The grader's pytest plugin, unittest runner, channel and (``observe``) audit hook under ``/eval``; the
    grade's fresh canaries."""
    plugins = eval_dir / "plugins"
    plugins.mkdir()
    here = Path(__file__).resolve().parent
    for name, source in PLUGIN_SOURCES.items():
        if observe or name != "sitecustomize.py":
            shutil.copyfile(here / source, plugins / name)
    return canary.make()


def canary_dirs(repo: Path, test_files: set[str]) -> list[str]:
    """Every directory that holds a row test file (the repository's root when none does): the canaries are
    modules of these directories, so the same ``conftest.py`` files apply to canaries and tests and a
    forger scoped to the tests' directory forges the canaries too. Repository-relative."""
    dirs = set()
    for rel in test_files:
        parent = PurePosixPath(rel).parent
        path = repo / parent
        if ".." in parent.parts or parent.is_absolute():
            continue
        if path.is_dir() and not any(p.is_symlink() for p in [path, *path.parents] if p.is_relative_to(repo)):
            dirs.add(str(parent))
    return sorted(dirs or {"."})


def channel_config(workdir: str, canaries: canary.Canaries, dirs: Sequence[str]) -> dict[str, Any]:
    """What the grader's plugin reads out of its channel: the canaries' source, module name and directories
    (absolute in the sandbox; no file of them is written), and which canaries must fail."""
    absolute = [str(PurePosixPath(workdir) / d) if d != "." else workdir for d in dirs]
    return {
        "canaries": {"module": canaries.module, "source": canaries.source, "dirs": absolute},
        "must_fail": list(canaries.must_fail),
    }


def report_env(workdir: str) -> dict[str, str]:
    """What loads the grader's plugin into every pytest run (``-p``; the plugin directory on ``PYTHONPATH``:
    a row's pre-commands that set ``PYTHONPATH`` must keep it). Nothing secret: where the report goes and
    what the canaries are travel through the channel (:mod:`rollbus.grading.channel`)."""
    return {"PYTHONPATH": PLUGIN_DIR, "PYTEST_ADDOPTS": "-p rollbus_report", "ROLLBUS_AUDIT_ROOT": workdir}


def with_unittest_runner(command: str) -> str:
    """``python3 -m unittest ARGS`` as the grader's runner (same arguments, canaries added, reporting)."""
    return UNITTEST_MODULE.sub(f"{PLUGIN_DIR}/rollbus_unittest.py", command)


def evidence_of(ran: Completed, channel: ReportChannel, canaries: canary.Canaries) -> Evidence:
    text = channel.collect()
    if not text:
        return Evidence(ran.exit_code, (), canaries)
    try:
        test_runs = tuple(report.parse(text))
    except ValueError as exc:
        return Evidence(ran.exit_code, (), canaries, str(exc))
    return Evidence(ran.exit_code, test_runs, canaries)


async def _run_swepro(
    spec: GradingSpec,
    grader: Swepro,
    sandbox: BwrapSandbox,
    env: Mapping[str, str],
    eval_dir: Path,
    scratch: Path,
    deadline: float,
    canaries: canary.Canaries,
    channel: ReportChannel,
) -> tuple[Verdict, str]:
    files = shlex.quote(",".join(grader.selected_test_files))
    command = shell(spec, f"bash {EVAL_DIR}/run_script.sh {files}")
    ran = await sandbox.run(command, env, timeout=time_left(deadline), pass_fds=channel.fds)
    log = ran.stdout + ran.stderr
    if ran.timed_out:
        raise TimeoutError
    if limit := sandbox_failure(ran):
        return Verdict(False, limit, (), f"the tests hit a sandbox limit: {limit}"), log
    found = evidence_of(ran, channel, canaries)
    evidence: Evidence | None = found
    if not found.test_runs and not verdict.runs_pytest(grader.run_script.read_text(errors="replace")):
        evidence = None  # no pytest (a Go or JavaScript row): the parser's reading of the log alone
    return await parse_swepro(grader, ran, eval_dir, scratch, deadline, evidence, sandbox.workdir), log


async def _run_command(
    spec: GradingSpec,
    sandbox: BwrapSandbox,
    env: Mapping[str, str],
    deadline: float,
    canaries: canary.Canaries,
    channel: ReportChannel,
    known_files: set[str] | frozenset[str] = frozenset(),
) -> tuple[Verdict, str]:
    """eval_cmd or f2p_script, every pytest run carrying the grader's plugin, ``-m unittest`` run by the
    grader's runner, and the verdict read from their report. A reported test must come from a file the row
    names or from ``known_files`` (the row names none: no such check)."""
    grader = spec.grader
    assert isinstance(grader, EvalCmd | F2PScript)
    command = (
        with_unittest_runner(grader.cmd) if isinstance(grader, EvalCmd) else f"python3 {EVAL_DIR}/f2p.py"
    )
    text = grader.cmd if isinstance(grader, EvalCmd) else grader.script
    ran = await sandbox.run(shell(spec, command), env, timeout=time_left(deadline), pass_fds=channel.fds)
    log = ran.stdout + ran.stderr
    if ran.timed_out:
        raise TimeoutError
    if limit := sandbox_failure(ran):
        return Verdict(False, limit, (), f"the tests hit a sandbox limit: {limit}"), log
    evidence = evidence_of(ran, channel, canaries)
    named = spec.test_files()
    watched = verdict.runs_pytest(text) or (command != grader.cmd if isinstance(grader, EvalCmd) else False)
    outcome = verdict.command_outcome(
        evidence,
        log,
        runner_expected=watched,
        unittest_output=verdict.runs_unittest(text),
        expected_files=sorted(named | known_files) if named else [],
        required_files=sorted(f for f in named if TEST_FILE.fullmatch(PurePosixPath(f).name)),
        workdir=sandbox.workdir,
    )
    return outcome, log


async def parse_swepro(
    grader: Swepro,
    ran: Completed,
    eval_dir: Path,
    scratch: Path,
    deadline: float,
    evidence: Evidence | None = None,
    workdir: str = "/workspace",
) -> Verdict:
    """Run the row's parser over the logs in a sandbox of its own (nothing of the tested code is there)."""
    if ran.timed_out:
        raise TimeoutError
    logs = scratch / "logs"
    logs.mkdir()
    (logs / "stdout.log").write_text(ran.stdout)
    (logs / "stderr.log").write_text(ran.stderr)
    sandbox = await grading_sandbox(logs, "/workspace", eval_dir)
    try:
        w = sandbox.workdir
        argv = [
            "python3",
            "-I",
            f"{EVAL_DIR}/parser.py",
            f"{w}/stdout.log",
            f"{w}/stderr.log",
            f"{w}/output.json",
        ]
        parsed = await sandbox.run(argv, BASE_ENV | {"HOME": sandbox.home}, timeout=time_left(deadline))
        output = await _read_optional(sandbox, f"{w}/output.json")
    finally:
        await sandbox.close()
    if parsed.timed_out:
        raise TimeoutError
    if parsed.exit_code != 0 or output is None:
        return Verdict(
            False, verdict.PARSER_FAILED, (), f"parser exit {parsed.exit_code}: {parsed.stderr[-500:]}"
        )
    try:
        reported = verdict.parse_parser_output(output)
    except ValueError as exc:
        return Verdict(False, verdict.PARSER_FAILED, (), str(exc))
    return verdict.swepro_outcome(
        reported,
        grader.required,
        evidence=evidence,
        selected_files=grader.selected_test_files,
        workdir=workdir,
    )


def sandbox_failure(done: Completed) -> str | None:
    """The limit a command hit (memory, processes, disk, output), as the hardened sandbox names it."""
    kind = getattr(done, "failure_kind", None)
    return None if kind in (None, "timeout") else str(kind)


def shell(spec: GradingSpec, command: str) -> list[str]:
    """``command`` in bash, after the row's ``pre_commands`` (environment set-up shares its shell)."""
    return ["bash", "-c", "\n".join([*spec.pre_commands, command])]


async def _read_optional(sandbox: BwrapSandbox, path: str) -> str | None:
    try:
        data = await sandbox.read_file(path)
    except (OSError, ValueError):
        return None
    return data[: verdict.MAX_REPORT_BYTES + 1].decode("utf-8", errors="replace")


def time_left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def log_excerpt(text: str, limit: int) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def grade_sync(spec: GradingSpec, patch: bytes | str, config: GradeConfig | None = None) -> GradeResult:
    return asyncio.run(grade(spec, patch, config))
