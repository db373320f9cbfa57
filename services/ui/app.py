"""The pages: FastAPI routes over a :class:`ReadModel`, rendered server-side with Jinja2.

``Pages`` renders from the model alone (the bench times it without a server); :func:`create_app` wires it to
HTTP, the static files and, when given, the task that keeps the model fed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from argparse import ArgumentTypeError
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from rollbus.kafka.replay import parse_since
from rollbus.kafka.topics import TOPICS
from rollbus.services.ui import views
from rollbus.services.ui.model import ReadModel, overview, policy_offset, step_facts, throughput, trained_by

HERE = Path(__file__).resolve().parent
STEP_KEYS = ("step", "version", "rollouts", "reward_mean", "solve_rate", "tokens_trained", "masked_fraction",
             "staleness_mean", "staleness_max", "logprob_diff_mean", "logprob_diff_max",
             "ratio_outside_fraction", "approx_kl", "loss", "step_s")  # fmt: skip
PAGE_LIMIT = 100  # events per topic-browser page
TIMELINE_PX = 400  # width of the longest turn bar


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters.update(num=_num, when=_when, fold=lambda value: Markup(views.folded_html(value)))
    return env


class Pages:
    """Every page as a string, from the read model."""

    def __init__(self, model: ReadModel, source: str, decode: views.Decode | None = None) -> None:
        self.model, self.source, self.decode = model, source, decode
        self.env = environment()

    def _page(self, name: str, **context: Any) -> str:
        return self.env.get_template(name).render(source=self.source, **context)

    def figures(self) -> dict[str, Any]:
        """The overview's numbers, with each topic's events per second over the last minute."""
        return {**overview(self.model), "per_second": throughput(self.model, int(time.time() * 1000))}

    def overview(self) -> str:
        rollouts = sorted(self.model.rollouts.values(), key=lambda r: r.rollout_id)
        return self._page("overview.html", o=self.figures(), rollouts=rollouts, steps=step_facts(self.model),
                          step_keys=STEP_KEYS)  # fmt: skip

    def rollout(self, rollout_id: str) -> str | None:
        rollout = self.model.rollout(rollout_id)
        if rollout is None:
            return None
        chains = views.timeline(rollout, self.decode)
        # a step's entry holds its record (model.ReadModel._step): never None
        steps = [(e.offset, e.record, policy_offset(self.model, int(e.record["version"])))  # type: ignore[index]
                 for e in trained_by(self.model, rollout)]  # fmt: skip
        spans = [t["model_ms"] + t["queue_ms"] + (t["tool_ms"] or 0) for c in chains for t in c["turns"]]
        longest = max(spans, default=0)
        return self._page(
            "rollout.html", r=rollout, task=views.task_fields(rollout), chains=chains,
            scale=TIMELINE_PX / longest if longest else 0,
            segments=views.segment_rows(rollout, self.decode or views.ids_text),
            patch=views.patch_text(rollout), v=views.verdict(rollout),
            steps=steps, step_keys=STEP_KEYS,
        )  # fmt: skip

    def topics(self, want: views.Browse, since: str = "", error: str = "") -> str:
        entries, more = views.browse(self.model, want)
        return self._page(
            "topics.html", topics=[spec.name for spec in TOPICS], want=want, since=since, entries=entries,
            more=more, error=error,
        )  # fmt: skip

    def missing(self, what: str) -> str:
        return self._page("missing.html", what=what)


def _report(task: asyncio.Task[None]) -> None:
    """Say why reading stopped while the pages are still served (they show what was read until then)."""
    if not task.cancelled() and task.exception() is not None:
        print(f"ui: reading the topics stopped: {task.exception()!r}", file=sys.stderr, flush=True)


def create_app(pages: Pages, feeding: Callable[[], Coroutine[Any, Any, None]] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(feeding()) if feeding is not None else None
        if task is not None:
            task.add_done_callback(_report)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with suppress(Exception, asyncio.CancelledError):
                    await task

    app = FastAPI(title="rollbus ui", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return pages.overview()

    @app.get("/api/overview")
    def overview_json() -> JSONResponse:
        return JSONResponse(pages.figures())

    @app.get("/rollout/{rollout_id:path}", response_class=HTMLResponse)
    def rollout(rollout_id: str) -> HTMLResponse:
        page = pages.rollout(rollout_id)
        if page is None:
            return HTMLResponse(pages.missing(f"no events of rollout {rollout_id!r} (yet)"), status_code=404)
        return HTMLResponse(page)

    @app.get("/topics", response_class=HTMLResponse)
    def topics(
        topic: str = "tasks", partition: str = "", offset: int = 0, since: str = "", rollout: str = "",
        skip: int = 0, limit: int = PAGE_LIMIT,
    ) -> HTMLResponse:  # fmt: skip
        if topic not in [spec.name for spec in TOPICS]:
            return HTMLResponse(pages.missing(f"{topic!r} is not a rollbus topic"), status_code=404)
        part = int(partition) if partition.strip().isdigit() else None
        since_ms, error = 0, ""
        if since.strip():
            try:
                since_ms = parse_since(since.strip())
            except ArgumentTypeError as bad:
                error = str(bad)
        want = views.Browse(
            topic,
            part,
            max(offset, 0),
            since_ms,
            rollout.strip() or None,
            max(skip, 0),
            min(max(limit, 1), 1000),
        )
        return HTMLResponse(pages.topics(want, since.strip(), error), status_code=400 if error else 200)

    return app
