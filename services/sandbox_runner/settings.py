"""Settings of ``rollbus sandbox-runner`` (flags ``--x-y``, variables ``ROLLBUS_SANDBOX_RUNNER_X_Y``)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator

from rollbus import claude_cli
from rollbus.sandbox import Limits
from rollbus.sandbox.base import SandboxError
from rollbus.sandbox.bwrap_host import SCRATCH_ROOT
from rollbus.sandbox.e2b_backend import E2BOptions
from rollbus.settings import ADAPTER_URL, ServiceConsumerSettings

MIB = 1 << 20

DEFAULT_PROMPT_TEMPLATE = "{prompt}"


class RunnerSettings(ServiceConsumerSettings):
    """Settings of ``rollbus sandbox-runner``: where the adapter is, how rollouts run, what they may use."""

    model_config = ServiceConsumerSettings.scoped("sandbox-runner")

    adapter_url: str = Field(ADAPTER_URL, description="adapter the agent talks to", min_length=1)
    admin_token: SecretStr | None = Field(None, description="the adapter's admin token (sessions API)")
    backend: Literal["bwrap", "docker", "e2b"] = Field(
        "bwrap",
        description="sandbox backend of the agent (docker: the row's metadata.image, a container image the "
        "engine has; e2b: template and routing from ROLLBUS_E2B_*)",
    )
    public_adapter_url: str | None = Field(
        None, description="the adapter as an E2B VM reaches it (unset: --adapter-url)"
    )
    node_tarball: str | None = Field(
        None, description="e2b: host path or URL of the Node 22 linux-x64 tarball (.tar.xz/.tar.gz)"
    )
    claude_code_tarball: str | None = Field(
        None,
        description="e2b: host path or URL of npm-packed Claude Code (bin claude, or the native linux-x64)",
    )
    e2b_install_dir: str = Field(
        "/opt/rollbus-agent", min_length=2, description="e2b: where node/ and the CLI (cli/) go in the VM"
    )
    e2b_path: str = Field(
        "/usr/local/bin:/usr/bin:/bin",
        min_length=1,
        description="e2b: the VM's PATH after the installed tools",
    )
    e2b_poll: float = Field(2.0, gt=0, description="e2b: seconds between polls of a running remote command")
    e2b_step_timeout: float = Field(
        300.0, gt=0, description="e2b: seconds for one setup step in the VM (install, patch capture)"
    )
    agent_port: int = Field(
        8080, ge=1, le=65535, description="loopback port of the adapter inside the sandbox"
    )
    sandbox_root: Path = Field(SCRATCH_ROOT, description="host directory of sandboxes (traversable by all)")
    toolchain: Path | None = Field(
        None, description="root filesystem (dir or tarball) instead of the host /usr"
    )
    memory_mb: int | None = Field(4096, ge=64, description="memory limit of one sandbox, MiB (unset: none)")
    pids: int | None = Field(1024, ge=16, description="process limit of one sandbox (unset: none)")
    cpus: float | None = Field(2.0, gt=0, description="CPU bandwidth of one sandbox, cores (unset: none)")
    tmp_mb: int | None = Field(1024, ge=1, description="size of the sandbox's /tmp, MiB (unset: none)")
    disk_mb: int | None = Field(4096, ge=1, description="workspace + HOME size limit, MiB (unset: none)")
    output_mb: int = Field(32, ge=1, description="agent output kept per stream, MiB (head and tail)")
    consumer_group: str = Field(
        "rollbus-sandbox-runner", min_length=1, description="Kafka consumer group on tasks (add runners)"
    )
    concurrency: int = Field(2, ge=1, description="rollouts run at once by this runner")
    boot_concurrency: int = Field(4, ge=1, description="sandboxes booting at once")
    boot_attempts: int = Field(3, ge=1, description="tries to boot a sandbox before the attempt fails")
    boot_backoff: float = Field(0.5, ge=0, description="seconds before the first boot retry (doubles)")
    infra_retries: int = Field(
        2, ge=0, description="re-runs of a sample the infrastructure failed (rollbus.failures): each a new "
        "rollout of the same group and sample index, the next attempt number; 0: none"
    )
    inject_infra_failures: int = Field(
        0, ge=0, description="testing: the first N sandbox creations of this runner fail as infrastructure "
        "(boot_failed, not retried within the boot)"
    )
    agent_timeout: float = Field(1800.0, gt=0, description="wall-clock budget of one agent run, seconds")
    agent: str = Field(
        "claude_code",
        description="agent harness of rows without metadata.agent (claude_code | codex | mini_swe_agent)",
    )
    model: str = Field("rollbus-engine", min_length=1, description="model name the CLI asks for")
    max_turns: int = Field(50, ge=1, description="agent turns allowed per rollout")
    context_length: int = Field(
        32768, ge=4096, description="the served model's context in tokens (the adapter's --context-length): "
        "Codex's context window, and when it compacts so that its compaction request still fits",
    )
    max_output_tokens: int = Field(claude_cli.DEFAULT_MAX_OUTPUT_TOKENS, ge=1, description="CLI output cap")
    prompt_template: str = Field(
        DEFAULT_PROMPT_TEMPLATE,
        description="the agent's prompt; {prompt} is the row's problem_statement (else its prompt)",
    )
    cli_args: str = Field("", description="extra Claude Code arguments (shell words)")
    disallowed_tools: str = Field("WebFetch,WebSearch", description="tools the CLI denies (comma-separated)")
    agents_file: Path | None = Field(None, description="JSON file of sub-agent definitions (--agents)")
    patch_max_bytes: int = Field(2 * 2**20, ge=1024, le=6 * 2**20, description="patch size cap (bytes)")
    exclude_paths: str = Field(
        ".claude,.rollbus", description="workspace paths left out of the patch (comma-separated)"
    )
    poll_ms: int = Field(500, ge=10, description="consumer poll timeout, milliseconds")
    consumer_timeout_ms: int = Field(
        2000, ge=10, le=30_000,
        description="at most this long between the consumer's background fetcher's looks at its partitions, "
        "milliseconds (aiokafka's consumer_timeout_ms, default 200): what needs a new fetch (records taken, "
        "a resume, a seek, a rebalance) wakes it at once, so only an idle runner's wake-ups (5 a second at "
        "200, ~0.5 CPU-ms each: bench/rollout_cost.py) fall with it",
    )  # fmt: skip
    session_timeout_ms: int = Field(10_000, ge=1000, description="Kafka group session timeout, milliseconds")
    close_timeout: float = Field(30.0, gt=0, description="seconds to wait for the adapter's sessions API")
    adapter_wait: float = Field(
        120.0, ge=0,
        description="seconds a new attempt waits for an adapter that does not answer, then session_failed",
    )  # fmt: skip

    @field_validator("memory_mb", "pids", "cpus", "tmp_mb", "disk_mb", mode="before")
    @classmethod
    def _none_unsets(cls, value: object) -> object:
        """``none`` unsets a limit that has a default (under Compose the workspace's tmpfs would be this
        container's mount, which the engine starting the sandbox never sees: ``--disk-mb none``)."""
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("prompt_template")
    @classmethod
    def _has_prompt(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError("the template must contain {prompt}")
        return value

    @field_validator("agent")
    @classmethod
    def _known_agent(cls, value: str) -> str:
        from rollbus.services.sandbox_runner.harnesses import registry

        if value not in registry():
            raise ValueError(f"one of {', '.join(registry())}")
        return value

    @field_validator("cli_args")
    @classmethod
    def _shell_words(cls, value: str) -> str:
        shlex.split(value)  # unbalanced quotes fail here, not in the first rollout
        return value

    @field_validator("agents_file")
    @classmethod
    def _agents_json(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                data = json.loads(value.read_text())
            except OSError as exc:
                raise ValueError(f"cannot read it: {exc.strerror}") from None
            if not isinstance(data, dict):
                raise ValueError("the agents file must hold a JSON object {name: {description, prompt}}")
        return value

    @field_validator("node_tarball", "claude_code_tarball")
    @classmethod
    def _tarball(cls, value: str | None) -> str | None:
        if value and not value.startswith(("http://", "https://")) and not Path(value).is_file():
            raise ValueError("not a file (give a host path or an http(s) URL)")
        return value or None

    @model_validator(mode="after")
    def _e2b_complete(self) -> Self:
        if self.backend != "e2b":
            return self
        if not (self.node_tarball and self.claude_code_tarball):
            raise ValueError(
                "--backend e2b needs --node-tarball and --claude-code-tarball (host paths or URLs)"
            )
        if not self.e2b_install_dir.startswith("/"):
            raise ValueError("--e2b-install-dir must be an absolute path in the VM")
        try:
            self.e2b_options()  # ROLLBUS_E2B_METADATA_FILE is read (and checked) here, at start
        except SandboxError as exc:
            raise ValueError(str(exc)) from None
        return self

    def e2b_options(self, **overrides: object) -> E2BOptions:
        """The E2B backend's own options, read where it reads them (``ROLLBUS_E2B_TEMPLATE``,
        ``ROLLBUS_E2B_METADATA_FILE``, ``ROLLBUS_E2B_IMAGE_METADATA_KEY``); polled at ``--e2b-poll``."""
        given: dict[str, object] = {
            "poll_s": self.e2b_poll,
            "output_bytes": self.output_mb * MIB,
            **overrides,
        }
        return E2BOptions.from_env(os.environ, **given)

    def e2b_base_url(self) -> str:
        """``ANTHROPIC_BASE_URL`` in an E2B VM: the adapter's public address (no forwarder there)."""
        return self.public_adapter_url or self.adapter_url

    def extra_cli_args(self) -> list[str]:
        args = shlex.split(self.cli_args)
        if self.agents_file is not None:
            args += ["--agents", json.dumps(json.loads(self.agents_file.read_text()))]
        return args

    def denied_tools(self) -> list[str]:
        return [t.strip() for t in self.disallowed_tools.split(",") if t.strip()]

    def excluded(self) -> list[str]:
        return [p.strip().strip("/") for p in self.exclude_paths.split(",") if p.strip().strip("/")]

    def limits(self) -> Limits:
        def mib(value: int | None) -> int | None:
            return None if value is None else value * MIB

        return Limits(
            memory_bytes=mib(self.memory_mb), pids=self.pids, cpus=self.cpus, tmp_bytes=mib(self.tmp_mb),
            disk_bytes=mib(self.disk_mb), output_bytes=self.output_mb * MIB, wall_s=self.agent_timeout,
        )  # fmt: skip

    def agent_base_url(self) -> str:
        """``ANTHROPIC_BASE_URL`` as the agent sees it: the adapter listener on the sandbox's own loopback."""
        return f"http://127.0.0.1:{self.agent_port}"

    def admin(self) -> str:
        return self.admin_token.get_secret_value() if self.admin_token else ""
