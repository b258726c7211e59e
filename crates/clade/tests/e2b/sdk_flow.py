"""The official e2b Python SDK against `clade serve --e2b-api/--e2b-sandbox` (env: E2B_API_KEY, E2B_API_URL,
E2B_SANDBOX_URL; E2B_TEMPLATE names the template, e.g. minimal:ct). Prints one line per check; exits non-zero
on the first failure."""

import os
import sys
import time

from e2b import Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")
SKIP = set(os.environ.get("E2B_SKIP", "").split(","))


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f": {detail}" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


t0 = time.monotonic()
sbx = Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "clade", "run": str(os.getpid())})
r = sbx.commands.run("echo hi")
check("create + first command", r.stdout == "hi\n" and r.exit_code == 0, f"{(time.monotonic() - t0) * 1e3:.0f} ms {r!r}")

r = sbx.commands.run("echo out; echo err 1>&2; exit 3", envs={"X": "1"}) if False else None
try:
    sbx.commands.run("echo out; echo err 1>&2; exit 3")
    check("non-zero exit raises", False)
except Exception as e:  # CommandExitException
    check("non-zero exit raises", getattr(e, "exit_code", None) == 3 and "err" in getattr(e, "stderr", ""), repr(e))

r = sbx.commands.run("echo $FOO $PWD", envs={"FOO": "bar"}, cwd="/tmp")
check("envs and cwd", r.stdout.strip() == "bar /tmp", r.stdout)

chunks = []
r = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done", on_stdout=lambda s: chunks.append((time.monotonic(), s)))
spread = chunks[-1][0] - chunks[0][0] if chunks else 0
check("stream output", "".join(c for _, c in chunks) == "line1\nline2\nline3\n" and spread > 0.25, f"{len(chunks)} chunks over {spread:.2f} s")

# Files: write, read, bytes, list, exists, make_dir, rename, remove.
info = sbx.files.write("/tmp/e2b/hello.txt", "hello from the sdk")
check("write file", info.path == "/tmp/e2b/hello.txt", repr(info))
check("read file", sbx.files.read("/tmp/e2b/hello.txt") == "hello from the sdk")
blob = os.urandom(3 << 20)
sbx.files.write("/tmp/e2b/blob.bin", blob)
check("binary round trip 3 MiB", bytes(sbx.files.read("/tmp/e2b/blob.bin", format="bytes")) == blob)
names = sorted(e.name for e in sbx.files.list("/tmp/e2b"))
check("list dir", names == ["blob.bin", "hello.txt"], str(names))
check("exists", sbx.files.exists("/tmp/e2b/hello.txt") and not sbx.files.exists("/tmp/e2b/nope"))
check("make_dir", sbx.files.make_dir("/tmp/e2b/sub") is True and sbx.files.make_dir("/tmp/e2b/sub") is False)
sbx.files.rename("/tmp/e2b/hello.txt", "/tmp/e2b/sub/moved.txt")
check("rename", sbx.files.read("/tmp/e2b/sub/moved.txt") == "hello from the sdk")
sbx.files.remove("/tmp/e2b/sub")
check("remove", not sbx.files.exists("/tmp/e2b/sub"))
try:  # envd removes with os.RemoveAll: a missing path is no error
    sbx.files.remove("/tmp/e2b/never-there")
    check("remove of a missing path is no error", True)
except Exception as e:
    check("remove of a missing path is no error", False, repr(e))
st = sbx.files.get_info("/tmp/e2b/blob.bin")
check("get_info", st.size == len(blob) and st.type.value == "file", repr(st))
try:
    sbx.files.read("/tmp/e2b/missing")
    check("missing file raises NotFound", False)
except NotFoundException:
    check("missing file raises NotFound", True)

# Background command, a cut stream, reattach with connect, kill by pid.
h = sbx.commands.run("for i in $(seq 1 30); do echo tick$i; sleep 0.1; done; echo done", background=True)
pid = h.pid
time.sleep(0.3)
h.disconnect()
procs = [p.pid for p in sbx.commands.list()]
check("process listed after the stream was cut", pid in procs, str(procs))
h2 = sbx.commands.connect(pid)
res = h2.wait()
# (Whether tick1 came before the reattach depends on the guest's speed: under TCG the shell may not have
# printed it within 0.3 s, so only the end is checked.)
check("connect reattaches and sees the end", res.exit_code == 0 and res.stdout.strip().endswith("done"), f"exit {res.exit_code}: {res.stdout[-40:]!r}")
h3 = sbx.commands.run("sleep 60", background=True)
check("kill a command", sbx.commands.kill(h3.pid) is True)
check("kill of a missing pid is False", sbx.commands.kill(999999) is False)

# stdin
h4 = sbx.commands.run("read x; echo got:$x", background=True, stdin=True)
sbx.commands.send_stdin(h4.pid, "abc\n")
check("stdin", h4.wait().stdout.strip() == "got:abc")

# Info, list with metadata, timeout.
inf = sbx.get_info()
check("get_info of sandbox", inf.sandbox_id == sbx.sandbox_id and inf.metadata.get("suite") == "clade", repr(inf))
listed = Sandbox.list(query=__import__("e2b").SandboxQuery(metadata={"run": str(os.getpid())})).next_items()
check("list with metadata filter", [s.sandbox_id for s in listed] == [sbx.sandbox_id], str(listed))
sbx.set_timeout(300)
check("set_timeout", sbx.get_info().end_at.timestamp() - time.time() > 250)

if "pause" not in SKIP:
    sbx.files.write("/tmp/keep.txt", "kept")
    check("pause", sbx.pause() is not False)
    check("paused state", sbx.get_info().state.value == "paused")
    sbx2 = Sandbox.connect(sbx.sandbox_id)
    check("resume by connect keeps files", sbx2.files.read("/tmp/keep.txt") == "kept")
    check("commands after resume", sbx2.commands.run("echo back").stdout == "back\n")

if "fork" not in SKIP:
    sbx.files.write("/tmp/forked.txt", "from parent")
    kids = sbx.fork(count=2) if hasattr(sbx, "fork") else []
    kids = kids if isinstance(kids, list) else [kids]
    check("fork", len(kids) == 2 and all(k.files.read("/tmp/forked.txt") == "from parent" for k in kids))
    kids[0].files.write("/tmp/forked.txt", "changed in kid")
    check("forks are separate", kids[1].files.read("/tmp/forked.txt") == "from parent" and sbx.files.read("/tmp/forked.txt") == "from parent")
    for k in kids:
        k.kill()

if "snapshot" not in SKIP:
    sbx.files.write("/tmp/snap.txt", "snapshotted")
    snap = sbx.create_snapshot()
    check("snapshot", bool(snap.snapshot_id), repr(snap))
    s3 = Sandbox.create(snap.snapshot_id, timeout=60)
    check("create from snapshot", s3.files.read("/tmp/snap.txt") == "snapshotted")
    s3.kill()

# Bad input.
try:
    Sandbox.create("no-such-template-xyz")
    check("unknown template raises", False)
except Exception as e:
    check("unknown template raises", "not found" in str(e).lower() or "404" in str(e), repr(e))
try:
    Sandbox.create(TEMPLATE, api_key="e2b_0000")
    check("wrong key raises AuthenticationException", False)
except AuthenticationException:
    check("wrong key raises AuthenticationException", True)

sid = sbx.sandbox_id
check("kill", sbx.kill() is True)
try:
    sbx.commands.run("echo after kill")
    check("envd of a killed sandbox raises NotFound", False)
except (NotFoundException, SandboxException) as e:
    check("envd of a killed sandbox raises NotFound", isinstance(e, NotFoundException), type(e).__name__ + ": " + str(e)[:120])
check("get_info of killed is NotFound", not any(s.sandbox_id == sid for s in Sandbox.list().next_items()))

# Timeout: a sandbox with a 2 s timeout is gone shortly after.
short = Sandbox.create(TEMPLATE, timeout=2)
time.sleep(4.5)
check("timeout kills", not short.is_running())
print("all passed")
