"""What the pages show, computed from the read model: plain functions returning plain data or HTML fragments.

The token view is built here as one HTML string (not in a template loop): a 100k-token trajectory is one pass
over its tokens, grouped into runs of one colour (``bench/ui_render.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from itertools import groupby, islice
from typing import Any

from rollbus.events import SegmentEvent, TurnEvent
from rollbus.kafka.replay import SUMMARY_EDGE, summarise
from rollbus.services.ui.model import Entry, ReadModel, Rollout, drift_masked_tokens, trained_tokens

TRAINED, DRIFT, CONTEXT = "trained", "drift", "ctx"  # sampled and trained / sampled, masked / never sampled
FOLD_OVER = SUMMARY_EDGE + 1  # longer arrays are folded (expandable), as `rollbus replay` summarises
LONG_TEXT = 400  # strings longer than this are folded


def token_class(mask: int, version: int) -> str:
    if mask:
        return TRAINED
    return DRIFT if version >= 0 else CONTEXT


def token_runs(segment: SegmentEvent) -> list[tuple[str, int, int]]:
    """The segment's response as runs ``(class, start, end)`` of one colour, in order."""
    classes = map(token_class, segment.loss_mask, segment.policy_versions)
    runs, start = [], 0
    for cls, group in groupby(classes):
        n = sum(1 for _ in group)
        runs.append((cls, start, start + n))
        start += n
    return runs


Decode = Callable[[list[int]], str]  # token ids -> text (the tokenizer's decode)


def ids_text(ids: list[int]) -> str:
    """Token ids as they are, when there is no tokenizer to decode them."""
    return " ".join(map(str, ids))


def _run(cls: str, ids: list[int], decode: Decode) -> str:
    return f'<span class="tok {cls}" data-n="{len(ids)}">{escape(decode(ids))}</span>'


def segment_tokens_html(segment: SegmentEvent, freeze: str | None, decode: Decode = ids_text) -> str:
    """One segment's tokens: its prompt (context), its response coloured by mask (each run of one colour
    decoded as one piece), a mark where each drift cut starts, and the freeze that ended it."""
    prompt = list(segment.prompt_ids)
    parts = [f'<details class="prompt"><summary>segment prompt: {len(prompt)} tokens of context</summary>'
             f'{_run("prompt", prompt, decode)}</details>']  # fmt: skip
    response = list(segment.response_ids)
    for cls, start, end in token_runs(segment):
        if cls == DRIFT:
            parts.append(f'<mark class="mark drift" title="drift at response token {start}">drift</mark>')
        parts.append(_run(cls, response[start:end], decode))
    ending = freeze or segment.kind
    parts.append(f'<mark class="mark freeze {escape(segment.kind)}" title="segment ends: '
                 f'{escape(ending)}">{escape(ending)}</mark>')  # fmt: skip
    return "".join(parts)


def ordered_segments(rollout: Rollout) -> list[SegmentEvent]:
    return sorted(rollout.segments.values(), key=lambda s: (s.attempt_id, s.index, s.segment_id))


def freezes(rollout: Rollout) -> dict[tuple[str, str], str]:
    """(attempt, chain) -> why the chain was frozen or closed (subagent, wipe, compaction, fork, ...)."""
    ends = {}
    for s in rollout.sessions:
        if s.kind in ("frozen", "closed") and s.reason:
            ends[(s.attempt_id, s.chain_id)] = f"{s.kind}: {s.reason}"
    return ends


def chain_kinds(rollout: Rollout) -> dict[tuple[str, str], str]:
    kinds: dict[tuple[str, str], str] = {(a, c): t.chain_kind for (a, c, _), t in rollout.turns.items()}
    for s in rollout.sessions:
        kinds.setdefault((s.attempt_id, s.chain_id), s.chain_kind)
    return kinds


def segment_rows(rollout: Rollout, decode: Decode = ids_text) -> list[dict[str, Any]]:
    """The segments table and token view: K segments with reward shares, counts and their coloured tokens."""
    ends, kinds = freezes(rollout), chain_kinds(rollout)
    rows = []
    for s in ordered_segments(rollout):
        chain = (s.attempt_id, s.chain_id)
        rows.append({
            "segment_id": s.segment_id, "index": s.index, "num_segments": s.num_segments,
            "kind": s.kind, "chain_id": s.chain_id, "chain_kind": kinds.get(chain, "?"),
            "reward": s.reward, "trajectory_reward": s.trajectory_reward,
            "prompt_tokens": len(s.prompt_ids), "response_tokens": len(s.response_ids),
            "trained": trained_tokens(s), "drift": drift_masked_tokens(s),
            "html": segment_tokens_html(s, ends.get(chain), decode),
        })  # fmt: skip
    return rows


def timeline(rollout: Rollout, decode: Decode | None = None) -> list[dict[str, Any]]:
    """Turns per chain, in order, with model time, the tool time before each call and the queueing in it; the
    new prompt suffix and the output decoded when ``decode`` is given, else as ids."""
    chains: dict[tuple[str, str], list[TurnEvent]] = {}
    for (attempt, chain, _), turn in sorted(rollout.turns.items()):
        chains.setdefault((attempt, chain), []).append(turn)
    out = []
    for (attempt, chain), turns in chains.items():
        rows, previous_end = [], None
        for t in turns:
            timing = t.timings
            call_ms = timing.finished_at - timing.started_at
            prompt, output = list(t.prompt_ids), list(t.output_ids)
            rows.append({
                "turn_index": t.turn_index, "started_at": timing.started_at,
                "model_ms": timing.generation_ms, "queue_ms": max(call_ms - timing.generation_ms, 0),
                "tool_ms": None if previous_end is None else timing.started_at - previous_end,
                "suffix": decode(prompt) if decode else prompt,
                "output": decode(output) if decode else output, "prompt_tokens": t.prompt_tokens,
                "finish_reason": t.finish_reason, "policy_version": t.policy_version,
            })  # fmt: skip
            previous_end = timing.finished_at
        out.append({"attempt_id": attempt, "chain_id": chain, "chain_kind": turns[0].chain_kind,
                    "turns": rows})  # fmt: skip
    return out


def verdict(rollout: Rollout) -> dict[str, Any] | None:
    """The grader's verdict with its details parsed (kept as text when it is not JSON)."""
    if rollout.reward is None:
        return None
    reward = rollout.reward.to_dict()
    try:
        reward["details"] = json.loads(rollout.reward.details or "{}")
    except ValueError:
        pass
    return reward


def patch_text(rollout: Rollout) -> str | None:
    if rollout.diff is None:
        return None
    patch: bytes | str = rollout.diff.patch
    return patch.decode("utf-8", errors="replace") if isinstance(patch, bytes | bytearray) else str(patch)


def task_fields(rollout: Rollout) -> dict[str, Any] | None:
    if rollout.task is None:
        return None
    try:
        metadata = json.loads(rollout.task.metadata or "{}")
    except ValueError:
        metadata = {}
    statement = metadata.get("problem_statement") if isinstance(metadata, dict) else None
    return {**rollout.task.to_dict(), "problem_statement": statement or rollout.task.prompt}


# --- topic browser --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Browse:
    """What the topic browser shows: a topic, optionally one partition, from an offset (in every partition)
    or a time, one rollout's events only; a page of ``limit`` after skipping ``skip`` matches."""

    topic: str
    partition: int | None = None
    offset: int = 0
    since_ms: int = 0
    rollout_id: str | None = None
    skip: int = 0
    limit: int = 100


def browse(model: ReadModel, want: Browse) -> tuple[list[Entry], bool]:
    """The page of entries ``want`` asks for (partition by partition, in offset order); whether more match."""
    matches = (
        e
        for e in model.log.get(want.topic, [])
        if e.offset >= want.offset
        and e.timestamp >= want.since_ms
        and (want.partition is None or e.partition == want.partition)
        and (not want.rollout_id or e.key == want.rollout_id)
    )
    page = list(islice(matches, want.skip, want.skip + want.limit + 1))
    return page[: want.limit], len(page) > want.limit


def folded_html(value: Any) -> str:
    """A decoded record as nested HTML: long arrays, bytes and long text folded in ``<details>`` (summary
    first, the whole value on expanding)."""
    if isinstance(value, dict):
        items = "".join(f"<dt>{escape(str(k))}</dt><dd>{folded_html(v)}</dd>" for k, v in value.items())
        return f'<dl class="record">{items}</dl>'
    if isinstance(value, bytes | bytearray):
        return _fold(summarise(value), escape(" ".join(map(str, value))))
    if isinstance(value, list):
        if len(value) > FOLD_OVER and all(isinstance(v, int | float) for v in value):
            return _fold(summarise(value), escape(", ".join(map(str, value))))
        return "[" + ", ".join(folded_html(v) for v in value) + "]"
    if isinstance(value, str):
        if len(value) > LONG_TEXT:
            return _fold(f"{len(value)} chars: {value[:80]}…", f"<pre>{escape(value)}</pre>")
        return f"<code>{escape(json.dumps(value, ensure_ascii=False))}</code>"
    return f"<code>{escape(json.dumps(value))}</code>"


def _fold(summary: Any, whole: str) -> str:
    return f'<details class="fold"><summary>{escape(str(summary))}</summary><div>{whole}</div></details>'
