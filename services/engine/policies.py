"""What the engine outputs: sampled tokens, or a script replayed with real logprobs.

``--policy sample`` draws every token from the loaded weights. ``--policy scripted --script FILE``
replays fixed model outputs so end-to-end runs (tool calls, sub-agents, final answers) are
reproducible with a random model; the engine still scores each scripted token under the current
weights, so the logprobs are true and training on them is meaningful.

Script file (JSON)::

    {
      "turns": ["<raw model output>", {"text": "<partial output>", "complete": false}, ...],
      # a turn may quote its prompt: {"text": "... {id} ...", "fill": {"id": "<regex with one group>"}}
      "subagent_turns": ["..."],            # optional: replayed per sub-agent chain
      "side_text": "...",                   # optional: every side-chain request (titles, summaries)
      "final_text": "..."                   # optional: answer once a chain's turns run out
    }

A turn is raw model output (reasoning, ``<tool_call>`` blocks, text) without the closing
``<|im_end|>``; the engine appends it for a complete turn (a string, or ``"complete": true``), so the
request finishes with ``{"type": "stop", "matched": im_end}``. ``fill`` replaces each ``{name}`` in the text
with the first group of the regex's last match in the decoded prompt: a script can answer with what only
the run knows (an id a tool returned, e.g. Codex's sub-agent id for ``wait_agent``).

A rollout's main agent has one cursor
across its chains (a compaction or history rewrite starts a new chain id, ``main`` -> ``main.1``, but the
agent carries on with the next scripted turn); every sub-agent chain replays ``subagent_turns`` from the
start. A request advances its cursor by one (a retried request therefore gets the next turn). When a
chain's turns run out, the engine answers ``final_text`` (default :data:`DEFAULT_FINAL_TEXT`), a plain
text turn that ends the agent loop instead of failing the rollout.

The chain comes from the adapter's headers ``X-Rollbus-Rollout``, ``X-Rollbus-Chain`` and
``X-Rollbus-Chain-Kind`` (``main`` | ``subagent`` | ``side``); without them a request belongs to the
anonymous main chain. ``X-Rollbus-Harness`` names the harness whose route the request came through
(``claude_code``, ``codex``, ``gym``): a harness with scripts of its own (``--codex-script``) gets those,
since each harness offers its own tools; any other request gets ``--script``.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollbus.services.engine.protocol import BadRequest

DEFAULT_FINAL_TEXT = "The scripted session is over; I have nothing further to do."
DEFAULT_SIDE_TEXT = "Scripted session"
CHAIN_KINDS = ("main", "subagent", "side", "unattributed")  # unattributed replays subagent_turns

ROLLOUT_HEADER = "x-rollbus-rollout"
CHAIN_HEADER = "x-rollbus-chain"
CHAIN_KIND_HEADER = "x-rollbus-chain-kind"
HARNESS_HEADER = "x-rollbus-harness"
CODEX = "codex"  # the adapter's name for the Codex CLI's harness (its Responses route)


@dataclass(frozen=True)
class ChainRoute:
    """Which rollout and chain a request belongs to, and the harness it came from (the adapter's headers)."""

    rollout_id: str = ""
    chain_id: str = ""
    kind: str = "main"
    harness: str = ""  # empty: not said

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ChainRoute:
        kind = headers.get(CHAIN_KIND_HEADER, "main")
        if kind not in CHAIN_KINDS:
            raise BadRequest(f"X-Rollbus-Chain-Kind must be one of {', '.join(CHAIN_KINDS)}, got {kind!r}.")
        harness = headers.get(HARNESS_HEADER, "")
        return cls(headers.get(ROLLOUT_HEADER, ""), headers.get(CHAIN_HEADER, ""), kind, harness)


@dataclass(frozen=True)
class ScriptedTurn:
    """One scripted model output; ``complete`` turns get the ``<|im_end|>`` stop token appended."""

    text: str
    complete: bool = True
    fill: tuple[tuple[str, str], ...] = ()  # (placeholder name, regex whose group 1 replaces it)

    def filled(self, prompt: str) -> ScriptedTurn:
        """The text with each ``{name}`` replaced from ``prompt``; BadRequest if a regex finds nothing."""
        text = self.text
        for name, pattern in self.fill:
            found = re.findall(pattern, prompt)
            if not found:
                raise BadRequest(f"scripted turn: {pattern!r} ({{{name}}}) matches nothing in the prompt")
            last = found[-1]
            text = text.replace("{" + name + "}", last[0] if isinstance(last, tuple) else last)
        return ScriptedTurn(text, self.complete)


@dataclass(frozen=True)
class Script:
    turns: tuple[ScriptedTurn, ...]
    subagent_turns: tuple[ScriptedTurn, ...] = ()
    side_text: str = DEFAULT_SIDE_TEXT
    final_text: str = DEFAULT_FINAL_TEXT


def _turn(raw: Any, where: str) -> ScriptedTurn:
    if isinstance(raw, str):
        return ScriptedTurn(raw)
    if isinstance(raw, dict) and isinstance(raw.get("text"), str):
        complete, fill = raw.get("complete", True), raw.get("fill", {})
        if not isinstance(complete, bool):
            raise ValueError(f"{where}.complete must be a boolean")
        if not isinstance(fill, dict) or not all(isinstance(v, str) for v in fill.values()):
            raise ValueError(f"{where}.fill must map names to regular expressions")
        for name, pattern in fill.items():
            try:
                groups = re.compile(pattern).groups
            except re.error as err:
                raise ValueError(f"{where}.fill.{name}: {err}") from None
            if groups != 1:
                raise ValueError(f"{where}.fill.{name} must have exactly one group")
        return ScriptedTurn(raw["text"], complete, tuple(fill.items()))
    raise ValueError(f'{where} must be a string or {{"text": str, "complete": bool, "fill": {{...}}}}')


def _text(data: dict[str, Any], key: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"script {key} must be a string")
    return value


def parse_script(data: Any) -> Script:
    """Validate a decoded script file."""
    if not isinstance(data, dict) or not isinstance(data.get("turns"), list):
        raise ValueError('a script must be a JSON object with a "turns" list')
    subagent = data.get("subagent_turns", [])
    if not isinstance(subagent, list):
        raise ValueError("script subagent_turns must be a list")
    return Script(
        turns=tuple(_turn(raw, f"turns[{i}]") for i, raw in enumerate(data["turns"])),
        subagent_turns=tuple(_turn(raw, f"subagent_turns[{i}]") for i, raw in enumerate(subagent)),
        side_text=_text(data, "side_text", DEFAULT_SIDE_TEXT),
        final_text=_text(data, "final_text", DEFAULT_FINAL_TEXT),
    )


def load_script(path: str | Path) -> Script:
    try:
        return parse_script(json.loads(Path(path).read_text()))
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"bad script {path}: {err}") from err


class Policy(Protocol):
    name: str

    def scripted_turn(self, route: ChainRoute) -> ScriptedTurn | None:
        """The output to force for this request, or None to sample from the weights."""


class SamplePolicy:
    """True sampling from the loaded weights."""

    name = "sample"

    def scripted_turn(self, route: ChainRoute) -> ScriptedTurn | None:
        return None


DEFAULT = "default"  # the script of a rollout whose id names no task of its directory
NO_SCRIPT = Script(turns=())


def load_script_dir(path: str | Path) -> dict[str, Script]:
    """Every ``NAME.json`` of a directory, by name (a dataset's scripts, one per task)."""
    scripts = {p.stem: load_script(p) for p in sorted(Path(path).glob("*.json"))}
    if not scripts:
        raise ValueError(f"no *.json scripts in {path}")
    return scripts


def load_scripts(path: str | Path) -> dict[str, Script]:
    """A script directory by name, or one script file as the ``default`` of every rollout."""
    return load_script_dir(path) if Path(path).is_dir() else {DEFAULT: load_script(path)}


def task_script(scripts: Mapping[str, Script], rollout_id: str, default: Script) -> Script:
    """``NAME`` of the longest ``NAME-`` prefix of ``rollout_id``, its ``NAME@K`` variant for sample ``K``
    (the id's last ``-`` field) when there is one; ``default`` when no name is a prefix."""
    names = [n for n in scripts if "@" not in n and rollout_id.startswith(n + "-")]
    if not names:
        return default
    name = max(names, key=len)
    sample = rollout_id.rsplit("-", 1)[-1]
    return scripts.get(f"{name}@{sample}", scripts[name])


MAX_CURSORS = 10_000  # chains whose place in the script is remembered (least recently used go first)


@dataclass
class ScriptedPolicy:
    """Replays a :class:`Script`: one cursor per rollout's main agent, one per sub-agent chain.

    With ``by_prefix`` (``--script DIR``), a rollout whose id starts with ``NAME-`` replays ``NAME.json``
    (``rollbus submit`` starts rollout ids with the row's instance id), any other rollout ``script``;
    ``NAME@K.json``, when present, replaces it for sample K of each group (ids end in ``-K``), so one group
    can hold rollouts that solve and rollouts that fail: the reward variance a group-relative trainer needs.
    A harness in ``by_harness`` (a request's ``X-Rollbus-Harness``) picks from its own scripts the same way
    (their ``default`` for any other rollout), so one engine serves a dataset whose rows run under different
    harnesses, each in its own tools. At most ``max_cursors`` cursors are kept (an engine serves rollouts
    for days); the least recently used chain is forgotten first, and would start its script again.
    """

    script: Script
    name: str = "scripted"
    max_cursors: int = MAX_CURSORS
    cursors: OrderedDict[tuple[str, str, str], int] = field(default_factory=OrderedDict)
    by_prefix: dict[str, Script] = field(default_factory=dict)
    by_harness: dict[str, dict[str, Script]] = field(default_factory=dict)

    def script_for(self, rollout_id: str, harness: str = "") -> Script:
        if harness in self.by_harness:
            scripts = self.by_harness[harness]
            return task_script(scripts, rollout_id, scripts.get(DEFAULT, NO_SCRIPT))
        return task_script(self.by_prefix, rollout_id, self.script)

    def scripted_turn(self, route: ChainRoute) -> ScriptedTurn:
        script = self.script_for(route.rollout_id, route.harness)
        if route.kind == "side":
            return ScriptedTurn(script.side_text)
        turns = script.turns if route.kind == "main" else script.subagent_turns
        chain = "main" if route.kind == "main" else route.chain_id
        key = (route.rollout_id, chain, route.kind)
        cursor = self.cursors.pop(key, 0)
        self.cursors[key] = cursor + 1
        while len(self.cursors) > self.max_cursors:
            self.cursors.popitem(last=False)
        return turns[cursor] if cursor < len(turns) else ScriptedTurn(script.final_text)
