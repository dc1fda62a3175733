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
stage "test binaries"
# A production build reads no failpoint (the same test, without the feature).
cargo test -p space-service --lib test_hooks
cargo test --workspace --features space/test-hooks --no-run

# The hostile suite (tests/hostile.rs, about 11 minutes, most of it one bomb at a time and
# the rest waiting on timeouts) runs beside everything below: the host's 2 CPUs are about
# half idle through the other suites. Its output is printed once it ends.
stage "hostile suite (beside the rest)"
mkdir -p target/test-logs
hostile_log=target/test-logs/hostile.log
rm -f "$hostile_log" target/test-logs/hostile.rc
(
  rc=0
  # --workspace, as in the build above: the same features, so the same binary (no rebuild).
  cargo test --workspace --features space/test-hooks --test hostile --no-fail-fast \
    -- --test-threads 4 >"$hostile_log" 2>&1 || rc=$?
  echo "$rc" >target/test-logs/hostile.rc
) &
hostile_pid=$!
# Waits for the hostile suite and prints what it printed; fails if it failed. Also run on
# any early exit, so that a failure elsewhere neither cuts it off nor hides its log.
hostile_done() {
  trap - EXIT
  wait "$hostile_pid" || true
  echo "---- tests/hostile.rs (ran beside the stages above) ----"
  cat "$hostile_log"
  echo "---- end of tests/hostile.rs ----"
  [ "$(cat target/test-logs/hostile.rc 2>/dev/null || echo 1)" = 0 ]
}
trap 'hostile_done || true' EXIT

stage "test clients"
# The pinned client libraries the tests drive: E2B SDKs (tests/e2b.rs), the MCP client (tests/mcp.rs).
scripts/test-clients.sh
stage "workspace tests"
# Every test target of the workspace but the hostile suite, which runs above.
other_tests=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
names = {t["name"] for p in m["packages"] for t in p["targets"] if "test" in t["kind"]}
print(" ".join("--test " + n for n in sorted(names - {"hostile"})))')
workspace_rc=0
# shellcheck disable=SC2086 # one word per flag
cargo test --workspace --features space/test-hooks --no-fail-fast --lib --bins $other_tests \
  -- --test-threads 4 || workspace_rc=$?
cargo test --workspace --features space/test-hooks --doc || workspace_rc=$?
if [ "$workspace_rc" != 0 ]; then
  exit "$workspace_rc"
fi

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
stage "hostile suite (waiting for it)"
hostile_done
stage done
