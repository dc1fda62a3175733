#!/usr/bin/env bash
# Builds space and the static in-sandbox agent.
#   PROFILE=release (default) or debug for the `space` binary; the agent is always a static release build.
#   FEATURES=test-hooks builds both with the test suite's hooks (failpoints, fake egress names);
#   without it (scripts/run.sh) they are not compiled in.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${PROFILE:-release}"

# The agent runs as PID 1 in any template (busybox has no libc): link it statically.
# An explicit --target keeps RUSTFLAGS away from build scripts and proc macros.
features=()
if [ -n "${FEATURES:-}" ]; then
  features=(--features "$FEATURES")
fi
# Stripped: every gVisor sandbox gets its own copy of the agent and reads it at boot; its
# symbols were a fifth of it.
RUSTFLAGS="-C target-feature=+crt-static -C strip=symbols" cargo build --release -p space-agent \
  --target x86_64-unknown-linux-gnu "${features[@]}"

if [ "$profile" = release ]; then
  cargo build --release -p space "${features[@]}"
else
  cargo build -p space "${features[@]}"
fi
echo "build: target/$profile/space and target/x86_64-unknown-linux-gnu/release/space-agent"
