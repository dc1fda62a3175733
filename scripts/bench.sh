#!/usr/bin/env bash
# The core benchmark: our API against raw runsc doing the same work, in one run
# (create-to-ready, the `true` round trip, idle RSS). Prints one table; never
# fails on speed, only when something breaks. Needs root, like the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
PROFILE=release scripts/build.sh

# The bench's server uses the shared test template cache.
export SPACE_TEST_TEMPLATES="$PWD/target/space-test-templates"
target/release/space admin prepare-template busybox --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent

cargo bench -p space --bench core
cargo bench -p space --bench lifecycle
