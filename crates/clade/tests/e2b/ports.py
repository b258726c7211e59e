"""A sandbox's ports through E2B's `<port>-<id>.<domain>` host names on clade's envd listener (docs/e2b.md), through
the official Python SDK: a server in the sandbox answers, a closed port and an unknown sandbox are 502 as E2B's
proxy says them, and `allowPublicTraffic: false` needs the sandbox's traffic access token. ct reaches the port
through the sandbox's network namespace, vm through a relay process in the guest. Env as sdk_flow.py."""

import os
import sys
import time
import urllib.parse

import httpx

from e2b import Sandbox

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


a = Sandbox.create(TEMPLATE)
# A server in the sandbox, reached from outside through its host name `<port>-<id>.<domain>` (sent to clade's
# envd listener; the names need no DNS here).
envd = os.environ["E2B_SANDBOX_URL"]
port_of = urllib.parse.urlparse(envd).port
srv = a.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/i.txt && cd /tmp/www && python3 -m http.server 8001",
                     background=True)
got = None
for _ in range(160):
    try:
        got = httpx.get(envd + "/i.txt", headers={"Host": f"8001-{a.sandbox_id}.localhost:{port_of}"}, timeout=5)
        if got.status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.25)
check("a sandbox's port through its host name", got is not None and got.text.strip() == "served", repr(got))
closed = httpx.get(envd + "/", headers={"Host": f"8002-{a.sandbox_id}.localhost:{port_of}"}, timeout=10)
check("a closed port is a 502 'port is not open'", closed.status_code == 502 and "port is not open" in closed.text,
      closed.text[:120])
none = httpx.get(envd + "/", headers={"Host": f"8001-sb-nope.localhost:{port_of}"}, timeout=10)
check("an unknown sandbox is a 502 'was not found'", none.status_code == 502 and "was not found" in none.text)
listed = [" ".join([q.cmd] + q.args) for q in a.commands.list()]
check("the port's relay is not among the sandbox's processes", not any("relay" in c for c in listed), repr(listed))
srv.kill()

# allowPublicTraffic false: its ports answer only with the sandbox's traffic access token.
p = Sandbox.create(TEMPLATE, network={"allow_public_traffic": False})
check("a private sandbox has a traffic access token", bool(p.traffic_access_token))
p.commands.run("cd /tmp && python3 -m http.server 8001", background=True)
host = {"Host": f"8001-{p.sandbox_id}.localhost:{port_of}"}
code = None
for _ in range(160):
    code = httpx.get(envd + "/", headers={**host, "e2b-traffic-access-token": p.traffic_access_token}, timeout=5).status_code
    if code == 200:
        break
    time.sleep(0.25)
check("with its token a private port answers", code == 200, str(code))
check("without it: 403", httpx.get(envd + "/", headers=host, timeout=5).status_code == 403)
wrong = {**host, "e2b-traffic-access-token": "x" + p.traffic_access_token[1:]}
check("with a wrong one: 403", httpx.get(envd + "/", headers=wrong, timeout=5).status_code == 403)
check("another sandbox's port needs none", a.traffic_access_token is None)
p.kill()

a.kill()
print("all passed")
