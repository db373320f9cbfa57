"""What every route checks in a JSON body before it looks at its fields: valid JSON, an object, no nesting
deeper than the chat template survives, no lone surrogates. Route-neutral: the Anthropic, Chat Completions
and Responses routes (and the admin API) share it."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from rollbus.services.adapter.errors import invalid_request

#: JSON nesting allowed anywhere in a body: far below what the chat template's recursion survives
#: (about 600 levels), far above any real tool schema or tool input
MAX_DEPTH = 64
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # a \uD800-\uDFFF escape in the raw bytes


def decode_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        data = loads_exact(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None
    except ValueError as exc:  # an integer over the interpreter's 4300-digit conversion limit
        raise invalid_request(f"request body holds a number that is too long: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request(f"request body must be a JSON object, not {type(data).__name__}")
    check_json(data, strings=_SURROGATE.search(body) is not None)
    return data


def loads_exact(body: bytes) -> Any:
    """orjson where it reads what the standard decoder reads (an agent resends its whole conversation every
    turn, ~100 KB from Claude Code, read ~2.5x faster; the engine's answer holds every sampled id and
    logprob); what it refuses (NaN, a lone surrogate, another
    encoding than UTF-8, nesting past its limit, bad JSON) and any run of 20 digits (orjson reads an int
    past 64 bits as a float) go to the standard decoder, which reads or refuses them as before."""
    if not has_long_number(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


def has_long_number(raw: bytes) -> bool:
    """Whether ``raw`` holds a run of 20 digits or more (in a number or not); ~40x faster than a regex."""
    return b"00000000000000000000" in raw.translate(_DIGITS_AS_ZERO)


def check_json(data: Any, *, strings: bool) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and, if ``strings``, lone surrogates (``"\\ud800"``):
    JSON allows them, but no tokenizer can encode them. Iterative, so any depth is safe to check."""
    if not strings:
        _check_depth(data)
        return
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise invalid_request(f"request body is nested too deeply (more than {MAX_DEPTH} levels)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if strings and isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))
        elif strings and isinstance(value, str):
            _check_text(value)


def _check_depth(data: Any) -> None:
    """:func:`check_json` without strings: only containers are visited (most nodes of a body are strings)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    push, pop = stack.append, stack.pop
    while stack:
        value, depth = pop()
        if depth > MAX_DEPTH:
            raise invalid_request(f"request body is nested too deeply (more than {MAX_DEPTH} levels)")
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, dict | list):
                push((item, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_request(
            f"request body holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not text"
        ) from None
