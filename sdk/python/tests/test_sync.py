"""The blocking client against a real server."""

from __future__ import annotations

import gc
import io
import os
import time

import pytest

from conftest import OUTPUT_CAP_MIB, unique
from space_client import (
    BadRequest,
    Client,
    Command,
    CommandError,
    CommandTimeout,
    Conflict,
    FileInfo,
    InvalidArgument,
    NotFound,
    Operation,
    OperationFailed,
    OutputChunk,
    OutputStream,
    ProcessResult,
    Result,
    Sandbox,
    Template,
    Unauthorized,
)

MISSING_SB = "sb_" + "a" * 20
MISSING_OP = "op_" + "a" * 20
MISSING_CMD = "cmd_" + "a" * 20


def test_issue_example(client, tmp_path):
    """The usage of the issue, as written, on debian (python3, bash)."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "main.py").write_text("print('main')\n")
    (src / "pkg" / "util.py").write_text("X = 1\n")
    label = unique("t1")
    with client.sandboxes.create(template="debian", labels={"task": label}) as sb:
        assert isinstance(sb, Sandbox) and sb.state == "running" and sb.labels == {"task": label}
        r = sb.run(["python3", "-c", "print(6*7)"])
        assert isinstance(r, Result)
        assert (r.exit_code, r.signal, r.timed_out, r.stdout, r.stderr) == (0, None, False, "42\n", "")
        assert r.stdout_bytes == b"42\n" and r.ok and not r.output_truncated
        r = sb.run("echo $HOME", shell=True)
        assert r.stdout == "/root\n"
        cmd = sb.start(["python3", "-u", "-m", "http.server", "8000"])
        assert isinstance(cmd, Command) and cmd.result is None
        seen = b""
        for chunk in cmd.output(follow=True, offset=0):
            assert isinstance(chunk, OutputChunk) and isinstance(chunk.data, bytes)
            seen += chunk.data
            if b"Serving HTTP" in seen:
                break
        page = sb.run(["python3", "-c", "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)"])
        assert page.stdout == "200\n", page
        cmd.signal("TERM")
        res = cmd.wait()
        assert isinstance(res, ProcessResult) and res.signal == 15 and cmd.state in ("killed", "exited")
        sb.files.write("/work/app.py", b"print(1)\n")  # creates /work
        assert sb.files.read("/work/app.py") == b"print(1)\n"
        assert [e.name for e in sb.files.list("/work")] == ["app.py"]
        sb.files.upload_dir(src, "/work/src")
        assert sb.run(["python3", "/work/src/main.py"]).stdout == "main\n"
        assert sb.run(["python3", "-c", "import sys; sys.path.insert(0, '/work/src'); import pkg.util as u; print(u.X)"]).stdout == "1\n"
        sb.suspend()
        assert sb.state == "suspended"
        sb.resume()
        assert sb.state == "running"
        assert sb.files.read("/work/app.py") == b"print(1)\n"
        sb.pause()
        assert sb.state == "paused"
        assert [s.id for s in client.sandboxes.list(label=f"task={label}")] == [sb.id]
        assert client.sandboxes.get(sb.id).state == "paused"
        ops = client.operations.list(sandbox_id=sb.id)
        assert {o.kind for o in ops} >= {"create", "suspend", "resume", "pause"}
        assert client.operations.get(ops[0].id).id == ops[0].id
    assert client.sandboxes.get(sb.id).state == "destroyed"
    assert client.sandboxes.list(label=f"task={label}")[0].state == "destroyed"


def test_run(sandbox):
    r = sandbox.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
    assert r.process.stdout_bytes == 4 and r.duration_ms >= 0 and r.command_id.startswith("cmd_")
    with pytest.raises(CommandError) as e:
        sandbox.run(["sh", "-c", "echo boom >&2; exit 2"], check=True)
    assert e.value.result.exit_code == 2 and "boom" in str(e.value)
    assert sandbox.run("echo $A-$S; pwd; id -u", shell=True, env={"A": "a"}, secrets={"S": "s"}, cwd="/tmp",
                       user="user").stdout == "a-s\n/tmp\n1000\n"
    r = sandbox.run(["cat"], stdin=b"abc\x00\xff")
    assert r.stdout_bytes == b"abc\x00\xff" and r.exit_code == 0
    assert sandbox.run(["wc", "-c"], stdin="x" * 3_000_000).stdout.strip() == "3000000"  # > 1 MiB: in pieces
    # It may end before its input is written (409, or 503 until its end is recorded;
    # servers of today may also hold that write for 20 s first).
    assert sandbox.run(["true"], stdin=b"ignored").exit_code == 0
    r = sandbox.run(["sh", "-c", "kill -9 $$"])
    assert r.signal == 9 and r.exit_code is None and not r.ok


def test_run_timeout(sandbox):
    t = time.monotonic()
    r = sandbox.run(["sleep", "30"], timeout_seconds=1)
    assert r.timed_out and not r.ok and time.monotonic() - t < 15
    with pytest.raises(CommandTimeout) as e:
        sandbox.run(["sleep", "30"], timeout_seconds=1, check=True)
    assert e.value.result.timed_out


def test_run_output_is_never_partial(sandbox):
    # 1.5 MiB: past the 1 MiB inline cap of `wait: true`, so run() reads the output endpoint.
    n = 1_500_000
    r = sandbox.run(["sh", "-c", f"head -c {n} /dev/zero | tr '\\0' a; echo tail >&2"])
    assert r.inline_truncated and not r.output_truncated
    assert r.stdout_bytes == b"a" * n and r.stdout == "a" * n and r.stderr == "tail\n"
    # Not UTF-8: the inline text is lossy, the bytes are exact.
    r = sandbox.run(["printf", "\\377\\376ok"])
    assert r.stdout_bytes == b"\xff\xfeok" and r.stdout == "\ufffd\ufffdok"
    # Past the server's own retention cap: the tail is kept and the result says so.
    cap = OUTPUT_CAP_MIB << 20
    # (It drops the head in whole MiBs, so it takes more than cap + 1 MiB.)
    total = cap + (3 << 19)
    r = sandbox.run(["sh", "-c", f"head -c {total} /dev/zero"])
    assert r.output_truncated and r.process.stdout_bytes == total
    assert cap <= len(r.stdout_bytes) < total and r.stdout_bytes.count(0) == len(r.stdout_bytes)


def test_start_output_signal_wait(sandbox):
    cmd = sandbox.start("for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.1; done", shell=True)
    chunks = list(cmd.output(follow=True))
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == b"o1\no2\no3\n"
    assert b"".join(c.data for c in chunks if c.stream == "stderr") == b"e1\ne2\ne3\n"
    offs = 0
    for c in chunks:  # combined offsets are contiguous
        assert c.offset == offs
        offs = c.end
    assert cmd.result is not None and cmd.result.exit_code == 0 and cmd.state == "exited"
    s = cmd.output(stream="stderr", offset=3)
    assert b"".join(c.data for c in s) == b"e2\ne3\n" and s.result.exit_code == 0 and s.state == "exited"
    assert cmd.wait().exit_code == 0
    assert cmd.collect().stdout == "o1\no2\no3\n"

    long = sandbox.start(["sh", "-c", "echo started; exec sleep 30"])
    assert long.refresh().state in ("starting", "running")
    with pytest.raises(CommandTimeout):
        long.wait(timeout=0.3)
    got = b""
    for c in long.output(follow=True):
        got += c.data
        if b"started" in got:
            break
    # A follow left early is closed at once, not left to the cyclic GC (which could close
    # its response later, inside the connection pool's lock of another request).
    gc.disable()
    try:
        s = long.output(follow=True)
        it = iter(s)
        assert next(it).data == b"started\n"
        del it
        assert s._gen() is None
    finally:
        gc.enable()
    # Without follow: what is there now, then the iteration ends (no end line yet).
    now = long.output()
    assert b"".join(c.data for c in now) == b"started\n" and now.result is None
    assert {c.id for c in sandbox.commands.list()} >= {cmd.id, long.id}
    assert sandbox.commands.get(long.id).state == "running"
    assert long.kill() is long
    assert long.wait().signal == 9 and long.state == "killed"
    assert sandbox.refresh() is sandbox and sandbox.state == "running" and sandbox.last_active_at
    with pytest.raises(Conflict):
        long.signal("TERM")


def test_stdin(sandbox):
    cmd = sandbox.start(["cat"], stdin=True)
    cmd.write_stdin(b"hello ")
    cmd.write_stdin("world")
    cmd.close_stdin()
    assert cmd.wait().exit_code == 0
    assert cmd.collect().stdout == "hello world"
    with pytest.raises(Conflict):
        cmd.write_stdin(b"late")


def test_files(sandbox, tmp_path):
    f = sandbox.files
    info = f.write("/data/x/hello.txt", "hello\n", mode=0o600)
    assert info is None or isinstance(info, FileInfo)
    st = f.stat("/data/x/hello.txt")
    assert (st.type, st.size, st.mode & 0o777, st.name, st.is_file) == ("file", 6, 0o600, "hello.txt", True)
    assert f.read_text("/data/x/hello.txt") == "hello\n"
    f.write("/data/stream.bin", io.BytesIO(b"\x00" * 3_000_000))
    assert f.stat("/data/stream.bin").size == 3_000_000
    f.write("/data/owned", b"u", uid=1000, gid=1000)
    assert (f.stat("/data/owned").uid, f.stat("/data/owned").gid) == (1000, 1000)
    assert f.exists("/data/x") and not f.exists("/data/nope")
    f.mkdir("/data/a/b/c", mode=0o700)
    assert f.stat("/data/a/b/c").is_dir
    names = sorted(e.path for e in f.list("/data", depth=2))
    assert names == ["/data/a", "/data/a/b", "/data/owned", "/data/stream.bin", "/data/x", "/data/x/hello.txt"]
    assert not f.list("/data").truncated
    f.move("/data/x/hello.txt", "/data/a/hello.txt")
    assert f.exists("/data/a/hello.txt") and not f.exists("/data/x/hello.txt")
    f.write("/data/other", b"o")
    with pytest.raises(Conflict):
        f.move("/data/other", "/data/a/hello.txt")
    f.move("/data/other", "/data/a/hello.txt", overwrite=True)
    assert f.read("/data/a/hello.txt") == b"o"
    with pytest.raises((Conflict, BadRequest)):
        f.remove("/data/a")  # not empty, not recursive
    assert f.remove("/data/a", recursive=True) >= 4
    assert f.remove("/data/owned") == 1
    with pytest.raises(NotFound):
        f.read("/data/owned")
    with pytest.raises((NotFound, BadRequest)):  # BadRequest: a server older than `parents`
        f.write("/nowhere/file", b"x", parents=False)
    with pytest.raises(InvalidArgument):
        f.read("relative")
    with pytest.raises(InvalidArgument):
        f.write("/x", 42)
    with pytest.raises(BadRequest):
        f.read("/data")  # a directory


def test_upload_download_dir(sandbox, tmp_path):
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    payload = os.urandom(2_500_000)
    (src / "sub" / "deep" / "blob").write_bytes(payload)
    (src / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (src / "tool.sh").chmod(0o755)
    (src / "link").symlink_to("a.txt")
    stats = sandbox.files.upload_dir(src, "/opt/app")
    assert stats is None or stats.entries >= 6
    assert sandbox.run(["/opt/app/tool.sh"]).stdout == "tool\n"
    assert sandbox.files.stat("/opt/app/link").type == "symlink"
    assert sandbox.files.read("/opt/app/sub/deep/blob") == payload
    out = sandbox.files.download_dir("/opt/app", tmp_path / "back")
    assert (out / "sub" / "deep" / "blob").read_bytes() == payload
    assert os.readlink(out / "link") == "a.txt"
    with pytest.raises(InvalidArgument):
        sandbox.files.upload_dir(tmp_path / "missing", "/opt/x")


def test_lifecycle(client, sandbox):
    op = sandbox.pause(wait=False)
    assert isinstance(op, Operation) and op.kind == "pause" and op.sandbox_id == sandbox.id
    done = client.operations.wait(op.id)
    assert done.status == "succeeded" and done.done
    with pytest.raises(Conflict):
        sandbox.files.read("/etc/hostname")  # the file API needs a running sandbox
    with pytest.raises(Conflict):
        sandbox.pause()  # already paused
    with pytest.raises(Conflict):
        client.operations.cancel(op.id)  # it has ended
    op = sandbox.resume()
    assert op.succeeded and sandbox.state == "running"
    before = sandbox.last_active_at
    time.sleep(0.01)
    assert sandbox.keepalive(ttl_seconds=600) is sandbox and sandbox.ttl_seconds == 600 and sandbox.expires_at
    assert sandbox.last_active_at != before or before is None
    sandbox.run(["sh", "-c", "echo kept > /root/state"])
    sandbox.suspend()
    assert sandbox.state == "suspended" and sandbox.cost.memory_bytes in (0, None)
    sandbox.resume()
    assert sandbox.run(["cat", "/root/state"]).stdout == "kept\n"


def test_create_no_wait_and_destroy(client):
    op = client.sandboxes.create("busybox", wait=False, labels={"k": "nowait"}, env={"E": "1"},
                                 resources={"memory_mib": 256}, ttl_seconds=300)
    assert isinstance(op, Operation) and op.kind == "create" and op.sandbox_id
    try:
        client.operations.wait(op)
        sb = client.sandboxes.get(op.sandbox_id)
        assert sb.resources.memory_mib == 256 and sb.env == {"E": "1"} and sb.ttl_seconds == 300
        assert sb.run(["sh", "-c", "echo $E"]).stdout == "1\n"
    finally:
        d = client.sandboxes.destroy(op.sandbox_id, wait=False)
    assert d.kind == "destroy"
    assert client.operations.wait(d.id).succeeded
    assert client.sandboxes.get(op.sandbox_id).state == "destroyed"
    with pytest.raises(Conflict):
        client.sandboxes.get(op.sandbox_id).run(["true"])


def test_not_found(client):
    with pytest.raises(NotFound) as e:
        client.sandboxes.get(MISSING_SB)
    assert e.value.code == "not_found" and e.value.status == 404
    with pytest.raises(NotFound):
        client.operations.get(MISSING_OP)
    with pytest.raises(NotFound):
        client.sandboxes.create(template="no-such-template")
    with pytest.raises(NotFound):
        client.sandboxes.destroy(MISSING_SB)
    with pytest.raises(NotFound):
        client.templates.get("no-such-template")
    with pytest.raises(NotFound):
        client.templates.delete("no-such-template")


def test_not_found_in_sandbox(client, sandbox):
    with pytest.raises(NotFound):
        sandbox.commands.get(MISSING_CMD)
    with pytest.raises(NotFound):
        list(OutputStream(client, sandbox.id, MISSING_CMD, follow=True))
    with pytest.raises(NotFound):
        sandbox.files.stat("/no/such")
    with pytest.raises(NotFound):
        client.sandboxes.get(MISSING_SB).files  # noqa: B018  (the get raises)


def test_bad_input(client, sandbox):
    for call in (
        lambda: sandbox.run(42),
        lambda: sandbox.run(["ls"], shell=True),
        lambda: sandbox.run("ls -l"),
        lambda: sandbox.run(["sleep", "1"], timeout_seconds=-1),
        lambda: sandbox.run(["cat"], stdin=123),
        lambda: sandbox.start(["ls"], env={"A": 1}),
        lambda: client.sandboxes.create(template=None),
        lambda: client.sandboxes.create(template="busybox", labels="a=b"),
        lambda: client.sandboxes.list(label="nokey"),
        lambda: client.operations.wait(MISSING_OP, timeout=-3),
    ):
        with pytest.raises(InvalidArgument):
            call()
    cmd = sandbox.start(["true"])
    with pytest.raises(InvalidArgument):
        cmd.signal(0)
    with pytest.raises(InvalidArgument):
        cmd.output(stream="both")
    # What only the server can judge: its 400 with the code.
    with pytest.raises(BadRequest) as e:
        cmd.signal("NOTASIGNAL")
    assert e.value.code == "invalid_signal"
    # An unknown user or program is the command's failure (126/127, like a shell), not the request's.
    r = sandbox.run(["true"], user="nosuchuser")
    assert r.exit_code == 126 and "unknown user" in r.stderr
    assert sandbox.run(["/no/such/bin"]).exit_code == 127
    with pytest.raises(BadRequest):
        client.sandboxes.create(template="busybox", labels={"bad key!": "v"})


def test_unauthorized(server):
    with Client(server.url, "wrong-token") as c:
        with pytest.raises(Unauthorized) as e:
            c.sandboxes.list()
        assert e.value.code == "unauthorized" and e.value.status == 401
    with Client(server.url, server.token) as c:
        assert c.health()
        assert any(r.name == "gvisor" and r.available for r in c.runtimes())


def test_templates(client, tmp_path):
    names = {t.name for t in client.templates.list()}
    assert {"busybox", "debian"} <= names
    bb = client.templates.get("busybox")
    assert isinstance(bb, Template) and bb.builtin and bb.ready
    name = unique("sdk-tpl")
    (tmp_path / "motd").write_text("from src\n")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'''
name = "{name}"
base = "busybox"
env = {{ GREETING = "hi" }}
workdir = "/srv"

[[files]]
path = "/srv/motd"
src = "motd"

[[steps]]
run = "echo built > /srv/version"
''')
    try:
        t = client.templates.build(recipe)
        assert isinstance(t, Template) and t.name == name and t.version and not t.builtin
        with client.sandboxes.create(template=name) as sb:
            assert sb.run("cat motd version; echo $GREETING", shell=True).stdout == "from src\nbuilt\nhi\n"
            sb.files.write("/srv/extra", b"x")
            snap = unique("sdk-snap")
            try:
                s = sb.snapshot_template(snap)
                assert isinstance(s, Template) and s.name == snap
                with client.sandboxes.create(template=snap) as sb2:
                    assert sb2.files.read("/srv/extra") == b"x"
            finally:
                client.templates.delete(snap)
        op = client.templates.build({"name": name, "base": "busybox", "steps": [{"run": "echo v2 > /v"}]}, wait=False)
        assert isinstance(op, Operation) and op.kind == "build" and op.template == name
        client.operations.wait(op)
        assert "echo v2" in client.operations.log(op.id)
        assert len(client.templates.get(name).versions) == 2
        with pytest.raises(OperationFailed) as e:
            client.templates.build({"name": name, "base": "busybox", "steps": [{"run": "echo nope >&2; exit 3"}]})
        assert e.value.code == "build_failed" and e.value.operation.status == "failed"
    finally:
        client.templates.delete(name)
    with pytest.raises(NotFound):
        client.templates.get(name)
    with pytest.raises(BadRequest):
        client.templates.build({"name": "Bad Name!", "base": "busybox"})


def test_failed_create(client):
    """A create whose operation fails raises OperationFailed with its code, and the
    failed sandbox does not stay behind."""
    name = unique("sdk-nostart")
    client.templates.build({"name": name, "base": "busybox",
                            "start": {"run": "sleep 100", "ready": {"run": "false", "timeout_seconds": 1}}})
    label = unique("failed")
    try:
        with pytest.raises(OperationFailed) as e:
            client.sandboxes.create(template=name, labels={"case": label})
        assert e.value.code == "start_failed" and e.value.operation.kind == "create"
        [sb] = client.sandboxes.list(label={"case": label})
        assert sb.id == e.value.operation.sandbox_id
        [destroy] = [o for o in client.operations.list(sandbox_id=sb.id) if o.kind == "destroy"]
        client.operations.wait(destroy)
        assert client.sandboxes.get(sb.id).state in ("destroying", "destroyed")
    finally:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(s.state != "destroyed" for s in client.sandboxes.list(label={"case": label})):
            time.sleep(0.1)
        client.templates.delete(name)
