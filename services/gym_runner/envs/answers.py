"""Final answers in model text: ``<answer>...</answer>`` (or ``\\boxed{...}``), read as exact rationals.

The policy is the attacker here: model text is never evaluated. Only plain number syntax is accepted
(``-12``, ``3/4``, ``2.5``, ``\\frac{3}{4}``) and only then handed to ``sympy.Rational``, so no
sympify/eval ever sees model output.
"""

from __future__ import annotations

import re
from typing import Any

import sympy

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_FRAC = re.compile(r"^\\d?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}$")
_NUMBER = re.compile(r"^-?\d{1,30}(\.\d{1,30})?(/\d{1,30})?$")
MAX_ANSWER_CHARS = 100
_THINK, _THINK_END = "<think>", "</think>"


def message_text(message: dict[str, Any]) -> str:
    """The reply's text without its reasoning: ``step`` gets it as ms-swift does, ``<think>R</think>``
    first (R cannot hold ``</think>``: the parser ends R at the first); built-ins grade the answer."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    content = str(content)
    if content.lstrip().startswith(_THINK) and _THINK_END in content:
        return content.split(_THINK_END, 1)[1].lstrip("\n")
    return content


def extract_answer(text: str) -> str | None:
    """The last ``<answer>`` (else ``\\boxed{}``) in ``text``, stripped; None when there is none."""
    found = _ANSWER.findall(text) or _BOXED.findall(text)
    return found[-1].strip() if found else None


def parse_rational(answer: str) -> sympy.Rational | None:
    """``answer`` as an exact rational, or None if not a plain number (``$``, spaces, commas dropped)."""
    text = answer.strip().strip("$").replace(" ", "").replace(",", "")
    if len(text) > MAX_ANSWER_CHARS:
        return None
    frac = _FRAC.match(text.replace("\\dfrac", "\\frac"))
    if frac:
        return sympy.Rational(int(frac.group(1)), int(frac.group(2)))
    if not _NUMBER.match(text):
        return None
    if "/" in text:
        num, den = text.split("/")
        if int(den) == 0:
            return None
        return sympy.Rational(sympy.Rational(num), int(den))
    return sympy.Rational(text)


def last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message
    return {}
