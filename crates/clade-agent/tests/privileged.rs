//! The agent as PID 1 of a namespace sandbox built by the test (`unshare -p -m -n -u -i --fork`, a
//! tmpfs root): init's mounts, loopback, services, survival, identity, and the stale-connection reset.

mod common;

use clade_agent::{ExecSpec, Identity, ReadyTarget};
use common::NsAgent;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

fn sh(script: &str) -> ExecSpec {
    ExecSpec::new(["/bin/sh", "-c", script])
}

fn out(c: &clade_agent::AgentClient, script: &str) -> String {
    let o = c.run(sh(script)).unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

fn can_unshare() -> bool {
    let ok = std::process::Command::new("unshare")
        .args(["-p", "-m", "-n", "-u", "-i", "--fork", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: unshare -p -m -n -u -i does not work here");
    }
    ok
}

/// A setup tree with a service that starts an HTTP server and returns once it listens.
fn setup_tree(dir: &Path) {
    let svc = dir.join("etc/clade/services.d");
    std::fs::create_dir_all(&svc).unwrap();
    std::fs::write(
        svc.join("10-http"),
        "#!/bin/sh\ncd /tmp\npython3 -m http.server 7001 --bind 127.0.0.1 >/dev/null 2>&1 &\n\
         while ! python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7001))\" 2>/dev/null; do sleep 0.05; done\n\
         touch /run/svc-ready\n",
    )
    .unwrap();
    std::process::Command::new("chmod").arg("+x").arg(svc.join("10-http")).status().unwrap();
    let hook = dir.join("etc/clade/on-restore.d");
    std::fs::create_dir_all(&hook).unwrap();
    std::fs::write(hook.join("50-gen"), "#!/bin/sh\necho \"$CLADE_GENERATION\" > /run/restored\n").unwrap();
    std::process::Command::new("chmod").arg("+x").arg(hook.join("50-gen")).status().unwrap();
}

fn start() -> NsAgent {
    let setup = common::tempdir("setup");
    setup_tree(&setup);
    let a = NsAgent::start("ns", Some(&setup));
    let _ = std::fs::remove_dir_all(&setup);
    a
}

/// Until init's services are up: their readiness checks are TCP connections on the sandbox's loopback.
fn wait_services(c: &clade_agent::client::AgentClient) {
    let t0 = Instant::now();
    while !c.hello().unwrap().services_ready {
        assert!(t0.elapsed() < Duration::from_secs(30), "services never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn privileged_init_mounts_services_and_loopback() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let h = c.hello().unwrap();
    assert_eq!((h.pid, h.role.as_str()), (1, "init"));
    let mounts = out(&c, "cat /proc/self/mountinfo");
    for m in [" /proc ", " /sys ", " /dev ", " /dev/pts ", " /dev/shm ", " /run ", " /tmp "] {
        assert!(mounts.contains(m), "{m} not mounted:\n{mounts}");
    }
    assert!(out(&c, "cat /sys/class/net/lo/operstate; cat /sys/class/net/lo/flags").contains("0x9"), "lo is not up");
    // the service returned once it listened, in order, and hello says so
    wait_services(&c);
    c.stat("/run/svc-ready").unwrap();
    c.wait_ready(ReadyTarget::Url { url: "http://127.0.0.1:7001/".into() }, Duration::from_secs(10)).unwrap();
    c.wait_ready(ReadyTarget::Port { port: 7001 }, Duration::from_secs(1)).unwrap();
    // a PTY works inside (devpts mounted by init)
    let mut spec = sh("tty");
    spec.pty = Some(clade_agent::PtySize { rows: 5, cols: 40 });
    assert!(String::from_utf8_lossy(&c.run(spec).unwrap().stdout).contains("/dev/pts/"));
    // env for login shells
    let mut vars = BTreeMap::new();
    vars.insert("CLADE_TEST".to_string(), "v1".to_string());
    c.write_env(vars).unwrap();
    assert_eq!(out(&c, "sh -lc 'echo $CLADE_TEST'").trim(), "v1");
}

#[test]
fn privileged_pid1_survives_crashes_sigpipe_and_orphans() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let st = c.run(sh("kill -SEGV $$")).unwrap().status;
    assert_eq!(st.signal, Some(11));
    let st = c.run(sh("yes | head -c 1 >/dev/null")).unwrap().status;
    assert!(st.success());
    // signals sent to PID 1 from inside are ignored or survived
    c.run(sh("kill -PIPE 1; kill -TERM 1; kill -HUP 1; kill -INT 1; kill -USR1 1; kill -SEGV 1; true")).unwrap();
    // orphans get reaped: a daemon whose parent exits
    c.run(sh("sleep 0.2 & exit 0")).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let stats = out(&c, "cat /proc/[0-9]*/stat 2>/dev/null");
    assert!(!stats.contains(") Z "), "zombies left:\n{stats}");
    // the host vanishing mid-stream costs the agent nothing (EPIPE on its writes)
    {
        let c2 = a.client();
        let _p = c2.exec(sh("yes")).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(a.alive());
    let c3 = a.client();
    assert_eq!(c3.hello().unwrap().pid, 1);
    // the `yes` whose reader went away keeps running (its output is dropped): kill it by name
    c3.run(sh("kill $(pidof yes) 2>/dev/null; true")).unwrap();
    assert!(a.alive());
}

#[test]
fn privileged_identity_in_sandbox() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let p = c.exec(sh("trap 'echo got > /run/sig; exit 0' USR1; while :; do sleep 0.02; done")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    c.register_restore_signal(p.pid, 10).unwrap();
    let rep = c
        .set_identity(Identity {
            hostname: Some("sib-3".into()),
            machine_id: Some("fedcba9876543210fedcba9876543210".into()),
            entropy: (0..64u8).map(|i| i.wrapping_mul(37)).collect(),
            generation: Some(3),
            run_on_restore: true,
            signal_registered: true,
            continues: false,
        })
        .unwrap();
    assert!(rep.errors.is_empty(), "{rep:?}");
    assert!(rep.hostname_set && rep.machine_id_set && rep.crng_reseeded);
    assert_eq!((rep.entropy_added, rep.signalled, rep.scripts.len()), (64, 1, 1));
    assert_eq!(
        out(&c, "hostname; cat /etc/hostname /etc/machine-id /run/restored; grep -c '^127.0.1.1[[:space:]]sib-3$' /etc/hosts"),
        "sib-3\nsib-3\nfedcba9876543210fedcba9876543210\n3\n1\n"
    );
    assert!(p.output().unwrap().status.success());
    assert_eq!(c.read_file_vec("/run/sig").unwrap(), b"got\n");
    assert_eq!(c.hello().unwrap().generation, 3);
    // the host's own files were not touched
    assert!(!std::fs::read_to_string("/etc/hosts").unwrap_or_default().contains("sib-3"));
    assert_ne!(
        std::fs::read_to_string("/etc/machine-id").unwrap_or_default().trim(),
        "fedcba9876543210fedcba9876543210"
    );
}

#[test]
fn privileged_net_reset_destroys_established_connections() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    // Init's services check their readiness over loopback TCP: on a slow host such a check can still be
    // connected when the counts below are taken (a fresh-clone run counted one extra), so they finish first.
    wait_services(&c);
    // a long-lived TCP connection on the sandbox's own loopback: both ends established
    let server = c
        .exec(sh("python3 -c \"import socket,time\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 7100)); s.listen()\nc,_=s.accept()\ntry:\n  c.recv(10)\n  print('closed')\nexcept OSError as e:\n  print('reset', e.errno)\""))
        .unwrap();
    c.wait_ready(ReadyTarget::Port { port: 7100 }, Duration::from_secs(10)).unwrap();
    let client = c
        .exec(sh("python3 -c \"import socket\ns=socket.create_connection(('127.0.0.1', 7100))\ntry:\n  s.recv(10)\n  print('closed')\nexcept OSError as e:\n  print('reset', e.errno)\""))
        .unwrap();
    let t0 = Instant::now();
    loop {
        let ss = out(&c, "cat /proc/net/tcp");
        if ss.lines().filter(|l| l.split_whitespace().nth(3) == Some("01")).count() >= 2 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "connection never established:\n{ss}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // loopback connections are not "to the host": the default keeps them
    assert_eq!(c.net_reset(None, &[]).unwrap(), 0);
    // the kept local port's socket is kept; its peer (the client end) is destroyed, and on loopback the
    // reset that sends takes the kept end down too
    assert_eq!(c.net_reset(Some("127.0.0.1".parse().unwrap()), &[7100]).unwrap(), 1);
    let s = String::from_utf8_lossy(&server.output().unwrap().stdout).into_owned();
    let k = String::from_utf8_lossy(&client.output().unwrap().stdout).into_owned();
    assert!(s.contains("reset") || k.contains("reset"), "server: {s} client: {k}");
    // Both processes have exited; the kept end's RST travels through loopback's softirq, which a loaded host
    // may defer: wait (bounded) for no established socket to be left, then nothing matches any more.
    let t0 = Instant::now();
    loop {
        let ss = out(&c, "cat /proc/net/tcp");
        if !ss.lines().any(|l| l.split_whitespace().nth(3) == Some("01")) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "an established socket outlived both ends' processes:\n{ss}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.net_reset(Some("127.0.0.1".parse().unwrap()), &[]).unwrap(), 0);
}

/// A process with a root of its own (a pod member of another image): it sees that root's files, runs as that
/// root's user, in a working directory inside it; the agent's own files stay out of its sight.
#[test]
fn privileged_exec_with_a_root_of_its_own() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let made = out(
        &c,
        "mkdir -p /croot/bin /croot/etc /croot/w && cp /bin/busybox /croot/bin/busybox && \
         ln -s busybox /croot/bin/sh && ln -s busybox /croot/bin/id && ln -s busybox /croot/bin/cat && \
         echo 'app:x:1234:4321::/w:/bin/sh' > /croot/etc/passwd && echo mine > /croot/marker && \
         chmod 777 /croot/w && echo ok",
    );
    assert_eq!(made, "ok\n", "{made}");
    let spec = ExecSpec {
        root: Some("/croot".into()),
        user: Some("app".into()),
        cwd: Some("/w".into()),
        ..sh("id -u; id -g; pwd; cat /marker; echo $HOME; test -e /etc/clade || echo no-agent-files")
    };
    let o = c.run(spec).unwrap();
    let said = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert_eq!(said, "1234\n4321\n/w\nmine\n/w\nno-agent-files\n");
    // Control: without the root, the same user does not exist and the marker is elsewhere.
    let err = c.run(ExecSpec { user: Some("app".into()), ..sh("true") }).unwrap_err().to_string();
    assert!(err.contains("no user \"app\""), "{err}");
    assert_eq!(out(&c, "cat /marker 2>/dev/null || echo absent"), "absent\n");
    let err = c.run(ExecSpec { root: Some("/nowhere".into()), ..sh("true") }).unwrap_err().to_string();
    assert!(err.contains("/nowhere"), "a missing root is named: {err}");
}

/// `signal_group`: a process the agent started, a child it forked and a grandchild with a session of its own
/// are stopped, continued and killed together; another process of the sandbox is not touched.
#[test]
fn privileged_signal_group_reaches_a_process_and_its_descendants() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let count = |f: &str| -> String { out(&c, &format!("cat /tmp/{f} 2>/dev/null || echo none")) };
    let other = c.exec(sh("i=0; while :; do i=$((i+1)); echo $i > /tmp/other; sleep 0.05; done")).unwrap();
    let leader = c
        .exec(sh("setsid sh -c 'j=0; while :; do j=$((j+1)); echo $j > /tmp/deep; sleep 0.05; done' & \
                  i=0; while :; do i=$((i+1)); echo $i > /tmp/mine; sleep 0.05; done"))
        .unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let moved = |f: &str| {
        let before = count(f);
        std::thread::sleep(Duration::from_millis(300));
        before != count(f)
    };
    assert!(moved("mine") && moved("deep") && moved("other"), "control: all three count");
    let stopped = c.signal_group(leader.pid, 19).unwrap();
    assert!(stopped >= 2, "the leader, its child and the grandchild's tree: {stopped}");
    assert!(!moved("mine") && !moved("deep"), "stopped: the leader and the grandchild with its own session");
    assert!(moved("other"), "another process goes on");
    c.signal_group(leader.pid, 18).unwrap();
    assert!(moved("mine") && moved("deep"), "continued");
    c.signal_group(leader.pid, 9).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(!moved("mine") && !moved("deep"), "killed, descendants included");
    assert!(moved("other"));
    let err = c.signal_group(1, 9).unwrap_err().to_string();
    assert!(err.contains("leads no group"), "{err}");
    other.signal(9).unwrap();
}

/// `ExecSpec::caps` and `no_new_privs` (an OCI process's bounding set and `noNewPrivileges`): the process holds
/// only the named capabilities, in every set, as root too; a child of another user holds none.
#[test]
fn privileged_exec_with_fewer_capabilities_and_no_new_privs() {
    if !can_unshare() {
        return;
    }
    let a = start();
    let c = a.client();
    let status = "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status | tr -s '\\t ' ' '";
    let run = |spec: ExecSpec| {
        let o = c.run(spec).unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
    };
    // Control: without them, the agent's own (all of them, as the test runs it).
    let own = run(sh(status));
    let bounding = own.lines().find_map(|l| l.strip_prefix("CapBnd: ")).map(|h| u64::from_str_radix(h, 16));
    assert!(matches!(bounding, Some(Ok(b)) if b & !0x21 != 0) && own.contains("NoNewPrivs: 0"), "{own}");
    let fewer = ExecSpec { caps: Some(vec!["CAP_CHOWN".into(), "CAP_KILL".into()]), no_new_privs: true, ..sh(status) };
    assert_eq!(
        run(fewer),
        "CapInh: 0000000000000000\nCapPrm: 0000000000000021\nCapEff: 0000000000000021\n\
         CapBnd: 0000000000000021\nCapAmb: 0000000000000000\nNoNewPrivs: 1\n"
    );
    // None at all (Kubernetes' `drop: [ALL]`).
    let none = run(ExecSpec { caps: Some(vec![]), ..sh(status) });
    assert!(none.contains("CapEff: 0000000000000000") && none.contains("CapBnd: 0000000000000000"), "{none}");
    let bad = c.run(ExecSpec { caps: Some(vec!["CAP_NOPE".into()]), ..sh("true") }).unwrap_err().to_string();
    assert!(bad.contains("CAP_NOPE"), "{bad}");
}
