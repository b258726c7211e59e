"""E2B's network settings through the official Python SDK on a template with egress (ct or vm): `update_network`
(deny_out), `allow_internet_access=False` with `allow_out`, and the rules kept across a pause and resume. The
"internet" is a host in a network namespace the test made (OUTSIDE=addr:port answering `pong`); nothing leaves the
machine. Env as sdk_flow.py, plus OUTSIDE."""

import os
import sys

from e2b import Sandbox
from e2b.exceptions import SandboxException

TEMPLATE = os.environ["E2B_TEMPLATE"]
ADDR, PORT = os.environ["OUTSIDE"].split(":")
PROBE = (
    "python3 -c \"import socket; s = socket.create_connection(('%s', %s), 3); print(s.recv(16).decode())\"" % (ADDR, PORT)
)


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


def reaches(sbx):
    r = sbx.commands.run(PROBE + " 2>&1 || true")
    return "pong" in r.stdout


a = Sandbox.create(TEMPLATE)
check("control: with egress and no rules the outside answers", reaches(a))
a.update_network({"deny_out": [ADDR]})
check("update_network deny_out: refused", not reaches(a))
a.pause()
a = Sandbox.connect(a.sandbox_id)
check("the denial holds after a pause and resume", not reaches(a))
a.update_network({"deny_out": []})
check("cleared: it answers again", reaches(a))
a.kill()

b = Sandbox.create(TEMPLATE, allow_internet_access=False)
check("allow_internet_access=False: nothing answers", not reaches(b))
b.kill()
c = Sandbox.create(TEMPLATE, allow_internet_access=False, network={"allow_out": [ADDR + "/32"]})
check("allow_out wins over the denial of everything", reaches(c))
try:
    c.update_network({"deny_out": ["example.com"]})
    check("a name in the rules is refused", False)
except SandboxException as e:
    check("a name in the rules is refused (400)", str(e).startswith("400") and "IPv4" in str(e), str(e)[:120])
c.kill()
print("all passed")
