"""What needs no server: argument checks, error mapping, decoding, the resume
state machine, the streamed tar, recipes, configuration."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile

import pytest

from space_client import (
    AsyncClient,
    BadRequest,
    Client,
    CommandError,
    CommandTimeout,
    Conflict,
    InvalidArgument,
    NotFound,
    OperationFailed,
    Result,
    ServerError,
    SpaceError,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from space_client import _core as core
from space_client._tar import tar_gz_stream
from space_client.errors import error_from_response
from space_client.models import Command, Operation, OutputChunk, Sandbox


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("SPACE_URL", "http://10.1.2.3:9999/")
    monkeypatch.setenv("SPACE_TOKEN", "tok")
    c = Client()
    assert (c.url, c.token) == ("http://10.1.2.3:9999", "tok")
    c.close()
    monkeypatch.delenv("SPACE_URL")
    monkeypatch.delenv("SPACE_TOKEN")
    c = Client()
    assert (c.url, c.token) == ("http://127.0.0.1:7070", "space-dev-token")
    c.close()
    assert AsyncClient("http://x:1", "t").url == "http://x:1"
    with pytest.raises(InvalidArgument):
        Client("localhost:7070")


@pytest.mark.parametrize(
    "status,cls,code",
    [
        (400, BadRequest, "invalid_request"),
        (401, Unauthorized, "unauthorized"),
        (404, NotFound, "not_found"),
        (409, Conflict, "invalid_transition"),
        (500, ServerError, "internal"),
        (503, Unavailable, "unavailable"),
    ],
)
def test_error_mapping(status, cls, code):
    e = error_from_response(status, json.dumps({"error": {"code": code, "message": "m"}}).encode())
    assert type(e) is cls and e.code == code and e.message == "m" and e.status == status
    assert isinstance(e, SpaceError)
    assert code in str(e)


def test_error_429_and_non_json():
    e = error_from_response(429, b'{"error":{"code":"too_many_requests","message":"slow"}}', {"retry-after": "3"})
    assert isinstance(e, TooManyRequests) and e.retry_after == 3.0
    e = error_from_response(502, b"<html>bad gateway</html>")
    assert isinstance(e, ServerError) and e.code == "http_502" and "bad gateway" in e.message


def test_invalid_argument_is_value_and_type_error():
    e = InvalidArgument("x")
    assert isinstance(e, ValueError) and isinstance(e, TypeError) and isinstance(e, BadRequest)
    assert e.code == "invalid_argument" and e.status is None


def body(cmd, **kw):
    base = dict(shell=False, env=None, cwd=None, user=None, secrets=None, timeout_seconds=None)
    base.update(kw)
    return core.command_body(cmd, **base)


def test_command_body():
    assert body(["ls", "-l"]) == {"argv": ["ls", "-l"]}
    assert body("echo $HOME", shell=True, wait=True) == {"shell": "echo $HOME", "wait": True}
    b = body(["x"], env={"A": "1"}, cwd="/w", user="user", secrets={"S": "v"}, timeout_seconds=5, stdin=True,
             pty=(24, 80))
    assert b == {"argv": ["x"], "env": {"A": "1"}, "cwd": "/w", "user": "user", "secrets": {"S": "v"},
                 "timeout_seconds": 5, "stdin": True, "pty": {"rows": 24, "cols": 80}}


@pytest.mark.parametrize(
    "cmd,kw,match",
    [
        (42, {}, "list of strings"),
        ("ls -l", {}, "needs shell=True"),
        (["ls"], {"shell": True}, "shell=True takes"),
        ([], {}, "empty"),
        (["ls", 3], {}, "argv item"),
        (["ls"], {"timeout_seconds": -1}, ">= 0"),
        (["ls"], {"timeout_seconds": "5"}, "integer"),
        (["ls"], {"env": {"A": 1}}, "strings"),
        (["ls"], {"env": ["A=1"]}, "mapping"),
        (["ls"], {"cwd": ""}, "cwd"),
        (["ls"], {"pty": {"rows": 1}}, "pty"),
    ],
)
def test_command_body_refuses(cmd, kw, match):
    with pytest.raises(InvalidArgument, match=match):
        body(cmd, **kw)


def test_other_checks():
    for bad in ("relative/path", 3, None):
        with pytest.raises(InvalidArgument):
            core.abs_path(bad)
    with pytest.raises(InvalidArgument):
        core._signal(0)
    with pytest.raises(InvalidArgument):
        core._signal(True)
    assert core._signal("TERM") == "TERM" and core._signal(9) == 9
    import signal as pysignal

    assert core._signal(pysignal.SIGINT) == 2
    assert core._mode(0o755) == "0755" and core._mode("0644") == "0644"
    with pytest.raises(InvalidArgument):
        core._mode(0o17777)
    assert core.label_selector({"a": "1", "b": "2"}) == "a=1,b=2"
    with pytest.raises(InvalidArgument):
        core.label_selector("novalue")
    with pytest.raises(InvalidArgument):
        next(core.create_sandbox(""))
    with pytest.raises(InvalidArgument):
        next(core.create_sandbox("busybox", ttl_seconds=-5))
    with pytest.raises(InvalidArgument):
        next(core.create_sandbox("busybox", on_idle="explode"))
    with pytest.raises(InvalidArgument):
        next(core.wait_operation({"id": "op_x", "kind": "create", "status": "pending", "created_at": "",
                                  "updated_at": ""}, timeout=-1))
    with pytest.raises(InvalidArgument):
        next(core.list_files("sb_x", "/", depth=0))


def test_models_decode_and_ignore_unknown_fields():
    op = Operation.from_dict({"id": "op_1", "kind": "create", "status": "failed", "created_at": "t",
                              "updated_at": "t", "error": {"code": "start_failed", "message": "m"},
                              "some_future_field": 1})
    assert op.done and not op.succeeded and op.error.code == "start_failed"
    e = OperationFailed(op)
    assert e.code == "start_failed" and e.operation is op
    sb = Sandbox.from_dict({
        "id": "sb_1", "state": "running", "template": "busybox", "template_version": "1", "runtime": "gvisor",
        "labels": {}, "resources": {"vcpus": 1}, "env": {}, "network": {"mode": "none", "resolved": [
            {"entry": "1.2.3.4", "cidr": "1.2.3.4/32"}]}, "created_at": "t", "updated_at": "t",
        "cost": {"memory_bytes": 5}})
    assert sb.resources.vcpus == 1 and sb.cost.memory_bytes == 5 and sb.network.resolved[0].cidr == "1.2.3.4/32"
    assert sb.to_dict()["network"]["resolved"][0]["entry"] == "1.2.3.4"
    with pytest.raises(SpaceError):
        Command.from_dict({"id": "cmd_1"})


def test_result_check():
    cmd = {"id": "cmd_1", "sandbox_id": "sb_1", "state": "exited",
           "result": {"exit_code": 3, "signal": None, "timed_out": False, "oom_killed": False, "duration_ms": 1,
                      "stdout_bytes": 0, "stderr_bytes": 4, "output_truncated": False}}
    r = Result._build(cmd, b"", b"bad\n", False)
    assert not r.ok and r.stderr == "bad\n"
    with pytest.raises(CommandError, match="exit code 3: bad"):
        r.check()
    cmd["result"].update(exit_code=None, signal=9, timed_out=True)
    with pytest.raises(CommandTimeout):
        Result._build(cmd, b"", b"", False).check()


def test_needs_full_output():
    res = {"stdout_bytes": 2, "stderr_bytes": 0, "output_truncated": False}
    assert not core._needs_full_output({"stdout": "hi", "stderr": "", "result": res, "inline_truncated": False})
    assert core._needs_full_output({"stdout": "hi", "stderr": "", "result": res, "inline_truncated": True})
    assert core._needs_full_output({"stdout": "\ufffd", "stderr": "", "result": res})
    assert core._needs_full_output({"stdout": "h", "stderr": "", "result": res})


def _line(stream, offset, data):
    return (json.dumps({"stream": stream, "offset": offset, "data": base64.b64encode(data).decode()}) + "\n").encode()


def test_output_state_resumes_exactly():
    st = core.OutputState(0, True, "combined")
    text = b"".join(_line("stdout", i * 4, b"l%02d\n" % i) for i in range(5))
    st.begin()
    first = len(_line("stdout", 0, b"l00\n"))
    got = st.feed(text[: first + 10])  # a cut in the middle of the second line
    assert [c.data for c in got] == [b"l00\n"] and st.next_offset == 4
    assert st.params == {"offset": 4, "stream": "combined", "follow": "true"}
    assert not st.finished()
    st.broken("cut")
    st.begin()
    # The server may send a chunk that overlaps what was delivered: only the new bytes pass.
    got = st.feed(_line("stdout", 2, b"0\nl01\n") + _line("stdout", 8, b"l02\n"))
    assert [(c.offset, c.data) for c in got] == [(4, b"l01\n"), (8, b"l02\n")]
    got = st.feed(_line("stdout", 0, b"l00\n") + b'{"result":{"exit_code":0},"state":"exited"}\n')
    assert got == [] and st.finished() and st.end["state"] == "exited"


def test_output_state_bounds_retries():
    st = core.OutputState(0, True, "stdout", max_retries=3)
    for _ in range(3):
        st.begin()
        assert st.broken("x") <= 2.0 * 1.25
    st.begin()
    with pytest.raises(SpaceError) as e:
        st.broken("x")
    assert e.value.code == "stream_interrupted" and e.value.offset == 0
    with pytest.raises(InvalidArgument):
        core.OutputState(-1, True, "combined")
    with pytest.raises(InvalidArgument):
        core.OutputState(0, True, "both")


def test_output_chunk():
    c = OutputChunk.from_line({"stream": "stderr", "offset": 7, "data": base64.b64encode(b"\xffab").decode()})
    assert c.end == 10 and c.data == b"\xffab" and c.text == "\ufffdab"


def test_tar_stream(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "a.txt").write_text("A")
    (src / "pkg" / "deep" / "big.bin").write_bytes(os.urandom(3 << 20))
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("a.txt")
    (src / "empty").mkdir()
    os.link(src / "a.txt", src / "hard")
    data = b"".join(tar_gz_stream(src))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
        names = {m.name: m for m in tf.getmembers()}
        assert set(names) == {"a.txt", "pkg", "pkg/deep", "pkg/deep/big.bin", "run.sh", "link", "empty", "hard"}
        assert names["link"].issym() and names["link"].linkname == "a.txt"
        assert names["run.sh"].mode & 0o777 == 0o755
        assert names["empty"].isdir()
        assert names["hard"].islnk() or names["a.txt"].islnk()
        assert tf.extractfile("pkg/deep/big.bin").read() == (src / "pkg" / "deep" / "big.bin").read_bytes()


def test_recipe_toml(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("<h1>hi</h1>")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('name = "web"\nbase = "busybox"\n[[files]]\npath = "/srv/index.html"\nsrc = "site/index.html"\n'
                      'mode = 0o644\n[[steps]]\nrun = "true"\n')
    r = core.recipe_json(recipe)
    assert r["files"][0] == {"path": "/srv/index.html", "mode": 0o644,
                             "content_base64": base64.b64encode(b"<h1>hi</h1>").decode()}
    assert core.recipe_json('name = "x"\nbase = "busybox"\n') == {"name": "x", "base": "busybox"}
    with pytest.raises(InvalidArgument):
        core.recipe_json({"base": "busybox"})
    with pytest.raises(InvalidArgument):
        core.recipe_json("name = ")
