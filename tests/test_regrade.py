"""``rollbus regrade`` over a real broker: a log graded by a deliberately weakened grader, regraded.

The weakness is the test's: a stub grader that says every patch solves its task (the service's own reward
record, with reward 1 and no flags), standing in for any grader bug that let rewards through. The regrade runs
the real current grader in real sandboxes on the swe-mini tasks, and must name every flipped reward, under the
policy version of the attempt, with the flags the real grader raises; bad diffs are problem lines naming their
place in the log, and everything else is still regraded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from rollbus.codec import Decoded, encode
from rollbus.events import DiffEvent
from rollbus.grading import GradeResult
from rollbus.kafka.bus import Publisher
from rollbus.kafka.replay import ReadPlan, read
from rollbus.services.grader import regrade as regrade_module
from rollbus.services.grader.core import reward_record
from tests.event_samples import SAMPLES, turn
from tests.test_grading_swe_mini import CHEATS, CORPUS, SWE_MINI, load_build

pytestmark = pytest.mark.kafka

ALWAYS_SOLVED = GradeResult(reward=1.0, solved=True, applied_cleanly=True, failure_kind=None)
CHEAT = next(c for c in CORPUS if c["name"] == "conftest_passes_everything")


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def diff(rollout_id: str, attempt_id: str, row: dict[str, Any], patch: bytes) -> dict[str, Any]:
    """A diff event as the runner publishes it (schema v3: the patch is the bytes git wrote)."""
    return {
        **SAMPLES["diff"], "rollout_id": rollout_id, "attempt_id": attempt_id, "patch": patch,
        "task_metadata": json.dumps(row["metadata"]), "label": row["label"],
    }  # fmt: skip


def regrade(bootstrap: str, ns: str, into: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbus", "regrade", "--into", into, "--json", "--concurrency", "3",
         "--bootstrap-servers", bootstrap, "--namespace", ns, "--data-dir", str(SWE_MINI)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


async def test_regrade_finds_every_reward_a_weakened_grader_let_through(
    kafka_bootstrap: str, topics: dict[str, str], rows: dict[str, dict[str, Any]]
) -> None:
    cheat_patch = (CHEATS / f"{CHEAT['name']}.patch").read_bytes()
    gold = {task: row["label"].encode() for task, row in rows.items()}
    graded = [  # (diff, policy versions of its turns); every one graded 1.0 by the weakened grader
        (diff("r-gold", "a-1", rows["lru"], gold["lru"]), [1]),
        (diff("r-empty", "a-1", rows["slugify"], b""), [1]),
        (diff("r-cheat", "a-1", rows[CHEAT["task"]], cheat_patch), [2]),
        (diff("r-cheat", "a-2", rows["roman"], gold["roman"]), [2]),  # same rollout, other attempt
        (diff("r-span", "a-1", rows["roman"], b""), [1, 2]),  # turns sampled by two policies: counts as 2
    ]
    never_graded = diff("r-new", "a-1", rows["slugify"], gold["slugify"])  # no turns, no reward
    async with Publisher(kafka_bootstrap) as bus:
        for record, versions in graded:
            for index, version in enumerate(versions):
                await bus.publish(topics["turns"], turn(**{
                    "rollout_id": record["rollout_id"], "attempt_id": record["attempt_id"],
                    "turn_index": index, "policy_version": version,
                }))  # fmt: skip
            await bus.publish(topics["diffs"], record)
            await bus.publish(topics["rewards"], reward_record(record, ALWAYS_SOLVED))
        await bus.publish(topics["diffs"], graded[0][0])  # redelivered: counted, graded once
        await bus.publish(topics["diffs"], never_graded)
        await bus.publish(topics["rewards"], {**SAMPLES["reward"], "rollout_id": "gym-1"})  # no diff: ignored
        poison = await bus.publish_bytes(topics["diffs"], b"\x00not an event", key="r-poison")
        keyless = await bus.publish(topics["diffs"], {**graded[0][0], "rollout_id": ""})
        misplaced = await bus.publish_bytes(topics["diffs"], encode("reward", SAMPLES["reward"]), key="r-1")

    ns = topics["turns"].rsplit(".", 1)[0]
    into = f"{ns}.regraded"
    done = regrade(kafka_bootstrap, ns, into)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)

    flipped = {(c["rollout_id"], c["attempt_id"], c["policy_version"]): c for c in report["changes"]}
    assert set(flipped) == {
        ("r-empty", "a-1", "1"), ("r-cheat", "a-1", "2"), ("r-span", "a-1", "2"), ("r-new", "a-1", "unknown"),
    }  # fmt: skip
    for key in [("r-empty", "a-1", "1"), ("r-cheat", "a-1", "2"), ("r-span", "a-1", "2")]:
        assert flipped[key]["was"]["reward"] == 1.0 and flipped[key]["now"]["reward"] == 0.0, flipped[key]
    cheat_now = flipped[("r-cheat", "a-1", "2")]["now"]
    assert (
        set(CHEAT["flags"]) <= set(cheat_now["flags"]) and cheat_now["failure_kind"] == CHEAT["failure_kind"]
    )
    assert flipped[("r-new", "a-1", "unknown")]["was"] is None
    assert flipped[("r-new", "a-1", "unknown")]["now"]["reward"] == 1.0

    versions = report["policy_versions"]
    assert list(versions) == ["1", "2", "unknown"]
    assert [versions[v]["regraded"] for v in versions] == [2, 3, 1]
    assert [(versions[v]["changed"], versions[v]["lowered"], versions[v]["raised"]) for v in versions] == [
        (1, 1, 0), (2, 2, 0), (0, 0, 0),
    ]  # fmt: skip
    assert versions["unknown"]["not_graded_before"] == 1
    assert set(CHEAT["flags"]) <= set(versions["2"]["flags"]) and not versions["1"]["flags"]
    assert (report["diffs"], report["regraded"], report["changed"], report["repeated_diffs"]) == (10, 6, 3, 1)

    assert sorted(line.split(",")[0] for line in report["problems"]) == sorted([
        f"diffs[{poison.partition}]@{poison.offset}: undecodable diff",
        f"diffs[{keyless.partition}]@{keyless.offset}: diff without a rollout_id",
        f"diffs[{misplaced.partition}]@{misplaced.offset}: a reward event on diffs",
    ]), report["problems"]  # fmt: skip

    published = {}
    async for message, decoded in read(kafka_bootstrap, ReadPlan(into)):
        assert isinstance(decoded, Decoded) and decoded.event_type == "reward"
        assert message.key == decoded.record["rollout_id"].encode()
        published[(decoded.record["rollout_id"], decoded.record["attempt_id"])] = decoded.record["reward"]
    assert published == {
        ("r-gold", "a-1"): 1.0, ("r-empty", "a-1"): 0.0, ("r-cheat", "a-1"): 0.0, ("r-cheat", "a-2"): 1.0,
        ("r-span", "a-1"): 0.0, ("r-new", "a-1"): 1.0,
    }  # fmt: skip

    again = regrade(kafka_bootstrap, ns, into)
    assert again.returncode == 1 and f"{into} already holds messages" in again.stderr


async def test_a_diff_that_crashes_the_grader_is_a_problem_line_and_the_rest_is_regraded(
    kafka_bootstrap: str,
    topics: dict[str, str],
    rows: dict[str, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grader's own bug cannot be produced from input, so the grade function is wrapped to raise for one
    rollout (the only fake here; every other diff goes through the real grader)."""
    real = regrade_module.grade_diff

    async def crashes_on_one(diff: DiffEvent, *args: Any, **kwargs: Any) -> GradeResult:
        if diff.rollout_id == "r-crash":
            raise RuntimeError("boom")
        return await real(diff, *args, **kwargs)

    monkeypatch.setattr(regrade_module, "grade_diff", crashes_on_one)
    async with Publisher(kafka_bootstrap) as bus:
        crash = await bus.publish(topics["diffs"], diff("r-crash", "a-1", rows["slugify"], b""))
        await bus.publish(topics["diffs"], diff("r-ok", "a-1", rows["slugify"], b""))
    ns = topics["turns"].rsplit(".", 1)[0]
    settings = regrade_module.RegradeSettings(
        bootstrap_servers=kafka_bootstrap,
        namespace=ns,
        into=f"{ns}.regraded",
        data_dir=SWE_MINI,
        concurrency=2,
    )
    report = await regrade_module.regrade(settings)
    assert report["problems"] == [
        f"diffs[{crash.partition}]@{crash.offset}: the grader crashed, not regraded: RuntimeError: boom"
    ]
    assert [(c["rollout_id"], c["was"], c["now"]["reward"]) for c in report["changes"]] == [
        ("r-ok", None, 0.0)
    ]
    kept = [d.record["rollout_id"] async for _, d in read(kafka_bootstrap, ReadPlan(f"{ns}.regraded"))]
    assert kept == ["r-ok"]
