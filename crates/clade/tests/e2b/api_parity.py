"""E2B control-plane and process behaviours through the official Python SDK (docs/e2b.md): list filters (order,
started_after, template), metrics, Template.exists, a command's timeout ending its stream, a PTY reattached after
a disconnect, a command's error when its sandbox is killed under it, sudo, and /proc files read whole (ports:
ports.py). Env as sdk_flow.py."""

import asyncio
import os
import sys
import time
import uuid
from datetime import timedelta

from e2b import AsyncSandbox, Sandbox, SandboxQuery, Template, TimeoutException
from e2b.sandbox.commands.command_handle import PtySize

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


tag = {"parity": uuid.uuid4().hex}
a = Sandbox.create(TEMPLATE, metadata=tag)
time.sleep(0.05)
b = Sandbox.create(TEMPLATE, metadata=tag)
q = SandboxQuery(metadata=tag)
asc = [s.sandbox_id for s in Sandbox.list(query=q, order="asc").next_items()]
desc = [s.sandbox_id for s in Sandbox.list(query=q, order="desc").next_items()]
check("list order asc / desc", asc == [a.sandbox_id, b.sandbox_id] and desc == asc[::-1], f"{asc} {desc}")
started = b.get_info().started_at
later = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag, started_after=started)).next_items()]
check("list started_after", later == [b.sandbox_id], repr(later))
none = Sandbox.list(query=SandboxQuery(metadata=tag, started_after=started + timedelta(seconds=2))).next_items()
check("list started_after a later time", none == [], repr(none))
tpl = a.get_info().template_id
same = Sandbox.list(query=SandboxQuery(metadata=tag, template=tpl)).next_items()
other = Sandbox.list(query=SandboxQuery(metadata=tag, template="no-such-template")).next_items()
check("list template filter", len(same) == 2 and other == [], f"{tpl} {len(same)} {len(other)}")

m = a.get_metrics()
check("metrics: one entry measured now", len(m) == 1 and m[0].mem_used > 0 and m[0].disk_total > 0, repr(m))
check("metrics: cpu within 0..100", 0 <= m[0].cpu_used_pct <= 100 and m[0].cpu_count >= 1, repr(m[0]))
old = a.get_metrics(start=m[0].timestamp - timedelta(hours=2), end=m[0].timestamp - timedelta(hours=1))
check("metrics: none before the sandbox", old == [], repr(old))

check("Template.exists('base')", Template.exists("base") is True)
check("Template.exists of an unknown name", Template.exists(f"nope-{uuid.uuid4().hex}") is False)

boot = a.files.read("/proc/sys/kernel/random/boot_id").strip()
check("a /proc file reads whole", len(boot) == 36, repr(boot))
r = a.commands.run("sudo -n whoami")
check("sudo as user", r.stdout.strip() == "root", repr(r))

# A PTY, left and reattached: its output keeps coming as PTY data.
out = []
term = a.pty.create(PtySize(24, 80), envs={"FOO": "bar"})
a.pty.send_stdin(term.pid, b"echo one-$FOO\n")
term.disconnect()
again = a.pty.connect(term.pid)
a.pty.send_stdin(term.pid, b"echo two-$FOO\nexit\n")
res = again.wait(on_pty=lambda d: out.append(d.decode(errors="replace")))
check("a reattached PTY streams its output", "two-bar" in "".join(out) and res.exit_code == 0, repr("".join(out)))


async def async_checks():
    s = await AsyncSandbox.connect(b.sandbox_id)
    t = time.monotonic()
    try:
        await s.commands.run("sleep 10", timeout=1)
        check("a command's timeout ends it", False, "no TimeoutException")
    except TimeoutException:
        check("a command's timeout ends its stream", time.monotonic() - t < 8, f"{time.monotonic() - t:.1f} s")
    cmd = await s.commands.run("sleep 60", background=True)
    await s.kill()
    try:
        await cmd.wait()
        check("a kill under a command is an error", False)
    except Exception as e:  # noqa: BLE001 - the SDK's own message is what is checked
        check("a kill under a command says so", "killed or reached its end of life" in str(e), str(e)[:200])


asyncio.run(async_checks())
a.kill()
print("all passed")
