#!/usr/bin/env python3
"""Browser test of the web console, driven by Playwright (Chromium).

Environment: SPACE_URL (the server), SPACE_KEY (tenant A's key), SPACE_OTHER_KEY (tenant
B's key), SPACE_TEMPLATE (a template with /bin/sh, e.g. busybox), SPACE_SCREENSHOTS (a
directory for PNGs), CHROMIUM (the browser binary; default /usr/bin/chromium). Optional:
SPACE_SERVER_TOKEN (the operator check), SPACE_REVOKE_KEY with SPACE_BIN and SPACE_DATA_DIR
(a key revoked while signed in).

It sets things up through the API (urllib) and checks everything through the browser.
One line per check; on the first failure it saves failure-<check>.png, prints the page's
console errors and exits 1. Every sandbox and template it made is removed in the end.
"""

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request

from playwright.sync_api import expect, sync_playwright

URL = os.environ.get("SPACE_URL", "http://127.0.0.1:7070").rstrip("/")
KEY = os.environ["SPACE_KEY"]
OTHER_KEY = os.environ["SPACE_OTHER_KEY"]
TEMPLATE = os.environ.get("SPACE_TEMPLATE", "busybox")
SHOTS = os.environ.get("SPACE_SCREENSHOTS") or tempfile.mkdtemp(prefix="space-console-")
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
BUILD_TEMPLATE = os.environ.get("SPACE_CONSOLE_BUILD", "1") != "0"
# Optional: the server's own token (the operator check), and a key to revoke while signed
# in with `SPACE_BIN keys revoke … --data-dir SPACE_DATA_DIR` (the revoked-key check).
SERVER_TOKEN = os.environ.get("SPACE_SERVER_TOKEN")
REVOKE_KEY = os.environ.get("SPACE_REVOKE_KEY")
SPACE_BIN = os.environ.get("SPACE_BIN")
DATA_DIR = os.environ.get("SPACE_DATA_DIR")

os.makedirs(SHOTS, exist_ok=True)
# Generous: the suite runs this beside other tests that load both cores, and a 2-core CI
# machine now and then stalls whole for up to 90 s (its kernel then logs a workqueue lockup:
# ci86, ci90). Every wait outlasts such a stall; only a failure waits that long.
WAIT_MS = 150_000
expect.set_options(timeout=WAIT_MS)

created_sandboxes = []  # (key, id)
created_templates = []  # (key, name)


# ---------------------------------------------------------------- API helpers


def call(method, path, key, body=None, raw=None, timeout=WAIT_MS // 1000):
    """One API request; returns (status, parsed JSON or bytes)."""
    data = None
    headers = {"Authorization": f"Bearer {key}"}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    elif raw is not None:
        data = raw
        headers["Content-Type"] = "application/octet-stream"
    req = urllib.request.Request(URL + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload


def create_sandbox(key, labels, wait=True):
    status, op = call("POST", "/v1/sandboxes", key, {"template": TEMPLATE, "labels": labels})
    assert status == 202, f"create answered {status}: {op}"
    created_sandboxes.append((key, op["sandbox_id"]))
    if wait:
        wait_op(key, op)
    return op["sandbox_id"]


def wait_op(key, op, limit=120):
    deadline = time.time() + limit
    while time.time() < deadline:
        status, cur = call("GET", f"/v1/operations/{op['id']}?wait=30s", key)
        assert status == 200, f"operation {op['id']}: {status} {cur}"
        if cur["status"] in ("succeeded", "failed", "cancelled"):
            assert cur["status"] == "succeeded", f"operation {op['id']} ended {cur['status']}: {cur.get('error')}"
            return cur
    raise AssertionError(f"operation {op['id']} did not end within {limit} s")


def cleanup():
    todo = list(created_sandboxes)
    created_sandboxes.clear()
    for key, sid in todo:
        try:
            status, body = call("GET", f"/v1/sandboxes/{sid}", key)
            if status == 200 and body["state"] != "destroyed":
                status, op = call("DELETE", f"/v1/sandboxes/{sid}", key)
                if status == 202:
                    try:
                        wait_op(key, op, limit=60)
                    except AssertionError as e:
                        print(f"cleanup: {e}", file=sys.stderr)
        except Exception as e:  # keep cleaning
            print(f"cleanup of {sid} failed: {e}", file=sys.stderr)
    templates = list(created_templates)
    created_templates.clear()
    for key, name in templates:
        try:
            call("DELETE", f"/v1/templates/{urllib.parse.quote(name)}", key)
        except Exception as e:
            print(f"cleanup of template {name} failed: {e}", file=sys.stderr)


# ---------------------------------------------------------------- test harness


class Failed(Exception):
    pass


class Run:
    def __init__(self, page):
        self.page = page
        self.console = []
        self.page_errors = []
        self.urls = []
        self.dialogs = []
        page.on("console", lambda m: m.type in ("error", "warning") and self.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("request", lambda r: self.urls.append(r.url))
        page.on("framenavigated", lambda f: self.urls.append(f.url))
        page.on("websocket", lambda ws: self.urls.append(ws.url))
        page.on("dialog", self.on_dialog)

    def on_dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.accept()

    def check(self, name, fn):
        try:
            detail = fn()
        except Exception as e:
            shot = os.path.join(SHOTS, f"failure-{name}.png")
            try:
                self.page.screenshot(path=shot, full_page=True)
            except Exception:
                shot = "(no screenshot)"
            print(f"FAIL {name}: {e}")
            traceback.print_exc()
            print(f"  screenshot: {shot}")
            print(f"  page URL: {self.page.url}")
            for line in self.console[-30:]:
                print(f"  console {line}")
            for line in self.page_errors:
                print(f"  page error: {line}")
            raise Failed(name) from e
        if self.page_errors:
            errs = "; ".join(self.page_errors)
            print(f"FAIL {name}: uncaught errors in the page: {errs}")
            raise Failed(name)
        print(f"ok   {name}" + (f" ({detail})" if detail else ""), flush=True)

    def shot(self, name):
        self.page.screenshot(path=os.path.join(SHOTS, name))


def tid(name):
    return f'[data-testid="{name}"]'


def main():
    other_sb = None
    my_sb = None

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        run = Run(page)
        try:
            # 1. A wrong key gets a clear message and stays on the login form.
            def wrong_key():
                page.goto(URL + "/")
                expect(page.locator(tid("login-key"))).to_be_visible()
                assert page.locator(tid("login-key")).get_attribute("type") == "password"
                run.shot("login.png")
                page.fill(tid("login-key"), "spk_" + "0" * 64)
                page.click(tid("login-submit"))
                expect(page.locator(tid("login-error"))).to_contain_text("not accepted")
                expect(page.locator(tid("login-key"))).to_be_visible()
                expect(page.locator(tid("nav-sandboxes"))).to_have_count(0)
                assert "spk_" not in page.url

            run.check("wrong-key", wrong_key)

            # 2. Log in with tenant A's key.
            def login():
                page.fill(tid("login-key"), KEY)
                page.click(tid("login-submit"))
                expect(page.locator(tid("nav-sandboxes"))).to_be_visible()
                expect(page.locator(tid("logout"))).to_be_visible()
                assert KEY not in page.url
                # The header tells keys apart by their first hex digits, and shows no more.
                assert KEY[8:16] not in page.locator("body").inner_text(), "the page shows the key"
                stored = page.evaluate("() => [JSON.stringify(sessionStorage), JSON.stringify(localStorage)]")
                assert KEY in stored[0], "the key should be in sessionStorage"
                assert KEY not in stored[1], "the key must never be in localStorage"
                rows = page.locator(f'{tid("sandbox-row")}, {tid("empty-state")}')
                expect(rows.first).to_be_visible()
                expect(page.locator(tid("live-status"))).to_have_text("Live")
                if page.locator(tid("sandbox-row")).count() == 0:
                    run.shot("sandboxes-empty.png")
                    return "empty list, screenshot taken"
                return f"{page.locator(tid('sandbox-row')).count()} sandboxes already"

            run.check("login", login)

            # 3. A sandbox created through the API appears live; tenant B's never shows.
            def live_list():
                nonlocal other_sb, my_sb
                other_sb = create_sandbox(OTHER_KEY, {"owner": "b"})
                page.evaluate("() => { window.__marker = 'still-here'; }")
                my_sb = create_sandbox(KEY, {"owner": "a"}, wait=False)
                row = page.locator(f'{tid("sandbox-row")}[data-id="{my_sb}"]')
                expect(row).to_be_visible()
                expect(row.locator(tid("sandbox-state"))).to_have_text("running")
                assert page.evaluate("() => window.__marker") == "still-here", "the page reloaded"
                expect(page.locator(f'[data-id="{other_sb}"]')).to_have_count(0)
                assert other_sb not in page.locator("body").inner_text()
                assert other_sb not in page.content()
                expect(row).to_contain_text("owner=a")
                expect(row).to_contain_text(TEMPLATE)
                # The cost (disk bytes at least) shows, from the event or the list's next read.
                expect(row.locator(tid("sandbox-cost"))).to_contain_text(re.compile(r"disk\s+\d"))
                run.shot("sandboxes.png")
                return my_sb

            run.check("live-list", live_list)

            # 4. Filters.
            def filters():
                row = page.locator(f'{tid("sandbox-row")}[data-id="{my_sb}"]')
                page.fill(tid("filter-label"), "owner=a")
                expect(row).to_be_visible()
                page.select_option(tid("filter-state"), "running")
                expect(row).to_be_visible()
                page.select_option(tid("filter-state"), "suspended")
                expect(row).to_have_count(0)
                page.select_option(tid("filter-state"), "")
                page.select_option(tid("filter-template"), TEMPLATE)
                expect(row).to_be_visible()
                page.select_option(tid("filter-template"), "")
                page.fill(tid("filter-label"), "owner=zzz")
                expect(page.locator(tid("empty-state"))).to_be_visible()
                expect(page.locator(tid("sandbox-row"))).to_have_count(0)
                page.fill(tid("filter-label"), "")
                expect(row).to_be_visible()

            run.check("filters", filters)

            # 5. Terminal: a TTY shell over the attach WebSocket, in xterm.js.
            def terminal():
                page.click(f'{tid("sandbox-row")}[data-id="{my_sb}"] a')
                expect(page.locator(f'h1 {tid("sandbox-state")}')).to_have_text("running")
                assert page.evaluate("() => window.__marker") == "still-here"
                page.click(tid("tab-terminal"))
                page.click(tid("terminal-open"))
                term = page.locator(tid("terminal"))
                expect(term.locator(".xterm-rows")).to_be_visible()
                expect(page.locator(".term-bar")).to_have_attribute("data-state", "live")
                # A prompt before typing.
                page.wait_for_function(
                    "() => /[#$] ?$/m.test(document.querySelector('[data-testid=terminal] .xterm-rows').innerText.replace(/\\u00a0/g,' ').trimEnd())",
                    timeout=WAIT_MS,
                )
                term.click()
                page.keyboard.type("echo hi\n")
                wait_line(page, "hi")
                # Resize: a smaller window gives the pty fewer rows and columns.
                page.keyboard.type("stty size\n")
                before = wait_size(page, lambda r, c: r == dom_rows(page))
                page.set_viewport_size({"width": 1000, "height": 640})
                page.wait_for_function(
                    "(n) => document.querySelectorAll('[data-testid=terminal] .xterm-rows > div').length < n",
                    arg=before[0],
                )
                page.wait_for_timeout(300)
                term.click()
                page.keyboard.type("clear; stty size\n")
                after = wait_size(page, lambda r, c: (r, c) != before and r == dom_rows(page))
                assert after[1] < before[1], f"columns did not shrink: {before} -> {after}"
                page.set_viewport_size({"width": 1280, "height": 800})
                page.wait_for_timeout(300)
                term.click()
                page.keyboard.type("clear; echo back-to-full; ls /\n")
                wait_line(page, "back-to-full")
                run.shot("terminal.png")
                return f"pty {before[0]}x{before[1]} -> {after[0]}x{after[1]}"

            run.check("terminal", terminal)

            # 6. Files: upload random bytes, list, download identical bytes, delete.
            def files():
                page.click(tid("tab-files"))
                page.fill(tid("files-path"), "/tmp")
                page.press(tid("files-path"), "Enter")
                expect(page.locator(".path-crumbs")).to_contain_text("tmp")
                data = b"\xff\xfe\x80\x00not utf-8\xc3\x28" + secrets.token_bytes(100 * 1024)
                name = f"blob-{secrets.token_hex(4)}.bin"
                page.set_input_files(tid("file-upload"), files=[{"name": name, "mimeType": "application/octet-stream", "buffer": data}])
                row = page.locator(f'{tid("file-row")}[data-name="{name}"]')
                expect(row).to_be_visible()
                status, stored = call("GET", f"/v1/sandboxes/{my_sb}/files?path=/tmp/{name}", KEY)
                assert status == 200 and stored == data, f"the sandbox holds other bytes ({status}, {len(stored or b'')} bytes)"
                with page.expect_download() as dl:
                    row.locator(tid("file-download")).click()
                path = dl.value.path()
                with open(path, "rb") as f:
                    got = f.read()
                assert dl.value.suggested_filename == name, dl.value.suggested_filename
                assert got == data, f"downloaded {len(got)} bytes, not the {len(data)} uploaded"
                run.shot("files.png")
                n = len(run.dialogs)
                row.locator(tid("file-delete")).click()
                expect(row).to_have_count(0)
                assert len(run.dialogs) == n + 1, "deleting should ask first"
                status, _ = call("GET", f"/v1/sandboxes/{my_sb}/files/stat?path=/tmp/{name}", KEY)
                assert status == 404, f"the file is still there ({status})"
                return f"{len(data)} bytes round-tripped"

            run.check("files", files)

            # 7. Commands: the terminal's shell is listed; output replays from an offset.
            def commands():
                page.click(tid("tab-commands"))
                status, listing = call("GET", f"/v1/sandboxes/{my_sb}/commands", KEY)
                assert status == 200
                shells = [c for c in listing["commands"] if c.get("pty")]
                assert shells, "no pty command recorded"
                expect(page.locator(f'{tid("command-row")}[data-id="{shells[0]["id"]}"]')).to_be_visible()
                page.fill(tid("command-input"), "echo one; echo two")
                page.click(tid("command-run"))
                row = page.locator(tid("command-row")).filter(has_text="echo one; echo two")
                expect(row).to_have_count(1)
                row.click()
                expect(row.locator(tid("command-state"))).to_have_text("exited")
                wait_output(page, "one\ntwo\n")
                page.fill(tid("output-offset"), "4")
                page.press(tid("output-offset"), "Enter")
                wait_output(page, "two\n")
                page.fill(tid("output-offset"), "0")
                page.press(tid("output-offset"), "Enter")
                wait_output(page, "one\ntwo\n")
                run.shot("commands.png")

            run.check("commands", commands)

            # 8. Suspend and resume with the buttons; the badge follows without a reload.
            def lifecycle():
                state = page.locator(f'h1 {tid("sandbox-state")}')
                expect(page.locator(tid("action-pause"))).to_be_enabled()
                expect(page.locator(tid("action-resume"))).to_be_disabled()
                page.click(tid("action-suspend"))
                opline = page.locator(tid("operation-status"))
                expect(opline).to_be_visible()
                expect(opline).to_contain_text("Suspend")
                expect(state).to_have_text("suspended")
                expect(opline).to_contain_text("Suspend succeeded")
                expect(page.locator(tid("sandbox-cost"))).to_contain_text(re.compile(r"snapshot\s+\d"))
                expect(page.locator(tid("action-suspend"))).to_be_disabled()
                expect(page.locator(tid("action-resume"))).to_be_enabled()
                page.click(tid("action-resume"))
                expect(opline).to_contain_text("Resume")
                expect(state).to_have_text("running")
                expect(opline).to_contain_text("Resume succeeded")
                expect(page.locator(tid("sandbox-cost"))).to_contain_text(re.compile(r"disk\s+\d"))
                assert page.evaluate("() => window.__marker") == "still-here", "the page reloaded"
                run.shot("sandbox.png")

            run.check("suspend-resume", lifecycle)

            # 9. Templates (and a small build), operations and pools render.
            def templates():
                page.click(tid("nav-templates"))
                expect(page.locator(f'{tid("template-row")}[data-name="{TEMPLATE}"]')).to_be_visible()
                if not BUILD_TEMPLATE:
                    run.shot("templates.png")
                    return "build skipped"
                name = f"console-test-{secrets.token_hex(3)}"
                created_templates.append((KEY, name))
                page.fill(tid("template-build-name"), name)
                page.select_option(tid("template-build-base"), "busybox")
                page.fill(
                    tid("template-build-recipe"),
                    json.dumps({"files": [{"path": "/etc/motd", "content": "hello\n"}], "steps": [{"run": "echo built > /version"}]}, indent=2),
                )
                page.click(tid("template-build-submit"))
                log = page.locator(tid("build-log"))
                expect(log).to_contain_text(f"building template {name}")
                expect(log).to_contain_text("published")
                expect(page.locator(tid("template-build-status"))).to_contain_text("succeeded")
                expect(page.locator(f'{tid("template-row")}[data-name="{name}"]')).to_be_visible()
                run.shot("templates.png")
                return f"built {name}"

            run.check("templates", templates)

            def operations():
                page.click(tid("nav-operations"))
                for kind in ("suspend", "resume", "create"):
                    row = page.locator(f'{tid("operation-row")}[data-kind="{kind}"]').filter(has_text=my_sb)
                    expect(row.first).to_be_visible()
                    expect(row.first.locator(tid("operation-state"))).to_have_text("succeeded")
                assert other_sb not in page.content()
                run.shot("operations.png")

            run.check("operations", operations)

            def pools():
                page.click(tid("nav-pools"))
                shown = page.locator(f'{tid("pool-row")}, {tid("empty-state")}, {tid("error-state")}')
                expect(shown.first).to_be_visible()
                run.shot("pools.png")
                if page.locator(tid("error-state")).count():
                    expect(page.locator(tid("error-state"))).to_contain_text("operator")
                    return "403 for a tenant key, shown as such"
                return "pool list"

            run.check("pools", pools)

            # 10. Destroy through the button, after a confirmation.
            def destroy():
                page.click(tid("nav-sandboxes"))
                page.click(f'{tid("sandbox-row")}[data-id="{my_sb}"] a')
                state = page.locator(f'h1 {tid("sandbox-state")}')
                expect(state).to_have_text("running")
                n = len(run.dialogs)
                page.click(tid("action-destroy"))
                expect(state).to_have_text("destroyed")
                assert len(run.dialogs) == n + 1 and my_sb in run.dialogs[-1], run.dialogs
                for a in ("pause", "resume", "suspend", "destroy"):
                    expect(page.locator(tid(f"action-{a}"))).to_be_disabled()
                assert page.evaluate("() => window.__marker") == "still-here"

            run.check("destroy", destroy)

            # 11. Log out: back to the login form, nothing of the key left.
            def logout():
                page.click(tid("logout"))
                expect(page.locator(tid("login-key"))).to_be_visible()
                stored = page.evaluate("() => JSON.stringify(sessionStorage) + JSON.stringify(localStorage) + document.cookie")
                assert KEY not in stored, "the key is still stored"
                page.reload()
                expect(page.locator(tid("login-key"))).to_be_visible()
                leaked = [u for u in run.urls if KEY in u or urllib.parse.quote(KEY) in u]
                assert not leaked, f"the key appeared in a URL: {leaked[:3]}"
                return f"{len(run.urls)} URLs checked for the key"

            run.check("logout", logout)

            # 12. The server's own token: the operator, who manages pools.
            def operator():
                if not SERVER_TOKEN:
                    return "skipped (no SPACE_SERVER_TOKEN)"
                page.fill(tid("login-key"), SERVER_TOKEN)
                page.click(tid("login-submit"))
                expect(page.locator(".key-status")).to_contain_text("operator")
                assert SERVER_TOKEN[:4] not in page.locator(".key-status").inner_text(), "the header shows the token"
                page.click(tid("nav-pools"))
                expect(page.locator(tid("pool-submit"))).to_be_visible()
                shown = page.locator(f'{tid("pool-row")}, {tid("empty-state")}')
                expect(shown.first).to_be_visible()
                run.shot("pools-operator.png")
                # Tenant A's sandboxes are not the operator's tenant's.
                page.click(tid("nav-sandboxes"))
                expect(page.locator(f'{tid("sandbox-row")}, {tid("empty-state")}').first).to_be_visible()
                assert my_sb not in page.content() and other_sb not in page.content()
                page.click(tid("logout"))
                expect(page.locator(tid("login-key"))).to_be_visible()

            run.check("operator", operator)

            # 13. A key revoked while the console is open: back to sign-in, with why.
            def revoked():
                if not (REVOKE_KEY and SPACE_BIN and DATA_DIR):
                    return "skipped (no SPACE_REVOKE_KEY, SPACE_BIN, SPACE_DATA_DIR)"
                page.fill(tid("login-key"), REVOKE_KEY)
                page.click(tid("login-submit"))
                expect(page.locator(tid("live-status"))).to_have_text("Live")
                status, me = call("GET", "/v1/whoami", REVOKE_KEY)
                assert status == 200, f"whoami: {status} {me}"
                out = subprocess.run(
                    [SPACE_BIN, "keys", "revoke", me["key_id"], "--data-dir", DATA_DIR],
                    capture_output=True, text=True, timeout=WAIT_MS // 1000,
                )
                assert out.returncode == 0, f"space keys revoke: {out.stderr}"
                # The live feed is cut off, its reconnect gets 401: sign-in says so.
                expect(page.locator(tid("login-error"))).to_contain_text("revoked")
                expect(page.locator(tid("login-key"))).to_be_visible()
                stored = page.evaluate("() => JSON.stringify(sessionStorage)")
                assert REVOKE_KEY not in stored, "a revoked key is still kept"
                run.shot("revoked.png")

            run.check("revoked", revoked)
        except Failed:
            return 1
        finally:
            try:
                browser.close()
            except Exception:
                pass
            cleanup()
    print(f"all checks passed; screenshots in {SHOTS}")
    return 0


def term_rows(page):
    return page.evaluate(
        "() => [...document.querySelectorAll('[data-testid=terminal] .xterm-rows > div')]"
        ".map(r => r.textContent.replace(/\\u00a0/g, ' ').trim())"
    )


def wait_line(page, text, timeout=WAIT_MS):
    """Waits until a whole line of the terminal's screen is exactly `text`."""
    page.wait_for_function(
        "(t) => [...document.querySelectorAll('[data-testid=terminal] .xterm-rows > div')]"
        ".some(r => r.textContent.replace(/\\u00a0/g, ' ').trim() === t)",
        arg=text,
        timeout=timeout,
    )


def wait_output(page, text, timeout=WAIT_MS):
    """Waits until the command output pane holds exactly `text` (byte for byte)."""
    try:
        page.wait_for_function(
            "(t) => document.querySelector('[data-testid=command-output]')?.textContent === t",
            arg=text,
            timeout=timeout,
        )
    except Exception:
        got = page.evaluate("() => document.querySelector('[data-testid=command-output]')?.textContent")
        raise AssertionError(f"command output is {got!r}, not {text!r}")


def dom_rows(page):
    return page.evaluate("() => document.querySelectorAll('[data-testid=terminal] .xterm-rows > div').length")


def wait_size(page, ok, timeout=WAIT_MS):
    """Waits for a `stty size` answer ("ROWS COLS" as a whole line) that satisfies
    ok(rows, cols); asks again every few seconds (a resize may land after a question)."""
    deadline = time.time() + timeout / 1000
    asked = time.time()
    seen = []
    while time.time() < deadline:
        seen = [tuple(map(int, l.split())) for l in term_rows(page) if re.fullmatch(r"\d+ \d+", l)]
        for r, c in reversed(seen):
            if ok(r, c):
                return (r, c)
        if time.time() - asked > 4:
            page.locator(tid("terminal")).click()
            page.keyboard.type("clear; stty size\n")
            asked = time.time()
        page.wait_for_timeout(100)
    raise AssertionError(f"no fitting `stty size` answer on the screen (saw {seen}, screen has {dom_rows(page)} rows)")


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        cleanup()
    sys.exit(code)
