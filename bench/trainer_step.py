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

    python bench/trainer_step.py --quick   # 1 vs 2 ranks, dense and MoE, 4 x 256 tokens, one step each
    python bench/trainer_step.py           # + 20k/64k segments, chunked vs full; best of 3 steps each
    python bench/trainer_step.py --device cuda --shape gpu   # GPU-sized layers, 4 x 4096 tokens, with MFU

``--shape gpu`` builds the models on the device at sizes whose matrix products fill a GPU: a dense Qwen3 of
Qwen3-1.7B's layer shape (hidden 2048, 28 layers) and a Qwen3-MoE of Qwen3-30B-A3B's layer shape (hidden 2048,
128 experts, top-8) cut to 4 layers so that weights, gradients and AdamW state fit one card. With one GPU the
"2 ranks" line is FSDP2 over NCCL at world size 1: the sharded path's cost, no parameter split across cards.
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


SHAPES = {  # (dense spec, MoE spec, MoE spec's experts)
    "tiny": None,
    "gpu": ({"hidden_size": 2048, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
             "intermediate_size": 6144},
            {"hidden_size": 2048, "layers": 4, "heads": 32, "kv_heads": 4, "head_dim": 128,
             "intermediate_size": 6144},
            {"experts": 128, "top_k": 8, "expert_size": 768}),
}  # fmt: skip


def build_model(kind: str, shape: str, device):
    """The bench's random model, built on ``device`` (a GPU-sized one initialises in seconds there)."""
    import torch

    from rollbus.policy_model import ModelSpec, random_qwen3
    from rollbus.trainer.moe import MoeSpec, random_qwen3_moe

    sizes = SHAPES[shape]
    dense = ModelSpec(**sizes[0]) if sizes else ModelSpec()
    sparse, experts = (ModelSpec(**sizes[1]), MoeSpec(**sizes[2])) if sizes else (ModelSpec(), MoeSpec())
    with torch.device(device):
        if kind == "moe":
            return random_qwen3_moe(sparse, experts, 248077, (248046,), 0)
        return random_qwen3(dense, 248077, (248046,), 0)


def measure(
    tokens: int, chunk: int, segments: int, steps: int, threads: int, kind: str, device: str,
    shape: str = "tiny", force_shard: bool = False, cast_experts: bool = True,
) -> dict:  # fmt: skip
    """One process's numbers (called in a fresh interpreter, possibly as one rank of torchrun)."""
    import psutil
    import torch
    import torch.distributed as dist

    from rollbus.trainer.batch import split_for_ranks
    from rollbus.trainer.device import placement
    from rollbus.trainer.expert_precision import cast_experts_under_autocast
    from rollbus.trainer.loss import LossConfig, PolicyForward
    from rollbus.trainer.routing_replay import RoutingReplay
    from rollbus.trainer.sharding import even_shares, shard
    from rollbus.trainer.step import OptimConfig, make_optimizer, train_step

    torch.set_num_threads(threads)
    where = placement(device, "auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if where.device.type == "cuda":
        torch.cuda.set_device(where.device)
    sharded = world > 1 or force_shard
    if sharded:
        dist.init_process_group(where.backend)
    rank = dist.get_rank() if sharded else 0
    model = build_model(kind, shape, where.device)
    flops_model = model
    experts = getattr(model.config, "_experts_implementation", None) if kind == "moe" else None
    forward = PolicyForward(model, RoutingReplay(model) if kind == "moe" else None)
    if sharded:
        shard(forward, where)
    elif where.mixed and cast_experts:  # as the trainer's Learner does in one process
        cast_experts_under_autocast(model)
    optimizer = make_optimizer(forward, OptimConfig())
    batch = [make_segment(tokens, seed) for seed in range(segments)]
    if kind == "moe":  # replayed routes, as a rollout records them: random distinct experts per position
        config = model.config
        for segment in batch:
            scores = torch.rand(tokens - 1, config.num_hidden_layers, config.num_experts)
            segment.routed_experts = scores.topk(config.num_experts_per_tok, -1).indices.to(torch.uint8)
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
        "flops": model_flops(flops_model, tokens * segments, trained), "world": world, "sharded": sharded,
        "experts_implementation": experts,
    }  # fmt: skip
    if sharded:
        dist.destroy_process_group()
    return result


def run_child(args: list[str], torchrun: int = 0) -> dict:
    from rollbus.kafka.broker import free_port

    cmd = [sys.executable, __file__, "--child", *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun),
               "--master-port", str(free_port()), __file__, "--child", *args]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    out = done.stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return next(r for r in rows if r["rank"] == 0)


def child_args(
    tokens: int, chunk: int, segments: int, steps: int, threads: int, kind: str = "dense",
    device: str = "cpu", shape: str = "tiny", force_shard: bool = False, cast_experts: bool = True,
) -> list[str]:  # fmt: skip
    return [f"--tokens={tokens}", f"--chunk={chunk}", f"--segments={segments}", f"--steps={steps}",
            f"--threads={threads}", f"--kind={kind}", f"--device={device}", f"--shape={shape}",
            *(["--force-shard"] if force_shard else []),
            *([] if cast_experts else ["--no-cast-experts"])]  # fmt: skip


def line(name: str, r: dict) -> str:
    text = (f"{name:<30} {r['seconds']:7.2f} s (cpu {r['cpu_seconds']:6.2f} s) "
            f"{r['tokens'] / r['seconds']:7.0f} tok/s "
            f"{r['trained'] / r['seconds']:6.0f} trained/s  peak {'' if r['device'] != 'cpu' else '+'}"
            f"{r['peak_growth_mb']:6.0f} MB")  # fmt: skip
    peak = peak_tflops(r["device"])
    if peak is not None:  # every rank does 1/world of the work in the same wall time
        mfu = r["flops"] / r["seconds"] / r["world"] / (peak * 1e12)
        text += f"  MFU {mfu:.2%} of {r['device']} bf16 peak {peak:.0f} TFLOP/s"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 vs 2 ranks only, one step per measurement")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="model size (gpu: GPU-sized)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--force-shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-cast-experts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="dense", choices=["dense", "moe"], help=argparse.SUPPRESS)
    for flag, default in (("--tokens", 0), ("--chunk", 512), ("--segments", 1), ("--steps", 1),
                          ("--threads", 1)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        given = (args.tokens, args.chunk, args.segments, args.steps, args.threads, args.kind, args.device)
        measured = measure(*given, args.shape, args.force_shard, not args.no_cast_experts)
        print(json.dumps(measured), flush=True)
        return
    steps = 1 if args.quick else 3
    size = 256 if args.quick else 2000
    if args.shape == "gpu":
        size = 4096
    ranks, force = 2, False
    if args.device == "cuda":
        import torch

        ranks = min(2, torch.cuda.device_count())
        force = ranks == 1
    label = "torchrun 2 ranks (FSDP2)" if ranks == 2 else "torchrun 1 rank (FSDP2, NCCL)"
    speedups = {}
    for kind in ("dense", "moe"):
        print(f"{kind}, 4 segments x {size} tokens, on {args.device}, shape {args.shape}:")
        given = (size, 512, 4, steps, 1, kind, args.device, args.shape)
        one = run_child(child_args(*given))
        two = run_child(child_args(*given, force), torchrun=ranks)
        print(line("  1 process, 1 thread", one))
        if kind == "moe" and args.device == "cuda":  # the grouped product autocast does not cover
            print(line("  1 process, experts not cast", run_child(child_args(*given, False, False))))
        print(line(f"  {label}", two))
        if one["experts_implementation"]:
            print(f"  experts implementation: {one['experts_implementation']}")
        speedups[kind] = one["seconds"] / two["seconds"]
    if not args.quick and args.shape == "tiny":
        long_segments(steps)
    sharded = "2 FSDP2 ranks" if ranks == 2 else "1 FSDP2 rank over NCCL"
    print(f"ratio: {sharded} vs 1 process = {speedups['dense']:.2f}x (dense), "
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
