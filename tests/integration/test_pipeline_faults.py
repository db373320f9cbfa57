"""The whole pipeline under SIGKILL (``tests/pipeline_faults.py``): ``rollbus up`` on its embedded broker,
16 rollouts of the bundled swe-mini dataset, and the adapter, sandbox runner, grader, segmenter, trainer,
engine and broker each killed with -9 once while they run, at seeded moments, each restarted by the
supervisor. The soak (more rounds, by hand): ``python -m tests.pipeline_faults``."""

from __future__ import annotations

import os

import pytest

from tests.pipeline_faults import TARGETS, run_with_faults

pytestmark = [pytest.mark.kafka, pytest.mark.faults]


@pytest.mark.timeout(1800)  # the stack starts in about two minutes on a loaded 2-core machine
async def test_every_part_killed_once_mid_run_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    for name in ("ROLLBUS_BOOTSTRAP_SERVERS", "ROLLBUS_NAMESPACE"):  # the stack's own embedded broker
        monkeypatch.delenv(name, raising=False)
    seed = int(os.environ.get("ROLLBUS_FAULT_SEED", "23"))
    lines: list[str] = []
    state = tmp_path / "state"
    kills, verdict = await run_with_faults(state, tasks=8, samples=2, seed=seed, say=lines.append)
    log = "\n".join(lines[-80:])
    assert sorted(k.target for k in kills) == sorted(TARGETS), log
    assert verdict.problems == [], f"seed {seed}: {verdict}\n{log}"
    assert verdict.rollouts == verdict.rewards == 16, verdict
    assert verdict.segments > 0 and verdict.rebuilt == verdict.segments, verdict
    assert verdict.groups_trained > 0, verdict  # the demo tasks' groups have reward variance: they train
