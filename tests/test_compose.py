"""compose/ is validated by a real Compose implementation (Debian's docker-compose needs no engine)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
SERVICES = {"kafka", "topics", "engine", "adapter", "sandbox-runner", "grader", "segmenter", "trainer"}


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: scripts/bootstrap.sh installs Debian's docker-compose")
    return subprocess.run(
        [exe, "-p", "rollbus", "-f", str(COMPOSE), *args], capture_output=True, text=True, check=False
    )


def test_compose_file_is_valid() -> None:
    done = _compose("config", "-q")
    assert done.returncode == 0, done.stderr


def test_every_service_has_a_container_and_only_sglang_needs_the_gpu_profile() -> None:
    resolved = yaml.safe_load(_compose("config").stdout)["services"]
    assert SERVICES <= set(resolved)
    gpu_only = {name for name, service in resolved.items() if "gpu" in service.get("profiles", [])}
    assert gpu_only == {"sglang"}
    devices = resolved["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_services_run_rollbus_subcommands_that_exist() -> None:
    from rollbus.cli import COMMANDS

    spec = yaml.safe_load(COMPOSE.read_text())
    for name, service in spec["services"].items():
        if service.get("image", "").startswith("rollbus"):
            assert service["command"][0] in COMMANDS, name
