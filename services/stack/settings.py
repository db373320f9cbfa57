"""Settings of ``rollbus up`` and ``rollbus demo``, apart from the stack they start: ``--help`` reads these
alone (no Kafka client, HTTP client or console library)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rollbus.demo_runs import last_demo, new_demo_namespace
from rollbus.package_data import data_dir
from rollbus.settings import BusSettings, shared

EXAMPLES = data_dir("examples")


class StackSettings(BusSettings):
    """Settings of ``rollbus up`` (flags --x-y, variables ROLLBUS_UP_X_Y)."""

    model_config = BusSettings.scoped("up")
    embedded_broker: bool | None = Field(
        None,
        description="start the state dir's embedded broker; unset: yes, unless a bootstrap address is given "
        "(--bootstrap-servers or ROLLBUS_BOOTSTRAP_SERVERS): that cluster is used and no broker started",
    )
    policy: Literal["sample", "scripted"] = Field("scripted", description="the engine's policy")
    script: Path = Field(
        EXAMPLES / "swe-mini" / "scripts",
        description="scripted policy: a JSON file, or a directory of NAME.json per task (rollout-id prefix)",
    )
    codex_script: Path = Field(
        EXAMPLES / "swe-mini" / "scripts-codex",
        description="scripted policy of the rollouts the Codex CLI runs (its requests come through the "
        "adapter's Responses route); unset while --script is given: --script serves them too",
    )
    agent: Literal["claude_code", "codex"] = Field(
        "claude_code", description="the sandbox runner's agent harness for rows without metadata.agent"
    )
    sandbox_backend: Literal["bwrap", "docker"] = Field(
        "bwrap",
        description="sandbox backend of the agent and of the grader (docker: each row's metadata.image, a "
        "container image the engine has or, for a Harbor task, builds; the runner's and grader's --backend)",
    )
    engine_port: int = Field(0, ge=0, le=65535, description="engine port (0: a free one)")
    adapter_port: int = Field(0, ge=0, le=65535, description="adapter port (0: a free one)")
    group_size: int = Field(2, ge=1, description="rollouts per group the trainer waits for")
    over_sample: int = Field(
        0, ge=0, description="the trainer's --over-sample: groups submitted with group size + N samples "
        "train their first valid group-size ones (the demo submits them so)"
    )
    rollout_batch_size: int = Field(1, ge=1, description="complete groups per training step")
    refill_dataset: Path | None = Field(
        None, description="the trainer's --refill-dataset: every group it will not train (no reward "
        "variance, lost to infrastructure, ...) is replaced by a new group of this dataset's next row"
    )
    steps: int = Field(0, ge=0, description="training steps before the trainer stops (0: never)")
    runner_concurrency: int = Field(2, ge=1, description="rollouts the sandbox runner runs at once")
    inject_infra_failures: int = Field(
        0, ge=0, description="testing: the first N sandbox creations of the run fail as infrastructure (the "
        "sandbox runner's --inject-infra-failures): re-run, never trained, counted in the summary"
    )
    gym: bool = Field(True, description="also run the gym runner (gym tasks)")
    moe: bool = Field(
        False,
        description="serve and train the small random Qwen3-MoE with rollout routing replay: the "
        "engine returns each turn's routed experts, the adapter stores them, the trainer replays them and "
        "measures its own routing beside",
    )
    external_plugins: str = Field(
        "", description="the gym runner's --external-plugins (.py files, comma-separated)"
    )
    gym_env: str | None = Field(None, description="the gym runner's --gym-env (env of rows without one)")
    ready_timeout: float = Field(180.0, gt=0, description="seconds each service may take to become ready")
    stop_grace: float = Field(20.0, gt=0, description="seconds a service may take to stop before SIGKILL")

    @model_validator(mode="after")
    def _gym_flags_need_the_gym_runner(self) -> StackSettings:
        """Plugins that no runner loads, or a missing file, would only show as episodes going wrong."""
        if (self.external_plugins or self.gym_env) and not self.gym:
            raise ValueError("--external-plugins and --gym-env go to the gym runner: add --gym")
        for path in plugin_paths(self):
            if path.suffix != ".py" or not path.is_file():
                raise ValueError(f"--external-plugins: {str(path)!r} is not a Python file")
        return self

    @model_validator(mode="after")
    def _one_broker(self) -> StackSettings:
        if self.embedded_broker and self.bootstrap_given():
            raise ValueError(
                f"--embedded-broker true and a bootstrap address ({self.bootstrap_servers}) name two "
                "brokers: give one (unset ROLLBUS_BOOTSTRAP_SERVERS to use the embedded broker)"
            )
        return self

    def bootstrap_given(self) -> bool:
        """A bootstrap address named by the user (flag or variable), not found in the state dir."""
        return "bootstrap_servers" in self.model_fields_set

    def starts_broker(self) -> bool:
        return self.embedded_broker if self.embedded_broker is not None else not self.bootstrap_given()

    def backend_flags(self) -> dict[str, list[str]]:
        """The sandbox runner's and the grader's ``--backend`` for ``--sandbox-backend``."""
        if self.sandbox_backend == "docker":
            return {"sandbox-runner": ["--backend", "docker"], "grader": ["--backend", "docker"]}
        return {"sandbox-runner": [], "grader": []}

    def engine_scripts(self) -> list[str]:
        """The engine's script flags: ``--script`` for every request and, unless ``--script`` alone was given
        (one script for every harness), ``--codex-script`` for the Codex CLI's: each row runs under its own
        harness (``metadata.agent``), whose tools its script must call."""
        flags = ["--script", str(self.script)]
        if "codex_script" in self.model_fields_set or "script" not in self.model_fields_set:
            flags += ["--codex-script", str(self.codex_script)]
        return flags


def plugin_paths(settings: StackSettings) -> list[Path]:
    """``--external-plugins`` as absolute paths (the runner may start elsewhere)."""
    return [Path(p.strip()).expanduser().resolve() for p in settings.external_plugins.split(",") if p.strip()]


class DemoSettings(StackSettings):
    """Settings of ``rollbus demo`` (flags --x-y, variables ROLLBUS_DEMO_X_Y)."""

    model_config = StackSettings.scoped("demo")
    tasks: Path = Field(
        EXAMPLES / "swe-mini" / "demo.jsonl",
        description="dataset submitted (slime's rows; metadata.agent picks a row's harness: swe-mini's "
        "demo-mixed.jsonl runs both)",
    )
    n_samples_per_prompt: int = Field(2, ge=1, description="rollouts per task (one group)")
    steps: int = Field(
        2, ge=0, description="training steps, one per round of the dataset (0: one round, no training wait)"
    )
    json_summary: Path | None = Field(None, description="also write the summary as JSON here")
    timeout: float = Field(1800.0, gt=0, description="seconds the whole demo may take")
    idle_timeout: float = Field(
        300.0, gt=0, description="seconds without any new event, once every rollout ended, before giving up"
    )
    gym: bool = Field(False, description="also run the gym runner")
    namespace: str = Field(
        "",
        validation_alias=shared("namespace"),
        description="the run's topic namespace: an earlier run's continues that run; unset: a new run of its "
        "own (demo-<time>-<hex>)",
        pattern=r"^[A-Za-z0-9._-]*$",
    )
    resume: bool = Field(
        False, description="continue the last demo run of the state dir (its topics and trainer checkpoints)"
    )

    @model_validator(mode="after")
    def _one_run(self) -> DemoSettings:
        if self.resume and "namespace" in self.model_fields_set:
            raise ValueError("--resume continues the last demo run and --namespace names one: give one")
        return self

    def run_namespace(self) -> tuple[str, str]:
        """The namespace this demo runs in, and how it was chosen (for its first line)."""
        state = self.state_dir / "up"
        if self.resume:
            return last_demo(state), "continuing the last demo run"
        if "namespace" in self.model_fields_set:
            return self.namespace, "the namespace given"
        return new_demo_namespace(), "a new run"
