"""``frozen_lake``: the grid world as text. S start, F ice, H hole, G goal; one move per turn.

``env_config``: ``{"name": "frozen_lake", "map": ["SFFF", "FHFH", "FFFH", "HFFG"]}`` or ``{"size": 4,
"seed": 1}`` (a random map with a path to the goal). ``slippery`` (false by default) makes a move slide
sideways a third of the time each way, from the episode's seed. Reward 1 on reaching G (done); a hole ends
the episode with 0; an unreadable move costs a turn.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollbus.services.gym_runner.envs.answers import last_assistant, message_text
from rollbus.services.gym_runner.gym import Env, RolloutInferRequest, register_env

DEFAULT_MAP = ("SFFF", "FHFH", "FFFH", "HFFG")
MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
SIDEWAYS = {"left": ("up", "down"), "right": ("up", "down"), "up": ("left", "right")}
SIDEWAYS["down"] = SIDEWAYS["up"]
_MOVE = re.compile(r"<move>\s*(left|right|up|down)\s*</move>", re.IGNORECASE)
SYSTEM = (
    "You walk on a frozen lake. S is the start, F is safe ice, H is a hole, G is the goal; you are P. "
    "Each turn answer with one move: <move>left</move>, <move>right</move>, <move>up</move> or "
    "<move>down</move>."
)


def random_map(size: int, seed: int, hole_rate: float = 0.2) -> tuple[str, ...]:
    """A ``size`` x ``size`` map with S top-left, G bottom-right and a hole-free path between them."""
    rng = random.Random(seed)
    while True:
        grid = [["H" if rng.random() < hole_rate else "F" for _ in range(size)] for _ in range(size)]
        grid[0][0], grid[-1][-1] = "S", "G"
        rows = tuple("".join(row) for row in grid)
        if _reachable(rows):
            return rows


def _reachable(rows: tuple[str, ...]) -> bool:
    size, seen, todo = len(rows), {(0, 0)}, [(0, 0)]
    while todo:
        r, c = todo.pop()
        if rows[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < len(rows[nr]) and (nr, nc) not in seen and rows[nr][nc] != "H":
                seen.add((nr, nc))
                todo.append((nr, nc))
    return False


def check_map(rows: Any) -> tuple[str, ...]:
    if not isinstance(rows, list | tuple) or not rows or not all(isinstance(r, str) for r in rows):
        raise ValueError("map must be a non-empty list of strings")
    if len({len(r) for r in rows}) != 1 or set("".join(rows)) - set("SFHG"):
        raise ValueError("map rows must be equally long and use only S, F, H, G")
    if "".join(rows).count("S") != 1 or "G" not in "".join(rows):
        raise ValueError("map needs exactly one S and at least one G")
    return tuple(rows)


@register_env("frozen_lake")
class FrozenLakeEnv(Env):
    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        seed = int(env_config.get("seed", 0))
        if "map" in env_config:
            self.rows = check_map(env_config["map"])
        elif "size" in env_config:
            size = int(env_config["size"])
            if not 2 <= size <= 12:
                raise ValueError(f"size must be 2..12, not {size}")
            self.rows = random_map(size, seed)
        else:
            self.rows = DEFAULT_MAP
        self.slippery = bool(env_config.get("slippery", False))
        self.rng = random.Random(seed)
        at = "".join(self.rows).index("S")
        self.pos = divmod(at, len(self.rows[0]))

    def render(self) -> str:
        lines = []
        for r, row in enumerate(self.rows):
            lines.append("".join("P" if (r, c) == self.pos else ch for c, ch in enumerate(row)))
        return "\n".join(lines)

    async def reset(self, request: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        info = {"map": list(self.rows), "pos": list(self.pos)}
        return f"The lake:\n{self.render()}\nYour move?", info, SYSTEM

    async def step(self, messages: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        found = _MOVE.findall(message_text(last_assistant(messages)))
        if not found:
            info: dict[str, Any] = {"move": None, "pos": list(self.pos), "tile": None, "solved": False}
            return "No move found; answer with <move>left|right|up|down</move>.", 0.0, False, info
        wanted = found[-1].lower()
        move = self._slide(wanted)
        dr, dc = MOVES[move]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < len(self.rows) and 0 <= c < len(self.rows[0]):
            self.pos = (r, c)
        tile = self.rows[self.pos[0]][self.pos[1]]
        info = {"move": wanted, "moved": move, "pos": list(self.pos), "tile": tile, "solved": tile == "G"}
        if tile == "G":
            return "You reached the goal.", 1.0, True, info
        if tile == "H":
            return "You fell into a hole.", 0.0, True, info
        return f"{self.render()}\nYour move?", 0.0, False, info

    def _slide(self, move: str) -> str:
        if not self.slippery:
            return move
        roll = self.rng.random()
        return move if roll < 1 / 3 else SIDEWAYS[move][0 if roll < 2 / 3 else 1]
