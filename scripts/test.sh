#!/usr/bin/env bash
# The whole test suite: host dependencies, lints, unit and integration tests
# against real runsc, real SQLite and a real server on an ephemeral port.
set -euo pipefail
cd "$(dirname "$0")/.."
# A one-shot run gains nothing from incremental state, which would double the
# size of target/ (CI's disk is shared and not large).
export CARGO_INCREMENTAL=0
stage() { echo "== test.sh $(date +%T): $*"; }

stage setup
scripts/setup.sh
stage build
PROFILE=debug FEATURES=test-hooks scripts/build.sh

stage lints
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --features space/test-hooks,space-agent/test-hooks -- -D warnings

stage templates
# Integration tests share one template cache; build it once up front.
export SPACE_TEST_TEMPLATES="$PWD/target/space-test-templates"
target/debug/space admin prepare-template busybox --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent
target/debug/space admin prepare-template debian --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent
target/debug/space admin prepare-template code-interpreter --templates-dir "$SPACE_TEST_TEMPLATES" --data-dir /nonexistent

# The conformance suite must run on both runtimes here: a runtime that is
# unavailable fails the run instead of being skipped.
export SPACE_TEST_REQUIRE_RUNTIMES=gvisor,microvm
stage "test clients"
# The pinned client libraries the tests drive: E2B SDKs (tests/e2b.rs), the MCP client (tests/mcp.rs).
scripts/test-clients.sh
stage "workspace tests"
# A production build reads no failpoint (the same test, without the feature).
cargo test -p space-service --lib test_hooks
cargo test --workspace --features space/test-hooks --no-fail-fast -- --test-threads 4

stage "microVM pass"
# Whole suites again with every sandbox on the microVM runtime (see docs/RUNTIMES.md for
# the suites not repeated here, and why). The same packages and features as the workspace
# run, so its test binaries are reused rather than built again (space-agent's own files
# tests come along; they run no sandbox).
SPACE_TEST_RUNTIME=microvm cargo test --workspace --features space/test-hooks \
  --test files --test disk --test restart --test cli --test e2b --no-fail-fast -- --test-threads 3

stage "python SDK"
# sdk/python against a real server its fixtures start: builds the wheel, checks the models
# against the served /v1/openapi.json, runs every method sync and async.
sdk/python/run-tests.sh -q

stage schemathesis
# The API against its own OpenAPI document: schemathesis, no 5xx (see scripts/schemathesis.sh).
scripts/schemathesis.sh
stage done
