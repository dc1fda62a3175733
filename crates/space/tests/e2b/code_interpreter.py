#!/usr/bin/env python3
"""E2B's code interpreter SDK (`e2b-code-interpreter`, sync and async, pinned by
scripts/test-clients.sh) against space, unmodified, as an application would use it:
its default template (`code-interpreter-v1`), run_code with callbacks, and its
context calls.

Run with the venv's python. Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
SPACE_OTHER_KEY (another tenant), SPACE_E2B_DEADLINE (seconds, default 240).

Prints `ok <check>` per check; on the first failure prints the traceback and exits 1.
Every sandbox it created is killed on the way out.
"""

import asyncio
import base64
import os
import re
import sys
import threading
import traceback

import httpx
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox

# The helpers of the E2B SDK script beside this one: checks, and the list of sandboxes to
# kill on the way out.
from sdk_sync import API_KEY, OTHER_KEY, SANDBOX_URL, check, cleanup, created, ok, raises

DEADLINE = float(os.environ.get("SPACE_E2B_DEADLINE", "240"))


def watchdog():
    print(f"FAIL watchdog: still running after {DEADLINE:.0f} s", flush=True)
    import faulthandler

    faulthandler.dump_traceback(all_threads=True)
    cleanup()
    os._exit(1)


def sync_checks():
    sbx = Sandbox.create(timeout=600)
    created.append((sbx.sandbox_id, API_KEY))
    check(sbx.get_info().template_id == "code-interpreter-v1", f"template {sbx.get_info()!r}")
    ok("Sandbox.create with the default template code-interpreter-v1")

    out, results, errors = [], [], []
    ex = sbx.run_code(
        "x = 41\nprint('hello')\nx + 1",
        on_stdout=lambda m: out.append(m.line),
        on_result=results.append,
        on_error=errors.append,
    )
    check(ex.text == "42", f"text {ex!r}")
    check(ex.logs.stdout == ["hello\n"], f"logs {ex.logs!r}")
    check(out == ["hello\n"] and len(results) == 1 and not errors, f"callbacks {out} {results} {errors}")
    check(ex.results[0].is_main_result, f"main {ex.results!r}")
    check(ex.execution_count == 1, f"count {ex.execution_count}")
    ok("run_code: stdout, the main result, callbacks, execution_count")

    ex = sbx.run_code("x += 1\nx")
    check(ex.text == "42", f"persist {ex!r}")
    ok("variables persist between cells")

    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()"
    )
    pngs = [r.png for r in ex.results if r.png]
    check(len(pngs) == 1, f"chart {ex!r}")
    check(base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n"), "not a PNG")
    ok("a matplotlib chart comes back as a PNG that decodes")

    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    r = ex.results[0]
    check("<table" in (r.html or "") and "a" in (r.text or ""), f"dataframe {r!r}")
    check(set(r.formats()) >= {"text", "html"}, f"formats {r.formats()}")
    ok("a pandas DataFrame comes back as text and HTML")

    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    check(ex.error is not None and ex.error.name == "ValueError", f"error {ex.error!r}")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", ex.error.traceback)
    check(ex.error.value == "bad value" and "raise ValueError" in plain, f"traceback {plain}")
    ok("an exception comes back as an error with its traceback")

    e = raises(TimeoutException, sbx.run_code, "while True: pass", timeout=3)
    ex = sbx.run_code("x")
    check(ex.text == "42", f"after the timeout {ex!r}")
    ok("while True: pass is interrupted by a timeout; the next cell works")

    ex = sbx.run_code("import os\nos.environ.get('ONLY_HERE')", envs={"ONLY_HERE": "yes"})
    check(ex.text == "'yes'", f"envs {ex!r}")
    ex = sbx.run_code("print(os.environ.get('ONLY_HERE'))")
    check(ex.logs.stdout == ["None\n"], f"env leaked {ex!r}")
    ok("run_code envs apply to that cell only")

    ctx = sbx.create_code_context(cwd="/tmp")
    check(ctx.language == "python" and ctx.cwd == "/tmp" and ctx.id, f"context {ctx!r}")
    ex = sbx.run_code("import os\ny = 5\nos.getcwd()", context=ctx)
    check(ex.text == "'/tmp'", f"cwd {ex!r}")
    ex = sbx.run_code("y")
    check(ex.error is not None and ex.error.name == "NameError", f"shared {ex!r}")
    ex = sbx.run_code("x", context=ctx)
    check(ex.error is not None and ex.error.name == "NameError", f"shared {ex!r}")
    ids = [c.id for c in sbx.list_code_contexts()]
    check(ctx.id in ids and len(ids) == 2, f"list {ids}")
    ok("two contexts do not share state; list_code_contexts")

    sbx.restart_code_context(ctx)
    ex = sbx.run_code("y", context=ctx)
    check(ex.error is not None and ex.error.name == "NameError", f"restart {ex!r}")
    sbx.remove_code_context(ctx.id)
    check(ctx.id not in [c.id for c in sbx.list_code_contexts()], "removed context listed")
    raises(NotFoundException, sbx.run_code, "1", context=ctx)
    ok("restart_code_context and remove_code_context")

    ex = sbx.run_code("echo from-bash; V=1; echo $V", language="bash")
    check(ex.logs.stdout == ["from-bash\n", "1\n"], f"bash {ex.logs!r}")
    ex = sbx.run_code("echo $V", language="bash")
    check(ex.logs.stdout == ["1\n"], f"bash state {ex.logs!r}")
    bash = sbx.create_code_context(language="bash")
    check(bash.language == "bash", f"bash context {bash!r}")
    ex = sbx.run_code("echo ${V-unset}", context=bash)
    check(ex.logs.stdout == ["unset\n"], f"bash contexts shared {ex.logs!r}")
    e = raises(SandboxException, sbx.run_code, "1", language="r")
    check("400" in str(e), f"r {e}")
    ok("bash: the default context and one of its own; an unknown language is refused")

    # The same sandbox's envd token opens the interpreter; none, or another tenant's key
    # as a token, does not.
    with httpx.Client(timeout=20) as client:
        url = f"{SANDBOX_URL}/contexts"
        h = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
        check(client.get(url, headers=h).status_code == 401, "no token")
        bad = dict(h, **{"E2B-Traffic-Access-Token": OTHER_KEY})
        check(client.get(url, headers=bad).status_code == 401, "another key")
        good = dict(h, **{"E2B-Traffic-Access-Token": sbx.traffic_access_token})
        check(client.get(url, headers=good).status_code == 200, "the traffic token")
    ok("the interpreter's routes need the sandbox's token")
    return sbx


async def async_checks():
    sbx = await AsyncSandbox.create(timeout=600)
    created.append((sbx.sandbox_id, API_KEY))
    seen = []

    async def on_stdout(m):
        seen.append(m.line)

    ex = await sbx.run_code("for i in range(3): print(i)", on_stdout=on_stdout)
    check(seen == ["0\n", "1\n", "2\n"] or "".join(seen) == "0\n1\n2\n", f"async stdout {seen}")
    ctx = await sbx.create_code_context()
    ex = await sbx.run_code("z = 3\nz * 2", context=ctx)
    check(ex.text == "6", f"async {ex!r}")
    contexts = await sbx.list_code_contexts()
    check(ctx.id in [c.id for c in contexts], f"async list {contexts}")
    await sbx.remove_code_context(ctx)
    ok("AsyncSandbox: run_code with an async callback, contexts")
    await sbx.kill()


def main():
    timer = threading.Timer(DEADLINE, watchdog)
    timer.daemon = True
    timer.start()
    try:
        sync_checks()
        asyncio.run(async_checks())
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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
