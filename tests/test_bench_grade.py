"""``bench/grade.py --quick``: the grader-versus-bare bench runs as a smoke test and ends on its ratio line.

The figure itself is not asserted (speed lives in bench/, not in tests); the line is what a reader of the
bench looks for, so its absence or a crash of the bench fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "grade.py"
RATIO_LINE = re.compile(
    r"^ratio \d+\.\d\dx over 3 tasks \(grader \d+\.\d{3} s, bare \d+\.\d{3} s\): "
    r"(within|OVER) the 2.5x budget"
    r"; audit layer \d+\.\d\dx \(\+-?\d+\.\d\d bare\); second run \d+\.\d\dx \(\+-?\d+\.\d\d bare\)$"
)


def test_quick_run_prints_the_ratio_line() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    tasks = [line.split()[0] for line in lines[1:-1]]
    assert tasks == ["swe-mini__lru", "swe-mini__slugify", "swe-mini__roman"], done.stdout
    assert RATIO_LINE.match(lines[-1]), done.stdout
