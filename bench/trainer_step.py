"""Trainer step throughput and memory: long segments, chunked vs full-vocabulary logits, 2 ranks vs 1.

Each measurement runs in a fresh process (peak RSS is per process), on the engine's default random Qwen3
(hidden 64, 2 layers) over the real Qwen3.6 vocabulary (248k ids), with ~15% of the response tokens trained
(sampled tokens between long tool results). Reported: tokens per second (whole segment, and trained tokens),
the step's wall time, and peak RSS growth during the step. The baselines are measured in the same run:

* chunked vs full logits on the same segment (full logits at 20k tokens would need 20k x 248k x 4 bytes
  = ~20 GB per copy, so the comparison is at a length the machine can hold, and the 20k/64k figures of the
  full path are computed, not measured);
* ``torchrun --nproc-per-node 2`` (gloo, 1 thread per rank) vs one process with 1 and with 2 threads.

    python bench/trainer_step.py --quick   # one step each: 20k/64k chunked, 1k chunked vs full, DDP 4 x 1k
    python bench/trainer_step.py           # best of 3 steps each (the first includes warm-up), 2k baselines
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MASK_FRACTION = 0.15


def make_segment(total: int, seed: int):
    import torch

    from trainer.loss import SegmentInput

    g = torch.Generator().manual_seed(seed)
    prompt = min(2000, total // 4)
    ids = torch.randint(10, 240000, (total,), generator=g)
    runs = torch.rand(total - prompt, generator=g) < MASK_FRACTION  # sampled tokens, scattered
    positions = torch.nonzero(runs)[:, 0] + prompt
    logprobs = -torch.rand(len(positions), generator=g) * 3
    return SegmentInput(ids, positions, logprobs, advantage=1.0, weight=1.0 / max(len(positions), 1))


def measure(tokens: int, chunk: int, segments: int, steps: int, threads: int) -> dict:
    """One process's numbers (called in a fresh interpreter, possibly as one rank of torchrun)."""
    import psutil
    import torch
    import torch.distributed as dist

    from rollbus.policy_model import ModelSpec, random_qwen3
    from trainer.batch import split_for_ranks
    from trainer.loss import LossConfig
    from trainer.step import OptimConfig, make_optimizer, train_step

    torch.set_num_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model = random_qwen3(ModelSpec(), 248077, (248046,), 0)
    optimizer = make_optimizer(model, OptimConfig())
    batch = [make_segment(tokens, seed) for seed in range(segments)]
    share = split_for_ranks(batch, world)[rank]
    config = LossConfig(logits_chunk=chunk)
    rss_before = psutil.Process().memory_info().rss
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(model, optimizer, share, config, OptimConfig())
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if world > 1:
        dist.destroy_process_group()
    return {
        "tokens": tokens * segments, "trained": sum(len(s.positions) for s in batch), "seconds": min(times),
        "cpu_seconds": min(cpu),
        "peak_growth_mb": max(peak - rss_before, 0) / 2**20, "rank": rank,
    }  # fmt: skip


def run_child(args: list[str], torchrun: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
               "--master-port", str(29400 + os.getpid() % 1000), __file__, "--child", *args]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return next(r for r in rows if r["rank"] == 0)


def child_args(tokens: int, chunk: int, segments: int, steps: int, threads: int) -> list[str]:
    return [f"--tokens={tokens}", f"--chunk={chunk}", f"--segments={segments}", f"--steps={steps}",
            f"--threads={threads}"]  # fmt: skip


def line(name: str, r: dict) -> str:
    return (f"{name:<30} {r['seconds']:7.2f} s (cpu {r['cpu_seconds']:6.2f} s) "
            f"{r['tokens'] / r['seconds']:7.0f} tok/s "
            f"{r['trained'] / r['seconds']:6.0f} trained/s  peak +{r['peak_growth_mb']:6.0f} MB")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: one step per measurement, short segments"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for flag, default in (
        ("--tokens", 0),
        ("--chunk", 512),
        ("--segments", 1),
        ("--steps", 1),
        ("--threads", 1),
    ):
        parser.add_argument(flag, type=int, default=default, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(measure(args.tokens, args.chunk, args.segments, args.steps, args.threads)), flush=True
        )
        return
    steps = 1 if args.quick else 3
    print("long segments, chunked logits (1 thread):")
    for tokens in (2_000,) if args.quick else (20_000, 64_000):
        r = run_child(child_args(tokens, 512, 1, steps, 1))
        every = tokens * 248077 * 4 / 2**30
        masked = r["trained"] * 248077 * 4 / 2**30
        note = f" (full logits: {every:.0f} GB per copy; at trained positions only {masked:.1f} GB)"
        print(line(f"  {tokens // 1000}k tokens, chunk 512", r) + note)
    short = 500 if args.quick else 2000
    print(f"chunked vs full logits, {short}-token segment (1 thread):")
    chunked = run_child(child_args(short, 512, 1, steps, 1))
    full = run_child(child_args(short, 0, 1, steps, 1))
    print(line("  chunked (512)", chunked))
    print(line("  full logits", full))
    saved = full["peak_growth_mb"] - chunked["peak_growth_mb"]
    times = chunked["seconds"] / full["seconds"]
    print(f"  ratio: chunked time / full time = {times:.2f}; peak memory saved {saved:.0f} MB")
    print(f"data parallel, 4 segments x {short} tokens:")
    one = run_child(child_args(short, 512, 4, steps, 1))
    one_two_threads = run_child(child_args(short, 512, 4, steps, 2))
    ddp = run_child(child_args(short, 512, 4, steps, 1), torchrun=2)
    print(line("  1 process, 1 thread", one))
    print(line("  1 process, 2 threads", one_two_threads))
    print(line("  torchrun 2 ranks x 1 thread", ddp))
    print(f"  ratio: 2 ranks vs 1 process (1 thread) = {one['seconds'] / ddp['seconds']:.2f}x throughput; "
          f"vs 1 process (2 threads) = {one_two_threads['seconds'] / ddp['seconds']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
