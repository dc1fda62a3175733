"""The asyncio client against a real server: the same surface as the blocking one."""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from conftest import OUTPUT_CAP_MIB, PENDING_DESTROYS, unique
from space_client import (
    AsyncClient,
    AsyncCommand,
    AsyncSandbox,
    BadRequest,
    CommandError,
    CommandTimeout,
    Conflict,
    InvalidArgument,
    NotFound,
    Operation,
    OperationFailed,
    OutputChunk,
    Result,
    Template,
    Unauthorized,
)

MISSING_SB = "sb_" + "a" * 20
MISSING_OP = "op_" + "a" * 20
MISSING_CMD = "cmd_" + "a" * 20


@pytest.fixture
async def asb(aclient, request):
    sb = await aclient.sandboxes.create(template="busybox", labels={"test": request.node.name[:60]})
    try:
        yield sb
    finally:
        PENDING_DESTROYS.append((await aclient.sandboxes.destroy(sb.id, wait=False)).id)


async def test_async_usage(aclient):
    label = unique("at1")
    async with await aclient.sandboxes.create(template="busybox", labels={"task": label}) as sb:
        assert isinstance(sb, AsyncSandbox) and sb.state == "running"
        r = await sb.run(["sh", "-c", "echo $((6*7))"])
        assert isinstance(r, Result) and (r.exit_code, r.stdout, r.stderr) == (0, "42\n", "")
        assert (await sb.run("echo $HOME", shell=True)).stdout == "/root\n"
        cmd = await sb.start(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"])
        assert isinstance(cmd, AsyncCommand)
        chunks = [c async for c in cmd.output(follow=True)]
        assert all(isinstance(c, OutputChunk) for c in chunks)
        assert b"".join(c.data for c in chunks) == b"1\n2\n3\n" and cmd.result.exit_code == 0
        assert (await cmd.wait()).exit_code == 0
        await sb.files.write("/work/app.sh", b"echo app\n")
        assert await sb.files.read("/work/app.sh") == b"echo app\n"
        assert [e.name for e in await sb.files.list("/work")] == ["app.sh"]
        [s] = await aclient.sandboxes.list(label={"task": label})
        assert s.id == sb.id and (await aclient.sandboxes.get(sb.id)).id == sb.id
    assert (await aclient.sandboxes.get(sb.id)).state == "destroyed"


async def test_async_run(asb):
    r = await asb.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    with pytest.raises(CommandError):
        await asb.run(["false"], check=True)
    assert (await asb.run("echo $A-$S; pwd; id -u", shell=True, env={"A": "a"}, secrets={"S": "s"}, cwd="/tmp",
                          user="user")).stdout == "a-s\n/tmp\n1000\n"
    assert (await asb.run(["cat"], stdin=b"in\xff")).stdout_bytes == b"in\xff"
    r = await asb.run(["sleep", "30"], timeout_seconds=1)
    assert r.timed_out
    with pytest.raises(CommandTimeout):
        r.check()
    # Several at once on one sandbox.
    rs = await asyncio.gather(*(asb.run(["echo", str(i)]) for i in range(5)))
    assert [x.stdout for x in rs] == [f"{i}\n" for i in range(5)]
    n = 1_200_000
    r = await asb.run(["sh", "-c", f"head -c {n} /dev/zero | tr '\\0' b"])
    assert r.inline_truncated and r.stdout_bytes == b"b" * n
    total = (OUTPUT_CAP_MIB << 20) + (3 << 19)
    r = await asb.run(["head", "-c", str(total), "/dev/zero"])
    assert r.output_truncated and r.process.stdout_bytes == total and len(r.stdout_bytes) < total


async def test_async_commands(asb):
    cmd = await asb.start(["sh", "-c", "echo ready; exec sleep 30"])
    got = b""
    async with cmd.output(follow=True) as s:
        async for c in s:
            got += c.data
            if b"ready" in got:
                break
    assert b"".join([c.data async for c in cmd.output(stream="stdout")]) == b"ready\n"
    assert (await cmd.refresh()).state == "running"
    with pytest.raises(CommandTimeout):
        await cmd.wait(timeout=0.2)
    assert cmd.id in {c.id for c in await asb.commands.list()}
    assert (await asb.commands.get(cmd.id)).id == cmd.id
    await cmd.signal("TERM")
    assert (await cmd.wait()).signal == 15
    k = await asb.start(["sleep", "30"])
    await k.kill()
    assert (await k.wait()).signal == 9

    cat = await asb.start(["cat"], stdin=True)
    await cat.write_stdin("abc")
    await cat.close_stdin()
    res = await cat.collect()
    assert res.stdout == "abc" and res.exit_code == 0
    with pytest.raises(Conflict):
        await cat.write_stdin(b"late")
    with pytest.raises(NotFound):
        await asb.commands.get(MISSING_CMD)


async def test_async_files(asb, tmp_path):
    f = asb.files
    await f.write("/d/x/a.txt", "A", mode=0o640)
    st = await f.stat("/d/x/a.txt")
    assert (st.size, st.mode & 0o777, st.type) == (1, 0o640, "file")
    assert await f.read_text("/d/x/a.txt") == "A"
    await f.write("/d/big", io.BytesIO(b"z" * 2_000_000))
    assert (await f.stat("/d/big")).size == 2_000_000
    assert await f.exists("/d/x") and not await f.exists("/d/none")
    await f.mkdir("/d/m/n")
    assert sorted(e.path for e in await f.list("/d", depth=2)) == ["/d/big", "/d/m", "/d/m/n", "/d/x", "/d/x/a.txt"]
    await f.move("/d/x/a.txt", "/d/m/a.txt")
    await f.write("/d/o", b"o")
    with pytest.raises(Conflict):
        await f.move("/d/o", "/d/m/a.txt")
    await f.move("/d/o", "/d/m/a.txt", overwrite=True)
    assert await f.read("/d/m/a.txt") == b"o"
    assert await f.remove("/d/m", recursive=True) >= 3
    assert await f.remove("/d/big") == 1
    with pytest.raises(NotFound):
        await f.stat("/d/big")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    (src / "x.sh").write_text("echo x\n")
    (src / "x.sh").chmod(0o755)
    await f.upload_dir(src, "/up")
    assert await f.read("/up/sub/b.bin") == (src / "sub" / "b.bin").read_bytes()
    assert (await asb.run(["/up/x.sh"])).stdout == "x\n"
    back = await f.download_dir("/up", tmp_path / "back")
    assert (back / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    with pytest.raises(InvalidArgument):
        await f.read("rel")


async def test_async_lifecycle(aclient, asb):
    op = await asb.pause(wait=False)
    assert isinstance(op, Operation) and op.kind == "pause"
    assert (await aclient.operations.wait(op)).succeeded
    with pytest.raises(Conflict):
        await asb.files.read("/etc/hostname")
    with pytest.raises(Conflict):
        await aclient.operations.cancel(op.id)
    await asb.resume()
    assert asb.state == "running"
    await asb.keepalive(ttl_seconds=900)
    assert asb.ttl_seconds == 900
    await asb.suspend()
    assert asb.state == "suspended"
    await asb.resume()
    assert (await asb.run(["true"])).exit_code == 0
    assert (await asb.refresh()).state == "running"
    ops = await aclient.operations.list(sandbox_id=asb.id, limit=50)
    assert {"create", "pause", "resume", "suspend"} <= {o.kind for o in ops}
    assert (await aclient.operations.get(op.id)).status == "succeeded"
    # create without waiting, destroy through the namespace
    cop = await aclient.sandboxes.create("busybox", wait=False)
    try:
        assert isinstance(cop, Operation) and cop.kind == "create"
        await aclient.operations.wait(cop.id)
    finally:
        d = await aclient.sandboxes.destroy(cop.sandbox_id)
    assert d.succeeded and (await aclient.sandboxes.get(cop.sandbox_id)).state == "destroyed"


async def test_async_errors(server, aclient, asb):
    with pytest.raises(NotFound) as e:
        await aclient.sandboxes.get(MISSING_SB)
    assert e.value.code == "not_found"
    with pytest.raises(NotFound):
        await aclient.operations.get(MISSING_OP)
    with pytest.raises(NotFound):
        await aclient.sandboxes.create(template="no-such-template")
    with pytest.raises(NotFound):
        await aclient.templates.get("no-such-template")
    for coro in (asb.run(42), asb.run(["ls"], shell=True), asb.run(["x"], timeout_seconds=-1),
                 asb.files.write("/x", 3.5), aclient.sandboxes.create(template="")):
        with pytest.raises(InvalidArgument):
            await coro
    cmd = await asb.start(["true"])
    with pytest.raises(BadRequest):
        await cmd.signal("NOPE")
    async with AsyncClient(server.url, "bad") as bad:
        with pytest.raises(Unauthorized):
            await bad.sandboxes.list()
    assert await aclient.health()
    assert any(r.name == "gvisor" for r in await aclient.runtimes())
    assert "paths" in await aclient.openapi()


async def test_async_templates(aclient):
    assert {"busybox", "debian"} <= {t.name for t in await aclient.templates.list()}
    name = unique("sdk-atpl")
    try:
        t = await aclient.templates.build(f'name = "{name}"\nbase = "busybox"\n'
                                          '[[files]]\npath = "/hello"\ncontent = "hello\\n"\n')
        assert isinstance(t, Template) and t.name == name
        assert (await aclient.templates.get(name)).ready
        async with await aclient.sandboxes.create(template=name) as sb:
            assert await sb.files.read("/hello") == b"hello\n"
            await sb.files.write("/extra", b"e")
            snap = unique("sdk-asnap")
            op = await sb.snapshot_template(snap, wait=False)
            assert isinstance(op, Operation) and op.kind == "build"
            try:
                await aclient.operations.wait(op)
                async with await aclient.sandboxes.create(template=snap) as sb2:
                    assert await sb2.files.read("/extra") == b"e"
            finally:
                await aclient.templates.delete(snap)
        bop = await aclient.templates.build({"name": name, "base": "busybox", "steps": [{"run": "echo step-ran"}]},
                                            wait=False)
        await aclient.operations.wait(bop)
        assert "step-ran" in await aclient.operations.log(bop.id)
        with pytest.raises(OperationFailed) as e:
            await aclient.templates.build({"name": name, "base": "busybox", "steps": [{"run": "exit 4"}]})
        assert e.value.code == "build_failed"
    finally:
        await aclient.templates.delete(name)
