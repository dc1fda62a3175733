"""Drift check: the SDK's models and requests against the OpenAPI document the
live server serves (``GET /v1/openapi.json``), and against the repository's
snapshot of it when the SDK sits in the repository."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import REPO
from space_client import _core as core
from space_client.models import SCHEMA_MODELS, FileInfo

SNAPSHOT = REPO / "crates/space/tests/snapshots/openapi.json"
SB, CMD, OP = "sb_" + "a" * 20, "cmd_" + "a" * 20, "op_" + "a" * 20


def model_problems(doc: dict) -> list[str]:
    schemas = doc["components"]["schemas"]
    problems = []
    for model in SCHEMA_MODELS:
        schema = schemas.get(model.__schema__)
        if schema is None:
            problems.append(f"{model.__name__}: no schema {model.__schema__!r}")
            continue
        props = set(schema.get("properties", {}))
        required = set(schema.get("required", []))
        fields = {f.name for f in dataclasses.fields(model)}
        for name in sorted(fields - props):
            problems.append(f"{model.__name__}.{name}: not in schema {model.__schema__}")
        for name in sorted(required - fields):
            problems.append(f"{model.__name__}: lacks required {model.__schema__}.{name}")
        for name in sorted(props - fields):
            problems.append(f"{model.__name__}: lacks {model.__schema__}.{name} (a field the server returns)")
        for f in dataclasses.fields(model):
            # A field the schema requires is one the model requires too (no default).
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if f.name in required and has_default:
                problems.append(f"{model.__name__}.{f.name}: required by the schema, optional in the model")
    return problems


def first_request(flow) -> core.Req:
    req = next(flow)
    flow.close()
    assert isinstance(req, core.Req)
    return req


def sample_requests() -> list[core.Req]:
    """One request of every kind the SDK sends, each with every option set."""
    body = core.command_body(["ls"], shell=False, env={"A": "1"}, cwd="/", user="user", secrets={"S": "v"},
                             timeout_seconds=5, stdin=True, pty=(24, 80), wait=True)
    shell = core.command_body("ls", shell=True, env=None, cwd=None, user=None, secrets=None, timeout_seconds=None)
    out = core.OutputState(5, True, "stdout")
    reqs = [
        first_request(core.create_sandbox("busybox", runtime="gvisor", env={"A": "1"}, labels={"k": "v"},
                                          resources={"vcpus": 1, "memory_mib": 256, "disk_mib": 512, "pids": 64},
                                          network="none", ttl_seconds=60, idle_timeout_seconds=30,
                                          on_idle="destroy", secrets={"S": "v"})),
        first_request(core.get_sandbox(SB)),
        first_request(core.list_sandboxes("a=b")),
        first_request(core.lifecycle(SB, "pause")),
        first_request(core.lifecycle(SB, "resume")),
        first_request(core.lifecycle(SB, "suspend")),
        first_request(core.lifecycle(SB, "destroy")),
        first_request(core.keepalive(SB, 60)),
        first_request(core.snapshot_template(SB, "snap")),
        first_request(core.wait_operation({"id": OP, "kind": "create", "status": "pending", "created_at": "",
                                           "updated_at": ""})),
        first_request(core.get_operation(OP)),
        first_request(core.list_operations(SB, 10)),
        first_request(core.cancel_operation(OP)),
        first_request(core.operation_log(OP)),
        first_request(core.start_command(SB, body)),
        first_request(core.start_command(SB, shell)),
        first_request(core.get_command(SB, CMD)),
        first_request(core.list_commands(SB)),
        first_request(core.wait_command(SB, CMD, 5)),
        first_request(core.signal_command(SB, CMD, "TERM")),
        first_request(core.write_stdin(SB, CMD, b"x", eof=True)),
        core.Req("GET", core._cmd_path(SB, CMD) + "/output", params=out.params),
        first_request(core.write_file(SB, "/f", b"x", mode=0o644, uid=1, gid=1, parents=False)),
        first_request(core.read_file(SB, "/f")),
        first_request(core.stat_file(SB, "/f")),
        first_request(core.list_files(SB, "/", depth=2)),
        first_request(core.mkdir(SB, "/d", mode=0o755, uid=1, gid=1)),
        first_request(core.move(SB, "/a", "/b", overwrite=True)),
        first_request(core.remove(SB, "/a", recursive=True)),
        first_request(core.upload_dir(SB, REPO / "sdk/python/src", "/d")),
        first_request(core.download_dir(SB, "/d", "/nonexistent-never-written")),
        first_request(core.list_templates()),
        first_request(core.build_template({"name": "n", "base": "busybox", "env": {"A": "1"}, "workdir": "/",
                                           "user": "user", "packages": [], "resources": {"vcpus": 1},
                                           "files": [{"path": "/f", "content": "x", "mode": 420}],
                                           "steps": [{"run": "true"}], "start": {"run": "true"}})),
        first_request(core.delete_template("n")),
        first_request(core.runtimes()),
        first_request(core.openapi()),
        first_request(core.health()),
    ]
    return reqs


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def request_problems(doc: dict) -> list[str]:
    problems = []
    templates = [(re.compile("^" + re.sub(r"\{[^/]+\}", "[^/]+", p) + "$"), p) for p in doc["paths"]]
    for req in sample_requests():
        method = req.method.lower()
        matches = [p for rx, p in templates if rx.match(req.path) and method in doc["paths"][p]]
        if not matches:
            problems.append(f"{req.method} {req.path}: no such operation in the document")
            continue
        # The most specific template (fewest parameters) wins: /files/list over /files/{x}.
        path = min(matches, key=lambda p: p.count("{"))
        op = doc["paths"][path][method]
        known = {p["name"] for p in op.get("parameters", []) if p.get("in") == "query"}
        for name in sorted(set(req.params or {}) - known):
            problems.append(f"{req.method} {path}: query parameter {name!r} not in the document")
        if req.json is not core._UNSET:
            content = (op.get("requestBody") or {}).get("content", {})
            if "application/json" not in content:
                problems.append(f"{req.method} {path}: sends JSON, the document takes none")
                continue
            schema = _resolve(doc, content["application/json"]["schema"])
            props = set(schema.get("properties", {}))
            for name in sorted(set(req.json) - props):
                problems.append(f"{req.method} {path}: body field {name!r} not in the document")
            for name in sorted(set(schema.get("required", [])) - set(req.json)):
                problems.append(f"{req.method} {path}: body lacks required {name!r}")
    return problems


def test_models_and_requests_match_served_openapi(client):
    doc = client.openapi()
    problems = model_problems(doc) + request_problems(doc)
    assert not problems, "the SDK and the served /v1/openapi.json differ:\n" + "\n".join(problems)


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="not inside the repository")
def test_models_and_requests_match_repo_snapshot():
    doc = json.loads(SNAPSHOT.read_text())
    problems = model_problems(doc) + request_problems(doc)
    assert not problems, f"the SDK and {SNAPSHOT} differ:\n" + "\n".join(problems)


def test_file_info_matches_live_answers(sandbox):
    """FileInfo has no schema in the document: check it against what the server says."""
    sandbox.run(["sh", "-c", "mkdir -p /t && echo x > /t/f && ln -s f /t/l"])
    fields = {f.name for f in dataclasses.fields(FileInfo)}
    required = {f.name for f in dataclasses.fields(FileInfo)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    h = sandbox._client
    for path in ("/t/f", "/t/l", "/t"):
        raw = h._run(_raw_stat(sandbox.id, path))
        assert set(raw) <= fields, f"FileInfo lacks {set(raw) - fields}"
        assert required <= set(raw), f"the server no longer sends {required - set(raw)}"
    listing = h._run(_raw_list(sandbox.id, "/t"))
    assert set(listing) <= {"path", "entries", "truncated"}
    for e in listing["entries"]:
        assert set(e) <= fields and required <= set(e)


def _raw_stat(sb, path):
    r = yield core.Req("GET", f"/v1/sandboxes/{sb}/files/stat", params={"path": path})
    return r.json()


def _raw_list(sb, path):
    r = yield core.Req("GET", f"/v1/sandboxes/{sb}/files/list", params={"path": path})
    return r.json()
