"""`make demo`, as a user runs it: the closed loop on embedded defaults, judged by its JSON summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_rolls_out_grades_segments_trains_and_serves_the_new_policy(tmp_path: Path) -> None:
    summary_file = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "demo", "--state-dir", str(tmp_path / "state"),
         "--json-summary", str(summary_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    tail = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, tail
    summary = json.loads(summary_file.read_text())
    # demo.jsonl: two tasks x two samples; sample 1 of each replays a script that fails on purpose
    assert summary["rollouts_submitted"] == summary["rollouts_finished"] == 4, summary
    assert summary["solved"] == 2 and summary["rollouts_failed"] == 0, summary
    assert summary["segments"] >= 4 and summary["tokens_trained"] > 0, summary
    assert summary["train_steps"] >= 2 and summary["policy_version"] >= 2, summary
    served = re.search(r"serving weight version (\S+)", done.stdout)
    assert served and int(served.group(1)) == summary["policy_version"], tail
    assert "rollbus broker start --state-dir" in done.stdout
