"""A follow stream whose connection is cut mid-way resumes by itself, with no byte
lost or repeated: a TCP proxy of the test's own sits between client and server
and cuts connections after a number of bytes (in the middle of an NDJSON line)."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

import pytest

from space_client import AsyncClient, Client, StreamInterrupted

LINES = 300
# Numbered lines on stdout and stderr, over about 3 seconds.
SCRIPT = (
    f"i=0; while [ $i -lt {LINES} ]; do echo \"line $i of the numbered output\"; "
    "[ $((i % 7)) = 0 ] && echo \"err $i\" >&2; i=$((i+1)); [ $((i % 10)) = 0 ] && sleep 0.1; done; true"
)
EXPECTED_OUT = b"".join(b"line %d of the numbered output\n" % i for i in range(LINES))
EXPECTED_ERR = b"".join(b"err %d\n" % i for i in range(LINES) if i % 7 == 0)


class CutProxy:
    """Forwards TCP to the server. Once armed, it cuts the connection carrying the
    bytes from the server after ``cut_after`` of them (counted from arming, and
    again from each cut), ``times`` times: the client gets a partial response and
    then a reset."""

    def __init__(self, target_url: str):
        u = urlsplit(target_url)
        self.host, self.port = u.hostname, u.port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.lock = threading.Lock()
        self.cut_after = 0
        self.cuts_left = 0
        self.count = 0
        self.cuts = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def arm(self, cut_after: int, times: int) -> None:
        with self.lock:
            self.cut_after, self.cuts_left, self.count = cut_after, times, 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_w}

        def cut() -> None:
            writer.transport.abort()
            up_w.transport.abort()

        async def to_server() -> None:
            try:
                while data := await reader.read(65536):
                    up_w.write(data)
                    await up_w.drain()
            except (ConnectionError, OSError):
                pass

        async def to_client() -> None:
            try:
                while data := await up_r.read(65536):
                    with self.lock:
                        room = self.cut_after - self.count if self.cuts_left > 0 else None
                        if room is not None and len(data) >= room:
                            self.cuts_left -= 1
                            self.cuts += 1
                            self.count = 0
                            data, cutting = data[:room], True
                        else:
                            if room is not None:
                                self.count += len(data)
                            cutting = False
                    writer.write(data)
                    await writer.drain()
                    if cutting:
                        await asyncio.sleep(0.05)  # let the partial bytes reach the client
                        cut()
                        return
            except (ConnectionError, OSError):
                pass
            finally:
                cut()

        t = asyncio.ensure_future(to_server())
        await to_client()
        t.cancel()
        self.writers -= {writer, up_w}

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for w in list(self.writers):
                w.transport.abort()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def proxy(server):
    p = CutProxy(server.url)
    yield p
    p.close()


def test_follow_resumes_after_cuts(server, client, proxy):
    with Client(proxy.url, server.token) as pc, client.sandboxes.create(template="busybox") as sb:
        cmd = sb.start(SCRIPT, shell=True)
        pcmd = pc.sandboxes.get(sb.id).commands.get(cmd.id)
        proxy.arm(cut_after=1500, times=4)
        stream = pcmd.output(follow=True)
        chunks = list(stream)
        out = b"".join(c.data for c in chunks if c.stream == "stdout")
        err = b"".join(c.data for c in chunks if c.stream == "stderr")
        assert out == EXPECTED_OUT
        assert err == EXPECTED_ERR
        assert proxy.cuts == 4 and stream.reconnects >= 4
        assert stream.result.exit_code == 0 and pcmd.result.exit_code == 0
        # Offsets of the combined view are contiguous across the reconnects.
        pos = 0
        for c in chunks:
            assert c.offset == pos
            pos = c.end
        # One view alone, resumed from a mid-way offset, through more cuts.
        proxy.arm(cut_after=700, times=3)
        s = pcmd.output(follow=True, stream="stdout", offset=1000)
        assert b"".join(c.data for c in s) == EXPECTED_OUT[1000:] and proxy.cuts == 7


def test_follow_gives_up_after_bounded_retries(server, client, proxy):
    with Client(proxy.url, server.token, max_stream_retries=2) as pc, \
            client.sandboxes.create(template="busybox") as sb:
        cmd = sb.start(["sh", "-c", "echo x; sleep 30"])
        pcmd = pc.sandboxes.get(sb.id).commands.get(cmd.id)
        proxy.arm(cut_after=20, times=1000)  # every response dies in its headers
        with pytest.raises(StreamInterrupted) as e:
            list(pcmd.output(follow=True))
        assert e.value.offset == 0 and e.value.code == "stream_interrupted"
        assert proxy.cuts == 3
        cmd.kill()


async def test_async_follow_resumes_after_cuts(server, aclient, proxy):
    async with AsyncClient(proxy.url, server.token) as pc:
        async with await aclient.sandboxes.create(template="busybox") as sb:
            cmd = await sb.start(SCRIPT, shell=True)
            pcmd = await (await pc.sandboxes.get(sb.id)).commands.get(cmd.id)
            proxy.arm(cut_after=1200, times=3)
            stream = pcmd.output(follow=True, stream="stdout")
            data = b"".join([c.data async for c in stream])
            assert data == EXPECTED_OUT
            assert proxy.cuts == 3 and stream.reconnects >= 3
            assert stream.result.exit_code == 0
