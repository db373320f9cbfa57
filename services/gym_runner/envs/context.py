"""``window``: keep the system message, the first user message and the newest messages.

``ctx_config``: ``{"name": "window", "keep": 4}``. Dropping middle messages changes the prompt's tokens, so
the adapter starts a new chain (the old one freezes as a ``wipe`` segment): the point of recording it.
``dummyContextManager`` (ms-swift's name for its default) keeps the history as it is.
"""

from __future__ import annotations

from typing import Any

from rollbus.services.gym_runner.gym import ContextManager, register_context_manager


@register_context_manager("window")
class WindowContext(ContextManager):
    def __init__(self, ctx_config: dict[str, Any]) -> None:
        super().__init__(ctx_config)
        self.keep = int(ctx_config.get("keep", 6))
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, not {self.keep}")

    def manage_context(self, history: list[dict[str, Any]], trajectory_id: str) -> list[dict[str, Any]]:
        n = 0
        while n < len(history) and history[n].get("role") == "system":
            n += 1
        if n < len(history) and history[n].get("role") == "user":
            n += 1
        head, rest = history[:n], history[n:]
        if len(rest) <= self.keep:
            return history
        tail = rest[-self.keep :]
        while tail and tail[0].get("role") != "user":  # a window starts at a user turn
            tail = tail[1:]
        return head + tail


@register_context_manager("dummyContextManager")
class KeepContext(ContextManager):
    def manage_context(self, history: list[dict[str, Any]], trajectory_id: str) -> list[dict[str, Any]]:
        return history
