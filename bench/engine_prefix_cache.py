"""Prefix cache speed-up of the local engine on a growing agent conversation.

A 10-turn conversation grows to ~16k tokens (Claude Code prompts start near 15-20k): each turn appends
the previous output plus a ~1.6k-token tool result and generates 16 tokens. The same prompts are timed
on an engine with the prefix cache and on one without it (capacity 0), both built in this run and
sharing one model. Wall time is reported, and process CPU time, which is steadier when other jobs share
the cores; the ratios are over the whole conversation.

    ~/.cache/rollbus/venv/bin/python bench/engine_prefix_cache.py [--turns 10] [--tokens-per-turn 1600]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from rollbus.services.engine.engine import Engine
from rollbus.services.engine.model import ModelSpec, random_model
from rollbus.services.engine.policies import ChainRoute, SamplePolicy
from rollbus.services.engine.protocol import GenerateRequest, Generation, SamplingParams
from rollbus.services.engine.sampling import Sampling
from rollbus.tokenizer import SpecialIds, load_tokenizer


def tool_result(tokenizer, rng: random.Random, n_tokens: int) -> list[int]:
    """A user turn carrying ~``n_tokens`` of file-listing-like text."""
    words = ["src/", "engine", "test_", ".py", "def ", "return", "import ", "class ", "\n", "    ", "# "]
    body = tokenizer.encode("".join(rng.choice(words) for _ in range(n_tokens)), add_special_tokens=False)
    head = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n", add_special_tokens=False)
    tail = tokenizer.encode("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    return head + body[:n_tokens] + tail


def request(prompt: list[int], turn: int, new_tokens: int) -> GenerateRequest:
    params = SamplingParams(sampling=Sampling(temperature=1.0), max_new_tokens=new_tokens, ignore_eos=True,
                            sampling_seed=turn)
    return GenerateRequest(rid=f"turn-{turn}", input_ids=prompt, params=params, return_logprob=True)


def timed(engine: Engine, prompt: list[int], turn: int, new_tokens: int) -> tuple[float, float, Generation]:
    """Wall seconds, CPU seconds (all threads) and the generation."""
    wall, cpu = time.perf_counter(), time.process_time()
    generation = engine.generate(request(prompt, turn, new_tokens), ChainRoute("bench", "main"))
    return time.perf_counter() - wall, time.process_time() - cpu, generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--tokens-per-turn", type=int, default=1600)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 turns of 300 tokens")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.tokens_per_turn = 3, 300
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = load_tokenizer("qwen3.6")
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    model = random_model(ModelSpec(), len(tokenizer), stops, seed=0)
    cached = Engine(model, tokenizer, SamplePolicy(), model_path="bench", cache_capacity=8)
    uncached = Engine(model, tokenizer, SamplePolicy(), model_path="bench", cache_capacity=0)
    rng = random.Random(0)
    opening = ("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\n"
               "Fix the failing test.<|im_end|>\n<|im_start|>assistant\n")
    system = tokenizer.encode(opening, add_special_tokens=False)
    prompt = system
    totals = {"warm wall": 0.0, "warm cpu": 0.0, "cold wall": 0.0, "cold cpu": 0.0}
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'cached wall/cpu s':>18} {'uncached wall/cpu s':>20}")
    for turn in range(args.turns):
        prompt = prompt + tool_result(tokenizer, rng, args.tokens_per_turn)
        warm_wall, warm_cpu, warm = timed(cached, prompt, turn, args.new_tokens)
        cold_wall, cold_cpu, cold = timed(uncached, prompt, turn, args.new_tokens)
        assert cold.cached_tokens == 0 and warm.output_ids == cold.output_ids
        for key, value in zip(totals, (warm_wall, warm_cpu, cold_wall, cold_cpu), strict=True):
            totals[key] += value
        print(f"{turn + 1:>4} {len(prompt):>7} {warm.cached_tokens:>7} {warm_wall:>9.2f}/{warm_cpu:<8.2f} "
              f"{cold_wall:>10.2f}/{cold_cpu:<8.2f}")
        prompt = prompt + warm.output_ids
    print(f"total wall: cached {totals['warm wall']:.2f} s, uncached {totals['cold wall']:.2f} s, "
          f"speed-up {totals['cold wall'] / totals['warm wall']:.1f}x")
    print(f"total cpu:  cached {totals['warm cpu']:.2f} s, uncached {totals['cold cpu']:.2f} s, "
          f"speed-up {totals['cold cpu'] / totals['warm cpu']:.1f}x")

if __name__ == "__main__":
    main()
