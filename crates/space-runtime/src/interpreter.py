"""space's code interpreter, inside a sandbox of the `code-interpreter` template.

Two roles, one file (installed as /opt/space/interpreter.py):

- `serve`: the execution service. It owns the contexts: a Jupyter kernel each for
  Python, a persistent bash for bash. It listens on a Unix socket that only its user
  can reach, and answers one JSON request per connection with NDJSON events.
- `call`: a client. It reads one request from stdin, sends it to the service and
  copies the events to stdout. The host runs it as an ordinary command, so every
  request (every execution) is recorded like any command and can be replayed.

Requests: {"op": "create", "language": "python"|"bash", "cwd": ...},
{"op": "list"}, {"op": "delete", "id": ...}, {"op": "restart", "id": ...},
{"op": "execute", "id": ..., "code": ..., "timeout": seconds}.

Events, one JSON object a line: {"type": "context", ...}, {"type": "contexts", ...},
{"type": "stdout"|"stderr", "text"}, {"type": "result", "is_main_result", "text",
"html", "png", "svg", "jpeg", "json", "markdown", "latex", "javascript", "pdf"},
{"type": "error", "name", "value", "traceback"}, {"type": "end", "execution_count",
"duration_ms"}, and {"type": "failed", "code", "message"} for a request that cannot
be served.

The client imports nothing from Jupyter: it starts in a few milliseconds.
"""

import json
import os
import socket
import sys
import time

# The client exits with this when the service is not running (the host starts it).
NOT_RUNNING = 75


def socket_dir():
    return "/tmp/.space-interpreter-%d" % os.getuid()


def socket_path():
    return os.path.join(socket_dir(), "sock")


def call(wait_seconds):
    request = sys.stdin.buffer.read()
    deadline = time.monotonic() + wait_seconds
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(socket_path())
            break
        except OSError:
            s.close()
            if time.monotonic() >= deadline:
                return NOT_RUNNING
            time.sleep(0.05)
    s.sendall(request.rstrip(b"\n") + b"\n")
    s.shutdown(socket.SHUT_WR)
    out = sys.stdout.buffer
    while True:
        data = s.recv(1 << 16)
        if not data:
            break
        out.write(data)
        out.flush()
    return 0


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
        env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        await self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)
        # Figures show as results of the cell, as in a notebook.
        await self.run_quiet("%matplotlib inline")

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

    async def execute(self, code, timeout, emit):
        import asyncio

        msg_id = self.kc.execute(code, allow_stdin=False)
        deadline = time.monotonic() + timeout
        timed_out = False
        count = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and not timed_out:
                timed_out = True
                await self.km.interrupt_kernel()
                deadline = time.monotonic() + 30
                continue
            if left <= 0:
                # An interrupt that did not take: the kernel is restarted, its state lost.
                await self.km.restart_kernel(now=True)
                self.kc.stop_channels()
                self.kc = self.km.client()
                self.kc.start_channels()
                await self.kc.wait_for_ready(timeout=60)
                await self.run_quiet("%matplotlib inline")
                break
            try:
                msg = await self.kc.get_iopub_msg(timeout=min(left, 1.0))
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

    async def execute(self, code, timeout, emit):
        import asyncio

        if self.proc.returncode is not None:
            await self.start()
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
        done, _ = await asyncio.wait(tasks, timeout=timeout)
        if len(done) < 2:
            # Interrupt what runs; if bash itself does not come back, start a new one.
            try:
                os.killpg(self.proc.pid, 2)
            except OSError:
                pass
            done, _ = await asyncio.wait(tasks, timeout=5)
            if len(done) < 2:
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


class Service:
    def __init__(self):
        self.contexts = {}
        self.next = 0

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
        import secrets

        language = request.get("language") or "python"
        cwd = request.get("cwd") or os.path.expanduser("~")
        if not os.path.isdir(cwd):
            raise Failed("invalid_request", "cwd %s is not a directory" % cwd)
        kinds = {"python": PythonContext, "bash": BashContext}
        if language not in kinds:
            raise Failed("invalid_request", "language must be python or bash, not %s" % language)
        ctx = kinds[language]("ctx_" + secrets.token_hex(8), cwd)
        try:
            await ctx.start()
        except Exception as e:
            await ctx.stop()
            raise Failed("internal", "cannot start the %s context: %s" % (language, e))
        self.contexts[ctx.id] = ctx
        emit(dict(self.describe(ctx), type="context"))

    async def serve_one(self, reader, writer):
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
                ctx = self.context(request)
                timeout = float(request.get("timeout") or 300)
                async with ctx.lock:
                    started = time.monotonic()
                    count = await ctx.execute(str(request.get("code", "")), timeout, emit)
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

    os.makedirs(socket_dir(), mode=0o700, exist_ok=True)
    lock = open(os.path.join(socket_dir(), "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another service is running
    try:
        os.unlink(socket_path())
    except FileNotFoundError:
        pass
    service = Service()

    async def main():
        server = await asyncio.start_unix_server(service.serve_one, path=socket_path(), limit=1 << 26)
        os.chmod(socket_path(), 0o600)
        async with server:
            await server.serve_forever()

    asyncio.run(main())
    return 0


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role == "call":
        sys.exit(call(float(sys.argv[2]) if len(sys.argv) > 2 else 0))
    if role == "serve":
        sys.exit(serve())
    sys.stderr.write("usage: interpreter.py call [WAIT_SECONDS] | serve\n")
    sys.exit(2)
