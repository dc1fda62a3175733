#!/usr/bin/env bash
# The main job: install host dependencies, build, make the default template,
# and run `space serve` on 127.0.0.1:7070 in dev mode (token: space-dev-token).
set -euo pipefail
cd "$(dirname "$0")/.."
data_dir="${SPACE_DATA_DIR:-/var/lib/space}"

scripts/setup.sh
scripts/build.sh
# The CLI the README's tour uses, on PATH for every shell (a link to this build).
if [[ -w /usr/local/bin ]]; then
  ln -sf "$PWD/target/release/space" /usr/local/bin/space
  echo "run.sh: /usr/local/bin/space -> $PWD/target/release/space"
else
  echo "run.sh: /usr/local/bin is not writable; the CLI is $PWD/target/release/space"
fi
target/release/space admin prepare-template debian --data-dir "$data_dir"
target/release/space admin prepare-template busybox --data-dir "$data_dir"
# The code interpreter's template (about 1.5 minutes the first time): E2B's code interpreter
# SDK creates from it, and a first create should not wait for a build.
target/release/space admin prepare-template code-interpreter --data-dir "$data_dir"
echo "run.sh: the web console will be at http://127.0.0.1:7070/ (sign in with the dev token, \$SPACE_DEV_TOKEN or space-dev-token)"
exec target/release/space serve --dev --listen 127.0.0.1:7070 --data-dir "$data_dir"
