"""The rollout page with the project's real tokenizer: each turn's new prompt suffix and output as text, and
the token view's coloured runs as the text of their tokens."""

from __future__ import annotations

from html import escape

from rollbus.events import SegmentEvent
from rollbus.services.ui.app import Pages
from rollbus.services.ui.main import decoder
from rollbus.services.ui.model import fold
from rollbus.services.ui.views import token_runs
from tests.ui_support import entries, run_events


def test_turns_and_token_runs_are_shown_as_the_tokenizer_decodes_them() -> None:
    decode = decoder("qwen3.6")
    assert decode is not None and decoder("") is None
    events = run_events()
    page = Pages(fold(entries(events)), "test", decode=decode).rollout("r-0")
    assert page is not None
    turns = [r for t, r in events if t == "turns" and r["rollout_id"] == "r-0"]
    for turn in turns:
        assert f'<pre class="text">{escape(decode(turn["output_ids"]))}</pre>' in page
    segments = [r for t, r in events if t == "segments" and r["rollout_id"] == "r-0"]
    final = next(s for s in segments if s["kind"] == "final")
    runs = token_runs(SegmentEvent.from_dict(final))
    for cls, start, end in runs:  # every run of one colour reads as its tokens' text
        ids = final["response_ids"][start:end]
        assert f'<span class="tok {cls}" data-n="{len(ids)}">{escape(decode(ids))}</span>' in page
