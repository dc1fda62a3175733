"""The Python E2B SDK side of benches/e2b.rs: makes one sandbox with
Sandbox.create(), prints its id, then times `commands.run("true")` in the
batches it is asked for on stdin ("run N"), printing each batch's seconds as
JSON. Leaves the sandbox to the bench, which destroys it."""

import json
import sys
import time

from e2b import Sandbox

sbx = Sandbox.create(template="base", timeout=3600)
print(json.dumps({"sandbox": sbx.sandbox_id}), flush=True)
for line in sys.stdin:
    words = line.split()
    if not words:
        continue
    if words[0] != "run":
        raise SystemExit(f"unknown request {line!r}")
    times = []
    for _ in range(int(words[1])):
        t0 = time.perf_counter()
        r = sbx.commands.run("true")
        times.append(time.perf_counter() - t0)
        assert r.exit_code == 0, r
    print(json.dumps({"times": times}), flush=True)
