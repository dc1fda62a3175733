#!/usr/bin/env bash
# Installs the pinned client libraries the compatibility tests drive, as real
# users would: the E2B SDKs (crates/space/tests/e2b/: Python in a venv, JS in a
# node prefix), the official Python MCP client (crates/space/tests/mcp/) and
# Playwright for Python driving Debian's chromium (crates/space/tests/console/),
# all under target/test-clients/ (chromium from apt). Idempotent: a second run with the right
# versions already installed does nothing.
#
#   Python: target/test-clients/venv/bin/python   (e2b==$PY_VERSION,
#           e2b-code-interpreter==$CI_VERSION, mcp==$MCP_VERSION,
#           playwright==$PW_VERSION; its browser is /usr/bin/chromium)
#   JS:     target/test-clients/node/node_modules  (e2b@$JS_VERSION and
#           @e2b/code-interpreter@$JS_CI_VERSION; the tests get it as E2B_NODE_MODULES)
set -euo pipefail
# Retries for a mirror that does not answer for a moment (scripts/apt.conf).
export APT_CONFIG="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/apt.conf"
cd "$(dirname "$0")/.."

PY_VERSION=2.63.0
CI_VERSION=2.11.5
MCP_VERSION=2.3.0
JS_VERSION=2.51.0
JS_CI_VERSION=2.8.0
PW_VERSION=1.65.2
DIR=target/test-clients
VENV=$DIR/venv
NODE=$DIR/node

mkdir -p "$DIR"

# --- Python SDK ---
py_ok() {
  "$VENV/bin/python" -c "import e2b, e2b_code_interpreter, mcp, importlib.metadata as m; assert m.version('e2b')=='$PY_VERSION' and m.version('e2b-code-interpreter')=='$CI_VERSION' and m.version('mcp')=='$MCP_VERSION' and m.version('playwright')=='$PW_VERSION'" >/dev/null 2>&1
}
if ! py_ok; then
  if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo APT_CONFIG=$APT_CONFIG"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq python3-venv
  fi
  # A half-made venv (no pip) from an interrupted run is rebuilt.
  [[ -x "$VENV/bin/pip" ]] || { rm -rf "$VENV"; python3 -m venv "$VENV"; }
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "e2b==$PY_VERSION" \
    "e2b-code-interpreter==$CI_VERSION" "mcp==$MCP_VERSION" "playwright==$PW_VERSION"
  py_ok || { echo "test-clients.sh: python e2b $PY_VERSION / e2b-code-interpreter $CI_VERSION / mcp $MCP_VERSION / playwright $PW_VERSION not importable after install" >&2; exit 1; }
fi

# --- The browser of the console tests: Debian's chromium, driven by Playwright ---
if ! command -v chromium >/dev/null; then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo APT_CONFIG=$APT_CONFIG"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq chromium >/dev/null
fi

# --- JS SDK ---
js_version() { # [PACKAGE]
  node -e "process.stdout.write(require(process.argv[1]).version)" \
    "$PWD/$NODE/node_modules/${1:-e2b}/package.json" 2>/dev/null || true
}
command -v node >/dev/null || { echo "test-clients.sh: node (>= 20) is required" >&2; exit 1; }
if [[ "$(js_version)" != "$JS_VERSION" || "$(js_version @e2b/code-interpreter)" != "$JS_CI_VERSION" ]]; then
  mkdir -p "$NODE"
  npm install --prefix "$NODE" --no-audit --no-fund --loglevel=error "e2b@$JS_VERSION" \
    "@e2b/code-interpreter@$JS_CI_VERSION" >/dev/null
  [[ "$(js_version)" == "$JS_VERSION" && "$(js_version @e2b/code-interpreter)" == "$JS_CI_VERSION" ]] \
    || { echo "test-clients.sh: JS e2b $JS_VERSION / @e2b/code-interpreter $JS_CI_VERSION not installed" >&2; exit 1; }
fi

echo "test clients: python e2b $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("e2b"), "e2b-code-interpreter", m.version("e2b-code-interpreter"), "mcp", m.version("mcp"), "playwright", m.version("playwright"))'), js e2b $(js_version) @e2b/code-interpreter $(js_version @e2b/code-interpreter), $(chromium --version 2>/dev/null)"
