"""Plain-text tables of bus events for ``rollbus replay --format table`` and ``rollbus tail``: one per topic.

Each event type gets the columns that matter for it (a turn's chain, turn index, prompt tokens, new suffix,
sampled tokens, finish and policy version; a reward's value, solved flag, failure kind and grader flags ...).
What a person needs to copy back into a command (rollout, attempt, chain and segment ids, keys) is never
cut; only free text (a task's prompt, an error) is shortened. Cells are plain strings written as they are:
no markup language sees event text, so ``list[float]`` stays ``list[float]``, and nothing wraps lines, so
piped output keeps one event per line whatever the terminal width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

TEXT_WIDTH = 60  # free text (prompts, errors) is cut here; ids never are

Cell = Callable[[dict[str, Any]], Any]


def text(value: Any, width: int = TEXT_WIDTH) -> str:
    """Free text on one line, cut to ``width`` with an ellipsis."""
    flat = " ".join(str(value).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def count(name: str) -> Cell:
    return lambda r: len(r[name])


def get(name: str) -> Cell:
    return lambda r: r.get(name)


def _tests(record: dict[str, Any]) -> str:
    tests = record.get("tests") or []
    passed = sum(1 for t in tests if str(t.get("status", "")).upper() in ("PASSED", "PASS", "OK"))
    return f"{passed}/{len(tests)}" if tests else "-"


def _patch(record: dict[str, Any]) -> str:
    lines = bytes(record["patch"]).splitlines()  # bytes since diff v3 (older events read back as bytes too)
    changed = sum(1 for line in lines if line[:1] in (b"+", b"-") and line[:3] not in (b"+++", b"---"))
    return f"{changed} lines" + (" (truncated)" if record.get("patch_truncated") else "")


COLUMNS: dict[str, tuple[tuple[str, Cell], ...]] = {
    "turn": (
        ("rollout", get("rollout_id")), ("attempt", get("attempt_id")), ("chain", get("chain_id")),
        ("kind", get("chain_kind")), ("turn", get("turn_index")), ("prompt tokens", get("prompt_tokens")),
        ("new suffix", count("prompt_ids")), ("sampled", count("output_ids")),
        ("finish", get("finish_reason")), ("policy", get("policy_version")),
    ),
    "session": (
        ("rollout", get("rollout_id")), ("attempt", get("attempt_id")), ("chain", get("chain_id")),
        ("event", get("kind")), ("chain kind", get("chain_kind")), ("reason", get("reason")),
        ("turns", get("turn_count")), ("parent chain", get("parent_chain_id")),
    ),
    "diff": (
        ("rollout", get("rollout_id")), ("attempt", get("attempt_id")), ("group", get("group_id")),
        ("exit", get("exit_status")), ("turns", get("turns")),
        ("wall s", lambda r: f"{r['wall_time_s']:.1f}"), ("patch", _patch),
        ("failure kind", get("failure_kind")), ("error", lambda r: r.get("error") and text(r["error"])),
    ),
    "reward": (
        ("rollout", get("rollout_id")), ("attempt", get("attempt_id")), ("group", get("group_id")),
        ("reward", lambda r: f"{r['reward']:.4g}"), ("solved", get("solved")),
        ("applied", get("applied_cleanly")), ("failure kind", get("failure_kind")),
        ("flags", lambda r: ",".join(r.get("flags") or []) or "-"), ("tests passed", _tests),
        ("step rewards", lambda r: ",".join(f"{x:.3g}" for x in r.get("step_rewards") or []) or "-"),
        ("infos", lambda r: text(r["infos"]) if r.get("infos", "[]") != "[]" else "-"),  # gym: reset+steps
    ),
    "segment": (
        ("segment", get("segment_id")), ("rollout", get("rollout_id")), ("attempt", get("attempt_id")),
        ("chain", get("chain_id")), ("index/K", lambda r: f"{r['index']}/{r['num_segments']}"),
        ("kind", get("kind")), ("prompt", count("prompt_ids")), ("response", count("response_ids")),
        ("trained", lambda r: sum(r["loss_mask"])), ("reward", lambda r: f"{r['reward']:.4g}"),
        ("policy", lambda r: ",".join(str(v) for v in sorted(set(r["policy_versions"]) - {-1})) or "-"),
    ),
    "task": (
        ("rollout", get("rollout_id")), ("group", get("group_id")),
        ("sample", lambda r: f"{r['sample_index']}/{r['group_size']}"), ("label", get("label")),
        ("prompt", lambda r: text(r["prompt"])),
    ),
    "policy": (
        ("version", get("version")), ("location", get("location")),
        ("published (UTC)", lambda r: clock(r["published_at"], date=True)),
    ),
    "train_step": (
        ("step", get("step")), ("version", get("version")), ("groups", count("group_ids")),
        ("segments", count("segment_ids")), ("tokens", get("tokens_trained")),
        ("reward", lambda r: f"{r['reward_mean']:.3g}"), ("loss", lambda r: f"{r['loss']:.4g}"),
        ("stale max", get("staleness_max")), ("|dlogp| max", lambda r: f"{r['logprob_diff_max']:.3g}"),
        ("kl", lambda r: f"{r['approx_kl']:.3g}"),
    ),
    "dead_letter": (
        ("source", get("source_topic")), ("partition", get("partition")), ("offset", get("offset")),
        ("key", lambda r: r["key"].decode(errors="replace") if r.get("key") is not None else None),
        ("service", get("service")), ("error", lambda r: text(r["error"])),
    ),
}  # fmt: skip
PLACE = ("p", "offset", "time (UTC)")


def clock(millis: int, date: bool = False) -> str:
    moment = datetime.fromtimestamp(millis / 1000, UTC).isoformat(timespec="milliseconds")
    return moment[:23] if date else moment[11:23]


def cell(value: Any) -> str:
    """One cell as text: None or empty as ``-``, booleans as yes/no, anything else as ``str`` on one line."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value).replace("\n", "\\n").replace("\r", "\\r")


def header(event_type: str | None) -> list[str]:
    """Column names for a topic holding ``event_type`` (None: a topic rollbus does not know)."""
    names = [name for name, _ in COLUMNS[event_type]] if event_type in COLUMNS else ["key", "type", "event"]
    return [*PLACE, *names]


def cells(
    event_type: str | None,
    place: tuple[int, int, int],
    key: str | None,
    decoded_type: str | None,
    record: dict[str, Any] | None,
    error: str | None = None,
) -> list[str]:
    """One row: partition, offset, time, then the topic's columns (or why the message is undecodable)."""
    partition, offset, millis = place
    first = [str(partition), str(offset), clock(millis)]
    if record is None:
        return [*first, f"undecodable (key {cell(key)}): {error}"]
    if decoded_type != event_type or event_type not in COLUMNS:
        summary = " ".join(
            f"{name}={cell(value)}" for name, value in record.items() if name != "schema_version"
        )
        return [*first, cell(key), cell(decoded_type), summary]
    return [*first, *(cell(column(record)) for _, column in COLUMNS[event_type])]


@dataclass
class TableWriter:
    """Rows aligned under a header. ``stream`` writes each row as it comes (tail): columns grow to fit
    the widest value seen so far; otherwise rows are held and aligned as a whole at :meth:`close`."""

    out: TextIO
    columns: list[str]
    stream: bool = False
    widths: list[int] = field(init=False)
    held: list[list[str]] = field(default_factory=list, init=False)
    started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.widths = [len(name) for name in self.columns]

    def add(self, row: list[str]) -> None:
        for index, value in enumerate(row[: len(self.widths)]):
            self.widths[index] = max(self.widths[index], len(value))
        if self.stream:
            self._write(row)
        else:
            self.held.append(row)

    def close(self) -> None:
        for row in self.held:
            self._write(row)
        self.held.clear()

    def _write(self, row: list[str]) -> None:
        if not self.started:
            self.started = True
            self._line(self.columns)
        self._line(row)
        self.out.flush()

    def _line(self, row: list[str]) -> None:
        padded = [value.ljust(self.widths[i]) if i < len(row) - 1 else value for i, value in enumerate(row)]
        self.out.write("  ".join(padded).rstrip() + "\n")
