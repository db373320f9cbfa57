"""The built-in envs: math (exact answers, one retry, model text never evaluated), frozen_lake, python_tool
(real bwrap sandbox without network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sympy
from hypothesis import given
from hypothesis import strategies as st

from rollbus.services.gym_runner.envs import extract_answer, parse_rational
from rollbus.services.gym_runner.envs.frozen_lake import _reachable, random_map
from rollbus.services.gym_runner.envs.math_env import generate
from rollbus.services.gym_runner.gym import RolloutInferRequest, make_env

REQUEST = RolloutInferRequest([])


def said(text: str, **extra) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text, **extra}]


@pytest.mark.parametrize(
    ("text", "value"),
    [("3/4", sympy.Rational(3, 4)), ("-12", -12), ("2.5", sympy.Rational(5, 2)),
     ("\\frac{6}{8}", sympy.Rational(3, 4)), (" $1,024$ ", 1024), ("0.1", sympy.Rational(1, 10))],
)  # fmt: skip
def test_numbers_parse_exactly(text, value) -> None:
    assert parse_rational(text) == value


@pytest.mark.parametrize(
    "hostile",
    ["__import__('os').system('touch /tmp/pwned')", "1/0", "x", "2**10000000", "1e400", "9" * 200, "",
     "3/4/5", "lambda: 1", "Rational(1,3)", "1_000"],
)  # fmt: skip
def test_anything_but_a_plain_number_is_no_answer(hostile) -> None:
    assert parse_rational(hostile) is None


@given(st.fractions(min_value=-(10**12), max_value=10**12, max_denominator=10**6))
def test_any_fraction_written_as_a_over_b_round_trips(value) -> None:
    assert parse_rational(f"{value.numerator}/{value.denominator}") == sympy.Rational(
        value.numerator, value.denominator
    )


def test_the_last_answer_tag_counts() -> None:
    assert extract_answer("<answer>1</answer> no wait <answer> 2 </answer>") == "2"
    assert extract_answer("so \\boxed{7}") == "7" and extract_answer("no answer") is None


def test_problems_are_deterministic_per_seed_and_varied() -> None:
    assert generate(5) == generate(5)
    kinds = {generate(s).question.split()[0] for s in range(40)}
    assert len(kinds) >= 3


async def test_math_right_first_time_scores_one() -> None:
    env = make_env({"name": "math", "seed": 2})
    question, info, system = await env.reset(REQUEST)
    assert question == "What is 7 * 7 - 25?" and info["expected"] == "24" and "<answer>" in system
    _, reward, done, info = await env.step(said("<answer>24</answer>"))
    assert (reward, done, info["solved"]) == (1.0, True, True)


async def test_math_one_hint_then_half_reward_or_nothing() -> None:
    env = make_env({"name": "math", "seed": 2})
    await env.reset(REQUEST)
    hint, reward, done, _ = await env.step(said("<answer>30</answer>"))
    assert (reward, done) == (0.0, False) and "too high" in hint
    _, reward, done, info = await env.step(said("<answer>48/2</answer>"))
    assert (reward, done, info["attempt"]) == (0.5, True, 2)

    env = make_env({"name": "math", "question": "What is 1/3 + 1/6?", "answer": "1/2"})
    await env.reset(REQUEST)
    hint, *_ = await env.step(said("I think it is a half"))
    assert "no <answer>" in hint
    _, reward, done, info = await env.step(said("<answer>0.4</answer>"))
    assert (reward, done, info["correct"]) == (0.0, True, False)


async def test_frozen_lake_goal_hole_and_walls() -> None:
    env = make_env({"name": "frozen_lake"})
    observation, info, _ = await env.reset(REQUEST)
    assert observation.splitlines()[1] == "PFFF" and info["pos"] == [0, 0]
    rewards = []
    for move in ("up", "down", "down", "right", "right", "down", "right"):
        _, reward, done, info = await env.step(said(f"<move>{move}</move>"))
        rewards.append(reward)
    assert info == {"move": "right", "moved": "right", "pos": [3, 3], "tile": "G", "solved": True}
    assert rewards == [0.0] * 6 + [1.0] and done

    env = make_env({"name": "frozen_lake"})
    await env.reset(REQUEST)
    _, reward, done, info = await env.step(said("<move>down</move>"))
    _, reward, done, info = await env.step(said("<move>right</move>"))
    assert (reward, done, info["tile"]) == (0.0, True, "H")
    observation, reward, done, info = await env.step(said("I refuse to move"))
    assert "No move found" in observation and info["move"] is None


@given(st.integers(2, 8), st.integers(0, 10**6))
def test_random_maps_always_have_a_path(size, seed) -> None:
    rows = random_map(size, seed)
    assert len(rows) == size and rows[0][0] == "S" and rows[-1][-1] == "G" and _reachable(rows)


def call(code: str, call_id: str = "call_1") -> list[dict]:
    tool_call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "python", "arguments": {"code": code}},
    }
    return said("", tool_calls=[tool_call])


async def test_python_tool_runs_code_in_a_networkless_sandbox_and_close_removes_it() -> None:
    env = make_env({"name": "python_tool", "seed": 2, "timeout": 5, "max_calls": 5})
    question, info, _ = await env.reset(REQUEST)
    assert "1 to 25" in question and info["expected"] == "5525"
    try:
        results, reward, done, info = await env.step(call("print(sum(i * i for i in range(1, 26)))"))
        assert results == [{"role": "tool", "tool_call_id": "call_1", "content": "5525\n"}]
        assert (reward, done, info["exit_codes"]) == (0.0, False, [0])
        probe = (
            "import socket, os\ns = socket.socket()\ns.settimeout(2)\n"
            "try:\n    s.connect(('1.1.1.1', 53))\n    print('connected')\nexcept OSError as e:\n"
            "    print('no network', type(e).__name__)\n"
            "print(os.path.exists('/root'), os.listdir('/workspace'))"
        )
        results, *_ = await env.step(call(probe))
        assert results[0]["content"].startswith("no network") and "['main.py']" in results[0]["content"]
        results, *_ = await env.step(call("while True: pass"))
        assert "[killed after 5.0 s]" in results[0]["content"]
        results, _, _, info = await env.step(call("x = bytearray(2 * 1024 ** 3)\nprint('allocated')"))
        assert "allocated" not in results[0]["content"] and info["exit_codes"] != [0]
        workdir = Path(env._workdir)
        assert workdir.is_dir()
    finally:
        await env.close()
    assert not workdir.exists()
    _, reward, done, info = await env.step(said("<answer>5525</answer>"))
    assert (reward, done, info["solved"]) == (1.0, True, True)


async def test_python_tool_refuses_bad_calls_without_running_them() -> None:
    env = make_env({"name": "python_tool", "max_calls": 1})
    await env.reset(REQUEST)
    bad = said("", tool_calls=[{"id": "c", "function": {"name": "python", "arguments": "not json"}}])
    results, *_ = await env.step(bad)
    assert results[0]["content"].startswith("refused: the python tool takes")
    results, *_ = await env.step(call("print(1)"))
    assert results[0]["content"] == "refused: at most 1 python calls per episode"
    assert env._sandbox is None  # nothing ever ran
    await env.close()
