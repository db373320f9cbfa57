"""Prompt building per turn: canonical append-only history against full re-render + merge_turns.

Run: ``python bench/prompt_build.py [--quick]``. Replays synthetic Claude-Code-shaped conversations (10, 50
and 100 turns, each growing to ~64k tokens) with the real Qwen3.6 tokenizer and chat template. The
model's outputs are prepared before timing; timed per turn is what the adapter pays to build the
prompt and record the turn (plan + commit), plus the final stitching into segments (segment_chain
or merge_turns). Prints CPU time per turn (mean, and over the last 10 turns, where the context is
largest), totals, the ratio re-render / canonical, and the share of sampled tokens trained (mask 1)
in each mode, for histories echoed back untouched and as the Claude Code CLI re-serialises them.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from rollbus.services.adapter.canonical import CanonicalHistory, RerenderHistory
from rollbus.tokenizer import SpecialIds, load_tokenizer

CONTEXT_TOKENS = 64_000
REMINDER = "<system-reminder>\nThe todo list changed; do not mention this to the user.\n</system-reminder>"
LINE = "    def handle_{i}(self, request):  # retries={r}\n        return self.pool.submit(request, {t})\n"


def claude_code_tools(count: int = 12) -> list[dict]:
    """Tool definitions about the size of Claude Code's (long descriptions, nested schemas)."""
    description = "Executes the given command and returns its output. " * 25
    return [
        {
            "type": "function",
            "function": {
                "name": f"Tool{i}",
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The command to execute."},
                        "timeout": {"type": "number", "description": "Optional timeout in milliseconds."},
                        "description": {"type": "string", "description": "What the command does."},
                    },
                    "required": ["command"],
                },
            },
        }
        for i in range(count)
    ]


def tool_call(call_id: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "Tool1", "arguments": arguments}}


@dataclass
class Step:
    """One turn of the script: the model's reply, its sampled ids and what the client adds after it."""

    message: dict
    output_ids: list[int]
    echo_untouched: dict
    echo_reserialised: dict
    added: list[dict]


def sampled_ids(tokenizer, message: dict) -> list[int]:
    """What the model samples for ``message``: its rendered turn after the generation prompt."""
    head = [{"role": "user", "content": "."}]
    prompt = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(head + [message], tokenize=False)
    text = full[len(prompt) : full.rindex("<|im_end|>") + len("<|im_end|>")]
    return tokenizer.encode(text, add_special_tokens=False)


def script(tokenizer, turns: int, rng: random.Random, context: int = CONTEXT_TOKENS) -> list[Step]:
    """A conversation whose tool results grow the context to about ``context`` tokens by the last turn."""
    line_tokens = len(tokenizer.encode(LINE.format(i=123, r=3, t=45), add_special_tokens=False))
    lines_per_result = max(1, (context - 10_000) // turns // line_tokens)
    steps = []
    for n in range(turns):
        call_id = f"toolu_{n:04d}"
        args = {"command": f"sed -n 1,200p src/m{n}.py", "description": "Read the module", "timeout": 60}
        message = {
            "role": "assistant",
            "content": "Let me read the module." if n % 4 else "",
            "reasoning_content": f"Step {n}: the failure points at module {n}; read it before editing.",
            "tool_calls": [tool_call(call_id, args)],
        }
        # the CLI sends tool inputs back re-serialised (here: other key order) and may drop thinking
        reserialised = dict(message, tool_calls=[tool_call(call_id, dict(reversed(args.items())))])
        if rng.random() < 0.5:
            reserialised.pop("reasoning_content")
        result = "".join(LINE.format(i=i, r=i % 5, t=rng.randrange(10, 99)) for i in range(lines_per_result))
        added = [{"role": "tool", "tool_call_id": call_id, "content": result}]
        if n % 10 == 9:
            added.append({"role": "user", "content": f"{REMINDER}\nKeep going."})
        steps.append(Step(message, sampled_ids(tokenizer, message), message, reserialised, added))
    return steps


@dataclass
class Result:
    seconds_per_turn: list[float]
    stitch_seconds: float
    kept: float
    new_chains: int
    prompt_tokens: int

    @property
    def total(self) -> float:
        return sum(self.seconds_per_turn) + self.stitch_seconds

    @property
    def tail(self) -> float:
        last = self.seconds_per_turn[-10:]
        return sum(last) / len(last)


def replay(history, steps: list[Step], tools: list[dict], echo: str) -> Result:
    messages = [
        {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude. " * 40},
        {"role": "user", "content": f"{REMINDER}\nFix the failing tests."},
    ]
    per_turn, new_chains, prompt_tokens = [], 0, 0
    for version, step in enumerate(steps):
        start = time.process_time()
        plan = history.plan(messages, tools)
        history.commit(plan, step.output_ids, [-0.25] * len(step.output_ids), "stop", version, step.message)
        per_turn.append(time.process_time() - start)
        new_chains += plan.new_chain
        prompt_tokens = len(plan.prompt_ids)
        messages = messages + [getattr(step, f"echo_{echo}")] + step.added
    start = time.process_time()
    chains = history.all_chains()
    sequences = [seq for chain in chains for seq in chain.sequences()]
    stitch = time.process_time() - start
    sampled = sum(len(t.output_ids) for chain in chains for t in chain.turns)
    kept = sum(sum(seq.loss_mask) for seq in sequences) / sampled
    return Result(per_turn, stitch, kept, new_chains, prompt_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 10-turn conversation to ~16k tokens")
    args = parser.parse_args()
    tokenizer = load_tokenizer("qwen3.6")
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    tools = claude_code_tools()
    print(
        f"{'turns':>5} {'echo':>12} {'context':>8} {'canon ms/turn':>13} {'rerender':>9} {'last-10':>8} "
        f"{'total x':>8} {'kept canon':>10} {'kept rerender':>13} {'new chains':>10}"
    )
    for turns in (10,) if args.quick else (10, 50, 100):
        steps = script(tokenizer, turns, random.Random(turns), 16_000 if args.quick else CONTEXT_TOKENS)
        for echo in ("untouched", "reserialised"):
            canon = replay(CanonicalHistory(tokenizer, stop_token_ids=stops), steps, tools, echo)
            rerender = replay(RerenderHistory(tokenizer, stop_token_ids=stops), steps, tools, echo)
            print(
                f"{turns:>5} {echo:>12} {canon.prompt_tokens:>8} {1e3 * canon.total / turns:>13.2f} "
                f"{1e3 * rerender.total / turns:>9.2f} {rerender.tail / canon.tail:>7.1f}x "
                f"{rerender.total / canon.total:>7.1f}x {canon.kept:>10.1%} {rerender.kept:>13.1%} "
                f"{canon.new_chains:>10}"
            )


if __name__ == "__main__":
    main()
