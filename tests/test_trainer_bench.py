"""``bench/trainer_step.py --quick``: dense and MoE, 1 process vs 2 FSDP2 ranks, ends on its ratio line.

The figures are not asserted (speed lives in bench/); a crash of either path or a missing line fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "trainer_step.py"
MEASURED = re.compile(
    r"^  (1 process, 1 thread|torchrun 2 ranks \(FSDP2\)) +[\d.]+ s .* tok/s .* peak \+ *\d+ MB"
)
RATIO_LINE = re.compile(
    r"^ratio: 2 FSDP2 ranks vs 1 process = \d+\.\d\dx \(dense\), \d+\.\d\dx \(moe\) step throughput$"
)


def test_quick_run_measures_dense_and_moe_on_one_and_two_ranks() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [x.split(",")[0] for x in lines if not x.startswith(" ")][:2] == ["dense", "moe"], done.stdout
    assert sum(bool(MEASURED.match(x)) for x in lines) == 4, done.stdout
    assert RATIO_LINE.match(lines[-1]), done.stdout
