"""Issue 12: the gym info dicts a step trained on land in the trainer's log (``infos.jsonl``).

The segments here are cut by the real segmenter from a gym episode as the gym runner writes it; the Trainer's
own wiring (a real broker, a real tiny model) is exercised in tests/test_trainer_service.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollbus.codec import decode, encode
from rollbus.events import spec
from rollbus.services.segmenter.segmentation import FACT_KINDS, Fact, Segmenter
from rollbus.trainer.metrics import MetricsLog, info_count, info_rows
from tests.synthetic_rollouts import RolloutWriter, simple_rollout

INFOS = [{"reset": True, "map": "SFFG"}, {"step": 1, "action": "right"}, {"step": 2, "solved": True}]
TOPIC_EVENT = {e.topic: e.event_type for e in (spec("turn"), spec("session"), spec("diff"), spec("reward"))}


def cut(writer: RolloutWriter, infos: str | None) -> list[dict]:
    """The segments the real segmenter emits for ``writer``'s rollout, through the wire format both ways."""
    segmenter = Segmenter({}, {})
    events = writer.events
    if infos is not None:
        events = [*events[:-1], ("rewards", dict(events[-1][1], infos=infos))]
    segments = []
    for at, (topic, record) in enumerate(events):
        raw = encode(TOPIC_EVENT[topic], record)
        outcome = segmenter.handle(Fact(FACT_KINDS[topic], decode(raw).record, at), raw)
        segments += [decode(encode("segment", s)).record for s in outcome.segments]
        segmenter.settle(outcome)
    return segments


def gym_episode(rollout_id: str, reward: float) -> RolloutWriter:
    writer = RolloutWriter(rollout_id)
    writer.turn("main", "main", [1, 2, 3], 4)
    writer.turn("main", "main", [21, 22], 3)
    writer.close()
    writer.reward(reward, details='{"kind": "gym"}')
    return writer


def test_a_gym_episodes_infos_land_in_infos_jsonl_once_with_its_reward(tmp_path: Path) -> None:
    gym = cut(gym_episode("episode-1", 1.0), json.dumps(INFOS))
    coding = cut(simple_rollout("swe-1"), None)  # three segments, infos "[]"
    log = MetricsLog(tmp_path)
    rows = info_rows([*coding, *gym], step=4, version=4)
    log.write_infos(rows)
    lines = [json.loads(line) for line in (tmp_path / "infos.jsonl").read_text().splitlines()]
    assert lines == [{"step": 4, "version": 4, "rollout_id": "episode-1", "reward": 1.0, "infos": INFOS}]
    assert info_count(rows) == 3


def test_an_episode_cut_into_several_segments_is_logged_once_from_its_final_segment() -> None:
    segments = cut(simple_rollout("multi"), json.dumps(INFOS))
    assert [s["kind"] for s in segments] == ["subagent", "wipe", "final"]
    rows = info_rows(segments, step=1, version=1)
    assert [(r["rollout_id"], r["infos"]) for r in rows] == [("multi", INFOS)]


def test_a_step_without_infos_writes_no_file(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    rows = info_rows(cut(simple_rollout("swe-2"), None), step=1, version=1)
    log.write_infos(rows)
    assert rows == [] and info_count(rows) == 0 and not (tmp_path / "infos.jsonl").exists()


def test_infos_that_are_not_a_json_list_are_logged_raw_and_flagged_not_dropped(tmp_path: Path) -> None:
    """The env (or a policy steering it) writes whatever it likes into info; the trainer must not crash."""
    bad = ['{"not": "a list"}', "[1, 2", "\u0000\ud7ff", '"[]"', "null"]
    segments = [cut(gym_episode(f"bad-{i}", 0.0), raw)[0] for i, raw in enumerate(bad)]
    log = MetricsLog(tmp_path)
    rows = info_rows(segments, step=2, version=3)
    log.write_infos(rows)
    lines = [json.loads(line) for line in (tmp_path / "infos.jsonl").read_text().splitlines()]
    assert [(line["infos"], line["malformed"]) for line in lines] == [(raw, True) for raw in bad]
    assert info_count(rows) == 0


def test_infos_accumulate_across_steps(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    for step in (1, 2):
        log.write_infos(info_rows(cut(gym_episode(f"e{step}", 0.5), json.dumps(INFOS[:step])), step, step))
    lines = [json.loads(line) for line in (tmp_path / "infos.jsonl").read_text().splitlines()]
    assert [(line["step"], len(line["infos"])) for line in lines] == [(1, 1), (2, 2)]
