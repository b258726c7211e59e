# The escape probes of guest_jail.rs, run inside a ct sandbox by its python3. Each probe tries one known way
# out of a container and prints the errno it got (0: it worked, i.e. the escape is open). Probes whose escape
# would change the host stop at the first step that proves it open (a mount is unmounted at once, a file
# opened for writing is closed without a write, the time zone is set to the value it has).
# argv: BLOCK_MAJOR BLOCK_MINOR OTHER_PID FORK_COUNT
import ctypes, ctypes.util, errno, json, os, sys, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}


def err_of(r):
    return 0 if r >= 0 else ctypes.get_errno()


def sc(nr, *args):
    return err_of(libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]))


def try_open(path, flags):
    try:
        os.close(os.open(path, flags))
        return 0
    except OSError as e:
        return e.errno


def mount(name, src, target, fstype, data):
    os.makedirs(target, exist_ok=True)
    r = libc.mount(src.encode(), target.encode(), fstype.encode(), 0, data.encode() if data else None)
    e = err_of(r)
    if e == 0:
        if name == "cgroup_mount":
            # CVE-2022-0492: the root of a v1 hierarchy has release_agent; writable is the escape.
            out["release_agent"] = 0 if os.access(os.path.join(target, "release_agent"), os.W_OK) else errno.EACCES
        libc.umount2(target.encode(), 2)
    out[name] = e


# status: the jail as the kernel reports it for this process
for line in open("/proc/self/status"):
    k, _, v = line.partition(":")
    if k in ("CapBnd", "CapEff", "CapPrm", "CapInh", "Seccomp", "NoNewPrivs"):
        out["status_" + k] = v.strip()
out["uid_map"] = open("/proc/self/uid_map").read().split()
out["cgroup"] = open("/proc/self/cgroup").read().strip()

mount("devtmpfs_mount", "none", "/tmp/probe-dev", "devtmpfs", None)
mount("cgroup_mount", "none", "/tmp/probe-cg", "cgroup", "memory")
mount("proc_mount", "proc", "/tmp/probe-proc", "proc", None)
out.setdefault("release_agent", errno.EPERM)

# mknod + open of the host's block device
dev = os.makedev(int(sys.argv[1]), int(sys.argv[2]))
if os.path.lexists("/tmp/probe-blk"):
    os.unlink("/tmp/probe-blk")  # an earlier probe's, in the mark this sandbox came from
try:
    os.mknod("/tmp/probe-blk", 0o600 | 0o060000, dev)
    out["mknod"] = 0
except OSError as e:
    out["mknod"] = e.errno
out["blockdev_open"] = try_open("/tmp/probe-blk", os.O_RDONLY) if out["mknod"] == 0 else out["mknod"]

# open_by_handle_at(mount_fd, handle, flags): CAP_DAC_READ_SEARCH decides before the handle is decoded
handle = (ctypes.c_ubyte * 16)()
ctypes.memmove(handle, (ctypes.c_uint32 * 2)(8, 1), 8)
root = os.open("/", os.O_RDONLY)
out["open_by_handle_at"] = sc(304, root, handle, os.O_RDONLY)
os.close(root)

# non-namespaced sysctls, sysrq, /sys
out["core_pattern"] = try_open("/proc/sys/kernel/core_pattern", os.O_WRONLY)
out["sysctl_vm"] = try_open("/proc/sys/vm/drop_caches", os.O_WRONLY)
out["sysrq_trigger"] = try_open("/proc/sysrq-trigger", os.O_WRONLY)
out["sys_write"] = try_open("/sys/kernel/mm/ksm/run", os.O_WRONLY)

# masked paths: readable content is the leak
def content(path):
    try:
        with open(path, "rb") as f:
            return len(f.read(64))
    except OSError as e:
        return -e.errno
out["kcore_bytes"] = content("/proc/kcore")
out["timer_list_bytes"] = content("/proc/timer_list")
out["sys_firmware_entries"] = len(os.listdir("/sys/firmware")) if os.path.isdir("/sys/firmware") else 0

# clock: settimeofday(NULL, tz) needs CAP_SYS_TIME and sets only the kernel's time zone (to what it is)
tz = (ctypes.c_int * 2)()
libc.gettimeofday(None, tz)
out["settimeofday"] = err_of(libc.settimeofday(None, tz))
timex = (ctypes.c_ubyte * 256)()  # struct timex, modes = 0: a read
out["adjtimex"] = sc(159, timex)

# module loading, bpf, keyctl, perf, io_uring, userfaultfd, namespaces
out["init_module"] = sc(175, 0, 0, ctypes.c_char_p(b""))
out["finit_module"] = sc(313, -1, ctypes.c_char_p(b""), 0)
attr = (ctypes.c_ubyte * 128)()
out["bpf"] = sc(321, 0, attr, 72)
out["keyctl"] = sc(250, 0, -3, 0)
out["perf_event_open"] = sc(298, 0, 0, -1, -1, 0)
params = (ctypes.c_ubyte * 120)()
r = libc.syscall(ctypes.c_long(425), ctypes.c_long(1), params)
out["io_uring_setup"] = err_of(r)
if r >= 0:
    os.close(r)
r = libc.syscall(ctypes.c_long(323), ctypes.c_long(0))
out["userfaultfd"] = err_of(r)
if r >= 0:
    os.close(r)
pid = os.fork()
if pid == 0:
    os._exit(0 if libc.unshare(0x10000000 | 0x20000) == 0 else ctypes.get_errno())
out["unshare"] = os.waitpid(pid, 0)[1] >> 8

# AF_VSOCK: the host's vsock services (a VM host's agents)
r = libc.socket(40, 1, 0)
out["vsock"] = err_of(r)
if r >= 0:
    os.close(r)

# ptrace: another sandbox's process is out of sight; our own child is not (the probe's control)
out["ptrace_other_sandbox"] = sc(101, 16, int(sys.argv[3]), 0, 0)
child = os.fork()
if child == 0:
    time.sleep(5)
    os._exit(0)
out["ptrace_own_child"] = sc(101, 16, child, 0, 0)
os.kill(child, 9)
os.waitpid(child, 0)

# compatibility, not escapes: a newer libc's calls work (fchmodat2) or answer ENOSYS (statmount), never EPERM
open("/tmp/probe-f", "w").close()
out["fchmodat2"] = sc(452, -100, ctypes.c_char_p(b"/tmp/probe-f"), 0o644, 0)
out["statmount"] = sc(457, 0, 0, 0, 0)

# fork bomb (bounded): how many children could be started
want, kids = int(sys.argv[4]), []
for _ in range(want):
    try:
        p = os.fork()
    except OSError:
        break
    if p == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(p)
out["forked"] = len(kids)
for p in kids:
    os.kill(p, 9)
for p in kids:
    os.waitpid(p, 0)

print(json.dumps(out))
