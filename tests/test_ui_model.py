"""The UI's read model and views: pure functions over the events the pipeline writes (tests/ui_support.py)."""

from __future__ import annotations

import random
from typing import Any

from rollbus.events import SegmentEvent
from rollbus.services.ui.app import Pages
from rollbus.services.ui.model import (
    Entry,
    ReadModel,
    fold,
    overview,
    policy_offset,
    throughput,
    trained_by,
)  # fmt: skip
from rollbus.services.ui.views import Browse, browse, folded_html, segment_rows, token_runs
from tests.event_samples import SAMPLES
from tests.ui_support import AT, entries, run_events, train_step


def diff(rollout_id: str, failure_kind: str) -> dict[str, Any]:
    return {**SAMPLES["diff"], "rollout_id": rollout_id, "failure_kind": failure_kind}


def masked(mask: bytes, versions: list[int]) -> SegmentEvent:
    """A segment whose response has ``mask`` and ``versions`` (the rest of it as the sample's)."""
    n = len(mask)
    return SegmentEvent.from_dict({**SAMPLES["segment"], "response_ids": [1] * n, "loss_mask": mask,
                                   "rollout_logprobs": [0.0] * n, "policy_versions": versions})  # fmt: skip


def test_the_overview_counts_what_the_events_say() -> None:
    events = run_events()
    o = overview(fold(entries(events)))
    segments = [r for t, r in events if t == "segments"]
    assert o["rollouts"] == {"submitted": 4, "running": 0, "finished": 4, "failed": 0}
    assert o["failure_kinds"] == {"unsolved": 2}
    assert o["per_version"] == [
        {"version": 0, "rollouts": 2, "reward_mean": 0.5, "solve_rate": 0.5},
        {"version": 1, "rollouts": 2, "reward_mean": 0.5, "solve_rate": 0.5},
    ]
    assert o["train_steps"] == 1 and o["policy_version"] == 1
    assert o["trainable_tokens"] == sum(sum(s["loss_mask"]) for s in segments) > 0
    first_group = [s for s in segments if s["group_id"] == "g0"]
    assert o["tokens_trained"] == sum(sum(s["loss_mask"]) for s in first_group) > 0  # what step 1 says
    assert o["segments_trained"] == len(first_group) < len(segments)
    assert o["last_step"]["step"] == 1 and o["last_step"]["staleness_mean"] == 0.25
    assert o["last_step"]["logprob_diff_max"] == 0.4375 and o["last_step"]["approx_kl"] == 0.00125
    assert o["drift_masked_tokens"] == 2  # the one drifted output's two tokens
    response = sum(len(s["response_ids"]) for s in segments)
    assert o["untrained_fraction"] == (response - o["trainable_tokens"]) / response
    assert o["events"]["segments"] == len(segments) and o["dead_letters"] == 0


def test_a_rollout_in_flight_and_one_whose_run_failed() -> None:
    model = fold(
        entries([e for e in run_events() if e[0] in ("tasks", "turns") and e[1]["rollout_id"] == "r-0"])
    )
    assert overview(model)["rollouts"] == {"submitted": 1, "running": 1, "finished": 0, "failed": 0}
    model.add(Entry("diffs", 0, 0, AT, "r-0", "diff", diff("r-0", "timeout")))
    failed = {**SAMPLES["reward"], "rollout_id": "r-0", "reward": 0.0, "solved": False,
              "failure_kind": "timeout"}  # fmt: skip
    model.add(Entry("rewards", 0, 0, AT, "r-0", "reward", failed))
    o = overview(model)
    assert o["rollouts"]["failed"] == 1 and o["failure_kinds"] == {"timeout": 1}
    assert o["failure_classes"] == {} and o["reruns"] == 0


def test_infrastructure_failures_and_reruns_are_counted_apart_from_the_policys() -> None:
    model = fold(entries([e for e in run_events() if e[0] == "tasks" and e[1]["rollout_id"] == "r-0"]))
    infra = {**SAMPLES["reward"], "rollout_id": "r-0", "reward": 0.0, "solved": False,
             "failure_kind": "rollout_failed", "failure_class": "infrastructure",
             "failure_cause": "boot_failed", "rerun_rollout_id": "r.r1-0"}  # fmt: skip
    model.add(Entry("diffs", 0, 0, AT, "r-0", "diff", diff("r-0", "boot_failed")))
    model.add(Entry("rewards", 0, 0, AT, "r-0", "reward", infra))
    rerun = {**next(e[1] for e in run_events() if e[0] == "tasks"), "rollout_id": "r.r1-0", "attempt": 1}
    model.add(Entry("tasks", 0, 1, AT, "r.r1-0", "task", rerun))
    timeout = {**SAMPLES["reward"], "rollout_id": "r.r1-0", "reward": 0.0, "solved": False,
               "failure_kind": "timeout", "failure_class": "policy", "failure_cause": "timeout"}  # fmt: skip
    model.add(Entry("rewards", 0, 1, AT, "r.r1-0", "reward", timeout))
    o = overview(model)
    assert o["failure_classes"] == {"infrastructure": 1, "policy": 1} and o["reruns"] == 1
    assert o["failure_kinds"] == {"boot_failed": 1, "timeout": 1}


def test_the_fold_does_not_care_in_which_order_partitions_arrive() -> None:
    """The feed reads topics concurrently and a rebuild reads them one by one; Kafka keeps only each
    partition's order. Every interleaving that keeps it must give one model."""
    placed = entries(run_events())
    reference = fold(placed)
    rng = random.Random(7)
    for _ in range(30):
        queues: dict[tuple[str, int], list[Entry]] = {}
        for entry in placed:
            queues.setdefault((entry.topic, entry.partition), []).append(entry)
        interleaved = []
        while queues:
            place = rng.choice(sorted(queues))
            interleaved.append(queues[place].pop(0))
            if not queues[place]:
                del queues[place]
        assert fold(interleaved) == reference


def test_a_redelivered_segment_is_counted_once_and_undecodable_messages_are_kept() -> None:
    placed = entries(run_events())
    segment = next(e for e in placed if e.topic == "segments")
    model = fold([*placed, segment, Entry("turns", 0, 99, AT, "r-0", None, None, "bad magic")])
    o = overview(model)
    assert o["duplicate_segments"] == 1 and o["undecodable"] == 1
    assert o["segments"] == sum(1 for e in placed if e.topic == "segments")
    assert [e.offset for e in model.log["turns"] if e.error == "bad magic"] == [99]


def test_a_rollout_is_trained_by_the_step_whose_fact_names_its_segments() -> None:
    model = fold(entries(run_events()))
    [step] = trained_by(model, model.rollouts["r-0"])
    assert step.record is not None and step.record["step"] == 1 and step.topic == "train-steps"
    assert trained_by(model, model.rollouts["r-1"]) == [step]
    assert trained_by(model, model.rollouts["r-2"]) == []  # a policy came after it, but no step named it
    later = [s.to_dict() for r in ("r-2", "r-3") for s in model.rollouts[r].segments.values()]
    _, fact = train_step(2, ["g1"], later, AT + 5000)
    model.add(Entry("train-steps", 0, 1, AT, None, "train_step", fact))
    assert [e.record["step"] for e in trained_by(model, model.rollouts["r-2"])] == [2]  # type: ignore[index]
    again = Entry("train-steps", 0, 2, AT, None, "train_step", {**fact, "segment_ids": []})
    model.add(again)  # a restarted trainer's second copy of step 2: the first is kept
    assert model.steps[2].offset == 1 and overview(model)["train_steps"] == 2


def test_the_rollout_page_shows_the_step_that_trained_it_with_its_figures() -> None:
    pages = Pages(fold(entries(run_events())), "test")
    page = pages.rollout("r-0")
    assert page is not None
    assert '<a class="step" href="/topics?topic=train-steps&offset=0">step 1</a>' in page
    assert 'id="trained-by"' in page and '<td class="logprob_diff_max">0.4375</td>' in page
    assert '<td class="staleness_mean">0.25</td>' in page
    untrained = pages.rollout("r-2")
    assert untrained is not None and 'id="untrained"' in untrained and 'id="trained-by"' not in untrained


def test_token_runs_cover_the_response_in_order_one_colour_each() -> None:
    segment = masked(bytes([0, 0, 1, 1, 0, 0, 1, 0]), [-1, -1, 3, 3, 3, 3, 4, -1])
    assert token_runs(segment) == [("ctx", 0, 2), ("trained", 2, 4), ("drift", 4, 6), ("trained", 6, 7),
                                   ("ctx", 7, 8)]  # fmt: skip
    assert token_runs(masked(b"", [])) == []


def test_segment_rows_carry_counts_a_drift_mark_and_the_freeze_reason() -> None:
    model = fold(entries(run_events()))
    rows = segment_rows(model.rollouts["r-0"])
    assert [r["kind"] for r in rows] == ["subagent", "wipe", "final"]
    assert [r["drift"] for r in rows] == [0, 0, 2]
    assert rows[-1]["html"].count('class="mark drift"') == 1
    assert "frozen: compaction" in rows[1]["html"] and "frozen: subagent" in rows[0]["html"]
    assert sum(r["reward"] for r in rows) == rows[0]["trajectory_reward"]


def test_the_browser_filters_by_partition_offset_time_and_rollout_and_pages() -> None:
    model = fold(entries(run_events()))
    turns = model.log["turns"]
    of_r1 = [e for e in turns if e.key == "r-1"]
    picked, more = browse(model, Browse("turns", rollout_id="r-1", limit=3))
    assert picked == of_r1[:3] and more
    rest, more = browse(model, Browse("turns", rollout_id="r-1", skip=3, limit=100))
    assert picked + rest == of_r1 and not more
    p = turns[0].partition
    got, _ = browse(model, Browse("turns", partition=p, offset=2))
    assert got == [e for e in turns if e.partition == p and e.offset >= 2] and got
    late = Entry("turns", 0, 1000, AT + 60_000, "r-9", None, None, "bad magic")
    model.add(late)
    assert browse(model, Browse("turns", since_ms=AT + 1)) == ([late], False)
    assert browse(ReadModel(), Browse("turns")) == ([], False)


def test_long_arrays_and_bytes_fold_and_text_is_escaped() -> None:
    html = folded_html({"ids": list(range(20)), "mask": bytes([1, 0] * 10), "note": "<script>x</script>"})
    assert html.count("<details") == 2 and "[20 ids: 0, 1, 2 … 19]" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<details" not in folded_html([1, 2, 3])


def test_pages_render_every_page_and_say_when_a_rollout_is_unknown() -> None:
    pages = Pages(fold(entries(run_events())), "test")
    assert 'href="/rollout/r-0"' in pages.overview()
    page = pages.rollout("r-0")
    assert page is not None and 'id="count-trained"' in page and "frozen: compaction" in page
    assert pages.rollout("nope") is None
    assert "r-1" in pages.topics(Browse("turns", rollout_id="r-1"))


def test_throughput_counts_each_topics_events_of_the_last_minute() -> None:
    model = ReadModel()
    for offset, at in enumerate((AT - 70_000, AT - 30_000, AT - 1, AT)):
        model.add(Entry("policy", 0, offset, at, "policy", "policy",
                        {"version": offset, "location": "x", "published_at": at}))  # fmt: skip
    assert throughput(model, AT) == {"policy": 3 / 60}
    assert throughput(model, AT + 120_000) == {"policy": 0.0}
    assert policy_offset(model, 2) == 2 and policy_offset(model, 9) is None
