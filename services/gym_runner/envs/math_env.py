"""``math``: one arithmetic or algebra word problem per episode, generated from ``seed``; one retry.

``env_config``: ``{"name": "math", "seed": 7}`` (generated), or ``{"name": "math", "question": "...",
"answer": "3/4"}`` (a dataset's own problem). Rewards: 1.0 for a right first answer, ``retry_reward`` (0.5)
for a right second answer after the hint, 0 otherwise; at most two steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import sympy

from rollbus.services.gym_runner.envs.answers import (
    extract_answer,
    last_assistant,
    message_text,
    parse_rational,
)
from rollbus.services.gym_runner.gym import Env, RolloutInferRequest, register_env

SYSTEM = "You solve math problems. Think briefly, then give the final answer as <answer>NUMBER</answer>."
NAMES = ("Ada", "Ben", "Chloe", "Dev", "Ema", "Femi", "Gus", "Hana")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: sympy.Rational


def generate(seed: int) -> Problem:
    """A deterministic problem for ``seed``: arithmetic, a linear equation, or a fraction word problem."""
    rng = random.Random(seed)
    kind = rng.choice(("arithmetic", "linear", "tank"))
    if kind == "arithmetic":
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 60)
        return Problem(f"What is {a} * {b} - {c}?", sympy.Rational(a * b - c))
    if kind == "linear":
        a, x, b = rng.randint(2, 9), rng.randint(-12, 12), rng.randint(-30, 30)
        d = rng.choice((1, 1, 2, 3))
        c = sympy.Rational(a * x, d) + b
        lhs = f"{a}x/{d}" if d > 1 else f"{a}x"
        sign = "+" if b >= 0 else "-"
        return Problem(f"Solve for x: {lhs} {sign} {abs(b)} = {c}", sympy.Rational(x))
    name, cap = rng.choice(NAMES), rng.randint(2, 20) * 12
    p, q = rng.choice(((1, 2), (2, 3), (3, 4), (5, 6), (1, 3), (3, 8)))
    drawn = rng.randint(1, 9)
    question = (
        f"{name}'s tank holds {cap} litres. It is filled to {p}/{q} of its capacity, then {name} draws off "
        f"{drawn} litres. How many litres are left in the tank?"
    )
    return Problem(question, sympy.Rational(cap * p, q) - drawn)


@register_env("math")
class MathEnv(Env):
    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        self.retry_reward = float(env_config.get("retry_reward", 0.5))
        if "question" in env_config:
            answer = parse_rational(str(env_config.get("answer", "")))
            if answer is None:
                raise ValueError(f"answer {env_config.get('answer')!r} is not a number")
            self.problem = Problem(str(env_config["question"]), answer)
        else:
            seed = env_config.get("seed", 0)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"seed must be an integer, not {seed!r}")
            self.problem = generate(seed)
        self.attempt = 0

    async def reset(self, request: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        info = {"question": self.problem.question, "expected": str(self.problem.answer)}
        return self.problem.question, info, SYSTEM

    async def step(self, messages: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        self.attempt += 1
        given = extract_answer(message_text(last_assistant(messages)))
        value = parse_rational(given) if given is not None else None
        correct = value is not None and value == self.problem.answer
        info = {"attempt": self.attempt, "given": given, "correct": correct, "solved": correct}
        if correct:
            return "Correct.", 1.0 if self.attempt == 1 else self.retry_reward, True, info
        if self.attempt >= 2:
            return "Still wrong.", 0.0, True, info
        return self._hint(given, value), 0.0, False, info

    def _hint(self, given: str | None, value: sympy.Rational | None) -> str:
        if given is None:
            return "I found no <answer>...</answer> in your reply. Try once more and give the number in it."
        if value is None:
            return f"{given!r} is not a plain number. Try once more: a number or a fraction like 3/4."
        side = "too high" if value > self.problem.answer else "too low"
        return f"{given} is {side}. Check your working and try once more."
