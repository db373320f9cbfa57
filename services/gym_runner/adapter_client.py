"""The runner's side of the adapter: open and close a session per attempt (admin API), and one model call
through ``POST /v1/chat/completions`` with the session's token, so every turn is recorded by the adapter."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from rollbus.services.gym_runner.gym import ContextFull, Message, ModelCall, ModelError, Reply

BUSY = (429, 503, 529)


class AdapterError(RuntimeError):
    """The admin API refused or could not be reached (a session could not be opened)."""


class AdapterClient:
    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        admin_token: str,
        model: str,
        max_tokens: int,
        temperature: float,
        busy_retries: int = 5,
    ) -> None:
        self.http, self.admin_token, self.model = http, admin_token, model
        self.max_tokens, self.temperature, self.busy_retries = max_tokens, temperature, busy_retries

    def _admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token}"}

    async def open(self, rollout_id: str, attempt_id: str) -> str:
        """A session token for this attempt (the adapter keys the session by rollout id)."""
        body = {"rollout_id": rollout_id, "attempt_id": attempt_id, "harness": "gym"}  # the OpenAI route only
        try:
            response = await self.http.post("/admin/sessions", json=body, headers=self._admin())
        except httpx.HTTPError as exc:
            raise AdapterError(f"opening a session: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise AdapterError(f"opening a session: {response.status_code} {_message(response)}")
        return str(response.json()["token"])

    async def close(self, rollout_id: str, attempt_id: str | None) -> None:
        """Close the attempt's session (all of the rollout's with ``attempt_id=None``): its chains end, its
        token is revoked. A session no request reached is a 404: fine. Same contract as the sandbox runner."""
        body = {"attempt_id": attempt_id} if attempt_id else {}
        try:
            response = await self.http.post(
                f"/admin/sessions/{rollout_id}/close", json=body, headers=self._admin()
            )
        except httpx.HTTPError as exc:
            raise AdapterError(f"closing a session: {type(exc).__name__}: {exc}") from exc
        if response.status_code not in (200, 404):
            raise AdapterError(f"closing a session: {response.status_code} {_message(response)}")

    def model_call(self, token: str) -> ModelCall:
        async def call(messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
            return await self.complete(token, messages, tools)

        return call

    async def complete(self, token: str, messages: list[Message], tools: list[dict[str, Any]]) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if tools:
            body["tools"] = tools
        for attempt in range(self.busy_retries + 1):
            try:
                response = await self.http.post(
                    "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {token}"}
                )
            except httpx.HTTPError as exc:
                raise ModelError(f"model call: {type(exc).__name__}: {exc}") from exc
            if response.status_code in BUSY and attempt < self.busy_retries:
                await asyncio.sleep(_retry_after(response))
                continue
            return _reply(response)
        raise AssertionError("unreachable")


def _reply(response: httpx.Response) -> Reply:
    if response.status_code != 200:
        message = _message(response)
        if response.status_code == 400 and "prompt is too long" in message:
            raise ContextFull(message)
        raise ModelError(f"model call: {response.status_code} {message}")
    try:
        choice = response.json()["choices"][0]
        return Reply(dict(choice["message"]), str(choice["finish_reason"]))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ModelError(f"model call: malformed response: {exc}") from exc


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(30.0, max(0.1, float(response.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0
