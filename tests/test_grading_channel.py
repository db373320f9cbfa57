"""The grader's channel is out of the tested code's reach (issue 33), tried as the attacker would.

Patches against swe-mini rows that fix nothing: a probe that looks, from inside the package under test,
everywhere the grader's report path, run id, canary names and must-fail names used to be (the environment,
``/proc/self/environ``, the descriptors in ``/proc/self/fd``, the repository, the home directory, ``/tmp``,
``/eval``) and prints what it finds; and a run laundered through a child: the package starts a child pytest on
empty stand-ins of the hidden tests (same relative path, same test names), which used to inherit the
plugin's environment and report an honest passing run with correct canaries, then skips the real hidden
module while it is collected. Both scored 1.0 (the probe: it found the report path and the
canaries); now the probe finds nothing and the child reports nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import parse_row
from tests.test_grading_swe_mini import SWE_MINI, append_to, grade_on, load_build

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


PROBE = [  # what the grader used to leave within reach: its report path, canary module and must-fail names
    "import os as _o, re as _r",
    "",
    "_SECRET = _r.compile(r'rollbus-report|test_[0-9a-f]{12}|[.]jsonl')",
    "",
    "def _look():",
    "    seen = [f'env {k}={v}' for k, v in _o.environ.items() if _SECRET.search(v)]",
    "    raw = open('/proc/self/environ', 'rb').read().decode(errors='replace')",
    "    seen += [f'proc-environ {kv}' for kv in raw.split(chr(0)) if _SECRET.search(kv)]",
    "    for fd in _o.listdir('/proc/self/fd'):",
    "        try:",
    "            target = _o.readlink(f'/proc/self/fd/{fd}')",
    "        except OSError:",
    "            continue",
    "        if _SECRET.search(target):",
    "            seen.append(f'fd {fd} -> {target}')",
    "    for top in (_o.getcwd(), _o.path.expanduser('~'), '/tmp', '/eval'):",
    "        for root, dirs, files in _o.walk(top):",
    "            dirs[:] = [d for d in dirs if d != '.git']",
    "            seen += [f'file {root}/{name}' for name in files if _SECRET.search(name)]",
    "            for name in files:",
    "                if _o.path.join(root, name) == __file__:  # the probe itself",
    "                    continue",
    "                try:",
    "                    if _SECRET.search(open(_o.path.join(root, name), errors='replace').read(1 << 20)):",
    "                        seen.append(f'file-content {root}/{name}')",
    "                except OSError:",
    "                    pass",
    "    return seen",
    "",
    "_seen = _look()",
    "if _seen:  # shown in the log as the collection error's message",
    "    raise ImportError(' '.join(f'GRADER-LEAK {x}' for x in _seen))",
]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_nothing_of_the_graders_is_where_the_tested_code_can_read_it(
    rows: dict[str, dict[str, Any]], backend: str
) -> None:
    patch = append_to("textkit/__init__.py", "from textkit.slug import slugify", PROBE)
    result = await grade_on(backend)(parse_row(rows["slugify"], SWE_MINI), patch)
    assert result.reward == 0.0  # the bug is still there
    log = result.details["log"]
    assert "test_slug_hidden" in log  # the probe ran where the tests ran
    assert not re.findall(r"GRADER-LEAK (?:env|proc-environ|fd|file|file-content) \S+", log), log


LAUNDER = [
    "import os as _o, re as _r, subprocess as _sp, sys as _s, tempfile as _t",
    "",
    "if not _o.environ.get('_CHILD_RUN'):",
    "    _o.environ['_CHILD_RUN'] = '1'",
    "    _names = _r.findall(r'^def (test_\\w+)', open('tests/test_center_hidden.py').read(), _r.M)",
    "    _d = _t.mkdtemp()",
    "    _o.makedirs(_d + '/tests')",
    "    with open(_d + '/tests/test_center_hidden.py', 'w') as _f:",
    "        _f.write(''.join(f'def {n}():\\n    pass\\n\\n' for n in _names))",
    "    _sp.run([_s.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',",
    "             'tests/test_center_hidden.py'], cwd=_d)",
    "    import pytest as _p",
    "    _p.skip('optional backend missing', allow_module_level=True)  # the real hidden tests vanish",
]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_child_pytest_cannot_report_for_the_run(
    rows: dict[str, dict[str, Any]], backend: str
) -> None:
    """median (f2p_script): hidden and visible test files; the visible ones pass with the bug."""
    patch = append_to("stats/__init__.py", "from stats.center import median", LAUNDER)
    result = await grade_on(backend)(parse_row(rows["median"], SWE_MINI), patch)
    assert (result.reward, result.solved) == (0.0, False), result
    hidden = {t.name: t.status for t in result.tests if t.name.startswith("tests/test_center_hidden.py")}
    assert hidden == {"tests/test_center_hidden.py": "SKIPPED"}, result  # the child's passes did not count


def test_a_child_process_inherits_no_channel(tmp_path: Path) -> None:
    """The claiming process makes its descriptors close-on-exec: a child it starts finds nothing to read,
    writes nothing, and a second claim in the same process is the first one's."""
    from rollbus.grading.channel import Channel

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "rollbus_channel.py").write_text(
        (Path(__file__).resolve().parents[1] / "rollbus" / "grading" / "sandbox_channel.py").read_text()
    )
    script = (
        "import os, subprocess, sys, rollbus_channel as c\n"
        "config = c.claim()\n"
        "assert 'ROLLBUS_CHANNEL' not in os.environ\n"
        "c.write({'event': 'parent', 'must_fail': config['must_fail']})\n"
        'child = \'import rollbus_channel as c; print(c.claim()); c.write({"event": "child"})\'\n'
        "env = {**os.environ, 'ROLLBUS_CHANNEL': sys.argv[1]}\n"
        "subprocess.run([sys.executable, '-c', child], env=env, check=True)\n"
        "os.system(f'{sys.executable} -c \"{child}\"')\n"
    )
    channel = Channel({"must_fail": ["test_abc"]})
    try:
        env = {**os.environ, "PYTHONPATH": str(plugins), **channel.env}
        done = subprocess.run(
            [sys.executable, "-c", script, channel.env["ROLLBUS_CHANNEL"]], env=env, capture_output=True,
            text=True, timeout=60, pass_fds=channel.fds, check=False,
        )  # fmt: skip
        text = channel.collect()
    finally:
        channel.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]
    assert '"event": "parent"' in text and '"child"' not in text
    assert text.count("\n") == 1


CONTAINER_PROBE = [  # from inside the grading container, while the tests are collected
    "import json as _j, os as _o, socket as _s",
    "",
    "def _try():",
    "    seen = {'channel_dir': sorted(_o.listdir('/run/rollbus-grader'))}",
    "    u = _s.socket(_s.AF_UNIX)",
    "    try:",
    "        u.connect('/run/rollbus-grader/channel')",
    "        seen['connect'] = 'connected'",
    "    except OSError as exc:",
    "        seen['connect'] = type(exc).__name__",
    "    try:",
    "        open('/run/rollbus-grader/forged', 'w')",
    "        seen['write'] = 'written'",
    "    except OSError as exc:",
    "        seen['write'] = type(exc).__name__",
    "    try:",
    "        _s.create_connection(('1.1.1.1', 53), timeout=5)",
    "        seen['network'] = 'reached'",
    "    except OSError as exc:",
    "        seen['network'] = type(exc).__name__",
    "    if _o.fork() == 0:  # a child writes a passing run into every descriptor it holds",
    "        line = _j.dumps({'event': 'start', 'run': 'forged', 'pid': _o.getpid()}) + '\\n'",
    "        for fd in range(3, 64):",
    "            try:",
    "                _o.write(fd, line.encode())",
    "            except OSError:",
    "                pass",
    "        _o._exit(0)",
    "    _o.wait()",
    "    return seen",
    "",
    "raise ImportError('CONTAINER-PROBE ' + _j.dumps(_try()))",
]


@pytest.mark.docker
async def test_the_grading_container_holds_no_way_to_the_channel_but_the_launched_process(
    rows: dict[str, dict[str, Any]],
) -> None:
    """From inside the grading container while the tests run: the channel's socket is gone once the
    launcher took it (its directory empty, read-only; a connect finds nothing), no network, and a forked
    child's records in the report are refused (the report is then not the grader's: reward 0)."""
    patch = append_to("textkit/__init__.py", "from textkit.slug import slugify", CONTAINER_PROBE)
    result = await grade_on("docker")(parse_row(rows["slugify"], SWE_MINI), patch)
    assert result.reward == 0.0, result
    found = re.search(r"CONTAINER-PROBE (\{.*?\})", result.details["log"])
    assert found, result.details["log"]
    import json

    seen = json.loads(found.group(1))
    assert seen["channel_dir"] == [] and seen["connect"] in ("FileNotFoundError", "ConnectionRefusedError")
    assert seen["write"] in ("OSError", "PermissionError") and seen["network"] == "OSError", seen
    assert result.failure_kind == "tampered" and "spawns_process" in result.flags, result  # the fork's run


def test_the_socket_channel_takes_one_connection_and_hands_the_launched_command_bwraps_descriptors(
    tmp_path: Path,
) -> None:
    """The container's way onto the channel, run on the host: the launcher connects, the command it becomes
    claims the configuration from inherited descriptors as under bwrap, the socket is gone for anyone after
    it (a second connect finds no file), and a child it starts inherits nothing."""
    from rollbus.grading.channel import SocketChannel

    grading = Path(__file__).resolve().parents[1] / "rollbus" / "grading"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, source in (
        ("rollbus_channel.py", "sandbox_channel.py"),
        ("rollbus_launch.py", "sandbox_launch.py"),
    ):
        (plugins / name).write_text((grading / source).read_text())
    script = (
        "import os, socket, subprocess, sys, rollbus_channel as c\n"
        "config = c.claim()\n"
        "c.write({'event': 'parent', 'must_fail': config['must_fail']})\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        'child = \'import rollbus_channel as c; print(c.claim()); c.write({"event": "child"})\'\n'
        "subprocess.run([sys.executable, '-c', child], check=True)\n"
    )
    channel = SocketChannel({"must_fail": ["test_abc"]}, tmp_path / "channel")
    try:
        env = {**os.environ, "PYTHONPATH": str(plugins)}
        launch = [sys.executable, "-I", "-S", str(plugins / "rollbus_launch.py"), channel.path]
        done = subprocess.run(
            [*launch, sys.executable, "-c", script, channel.path], env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        text = channel.collect()
    finally:
        channel.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FileNotFoundError", "None"]
    assert '"event": "parent"' in text and '"test_abc"' in text and '"child"' not in text
    assert text.count("\n") == 1 and not os.listdir(tmp_path / "channel")
