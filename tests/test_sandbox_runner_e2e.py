"""The sandbox runner end to end: rows submitted with `rollbus submit`, the runner service consuming `tasks`,
the real Claude Code CLI in bwrap against the real adapter and the scripted engine, `diffs` on a real broker.

Each row's instance id picks its script (the engine's ``--script DIR``), so one engine serves every task:
a fix, an agent that never edits, one that kills its own CLI, one that sleeps past its budget, and an image
that does not exist. A second test kills a runner with ``kill -9`` mid-rollout: the task completes as a new
attempt on the next runner, with the killed attempt's sandbox gone, the grader service rewards it, and a real
segmenter (Faust worker) trains that attempt alone (it runs on the adapter's namespace, where no other test
submits tasks). Then every swe-mini task, solved by its
script and graded 1 by the grader service, and the two scripts that fail on purpose, graded 0.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollbus.grading.rows import absolute_paths
from rollbus.kafka.bus import Publisher
from rollbus.kafka.topics import create_topics, topic_name
from rollbus.rows import RowKeys, parse_row, tasks_for
from rollbus.sandbox.bwrap_host import SCRATCH_ROOT
from rollbus.services.sandbox_runner.main import run_one
from rollbus.services.sandbox_runner.settings import RunnerSettings
from tests.conftest import TEST_PARTITIONS
from tests.e2e_support import EXAMPLES, SCRIPTS, Rig, rollout_events
from tests.runner_support import (
    FIXED_LINE,
    RUNNER_SCRIPTS,
    RunnerProcess,
    all_events,
    build_calc_image,
    calc_row,
    committed_all,
    container_task,
    scripts_dir,
    submit,
    wait_for,
    write_dataset,
)
from tests.segmenter_support import SegmenterProcess
from tests.waiting import until

pytestmark = pytest.mark.kafka

BUDGET_S = 120  # the runner's agent budget; honest rollouts end well before it, even on a loaded machine
HANG_BUDGET_S = 30  # the hanging agent's, on a runner of its own (waiting out 120 s cost every CI run 90 s)
FAILING = ("swe-mini__sum-to", "swe-mini__binsearch")  # examples/swe-mini/scripts-failing
SCRIPTS_BY_TASK = {
    "calc-fix": SCRIPTS / "fix_calc.json",
    "calc-noedit": RUNNER_SCRIPTS / "never_edits.json",
    "calc-crash": RUNNER_SCRIPTS / "crash.json",
    "calc-hang": RUNNER_SCRIPTS / "hang.json",
    "calc-slow": RUNNER_SCRIPTS / "slow_fix.json",
    "calc-hog": RUNNER_SCRIPTS / "memory_hog.json",
    "calc-bloat": RUNNER_SCRIPTS / "workspace_bloat.json",
}


def peak_rss(runner: RunnerProcess) -> int:
    """The runner process's peak resident set so far (VmHWM), in bytes."""
    assert runner.proc is not None
    for line in Path(f"/proc/{runner.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM for the runner")


async def new_namespace(bootstrap: str) -> str:
    name = f"runner-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, TEST_PARTITIONS, name)
    return name


@pytest.fixture(scope="module")
def rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Adapter and one scripted engine replaying every task's own script."""
    work = tmp_path_factory.mktemp("runner-services")
    namespace = asyncio.run(new_namespace(kafka_bootstrap))
    rig = Rig(kafka_bootstrap, namespace, work)
    rig.start()
    rig.use_script(scripts_dir(work / "scripts", SCRIPTS_BY_TASK))
    try:
        yield rig
    finally:
        rig.stop()


def by_instance(diffs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for records in diffs.values():
        for record in records:
            grouped.setdefault(json.loads(record["task_metadata"])["instance_id"], []).append(record)
    return grouped


async def test_rows_to_diffs_with_named_failures(rig: Rig, tmp_path: Path, data_dir: Path) -> None:
    namespace = await new_namespace(rig.bootstrap)
    dataset = write_dataset(data_dir / "tasks.jsonl", [
        calc_row("calc-noedit"), calc_row("calc-crash"), "{not json",
        calc_row("calc-gone", image="no_such_image"), calc_row("calc-hog"), calc_row("calc-bloat"),
    ])  # fmt: skip
    submitted = submit(rig.bootstrap, namespace, dataset)
    assert submitted.returncode == 1, submitted.stderr  # one row was bad, the others went out
    assert f"{dataset}:3: invalid JSON" in submitted.stderr
    assert "submitted 5 tasks (5 rows x 1 samples)" in submitted.stdout
    fixes = write_dataset(data_dir / "fix.jsonl", [calc_row("calc-fix", label="range(1, n + 1)")])
    assert submit(rig.bootstrap, namespace, fixes, "--n-samples-per-prompt", "2").returncode == 0
    tasks = await all_events(rig.bootstrap, namespace, "tasks")
    gym = {**tasks[0], "rollout_id": "gym-task-0", "env_config": json.dumps({"env": "frozen_lake"})}
    async with Publisher(rig.bootstrap) as publisher:
        await publisher.publish(topic_name("tasks", namespace), gym)

    hang_namespace = await new_namespace(rig.bootstrap)  # its own runner and group: its own, shorter budget
    hangs = write_dataset(data_dir / "hang.jsonl", [calc_row("calc-hang")])
    assert submit(rig.bootstrap, hang_namespace, hangs).returncode == 0
    (hang_task,) = await all_events(rig.bootstrap, hang_namespace, "tasks")

    runner = RunnerProcess(rig, namespace, tmp_path / "runner", "--concurrency", "6", "--memory-mb", "1024",
                           "--agent-timeout", str(BUDGET_S), "--boot-backoff", "0.1",
                           "--infra-retries", "0").start()  # re-runs: test_sandbox_runner_rerun  # fmt: skip
    hang_runner = RunnerProcess(rig, hang_namespace, tmp_path / "hang-runner", "--consumer-group", "hang",
                                "--agent-timeout", str(HANG_BUDGET_S), name="hang").start()  # fmt: skip
    try:
        diffs = await wait_for(rig.bootstrap, namespace, "diffs", {t["rollout_id"] for t in tasks}, 400)
        hung = await wait_for(rig.bootstrap, hang_namespace, "diffs", {hang_task["rollout_id"]}, 300)
        # a runner commits a task's offset only after its diff is out, so once both groups have committed
        # every task (the gym task too), any (wrong) diff of the gym task would already be on the topic
        runner_group = "rollbus-sandbox-runner"
        await until(lambda: committed_all(rig.bootstrap, namespace, runner_group), "the runner's commits",
                    timeout=120, interval=0.5, log=runner.log)  # fmt: skip
        await until(lambda: committed_all(rig.bootstrap, hang_namespace, "hang"), "the hang runner's commits",
                    timeout=120, interval=0.5, log=hang_runner.log)  # fmt: skip
        peak = peak_rss(runner)
    finally:
        runner.stop()
        hang_runner.stop()
    diffs.update(hung)
    every = await all_events(rig.bootstrap, namespace, "diffs")
    assert len(await all_events(rig.bootstrap, hang_namespace, "diffs")) == 1, "one diff for the hung task"
    every += hung[hang_task["rollout_id"]]
    tasks.append(hang_task)
    assert "gym-task-0" not in {d["rollout_id"] for d in every}, "gym tasks belong to the gym runner"
    assert len(every) == len(tasks), "one diff per task, no duplicates"
    got = by_instance(diffs)
    expected = {
        "calc-fix": 2,
        "calc-noedit": 1,
        "calc-crash": 1,
        "calc-hang": 1,
        "calc-gone": 1,
        "calc-hog": 1,
        "calc-bloat": 1,
    }
    assert {i: len(r) for i, r in got.items()} == expected
    group = got["calc-fix"]
    assert group[0]["group_id"] == group[1]["group_id"] and {r["group_size"] for r in group} == {2}
    assert len({d["attempt_id"] for d in every}) == len(every) and all(d["attempt_id"] for d in every)
    for fixed in got["calc-fix"]:
        assert fixed["failure_kind"] is None and fixed["exit_status"] == 0, runner.log()[-3000:]
        assert FIXED_LINE.encode() in fixed["patch"] and fixed["turns"] == 3
        assert fixed["label"] == "range(1, n + 1)" and not fixed["patch_truncated"]
        assert json.loads(fixed["task_metadata"])["eval_cmd"] == "python3 -m unittest -q"
    assert {(d["failure_kind"], d["patch"]) for d in got["calc-noedit"]} == {(None, b"")}
    assert {d["failure_kind"] for d in got["calc-crash"]} == {"agent_crashed"}
    assert all(d["exit_status"] != 0 for d in got["calc-crash"])
    assert {d["failure_kind"] for d in got["calc-hang"]} == {"timeout"}
    assert all(HANG_BUDGET_S <= d["wall_time_s"] < HANG_BUDGET_S + 30 for d in got["calc-hang"])
    assert {d["failure_kind"] for d in got["calc-gone"]} == {"boot_failed"}
    assert all("no_such_image" in d["error"] for d in got["calc-gone"])
    assert {d["failure_kind"] for d in got["calc-hog"]} == {"memory_limit"}
    # 200 MB of random bytes in the workspace: its patch is named and capped, and the runner that took it is
    # alive and small (the host-side capture before took ~4 bytes of RSS per byte of such data)
    (bloat,) = got["calc-bloat"]
    assert bloat["failure_kind"] in ("patch_too_large", "patch_failed"), bloat["error"]
    assert len(bloat["patch"]) <= 2 * 2**20 and bloat["exit_status"] == 0
    assert peak < 400 * 2**20, f"the runner's peak RSS was {peak >> 20} MiB"
    left = [p.name for p in SCRATCH_ROOT.iterdir() if any(d["attempt_id"] in p.name for d in every)]
    assert not left, "every attempt's sandbox was removed"


async def test_runner_killed_mid_rollout_reruns_the_task_and_only_the_rewarded_attempt_trains(
    rig: Rig, tmp_path: Path, data_dir: Path
) -> None:
    """The first runner is killed -9 once its attempt has a turn on the bus; a second runner re-runs the task
    as a new attempt, the grader rewards it, and a real segmenter cuts segments of that attempt only.

    Everything runs on the adapter's namespace, so turns, sessions, diffs and rewards are co-partitioned for
    the segmenter (as in production). The engine's cursor is per rollout, so the second attempt carries on
    with the script's next turn (Read, Edit, answer) where a policy would start over: what is checked is
    which attempt each event names, not what the attempts say."""
    rig.use_script(rig.log_dir / "scripts")
    namespace = rig.namespace
    dataset = write_dataset(data_dir / "slow.jsonl", [calc_row("calc-slow")])
    assert submit(rig.bootstrap, namespace, dataset).returncode == 0
    (task,) = await all_events(rig.bootstrap, namespace, "tasks")
    rollout_id = task["rollout_id"]
    segmenter = SegmenterProcess(rig.bootstrap, namespace, tmp_path / "segmenter").start()  # starts meanwhile
    grader = RunnerProcess.grader(rig.bootstrap, namespace, tmp_path / "grader").start()
    first = RunnerProcess(rig, namespace, tmp_path / "first", name="first").start()
    try:  # the first attempt is inside its 90 s sleep once its first turn is on the bus
        early = await wait_for(rig.bootstrap, namespace, "turns", {rollout_id}, 180)
        await asyncio.sleep(2)
        started = first.kill9()
    finally:
        first.stop()
    (killed,) = {t["attempt_id"] for t in early[rollout_id]}
    # the premise: killed inside the sleep, so the engine's cursor stands at the script's Read (were it past
    # it, the second attempt would Edit an unread file, which the CLI refuses, and be graded 0 for that)
    turns = await all_events(rig.bootstrap, namespace, "turns")
    turns_before = [t for t in turns if t["rollout_id"] == rollout_id]
    assert len(turns_before) == 1, "the first attempt was killed inside its sleep, after exactly one turn"
    assert started, "the first runner had its sandbox running"
    assert not survivors(started), "the killed runner's sandbox died with it"
    second = RunnerProcess(rig, namespace, tmp_path / "second", name="second").start()
    try:
        diffs = await wait_for(rig.bootstrap, namespace, "diffs", {rollout_id}, 300)
        rewards = await wait_for(rig.bootstrap, namespace, "rewards", {rollout_id}, 180)
        segments = await wait_for(rig.bootstrap, namespace, "segments", {rollout_id}, 120)
        runner_group = "rollbus-sandbox-runner"
        await until(lambda: committed_all(rig.bootstrap, namespace, runner_group), "the re-run's commit",
                    timeout=120, interval=0.5, log=second.log)  # fmt: skip
    except TimeoutError:
        raise AssertionError(f"{grader.log()[-2000:]}\n{segmenter.log()[-4000:]}") from None
    finally:
        second.stop()
        grader.stop()
        segmenter.stop()
    (diff,) = diffs[rollout_id]
    assert diff["failure_kind"] is None and FIXED_LINE.encode() in diff["patch"], second.log()[-3000:]
    assert len(await all_events(rig.bootstrap, namespace, "diffs")) == 1, (
        "the killed attempt published nothing"
    )
    assert "rollout" in second.log() and "attempt" in second.log()
    rewarded = diff["attempt_id"]
    assert rewarded != killed, "the re-run is a new attempt"
    (reward,) = rewards[rollout_id]
    assert (reward["attempt_id"], reward["reward"], reward["solved"]) == (rewarded, 1.0, True), reward
    await only_the_rewarded_attempt_trains(rig, rollout_id, killed, diff, segments[rollout_id][0])


async def only_the_rewarded_attempt_trains(
    rig: Rig, rollout_id: str, killed: str, diff: dict, first_segment: dict
) -> None:
    """Both attempts are on `turns` and were closed on `sessions`; every segment is the rewarded one's."""
    rewarded = diff["attempt_id"]
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", rollout_id)
    per_attempt = {a: sum(t["attempt_id"] == a for t in turns) for a in {t["attempt_id"] for t in turns}}
    assert per_attempt == {killed: per_attempt.get(killed), rewarded: diff["turns"]} and per_attempt[killed]
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", rollout_id)
    closed = {s["attempt_id"] for s in sessions if s["kind"] == "closed"}
    assert closed == {killed, rewarded}, "opening the new attempt closed what the killed one left open"
    every = [
        s for s in await all_events(rig.bootstrap, rig.namespace, "segments") if s["rollout_id"] == rollout_id
    ]
    assert every and len({s["segment_id"] for s in every}) == first_segment["num_segments"]
    assert {s["attempt_id"] for s in every} == {rewarded}, "no segment of the killed attempt"
    assert all(s["segment_id"].startswith(f"{rollout_id}/{rewarded}/") for s in every)
    assert {s["trajectory_reward"] for s in every} == {1.0}
    letters = await all_events(rig.bootstrap, rig.namespace, "dead-letters")
    assert not [d for d in letters if rollout_id in str(d.get("error"))], letters


async def test_run_one_task_without_the_bus_is_what_the_demo_calls(rig: Rig, data_dir: Path) -> None:
    """``run_one``: one `tasks` record in, its `diffs` record out (nothing published, nothing consumed)."""
    rig.use_script(rig.log_dir / "scripts")
    row = parse_row(json.dumps(calc_row("calc-fix")), 1, RowKeys(), data_dir)
    (task,) = tasks_for(row, 1)
    settings = RunnerSettings.load({"adapter_url": rig.url, "admin_token": rig.admin_token})
    diff = await run_one(settings, task)
    assert diff["rollout_id"] == task["rollout_id"] and diff["failure_kind"] is None, diff["error"]
    assert FIXED_LINE.encode() in diff["patch"] and diff["attempt_id"].startswith("att-")


def survivors(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still alive 10 s later (zombies count as gone)."""
    deadline = time.monotonic() + 10
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A dataset directory holding its image: rows name it by a relative path, as users write them."""
    shutil.copytree(EXAMPLES / "buggy_repo", tmp_path / "data" / "buggy_repo")
    return tmp_path / "data"


# --- swe-mini: every task solved by its script and graded 1; two scripts that fail on purpose graded 0 ------

SWE_MINI = EXAMPLES / "swe-mini"


@pytest.fixture(scope="module")
def swe_mini_rows() -> list[dict]:
    """The dataset's rows with absolute paths (the images built first, as `make` does)."""
    built = subprocess.run([sys.executable, str(SWE_MINI / "build.py")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    rows = [json.loads(line) for line in (SWE_MINI / "tasks.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        row["metadata"] = absolute_paths(row["metadata"], SWE_MINI)
    return rows


async def run_and_grade(rig: Rig, tmp_path: Path, rows: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Submit ``rows``; the runner and the grader service on their topics; instance -> (diff, reward)."""
    namespace = await new_namespace(rig.bootstrap)
    dataset = write_dataset(tmp_path / "rows.jsonl", rows)
    assert submit(rig.bootstrap, namespace, dataset).returncode == 0
    tasks = await all_events(rig.bootstrap, namespace, "tasks")
    runner = RunnerProcess(rig, namespace, tmp_path / "runner", "--concurrency", "3").start()
    grader = RunnerProcess.grader(rig.bootstrap, namespace, tmp_path / "grader").start()
    try:
        ids = {t["rollout_id"] for t in tasks}
        rewards = await wait_for(rig.bootstrap, namespace, "rewards", ids, 900)
    finally:
        runner.stop()
        grader.stop()
    diffs = await wait_for(rig.bootstrap, namespace, "diffs", ids, 30)
    graded = {}
    for rollout_id, (diff,) in diffs.items():
        (reward,) = rewards[rollout_id]
        instance = json.loads(diff["task_metadata"])["instance_id"]
        assert diff["failure_kind"] is None, (instance, diff["error"], runner.log()[-2000:])
        assert reward["attempt_id"] == diff["attempt_id"], "the reward names the attempt it graded"
        graded[instance] = (diff, reward)
    return graded


async def test_swe_mini_every_task_solved_through_the_cli(
    rig: Rig, tmp_path: Path, swe_mini_rows: list[dict]
) -> None:
    rig.use_script(SWE_MINI / "scripts")
    graded = await run_and_grade(rig, tmp_path, swe_mini_rows)
    assert len(graded) == len(swe_mini_rows) == 10
    for instance, (diff, reward) in graded.items():
        assert diff["turns"] == 3, instance
        assert (reward["reward"], reward["solved"], reward["flags"]) == (1.0, True, []), (instance, reward)


async def test_swe_mini_scripts_that_fail_on_purpose_score_zero(
    rig: Rig, tmp_path: Path, swe_mini_rows: list[dict]
) -> None:
    rig.use_script(SWE_MINI / "scripts-failing")
    failing = [r for r in swe_mini_rows if r["metadata"]["instance_id"] in FAILING]
    graded = await run_and_grade(rig, tmp_path, failing)
    assert set(graded) == set(FAILING)
    wrong, _ = graded["swe-mini__sum-to"]
    assert b"+    return sum(range(0, n))" in wrong["patch"]
    deleted, _ = graded["swe-mini__binsearch"]
    assert b"deleted file mode" in deleted["patch"]
    assert {i: r["reward"] for i, (_, r) in graded.items()} == {i: 0.0 for i in FAILING}
    assert graded["swe-mini__binsearch"][1]["flags"], "deleting the tests is flagged, not just failed"


# --- the container backend: the same runner with --backend docker, the CLI mounted into an image ----------


@pytest.fixture(scope="module")
def calc_image() -> str:
    return build_calc_image()


@pytest.mark.docker
async def test_with_backend_docker_the_real_cli_fixes_the_task_in_a_container_of_its_image(
    rig: Rig, calc_image: str, data_dir: Path, tmp_path: Path
) -> None:
    """The real Claude Code CLI (the cached binary, mounted read-only) in a container of the task's image,
    the real adapter, the patch taken inside; an agent that never edits returns an empty patch; nothing of
    either sandbox is left on the host."""
    rig.use_script(rig.log_dir / "scripts")
    options = {"adapter_url": rig.url, "admin_token": rig.admin_token, "backend": "docker"}
    settings = RunnerSettings.load({**options, "sandbox_root": tmp_path / "sandboxes"})
    fixed = await run_one(settings, container_task(calc_image, "calc-fix", data_dir))
    assert fixed["failure_kind"] is None, fixed["error"]
    assert FIXED_LINE.encode() in fixed["patch"] and b"test_calc.py" not in fixed["patch"]
    idle = await run_one(settings, container_task(calc_image, "calc-noedit", data_dir))
    assert idle["failure_kind"] is None and idle["patch"] == b"", idle["error"]
    assert not list((tmp_path / "sandboxes").glob("*.docker"))


# --- a SWE-bench-shaped task in its own image: submit's reader, the CLI in docker, the grade in docker -----

SWEBENCH_IMAGE = "rollbus-test/swebench-buggy:1"
# the repository at /testbed at its base commit (its fix on a later branch, never seen in a sandbox), its own
# Python environment first on PATH, as SWE-bench images keep theirs in conda
SWEBENCH_DOCKERFILE = """FROM {base}
RUN python3 -m venv --without-pip --system-site-packages /opt/testbed
ENV PATH=/opt/testbed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY repo /testbed
WORKDIR /testbed
"""
HIDDEN_TEST = (
    "import unittest\n\nfrom calc import sum_to\n\n\nclass HiddenTest(unittest.TestCase):\n"
    "    def test_five(self) -> None:\n        self.assertEqual(sum_to(5), 15)\n"
)


@pytest.fixture(scope="module")
def swebench_row(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A SWE-bench row (as published, plus its image's name) over ``examples/buggy_repo``, its image built
    from the base image (cached by the engine: built once per machine)."""
    from rollbus.sandbox import docker_engine, docker_images
    from tests.test_validate import git

    root = tmp_path_factory.mktemp("swebench")
    repo = root / "context" / "repo"
    shutil.copytree(EXAMPLES / "buggy_repo", repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD")
    calc = (repo / "calc.py").read_text()
    (repo / "calc.py").write_text(calc.replace("range(1, n))", "range(1, n + 1))"))
    gold = git(repo, "diff") + "\n"
    (repo / "test_hidden.py").write_text(HIDDEN_TEST)
    git(repo, "add", "-N", "test_hidden.py")
    test_patch = git(repo, "diff", "--", "test_hidden.py") + "\n"
    git(repo, "checkout", "-q", "-b", "fix")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the fix")
    git(repo, "checkout", "-q", "main")
    client = docker_engine.client()
    dockerfile = SWEBENCH_DOCKERFILE.format(base=docker_images.ensure_base_image(client))
    (root / "context" / "Dockerfile").write_text(dockerfile)
    client.images.build(path=str(root / "context"), tag=SWEBENCH_IMAGE, rm=True, network_mode="none")
    return {
        "instance_id": "local__buggy-1", "repo": "local/buggy", "base_commit": base, "patch": gold,
        "test_patch": test_patch, "problem_statement": "sum_to(n) leaves n out of the sum.",
        "image_name": SWEBENCH_IMAGE, "FAIL_TO_PASS": json.dumps(["test_hidden.py::HiddenTest::test_five"]),
        "PASS_TO_PASS": json.dumps(["test_calc.py::SumToTest::test_below_one"]), "version": "1.0",
    }  # fmt: skip


@pytest.mark.docker
async def test_a_swebench_task_in_its_image_is_solved_by_the_cli_and_graded_in_its_container(
    rig: Rig, swebench_row: dict, tmp_path: Path
) -> None:
    """The row read by ``rollbus submit``'s SWE-bench reader; the real CLI in a container of its image fixes
    /testbed; the grader grades the diff in a fresh container of the digest the agent ran: the fix 1, the
    empty patch 0."""
    from rollbus.grading import GradeConfig
    from rollbus.rows import Row, read_dataset
    from rollbus.services.grader.core import grade_diff

    dataset = write_dataset(tmp_path / "swebench.jsonl", [swebench_row])
    [row] = [r for r in read_dataset(dataset, RowKeys(), "swebench") if isinstance(r, Row)]
    assert row.metadata["source"]["format"] == "swebench" and row.metadata["workdir"] == "/testbed"
    script = json.loads((SCRIPTS / "fix_calc.json").read_text().replace("/workspace/", "/testbed/"))
    scripts = rig.log_dir / "scripts-swebench"
    scripts.mkdir(exist_ok=True)
    (scripts / f"{row.instance_id}.json").write_text(json.dumps(script))
    rig.use_script(scripts)
    options = {"adapter_url": rig.url, "admin_token": rig.admin_token, "backend": "docker"}
    settings = RunnerSettings.load({**options, "sandbox_root": tmp_path / "sandboxes"})
    (task,) = tasks_for(row, 1)
    diff = await run_one(settings, task)
    assert diff["failure_kind"] is None and FIXED_LINE.encode() in diff["patch"], diff["error"]
    assert str(diff["image_digest"]).startswith("sha256:")
    config = GradeConfig(backend="docker")
    fixed = await grade_diff(diff, dataset.parent, config)
    assert (fixed.reward, fixed.failure_kind) == (1.0, None), fixed
    assert fixed.details["image_digest"] == diff["image_digest"]  # the bytes the agent ran
    empty = await grade_diff({**diff, "patch": b""}, dataset.parent, config)
    assert (empty.reward, empty.failure_kind) == (0.0, "tests_failed"), empty
