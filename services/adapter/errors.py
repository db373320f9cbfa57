"""Errors as the adapter raises them, and the retry hints the agents' CLIs obey.

The CLI retries 401/408/429/5xx/529 with backoff and honours ``retry-after``; ``x-should-retry: false``
stops it. So every error here says whether a retry can help; each wire protocol renders it in its own
shape (``WireProtocol.error``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApiError(Exception):
    """An error answer: HTTP status, error type (Anthropic's names), message and retry hints."""

    status: int
    error_type: str
    message: str
    retry_after: float | None = None
    should_retry: bool | None = None  # None: let the client decide from the status

    def __str__(self) -> str:
        return f"{self.status} {self.error_type}: {self.message}"

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers


class ClientGone(Exception):
    """The client closed the connection (while sending its body, or while its turn was generating)."""


def invalid_request(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message, should_retry=False)


def prompt_too_long(prompt_tokens: int, context_length: int) -> ApiError:
    """The exact wording makes the CLI compact its history and try again."""
    return invalid_request(f"prompt is too long: {prompt_tokens} tokens > {context_length} maximum")


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, "authentication_error", message, should_retry=False)


def forbidden(message: str) -> ApiError:
    return ApiError(403, "permission_error", message, should_retry=False)


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found_error", message, should_retry=False)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, "request_too_large", f"request body exceeds the {limit}-byte limit", should_retry=False
    )


def body_timed_out(timeout: float, received: int, declared: str | None) -> ApiError:
    """408: the body did not arrive in time; the CLI retries, which helps if the network hiccupped."""
    expected = f" of {declared}" if declared is not None else ""
    return ApiError(
        408,
        "timeout_error",
        f"request body not received within {timeout:g} s ({received}{expected} bytes arrived)",
        should_retry=True,
    )


def overloaded(message: str, retry_after: float) -> ApiError:
    """529: too many turns in flight; the CLI backs off and retries."""
    return ApiError(529, "overloaded_error", message, retry_after=retry_after, should_retry=True)


def unavailable(message: str, retry_after: float) -> ApiError:
    """503: draining, or the bus cannot take another turn; retrying later is safe."""
    return ApiError(503, "api_error", message, retry_after=retry_after, should_retry=True)


def upstream_failed(message: str) -> ApiError:
    """500: the engine failed this turn; nothing was recorded, so a retry is safe."""
    return ApiError(500, "api_error", message, retry_after=1, should_retry=True)
