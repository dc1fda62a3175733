#!/usr/bin/env python3
"""The E2B Python SDK (sync flavor, pinned by scripts/test-clients.sh) against
space's E2B-compatible API, used exactly as an application would use it.

Run with the venv's python (target/test-clients/venv/bin/python). Environment:
  E2B_API_URL, E2B_SANDBOX_URL   the server (both the same http://127.0.0.1:PORT)
  E2B_API_KEY                    tenant A's key
  SPACE_OTHER_KEY                tenant B's key
  SPACE_TEMPLATE                 template for Sandbox.create (default "base")
  SPACE_E2B_DEADLINE             seconds before the watchdog gives up (default 170)

Prints `ok <check>` per check; on the first failure prints the traceback and
exits 1. Every sandbox it created is killed on the way out, failure or not.
"""

import io
import os
import sys
import threading
import time
import traceback
import uuid

import httpx

from e2b import (
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

TEMPLATE = os.environ.get("SPACE_TEMPLATE", "base")
API_KEY = os.environ["E2B_API_KEY"]
OTHER_KEY = os.environ["SPACE_OTHER_KEY"]
SANDBOX_URL = os.environ["E2B_SANDBOX_URL"].rstrip("/")
DEADLINE = float(os.environ.get("SPACE_E2B_DEADLINE", "170"))
SUITE = f"py-sync-{uuid.uuid4().hex[:12]}"

# (sandbox id, api key) of every sandbox this script created.
created = []
cleanup_lock = threading.Lock()


def ok(name):
    print(f"ok {name}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def raises(exc_type, fn, *args, **kwargs):
    """Call fn and return the exception of exc_type it raised; fail otherwise."""
    try:
        result = fn(*args, **kwargs)
    except exc_type as e:
        return e
    except BaseException as e:
        raise AssertionError(
            f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"
        ) from e
    raise AssertionError(f"expected {exc_type.__name__}, got result {result!r}")


def create(**kwargs):
    kwargs.setdefault("template", TEMPLATE)
    kwargs.setdefault("timeout", 300)
    sbx = Sandbox.create(**kwargs)
    created.append((sbx.sandbox_id, kwargs.get("api_key", API_KEY)))
    return sbx


def cleanup():
    with cleanup_lock:
        while created:
            sandbox_id, key = created.pop()
            try:
                Sandbox.kill(sandbox_id, api_key=key, request_timeout=20)
            except Exception as e:
                print(f"cleanup: kill {sandbox_id}: {e!r}", file=sys.stderr)


def watchdog():
    print(f"FAIL watchdog: still running after {DEADLINE:.0f} s", flush=True)
    import faulthandler

    faulthandler.dump_traceback(all_threads=True)
    cleanup()
    os._exit(1)


def envd_post(path, sandbox_id, token, body=b"{}"):
    """A raw Connect (JSON) request to envd through the sandbox URL."""
    headers = {
        "E2b-Sandbox-Id": sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "Content-Type": "application/json",
    }
    if token is not None:
        headers["X-Access-Token"] = token
    return httpx.post(f"{SANDBOX_URL}{path}", headers=headers, content=body, timeout=20)


def envd_get(path, sandbox_id, token, params=None):
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    return httpx.get(f"{SANDBOX_URL}{path}", headers=headers, params=params, timeout=20)


def list_all(**kwargs):
    paginator = Sandbox.list(**kwargs)
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items


# ---------------------------------------------------------------- commands


def commands_checks(sbx):
    c = sbx.commands

    r = c.run("true")
    check(r.exit_code == 0 and r.stdout == "" and r.stderr == "", f"run true: {r!r}")
    ok("commands.run true exit 0")

    e = raises(CommandExitException, c.run, "echo hi; echo err >&2; exit 3")
    check(e.exit_code == 3, f"exit code {e.exit_code}")
    check(e.stdout == "hi\n", f"stdout {e.stdout!r}")
    check(e.stderr == "err\n", f"stderr {e.stderr!r}")
    ok("commands.run nonzero exit raises CommandExitException")

    r = c.run("echo $A-$B", envs={"A": "1", "B": "two"})
    check(r.stdout == "1-two\n", f"envs: {r.stdout!r}")
    ok("commands.run envs")

    r = c.run("echo $SBX_ENV")
    check(r.stdout == "from-create\n", f"sandbox envs: {r.stdout!r}")
    ok("Sandbox.create envs reach commands")

    r = c.run("pwd", cwd="/tmp")
    check(r.stdout == "/tmp\n", f"cwd: {r.stdout!r}")
    ok("commands.run cwd")

    r = c.run("id -u", user="root")
    check(r.stdout == "0\n", f"user root: {r.stdout!r}")
    ok("commands.run user=root")

    # Streamed, shown by cause rather than by timing: the command prints 1 and then waits
    # for a file that the callback writes only once it has that 1. Output that came all at
    # once at the end could never let it go on (it gives up after 60 s and says so).
    chunks = []
    errs = []
    go = f"/tmp/go-{uuid.uuid4().hex}"

    def on_out(s):
        chunks.append(s)
        if "".join(chunks) == "1\n":
            sbx.files.write(go, "")

    r = c.run(
        f"echo 1; echo e1 >&2; i=0; while [ ! -e {go} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
        f"[ -e {go} ] || echo unstreamed; for i in 2 3; do echo $i; echo e$i >&2; done",
        on_stdout=on_out,
        on_stderr=lambda s: errs.append(s),
        timeout=120,
    )
    check(
        "".join(chunks) == "1\n2\n3\n",
        f"output was not streamed, or not all of it came: {chunks!r}",
    )
    check("".join(errs) == "e1\ne2\ne3\n", f"on_stderr: {errs!r}")
    check(r.stdout == "1\n2\n3\n", f"result stdout {r.stdout!r}")
    ok("commands.run on_stdout/on_stderr stream")

    h = c.run("sleep 30", background=True)
    check(isinstance(h.pid, int) and h.pid > 0, f"pid {h.pid!r}")
    procs = {p.pid: p for p in c.list()}
    check(h.pid in procs, f"pid {h.pid} not in commands.list() {list(procs)}")
    check(procs[h.pid].args[-1:] == ["sleep 30"], f"ProcessInfo {procs[h.pid]!r}")
    ok("background command in commands.list")
    check(c.kill(h.pid) is True, "commands.kill returned False")
    e = raises(CommandExitException, h.wait)
    check(e.exit_code != 0, f"killed command exit code {e.exit_code}")
    ok("commands.kill ends the command (wait raises CommandExitException)")
    for _ in range(50):
        if h.pid not in [p.pid for p in c.list()]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"killed pid {h.pid} still in commands.list()")
    ok("killed command leaves commands.list")
    check(c.kill(999999) is False, "commands.kill(999999) should be False")
    ok("commands.kill unknown pid is False")

    r = c.run("sleep 1; echo done", background=True).wait()
    check(r.stdout == "done\n" and r.exit_code == 0, f"background wait: {r!r}")
    ok("background command wait()")

    h = c.run("cat", background=True, stdin=True, timeout=30)
    c.send_stdin(h.pid, "hello\n")
    c.send_stdin(h.pid, b"bytes\n")
    c.close_stdin(h.pid)
    r = h.wait()
    check(r.stdout == "hello\nbytes\n", f"stdin: {r.stdout!r}")
    ok("commands.send_stdin / close_stdin")

    h = c.run("cat", background=True, stdin=True, timeout=30)
    c.stream_input(h.pid, iter(["one\n", b"two\n", "three\n"]))
    c.close_stdin(h.pid)
    r = h.wait()
    check(r.stdout == "one\ntwo\nthree\n", f"stream_input: {r.stdout!r}")
    ok("commands.stream_input keeps order")

    h = c.run(
        "for i in 1 2 3 4 5 6 7 8; do echo line$i; sleep 0.25; done",
        background=True,
    )
    pid = h.pid
    h.disconnect()
    time.sleep(0.4)
    h2 = c.connect(pid, timeout=30)
    check(h2.pid == pid, f"connect pid {h2.pid} != {pid}")
    r = h2.wait()
    check(r.exit_code == 0, f"connect exit {r.exit_code}")
    check("line8\n" in r.stdout, f"connect output: {r.stdout!r}")
    ok("disconnect keeps the command; commands.connect gets its later output")

    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)
    check(h.pid in [p.pid for p in c.list()], "pty pid not in commands.list()")
    # $((40+2)): the output "pty-42" differs from the echoed input.
    sbx.pty.send_stdin(h.pid, b"echo pty-$((40+2))\n")
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; exit\n")
    data = []
    r = h.wait(on_pty=lambda b: data.append(bytes(b)))
    out = b"".join(data).decode("utf-8", "replace")
    check("pty-42" in out, f"pty output: {out!r}")
    check("30 100" in out, f"pty size after resize: {out!r}")
    check(r.exit_code == 0, f"pty exit {r.exit_code}")
    ok("pty create / send_stdin / resize / exit")

    # Ended by the timeout, not by the program (which would take 300 s): a bound with room
    # for a loaded host.
    start = time.monotonic()
    raises(TimeoutException, c.run, "sleep 300", timeout=1)
    check(time.monotonic() - start < 120, "timeout=1 did not end the command")
    ok("commands.run timeout raises TimeoutException")


# ---------------------------------------------------------------- files


def files_checks(sbx):
    f = sbx.files

    info = f.write("/tmp/a/b/c.txt", "x")
    check(info.path == "/tmp/a/b/c.txt", f"write path {info.path!r}")
    check(info.name == "c.txt", f"write name {info.name!r}")
    check(f.read("/tmp/a/b/c.txt") == "x", "read back")
    ok("files.write creates parents; read")

    data = bytes(range(256)) * 1000
    f.write("/tmp/bin.dat", data)
    back = f.read("/tmp/bin.dat", format="bytes")
    check(bytes(back) == data, f"binary round trip: {len(back)} bytes")
    ok("files binary round trip")

    infos = f.write_files(
        [
            {"path": "/tmp/m/one.txt", "data": "one"},
            {"path": "/tmp/m/two.bin", "data": b"\x00two\xff"},
        ]
    )
    check(
        sorted(i.path for i in infos) == ["/tmp/m/one.txt", "/tmp/m/two.bin"],
        f"write_files infos {infos!r}",
    )
    check(f.read("/tmp/m/one.txt") == "one", "write_files one")
    check(bytes(f.read("/tmp/m/two.bin", format="bytes")) == b"\x00two\xff", "two")
    ok("files.write_files")

    big = os.urandom(5 * 1024 * 1024)
    f.write("/tmp/big1.bin", big)  # multipart/form-data
    check(bytes(f.read("/tmp/big1.bin", format="bytes")) == big, "5 MiB multipart")
    f.write("/tmp/big2.bin", io.BytesIO(big))  # streamed application/octet-stream
    check(bytes(f.read("/tmp/big2.bin", format="bytes")) == big, "5 MiB octet")
    ok("files 5 MiB upload (multipart and octet-stream) reads back identical")

    f.write("/tmp/gz/big3.bin", io.BytesIO(big), gzip=True)
    check(bytes(f.read("/tmp/gz/big3.bin", format="bytes")) == big, "5 MiB gzip octet")
    ok("files gzip upload (octet-stream, Content-Encoding: gzip) reads back identical")

    f.write("/tmp/l/f1.txt", "12345")
    f.write("/tmp/l/sub/f2.txt", "z")
    entries = {e.name: e for e in f.list("/tmp/l")}
    check(set(entries) == {"f1.txt", "sub"}, f"list: {sorted(entries)}")
    check(entries["f1.txt"].type == FileType.FILE, f"f1 type {entries['f1.txt']!r}")
    check(entries["sub"].type == FileType.DIR, f"sub type {entries['sub']!r}")
    check(entries["f1.txt"].path == "/tmp/l/f1.txt", f"f1 path {entries['f1.txt']!r}")
    ok("files.list")
    paths = {e.path for e in f.list("/tmp/l", depth=2)}
    check(
        paths == {"/tmp/l/f1.txt", "/tmp/l/sub", "/tmp/l/sub/f2.txt"},
        f"list depth=2: {sorted(paths)}",
    )
    ok("files.list depth=2")

    info = f.get_info("/tmp/l/f1.txt")
    check(info.type == FileType.FILE and info.size == 5, f"get_info file {info!r}")
    check(info.name == "f1.txt" and info.path == "/tmp/l/f1.txt", f"{info!r}")
    info = f.get_info("/tmp/l/sub")
    check(info.type == FileType.DIR, f"get_info dir {info!r}")
    ok("files.get_info")

    check(f.exists("/tmp/l/f1.txt") is True, "exists true")
    check(f.exists("/tmp/l/nope") is False, "exists false")
    ok("files.exists")

    moved = f.rename("/tmp/l/f1.txt", "/tmp/l/g1.txt")
    check(moved.path == "/tmp/l/g1.txt", f"rename entry {moved!r}")
    check(not f.exists("/tmp/l/f1.txt") and f.exists("/tmp/l/g1.txt"), "rename")
    check(f.read("/tmp/l/g1.txt") == "12345", "renamed content")
    ok("files.rename")

    f.remove("/tmp/l/g1.txt")
    check(not f.exists("/tmp/l/g1.txt"), "remove file")
    f.remove("/tmp/l/sub")
    check(not f.exists("/tmp/l/sub"), "remove dir")
    ok("files.remove")

    check(f.make_dir("/tmp/md/x/y") is True, "make_dir new")
    check(f.make_dir("/tmp/md/x/y") is False, "make_dir existing")
    check(f.get_info("/tmp/md/x").type == FileType.DIR, "make_dir parents")
    ok("files.make_dir True then False")

    raises(NotFoundException, f.read, "/nope/missing.txt")
    raises(NotFoundException, f.list, "/nope")
    raises(NotFoundException, f.get_info, "/nope")
    ok("files not found raise NotFoundException")

    f.make_dir("/tmp/w")
    h = f.watch_dir("/tmp/w")
    try:
        f.write("/tmp/w/new.txt", "hi")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.extend(h.get_new_events())
            if any(
                e.name.endswith("new.txt")
                and e.type in (FilesystemEventType.CREATE, FilesystemEventType.WRITE)
                for e in seen
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no CREATE/WRITE event for new.txt: {seen!r}")
    finally:
        h.stop()
    ok("files.watch_dir events")


# ---------------------------------------------------------------- lifecycle


def lifecycle_checks(sbx, sbx2):
    ids = {s.sandbox_id for s in list_all(query=SandboxQuery(metadata={"suite": SUITE}))}
    check(ids == {sbx.sandbox_id, sbx2.sandbox_id}, f"list by suite: {ids}")
    ok("Sandbox.list metadata filter")

    p = Sandbox.list(query=SandboxQuery(metadata={"suite": SUITE}), limit=1)
    page1 = p.next_items()
    check(len(page1) == 1 and p.has_next, f"page 1: {page1!r} has_next={p.has_next}")
    page2 = p.next_items()
    check(len(page2) == 1, f"page 2: {page2!r}")
    page3 = p.next_items() if p.has_next else []
    check(page3 == [], f"page 3 should be empty: {page3!r}")
    check(
        {page1[0].sandbox_id, page2[0].sandbox_id} == ids,
        f"pages {page1[0].sandbox_id} {page2[0].sandbox_id}",
    )
    ok("Sandbox.list limit=1 paginates")

    one = list_all(query=SandboxQuery(metadata={"suite": SUITE, "n": "1"}))
    check([s.sandbox_id for s in one] == [sbx.sandbox_id], f"n=1: {one!r}")
    check(one[0].metadata.get("n") == "1", f"listed metadata {one[0].metadata}")
    ok("Sandbox.list two metadata keys")

    info = sbx.get_info()
    check(info.sandbox_id == sbx.sandbox_id, f"info id {info.sandbox_id}")
    check(info.metadata.get("suite") == SUITE and info.metadata.get("n") == "1", f"{info.metadata}")
    check(bool(info.template_id), f"template_id {info.template_id!r}")
    check(info.state == SandboxState.RUNNING, f"state {info.state!r}")
    check(info.cpu_count >= 1 and info.memory_mb >= 1, f"resources {info!r}")
    check(info.end_at > info.started_at, f"started_at {info.started_at} end_at {info.end_at}")
    check(Sandbox.get_info(sbx.sandbox_id).sandbox_id == sbx.sandbox_id, "static get_info")
    ok("get_info")

    metrics = sbx.get_metrics()
    check(len(metrics) >= 1, f"metrics {metrics!r}")
    m = metrics[-1]
    check(m.cpu_count >= 1 and m.mem_total > 0 and m.disk_total > 0, f"metric {m!r}")
    check(0 < m.mem_used <= m.mem_total * 2, f"memory in use {m!r}")
    ok("get_metrics")

    sbx.set_timeout(900)
    info = sbx.get_info()
    left = (info.end_at - info.started_at).total_seconds()
    check(left > 800, f"set_timeout(900): end_at - started_at = {left}")
    check(sbx.is_running() is True, "is_running")
    ok("set_timeout / is_running")

    # pause and resume, on sbx2
    sbx2.files.write("/tmp/persist.txt", "kept")
    h = sbx2.commands.run("sleep 600", background=True, timeout=0)
    pid = h.pid
    h.disconnect()
    check(sbx2.pause() is True, "pause returned False")
    info = Sandbox.get_info(sbx2.sandbox_id)
    check(info.state == SandboxState.PAUSED, f"state after pause {info.state!r}")
    ok("pause; get_info state paused")
    check(sbx2.pause() is False, "pause of a paused sandbox should be False (409)")
    ok("pause of a paused sandbox is False")
    paused = list_all(
        query=SandboxQuery(metadata={"suite": SUITE}, state=[SandboxState.PAUSED])
    )
    check([s.sandbox_id for s in paused] == [sbx2.sandbox_id], f"state filter {paused!r}")
    running = list_all(
        query=SandboxQuery(metadata={"suite": SUITE}, state=[SandboxState.RUNNING])
    )
    check([s.sandbox_id for s in running] == [sbx.sandbox_id], f"state filter {running!r}")
    ok("Sandbox.list state filter")

    resumed = Sandbox.connect(sbx2.sandbox_id)
    check(resumed.sandbox_id == sbx2.sandbox_id, "connect id")
    check(resumed.get_info().state == SandboxState.RUNNING, "state after connect")
    check(resumed.files.read("/tmp/persist.txt") == "kept", "file after resume")
    pids = [p.pid for p in resumed.commands.list()]
    check(pid in pids, f"background pid {pid} not in {pids} after resume")
    check(resumed.commands.run("echo back").stdout == "back\n", "run after resume")
    # the old object still works: same id, same access token
    check(sbx2.commands.run("echo old").stdout == "old\n", "old object after resume")
    same = sbx2.connect()
    check(same is sbx2, "instance connect on a running sandbox")
    ok("Sandbox.connect resumes: files and processes kept")

    # kill
    check(resumed.kill() is True, "kill returned False")
    raises(NotFoundException, Sandbox.get_info, sbx2.sandbox_id)
    raises(NotFoundException, Sandbox.connect, sbx2.sandbox_id)
    check(Sandbox.kill(sbx2.sandbox_id) is False, "second kill should be False")
    check(Sandbox.kill("no-such-sandbox-id") is False, "kill unknown id")
    ok("kill; get_info/connect NotFound; kill unknown is False")
    check(sbx2.is_running() is False, "is_running after kill")
    raises(SandboxException, sbx2.commands.run, "true")
    ok("killed sandbox: is_running False, commands fail")
    ids = {s.sandbox_id for s in list_all(query=SandboxQuery(metadata={"suite": SUITE}))}
    check(ids == {sbx.sandbox_id}, f"list after kill: {ids}")
    ok("killed sandbox leaves Sandbox.list")


# ---------------------------------------------------------------- security


def security_checks(sbx, other):
    token = sbx._envd_access_token
    check(isinstance(token, str) and token, f"no envd access token: {token!r}")

    r = envd_post("/process.Process/List", sbx.sandbox_id, "wrong")
    check(r.status_code == 401, f"wrong token: {r.status_code} {r.text[:200]}")
    r = envd_post("/process.Process/List", sbx.sandbox_id, None)
    check(r.status_code == 401, f"missing token: {r.status_code} {r.text[:200]}")
    r = envd_post("/process.Process/List", sbx.sandbox_id, token)
    check(r.status_code == 200, f"right token: {r.status_code} {r.text[:200]}")
    ok("envd RPC: wrong/missing access token 401, right one 200")

    sbx.files.write("/tmp/sec.txt", "secret")
    other.files.write("/tmp/sec.txt", "b-secret")
    r = envd_get("/files", sbx.sandbox_id, "wrong", params={"path": "/tmp/sec.txt"})
    check(r.status_code == 401, f"files wrong token: {r.status_code}")
    r = envd_get("/files", sbx.sandbox_id, None, params={"path": "/tmp/sec.txt"})
    check(r.status_code == 401, f"files missing token: {r.status_code}")
    r = envd_get("/files", sbx.sandbox_id, token, params={"path": "/tmp/sec.txt"})
    check(r.status_code == 200 and r.text == "secret", f"files right token: {r.status_code}")
    ok("envd /files: wrong/missing access token 401, right one 200")

    # tenant A's valid token against tenant B's sandbox
    r = envd_post("/process.Process/List", other.sandbox_id, token)
    check(400 <= r.status_code < 500, f"A's token on B's sandbox: {r.status_code}")
    r = envd_get("/files", other.sandbox_id, token, params={"path": "/tmp/sec.txt"})
    check(400 <= r.status_code < 500, f"A's token on B's files: {r.status_code}")
    check("b-secret" not in r.text, "A's token read B's file")
    r = envd_post("/process.Process/List", other.sandbox_id, other._envd_access_token)
    check(r.status_code == 200, f"B's own token: {r.status_code}")
    ok("envd: another sandbox's token is refused")

    raises(NotFoundException, Sandbox.connect, sbx.sandbox_id, api_key=OTHER_KEY)
    raises(NotFoundException, Sandbox.get_info, sbx.sandbox_id, api_key=OTHER_KEY)
    raises(NotFoundException, Sandbox.set_timeout, sbx.sandbox_id, 60, api_key=OTHER_KEY)
    raises(NotFoundException, Sandbox.pause, sbx.sandbox_id, api_key=OTHER_KEY)
    check(Sandbox.kill(sbx.sandbox_id, api_key=OTHER_KEY) is False, "B killed A's sandbox")
    check(sbx.is_running(), "A's sandbox after B's attempts")
    check(sbx.get_info().state == SandboxState.RUNNING, "A's sandbox state")
    ok("another tenant: connect/get_info/set_timeout/pause NotFound, kill False")

    b_list = list_all(query=SandboxQuery(metadata={"suite": SUITE}), api_key=OTHER_KEY)
    check(b_list == [], f"B sees A's sandboxes: {b_list!r}")
    b_own = list_all(query=SandboxQuery(metadata={"suite": SUITE + "-b"}), api_key=OTHER_KEY)
    check([s.sandbox_id for s in b_own] == [other.sandbox_id], f"B's own list {b_own!r}")
    a_of_b = list_all(query=SandboxQuery(metadata={"suite": SUITE + "-b"}))
    check(a_of_b == [], f"A sees B's sandboxes: {a_of_b!r}")
    everything = {s.sandbox_id for s in list_all()}
    check(other.sandbox_id not in everything, "B's sandbox in A's unfiltered list")
    ok("another tenant: Sandbox.list is per tenant")

    raises(AuthenticationException, list_all, api_key="space-wrong-key")
    # through create(): a sandbox made despite the wrong key is still killed
    raises(AuthenticationException, create, api_key="space-wrong-key")
    raises(AuthenticationException, Sandbox.get_info, sbx.sandbox_id, api_key="space-wrong-key")
    ok("wrong API key raises AuthenticationException")


def main():
    timer = threading.Timer(DEADLINE, watchdog)
    timer.daemon = True
    timer.start()
    try:
        sbx = create(metadata={"suite": SUITE, "n": "1"}, envs={"SBX_ENV": "from-create"})
        sbx2 = create(metadata={"suite": SUITE, "n": "2"})
        other = create(metadata={"suite": SUITE + "-b"}, api_key=OTHER_KEY)
        ok("Sandbox.create (two in tenant A, one in tenant B)")
        commands_checks(sbx)
        files_checks(sbx)
        security_checks(sbx, other)
        lifecycle_checks(sbx, sbx2)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        return 1
    finally:
        timer.cancel()
        cleanup()
    print("all ok", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # The verdict is in. Leave without the interpreter's finalization: the SDK's HTTP
    # client (pyqwest, a Rust extension with its own threads) was seen to end a
    # passing run with a silent non-zero status there, once in many CI runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
