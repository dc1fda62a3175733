#!/usr/bin/env bash
# Tests of the Python SDK against a real `space serve --dev` (started by the tests).
#
#   sdk/python/run-tests.sh [pytest args…]
#
# Makes (once) a virtualenv at <repo>/target/sdk-venv, installs the SDK with its
# test extra, builds its wheel into <repo>/target/sdk-wheel, then runs pytest.
# SPACE_BIN (default <repo>/target/debug/space, with space-agent beside it) and
# SPACE_TEST_TEMPLATES (default <repo>/target/space-test-templates, holding busybox
# and debian) say which server and templates the tests use.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="$repo/target/sdk-venv"
python="${PYTHON:-python3}"

"$python" - <<'EOF'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"the SDK needs Python >= 3.11, this is {sys.version.split()[0]}")
EOF

# A half-made venv (no pip) from an interrupted run is made again.
if [ ! -x "$venv/bin/pip" ]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
export PIP_CONSTRAINT="$here/test-constraints.txt"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$here[test]"
rm -rf "$repo/target/sdk-wheel"
"$venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps "$here" -w "$repo/target/sdk-wheel"
ls "$repo/target/sdk-wheel"/space_client-*.whl >/dev/null

export SPACE_BIN="${SPACE_BIN:-$repo/target/debug/space}"
export SPACE_TEST_TEMPLATES="${SPACE_TEST_TEMPLATES:-$repo/target/space-test-templates}"
cd "$here"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
