"""Versioned checkpoints: a half-written version is never picked up, a loaded one resumes exactly."""

from __future__ import annotations

from pathlib import Path

import torch

from rollbus.policy_model import ModelSpec, random_qwen3
from rollbus.trainer import checkpoint
from rollbus.trainer.checkpoint import TrainerState
from rollbus.trainer.step import OptimConfig, make_optimizer

SPEC = ModelSpec(hidden_size=16, layers=1, heads=2, kv_heads=1, head_dim=8, intermediate_size=32)


def save(root: Path, model, optimizer, state: TrainerState, keep: int) -> Path:
    return checkpoint.save(root, model, model.state_dict(), optimizer.state_dict(), state, keep)


def stepped():
    model = random_qwen3(SPEC, 97, (0,), seed=1)
    optimizer = make_optimizer(model, OptimConfig(lr=1e-2))
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_half_written_version_is_ignored_and_cleaned(tmp_path: Path) -> None:
    model, optimizer = stepped()
    save(tmp_path, model, optimizer, TrainerState(version=1, step=1), keep=3)
    partial = tmp_path / ".v00000002.tmp"  # what a kill during the write leaves behind
    partial.mkdir()
    (partial / "config.json").write_text("{")
    assert checkpoint.latest(tmp_path) == tmp_path / "v00000001"
    save(tmp_path, model, optimizer, TrainerState(version=2, step=2), keep=3)
    assert checkpoint.versions(tmp_path) == [1, 2] and not partial.exists()


def test_a_loaded_checkpoint_has_the_same_weights_optimizer_and_state(tmp_path: Path) -> None:
    model, optimizer = stepped()
    state = TrainerState(
        version=7, step=3, finished_groups={"a": 5, "b": 9}, counters={"duplicates_dropped": 2}
    )
    path = save(tmp_path, model, optimizer, state, keep=2)
    loaded, optimizer_state, loaded_state = checkpoint.load(path)
    assert loaded_state == state
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    again = make_optimizer(loaded, OptimConfig(lr=1e-2))
    again.load_state_dict(optimizer_state)
    for a, b in zip(optimizer.state.values(), again.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_state_written_before_finish_times_keeps_its_groups_from_load_time() -> None:
    state = TrainerState.from_json({"version": 2, "step": 2, "finished_groups": ["a", "b"]})
    assert sorted(state.finished_groups) == ["a", "b"]
    assert min(state.finished_groups.values()) > 1_700_000_000_000  # wall-clock ms: a horizon starts now


def test_old_versions_are_pruned_to_keep(tmp_path: Path) -> None:
    model, optimizer = stepped()
    for version in range(5):
        save(tmp_path, model, optimizer, TrainerState(version=version), keep=2)
    assert checkpoint.versions(tmp_path) == [3, 4]


def test_a_sharded_hugging_face_moe_directory_loads_and_each_version_is_written_consolidated(
    tmp_path: Path, monkeypatch
) -> None:
    """``--model-path`` with a ``model.safetensors.index.json`` and several shards (as the hub ships large
    models); the learner's version is a directory ``from_pretrained`` reads back to the same weights, sharded
    itself once past ``MAX_SHARD``, and a resumed learner starts from it with its optimizer state."""
    from transformers import AutoModelForCausalLM

    from rollbus.trainer.learner import Learner, initial_model
    from rollbus.trainer.moe import MoeSpec, random_qwen3_moe
    from rollbus.trainer.settings import TrainerSettings

    source = tmp_path / "hub"
    original = random_qwen3_moe(SPEC, MoeSpec(experts=4, top_k=2, expert_size=16), 97, (0,), seed=2)
    original.save_pretrained(source, max_shard_size="20KB")
    assert (source / "model.safetensors.index.json").exists() and len(list(source.glob("*.safetensors"))) >= 2
    settings = TrainerSettings.load(
        {"model_path": source, "checkpoint_dir": tmp_path / "ckpt", "device": "cpu", "lr": 1e-2}
    )
    learner = Learner(settings, initial_model(settings), TrainerState())
    assert learner.moe_shape is not None and learner.replay is not None
    monkeypatch.setattr(checkpoint, "MAX_SHARD", "20KB")
    learner.optimizer.zero_grad()
    learner.model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    learner.optimizer.step()
    learner.state.version = learner.state.step = 1
    written = learner.save(keep=2)
    assert (written / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(written)
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    trained = learner.model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    resumed = Learner.resume(settings)
    assert resumed.state.version == 1
    before = {k: v["exp_avg"] for k, v in learner.optimizer.state_dict()["state"].items()}
    after = {k: v["exp_avg"] for k, v in resumed.optimizer.state_dict()["state"].items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
