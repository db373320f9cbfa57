"""The UI's HTTP surface over a folded model (no broker): bad input gets a clear answer, never a crash."""

from __future__ import annotations

from fastapi.testclient import TestClient

from rollbus.services.ui.app import Pages, create_app
from rollbus.services.ui.model import fold
from tests.ui_support import entries, run_events


def client() -> TestClient:
    return TestClient(create_app(Pages(fold(entries(run_events())), "test")))


def test_a_bad_time_an_unknown_topic_or_rollout_are_answered_in_words() -> None:
    with client() as http:
        bad = http.get("/topics", params={"topic": "turns", "since": "yesterday"})
        assert bad.status_code == 400 and "--since wants an ISO time" in bad.text
        assert http.get("/topics", params={"topic": "secrets"}).status_code == 404
        missing = http.get("/rollout/nope")
        assert missing.status_code == 404 and "no events of rollout" in missing.text
        assert http.get("/topics", params={"topic": "turns", "partition": "x"}).status_code == 200  # all


def test_the_time_filter_pages_and_the_json_figures() -> None:
    with client() as http:
        later = http.get("/topics", params={"topic": "turns", "since": "2100-01-01T00:00:00Z"})
        assert later.status_code == 200 and "no events" in later.text
        first = http.get("/topics", params={"topic": "turns", "limit": 20}).text
        assert first.count('class="entry"') == 20 and "skip=20" in first
        rest = http.get("/topics", params={"topic": "turns", "limit": 20, "skip": 20}).text
        turns = sum(1 for topic, _ in run_events() if topic == "turns")
        assert rest.count('class="entry"') == turns - 20 > 0 and 'id="next"' not in rest
        figures = http.get("/api/overview").json()
        assert figures["rollouts"]["finished"] == 4 and set(figures["per_second"]) == set(figures["events"])
        assert http.get("/static/ui.js").status_code == 200
