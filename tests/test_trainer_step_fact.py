"""The step's fact on ``train-steps`` is its log row cut to the schema: pure, no broker."""

from __future__ import annotations

from rollbus.codec import decode, encode
from rollbus.trainer.metrics import step_fact
from tests.event_samples import SAMPLES


def test_the_fact_is_the_rows_fields_the_schema_names_and_encodes() -> None:
    row = {**SAMPLES["train_step"], "infos": 0, "duplicates_dropped": 3, "unreplayed_approx_kl": 0.5}
    del row["routing_agreement"]  # a dense model's row has none
    fact = step_fact(row)
    assert fact is not None and fact.to_dict() == {**SAMPLES["train_step"], "routing_agreement": None}
    assert decode(encode("train_step", fact)).record == {**fact.to_dict(), "schema_version": 1}
    again = step_fact({**row, "routing_agreement": 0.875})
    assert again is not None and again.routing_agreement == 0.875


def test_a_row_from_before_the_facts_gives_none_rather_than_a_made_up_fact() -> None:
    """A checkpoint written by a trainer that did not publish its steps: its row has no segment ids."""
    row = {k: v for k, v in SAMPLES["train_step"].items() if k not in ("segment_ids", "trained_at")}
    assert step_fact(row) is None
