"""Token-in/token-out calls to an SGLang ``/generate`` server over one pooled HTTP client
(:mod:`rollbus.services.adapter.engine_http`).

A turn that is cancelled (the CLI hung up) or fails is aborted on the server, so a dead request never
keeps generating on the GPU.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import orjson

from rollbus.services.adapter.bodies import loads_exact
from rollbus.services.adapter.engine_http import EngineHTTP, HTTPError
from rollbus.top_logprobs import BadTopLogprobs, from_sglang


class EngineError(Exception):
    """The engine failed or answered something that is not a generation."""


class EngineRejected(EngineError):
    """The engine answered 4xx: it will refuse this request however often it is sent."""


@dataclass(frozen=True)
class Generation:
    """One engine answer, reduced to what a turn records."""

    rid: str
    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_type: str  # stop | length | abort
    matched: Any  # the stop token id or string that ended it, if any
    prompt_tokens: int
    weight_version: str | None
    generation_ms: int
    routed_experts: str | None = None  # SGLang's base64 of int32 [rows, layers x top_k], when asked for
    top_logprobs: bytes | None = None  # each output token's top-k (rollbus.top_logprobs), when asked for


@dataclass(frozen=True)
class TurnHeaders:
    """Who the turn is for, so engine logs and schedulers can group by rollout and chain, and which harness's
    route it came through (empty: not said), so a scripted engine can answer in that harness's tools."""

    rollout_id: str
    chain_id: str
    chain_kind: str
    harness: str = ""

    def as_dict(self) -> dict[str, str]:
        headers = {
            "X-Rollbus-Rollout": self.rollout_id,
            "X-Rollbus-Chain": self.chain_id,
            "X-Rollbus-Chain-Kind": self.chain_kind,
        }
        if self.harness:
            headers["X-Rollbus-Harness"] = self.harness
        return headers


class SGLangClient:
    """``api_key``: the engine's ``--api-key``, sent as a bearer token on every call."""

    def __init__(self, http: EngineHTTP, api_key: str | None = None, abort_timeout: float = 5.0) -> None:
        self.abort_timeout = abort_timeout
        self.http = http
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str,
        headers: TurnHeaders,
        routes_from: int | None = None,
        top_logprobs: int = 0,
    ) -> Generation:
        """``routes_from``: ask for the routed experts of positions ``routes_from`` .. seqlen - 2 (SGLang's
        ``routed_experts_start_len``; the server needs ``--enable-return-routed-experts``); None: not.
        ``top_logprobs``: ask for each output token's top-k alternatives (``top_logprobs_num``); 0: not."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "rid": rid,
            "stream": False,
        }
        if routes_from is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routes_from)
        if top_logprobs:
            body["top_logprobs_num"] = top_logprobs
        started = time.monotonic()
        try:
            sent_headers = {**headers.as_dict(), **self.auth}
            response = await self.http.post("/generate", encode_body(body), sent_headers)
        except asyncio.CancelledError:
            await asyncio.shield(self.abort(rid))
            raise
        except HTTPError as exc:
            await self.abort(rid)
            raise EngineError(f"engine call failed: {type(exc).__name__}: {exc}") from exc
        if response.status != 200:
            await self.abort(rid)
            error = EngineRejected if 400 <= response.status < 500 else EngineError
            raise error(f"engine answered {response.status}: {response.text[:500]}")
        elapsed_ms = int((time.monotonic() - started) * 1000)
        return parse_generation(loads_exact(response.body), rid, elapsed_ms, top_logprobs)

    async def abort(self, rid: str) -> None:
        """Best effort: the engine may already have finished or be unreachable."""
        try:
            await self.http.post("/abort_request", orjson.dumps({"rid": rid}), self.auth, self.abort_timeout)
        except HTTPError:
            pass


def encode_body(body: dict[str, Any]) -> bytes:
    """The request as JSON bytes. orjson: the whole prompt's ids go with every turn, and the standard encoder
    spent ~4 ms on a 20k-token prompt (~0.2 CPU-s per 50-turn rollout, a fifth of the adapter's own work).
    What orjson refuses (an int past 64 bits, a lone surrogate) the standard encoder writes, as before; the
    sampling floats are bounded by the routes' validation, so no NaN (which orjson would write as null)."""
    try:
        return orjson.dumps(body)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(body).encode()


def parse_generation(data: Any, rid: str, elapsed_ms: int, top_logprobs: int = 0) -> Generation:
    """Check the engine's answer holds ids and one logprob per id (and, when ``top_logprobs`` k was asked
    for, k alternatives per id); a mismatch is an engine bug."""
    try:
        meta = data["meta_info"]
        pairs = meta["output_token_logprobs"]
        logprobs = [float(item[0]) for item in pairs]
        ids_from_logprobs = [int(item[1]) for item in pairs]
        output_ids = [int(i) for i in data.get("output_ids", ids_from_logprobs)]
        finish = meta.get("finish_reason") or {"type": "abort"}
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
        matched = finish.get("matched") if isinstance(finish, dict) else None
        text = str(data.get("text", ""))
        prompt_tokens = int(meta["prompt_tokens"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"engine answer is not a generation: {type(exc).__name__}: {exc}") from exc
    if output_ids != ids_from_logprobs:
        raise EngineError(
            f"engine output_ids ({len(output_ids)}) disagree with its logprob ids ({len(ids_from_logprobs)})"
        )
    version = meta.get("weight_version")
    routes = meta.get("routed_experts")
    top = None
    if top_logprobs:
        try:
            top = from_sglang(meta.get("output_top_logprobs"), top_logprobs, len(output_ids))
        except BadTopLogprobs as exc:
            raise EngineError(f"engine output_top_logprobs do not fit its output: {exc}") from exc
    return Generation(
        rid=rid,
        text=text,
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_type=finish_type,
        matched=matched,
        prompt_tokens=prompt_tokens,
        weight_version=None if version is None else str(version),
        generation_ms=int(meta.get("e2e_latency", elapsed_ms / 1000) * 1000),
        routed_experts=routes if isinstance(routes, str) else None,
        top_logprobs=top,
    )
