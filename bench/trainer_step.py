"""Trainer step throughput and memory: dense and MoE, 1 process vs 2 FSDP2 ranks, long segments, chunking.

Each measurement runs in a fresh process (peak memory is per process), on the engine's default random Qwen3
(hidden 64, 2 layers) or its MoE twin (8 experts, top-2, every layer sparse) over the real Qwen3.6 vocabulary
(248k ids), with ~15% of the response tokens trained (sampled tokens between long tool results). Reported:
tokens per second (whole segment, and trained tokens), the step's wall time, and peak memory growth during
the step (RSS on the CPU; allocated device memory on a GPU). With a CUDA device (``--device cuda``) each line
also gives MFU against the card's dense bf16 peak, and the card's name; the model FLOPs are 6 x active
non-embedding parameters x tokens + 6 x hidden x vocabulary x trained tokens (attention scores omitted).
The baselines are measured in the same run:

* 1 process vs ``torchrun --nproc-per-node 2`` (FSDP2 over gloo, 1 thread per rank), dense and MoE;
* chunked vs full logits on the same segment (full logits at 20k tokens would need 20k x 248k x 4 bytes
  = ~20 GB per copy, so the 20k/64k figures of the full path are computed, not measured).

    python bench/trainer_step.py --quick   # 1 vs 2 ranks, dense and MoE, 4 x 512 tokens, one step each
    python bench/trainer_step.py           # + 20k/64k segments, chunked vs full; best of 3 steps each
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

    from rollbus.trainer.loss import SegmentInput

    g = torch.Generator().manual_seed(seed)
    prompt = min(2000, total // 4)
    ids = torch.randint(10, 240000, (total,), generator=g)
    runs = torch.rand(total - prompt, generator=g) < MASK_FRACTION  # sampled tokens, scattered
    positions = torch.nonzero(runs)[:, 0] + prompt
    logprobs = -torch.rand(len(positions), generator=g) * 3
    return SegmentInput(ids, positions, logprobs, advantage=1.0, weight=1.0 / max(len(positions), 1))


BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def peak_tflops(card: str) -> float | None:
    """Dense bf16 peak of a known card (tensor cores, no sparsity), by the name CUDA reports."""
    return next((tflops for name, tflops in BF16_PEAK_TFLOPS.items() if name in card), None)


def model_flops(model, tokens: int, trained: int) -> float:
    """Training FLOPs of one step: 6 x active non-embedding parameters per token, plus the LM head at the
    trained positions (experts count top_k / experts of their parameters)."""
    config = model.config
    active = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name:
            continue
        share = config.num_experts_per_tok / config.num_experts if ".experts." in name else 1.0
        active += p.numel() * share
    return 6 * active * tokens + 6 * config.hidden_size * config.vocab_size * trained


def measure(tokens: int, chunk: int, segments: int, steps: int, threads: int, kind: str, device: str) -> dict:
    """One process's numbers (called in a fresh interpreter, possibly as one rank of torchrun)."""
    import psutil
    import torch
    import torch.distributed as dist

    from rollbus.policy_model import ModelSpec, random_qwen3
    from rollbus.trainer.batch import split_for_ranks
    from rollbus.trainer.device import placement
    from rollbus.trainer.loss import LossConfig, PolicyForward
    from rollbus.trainer.moe import MoeSpec, random_qwen3_moe
    from rollbus.trainer.sharding import even_shares, shard
    from rollbus.trainer.step import OptimConfig, make_optimizer, train_step

    torch.set_num_threads(threads)
    where = placement(device, "auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if where.device.type == "cuda":
        torch.cuda.set_device(where.device)
    if world > 1:
        dist.init_process_group(where.backend)
    rank = dist.get_rank() if world > 1 else 0
    if kind == "moe":
        model = random_qwen3_moe(ModelSpec(), MoeSpec(), 248077, (248046,), 0)
    else:
        model = random_qwen3(ModelSpec(), 248077, (248046,), 0)
    flops_model = model
    forward = PolicyForward(model.to(where.device))
    if world > 1:
        shard(forward, where)
    optimizer = make_optimizer(forward, OptimConfig())
    batch = [make_segment(tokens, seed) for seed in range(segments)]
    share = even_shares(split_for_ranks(batch, world))[rank]
    config = LossConfig(logits_chunk=chunk)
    rss_before = psutil.Process().memory_info().rss
    times, cpu = [], []
    for _ in range(steps):
        if where.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(forward, optimizer, share, config, OptimConfig(), where)
        if where.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    if where.device.type == "cuda":
        peak_growth = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_growth = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before, 0) / 2**20
    trained = sum(len(s.positions) for s in batch)
    result = {
        "tokens": tokens * segments, "trained": trained, "seconds": min(times), "cpu_seconds": min(cpu),
        "peak_growth_mb": peak_growth, "rank": rank, "device": where.name(),
        "flops": model_flops(flops_model, tokens * segments, trained), "world": world,
    }  # fmt: skip
    if world > 1:
        dist.destroy_process_group()
    return result


def run_child(args: list[str], torchrun: int = 0) -> dict:
    from rollbus.kafka.broker import free_port

    cmd = [sys.executable, __file__, "--child", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
               "--master-port", str(free_port()), __file__, "--child", *args]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    out = done.stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return next(r for r in rows if r["rank"] == 0)


def child_args(
    tokens: int, chunk: int, segments: int, steps: int, threads: int, kind: str = "dense", device: str = "cpu"
) -> list[str]:
    return [f"--tokens={tokens}", f"--chunk={chunk}", f"--segments={segments}", f"--steps={steps}",
            f"--threads={threads}", f"--kind={kind}", f"--device={device}"]  # fmt: skip


def line(name: str, r: dict) -> str:
    text = (f"{name:<30} {r['seconds']:7.2f} s (cpu {r['cpu_seconds']:6.2f} s) "
            f"{r['tokens'] / r['seconds']:7.0f} tok/s "
            f"{r['trained'] / r['seconds']:6.0f} trained/s  peak +{r['peak_growth_mb']:6.0f} MB")  # fmt: skip
    peak = peak_tflops(r["device"])
    if peak is not None:  # every rank does 1/world of the work in the same wall time
        mfu = r["flops"] / r["seconds"] / r["world"] / (peak * 1e12)
        text += f"  MFU {mfu:.2%} of {r['device']} bf16 peak {peak:.0f} TFLOP/s"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 vs 2 ranks only, one step per measurement")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="dense", choices=["dense", "moe"], help=argparse.SUPPRESS)
    for flag, default in (("--tokens", 0), ("--chunk", 512), ("--segments", 1), ("--steps", 1),
                          ("--threads", 1)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        given = (args.tokens, args.chunk, args.segments, args.steps, args.threads, args.kind, args.device)
        print(json.dumps(measure(*given)), flush=True)
        return
    steps = 1 if args.quick else 3
    size = 512 if args.quick else 2000
    speedups = {}
    for kind in ("dense", "moe"):
        print(f"{kind}, 4 segments x {size} tokens, on {args.device}:")
        one = run_child(child_args(size, 512, 4, steps, 1, kind, args.device))
        two = run_child(child_args(size, 512, 4, steps, 1, kind, args.device), torchrun=2)
        print(line("  1 process, 1 thread", one))
        print(line("  torchrun 2 ranks (FSDP2)", two))
        speedups[kind] = one["seconds"] / two["seconds"]
    if not args.quick:
        long_segments(steps)
    print(f"ratio: 2 FSDP2 ranks vs 1 process = {speedups['dense']:.2f}x (dense), "
          f"{speedups['moe']:.2f}x (moe) step throughput")  # fmt: skip


def long_segments(steps: int) -> None:
    print("long segments, chunked logits (1 thread):")
    for tokens in (20_000, 64_000):
        r = run_child(child_args(tokens, 512, 1, steps, 1))
        every = tokens * 248077 * 4 / 2**30
        masked = r["trained"] * 248077 * 4 / 2**30
        note = f" (full logits: {every:.0f} GB per copy; at trained positions only {masked:.1f} GB)"
        print(line(f"  {tokens // 1000}k tokens, chunk 512", r) + note)
    print("chunked vs full logits, 2000-token segment (1 thread):")
    chunked = run_child(child_args(2000, 512, 1, steps, 1))
    full = run_child(child_args(2000, 0, 1, steps, 1))
    print(line("  chunked (512)", chunked))
    print(line("  full logits", full))
    saved = full["peak_growth_mb"] - chunked["peak_growth_mb"]
    print(f"  chunked time / full time = {chunked['seconds'] / full['seconds']:.2f}; "
          f"peak memory saved {saved:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
