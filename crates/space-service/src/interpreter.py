"""space's code interpreter, inside a sandbox of the `code-interpreter` template.

The execution service. The server sends this file on the stdin of the command that
runs it (`python3 -I -c <bootstrap> serve`, see interpreter.rs), so it always matches
the server. It owns the contexts: a Jupyter kernel each for Python, a persistent bash
for bash. It listens on a Unix socket that only its user can reach, and answers one
JSON request per connection with NDJSON events. Its clients are commands of their
own (`space-agent relay`), so every request, every execution, is recorded like any
command and can be replayed.

Requests: {"op": "create", "language": "python"|"bash", "cwd": ...},
{"op": "list"}, {"op": "delete", "id": ...}, {"op": "restart", "id": ...},
{"op": "execute", "id": ... | "language": ..., "code": ..., "timeout": seconds,
"env": {...}}. An execution without an id runs in the language's default context,
made on first use.

Events, one JSON object a line: {"type": "context", ...}, {"type": "contexts", ...},
{"type": "stdout"|"stderr", "text"}, {"type": "result", "is_main_result", "text",
"html", "png", "svg", "jpeg", "json", "markdown", "latex", "javascript", "pdf"},
{"type": "error", "name", "value", "traceback"}, {"type": "end", "execution_count",
"duration_ms"}, and {"type": "failed", "code", "message"} for a request that cannot
be served. An execution starts with {"type": "accepted", "id"} once its context is
known, before it waits for the context's previous execution to finish.

A client that closes its connection during an execution has gone away: the execution
is interrupted.
"""

import json
import os
import sys
import time

# Where the service listens (interpreter.rs's SOCKET): a directory only its user enters.
SOCKET_DIR = "/tmp/.space-interpreter"
SOCKET = SOCKET_DIR + "/sock"
# An execution that is interrupted (past its timeout, or its client gone) is interrupted
# again every INTERRUPT_EVERY seconds until it ends: an interrupt that lands before the
# code started is spent on the kernel's own handler (bash's trap, an idle ipykernel), and
# the code would then run on. Past INTERRUPT_GRACE the context is restarted, its state lost.
INTERRUPT_EVERY = 1.0
INTERRUPT_GRACE = 30.0


# ---- the service ----

MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def result_event(data, main):
    event = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        key = MIME.get(mime)
        if key is None:
            extra[mime] = value
        else:
            if key in ("svg", "html", "markdown", "latex", "text") and isinstance(value, list):
                value = "".join(value)
            event[key] = value
    if extra:
        event["extra"] = extra
    return event


class Failed(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


class PythonContext:
    language = "python"

    def __init__(self, cid, cwd):
        self.id = cid
        self.cwd = cwd
        self.km = None
        self.kc = None
        self.count = 0
        self.lock = None

    async def start(self):
        from jupyter_client.manager import AsyncKernelManager

        self.km = AsyncKernelManager(kernel_name="python3")
        env = dict(os.environ)
        # Figures show as results of their cell, as in a notebook: the inline backend
        # hooks itself in when pyplot first loads it (no `%matplotlib inline`, which
        # would import matplotlib, a second under gVisor, into every new kernel).
        env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        await self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)

    async def run_quiet(self, code):
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        while True:
            msg = await self.kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return

    async def stop(self):
        if self.kc is not None:
            self.kc.stop_channels()
        if self.km is not None:
            await self.km.shutdown_kernel(now=True)

    async def execute(self, code, timeout, emit, env, abandoned):
        import asyncio

        if env:
            # Only for this execution: set now, put back after.
            await self.run_quiet(
                "import os as _space_os\n"
                "_space_saved = {k: _space_os.environ.get(k) for k in %r}\n"
                "_space_os.environ.update(%r)" % (list(env), env)
            )
        try:
            return await self.execute_cell(code, timeout, emit, abandoned)
        finally:
            if env:
                await self.run_quiet(
                    "for _k, _v in _space_saved.items():\n"
                    "    if _v is None: _space_os.environ.pop(_k, None)\n"
                    "    else: _space_os.environ[_k] = _v\n"
                    "del _space_saved, _k, _v"
                )

    async def execute_cell(self, code, timeout, emit, abandoned):
        import asyncio

        msg_id = self.kc.execute(code, allow_stdin=False)
        deadline = time.monotonic() + timeout
        timed_out = False
        next_interrupt = None
        count = None
        while True:
            left = deadline - time.monotonic()
            if abandoned.is_set() and not timed_out:
                left = 0
            if left <= 0 and not timed_out:
                timed_out = True
                await self.km.interrupt_kernel()
                next_interrupt = time.monotonic() + INTERRUPT_EVERY
                deadline = time.monotonic() + INTERRUPT_GRACE
                continue
            if timed_out and left > 0 and time.monotonic() >= next_interrupt:
                await self.km.interrupt_kernel()
                next_interrupt = time.monotonic() + INTERRUPT_EVERY
            if left <= 0:
                # An interrupt that did not take: the kernel is restarted, its state lost.
                await self.km.restart_kernel(now=True)
                self.kc.stop_channels()
                self.kc = self.km.client()
                self.kc.start_channels()
                await self.kc.wait_for_ready(timeout=60)
                break
            try:
                msg = await self.kc.get_iopub_msg(timeout=min(left, INTERRUPT_EVERY))
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                emit({"type": content["name"], "text": content["text"]})
            elif kind in ("execute_result", "display_data"):
                emit(result_event(content["data"], kind == "execute_result"))
            elif kind == "error" and not timed_out:
                emit(
                    {
                        "type": "error",
                        "name": content["ename"],
                        "value": content["evalue"],
                        "traceback": "\n".join(content["traceback"]),
                    }
                )
            elif kind == "execute_input":
                count = content.get("execution_count")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        if timed_out:
            emit(
                {
                    "type": "error",
                    "name": "TimeoutError",
                    "value": "the execution ran past its timeout of %gs and was interrupted" % timeout,
                    "traceback": "",
                }
            )
        if count is not None:
            self.count = count
        return self.count


class BashContext:
    """A persistent bash: variables, functions and the working directory carry over."""

    language = "bash"

    def __init__(self, cid, cwd):
        self.id = cid
        self.cwd = cwd
        self.proc = None
        self.count = 0
        self.lock = None

    async def start(self):
        import asyncio

        self.proc = await asyncio.create_subprocess_exec(
            "bash",
            "--noprofile",
            "--norc",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.cwd,
            start_new_session=True,
        )
        # A handler, not an ignore: what bash runs gets the default action back, so an
        # interrupt stops the running program and bash goes on to the next line.
        self.proc.stdin.write(b"trap : INT\n")

    async def stop(self):
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass
            await self.proc.wait()

    async def execute(self, code, timeout, emit, env, abandoned):
        import asyncio
        import shlex

        if self.proc.returncode is not None:
            await self.start()
        if env:
            # Only for this execution: a subshell would lose what the code sets, so the
            # variables are exported, and unset or put back after.
            saved = "".join(
                "_space_had_%d=${%s+x}; _space_old_%d=${%s-}; " % (i, k, i, k) for i, k in enumerate(env)
            )
            sets = "".join("export %s=%s; " % (k, shlex.quote(v)) for k, v in env.items())
            back = "".join(
                "if [ -n \"$_space_had_%d\" ]; then %s=$_space_old_%d; else unset %s; fi; " % (i, k, i, k)
                for i, k in enumerate(env)
            )
            code = saved + sets + "\n" + code + "\n__space_rc=$?; " + back + "(exit $__space_rc)"
        self.count += 1
        marker = "__space_end_%d_%d__" % (os.getpid(), self.count)
        script = "%s\n__space_rc=$?; printf '\\n%s %%d\\n' $__space_rc; printf '\\n%s\\n' >&2\n" % (
            code,
            marker,
            marker,
        )
        self.proc.stdin.write(script.encode())
        await self.proc.stdin.drain()
        rc = None

        async def pump(stream, name):
            nonlocal rc
            pending = b""
            while True:
                line = await stream.readline()
                if not line:
                    return
                text = line.decode(errors="replace")
                if text.startswith(marker):
                    if name == "stdout":
                        rc = int(text.split()[1])
                    # The newline printed before the marker belongs to it.
                    if pending not in (b"", b"\n"):
                        emit({"type": name, "text": pending[:-1].decode(errors="replace")})
                    return
                if pending:
                    emit({"type": name, "text": pending.decode(errors="replace")})
                pending = line

        tasks = [
            asyncio.ensure_future(pump(self.proc.stdout, "stdout")),
            asyncio.ensure_future(pump(self.proc.stderr, "stderr")),
        ]
        deadline = time.monotonic() + timeout
        gone = asyncio.ensure_future(abandoned.wait())
        pending = set(tasks)
        while pending and not gone.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(pending | {gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending = {t for t in tasks if not t.done()}
        gone.cancel()
        if pending:
            # Interrupt what runs, again and again (INTERRUPT_EVERY); if bash itself does
            # not come back, start a new one.
            grace = time.monotonic() + INTERRUPT_GRACE
            while pending and time.monotonic() < grace:
                try:
                    os.killpg(self.proc.pid, 2)
                except OSError:
                    break
                await asyncio.wait(pending, timeout=INTERRUPT_EVERY)
                pending = {t for t in tasks if not t.done()}
            if pending:
                for t in tasks:
                    t.cancel()
                await self.stop()
                await self.start()
            emit(
                {
                    "type": "error",
                    "name": "TimeoutError",
                    "value": "the execution ran past its timeout of %gs and was interrupted" % timeout,
                    "traceback": "",
                }
            )
        elif rc:
            emit({"type": "error", "name": "ExitCode", "value": str(rc), "traceback": ""})
        return self.count


def valid_env(env):
    """An execution's variables: names a shell accepts, string values."""
    import re

    if env is None:
        return {}
    if not isinstance(env, dict):
        raise Failed("invalid_request", "env must be an object of strings")
    for k, v in env.items():
        if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise Failed("invalid_request", "env: %r is not a variable name with a string value" % (k,))
    return env


class Service:
    def __init__(self):
        self.contexts = {}
        # The context an execution without an id runs in, by language.
        self.defaults = {}

    def describe(self, ctx):
        return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}

    def context(self, request):
        import asyncio

        ctx = self.contexts.get(request.get("id"))
        if ctx is None:
            raise Failed("not_found", "no context %s" % request.get("id"))
        if ctx.lock is None:
            # One request at a time per context: executions share the kernel's channels.
            ctx.lock = asyncio.Lock()
        return ctx

    async def create(self, request, emit):
        ctx = await self.make(request.get("language") or "python", request.get("cwd"))
        emit(dict(self.describe(ctx), type="context"))

    async def make(self, language, cwd):
        import secrets

        cwd = cwd or os.path.expanduser("~")
        if not os.path.isdir(cwd):
            raise Failed("invalid_request", "cwd %s is not a directory" % cwd)
        kinds = {"python": PythonContext, "bash": BashContext}
        if language not in kinds:
            raise Failed("invalid_request", "language must be python or bash, not %s" % language)
        ctx = kinds[language]("ctx_" + secrets.token_hex(8), cwd)
        try:
            await ctx.start()
        except ImportError as e:
            await ctx.stop()
            raise Failed(
                "unavailable",
                "this sandbox has no Jupyter kernel (%s): create it from the code-interpreter template" % e,
            )
        except Exception as e:
            await ctx.stop()
            raise Failed("internal", "cannot start the %s context: %s" % (language, e))
        self.contexts[ctx.id] = ctx
        return ctx

    async def default(self, language, cwd):
        import asyncio

        # One maker at a time, so two first executions share one default context.
        if not hasattr(self, "making"):
            self.making = asyncio.Lock()
        async with self.making:
            ctx = self.contexts.get(self.defaults.get(language))
            if ctx is None:
                ctx = await self.make(language, cwd)
                self.defaults[language] = ctx.id
        return self.context({"id": ctx.id})

    async def serve_one(self, reader, writer):
        import asyncio

        def emit(event):
            writer.write(json.dumps(event).encode() + b"\n")

        try:
            line = await reader.readline()
            request = json.loads(line)
            op = request.get("op")
            if op == "create":
                await self.create(request, emit)
            elif op == "list":
                emit({"type": "contexts", "contexts": [self.describe(c) for c in self.contexts.values()]})
            elif op == "delete":
                ctx = self.context(request)
                async with ctx.lock:
                    self.contexts.pop(ctx.id, None)
                    await ctx.stop()
                emit(dict(self.describe(ctx), type="context"))
            elif op == "restart":
                ctx = self.context(request)
                async with ctx.lock:
                    await ctx.stop()
                    await ctx.start()
                    ctx.count = 0
                emit(dict(self.describe(ctx), type="context"))
            elif op == "execute":
                if request.get("id"):
                    ctx = self.context(request)
                else:
                    ctx = await self.default(request.get("language") or "python", request.get("cwd"))
                timeout = float(request.get("timeout") or 300)
                env = valid_env(request.get("env"))
                abandoned = asyncio.Event()

                async def watch():
                    # The client sends nothing more: end of file means it is gone.
                    await reader.read()
                    abandoned.set()

                watcher = asyncio.ensure_future(watch())
                # Known context, valid request: the caller may start its stream.
                emit({"type": "accepted", "id": ctx.id})
                await writer.drain()
                async with ctx.lock:
                    started = time.monotonic()
                    try:
                        count = await ctx.execute(str(request.get("code", "")), timeout, emit, env, abandoned)
                    finally:
                        watcher.cancel()
                emit(
                    {
                        "type": "end",
                        "execution_count": count,
                        "duration_ms": int((time.monotonic() - started) * 1000),
                    }
                )
            else:
                raise Failed("invalid_request", "unknown op %r" % (op,))
        except Failed as e:
            emit({"type": "failed", "code": e.code, "message": e.message})
        except Exception as e:
            emit({"type": "failed", "code": "internal", "message": "%s: %s" % (type(e).__name__, e)})
        try:
            await writer.drain()
            writer.close()
        except Exception:
            pass


def serve():
    import asyncio
    import fcntl
    import signal

    # Started where SIGINT is ignored (`&` in a script), the contexts would inherit that
    # and no interrupt would reach them: a handler here gives them the default again.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    os.makedirs(SOCKET_DIR, mode=0o700, exist_ok=True)
    lock = open(os.path.join(SOCKET_DIR, "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another service is running
    try:
        os.unlink(SOCKET)
    except FileNotFoundError:
        pass
    service = Service()

    async def main():
        server = await asyncio.start_unix_server(service.serve_one, path=SOCKET, limit=1 << 26)
        os.chmod(SOCKET, 0o600)
        async with server:
            await server.serve_forever()

    asyncio.run(main())
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        sys.exit(serve())
    sys.stderr.write("usage: interpreter.py serve\n")
    sys.exit(2)
