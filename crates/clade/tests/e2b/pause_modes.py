"""E2B's pause and snapshot modes through the official Python SDK (docs/e2b.md, "Filesystem-only pause"): a full
pause keeps the boot (same boot id) and the processes; a filesystem-only pause, the timeout's filesystem-only
auto-pause and a filesystem-only snapshot keep the files and boot cold (a new boot id, no process of before);
`connect(on_resume="reboot")` boots the files of a full pause cold. Env as sdk_flow.py; HOME_DIR is where the
template's default user may write (default /home/user)."""

import os
import sys
import time

from e2b import Sandbox, SandboxState

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")
HOME = os.environ.get("HOME_DIR", "/home/user")
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


def sleeper_running(sbx):
    # No pgrep in every template: the command lines in /proc.
    r = sbx.commands.run(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 4242' || true")
    return r.stdout.strip() != "0"


def start_sleeper(sbx):
    sbx.commands.run("sleep 4242", background=True)
    for _ in range(40):
        if sleeper_running(sbx):
            return
        time.sleep(0.05)
    check("a background process runs", False)


# A full pause: the same boot, its processes go on.
s = Sandbox.create(TEMPLATE)
boot = s.files.read(BOOT_ID).strip()
check("a sandbox has a boot id of its own", len(boot) == 36, repr(boot))
start_sleeper(s)
s.files.write(f"{HOME}/full.txt", "full")
w = s.files.watch_dir(HOME)
check("full pause", s.pause())
check("paused", not s.is_running())
r = s.connect()
check("full resume: the same boot", r.files.read(BOOT_ID).strip() == boot)
check("full resume: its processes", sleeper_running(r))
r.files.write(f"{HOME}/after-resume.txt", "w")
evs = [(e.name, e.type.name) for e in w.get_new_events()]
check("a watch goes on across a whole pause", ("after-resume.txt", "CREATE") in evs, repr(evs))
w.stop()
# A full pause resumed with on_resume="reboot": its files, a cold boot.
s.files.write(f"{HOME}/before-reboot.txt", "kept")
# A reboot starts from the disk: on vm, what the guest had not flushed yet is lost (as E2B says of "reboot").
s.commands.run("sync")
check("full pause again", s.pause())
r = s.connect(on_resume="reboot")
check("reboot: the files persist", r.files.read(f"{HOME}/before-reboot.txt").strip() == "kept")
reboot_boot = r.files.read(BOOT_ID).strip()
check("reboot: a new boot id", reboot_boot != boot and len(reboot_boot) == 36, f"{boot} -> {reboot_boot}")
check("reboot: no process of before", not sleeper_running(r))
boot = reboot_boot
start_sleeper(r)

# A filesystem-only pause: the files, a cold boot.
s.files.write(f"{HOME}/fs-only-marker.txt", "persisted")
check("filesystem-only pause", s.pause(mode="filesystem"))
check("paused (filesystem only)", not s.is_running())
r = s.connect()
check("same sandbox", r.sandbox_id == s.sandbox_id)
check("the files persist", r.files.read(f"{HOME}/fs-only-marker.txt").strip() == "persisted")
check("and the earlier ones", r.files.read(f"{HOME}/full.txt").strip() == "full")
fs_boot = r.files.read(BOOT_ID).strip()
check("a cold boot: a new boot id", fs_boot != boot and len(fs_boot) == 36, f"{boot} -> {fs_boot}")
check("no process of before", not sleeper_running(r))
check("commands run after the cold boot", r.commands.run("echo up").stdout.strip() == "up")

# A filesystem-only snapshot: sandboxes made from it boot cold with its files; the source goes on.
start_sleeper(r)
r.files.write(f"{HOME}/snap.txt", "snapped")
snap = r.create_snapshot(mode="filesystem")
check("the source goes on after the snapshot", sleeper_running(r))
child = Sandbox.create(snap.snapshot_id)
check("the snapshot's files", child.files.read(f"{HOME}/snap.txt").strip() == "snapped")
check("a cold boot from the snapshot", child.files.read(BOOT_ID).strip() != fs_boot)
check("no process of the source", not sleeper_running(child))
child.kill()
r.kill()

# The timeout's filesystem-only auto-pause.
a = Sandbox.create(TEMPLATE, timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
a.files.write(f"{HOME}/auto.txt", "auto")
a_boot = a.files.read(BOOT_ID).strip()
state = None
for _ in range(60):
    state = a.get_info().state
    if state == SandboxState.PAUSED:
        break
    time.sleep(0.5)
check("auto-paused at its timeout", state == SandboxState.PAUSED, repr(state))
b = a.connect()
check("auto-pause: the files persist", b.files.read(f"{HOME}/auto.txt").strip() == "auto")
check("auto-pause: a cold boot", b.files.read(BOOT_ID).strip() != a_boot)
b.kill()
print("pause modes: all passed", flush=True)
