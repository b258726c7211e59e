//! Incremental ct marks (docs/ct.md, "Incremental marks"): where the kernel tracks dirty pages, a mark of a
//! running sandbox pre-dumps first (CRIU `pre-dump --track-mem`, the tasks running again while their pages are
//! read) and the frozen dump copies only the pages written since, the rest staying in its `parent` images.
//! Measured on one sandbox holding 160 MiB (about what the browser template holds) it leaves alone while it keeps writing a little: a full mark and an
//! incremental one, then siblings restored from the incremental mark (eagerly and lazily) must see every byte.
//!
//! Where the kernel tracks dirty pages (Debian's kernels: clade-vm's `guest_ct_in_vm` runs this binary in a vm
//! guest with `CLADE_EXPECT_SOFT_DIRTY=1`), the incremental mark must freeze the sandbox for at most half the
//! full one's time. Where it does not (this project's hosts), the forced pre-dump fails, and the mark must still
//! be taken whole, by a full dump.
//!
//! The same binary checks the cgroup freezer (`guest_freeze_stops_every_process_and_thaw_continues`), so the vm
//! guest covers cgroup v2's.

use std::time::{Duration, Instant};

use clade_agent::ExecSpec;
use clade_core::backend::{Identity, MarkOptions, Sandbox};
use clade_ct::sandbox::CtSandbox;

mod common;

fn id(name: &str) -> Identity {
    clade_core::hygiene::new_identity(&format!("predump-{name}-{}", std::process::id()), 0)
}

fn sh(sb: &dyn Sandbox, script: &str) -> String {
    let out = sb.agent().run(ExecSpec::new(["/bin/sh", "-c", script])).expect("exec");
    assert_eq!(out.status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Holds `MIB` MiB of random bytes it never writes again, dirties one small page set every 20 ms, and on
/// request (`/root/check`) writes the digest of the big buffer to `/root/h1`.
const MIB: usize = 160;
const HOLDER: &str = r#"
import hashlib, os, time
big = bytearray(os.urandom(MIB << 20))
small = bytearray(16 * 4096)
open('/root/h0.tmp', 'w').write(hashlib.sha256(big).hexdigest())
os.rename('/root/h0.tmp', '/root/h0')
i = 0
while True:
    time.sleep(0.02)
    i += 1
    small[(i % 16) * 4096] = i % 251
    if os.path.exists('/root/check'):
        os.remove('/root/check')
        open('/root/h1.tmp', 'w').write(hashlib.sha256(big).hexdigest())
        os.rename('/root/h1.tmp', '/root/h1')
"#;

fn wait_file(sb: &dyn Sandbox, path: &str) -> String {
    let t0 = Instant::now();
    loop {
        let out = sh(sb, &format!("cat {path} 2>/dev/null || true"));
        if !out.is_empty() {
            return out;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{path} never appeared");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The holder's digest, asked for in a sibling: the big buffer's pages came through the restore.
fn digest_now(sb: &dyn Sandbox) -> String {
    sh(sb, "rm -f /root/h1; touch /root/check");
    wait_file(sb, "/root/h1")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[test]
fn guest_incremental_mark_freezes_less_and_restores_every_page() {
    let Some(e) = common::env_with("predump", 1024, false, |_| {}) else { return };
    let tracked = clade_core::host::tracks_dirty_pages() == Some(true);
    if std::env::var("CLADE_EXPECT_SOFT_DIRTY").as_deref() == Ok("1") {
        assert!(tracked, "this kernel has CONFIG_MEM_SOFT_DIRTY, but the probe did not see a dirtied page");
    }
    // The default follows the kernel.
    assert_eq!(clade_ct::predump_default(), tracked && std::env::var("CLADE_CT_PREDUMP").as_deref() != Ok("0"));
    let mut base: CtSandbox = e.backend.cold_start_ct(&e.image, &id("base")).expect("cold start");
    sh(&base, &format!("cat > /root/holder.py <<'EOF'\nMIB = {MIB}\n{HOLDER}\nEOF"));
    sh(&base, "setsid python3 /root/holder.py </dev/null >/root/holder.log 2>&1 &");
    let h0 = wait_file(&base, "/root/h0");

    base.set_predump(false);
    let full_mark = base.mark(&MarkOptions::default()).expect("full mark");
    let full = base.last_dump().expect("a dump");
    assert!(full.pre_frozen.is_none());
    // Forced on: it pre-dumps where the kernel tracks dirty pages, and falls back to a full dump elsewhere.
    base.set_predump(true);
    let inc_mark = base.mark(&MarkOptions::default()).expect("incremental mark");
    let inc = base.last_dump().expect("a dump");
    eprintln!(
        "pause of a mark holding {MIB} MiB: full {:.1} ms, with pre-dump {:.1} ms (the pre-dump's freeze {:.1} ms) \
         = {:.3}x; tracked: {tracked}; stored: full {} KiB, incremental {} KiB",
        ms(full.frozen),
        ms(inc.frozen),
        inc.pre_frozen.map(ms).unwrap_or(0.0),
        inc.frozen.as_secs_f64() / full.frozen.as_secs_f64(),
        full_mark.stored_bytes >> 10,
        inc_mark.stored_bytes >> 10
    );
    assert_eq!(inc.pre_frozen.is_some(), tracked, "pre-dumped exactly where the kernel tracks dirty pages");
    if tracked {
        assert!(
            inc.frozen.as_secs_f64() <= 0.5 * full.frozen.as_secs_f64(),
            "incremental pause {:?} vs full {:?}",
            inc.frozen,
            full.frozen
        );
    }
    // The marked sandbox runs on.
    assert_eq!(digest_now(&base), h0);

    // Siblings of the incremental mark, eager and lazy, hold every page of the big buffer.
    e.backend.set_lazy_threshold(None);
    let mut eager = e.backend.restore_ct(&inc_mark, &id("eager")).expect("restore the incremental mark");
    assert_eq!(digest_now(&eager), h0, "eager sibling");
    e.backend.set_lazy_threshold(Some(0));
    let lazy = e.backend.restore_ct(&inc_mark, &id("lazy")).expect("restore the incremental mark lazily");
    e.backend.set_lazy_threshold(None);
    assert_eq!(digest_now(&lazy), h0, "lazy sibling");

    // A restored sibling's own incremental mark (its pre-dump reads pages that came from parent images).
    eager.set_predump(true);
    let again = eager.mark(&MarkOptions::default()).expect("mark of a restored sibling");
    assert_eq!(eager.last_dump().and_then(|d| d.pre_frozen).is_some(), tracked);
    let grandchild = e.backend.restore_ct(&again, &id("grand")).expect("restore the sibling's mark");
    assert_eq!(digest_now(&grandchild), h0, "grandchild");
    for sb in [base, eager, lazy, grandchild] {
        Box::new(sb).kill().expect("kill");
    }
}

/// The cgroup freezer (containerd's Pause; docs/ct.md, "Freeze") on whatever cgroup version the host has: v1's
/// `freezer.state` on these hosts, v2's `cgroup.freeze` in the Debian guest of `guest_ct_in_vm`, which runs this
/// binary too. A ticking loop stands still while frozen (control: it ticks thawed), and a frozen sandbox is
/// killed cleanly (its cgroup thawed first).
#[test]
fn guest_freeze_stops_every_process_and_thaw_continues() {
    let Some(e) = common::env_with("freeze", 256, false, |_| {}) else { return };
    let mut sb: CtSandbox = e.backend.cold_start_ct(&e.image, &id("freeze")).expect("cold start");
    sh(&sb, "setsid sh -c 'while :; do echo >> /root/ticks; sleep 0.05; done' </dev/null >/dev/null 2>&1 &");
    let count = |sb: &CtSandbox| sh(sb, "wc -l < /root/ticks").parse::<u32>().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = count(&sb);
    std::thread::sleep(Duration::from_secs(1));
    let thawed = count(&sb) - t0;
    assert!(thawed >= 8, "the loop ticks: {thawed} in 1 s");
    let before = count(&sb);
    sb.freeze().expect("freeze");
    std::thread::sleep(Duration::from_secs(1));
    sb.thaw().expect("thaw");
    let frozen = count(&sb) - before;
    let version = clade_core::host::cgroup_version().unwrap_or("none");
    eprintln!("freezer on {version} cgroups: {frozen} ticks in 1 s frozen, {thawed} thawed");
    assert!(frozen <= 2, "the loop stood still while frozen: {frozen} ticks (thawed: {thawed})");
    sb.freeze().expect("freeze again");
    Box::new(sb).kill().expect("a frozen sandbox is killed");
}
