"""``rollbus ui`` end to end in a real headless browser: Debian's chromium (bootstrap.sh --test installs it)
driven by Playwright, over a broker holding the events the pipeline writes. Screenshots go to pytest's tmp dir
(the path is printed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from playwright.async_api import async_playwright

from rollbus.kafka.broker import free_port
from rollbus.polling import wait_until
from tests.segmenter_support import namespace_of, publish
from tests.service_process import ServiceProcess
from tests.ui_support import run_events

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
async def ui(kafka_bootstrap: str, topics: dict[str, str], tmp_path: Path):
    """The events of two rounds on the bus, and ``rollbus ui`` caught up with them: (its URL, the events)."""
    events = run_events()
    await publish(kafka_bootstrap, topics, events)
    port = free_port()
    args = ["--bootstrap-servers", kafka_bootstrap, "--namespace", namespace_of(topics), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    service = ServiceProcess("ui", args, health_url=f"{url}/api/overview", log_dir=tmp_path)
    service.start(timeout=120)
    try:
        caught_up = lambda: sum(httpx.get(f"{url}/api/overview").json()["events"].values()) == len(events)  # noqa: E731
        wait_until(caught_up, timeout=120, interval=0.3, what="the UI catching up")
        yield url, events
    finally:
        service.stop()


async def test_overview_to_rollout_to_topics_in_a_real_browser(ui, tmp_path: Path) -> None:
    url, events = ui
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"screenshots in {shots}")
    assert Path(CHROMIUM).exists(), "no chromium: scripts/bootstrap.sh --test (make test) installs it"
    segments = [r for t, r in events if t == "segments" and r["rollout_id"] == "r-0"]
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)  # a loaded 2-core machine: patience, not speed, is under test
        await page.goto(url + "/")
        assert await page.locator("[data-k='rollouts.finished']").inner_text() == "4"
        await page.screenshot(path=shots / "overview.png", full_page=True)

        await page.locator("a.rollout-link", has_text="r-0").click()
        await page.wait_for_selector("body[data-tokens-counted='yes']")
        assert page.url.endswith("/rollout/r-0")
        trained = sum(sum(s["loss_mask"]) for s in segments)
        versions = [pair for s in segments for pair in zip(s["loss_mask"], s["policy_versions"], strict=True)]
        drift = sum(1 for m, v in versions if not m and v >= 0)
        assert int(await page.locator("#count-trained").inner_text()) == trained > 0
        assert int(await page.locator("#count-drift").inner_text()) == drift == 2
        assert await page.locator("#trajectory mark.drift").count() == 1
        assert [int(c) for c in await page.locator("td.seg-trained").all_inner_texts()] == [
            sum(s["loss_mask"]) for s in sorted(segments, key=lambda s: s["index"])
        ]
        assert await page.locator("a.step").all_inner_texts() == ["step 1"]  # as train-steps says
        assert await page.locator("#trained-by td.tokens_trained").inner_text() == str(
            sum(sum(s["loss_mask"]) for t, s in events if t == "segments" and s["group_id"] == "g0")
        )
        await page.screenshot(path=shots / "rollout.png", full_page=True)

        await page.locator("a", has_text="turns").first.click()
        await page.wait_for_selector("#entries")
        keys = await page.locator("tr.entry td:nth-child(4)").all_inner_texts()
        assert keys and set(keys) == {"r-0"}

        await page.goto(url + "/topics?topic=turns&offset=0")
        offsets = [int(o) for o in await page.locator("tr.entry td:nth-child(2)").all_inner_texts()]
        assert 0 in offsets and len(offsets) == min(100, sum(1 for t, _ in events if t == "turns"))
        await page.locator("tr.entry details.fold summary").first.click()  # a folded array opens
        assert await page.locator("tr.entry details.fold[open]").count() == 1
        await page.screenshot(path=shots / "topics.png", full_page=True)
        await browser.close()
    assert all((shots / name).stat().st_size > 0 for name in ("overview.png", "rollout.png", "topics.png"))
