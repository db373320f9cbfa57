"""SWE-bench Pro style parser for pytest ``-rA`` output.

``python parser.py stdout.log stderr.log output.json`` writes ``{"tests": [{"name", "status"}]}`` with
statuses PASSED, FAILED, SKIPPED or ERROR (XFAIL counts as PASSED, XPASS as FAILED), one entry per test name.
Only the "short test summary info" sections are read, and when a name is reported twice the worse
status wins, so a line the code under test prints that merely looks like a result
cannot turn a failure into a pass.
"""

import json
import re
import sys

SUMMARY = re.compile(r"^=+ short test summary info =+$")
RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)(?:\s+-\s.*)?$")
STATUS = {
    "PASSED": "PASSED",
    "XFAIL": "PASSED",
    "FAILED": "FAILED",
    "XPASS": "FAILED",
    "ERROR": "ERROR",
    "SKIPPED": "SKIPPED",
}
RANK = {"PASSED": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 3}


def parse(text):
    tests = {}
    in_summary = False
    for line in text.splitlines():
        line = line.rstrip()
        if SUMMARY.match(line):
            in_summary = True
            continue
        if in_summary and line.startswith("=") and line.endswith("="):
            in_summary = False
            continue
        match = RESULT.match(line) if in_summary else None
        if match is None or match.group(2).startswith("["):
            continue
        status = STATUS[match.group(1)]
        name = match.group(2)
        if name not in tests or RANK[status] > RANK[tests[name]]:
            tests[name] = status
    return [{"name": name, "status": status} for name, status in tests.items()]


def main(stdout_path, stderr_path, output_path):
    with open(stdout_path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    with open(output_path, "w", encoding="utf-8") as handle:
        json.dump({"tests": parse(text)}, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
