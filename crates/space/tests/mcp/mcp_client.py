"""The MCP server through the official Python MCP client (`mcp`, pinned by
scripts/test-clients.sh), over both transports: stdio (`space mcp`, started as a
subprocess the way agents start tools) and streamable HTTP (`/mcp`). Run by
tests/mcp.rs with SPACE_URL, SPACE_TOKEN (tenant A), SPACE_OTHER_TOKEN (tenant B),
SPACE_BIN and SPACE_TEMPLATE. Prints `ok <check>` per check; exits 1 on the first
failure; destroys every sandbox it made."""

import asyncio
import base64
import json
import os
import sys
import traceback

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

URL = os.environ["SPACE_URL"]
TOKEN = os.environ["SPACE_TOKEN"]
OTHER = os.environ["SPACE_OTHER_TOKEN"]
BIN = os.environ["SPACE_BIN"]
TEMPLATE = os.environ.get("SPACE_TEMPLATE", "busybox")
TOOLS = {
    "create_sandbox", "list_sandboxes", "destroy_sandbox", "run_command", "start_command",
    "read_output", "send_signal", "write_file", "read_file", "list_files", "suspend_sandbox",
    "resume_sandbox",
}
made = []


def ok(name):
    print(f"ok {name}", flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def http_client(token):
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=300)
    return Client(streamable_http_client(f"{URL}/mcp", http_client=http), read_timeout_seconds=300)


def stdio_client(token):
    env = dict(os.environ, SPACE_URL=URL, SPACE_TOKEN=token)
    return Client(StdioServerParameters(command=BIN, args=["mcp"], env=env), read_timeout_seconds=300)


async def call(c, name, args):
    """(is_error, structured result)."""
    r = await c.call_tool(name, args)
    data = r.structured_content
    if data is None:
        data = json.loads(r.content[0].text)
    return bool(r.is_error), data


async def good(c, name, args):
    err, data = await call(c, name, args)
    check(not err, f"{name}({args}) failed: {data}")
    return data


async def refused(c, name, args, code=None):
    try:
        err, data = await call(c, name, args)
    except Exception as e:  # a protocol error (bad arguments) is a refusal too
        check(code is None, f"{name}({args}): protocol error {e!r}, wanted code {code}")
        return None
    check(err, f"{name}({args}) should have failed: {data}")
    if code is not None:
        check(data["error"]["code"] == code, f"{name}: code {data['error']['code']} != {code}: {data}")
    return data


async def suite(c, other, label):
    tools = {t.name for t in (await c.list_tools()).tools}
    check(TOOLS <= tools, f"tools: missing {TOOLS - tools}")
    for t in (await c.list_tools()).tools:
        if t.name in TOOLS:
            check(t.description and len(t.description) > 20, f"{t.name} has no description")
            check(t.input_schema.get("type") == "object", f"{t.name} schema {t.input_schema}")
    ok(f"{label}: tools listed with schemas and descriptions")

    sb = (await good(c, "create_sandbox", {"template": TEMPLATE, "labels": {"suite": label}}))["sandbox_id"]
    made.append(sb)
    ok(f"{label}: create_sandbox")

    lst = await good(c, "list_sandboxes", {"labels": {"suite": label}})
    check([s["sandbox_id"] for s in lst["sandboxes"]] == [sb], f"list: {lst}")
    ok(f"{label}: list_sandboxes by label")

    r = await good(c, "run_command", {"sandbox_id": sb, "argv": ["sh", "-c", "echo out; echo err >&2; exit 3"]})
    check(r["exit_code"] == 3 and r["stdout"]["data"] == "out\n" and r["stderr"]["data"] == "err\n", f"run: {r}")
    r = await good(c, "run_command", {"sandbox_id": sb, "shell": "echo $GREETING from $(pwd)", "env": {"GREETING": "hi"}, "cwd": "/tmp"})
    check(r["exit_code"] == 0 and r["stdout"]["data"] == "hi from /tmp\n", f"shell: {r}")
    r = await good(c, "run_command", {"sandbox_id": sb, "shell": "sleep 30", "timeout_seconds": 1})
    check(r["timed_out"] is True, f"timeout: {r}")
    ok(f"{label}: run_command (argv, shell, env, cwd, exit code, timeout)")

    # Large output: cut with a marker and the offset to read on from; reading on
    # gives every byte exactly once.
    r = await good(c, "run_command", {"sandbox_id": sb, "shell": "i=0; while [ $i -lt 5000 ]; do echo line-$i; i=$((i+1)); done"})
    out = r["stdout"]
    check(out["truncated"] is True and len(out["data"]) <= 16384 and "note" in out, f"big: {str(out)[:300]}")
    text, off = out["data"], out["next_offset"]
    while True:
        more = await good(c, "read_output", {"command_id": r["command_id"], "offset": off, "stream": "stdout"})
        text += more["data"]
        off = more["next_offset"]
        if not more["truncated"]:
            break
    want = "".join(f"line-{i}\n" for i in range(5000))
    check(text == want, f"reassembled {len(text)} bytes != {len(want)}")
    check(more["result"]["exit_code"] == 0, f"end: {more}")
    ok(f"{label}: large output truncated with offset; read_output reassembles it exactly")

    st = await good(c, "start_command", {"sandbox_id": sb, "shell": "echo started; sleep 60"})
    cid = st["command_id"]
    for _ in range(100):
        o = await good(c, "read_output", {"command_id": cid})
        if o["data"] == "started\n":
            break
        await asyncio.sleep(0.1)
    check(o["data"] == "started\n" and o["state"] == "running", f"started: {o}")
    s = await good(c, "send_signal", {"command_id": cid, "signal": "TERM"})
    for _ in range(100):
        o = await good(c, "read_output", {"command_id": cid, "offset": o["next_offset"]})
        if o.get("result"):
            break
        await asyncio.sleep(0.1)
    check(o["result"]["signal"] == 15, f"signalled: {o}")
    ok(f"{label}: start_command, read_output, send_signal")

    await good(c, "write_file", {"sandbox_id": sb, "path": "/work/deep/note.txt", "content": "hello\n"})
    f = await good(c, "read_file", {"sandbox_id": sb, "path": "/work/deep/note.txt"})
    check(f["content"] == "hello\n" and f["truncated"] is False, f"read: {f}")
    blob = bytes(range(256)) * 4
    await good(c, "write_file", {"sandbox_id": sb, "path": "/work/blob.bin", "content_base64": base64.b64encode(blob).decode()})
    f = await good(c, "read_file", {"sandbox_id": sb, "path": "/work/blob.bin"})
    check(base64.b64decode(f["content_base64"]) == blob, "binary round trip")
    big = os.urandom(5 << 20)
    await good(c, "write_file", {"sandbox_id": sb, "path": "/work/big.bin", "content_base64": base64.b64encode(big).decode()})
    r = await good(c, "run_command", {"sandbox_id": sb, "argv": ["wc", "-c", "/work/big.bin"]})
    check(r["stdout"]["data"].split()[0] == str(5 << 20), f"5 MiB write: {r}")
    await good(c, "run_command", {"sandbox_id": sb, "argv": ["rm", "/work/big.bin"]})
    await refused(c, "write_file", {"sandbox_id": sb, "path": "/work/huge.bin", "content": "x" * ((8 << 20) + 1)})
    ls = await good(c, "list_files", {"sandbox_id": sb, "path": "/work"})
    names = sorted(e["name"] for e in ls["entries"])
    check(names == ["blob.bin", "deep"], f"list_files: {names}")
    r = await good(c, "run_command", {"sandbox_id": sb, "shell": "head -c 400000 /dev/zero | tr '\\0' 'x' > /work/big.txt"})
    f = await good(c, "read_file", {"sandbox_id": sb, "path": "/work/big.txt"})
    check(f["truncated"] is True and len(f["content"]) == 256 * 1024 and f["size"] == 400000, "big file cut")
    ok(f"{label}: write_file (parents, text, base64, 5 MiB; over 8 MiB refused), read_file (text, binary, cut), list_files")

    await good(c, "run_command", {"sandbox_id": sb, "shell": "echo kept > /tmp/kept"})
    s = await good(c, "suspend_sandbox", {"sandbox_id": sb})
    check(s["state"] == "suspended", f"suspend: {s}")
    err = await refused(c, "run_command", {"sandbox_id": sb, "argv": ["true"]})
    check(err["error"]["code"] in ("invalid_transition", "conflict"), f"run on suspended: {err}")
    s = await good(c, "resume_sandbox", {"sandbox_id": sb})
    check(s["state"] == "running", f"resume: {s}")
    r = await good(c, "run_command", {"sandbox_id": sb, "argv": ["cat", "/tmp/kept"]})
    check(r["stdout"]["data"] == "kept\n", f"after resume: {r}")
    ok(f"{label}: suspend_sandbox, resume_sandbox (files kept; a command on a suspended sandbox is refused clearly)")

    # Errors an agent can act on, and bad arguments.
    await refused(c, "run_command", {"sandbox_id": "sb_doesnotexist00000000", "argv": ["true"]}, "not_found")
    await refused(c, "run_command", {"sandbox_id": sb, "argv": ["true"], "shell": "true"}, "invalid_request")
    await refused(c, "run_command", {"sandbox_id": sb}, "invalid_request")
    await refused(c, "read_output", {"command_id": "cmd_nope"}, "not_found")
    await refused(c, "read_output", {"command_id": cid, "stream": "both"}, "invalid_request")
    await refused(c, "send_signal", {"command_id": cid, "signal": "NOPE"}, "invalid_request")
    await refused(c, "write_file", {"sandbox_id": sb, "path": "/x", "content": "a", "content_base64": "YQ=="}, "invalid_request")
    await refused(c, "write_file", {"sandbox_id": sb, "path": "relative.txt", "content": "a"})
    await refused(c, "read_file", {"sandbox_id": sb, "path": "/nope/nothing"}, "not_found")
    await refused(c, "create_sandbox", {"template": "no-such-template"}, "not_found")
    await refused(c, "run_command", {"sandbox_id": sb, "argv": ["true"], "bogus": 1})
    ok(f"{label}: errors carry codes an agent can act on; bad arguments are refused")

    # Another tenant sees none of it and changes nothing.
    for name, args in [
        ("run_command", {"sandbox_id": sb, "argv": ["true"]}),
        ("start_command", {"sandbox_id": sb, "argv": ["true"]}),
        ("read_output", {"command_id": cid}),
        ("send_signal", {"command_id": cid, "signal": "KILL"}),
        ("write_file", {"sandbox_id": sb, "path": "/tmp/x", "content": "x"}),
        ("read_file", {"sandbox_id": sb, "path": "/tmp/kept"}),
        ("list_files", {"sandbox_id": sb, "path": "/"}),
        ("suspend_sandbox", {"sandbox_id": sb}),
        ("resume_sandbox", {"sandbox_id": sb}),
        ("destroy_sandbox", {"sandbox_id": sb}),
    ]:
        await refused(other, name, args, "not_found")
    lst = await good(other, "list_sandboxes", {"labels": {"suite": label}})
    check(lst["sandboxes"] == [], f"other tenant lists {lst}")
    r = await good(c, "run_command", {"sandbox_id": sb, "argv": ["cat", "/tmp/kept"]})
    check(r["stdout"]["data"] == "kept\n", "the other tenant changed something")
    ok(f"{label}: another tenant's ids are not found, nothing changes")

    d = await good(c, "destroy_sandbox", {"sandbox_id": sb})
    check(d["state"] == "destroyed", f"destroy: {d}")
    made.remove(sb)
    await refused(c, "run_command", {"sandbox_id": sb, "argv": ["true"]})
    ok(f"{label}: destroy_sandbox")


async def main():
    async with http_client(TOKEN) as c, http_client(OTHER) as other:
        await suite(c, other, "http")
    async with stdio_client(TOKEN) as c, stdio_client(OTHER) as other:
        await suite(c, other, "stdio")
    # A wrong key gets nothing, on both transports.
    for make in (http_client, stdio_client):
        try:
            async with make("spk_wrong") as c:
                await c.list_tools()
            raise AssertionError(f"{make.__name__}: a wrong key was accepted")
        except AssertionError:
            raise
        except Exception:
            pass
    ok("a wrong key is refused on both transports")


def cleanup():
    if not made:
        return
    import urllib.request

    for sb in made:
        req = urllib.request.Request(f"{URL}/v1/sandboxes/{sb}", method="DELETE", headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            urllib.request.urlopen(req, timeout=30)
        except Exception as e:
            print(f"cleanup of {sb}: {e}", file=sys.stderr)


if __name__ == "__main__":
    try:
        asyncio.run(main())
        print("all ok")
    except BaseException:
        traceback.print_exc()
        cleanup()
        sys.exit(1)
