#!/usr/bin/env bash
# A tiny venv per clone, layered on the shared heavy one: `clone_venv.sh SHARED_VENV [CLONE]`.
# The shared venv (torch, kafka clients ...) is keyed by the lock files and used by every clone, but the
# project's own code is not installed into it: an editable install there points at whichever clone
# bootstrapped last, so clone A would run clone B's code. Instead each clone gets <clone>/.rollbus/venv: one
# .pth adds the shared site-packages, and an editable install of this clone (setuptools' finder for the
# packaging map of setup.py: services/ -> rollbus.services ...) makes `rollbus` import this clone's code under
# its one name; the clone's root is not put on the path, so `services` is no package there. Its `rollbus`
# command and `python` run this clone's code. Prints the clone venv's path. Cheap; the venv is rebuilt when the
# base changes, the editable install when the packaging (pyproject.toml, setup.py) does.
set -euo pipefail
shared=$(cd "$1" && pwd)
here=$(cd "${2:-$(dirname "$0")/..}" && pwd)
local_venv="$here/.rollbus/venv"
site=$("$shared/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
if [ "$(cat "$local_venv/.base" 2>/dev/null)" != "$shared" ] || [ ! -x "$local_venv/bin/python" ]; then
  echo "bootstrap: clone venv $local_venv on $shared" >&2
  rm -rf "$local_venv"
  mkdir -p "$here/.rollbus"
  "$shared/bin/python" -m venv --without-pip "$local_venv"
fi
local_site=$("$local_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
printf 'import site; site.addsitedir(%s)\n' "'$site'" > "$local_site/_rollbus_clone.pth"
# no build isolation: setuptools comes from the shared venv, so this needs no index
packaging=$(cat "$here/pyproject.toml" "$here/setup.py" | sha256sum | cut -c1-16)
if [ "$(cat "$local_venv/.packaging" 2>/dev/null)" != "$packaging" ] || [ ! -x "$local_venv/bin/rollbus" ]; then
  uv pip install -q --python "$local_venv/bin/python" --no-deps --no-build-isolation -e "$here" >&2
  echo "$packaging" > "$local_venv/.packaging"
fi
# the tools `make` and people use, on the clone venv's PATH: ruff as is (a binary), pytest through this
# venv's python (the shared venv's own pytest script would import another clone's code)
ln -sfn "$shared/bin/ruff" "$local_venv/bin/ruff"
printf '#!/usr/bin/env bash\nexec "%s" -m pytest "$@"\n' "$local_venv/bin/python" > "$local_venv/bin/pytest"
chmod +x "$local_venv/bin/pytest"
echo "$shared" > "$local_venv/.base"
echo "$local_venv"
