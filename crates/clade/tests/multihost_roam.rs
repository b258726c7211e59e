//! Three clade hosts sharing only a real Garage cluster (3 nodes, replication factor 3), on both backends
//! (docs/roam.md): a sandbox with a running process and an open file runs on host A, is suspended and pushed;
//! hosts B and C resume it at the same moment while one Garage node is down, and exactly one of them gets it,
//! the other being refused with the winner's name; the winner pushes it on (the node still down), the other
//! resumes it once the node is back, and A takes
//! it back fetching only what it lacked. The process, its open file's position and the files survive every
//! move, and the blob tier stays whole (every published root readable from it alone). Each host runs in a
//! network namespace of its own and reaches the store only through its link (common::hostnet).

use std::path::{Path, PathBuf};

use clade_store::testkit::Garage;

mod common;

use common::hostnet::HostNet;
use common::{blob_check, ok_env as ok, run_env as run, sh_env as sh, Env};

/// A host: its home, its network namespace and link to the store, and its environment (the shared blob tier
/// through the link, its own guest-RAM directory).
struct Host {
    name: &'static str,
    home: PathBuf,
    env: Env,
    _net: HostNet,
}

impl Host {
    fn new(name: &'static str, home: &Path, g: &Garage) -> Host {
        let net = HostNet::new(&format!("mh-{}", name.to_lowercase()), g);
        let mut env = net.env(g);
        env.push(("CLADE_SHM", format!("/dev/shm/{}", home.file_name().unwrap().to_string_lossy())));
        Host { name, home: home.to_path_buf(), env, _net: net }
    }
    fn id(&self) -> String {
        std::fs::read_to_string(self.home.join("host-id")).unwrap_or_default().trim().to_string()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // A test that failed midway leaves this host's sandboxes running: end them before their mounts go.
        let _ = run(&self.home, &self.env, &["kill", "--all"]);
        if let Some((_, shm)) = self.env.iter().find(|(k, _)| *k == "CLADE_SHM") {
            for e in std::fs::read_dir(Path::new(shm).join("lazy")).into_iter().flatten().flatten() {
                let _ = nix::mount::umount2(&e.path(), nix::mount::MntFlags::MNT_DETACH);
            }
            let _ = std::fs::remove_dir_all(shm);
        }
    }
}

#[test]
fn multihost_roam_ct_three_hosts() {
    let Some(mut g) = common::garage("clade-multihost-ct") else { return };
    let Some(a) = common::ct_home("clade-mh-ct-a") else { return };
    let bare = |p: &str| {
        let t = tempfile::Builder::new().prefix(p).tempdir_in("/var/tmp").unwrap();
        std::os::unix::fs::symlink(common::real_home().join("criu"), t.path().join("criu")).unwrap();
        t
    };
    let (b, c) = (bare("clade-mh-ct-b"), bare("clade-mh-ct-c"));
    three_hosts(&mut g, [a.path(), b.path(), c.path()], "ctbox", "ct");
}

#[test]
fn multihost_roam_vm_three_hosts() {
    let Some(mut g) = common::garage("clade-multihost-vm") else { return };
    let Some(a) = common::vm_home("clade-mh-vm-a") else { return };
    let (b, c) = (common::vm_bare_home("clade-mh-vm-b"), common::vm_bare_home("clade-mh-vm-c"));
    three_hosts(&mut g, [a.path(), b.path(), c.path()], "busybox", "vm");
}

/// The counter process's file: its lines must be 1, 2, 3, ... with none missing or repeated (a restarted
/// process would start again at 1; a lost file position would overwrite). Returns the last value.
fn counter(h: &Host, sbx: &str) -> u64 {
    let out =
        sh(&h.home, &h.env, sbx, "awk 'NR!=$1{bad=NR} END{print (bad?\"broken at \" bad:\"ok\"), NR}' /root/counter");
    let (state, n) = out.split_once(' ').unwrap_or((&out, "0"));
    assert_eq!(state, "ok", "{}: the counter's file is {out}", h.name);
    n.trim().parse().unwrap()
}

/// The sandbox is whole on `h`: the same machine and files, the process alive and counting on.
fn intact(h: &Host, sbx: &str, pid: &str, before: &str, last: u64) {
    assert_eq!(
        sh(&h.home, &h.env, sbx, "cat /etc/hostname /etc/machine-id; md5sum < /root/blob"),
        before,
        "{}",
        h.name
    );
    assert_eq!(sh(&h.home, &h.env, sbx, &format!("kill -0 {pid} && echo alive")), "alive", "{}", h.name);
    std::thread::sleep(std::time::Duration::from_millis(700));
    let now = counter(h, sbx);
    assert!(now > last, "{}: the process counts on from {last} (now {now})", h.name);
}

fn blob_whole(g: &Garage) {
    let rep = blob_check(g);
    assert!(rep.whole() && rep.manifests + rep.trees > 0, "{rep:?}");
}

fn three_hosts(g: &mut Garage, homes: [&Path; 3], template: &str, backend: &str) {
    let [a, b, c] = homes.map(|h| h.to_path_buf());
    let a = Host::new("A", &a, g);
    let (b, c) = (Host::new("B", &b, g), Host::new("C", &c, g));

    // Host A: a sandbox with a file of its own and a process writing to an open file.
    let r = ok(&a.home, &a.env, &["run", template, "--backend", backend, "--json"]);
    let sbx = r["sandboxes"][0]["sandbox"].as_str().unwrap().to_string();
    let pid = sh(
        &a.home,
        &a.env,
        &sbx,
        "mkdir -p /root && echo travelled > /root/note && head -c 2097152 /dev/urandom > /root/blob && \
         setsid sh -c 'i=0; exec 3>>/root/counter; while true; do i=$((i+1)); echo $i >&3; sleep 0.2; done' \
         </dev/null >/dev/null 2>&1 & echo $!",
    );
    std::thread::sleep(std::time::Duration::from_millis(600));
    let before = sh(&a.home, &a.env, &sbx, "cat /etc/hostname /etc/machine-id; md5sum < /root/blob");
    let owner = sh(&a.home, &a.env, &sbx, "stat -c '%u:%g %a' /root/blob");
    let last = counter(&a, &sbx);
    ok(&a.home, &a.env, &["suspend", &sbx, "--json"]);
    let pushed = ok(&a.home, &a.env, &["roam", "push", &sbx, "--json"]);
    eprintln!("{backend}: A pushed {} of {} bytes", pushed["bytes_uploaded"], pushed["full_bytes"]);
    blob_whole(g);

    // One Garage node down: B and C resume it at the same moment; exactly one gets it.
    g.stop_node(2);
    let race: Vec<(i32, String, String)> = std::thread::scope(|s| {
        let hs: Vec<_> =
            [&b, &c].iter().map(|h| s.spawn(|| run(&h.home, &h.env, &["resume", &sbx, "--json"]))).collect();
        hs.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let won: Vec<usize> = (0..2).filter(|&i| race[i].0 == 0).collect();
    assert_eq!(won.len(), 1, "exactly one of B and C resumes it: {race:?}");
    let (w, l) = if won[0] == 0 { (&b, &c) } else { (&c, &b) };
    let lost = &race[1 - won[0]];
    assert_eq!(lost.0, 4, "{}: refused as a conflict: {lost:?}", l.name);
    assert!(lost.2.contains(&w.id()), "{}'s refusal names the winner {}: {}", l.name, w.id(), lost.2);
    let res: serde_json::Value = serde_json::from_str(&race[won[0]].1).unwrap();
    let w_fetched = fetched(&res);
    eprintln!(
        "{backend}: {} won, resumed in {:.0} ms, fetched {w_fetched} bytes; {} was refused: {}",
        w.name,
        res["resume_ms"].as_f64().unwrap(),
        l.name,
        lost.2.trim()
    );
    intact(w, &sbx, &pid, &before, last);
    assert_eq!(sh(&w.home, &w.env, &sbx, "stat -c '%u:%g %a' /root/blob"), owner, "{}", w.name);
    if backend == "ct" {
        // The 2 MiB file, whose frames the winner lacked, was left out of its upper's layout and read through
        // the mark's upper tree, mounted lazily (docs/ct.md): the same bytes, owner and mode, as checked above.
        let notes: Vec<String> = std::fs::read_dir(w.home.join("cache/ct-uppers"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".lazy"))
            .collect();
        assert!(!notes.is_empty(), "{}: no upper layout left its large file lazy", w.name);
    }
    // Every host sees who has it in `clade hosts` (the winner's pull beat into the blob tier).
    let hosts = ok(&a.home, &a.env, &["hosts", "--json"]);
    let row = hosts.as_array().unwrap().iter().find(|r| r["host"] == w.id().as_str()).cloned();
    let owns = row.as_ref().and_then(|r| r["owns"].as_array().cloned()).unwrap_or_default();
    assert!(owns.iter().any(|s| s == sbx.as_str()), "{} owns {sbx}: {hosts}", w.name);

    // The winner changes it and pushes it on (the node still down), the node comes back, and the other host
    // resumes it.
    // A write into the lazily read file copies it up into the winner's own upper; the next host sees it.
    sh(
        &w.home,
        &w.env,
        &sbx,
        "echo onward >> /root/note && printf changed | dd of=/root/blob bs=1 seek=4096 conv=notrunc 2>/dev/null",
    );
    let before = sh(&w.home, &w.env, &sbx, "cat /etc/hostname /etc/machine-id; md5sum < /root/blob");
    let last = counter(w, &sbx);
    ok(&w.home, &w.env, &["suspend", &sbx, "--json"]);
    ok(&w.home, &w.env, &["roam", "push", &sbx, "--json"]);
    g.start_node(2).unwrap();
    let res = ok(&l.home, &l.env, &["resume", &sbx, "--json"]);
    eprintln!(
        "{backend}: {} resumed in {:.0} ms, fetched {} bytes",
        l.name,
        res["resume_ms"].as_f64().unwrap(),
        fetched(&res)
    );
    intact(l, &sbx, &pid, &before, last);
    assert_eq!(sh(&l.home, &l.env, &sbx, "cat /root/note"), "travelled\nonward");

    // Back to A, which holds the base and the sandbox's first mark: it fetches only what it lacks.
    let last = counter(l, &sbx);
    ok(&l.home, &l.env, &["suspend", &sbx, "--json"]);
    ok(&l.home, &l.env, &["roam", "push", &sbx, "--json"]);
    let res = ok(&a.home, &a.env, &["resume", &sbx, "--json"]);
    let a_fetched = fetched(&res);
    eprintln!("{backend}: A resumed in {:.0} ms, fetched {a_fetched} bytes", res["resume_ms"].as_f64().unwrap());
    assert!(a_fetched < w_fetched, "A fetched {a_fetched} bytes, a host with nothing fetched {w_fetched}");
    intact(&a, &sbx, &pid, &before, last);
    blob_whole(g);

    ok(&a.home, &a.env, &["kill", &sbx, "--json"]);
    let audit = ok(&a.home, &a.env, &["audit", "--json"]);
    assert_eq!(audit["findings"].as_array().unwrap().len(), 0, "{audit}");
    for h in [&b, &c] {
        let (code, _, _) = run(&h.home, &h.env, &["exec", &sbx, "--", "true"]);
        assert_eq!(code, 3, "{} forgot the sandbox it pushed", h.name);
    }
}

/// What a host read from the blob tier for a `resume --json`: its supervisor's reads (`blob_bytes`) and the
/// resuming command's (`pulled.blob_bytes`: the pull, the fetch-ahead, the heartbeat).
fn fetched(res: &serde_json::Value) -> u64 {
    res["blob_bytes"].as_u64().unwrap() + res["pulled"]["blob_bytes"].as_u64().unwrap_or(0)
}
