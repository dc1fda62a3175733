"""The local side of the interpreter bench: a Jupyter kernel on the host, driven by
jupyter_client, doing what the bench does in a sandbox.

Usage: local_kernel.py CELLS. Prints one JSON object: cold_ms (kernel start to the
result of `1+1`) and cells_ms (each `x += 1`, request to idle).
Run with Debian's python3 (python3-ipykernel, python3-jupyter-client).
"""

import json
import sys
import time

from jupyter_client.manager import KernelManager


def run(kc, code):
    msg_id = kc.execute(code)
    result = None
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "execute_result":
            result = msg["content"]["data"].get("text/plain")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return result


def main():
    cells = int(sys.argv[1])
    start = time.monotonic()
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    got = run(kc, "1+1")
    cold = (time.monotonic() - start) * 1000
    assert got == "2", got
    run(kc, "x = 0")
    times = []
    for _ in range(cells):
        t = time.monotonic()
        run(kc, "x += 1")
        times.append((time.monotonic() - t) * 1000)
    assert run(kc, "x") == str(cells)
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    print(json.dumps({"cold_ms": cold, "cells_ms": times}))


main()
