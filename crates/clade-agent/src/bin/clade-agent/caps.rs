//! Fewer capabilities for one process (`ExecSpec::caps`, an OCI process's bounding set) and `no_new_privs`
//! (`ExecSpec::no_new_privs`): a pod whose container drops capabilities gets at most those, on top of the
//! sandbox's jail (docs/kubernetes.md).
//!
//! Done in the forked child before exec, in this order: drop every capability not kept from the bounding set
//! (which needs `CAP_SETPCAP`, so before the ids change), clear the ambient set, take the ids (a user other
//! than root loses every capability there), then narrow the permitted, effective and inheritable sets to what
//! is kept. For root, exec gives the permitted set `inheritable | bounding`, so both must be narrowed. Only
//! system calls on data made before the fork: nothing allocates.

use clade_agent::AgentError;

/// Capability names in the kernel's numbering (`include/uapi/linux/capability.h`), 0 to 40.
const NAMES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// The mask of the named capabilities (`CAP_` prefix optional, any case). A name this agent does not know is
/// refused: keeping less than asked could break the program, and keeping more is not for it to decide.
pub fn mask(names: &[String]) -> Result<u64, AgentError> {
    let mut m = 0u64;
    for n in names {
        let upper = n.to_ascii_uppercase();
        let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
        let Some(i) = NAMES.iter().position(|k| *k == bare) else {
            return Err(AgentError::BadRequest { detail: format!("unknown capability {n:?}") });
        };
        m |= 1 << i;
    }
    Ok(m)
}

/// `capget`/`capset`'s header, version 3 (64-bit sets in two words).
#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Before the ids change: drop from the bounding set every capability not in `keep`, clear the ambient set.
pub fn drop_bounding(keep: u64) -> std::io::Result<()> {
    for cap in 0..64u64 {
        if keep & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                break; // past the kernel's last capability
            }
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: prctl with integer arguments only. EINVAL: a kernel without ambient capabilities has none.
    let r = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) };
    if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// After the ids changed: the permitted, effective and inheritable sets narrowed to `keep`.
pub fn narrow_sets(keep: u64) -> std::io::Result<()> {
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two `Data` for version 3, which `data` holds; the header is a valid struct.
    check(unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()) })?;
    for (i, d) in data.iter_mut().enumerate() {
        let word = (keep >> (32 * i)) as u32;
        d.effective &= word;
        d.permitted &= word;
        d.inheritable &= word;
    }
    // SAFETY: capset reads the header and two `Data`, both valid for the call.
    check(unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) })
}

/// `no_new_privs` for this process and what it execs.
pub fn set_no_new_privs() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }.into())
}

#[cfg(test)]
mod tests {
    use super::mask;

    #[test]
    fn names_map_to_the_kernels_numbers() {
        let m = |v: &[&str]| mask(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(m(&["CAP_CHOWN", "kill"]).unwrap(), 1 | 1 << 5);
        assert_eq!(m(&["CAP_NET_BIND_SERVICE", "CAP_SYS_ADMIN"]).unwrap(), 1 << 10 | 1 << 21);
        assert_eq!(m(&["CAP_CHECKPOINT_RESTORE"]).unwrap(), 1 << 40);
        assert_eq!(m(&[]).unwrap(), 0);
        assert!(m(&["CAP_NOPE"]).unwrap_err().to_string().contains("CAP_NOPE"));
    }
}
