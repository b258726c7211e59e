"""E2B's `base` template as clade ships it (templates/e2b-base) through the official Python SDK: commands and
files default to the user `user` in /home/user, as on E2B, and the tools E2B's base image documents are there.
Env as sdk_flow.py; E2B_SUDO=1 also checks passwordless sudo (a vm guest's own; on ct the template turns the
jail's no_new_privs off, docs/security.md), and that a command's envs do not leak into the next one."""

import os
import sys

from e2b import Sandbox

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


sbx = Sandbox.create(TEMPLATE)
r = sbx.commands.run("whoami; pwd; echo $HOME")
check("runs as user in /home/user", r.stdout.split() == ["user", "/home/user", "/home/user"], repr(r.stdout))
root = sbx.commands.run("whoami", user="root")
check("root when asked", root.stdout.strip() == "root", repr(root.stdout))
info = sbx.files.write("note.txt", "relative to the user's home")
check("relative file path is under /home/user", info.path == "/home/user/note.txt", repr(info))
check("the upload belongs to the user", sbx.files.get_info("note.txt").owner == "user")
tools = sbx.commands.run("python --version && python3 -m pip --version && curl --version && git --version && node --version")
check("python (as python), pip, curl, git, node", tools.exit_code == 0, tools.stdout.replace("\n", " | ")[:200])
if os.environ.get("E2B_SUDO") == "1":
    s = sbx.commands.run("sudo -n whoami")
    check("passwordless sudo", s.stdout.strip() == "root", repr(s))
    scoped = sbx.commands.run("echo $FOO", envs={"FOO": "bar"})
    after = sbx.commands.run('sudo echo "$FOO"')
    check("a command's envs are its own", (scoped.stdout.strip(), after.stdout.strip()) == ("bar", ""), repr(after))
sbx.kill()
print("all passed")
