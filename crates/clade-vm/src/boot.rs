//! The guest's first seconds: an initramfs clade builds from the extracted Debian kernel. Its busybox init loads
//! the virtio and ext4 modules in dependency order (from the `modules.dep` that setup generated), mounts the root
//! disk (`/dev/vda`, served by clade-nbd), and `switch_root`s to clade-agent as PID 1. Any failure prints one
//! `clade-init: FAILED ...` line on the console and powers off, so the host reports it at once instead of
//! timing out.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::initramfs::Initramfs;
use crate::machine::MachineType;

/// Where the agent lives inside every template's root filesystem.
pub const AGENT_PATH: &str = "/usr/lib/clade/clade-agent";

/// The marker the initramfs prints before handing over to the root's init.
pub const HANDOVER_MARKER: &str = "clade-init: switching root";

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("guest kernel modules at {0}: {1} (run ./x setup)")]
    Modules(String, std::io::Error),
    #[error("module {0} is not in the guest kernel's modules.dep")]
    UnknownModule(String),
    #[error("writing the initramfs {0}: {1}")]
    Write(String, std::io::Error),
}

/// The modules a guest needs, by machine type: the virtio transport, the block and console devices, ext4.
pub fn wanted_modules(machine: MachineType) -> Vec<&'static str> {
    let transport = match machine {
        MachineType::Q35 => "virtio_pci",
        MachineType::Microvm => "virtio_mmio",
    };
    // tcp_diag (with inet_diag): the agent destroys stale connections after a restore through sock_diag.
    // virtio_net: the NIC of `network = "egress"` guests (crate::net); loaded always, configured only when asked.
    vec![transport, "virtio_blk", "virtio_console", "virtio_rng", "virtio_net", "crc32c_generic", "ext4", "tcp_diag"]
}

/// Module name (`virtio_blk`) -> (relative path, dependencies' relative paths), from `modules.dep`.
fn read_deps(modules_dir: &Path) -> Result<HashMap<String, (String, Vec<String>)>, BootError> {
    let dep = modules_dir.join("modules.dep");
    let text = std::fs::read_to_string(&dep).map_err(|e| BootError::Modules(modules_dir.display().to_string(), e))?;
    let mut map = HashMap::new();
    for line in text.lines() {
        let Some((path, deps)) = line.split_once(':') else { continue };
        map.insert(module_name(path), (path.to_string(), deps.split_whitespace().map(String::from).collect()));
    }
    Ok(map)
}

fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.trim_end_matches(".ko").replace('-', "_")
}

/// Modules built into the kernel (`modules.builtin`; none when the kernel has no such list): a kernel that
/// builds in what another ships as a module (trixie's `virtio_pci`) needs nothing loaded for it.
fn read_builtin(modules_dir: &Path) -> HashSet<String> {
    std::fs::read_to_string(modules_dir.join("modules.builtin"))
        .map(|t| t.lines().map(module_name).collect())
        .unwrap_or_default()
}

/// The relative paths of `wanted` and all their dependencies, each after what it depends on. A wanted module
/// built into the kernel is left out.
pub fn load_order(modules_dir: &Path, wanted: &[&str]) -> Result<Vec<String>, BootError> {
    let deps = read_deps(modules_dir)?;
    let builtin = read_builtin(modules_dir);
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    fn visit(
        name: &str,
        deps: &HashMap<String, (String, Vec<String>)>,
        seen: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), BootError> {
        if !seen.insert(name.to_string()) {
            return Ok(());
        }
        let (path, ds) = deps.get(name).ok_or_else(|| BootError::UnknownModule(name.into()))?;
        // modules.dep lists the closest dependency first; load the farthest first.
        for d in ds.iter().rev() {
            visit(&module_name(d), deps, seen, order)?;
        }
        order.push(path.clone());
        Ok(())
    }
    for w in wanted.iter().filter(|w| !builtin.contains(**w) || deps.contains_key(**w)) {
        visit(w, &deps, &mut seen, &mut order)?;
    }
    Ok(order)
}

/// Build the guest initramfs for `machine` into `dest`.
pub fn build_initramfs(kernel_dir: &Path, busybox: &Path, machine: MachineType, dest: &Path) -> Result<(), BootError> {
    let bytes = initramfs_bytes(kernel_dir, busybox, machine)?;
    write_atomic(dest, &bytes)
}

/// Build the guest initramfs into `dir` unless it is there already; return its path. The name is a hash of
/// everything that shapes the archive (the init script, the modules in load order, and each input file's size
/// and mtime), so a change of any of them gives a new name and a stale cache is never used, while a hit costs
/// only `stat`s: every supervisor opens the backend, and reading the modules each time was start-up work.
pub fn cached_initramfs(
    kernel_dir: &Path,
    busybox: &Path,
    machine: MachineType,
    dir: &Path,
) -> Result<PathBuf, BootError> {
    use std::hash::{Hash, Hasher};
    let modules_dir = kernel_dir.join("modules");
    let order = load_order(&modules_dir, &wanted_modules(machine))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let names: Vec<String> = order.iter().map(|r| module_name(r)).collect();
    init_script(&names).hash(&mut h);
    let inputs = std::iter::once(busybox.to_path_buf()).chain(order.iter().map(|r| modules_dir.join(r)));
    for f in inputs {
        let m = std::fs::metadata(&f).map_err(|e| BootError::Write(f.display().to_string(), e))?;
        (f.display().to_string(), m.len(), m.modified().ok()).hash(&mut h);
    }
    let path = dir.join(format!("initramfs-{:016x}.cpio", h.finish()));
    if !path.exists() {
        write_atomic(&path, &initramfs_bytes(kernel_dir, busybox, machine)?)?;
    }
    Ok(path)
}

fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<(), BootError> {
    let tmp = clade_core::home::temp_beside(dest);
    std::fs::write(&tmp, bytes)
        .and_then(|_| std::fs::rename(&tmp, dest))
        .map_err(|e| BootError::Write(dest.display().to_string(), e))
}

fn initramfs_bytes(kernel_dir: &Path, busybox: &Path, machine: MachineType) -> Result<Vec<u8>, BootError> {
    let modules_dir = kernel_dir.join("modules");
    let order = load_order(&modules_dir, &wanted_modules(machine))?;
    let mut img = Initramfs::new();
    for d in ["bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"] {
        img.dir(d);
    }
    img.host_file("bin/busybox", busybox).map_err(|e| BootError::Write(busybox.display().to_string(), e))?;
    let mut names = Vec::new();
    for rel in &order {
        let name = module_name(rel);
        let src: PathBuf = modules_dir.join(rel);
        img.host_file(&format!("lib/modules/{name}.ko"), &src)
            .map_err(|e| BootError::Write(src.display().to_string(), e))?;
        names.push(name);
    }
    img.file("init", 0o755, init_script(&names).as_bytes());
    Ok(img.finish())
}

fn init_script(modules: &[String]) -> String {
    format!(
        r#"#!/bin/busybox sh
B=/bin/busybox
fail() {{ $B echo "clade-init: FAILED $*"; $B poweroff -f; }}
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for m in {modules}; do $B insmod /lib/modules/$m.ko 2>/dev/null || $B grep -q "^$m " /proc/modules || fail "insmod $m"; done
root=/dev/vda; init={agent}; rootflags=rw; net=
for arg in $($B cat /proc/cmdline); do
  case "$arg" in
    clade.root=*) root=${{arg#clade.root=}} ;;
    clade.init=*) init=${{arg#clade.init=}} ;;
    clade.rootflags=*) rootflags=${{arg#clade.rootflags=}} ;;
    clade.net=*) net=${{arg#clade.net=}} ;;
  esac
done
# network = "egress" (crate::net): eth0 ADDR/LEN with a default route via GATEWAY; no word, no route.
if [ -n "$net" ]; then
  $B ip link set eth0 up && $B ip addr add ${{net%,*}} dev eth0 && $B ip route add default via ${{net#*,}} || fail "network $net"
fi
# What udev would do: name the virtio-serial ports (/dev/virtio-ports/NAME), so the agent finds its channel.
$B mkdir -p /dev/virtio-ports
for p in /sys/class/virtio-ports/*; do
  [ -f $p/name ] && $B ln -sf ../${{p##*/}} /dev/virtio-ports/$($B cat $p/name)
done
i=0; while [ ! -b $root ]; do i=$((i+1)); [ $i -gt 500 ] && fail "no root disk $root"; $B usleep 10000; done
$B mount -t ext4 -o $rootflags $root /newroot || fail "mount $root"
[ -x /newroot$init ] || fail "no init $init in the root filesystem"
$B mount --move /dev /newroot/dev 2>/dev/null || $B umount /dev
$B umount /sys; $B umount /proc
$B echo "{marker}"
exec $B switch_root /newroot $init init
"#,
        modules = modules.join(" "),
        agent = AGENT_PATH,
        marker = HANDOVER_MARKER,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_load_first() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("modules.dep"),
            "kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko\n\
             kernel/lib/crc16.ko:\nkernel/fs/mbcache.ko:\nkernel/fs/jbd2/jbd2.ko:\n\
             kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
             kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\nkernel/drivers/virtio/virtio_ring.ko:\n",
        )
        .unwrap();
        let order = load_order(dir.path(), &["virtio_blk", "ext4"]).unwrap();
        let names: Vec<String> = order.iter().map(|p| module_name(p)).collect();
        assert_eq!(names, ["virtio_ring", "virtio", "virtio_blk", "jbd2", "mbcache", "crc16", "ext4"]);
        assert!(matches!(load_order(dir.path(), &["nope"]), Err(BootError::UnknownModule(_))));
        // Built in (trixie's virtio_pci): nothing to load, no error.
        std::fs::write(dir.path().join("modules.builtin"), "kernel/drivers/virtio/virtio_pci.ko\n").unwrap();
        let order = load_order(dir.path(), &["virtio_pci", "virtio_blk"]).unwrap();
        let names: Vec<String> = order.iter().map(|p| module_name(p)).collect();
        assert_eq!(names, ["virtio_ring", "virtio", "virtio_blk"]);
        assert!(matches!(load_order(dir.path(), &["nope"]), Err(BootError::UnknownModule(_))));
    }
}
