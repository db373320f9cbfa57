"""The built-in gym environments (all offline, small, seeded) and context managers; importing registers them.

| name | what |
| --- | --- |
| ``math`` | a seeded arithmetic/algebra word problem, exact rational check, one retry hint |
| ``frozen_lake`` | the grid world as text; reward 1 on the goal, done on a hole |
| ``python_tool`` | a computation question; the model may run Python in a network-less sandbox first |
| ``window`` (context manager) | keep the opening and the last ``keep`` messages |
| ``dummyContextManager`` (context manager) | keep the history as it is (ms-swift's default's name) |
"""

from rollbus.services.gym_runner.envs.answers import extract_answer, parse_rational
from rollbus.services.gym_runner.envs.context import KeepContext, WindowContext
from rollbus.services.gym_runner.envs.frozen_lake import FrozenLakeEnv
from rollbus.services.gym_runner.envs.math_env import MathEnv
from rollbus.services.gym_runner.envs.python_tool import PythonToolEnv

__all__ = [
    "FrozenLakeEnv",
    "KeepContext",
    "MathEnv",
    "PythonToolEnv",
    "WindowContext",
    "extract_answer",
    "parse_rational",
]
