"""HTTP face of the engine: the subset of SGLang's server API the adapter uses.

Routes and bodies mirror ``sglang/srt/entrypoints/http_server.py``: ``/generate`` (non-streaming, and
streaming as SGLang's cumulative ``data: {...}`` server-sent events ending in ``data: [DONE]``),
``/abort_request``, ``/health``, ``/get_model_info`` / ``/model_info``, ``/get_server_info`` /
``/server_info``, ``/update_weights_from_disk``, ``/flush_cache``, plus ``/metrics`` (prometheus-client).
Bad input is a 400 with ``{"error": {"message": ...}}``, as SGLang's ``_create_error_response``.

With ``--api-key`` every route but ``/health`` wants ``Authorization: Bearer <key>`` (401 otherwise), as
SGLang's ``--api-key``: weight updates, aborts and cache flushes are control, and the agent sandboxes
never get the key (only the adapter does).

Generation runs on one dedicated worker thread, so torch never blocks the event loop and requests are
served one at a time in arrival order; ``/abort_request`` reaches both queued and running requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from rollbus.services.engine.engine import Engine, TokenCallback
from rollbus.services.engine.policies import ChainRoute
from rollbus.services.engine.protocol import (
    BadRequest,
    GenerateRequest,
    Generation,
    IncrementalText,
    parse_generate,
    response_body,
)


@dataclass
class Served:
    """What the routes share: the engine, its generation worker and how it was started."""

    engine: Engine
    worker: ThreadPoolExecutor
    tokenizer_path: str
    served_model_name: str

    async def run(
        self, request: GenerateRequest, route: ChainRoute, on_token: TokenCallback | None = None
    ) -> Generation:
        self.engine.admit(request.rid)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker, self.engine.generate, request, route, on_token)


def served(http: Request) -> Served:
    return http.app.state.served


async def json_body(http: Request) -> Any:
    try:
        return await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from err


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def generate(http: Request) -> Response:
    arrived = time.perf_counter()
    state = served(http)
    engine = state.engine
    request = parse_generate(await json_body(http), engine.vocab_size, engine.context_length)
    route = ChainRoute.from_headers(http.headers)
    if request.stream:
        return StreamingResponse(stream(state, request, route, arrived), media_type="text/event-stream")
    generation = await state.run(request, route)
    text = engine.text(request, generation)
    return JSONResponse(response_body(request, generation, text, time.perf_counter() - arrived))


async def stream(state: Served, request: GenerateRequest, route: ChainRoute, arrived: float):
    """SGLang's default (non-incremental) stream: each event carries the whole output so far."""
    loop = asyncio.get_running_loop()
    partials: asyncio.Queue[Generation | None] = asyncio.Queue()
    task = asyncio.ensure_future(
        state.run(request, route, lambda partial: loop.call_soon_threadsafe(partials.put_nowait, partial))
    )
    task.add_done_callback(lambda _: partials.put_nowait(None))  # after every queued partial
    engine = state.engine
    text = IncrementalText(lambda ids: engine.decode(request, ids))
    try:
        while (partial := await partials.get()) is not None:
            yield sse(response_body(request, partial, text.feed(partial.output_ids), None))
        generation = task.result()
        latency = time.perf_counter() - arrived
        yield sse(response_body(request, generation, engine.text(request, generation), latency))
        yield b"data: [DONE]\n\n"
    finally:
        if not task.done():
            engine.abort(request.rid)  # the client went away mid-stream


async def abort_request(http: Request) -> Response:
    body = await json_body(http)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.")
    rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise BadRequest('abort_request takes {"rid": str} or {"abort_all": true}.')
    if rid or abort_all:
        served(http).engine.abort(rid, abort_all=abort_all)
    return Response(status_code=200)


async def health(http: Request) -> Response:
    return Response(status_code=200)


async def model_info(http: Request) -> JSONResponse:
    return JSONResponse(model_info_dict(served(http)))


def model_info_dict(state: Served) -> dict[str, Any]:
    engine = state.engine
    return {
        "model_path": engine.model_path,
        "served_model_name": state.served_model_name,
        "tokenizer_path": state.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": "auto",
        "model_type": engine.model.config.model_type,
        "architectures": engine.model.config.architectures,
        "policy": engine.policy.name,
        "vocab_size": engine.model.config.vocab_size,
        "context_length": engine.context_length,
    }


async def server_info(http: Request) -> JSONResponse:
    state = served(http)
    cache = state.engine.prefix_cache
    return JSONResponse(
        {
            **model_info_dict(state),
            "prefix_cache_capacity": cache.capacity,
            "prefix_cache_entries": len(cache),
            "prefix_cache_tokens": cache.cached_tokens(),
            "counters": vars(state.engine.counters),
        }
    )


COUNTER_HELP = {
    "requests": "Generate requests admitted",
    "aborted": "Requests aborted (by /abort_request or a client gone mid-stream)",
    "prompt_tokens": "Prompt tokens received",
    "cached_tokens": "Prompt tokens served from the prefix cache",
    "generated_tokens": "Tokens sampled",
}


class EngineCollector(Collector):
    """Reads the engine's counters and cache at scrape time, so the engine stays free of prometheus."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        for name, value in vars(self.engine.counters).items():
            yield CounterMetricFamily(f"rollbus_engine_{name}", COUNTER_HELP.get(name, name), value=value)
        cache = self.engine.prefix_cache
        yield GaugeMetricFamily(
            "rollbus_engine_prefix_cache_entries", "KV cache entries held", value=len(cache)
        )
        yield GaugeMetricFamily(
            "rollbus_engine_prefix_cache_tokens", "Tokens held in the KV cache", value=cache.cached_tokens()
        )
        info = InfoMetricFamily("rollbus_engine_weights", "The weights being served")
        info.add_metric(
            [], {"weight_version": str(self.engine.weight_version), "model_path": self.engine.model_path}
        )
        yield info


async def metrics(http: Request) -> Response:
    registry = http.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def update_weights_from_disk(http: Request) -> JSONResponse:
    body = await json_body(http)
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise BadRequest('update_weights_from_disk needs {"model_path": "<checkpoint dir>"}.')
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"weight_version must be a string, got {version!r}.")
    try:
        new_version = await asyncio.to_thread(served(http).engine.update_weights, body["model_path"], version)
    except (OSError, ValueError) as err:
        message = f"Failed to update weights: {err}"
        return JSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)
    message = f"Succeeded to update model weights. Weight version updated to {new_version}."
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


async def flush_cache(http: Request) -> PlainTextResponse:
    await asyncio.to_thread(served(http).engine.flush_cache)
    return PlainTextResponse("Cache flushed.\n")


async def bad_request(http: Request, err: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": str(err)}}, status_code=400)


ROUTES: list[tuple[str, Any, list[str]]] = [
    ("/generate", generate, ["POST", "PUT"]),
    ("/abort_request", abort_request, ["POST"]),
    ("/health", health, ["GET"]),
    ("/health_generate", health, ["GET"]),
    ("/get_model_info", model_info, ["GET"]),
    ("/model_info", model_info, ["GET"]),
    ("/get_server_info", server_info, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    ("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
    ("/flush_cache", flush_cache, ["GET", "POST"]),
]


OPEN_PATHS = ("/health",)  # what answers without the key (load balancers, readiness checks)


def require_key(app: FastAPI, api_key: str) -> None:
    """Every route but :data:`OPEN_PATHS` answers 401 unless the request carries the bearer key."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(http: Request, call_next: Any) -> Response:
        if http.url.path in OPEN_PATHS:
            return await call_next(http)
        given = http.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
        return await call_next(http)


def create_app(
    engine: Engine,
    *,
    tokenizer_path: str,
    served_model_name: str = "rollbus-engine",
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``, with its own single generation worker thread; with
    ``api_key`` every route but ``/health`` needs it."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-generate")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.abort(abort_all=True)
        worker.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(title="rollbus engine", lifespan=lifespan)
    app.state.served = Served(engine, worker, tokenizer_path, served_model_name)
    app.state.metrics_registry = CollectorRegistry()  # per app: several engines may live in one process
    app.state.metrics_registry.register(EngineCollector(engine))
    app.add_exception_handler(BadRequest, bad_request)
    if api_key:
        require_key(app, api_key)
    for path, endpoint, methods in ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    return app
