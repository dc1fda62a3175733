#!/usr/bin/env bash
# The benchmarks: our API against raw runsc doing the same work, in the same run.
#   core:      create-to-ready, the `true` exec round trip, idle RSS
#   lifecycle: pause+resume, suspend, resume from a snapshot, snapshot size
#   commands:  256 MiB stdout throughput, exec latency with 1, 10 and 50 clients
#   files:     1 GiB up and down through the file API, as a tar and as one file
#   runtimes:  gvisor and microvm side by side: boot, suspend/resume, snapshot size, exec
#   list:      GET /v1/sandboxes with 100 running sandboxes (p50, p99) against runsc list
# Each prints one table; they never fail on speed, only when something breaks.
# Needs root, like the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
PROFILE=release scripts/build.sh

# The bench's server uses the shared test template cache.
export SPACE_TEST_TEMPLATES="$PWD/target/space-test-templates"
target/release/space admin prepare-template busybox --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent

cargo bench -p space --bench core
cargo bench -p space --bench lifecycle
cargo bench -p space --bench commands
cargo bench -p space --bench files
cargo bench -p space --bench runtimes
cargo bench -p space --bench list
