"""A rollout's events -> its reward/K segments: the segmenter's state machine (pure, no I/O).

The segmenter, ``rollbus rebuild segments`` and the tests all drive this module, so a live run and a
replay of the raw topics cut the same segments. One :class:`RolloutState` per rollout id collects
*facts* from the four co-partitioned topics (turns, sessions, diffs, rewards) in whatever order they
interleave:

* a fact has an identity (a turn's is (attempt, chain, turn index)); a second fact with the same identity
  and digest is a writer's retry, dropped and counted; one with another digest is a conflict, and the
  rollout is dead-lettered with the reason;
* turn bodies are kept apart, as the bytes that were published (the prompt-reference encoding): the state
  holds only digests and counts, so it grows with turns, not tokens, and no prompt is ever resolved;
* the rollout is complete when the rewarded attempt was closed (a ``closed`` session event) and every main
  and sub-agent chain of that attempt ended (``frozen``/``closed``) with all the turns its end event
  counts. Then its segments are cut in the order the chains froze, the live main chain last (``final``);
  other attempts, side chains, unattributed chains and chains that ended ``ambiguous`` never train;
* a rollout that never completes is aborted by a clock fact (:func:`expire`), emitting nothing.

Terminal states (emitted, aborted, dead) are kept for a while *sealed* (a deduplication record, not a Kafka
tombstone), so a redelivered event is recognised as a duplicate after a crash, and a new turn or reward for a
finished rollout is dead-lettered instead of silently starting a second life. A sealed state is compact
(:func:`seal`): its turn and session digests shrink to one 8-byte fingerprint per fact, about a fifth of the
open state's size.
"""

from rollbus.services.segmenter.segmentation.completion import (
    chain_routes,
    complete,
    cut,
    expire,
    freeze_order,
    group_of,
    missing,
    segment_id,
    segment_record,
)
from rollbus.services.segmenter.segmentation.driver import (
    Handled,
    Options,
    Segmenter,
    WrongKey,
    body_key,
    decode_fact,
)
from rollbus.services.segmenter.segmentation.merge import apply, fingerprint, kill, reward_loss_scope, seal
from rollbus.services.segmenter.segmentation.state import (
    FACT_KINDS,
    TRAINABLE,
    ChainFacts,
    Conflict,
    Fact,
    FactKind,
    RolloutState,
    Status,
    Step,
)
from rollbus.trajectory import AMBIGUOUS

__all__ = [
    "AMBIGUOUS", "FACT_KINDS", "TRAINABLE", "ChainFacts", "Conflict", "Fact", "FactKind", "Handled",
    "Options", "RolloutState", "Segmenter", "Status", "Step", "WrongKey", "apply", "body_key",
    "chain_routes", "complete", "cut", "decode_fact", "expire", "fingerprint", "freeze_order",
    "group_of", "kill", "missing", "reward_loss_scope", "seal", "segment_id", "segment_record",
]  # fmt: skip
