"""Sandbox.create() to the first commands.run('echo hi') result through the e2b SDK, N times; prints one JSON
line of milliseconds (each sandbox is killed after, outside the timing)."""
import json, os, sys, time
from e2b import Sandbox

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
template = os.environ.get("E2B_TEMPLATE", "base")
Sandbox.create(template).kill()  # warm the SDK's imports and connection pools
ms = []
for _ in range(n):
    t = time.perf_counter()
    s = Sandbox.create(template, timeout=60)
    r = s.commands.run("echo hi")
    ms.append((time.perf_counter() - t) * 1e3)
    assert r.stdout == "hi\n", r
    s.kill()
print(json.dumps({"ms": ms}))
