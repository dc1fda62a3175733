#!/usr/bin/env bash
# The benchmarks: our API against raw runsc doing the same work, in the same run.
#   core:      create-to-ready, the `true` exec round trip, idle RSS
#   lifecycle: pause+resume, suspend, resume from a snapshot, snapshot size
#   commands:  256 MiB stdout throughput, exec latency with 1, 10 and 50 clients
#   files:     1 GiB up and down through the file API, as a tar and as one file
#   runtimes:  gvisor and microvm side by side: boot, suspend/resume, snapshot size, exec
#   list:      GET /v1/sandboxes with 100 running sandboxes (p50, p99) against runsc list
#   e2b:       commands.run("true") through the Python E2B SDK and through /v1, against runsc exec
#   pools:     create to first result from a warm pool and cold, against runsc create+start+exec
#   interpreter: the first result of 1+1 in a fresh code-interpreter sandbox (cold and
#              from a pool) and per-cell latency, against a local Jupyter kernel
#   creates:   one create at a time, then 16 at once, to a first result, against runsc create +
#              start + exec true (16 in parallel); 100 at once, each succeeded or refused (429),
#              none failed or hung
# Each prints one table; they never fail on speed, only when something breaks.
# Needs root, like the tests.
set -euo pipefail
# Retries for a mirror that does not answer for a moment (scripts/apt.conf).
export APT_CONFIG="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/apt.conf"
cd "$(dirname "$0")/.."

scripts/setup.sh
PROFILE=release scripts/build.sh

# The bench's server uses the shared test template cache.
export SPACE_TEST_TEMPLATES="$PWD/target/space-test-templates"
target/release/space admin prepare-template busybox --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent
target/release/space admin prepare-template debian --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent
target/release/space admin prepare-template code-interpreter --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent
# The interpreter bench's local side: a Jupyter kernel on the host, from Debian.
if ! /usr/bin/python3 -c 'import jupyter_client, ipykernel' 2>/dev/null; then
  apt-get install -y -qq python3-ipykernel python3-jupyter-client >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq python3-ipykernel python3-jupyter-client >/dev/null; }
fi
scripts/test-clients.sh

cargo bench -p space --bench core
cargo bench -p space --bench lifecycle
cargo bench -p space --bench commands
cargo bench -p space --bench files
cargo bench -p space --bench runtimes
cargo bench -p space --bench list
cargo bench -p space --bench e2b
cargo bench -p space --bench pools
cargo bench -p space --bench interpreter
cargo bench -p space --bench creates
