#!/usr/bin/env bash
# Schemathesis against a real server: generates requests from /v1/openapi.json
# (valid and invalid ones) and fails on any 5xx or a response that breaks the
# document. Two passes:
#   1. every operation, with generated ids (and whatever ids schemathesis picks
#      up from responses: it creates, destroys and builds for real);
#   2. the operations under /v1/sandboxes/{id} against one running sandbox and one
#      of its commands (lifecycle changes and keepalive left out, so it stays up).
# Then it destroys every sandbox, stops the server by PID and checks that no
# runsc or QEMU process of its data dir is left.
#
# The server runs on an ephemeral port with a throwaway data dir and its own
# templates dir (busybox only): nothing it builds or deletes touches the shared
# test templates. Its pools may hold no sandbox (--pool-max-sandboxes 0): the pool
# routes are fuzzed, but nothing boots behind the API's back.
#
# Environment: SCHEMATHESIS_EXAMPLES (per operation, default 25),
# SCHEMATHESIS_SEED (default: random, printed), SCHEMATHESIS_CHECKS (default: the four that
# hold: not_a_server_error, status_code_conformance, content_type_conformance,
# response_schema_conformance), SPACE_BIN (default target/debug/space).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=4.32.5
VENV=target/venv-schemathesis
EXAMPLES=${SCHEMATHESIS_EXAMPLES:-25}
SEED=${SCHEMATHESIS_SEED:-$RANDOM}
BIN=${SPACE_BIN:-target/debug/space}
CHECKS=${SCHEMATHESIS_CHECKS:-not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance}

if [[ "$("$VENV/bin/schemathesis" --version 2>/dev/null)" != *"$VERSION"* ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$VERSION"
fi
[[ -x "$BIN" ]] || cargo build -p space

TMP=$(mktemp -d /tmp/space-schemathesis.XXXXXX)
DATA="$TMP/data"
TEMPLATES="$TMP/templates"
mkdir -p "$DATA" "$TEMPLATES"
TOKEN="st-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
SERVER_PID=""
FAILED=0

log() { echo "schemathesis.sh [${SECONDS}s]: $*" >&2; }

api() { # METHOD PATH [BODY]
  local args=(-sS -X "$1" -H "Authorization: Bearer $TOKEN" --max-time 120)
  [[ $# -ge 3 ]] && args+=(-H 'content-type: application/json' --data "$3")
  curl "${args[@]}" "$URL$2"
}

# Processes of this run's sandboxes: runsc and QEMU name the data dir in their arguments.
leftovers() {
  ps -eo pid=,args= | awk -v d="$DATA" 'index($0, d) && !/awk/ {print $1}' |
    grep -vx "${SERVER_PID:-0}" || true
}

# Destroys every sandbox that is not yet destroyed and waits until none is left (one that
# is already being destroyed or changing state answers 409 and is asked again); prints the
# ids still there after 90 s.
destroy_all() {
  local ids id op ops deadline=$((SECONDS + 90))
  while :; do
    ids=$(api GET /v1/sandboxes | python3 -c '
import json, sys
for s in json.load(sys.stdin).get("sandboxes", []):
    if s["state"] != "destroyed":
        print(s["id"])' 2>/dev/null)
    if [[ -z "$ids" || $SECONDS -ge $deadline ]]; then
      echo $ids
      return
    fi
    ops=()
    for id in $ids; do
      op=$(api DELETE "/v1/sandboxes/$id" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("id",""))' 2>/dev/null)
      [[ -n "$op" ]] && ops+=("$op")
    done
    for op in "${ops[@]}"; do
      api GET "/v1/operations/$op?wait=60s" >/dev/null
    done
    # Only sandboxes busy with another operation left: give it a moment.
    ((${#ops[@]} > 0)) || sleep 0.5
  done
}

cleanup() {
  local rc=$?
  set +e
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    local remaining
    log "destroying what is left"
    remaining=$(destroy_all)
    if [[ -n "$remaining" ]]; then
      log "sandboxes not destroyed: $remaining"
      rc=1
    fi
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  local left
  left=$(leftovers)
  if [[ -n "$left" ]]; then
    log "processes of $DATA left behind (killing them):"
    ps -o pid=,args= -p "$(echo $left | tr ' ' ,)" >&2
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null
    rc=1
  fi
  if grep -qF "$TMP" /proc/mounts; then
    log "mounts under $TMP left behind:"
    grep -F "$TMP" /proc/mounts >&2
    rc=1
  fi
  if ((rc != 0)); then
    log "server log: $TMP/server.log (kept)"
    tail -n 40 "$TMP/server.log" >&2
  else
    rm -rf "$TMP"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "failed at line $LINENO: $BASH_COMMAND"' ERR

"$BIN" admin prepare-template busybox --templates-dir "$TEMPLATES" --data-dir /nonexistent >/dev/null 2>&1

SPACE_DEV_TOKEN="$TOKEN" SPACE_LOG=info "$BIN" serve --dev --listen 127.0.0.1:0 \
  --data-dir "$DATA" --templates-dir "$TEMPLATES" \
  --tenant-max-sandboxes 4 --tenant-max-running-commands 16 \
  --max-vcpus 2 --max-memory-mib 1024 --max-disk-mib 4096 --pool-max-sandboxes 0 \
  >"$TMP/server.out" 2>"$TMP/server.log" </dev/null &
SERVER_PID=$!
URL=""
for _ in $(seq 300); do
  URL=$(sed -n 's/^space listening on //p' "$TMP/server.out")
  [[ -n "$URL" ]] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { log "the server exited"; exit 1; }
  sleep 0.1
done
[[ -n "$URL" ]] || { log "the server did not start"; exit 1; }
log "server $URL (pid $SERVER_PID), seed $SEED, $EXAMPLES examples per operation"

api GET /v1/openapi.json >"$TMP/openapi.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["openapi"].startswith("3.1") and d["paths"]' "$TMP/openapi.json"

ST=("$PWD/$VENV/bin/schemathesis")
COMMON=(
  --url "$URL"
  -H "Authorization: Bearer $TOKEN"
  --checks "$CHECKS"
  --max-examples "$EXAMPLES"
  --workers 1
  --request-timeout 30
  --phases examples,coverage,fuzzing
  --seed "$SEED"
  --no-color
  --suppress-health-check all
  --warnings off
)

# Pass 1: everything but the never-ending event stream.
log "pass 1: all operations"
if ! (cd "$TMP" && "${ST[@]}" run "$TMP/openapi.json" "${COMMON[@]}" --exclude-path /v1/events \
  --max-time 80) >"$TMP/pass1.log" 2>&1; then
  FAILED=1
fi
tail -n 25 "$TMP/pass1.log"

# Pass 2: one live sandbox and one finished command (after pass 1's are gone: at most 4).
log "destroying pass 1's sandboxes"
left=$(destroy_all)
[[ -z "$left" ]] || { log "sandboxes of pass 1 not destroyed: $left"; exit 1; }
log "pass 2: /v1/sandboxes/{id}/… on a running sandbox"
create=$(api POST /v1/sandboxes '{"template":"busybox","runtime":"gvisor"}')
SB=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["sandbox_id"])' "$create")
OP=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["id"])' "$create")
state=$(api GET "/v1/operations/$OP?wait=60s" | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
[[ "$state" == succeeded ]] || { log "creating the sandbox: $state"; exit 1; }
CMD=$(api POST "/v1/sandboxes/$SB/commands" '{"argv":["echo","hi"],"wait":true}' |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
cat >"$TMP/pass2.toml" <<EOF
[[operations]]
include-path-regex = "^/v1/sandboxes/\\\\{id\\\\}"
parameters = { "path.id" = "$SB", "path.cid" = "$CMD" }
EOF
if ! (cd "$TMP" && "${ST[@]}" --config-file "$TMP/pass2.toml" run "$TMP/openapi.json" "${COMMON[@]}" \
  --include-path-regex '^/v1/sandboxes/\{id\}' \
  --exclude-operation-id destroySandbox --exclude-operation-id pauseSandbox \
  --exclude-operation-id resumeSandbox --exclude-operation-id suspendSandbox \
  --exclude-operation-id snapshotTemplate --exclude-operation-id keepaliveSandbox \
  --max-time 45) >"$TMP/pass2.log" 2>&1; then
  FAILED=1
fi
tail -n 25 "$TMP/pass2.log"
still=$(api GET "/v1/sandboxes/$SB" | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
log "the pass-2 sandbox is $still after the run"

log "responses by status: $(grep -o 'status=[0-9]*' "$TMP/server.log" | sort | uniq -c | tr -s ' \n' ' ')"
log "sandboxes created: $(grep -c 'create requested' "$TMP/server.log"), commands started: $(grep -c 'command started' "$TMP/server.log"), templates built: $(grep -c 'template built' "$TMP/server.log")"
if grep -q 'status=5[0-9][0-9]' "$TMP/server.log"; then
  log "the server answered 5xx:"
  grep 'status=5[0-9][0-9]' "$TMP/server.log" | head -20 >&2
  FAILED=1
fi
if ((FAILED)); then
  log "FAILED (seed $SEED); reports: $TMP/pass1.log $TMP/pass2.log"
  cp "$TMP"/pass*.log /tmp/ 2>/dev/null || true
  exit 1
fi
log "passed (seed $SEED)"
