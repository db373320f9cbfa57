"""``rollbus ui --demo`` opens a finished demo: the run's embedded broker is started from its state dir (and
stopped with the UI), its namespace is the last demo run recorded there, and the trainer's steps show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from rollbus.demo_runs import record_demo
from rollbus.kafka.broker import EmbeddedBroker, free_port
from rollbus.kafka.topics import TOPICS, create_topics, topic_name
from rollbus.polling import wait_until
from tests.segmenter_support import publish
from tests.service_process import ServiceProcess
from tests.ui_support import run_events

ROOT = Path(__file__).resolve().parents[1]


def test_without_a_recorded_demo_it_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "ui", "--demo", "--state-dir", str(tmp_path), "--tokenizer", ""],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "no demo run recorded in" in done.stderr, done.stderr


async def test_it_opens_a_finished_demo_and_stops_the_broker_it_started(tmp_path: Path) -> None:
    state, namespace, events = tmp_path / "state", "demo-20261126-120000-abcd", run_events()
    broker = EmbeddedBroker(state / "up", port=free_port())
    broker.start(timeout=120)
    try:  # a finished demo: its topics, its run recorded, its trainer's metrics; then its broker stopped
        await create_topics(broker.bootstrap_servers, 2, namespace)
        topics = {spec.name: topic_name(spec.name, namespace) for spec in TOPICS}
        await publish(broker.bootstrap_servers, topics, events)
    finally:
        broker.stop()
    record_demo(state / "up", namespace)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--demo", "--state-dir", str(state), "--port", str(port), "--tokenizer", ""]
    ui = ServiceProcess("ui", args, health_url=f"{url}/api/overview", log_dir=tmp_path)
    ui.start(timeout=240)  # the broker starts first
    try:
        count = lambda: sum(httpx.get(f"{url}/api/overview").json()["events"].values())  # noqa: E731
        wait_until(lambda: count() == len(events), timeout=120, interval=0.3, what="the demo's events")
        page = httpx.get(url + "/").text
        assert namespace in page and 'id="steps"' in page and "0.25" in page  # the step's fact, its staleness
        assert broker.is_running()
        assert ui.proc is not None
        ui.proc.terminate()  # the UI alone: the broker it started must stop with it
        ui.proc.wait(timeout=120)
        wait_until(lambda: not broker.is_running(), timeout=60, interval=0.2, what="the demo's broker's stop")
    finally:
        ui.stop()
        broker.stop()


def test_with_no_broker_it_serves_and_says_what_it_waits_for(tmp_path: Path) -> None:
    port, nobody = free_port(), free_port()
    args = ["--bootstrap-servers", f"127.0.0.1:{nobody}", "--port", str(port), "--tokenizer", ""]
    ui = ServiceProcess("ui", args, health_url=f"http://127.0.0.1:{port}/api/overview", log_dir=tmp_path)
    ui.start(timeout=120)
    try:
        said = lambda: "no Kafka broker answers at" in ui.log_path.read_text()  # noqa: E731
        wait_until(said, timeout=120, interval=0.3, what="the UI saying there is no broker")
        assert "trying again" in ui.log_path.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/api/overview").json()["events"] == {}
    finally:
        ui.stop()
