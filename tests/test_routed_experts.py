"""Routed experts as a claim check: SGLang's wire format in, the content-addressed store, the references a
turn and a segment carry, and the trainer fetching them (digest checked) for routing replay.

The "engine" here is the plain transformers MoE of ``tests/test_trainer_routing_replay.py`` with a hook that
records each router's top-k: independent of ``rollbus.trainer.routing_replay``.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollbus import codec
from rollbus.routed_experts import (
    RoutesCorrupt,
    RoutesError,
    RoutesRef,
    RoutesStore,
    RoutesUnavailable,
    cover,
    from_sglang,
    load,
    narrow,
)
from rollbus.services.adapter.turn import routes_start
from rollbus.services.segmenter.segmentation import chain_routes
from rollbus.trainer.batch import Group, InvalidSegment, fetch_routes, segment_inputs, validate
from rollbus.trainer.loss import LossConfig, PolicyForward, SegmentInput, batch_loss
from rollbus.trainer.metrics import mismatch
from rollbus.trainer.routing_replay import MoeShape, RoutingReplay
from rollbus.trajectory import Turn
from tests.event_samples import segment, turn
from tests.test_trainer_routing_replay import SPEC, VOCAB, moe_model, near_tied, rollout


def sglang_answer(ids: np.ndarray) -> str:
    """What SGLang's ``meta_info["routed_experts"]`` holds for ``[rows, layers, top_k]`` ids."""
    return base64.b64encode(np.ascontiguousarray(ids, np.int32).tobytes()).decode()


# ------------------------------------------------------------------------------- the store


def test_ids_are_stored_narrowed_under_their_digest_and_read_back_exactly(tmp_path) -> None:
    store = RoutesStore(tmp_path)
    ids = np.arange(5 * 6, dtype=np.int32).reshape(5, 6) % 128
    ref = store.put(ids, start=3)
    assert (ref.dtype, ref.start, ref.rows, ref.width) == ("uint8", 3, 5, 6)
    assert store.path(ref.digest).stat().st_size == 30  # one byte an id
    np.testing.assert_array_equal(store.get(ref), ids)
    assert store.put(ids, start=3) == ref  # idempotent: a retry writes nothing new
    assert len(list(tmp_path.rglob("*"))) == 2  # the fan-out directory and one file, no temporaries
    assert narrow(np.array([300])).dtype == np.uint16 and narrow(np.array([70_000])).dtype == np.int32
    with pytest.raises(RoutesError, match="negative"):
        narrow(np.array([-1]))


def test_a_wrong_digest_is_refused_with_a_clear_error_and_the_store_loses_nothing(tmp_path) -> None:
    store = RoutesStore(tmp_path)
    ids = np.array([[1, 2], [3, 4]], np.int32)
    ref = store.put(ids, start=0)
    wrong = RoutesRef("0" * 64, ref.dtype, 0, 2, 2)
    with pytest.raises(RoutesUnavailable, match=f"no routed experts under digest {'0' * 64}"):
        store.get(wrong)
    with pytest.raises(RoutesUnavailable, match="not a SHA-256 digest"):
        store.get(RoutesRef("../../etc/passwd", "uint8", 0, 2, 2))
    with pytest.raises(RoutesCorrupt, match="the reference says 3 x 2 uint8"):
        store.get(RoutesRef(ref.digest, "uint8", 0, 3, 2))
    path = store.path(ref.digest)
    path.write_bytes(bytes([1, 2, 3, 5]))  # the bytes changed after the digest was taken
    with pytest.raises(RoutesCorrupt, match="hash to"):
        store.get(ref)
    assert path.read_bytes() == bytes([1, 2, 3, 5])  # refused, not repaired or deleted


def test_sglang_answers_that_are_not_the_rows_asked_for_are_refused() -> None:
    ids = np.arange(12).reshape(3, 4)
    np.testing.assert_array_equal(from_sglang(sglang_answer(ids), 3), ids)
    for bad, rows, reason in [("not base64!", 3, "not base64"), (sglang_answer(ids), 5, "do not make 5 rows"),
                              (base64.b64encode(b"abc").decode(), 1, "not int32s"),
                              (sglang_answer(ids), 0, "where no row")]:  # fmt: skip
        with pytest.raises(RoutesError, match=reason):
            from_sglang(bad, rows)


# ------------------------------------------------------------------------------- which rows a turn asks for


def test_a_turn_extending_its_chain_asks_from_the_previous_turns_last_sampled_token() -> None:
    previous = Turn([1, 2, 3], [7, 8], [-0.1, -0.2], "stop", 0, chain_id="main", turn_index=0)
    # the previous request computed positions 0..3 (its last sampled token, 8 at position 4, never went in)
    assert routes_start([1, 2, 3, 7, 8, 9, 10], previous) == 4
    assert routes_start([1, 2, 3, 7, 8], previous) == 4  # nothing new but the last token: still one row
    assert routes_start([1, 2, 4, 7, 8, 9], previous) == 0  # diverged: the whole prompt
    assert routes_start([1, 2, 3], None) == 0


def test_cover_stitches_each_turns_new_rows_and_refuses_gaps_and_overruns() -> None:
    def ref(start: int, rows: int, width: int = 4) -> RoutesRef:
        return RoutesRef("d" * 64, "uint8", start, rows, width)

    # turn 0: prompt 3 + output 2 -> rows 0..3; turn 1 from 4: prompt 7 + output 3 -> rows 4..8; T = 10
    assert cover([ref(0, 4), ref(4, 5)], 10) == [(ref(0, 4), 0), (ref(4, 5), 0)]
    assert cover([ref(0, 4), ref(0, 9)], 10) == [(ref(0, 4), 0), (ref(0, 9), 4)]  # asked from 0: new rows
    assert cover([ref(0, 4), ref(5, 4)], 10) is None  # row 4 missing
    assert cover([ref(0, 4), ref(4, 6)], 10) is None  # a row past T - 2
    assert cover([ref(0, 4), ref(4, 5, width=6)], 10) is None  # two shapes of model
    assert cover([ref(0, 4)], 10) is None


# ------------------------------------------------------------------------------- on the wire


def test_a_turn_and_a_segment_with_routed_experts_round_trip_and_old_events_read_none() -> None:
    routes = {"digest": "a" * 64, "dtype": "uint8", "start": 4, "rows": 5, "width": 6}
    record = turn(routed_experts=routes)
    assert codec.decode(codec.encode("turn", record)).record["routed_experts"] == routes
    seg = {**segment(), "routed_experts": [routes, {**routes, "start": 9}]}
    assert codec.decode(codec.encode("segment", seg)).record["routed_experts"] == seg["routed_experts"]
    assert codec.decode(codec.encode("turn", turn())).record["routed_experts"] is None
    assert codec.decode(codec.encode("segment", segment())).record["routed_experts"] is None


def test_the_turn_digest_covers_its_routed_experts_reference() -> None:
    from rollbus.turn_log import turn_digest

    routes = {"digest": "a" * 64, "dtype": "uint8", "start": 4, "rows": 5, "width": 6}
    plain = turn()
    assert turn_digest({**plain, "routed_experts": None}) == turn_digest(plain)  # kept digests stay valid
    assert turn_digest({**plain, "routed_experts": routes}) != turn_digest(plain)
    assert turn_digest({**plain, "routed_experts": routes}) != turn_digest(
        {**plain, "routed_experts": {**routes, "digest": "b" * 64}}
    )


# ------------------------------------------------------------------------------- engine -> store -> trainer


def two_turn_chain(tmp_path):
    """An MoE "engine" samples a two-turn chain; each turn's routes are what SGLang would return for the
    start the adapter asks for, put in the store as the adapter does. Returns the pieces a test needs."""
    trainer_model, engine = near_tied()
    prompt = [7, 2, 33, 80, 14]
    ids, sampled, routes = rollout(engine, prompt, 20, seed=4)  # routes: positions 0..T-2, int32
    store = RoutesStore(tmp_path / "routes")
    first_output = 8  # turn 0 sampled ids[5:13]; turn 1's prompt adds ids[13:16], it sampled ids[16:]
    turn0 = Turn(prompt, ids[5:13], sampled[:8].tolist(), "stop", 0, chain_id="main", turn_index=0)
    refs = []
    for turn_prompt, output, previous in [(prompt, ids[5:13], None), (ids[:16], ids[16:], turn0)]:
        start = routes_start(turn_prompt, previous)
        seqlen = len(turn_prompt) + len(output)
        answer = sglang_answer(routes[start : seqlen - 1].reshape(seqlen - 1 - start, -1).numpy())
        refs.append(store.put(from_sglang(answer, seqlen - 1 - start), start))
    assert [r.start for r in refs] == [0, len(prompt) + first_output - 1]  # the edge: the last sampled token
    records = [{"routed_experts": ref.as_record()} for ref in refs]
    wire = chain_routes(records, len(ids))
    assert wire is not None
    mask = bytes([1] * 8 + [0] * 3 + [1] * 9)  # the response ids[5:]: the two outputs trained
    seg = {
        "segment_id": "r/a/0", "rollout_id": "r", "group_id": "g", "index": 0, "num_segments": 1,
        "prompt_ids": prompt, "response_ids": ids[5:], "loss_mask": mask,
        "rollout_logprobs": [lp if m else 0.0 for lp, m in zip(sampled.tolist(), mask, strict=True)],
        "policy_versions": [0] * 20, "trajectory_reward": 1.0, "reward": 1.0, "attempt_id": "a",
        "routed_experts": [ref.to_dict() for ref in wire],  # as the trainer decodes them
    }  # fmt: skip
    return trainer_model, store, seg, routes


def test_the_trainer_replays_exactly_what_the_engine_routed(tmp_path) -> None:
    trainer_model, store, seg, routes = two_turn_chain(tmp_path)
    shape = MoeShape.of(trainer_model)
    fetched = fetch_routes(seg, store, shape)
    np.testing.assert_array_equal(fetched["routed_experts"], routes.numpy())  # rows 0..T-2, every layer
    validate(fetched, VOCAB, shape)
    other = {**seg, "segment_id": "q/a/0", "rollout_id": "q", "trajectory_reward": 0.0}
    group = Group("g", {"r": {0: fetched}, "q": {0: fetch_routes(other, store, shape)}})
    inputs = [i for i in segment_inputs([group], normalize_std=True) if i.advantage > 0]
    replay = RoutingReplay(trainer_model)
    _, on = batch_loss(PolicyForward(trainer_model, replay), inputs, LossConfig(), backward=False)
    assert on.replayed == on.tokens == 17
    assert on.abs_diff_max < 1e-4, on  # the engine's logprobs, to float tolerance
    assert on.routes_agreed < on.route_positions == 24  # the engine's noise flipped some near-tied experts
    replay.close()  # the hook gone, the same segment routes on the trainer's near-tied logits
    _, off = batch_loss(PolicyForward(trainer_model, replay), inputs, LossConfig(), backward=False)
    assert off.abs_diff / off.tokens > 1e-2, off


def test_a_segment_whose_reference_is_wrong_is_refused_with_the_reason_and_kept_whole(tmp_path) -> None:
    trainer_model, store, seg, _ = two_turn_chain(tmp_path)
    shape = MoeShape.of(trainer_model)
    forged = {**seg, "routed_experts": [{**seg["routed_experts"][0], "digest": "f" * 64},
                                         seg["routed_experts"][1]]}  # fmt: skip
    before = dict(forged)
    with pytest.raises(InvalidSegment, match=f"segment 'r/a/0': no routed experts under digest {'f' * 64}"):
        fetch_routes(forged, store, shape)
    assert forged == before  # the record the trainer dead-letters is the one it got
    short = {**seg, "routed_experts": seg["routed_experts"][:1]}
    with pytest.raises(InvalidSegment, match="do not cover positions 0..23"):
        fetch_routes(short, store, shape)
    wide = MoeShape(layers=SPEC.layers + 1, top_k=2, experts=8, moe_layers=(0, 1, 2, 3))
    with pytest.raises(InvalidSegment, match="6 routed experts a position, the model has 4 layers"):
        fetch_routes(seg, store, wide)
    assert fetch_routes(seg, store, None)["routed_experts"] is None  # dense, or replay off: never read
    np.testing.assert_array_equal(
        load(cover([RoutesRef.of(r) for r in seg["routed_experts"]], 25), store).shape, (24, 6)
    )
    assert isinstance(torch.as_tensor(fetch_routes(seg, store, shape)["routed_experts"]), torch.Tensor)


def test_routing_agreement_is_whole_when_the_trainer_would_have_routed_the_same() -> None:
    model = moe_model()
    ids, sampled, routes = rollout(model, [5, 17, 3, 44, 9, 61], 10, seed=1)
    segment_input = SegmentInput(torch.tensor(ids), torch.arange(6, len(ids)), sampled, 1.0, 1.0,
                                 routed_experts=routes)  # fmt: skip
    replay = RoutingReplay(model)
    _, stats = batch_loss(PolicyForward(model, replay), [segment_input], LossConfig(), backward=False)
    assert stats.routes_agreed == stats.route_positions == len(ids) - 1
    assert mismatch(stats)["routing_agreement"] == 1.0


def test_a_segment_the_buffer_will_drop_is_known_before_its_routes_are_fetched() -> None:
    from rollbus.trainer.batch import GroupBuffer

    buffer = GroupBuffer(group_size=2)
    first = {"segment_id": "r/a/0", "rollout_id": "r", "group_id": "g", "index": 0, "num_segments": 1,
             "attempt_id": "a", "trajectory_reward": 1.0, "created_at": 0}  # fmt: skip
    assert not buffer.dropped(first)
    buffer.add(first)
    assert buffer.dropped(first)  # a duplicate
    buffer.abandon("g")
    assert buffer.dropped({**first, "segment_id": "q/a/0", "rollout_id": "q"})  # late: its group finished


def test_prune_deletes_ids_past_their_retention_and_a_new_put_restarts_their_age(tmp_path) -> None:
    store = RoutesStore(tmp_path)
    old, fresh, again = (store.put(np.full((3, 2), v, np.int32), start=0) for v in (1, 2, 3))
    abandoned = store.path(old.digest).parent / ".tmp-abandoned"
    abandoned.write_bytes(b"half a write")
    now = time.time()
    for ref_or_path, age in ((old, 7200), (fresh, 60), (again, 7200), (abandoned, 7200)):
        path = ref_or_path if isinstance(ref_or_path, Path) else store.path(ref_or_path.digest)
        os.utime(path, (now - age, now - age))
    assert store.put(np.full((3, 2), 3, np.int32), start=0) == again  # referenced again: young again

    old_size = store.path(old.digest).stat().st_size

    files, size = store.prune(older_than=3600, now=now)

    assert (files, size) == (2, old_size + len(b"half a write"))
    assert not store.path(old.digest).exists() and not abandoned.exists()
    assert (store.get(fresh) == 2).all() and (store.get(again) == 3).all()
    with pytest.raises(RoutesUnavailable, match=f"no routed experts under digest {old.digest}"):
        store.get(old)  # the trainer dead-letters such a segment with this reason
    assert store.prune(older_than=3600, now=now) == (0, 0)
