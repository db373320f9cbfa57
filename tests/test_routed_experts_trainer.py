"""The trainer service on a tiny Qwen3-MoE against a real broker: segments whose routed-experts references
resolve are replayed; one whose reference names ids the store does not hold goes to dead-letters whole, with
the reason, and its group is dropped, not trained on its own routing; ids past their retention are deleted
after the step."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from rollbus.codec import decode
from rollbus.kafka.topics import topic_name
from rollbus.routed_experts import RoutesStore
from rollbus.trainer.learner import Learner
from rollbus.trainer.service import Trainer
from tests.test_trainer_service import one_partition_namespace, publish, read_topic, segment, settings

pytestmark = pytest.mark.kafka
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_expert_size": 8}


def with_routes(record: dict, store: RoutesStore) -> dict:
    """``record`` with routes of every position but the last (SGLang's rows), two of its experts each."""
    tokens = len(record["prompt_ids"]) + len(record["response_ids"])
    rows = np.array([[r % 4, (r + 1) % 4] for r in range(tokens - 1)], np.int32)  # one layer, top-2
    return {**record, "routed_experts": [store.put(rows, start=0).as_record()]}


async def test_replayed_segments_train_and_a_forged_reference_is_dead_lettered_whole(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    namespace = await one_partition_namespace(kafka_bootstrap)
    store = RoutesStore(tmp_path / "routes")
    good = [with_routes(segment("g", f"g-r{r}", 0, 1, float(r)), store) for r in range(2)]
    kept = with_routes(segment("p", "p-r0", 0, 1, 1.0), store)
    forged = with_routes(segment("p", "p-r1", 0, 1, 0.0), store)
    forged["routed_experts"] = [{**forged["routed_experts"][0], "digest": "f" * 64}]
    await publish(kafka_bootstrap, namespace, [kept, forged, *good])
    stored = sorted(store.directory.glob("??/*"))
    for path in stored:  # stored two days ago: past the default retention once the step has read them
        os.utime(path, (time.time() - 2 * 86400,) * 2)

    config = settings(
        kafka_bootstrap, namespace, tmp_path / "ckpt", steps=1, routed_experts_dir=store.directory, **MOE
    )
    trainer = Trainer(Learner.resume(config))
    await asyncio.wait_for(trainer.run(), 300)

    dead = await read_topic(kafka_bootstrap, topic_name("dead-letters", namespace))
    assert len(dead) == 1 and f"no routed experts under digest {'f' * 64}" in dead[0].record["error"]
    assert decode(dead[0].record["value"]).record["routed_experts"] == forged["routed_experts"]  # kept whole
    assert trainer.counters["poisoned_groups_dropped"] == 1
    row = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["groups"] == 1 and row["replayed_fraction"] == 1.0  # group g, on the recorded routes
    assert 0.0 <= row["routing_agreement"] <= 1.0
    assert stored and not any(path.exists() for path in stored), "pruned after the step that read them"
    assert trainer.counters["routed_experts_pruned"] == len(stored)
