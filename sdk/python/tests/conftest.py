"""A real `space serve --dev` for the whole session.

SPACE_BIN (default <repo>/target/debug/space) is the server; SPACE_TEST_TEMPLATES
(default <repo>/target/space-test-templates) its template cache, holding
`busybox` and `debian`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import sys
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from space_client import AsyncClient, Client, SpaceError

REPO = Path(__file__).resolve().parents[3]
SPACE_BIN = os.environ.get("SPACE_BIN") or str(REPO / "target/debug/space")
TEMPLATES = os.environ.get("SPACE_TEST_TEMPLATES") or str(REPO / "target/space-test-templates")
LISTENING = re.compile(r"space listening on (http://127\.0\.0\.1:\d+)")
# The server keeps this much output per stream; the inline copy of `wait: true` is
# cut at 1 MiB. 2 MiB lets the tests reach both limits with little output.
OUTPUT_CAP_MIB = 2


@dataclass
class Server:
    url: str
    token: str
    proc: subprocess.Popen
    data_dir: str


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def server():
    if not os.access(SPACE_BIN, os.X_OK):
        pytest.exit(f"no server binary at {SPACE_BIN} (set SPACE_BIN)", returncode=2)
    if not Path(TEMPLATES, "busybox").exists():
        pytest.exit(f"no busybox template under {TEMPLATES} (set SPACE_TEST_TEMPLATES)", returncode=2)
    tmp = tempfile.mkdtemp(prefix="space-sdk-test-", dir="/tmp")
    token = "sdk-test-" + secrets.token_hex(8)
    log_path = Path(tmp, "server.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [SPACE_BIN, "serve", "--dev", "--listen", "127.0.0.1:0", "--data-dir", str(Path(tmp, "data")),
         "--templates-dir", TEMPLATES, "--output-cap-mib", str(OUTPUT_CAP_MIB)],
        env={**os.environ, "SPACE_DEV_TOKEN": token},
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        # Reads stdout to its end so the server never blocks on a full pipe.
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            if not found and (m := LISTENING.search(line)):
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    srv = None
    left: list = []
    try:
        ready.wait(60)
        if not found:
            _stop(proc)
            log.flush()
            tail = log_path.read_text(errors="replace")[-3000:]
            pytest.exit(f"the server did not start (exit {proc.poll()}):\n{tail}", returncode=2)
        srv = Server(found[0], token, proc, tmp)
        yield srv
    finally:
        # Also after a failure or an interrupt: sandboxes that outlive the server keep
        # their processes and mounts.
        if srv is not None and proc.poll() is None:
            left = _destroy_everything(srv)
        _stop(proc)
        log.close()
        _remove_data_dir(tmp)
    # No sandbox of the session may be left running.
    assert not left, f"sandboxes left running after the tests: {left}"


def _destroy_everything(srv: Server) -> list:
    """Waits for the destroys the fixtures began, then destroys whatever else runs
    (and waits for it: a sandbox that outlives the server keeps its mounts).
    Returns the sandboxes that were still running before that clean-up."""
    with Client(srv.url, srv.token) as c:
        for op in PENDING_DESTROYS:
            try:
                c.operations.wait(op, timeout=120)
            except SpaceError:
                pass
        boxes = c.sandboxes.list()
        left = [(b.id, b.state, b.labels) for b in boxes if b.state not in ("destroyed", "failed", "destroying")]
        for b in boxes:
            if b.state != "destroyed":
                try:
                    c.sandboxes.destroy(b.id, wait=False)
                except SpaceError:
                    pass  # already destroying
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(b.state == "destroyed" for b in c.sandboxes.list()):
                break
            time.sleep(0.2)
    return left


def _mounts_under(path: str) -> list[str]:
    prefix = os.path.realpath(path).rstrip("/") + "/"
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            mp = line.split()[1].encode().decode("unicode_escape")  # \040 and the like
            if mp.startswith(prefix) or mp == prefix[:-1]:
                out.append(mp)
    return out


def _remove_data_dir(tmp: str) -> None:
    """Removes the server's data dir once the server has exited, and never while
    anything is mounted below it (a sandbox's read-only binds of host folders)."""
    if not os.path.isdir(tmp):
        return
    mounts = _mounts_under(tmp)
    if mounts:
        print(f"\nNOT removing {tmp}: still mounted below it: {mounts}", file=sys.stderr)
        return
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def client(server):
    with Client(server.url, server.token) as c:
        yield c


@pytest.fixture
async def aclient(server):
    async with AsyncClient(server.url, server.token) as c:
        yield c


# Destroys the fixtures started and did not wait for: the session's end waits for them.
PENDING_DESTROYS: list[str] = []


@pytest.fixture
def sandbox(client, request):
    """A busybox sandbox, destroyed after the test (without waiting for the destroy
    to end: the session's end checks that every one did)."""
    sb = client.sandboxes.create(template="busybox", labels={"test": request.node.name[:60]})
    try:
        yield sb
    finally:
        PENDING_DESTROYS.append(client.sandboxes.destroy(sb.id, wait=False).id)


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


def wait_until(pred, timeout: float = 10.0, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return False
