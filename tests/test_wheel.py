"""The package works away from the clone: a wheel holds ``rollbus`` alone (services and trainer under it), the
schemas and the demo's examples as package data, and installed into a fresh venv outside the clone its
``rollbus`` command answers and finds its schemas and its demo's tasks there, not in the clone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pydantic
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = shutil.which("uv")
    assert uv, "uv is installed by scripts/bootstrap.sh"
    out = tmp_path_factory.mktemp("wheel")
    work = tmp_path_factory.mktemp("src")
    # build from a copy of the tracked files, so nothing built or cached in the clone leaks into the wheel
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src, dest = ROOT / rel, work / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_file():
            shutil.copy2(src, dest)
    subprocess.run([uv, "build", "--wheel", "-o", str(out)], cwd=work, check=True, capture_output=True,
                   timeout=600)  # fmt: skip
    (built,) = out.glob("rollbus-*.whl")
    return built


def test_the_wheel_holds_rollbus_alone_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"rollbus", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "rollbus/services/adapter/app.py" in names and "rollbus/trainer/main.py" in names
    assert "rollbus/schemas/diff.avsc" in names
    assert {"rollbus/services/ui/templates/rollout.html", "rollbus/services/ui/static/ui.js"} <= set(names)
    assert "rollbus/examples/swe-mini/demo.jsonl" in names and "rollbus/examples/swe-mini/build.py" in names
    assert not [n for n in names if "/images/" in n or "__pycache__" in n]
    # the packaging map (setup.py) carries every module of the three code folders under its one name
    tracked = subprocess.run(["git", "ls-files", "rollbus", "services", "trainer"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    code = {p if p.startswith("rollbus/") else f"rollbus/{p}" for p in tracked if p.endswith(".py")}
    assert code - set(names) == set()


def test_the_installed_wheel_runs_from_outside_the_clone(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # the dependencies from this venv's site-packages; the project itself only from the wheel
    Path(site, "_deps.pth").write_text(str(Path(pydantic.__file__).parents[1]) + "\n")
    uv = shutil.which("uv")
    assert uv
    subprocess.run([uv, "pip", "install", "--python", str(python), "--no-deps", str(wheel)], check=True,
                   capture_output=True)  # fmt: skip
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    helped = subprocess.run([str(venv / "bin" / "rollbus"), "demo", "--help"], cwd=away, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert helped.returncode == 0 and "usage: rollbus demo" in helped.stdout, helped.stderr
    where = subprocess.run(
        [str(python), "-c", "import rollbus.codec as c, rollbus.services.stack.demo as d;"
         "print(c.SCHEMA_DIR); print(d.DemoSettings.model_fields['tasks'].default)"],
        cwd=away, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert all(Path(p).resolve().is_relative_to(Path(site).resolve()) for p in where), where
    assert Path(where[1]).is_file()
