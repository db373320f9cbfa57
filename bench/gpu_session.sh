#!/usr/bin/env bash
# The trainer's checks on a GPU machine, as one script (a lent device has minutes, not hours).
# The machine's own python3 holds torch; the project's other pure-Python pins (transformers, huggingface_hub,
# pydantic, pydantic-settings, tenacity and what they need) travel as cp312 wheels in .whl/, fetched with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl NAME==VERSION` at the versions
# uv.lock pins. Each step has its own time limit, and a failure does not stop the next.
# Everything it prints is also written under $OUT (or ./gpu-out).
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
# one import name without installing: setup.py's package_dir maps services/ and trainer/ under rollbus, so
# link them there for this run (pytest and the bench put the checkout first on sys.path) and remove the links after
linked=()
for d in services trainer schemas examples; do
  [ -e "rollbus/$d" ] || { ln -s "../$d" "rollbus/$d"; linked+=("rollbus/$d"); }
done
trap 'rm -f "${linked[@]}"' EXIT
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
(nvidia-smi; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))") 2>&1 | tee "$out/machine.txt"
timeout "${TEST_LIMIT:-200}" python3 -m pytest --noconftest -p no:cacheprovider -o addopts= -q -s -rA \
  tests/test_trainer_cuda.py 2>&1 | tee "$out/tests.txt"
timeout "${BENCH_LIMIT:-300}" python3 bench/trainer_step.py --device cuda --shape gpu 2>&1 | tee "$out/bench.txt"
