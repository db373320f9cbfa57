"""compose/ is validated by a real Compose implementation (Debian's docker-compose needs no engine).

Beyond validity: every service has its container, every ROLLBUS_* variable the file names is one the service's
settings class reads (so a renamed option cannot leave the file silently setting nothing), and the secrets
reach only the services that need them.
"""

import functools
import importlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollbus.settings import Settings

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
# each rollbus container -> the settings class its command reads
SETTINGS = {
    "topics": "rollbus.commands.topics:TopicsSettings",
    "engine": "rollbus.services.engine.main:EngineSettings",
    "adapter": "rollbus.services.adapter.settings:AdapterSettings",
    "sandbox-runner": "rollbus.services.sandbox_runner.settings:RunnerSettings",
    "grader": "rollbus.services.grader.settings:GraderSettings",
    "gym-runner": "rollbus.services.gym_runner.settings:GymRunnerSettings",
    "segmenter": "rollbus.services.segmenter.settings:SegmenterSettings",
    "trainer": "rollbus.trainer.settings:TrainerSettings",
}
SERVICES = {"kafka", "sglang", *SETTINGS}
SECRETS = {
    "ENGINE_API_KEY": "engine-key-sentinel-0123456789",
    "ADAPTER_ADMIN_TOKEN": "admin-token-sentinel-0123456789",
    "ADAPTER_SIGNING_KEY": "signing-key-sentinel-0123456789",
}


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """docker-compose with ``env`` as its whole environment: a developer's compose/.env or shell stays out."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("no docker-compose: scripts/bootstrap.sh --test (make test) installs Debian's")
    command = [exe, "-p", "rollbus", "-f", str(COMPOSE), "--env-file", _no_env_file(), *args]
    return subprocess.run(
        command, capture_output=True, text=True, check=False, env={"PATH": "/usr/bin:/bin", **(env or {})}
    )


@functools.cache
def _no_env_file() -> str:
    empty = Path(tempfile.mkdtemp(prefix="rollbus-compose-")) / "empty.env"
    empty.write_text("")
    return str(empty)


@functools.cache
def _config() -> str:
    """The file as Compose resolves it, the GPU profile included, with sentinel secrets."""
    done = _compose("--profile", "gpu", "config", env=SECRETS)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _resolved() -> dict[str, Any]:
    return yaml.safe_load(_config())["services"]


def _settings_class(service: str) -> type[Settings]:
    module, name = SETTINGS[service].split(":")
    return getattr(importlib.import_module(module), name)


def _variables(cls: type[Settings]) -> set[str]:
    return {cls.env_var(name) for name in cls.model_fields}


def test_compose_file_is_valid() -> None:
    done = _compose("config", "-q", env=SECRETS)
    assert done.returncode == 0, done.stderr


SPEC = Path(__file__).resolve().parent / "compose_spec" / "compose-spec.json"  # Compose v2's schema (README)
VALIDATE = """
import json, sys, jsonschema, yaml
validator = jsonschema.Draft7Validator(json.load(open(sys.argv[1])))
for path in sys.argv[2:]:
    for error in validator.iter_errors(yaml.safe_load(open(path))):
        print(path, "/".join(map(str, error.absolute_path)), error.message[:300])
"""


def _spec_errors(*files: Path) -> list[str]:
    """What the current compose-spec schema finds wrong in ``files``, checked by the jsonschema that Debian's
    docker-compose runs on (its own interpreter: the test venv has no jsonschema)."""
    exe = shutil.which("docker-compose")
    assert exe, "no docker-compose: scripts/bootstrap.sh --test (make test) installs Debian's"
    interpreter = Path(exe).read_text(errors="replace").splitlines()[0].removeprefix("#!").split()
    done = subprocess.run([*interpreter, "-c", VALIDATE, str(SPEC), *map(str, files)], capture_output=True,
                          text=True, check=False, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_files_are_valid_for_the_current_compose_spec(tmp_path: Path) -> None:
    """Compose v2 validates against the compose-spec project's schema, newer than v1.29's copy."""
    assert _spec_errors(COMPOSE, COMPOSE.with_name("demo.yml")) == []
    broken = tmp_path / "broken.yml"  # the check sees what v2 would refuse
    typo = COMPOSE.read_text().replace("    pid: host\n", "    pid: host\n    privilegd: true\n", 1)
    broken.write_text(typo)
    [error] = _spec_errors(broken)
    assert "privilegd" in error and error.startswith(f"{broken} services/sandbox-runner")


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_a_missing_secret_stops_compose_naming_it(secret: str) -> None:
    done = _compose("config", "-q", env={k: v for k, v in SECRETS.items() if k != secret})
    assert done.returncode != 0
    assert secret in done.stderr


def test_every_service_has_a_container_and_only_sglang_needs_the_gpu_profile() -> None:
    resolved = _resolved()
    assert set(resolved) == SERVICES
    gpu_only = {name for name, service in resolved.items() if "gpu" in service.get("profiles", [])}
    assert gpu_only == {"sglang"}
    devices = resolved["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_every_rollbus_container_has_a_settings_class() -> None:
    rollbus = {name for name, s in _resolved().items() if s.get("image", "").startswith("rollbus")}
    assert rollbus == set(SETTINGS)


def test_services_run_rollbus_subcommands_that_read_the_mapped_settings_class() -> None:
    from rollbus.cli import COMMANDS, command_parser

    for name, service in _resolved().items():
        if name in SETTINGS:
            command = service["command"][0]
            assert command in COMMANDS, name
            parser = command_parser(command, importlib.import_module(COMMANDS[command][0]))
            flags = {flag for action in parser._actions for flag in action.option_strings}
            cls = _settings_class(name)
            assert {cls.flag(field) for field in cls.model_fields} <= flags, name


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_every_variable_of_a_service_is_one_its_settings_class_reads(service: str) -> None:
    environment = _resolved()[service].get("environment", {})
    read = _variables(_settings_class(service))
    unread = sorted(set(environment) - read)
    assert not unread, f"{service} does not read {unread}; it reads {sorted(read)}"


def test_every_rollbus_variable_named_anywhere_in_the_file_is_set_on_a_container() -> None:
    """Compose-level variables carry no ROLLBUS_ prefix: a ROLLBUS_ name is always a service's setting."""
    named = set(re.findall(r"\bROLLBUS_[A-Z0-9_]*[A-Z0-9]", COMPOSE.read_text()))
    on_containers = {var for s in _resolved().values() for var in s.get("environment", {})}
    # the one process-wide variable (rollbus.config.cache_dir), which the runner's entrypoint sets itself
    assert named - on_containers == {"ROLLBUS_CACHE"}


def test_every_value_set_is_one_the_settings_class_accepts() -> None:
    """The values themselves validate (ports, URLs, the signing key's length) with the secrets filled in."""
    for name, service in _resolved().items():
        if name in SETTINGS:
            cls = _settings_class(name)
            environment = {k: str(v) for k, v in service.get("environment", {}).items()}
            with pytest.MonkeyPatch.context() as patch:
                for key, value in environment.items():
                    patch.setenv(key, value)
                cls.load({})


def test_secrets_reach_only_the_services_that_need_them() -> None:
    resolved = _resolved()
    holders = {
        secret: {name for name, s in resolved.items() if value in json.dumps(s)}
        for secret, value in SECRETS.items()
    }
    assert holders["ENGINE_API_KEY"] == {"engine", "sglang", "adapter", "trainer"}
    assert holders["ADAPTER_ADMIN_TOKEN"] == {"adapter", "sandbox-runner", "gym-runner"}
    assert holders["ADAPTER_SIGNING_KEY"] == {"adapter"}
    assert SECRETS["ENGINE_API_KEY"] not in COMPOSE.read_text()


def test_no_service_is_privileged_and_only_the_sandboxing_services_reach_the_engine() -> None:
    """Sandboxes are sibling containers: the engine's socket and the host's pids (their sandboxes' owner
    stamps) go to the runner and the grader alone; CAP_SYS_ADMIN and CAP_SYS_PTRACE (the adapter's listener
    in the agent's network namespace) to the runner alone; what a sandbox mounts lives in SHARED_DIR,
    mounted at the one path the engine resolves."""
    resolved = _resolved()
    assert not {name for name, s in resolved.items() if s.get("privileged")}
    mounts = {name: " ".join(str(v) for v in s.get("volumes", [])) for name, s in resolved.items()}
    sockets = {name for name, text in mounts.items() if ":/var/run/docker.sock:" in text}
    assert sockets == {"sandbox-runner", "grader"}
    assert {name for name, s in resolved.items() if s.get("pid")} == sockets  # owner stamps: host pids
    assert {name for name, s in resolved.items() if s.get("cap_add")} == {"sandbox-runner"}
    assert resolved["sandbox-runner"]["cap_add"] == ["SYS_ADMIN", "SYS_PTRACE"]
    for name in sockets:
        shared = [str(v).split(":")[:2] for v in resolved[name]["volumes"] if "rollbus-shared" in str(v)]
        assert shared == [["/var/lib/rollbus-shared"] * 2], (name, shared)
    env = {name: resolved[name]["environment"] for name in sockets}
    assert env["sandbox-runner"]["ROLLBUS_SANDBOX_RUNNER_BACKEND"] == "docker"
    assert env["sandbox-runner"]["ROLLBUS_SANDBOX_RUNNER_SANDBOX_ROOT"].startswith("/var/lib/rollbus-shared/")
    assert env["grader"]["ROLLBUS_GRADER_BACKEND"] == "docker"
    assert env["grader"]["ROLLBUS_GRADER_SCRATCH_DIR"].startswith("/var/lib/rollbus-shared/")


def test_the_engine_loads_checkpoints_at_the_path_the_trainer_writes_them() -> None:
    resolved = _resolved()
    state = {
        name: {str(v) for v in resolved[name].get("volumes", [])} for name in ("trainer", "engine", "sglang")
    }
    assert all(any(v.startswith("rollbus-state:/state") for v in vols) for vols in state.values()), state
    assert resolved["trainer"]["environment"]["ROLLBUS_STATE_DIR"] == "/state"
