"""FSDP2 across real ``torchrun`` ranks (gloo, CPU) against one unsharded process, dense Qwen3 and Qwen3-MoE.

The file is also the worker: ``python tests/test_trainer_fsdp.py OUT KIND STEPS`` (plain, or under torchrun)
builds a small random model without the hub, trains STEPS fixed batches (five segments of unequal length, so
the ranks hold 3 and 2 and one rank runs a filler pass), and writes a consolidated checkpoint after each step
through the learner (gathered from the shards, written by rank 0). MoE segments carry the experts an
independent forward recorded, so routing replay runs inside the sharded step too. ``KILL_AT`` makes rank 1
SIGKILL itself inside the MoE block of that step; a fresh torchrun then resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollbus.kafka.broker import free_port  # noqa: E402
from rollbus.policy_model import ModelSpec, random_qwen3  # noqa: E402
from rollbus.trainer import checkpoint  # noqa: E402
from rollbus.trainer.checkpoint import TrainerState  # noqa: E402
from rollbus.trainer.loss import SegmentInput  # noqa: E402
from rollbus.trainer.moe import MoeSpec, random_qwen3_moe  # noqa: E402

VOCAB = 97
SPEC = ModelSpec(hidden_size=16, layers=2, heads=2, kv_heads=1, head_dim=8, intermediate_size=32,
                 context_length=256)  # fmt: skip
MOE = MoeSpec(experts=4, top_k=2, expert_size=16)


def build(kind: str) -> torch.nn.Module:
    if kind == "moe":
        return random_qwen3_moe(SPEC, MOE, VOCAB, (0,), seed=5)
    return random_qwen3(SPEC, VOCAB, (0,), seed=5)


def recorded_routes(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What the rollout's engine returns: each layer's chosen experts, rows for positions 0..T-2."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
             for layer in model.model.layers]  # fmt: skip
    with torch.no_grad():
        model(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1)[:-1].to(torch.uint8)


def batch(model: torch.nn.Module, kind: str, step: int) -> list[SegmentInput]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i, length in enumerate((9, 14, 6, 11, 8)):
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        positions = torch.arange(2, length)[torch.rand(length - 2, generator=g) < 0.7]
        positions = positions if len(positions) else torch.tensor([length - 1])
        logprobs = -torch.rand(len(positions), generator=g) * 4
        routes = recorded_routes(model, ids) if kind == "moe" else None
        out.append(
            SegmentInput(
                ids, positions, logprobs, advantage=(-1.0) ** i, weight=1 / 40, routed_experts=routes
            )
        )
    return out


def worker(out: Path, kind: str, steps: int) -> None:
    import torch.distributed as dist

    from rollbus.trainer.batch import split_for_ranks
    from rollbus.trainer.learner import Learner, follow, stop_followers
    from rollbus.trainer.settings import TrainerSettings

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    settings = TrainerSettings.load({
        "checkpoint_dir": out, "lr": 1e-2, "logits_chunk": 3, "device": "cpu", "threads": 1,
        "activation_checkpointing": kind == "moe", "mismatch_unreplayed": kind == "moe",
    })  # fmt: skip
    fresh = checkpoint.latest(out) is None
    learner = Learner(settings, build(kind), TrainerState()) if fresh else Learner.resume(settings)
    kill_at = int(os.environ.get("KILL_AT", "0"))
    if learner.rank == 1 and kill_at:
        arm_kill(learner, kill_at)
    if learner.rank != 0:
        follow(learner)
    else:
        if fresh:
            learner.save(keep=10)
        rows = []
        while learner.state.step < steps:
            reference = load_model(
                checkpoint.latest(out)
            )  # the rollout samples with the step's start weights
            shares = split_for_ranks(batch(reference, kind, learner.state.step), learner.world_size)
            result = learner.step(shares)
            learner.state.step += 1
            learner.state.version += 1
            learner.save(keep=10)
            rows.append({"loss": result.loss, "grad_norm": result.grad_norm, **vars(result.stats)})
        stop_followers()
        (out / f"result-{steps}.json").write_text(json.dumps(rows))
    if dist.is_initialized():
        dist.barrier()  # the ranks tear the group down together, not one while the other is mid-collective
        dist.destroy_process_group()


def arm_kill(learner, at_step: int) -> None:
    """SIGKILL this rank in the middle of its ``at_step``-th training pass (inside the MoE block)."""
    steps = {"n": 0}
    train = learner.train

    def counted(shares):
        steps["n"] += 1
        return train(shares)

    def kill(module, args, output):
        if steps["n"] == at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    learner.train = counted
    learner.model.model.layers[1].mlp.register_forward_hook(kill)


def load_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# --------------------------------------------------------------------------- the tests


def start(out: Path, kind: str, steps: int, ranks: int, **env: str) -> tuple[subprocess.Popen, list]:
    """The worker in the background: runs that do not depend on each other overlap (the machine has two
    cores and each process trains on one thread, so the results are those of runs made one at a time).
    Its output goes to files, not pipes: a run nobody reads yet must not block on a full pipe."""
    command = [sys.executable, __file__, str(out), kind, str(steps)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-port", str(free_port()), *command[1:]]  # fmt: skip
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    output = [tempfile.TemporaryFile("w+") for _ in range(2)]
    return subprocess.Popen(command, env=environment, stdout=output[0], stderr=output[1], text=True), output


def finish(started: tuple[subprocess.Popen, list]) -> subprocess.CompletedProcess:
    proc, output = started
    try:
        proc.wait(timeout=900)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    for file in output:
        file.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output[0].read(), output[1].read())


def run(out: Path, kind: str, steps: int, ranks: int, **env: str) -> subprocess.CompletedProcess:
    return finish(start(out, kind, steps, ranks, **env))


@pytest.fixture(scope="module")
def moe_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """Two MoE steps on two ranks, uninterrupted: its v1 is the sharded step the MoE case of
    test_two_sharded_ranks_take_the_step_of_one_process compares, its v2 the reference the kill test
    resumes to (one torchrun instead of two). Started on first use; calling the result waits for it."""
    out = tmp_path_factory.mktemp("moe-two-ranks")
    proc = start(out, "moe", 2, 2)
    done: list[subprocess.CompletedProcess] = []

    def wait() -> Path:
        if not done:
            done.append(finish(proc))
        assert done[0].returncode == 0, done[0].stderr[-4000:]
        return out

    try:
        yield wait
    finally:
        if proc[0].poll() is None:
            proc[0].kill()
            proc[0].wait()


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_sharded_ranks_take_the_step_of_one_process(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    one = tmp_path / "one"
    single_run = start(one, kind, 1, 1)
    if kind == "moe":  # the first of the shared run's two steps
        two, steps = request.getfixturevalue("moe_two_ranks")(), 2
    else:
        two, steps = tmp_path / "two", 1
        done = run(two, kind, 1, 2)
        assert done.returncode == 0, done.stderr[-4000:]
    done = finish(single_run)
    assert done.returncode == 0, done.stderr[-4000:]
    single, sharded = (
        json.loads((one / "result-1.json").read_text()),
        json.loads((two / f"result-{steps}.json").read_text()),
    )
    assert sharded[0]["tokens"] == single[0]["tokens"] > 0
    for key in ("loss", "grad_norm", "abs_diff", "approx_kl", "abs_diff_max"):
        assert sharded[0][key] == pytest.approx(single[0][key], rel=1e-5), key
    if kind == "moe":
        assert sharded[0]["replayed"] == single[0]["replayed"] == single[0]["tokens"]
        assert sharded[0]["unreplayed_tokens"] == single[0]["tokens"]
        for key in ("unreplayed_abs_diff", "unreplayed_abs_diff_max", "unreplayed_approx_kl"):
            assert sharded[0][key] == pytest.approx(single[0][key], rel=1e-5), key
    before, after, got = weights(one / "v00000000"), weights(one / "v00000001"), weights(two / "v00000001")
    assert got.keys() == after.keys()
    assert all(not torch.equal(after[k], before[k]) for k in after if "norm" not in k), "every weight trained"
    for key in after:  # one lost or doubled step moves trained weights by ~lr (1e-2)
        torch.testing.assert_close(got[key], after[key], rtol=1e-5, atol=1e-6, msg=key)
    loaded = build(kind).__class__.from_pretrained(two / "v00000001")  # a consolidated, loadable checkpoint
    assert torch.equal(loaded.model.embed_tokens.weight, after["model.embed_tokens.weight"])


def test_a_kill_inside_a_sharded_step_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, moe_two_ranks: Callable[[], Path]
) -> None:
    killed = tmp_path / "killed"
    dead = run(killed, "moe", 2, 2, KILL_AT="2")
    assert dead.returncode != 0 and "SIGKILL" in dead.stderr, dead.stderr[-4000:]
    assert checkpoint.versions(killed) == [0, 1], "the kill came inside step 2, after v1 was written"
    again = run(killed, "moe", 2, 2)
    assert again.returncode == 0, again.stderr[-4000:]
    expected, got = weights(moe_two_ranks() / "v00000002"), weights(killed / "v00000002")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
