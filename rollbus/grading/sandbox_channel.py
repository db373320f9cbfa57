"""The grader's channel inside the test sandbox, shipped read-only to ``/eval/plugins`` (``rollbus_channel``).

What the grader tells its plugin (the canaries' source and names, which must fail) and what the plugin tells
the grader (the report) travel through pipes the grader opened before the sandbox started, never through the
environment or a file: ``ROLLBUS_CHANNEL`` holds only a descriptor number. The first process that claims the
channel (the grader's pytest plugin or unittest runner, loaded before any repository code) reads the
configuration out of its pipe, makes every channel descriptor close-on-exec in itself, and from then on
only it can write records: a process it starts (a child pytest, ``os.system``) inherits no descriptor and
reads an empty pipe, so it reports nothing; a forked copy writes its own pid, which the grader rejects. When
the run ends the configuration goes back into its pipe for the command's next run. Nothing here names a
path, a run id or a canary: ``/proc/self/environ`` and ``/proc/self/fd`` (``pipe:[...]``) say nothing.

Runs under the sandbox's Python; imports nothing of rollbus.
"""

import json
import os

_state = {}


def claim():
    """The configuration (a dict), or None when this process has no channel (a child of the tested code, a
    run while another holds it, a process started outside the grader)."""
    if "config" in _state:
        return _state["config"]
    _state["config"] = None
    try:
        fd = int(os.environ.pop("ROLLBUS_CHANNEL", ""))
    except ValueError:
        return None
    try:
        os.set_blocking(fd, False)
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    except (BlockingIOError, OSError):
        return None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        config = json.loads(data)
        for key in ("report_fd", "refill_fd"):
            os.set_inheritable(config[key], False)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    _state["config"], _state["raw"] = config, data
    return config


def write(record):
    """One record into the grader's report, stamped with this process's pid."""
    config = _state.get("config")
    if not config:
        return
    line = (json.dumps({**record, "pid": os.getpid()}) + "\n").encode()
    try:
        while line:
            line = line[os.write(config["report_fd"], line) :]
    except OSError:
        pass


def release():
    """Give the configuration back for the command's next run; this process reports no more."""
    config, raw = _state.get("config"), _state.get("raw")
    _state["config"] = None
    if not config:
        return
    try:
        os.write(config["refill_fd"], raw)
    except OSError:
        pass
    for key in ("refill_fd", "report_fd"):
        try:
            os.close(config[key])
        except OSError:
            pass
