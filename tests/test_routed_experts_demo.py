"""``rollbus demo --moe`` / ``rollbus up --moe``: the flags each service gets, read by that service's own
settings (a flag one of them does not know would only show as a service failing to start), and the routing
figures the demo's summary reports from the trainer's step rows."""

from __future__ import annotations

import argparse

from rollbus.policy_model import MoeSpec
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.engine.main import EngineSettings
from rollbus.services.stack.demo import routing_figures
from rollbus.services.stack.up import Stack, StackSettings, moe_flags, service_specs
from rollbus.trainer.settings import TrainerSettings


def parsed(settings_class, argv: list[str]):
    parser = argparse.ArgumentParser()
    settings_class.add_arguments(parser)
    return settings_class.from_args(parser.parse_args(argv))


def test_moe_makes_every_side_agree_on_the_model_and_record_store_and_replay_its_routes(tmp_path) -> None:
    flags = moe_flags(StackSettings(moe=True, state_dir=tmp_path))
    engine = parsed(EngineSettings, flags["engine"])
    adapter = parsed(AdapterSettings, flags["adapter"])
    trainer = parsed(TrainerSettings, [*flags["trainer"], "--state-dir", str(tmp_path)])
    assert engine.moe_spec() == trainer.moe_spec() == MoeSpec()  # the same random MoE on both sides
    assert engine.enable_return_routed_experts and adapter.routed_experts
    assert trainer.routing_replay and trainer.mismatch_unreplayed
    plain = moe_flags(StackSettings(state_dir=tmp_path))
    assert parsed(EngineSettings, plain["engine"]).moe_spec() is None
    assert not parsed(AdapterSettings, plain["adapter"]).routed_experts


def test_the_stack_passes_the_moe_flags_and_adapter_and_trainer_share_the_store(tmp_path) -> None:
    settings = StackSettings(moe=True, state_dir=tmp_path)
    stack = Stack("127.0.0.1:9092", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "t", tmp_path, "k")
    args = {spec.name: list(spec.argv[4:]) for spec in service_specs(settings, stack)}  # after "rollbus NAME"
    engine = parsed(EngineSettings, args["engine"])
    adapter = parsed(AdapterSettings, args["adapter"])
    trainer = parsed(TrainerSettings, args["trainer"])
    assert engine.moe_spec() == trainer.moe_spec() is not None and engine.enable_return_routed_experts
    assert adapter.routed_experts and trainer.routing_replay
    assert adapter.routes_dir() == trainer.routes_dir() == tmp_path / "up" / "routed-experts"


def test_the_summary_averages_the_routing_figures_of_the_runs_steps() -> None:
    rows = [
        {"replayed_fraction": 1.0, "routing_agreement": 0.75, "logprob_diff_mean": 1e-6,
         "logprob_diff_max": 2e-6, "approx_kl": 0.0, "unreplayed_logprob_diff_mean": 0.2,
         "unreplayed_approx_kl": 0.01},
        {"replayed_fraction": 0.5, "routing_agreement": 0.25, "logprob_diff_mean": 3e-6,
         "logprob_diff_max": 9e-6, "approx_kl": 0.0, "unreplayed_logprob_diff_mean": 0.4,
         "unreplayed_approx_kl": 0.03},
    ]  # fmt: skip
    figures = routing_figures(rows)
    assert figures["routing_replayed_fraction"] == 0.75 and figures["routing_agreement"] == 0.5
    assert figures["logprob_diff_max"] == 9e-6 and abs(figures["unreplayed_logprob_diff_mean"] - 0.3) < 1e-12
    assert routing_figures([{"replayed_fraction": 0.0}])["routing_agreement"] is None  # never replayed
