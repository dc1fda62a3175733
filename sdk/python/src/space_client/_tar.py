"""A gzip'd tar of a local directory, produced as a stream of pieces: headers
come from :mod:`tarfile`, file contents are read 1 MiB at a time, so memory
stays small whatever the size of the tree."""

from __future__ import annotations

import os
import tarfile
import zlib
from pathlib import Path
from typing import Iterator

from .errors import InvalidArgument

BLOCK = 512
CHUNK = 1 << 20


def _tar_stream(root: Path) -> Iterator[bytes]:
    helper = tarfile.TarFile.open(fileobj=_Null(), mode="w", format=tarfile.PAX_FORMAT)
    try:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            for name in [None, *sorted(filenames), *[d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]]:
                if name is None:
                    if rel_dir == ".":
                        continue
                    full, arc = dirpath, rel_dir
                else:
                    full = os.path.join(dirpath, name)
                    arc = name if rel_dir == "." else os.path.join(rel_dir, name)
                ti = helper.gettarinfo(full, arcname=arc.replace(os.sep, "/"))
                if ti is None or not (ti.isreg() or ti.isdir() or ti.issym() or ti.islnk()):
                    continue  # sockets, fifos, devices: not sent
                yield ti.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
                if ti.isreg() and not ti.islnk():
                    left = ti.size
                    with open(full, "rb") as f:
                        while left > 0:
                            b = f.read(min(CHUNK, left))
                            if not b:
                                raise InvalidArgument(f"{full} shrank while it was being uploaded")
                            left -= len(b)
                            yield b
                    if ti.size % BLOCK:
                        yield b"\0" * (BLOCK - ti.size % BLOCK)
    finally:
        helper.close()
    yield b"\0" * (2 * BLOCK)


class _Null:
    """Where the helper TarFile (used only for gettarinfo) writes: nowhere."""

    def write(self, b):
        return len(b)

    def tell(self):
        return 0

    def close(self):
        pass


def tar_gz_stream(root: Path) -> Iterator[bytes]:
    z = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: gzip framing
    pending: list[bytes] = []
    size = 0
    for piece in _tar_stream(root):
        out = z.compress(piece)
        if out:
            pending.append(out)
            size += len(out)
        if size >= CHUNK:
            yield b"".join(pending)
            pending, size = [], 0
    pending.append(z.flush())
    yield b"".join(pending)
