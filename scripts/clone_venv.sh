#!/usr/bin/env bash
# A tiny venv per clone, layered on the shared heavy one: `clone_venv.sh SHARED_VENV [CLONE]`.
# The shared venv (torch, kafka clients ...) is keyed by the lock files and used by every clone, but the
# project's own code is not installed into it: an editable install there points at whichever clone
# bootstrapped last, so clone A would run clone B's code. Instead each clone gets <clone>/.rollbus/venv
# whose one .pth puts the clone first on the path, then the shared site-packages; its `rollbus` command
# and `python` run this clone's code. Prints the clone venv's path. Cheap; rebuilt when the base changes.
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
printf '%s\nimport site; site.addsitedir(%s)\n' "$here" "'$site'" > "$local_site/_rollbus_clone.pth"
cat > "$local_venv/bin/rollbus" <<SCRIPT
#!$local_venv/bin/python
import sys

from rollbus.cli import main

sys.exit(main())
SCRIPT
chmod +x "$local_venv/bin/rollbus"
# the tools `make` and people use, on the clone venv's PATH: ruff as is (a binary), pytest through this
# venv's python (the shared venv's own pytest script would import another clone's code)
ln -sfn "$shared/bin/ruff" "$local_venv/bin/ruff"
printf '#!/usr/bin/env bash\nexec "%s" -m pytest "$@"\n' "$local_venv/bin/python" > "$local_venv/bin/pytest"
chmod +x "$local_venv/bin/pytest"
echo "$shared" > "$local_venv/.base"
echo "$local_venv"
