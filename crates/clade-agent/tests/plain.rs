//! The agent as a plain process on a unix socket, driven through the real client.

mod common;

use clade_agent::wire::{encode, Chan, Kind};
use clade_agent::{AgentError, ClientError, ExecSpec, FileType, Identity, ProcEvent, PtySize, ReadyTarget, Reply};
use common::PlainAgent;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

fn sh(script: &str) -> ExecSpec {
    ExecSpec::new(["/bin/sh", "-c", script])
}

fn agent_err(r: Result<impl std::fmt::Debug, ClientError>) -> AgentError {
    match r {
        Err(ClientError::Agent(e)) => e,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[test]
fn hello_and_exec_streams() {
    let a = PlainAgent::start("exec");
    let c = a.client();
    let h = c.hello().unwrap();
    assert_eq!(h.wire_version, clade_agent::WIRE_VERSION);
    assert_eq!(h.role, "serve");
    assert_eq!(h.pid, a.child.id());
    assert!(!h.boot_id.is_empty());
    let out = c.run(sh("echo out; echo err >&2; exit 3")).unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code, Some(3));
    // env, cwd, clear_env
    let mut spec = sh("echo $FOO $(pwd) ${HOME}");
    spec.env.insert("FOO".into(), "bar".into());
    spec.cwd = Some("/tmp".into());
    spec.clear_env = true;
    assert_eq!(c.run(spec).unwrap().stdout, b"bar /tmp /root\n");
    // a user name from /etc/passwd sets uid, gid and HOME
    let mut spec = sh("echo $(id -u) $(id -g) $HOME");
    spec.user = Some("nobody".into());
    let out = c.run(spec).unwrap();
    assert_eq!(out.stdout, b"65534 65534 /nonexistent\n", "{out:?}");
    let mut spec = sh("id -u");
    spec.user = Some("no-such-user-x".into());
    assert!(matches!(agent_err(c.run(spec)), AgentError::BadRequest { .. }));
    // big output arrives whole and before the exit
    let out = c.run(sh("head -c 3000000 /dev/zero")).unwrap();
    assert_eq!(out.stdout.len(), 3_000_000);
    assert!(out.status.success());
}

#[test]
fn stdin_signal_list_wait() {
    let a = PlainAgent::start("stdin");
    let c = a.client();
    let mut spec = ExecSpec::new(["cat"]);
    spec.stdin = true;
    let p = c.exec(spec).unwrap();
    p.write_stdin(b"abc").unwrap();
    p.close_stdin().unwrap();
    let out = p.output().unwrap();
    assert_eq!(out.stdout, b"abc");
    let mut spec = ExecSpec::new(["sleep", "30"]);
    spec.tag = Some("sleeper".into());
    let p = c.exec(spec).unwrap();
    let listed = c.list_procs().unwrap();
    let me = listed.iter().find(|x| x.pid == p.pid).expect("listed");
    assert_eq!(me.tag.as_deref(), Some("sleeper"));
    assert!(me.exit.is_none());
    let pid = p.pid;
    let c2 = c.clone();
    let waiter = std::thread::spawn(move || c2.wait(pid, Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(50));
    p.signal(15).unwrap();
    let st = waiter.join().unwrap().unwrap();
    assert_eq!(st.signal, Some(15));
    assert_eq!(p.output().unwrap().status.signal, Some(15));
    assert!(matches!(agent_err(c.signal(pid, 15)), AgentError::NoSuchProcess { .. }));
    assert!(matches!(agent_err(c.signal(999_999, 15)), AgentError::NoSuchProcess { .. }));
}

#[test]
fn pty_and_resize() {
    let a = PlainAgent::start("pty");
    let c = a.client();
    let mut spec = sh("test -t 0 && test -t 1 && stty size");
    spec.pty = Some(PtySize { rows: 24, cols: 80 });
    let out = c.run(spec).unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("24 80"), "{:?}", out);
    let mut spec = sh("read x; stty size");
    spec.pty = Some(PtySize { rows: 10, cols: 20 });
    let p = c.exec(spec).unwrap();
    p.resize(30, 100).unwrap();
    p.write_stdin(b"go\n").unwrap();
    let out = p.output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("30 100"), "{:?}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn many_requests_in_flight() {
    let a = PlainAgent::start("many");
    let c = a.client();
    let big: Vec<u8> = (0..8_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let path = a.dir.join("big").display().to_string();
    c.write_file_bytes(&path, &big, None).unwrap();
    let mut threads = Vec::new();
    for i in 0..16 {
        let c = c.clone();
        let path = path.clone();
        threads.push(std::thread::spawn(move || {
            if i % 4 == 0 {
                assert_eq!(c.read_file_vec(&path).unwrap().len(), 8_000_000);
            } else {
                let out = c.run(sh(&format!("echo {i}"))).unwrap();
                assert_eq!(out.stdout, format!("{i}\n").into_bytes());
            }
            c.hello().unwrap();
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn files() {
    let a = PlainAgent::start("files");
    let c = a.client();
    let d = a.dir.display().to_string();
    let data: Vec<u8> = (0..5_000_003u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    let f = format!("{d}/sub/dir/file.bin");
    assert_eq!(c.write_file(&f, &mut &data[..], Some(0o600), true).unwrap(), data.len() as u64);
    assert_eq!(c.read_file_vec(&f).unwrap(), data);
    let st = c.stat(&f).unwrap();
    assert_eq!((st.file_type, st.size, st.mode), (FileType::File, data.len() as u64, 0o600));
    c.chmod(&f, 0o640).unwrap();
    assert_eq!(c.stat(&f).unwrap().mode, 0o640);
    c.mkdir_p(&format!("{d}/a/b/c"), None).unwrap();
    c.write_file_bytes(&format!("{d}/a/b/c/x"), b"x", None).unwrap();
    let one = c.list_dir(&format!("{d}/a"), 1).unwrap();
    assert_eq!(one.len(), 1);
    let all = c.list_dir(&format!("{d}/a"), 5).unwrap();
    assert_eq!(all.iter().map(|e| e.depth).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(all[2].stat.file_type, FileType::File);
    c.rename(&format!("{d}/a/b/c/x"), &format!("{d}/a/y")).unwrap();
    assert_eq!(c.read_file_vec(&format!("{d}/a/y")).unwrap(), b"x");
    assert!(matches!(agent_err(c.remove(&format!("{d}/a"), false)), AgentError::Os { .. }));
    c.remove(&format!("{d}/a"), true).unwrap();
    assert!(matches!(agent_err(c.stat(&format!("{d}/a"))), AgentError::NotFound { .. }));
    // a /proc file (st_size 0) still reads to its end
    let status = c.read_file_vec("/proc/self/status").unwrap();
    assert!(String::from_utf8_lossy(&status).contains("VmRSS"), "{}", String::from_utf8_lossy(&status));
    // an empty file, and replacing is atomic (no temp file left)
    c.write_file_bytes(&f, b"", None).unwrap();
    assert_eq!(c.read_file_vec(&f).unwrap(), b"");
    let names: Vec<_> = std::fs::read_dir(format!("{d}/sub/dir")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn bad_input_is_typed_and_the_agent_carries_on() {
    let mut a = PlainAgent::start("bad");
    let c = a.client();
    let d = a.dir.display().to_string();
    assert!(matches!(agent_err(c.read_file_vec(&format!("{d}/../etc/passwd"))), AgentError::BadPath { .. }));
    assert!(matches!(agent_err(c.stat("/etc/pa\0sswd")), AgentError::BadPath { .. }));
    assert!(matches!(agent_err(c.stat("relative")), AgentError::BadPath { .. }));
    assert!(matches!(agent_err(c.read_file_vec(&d)), AgentError::IsADirectory { .. }));
    assert!(matches!(agent_err(c.write_file_bytes(&d, b"x", None)), AgentError::IsADirectory { .. }));
    assert!(matches!(agent_err(c.read_file_vec("/nonexistent/x")), AgentError::NotFound { .. }));
    assert!(matches!(agent_err(c.run(ExecSpec::new(["/no/such/prog"]))), AgentError::NotFound { .. }));
    assert!(matches!(agent_err(c.run(ExecSpec::new(Vec::<String>::new()))), AgentError::BadRequest { .. }));
    let w = Duration::from_secs(5);
    let unknown = encode(Kind::Request, Chan::None, 0, 900, br#"{"op":"format_disk"}"#);
    assert!(matches!(agent_err(c.raw_call(&unknown, 900, w)), AgentError::UnknownOp { op, .. } if op == "format_disk"));
    let malformed = encode(Kind::Request, Chan::None, 0, 901, br#"{"op":"stat","path":5}"#);
    assert!(matches!(agent_err(c.raw_call(&malformed, 901, w)), AgentError::BadRequest { .. }));
    let notjson = encode(Kind::Request, Chan::None, 0, 902, b"\xff\x00garbage");
    assert!(matches!(agent_err(c.raw_call(&notjson, 902, w)), AgentError::BadRequest { .. }));
    let mut newer = encode(Kind::Request, Chan::None, 0, 903, br#"{"op":"hello"}"#);
    newer[4] = clade_agent::WIRE_VERSION + 1;
    assert!(matches!(agent_err(c.raw_call(&newer, 903, w)), AgentError::UnsupportedVersion { .. }));
    let mut badkind = encode(Kind::Reply, Chan::None, 0, 904, b"{}");
    badkind[5] = 77;
    assert!(matches!(agent_err(c.raw_call(&badkind, 904, w)), AgentError::BadFrame { .. }));
    let wrongdir = encode(Kind::Reply, Chan::None, 0, 905, b"{}");
    assert!(matches!(agent_err(c.raw_call(&wrongdir, 905, w)), AgentError::BadFrame { .. }));
    let short = [2u8, 0, 0, 0, 1, 1];
    assert!(matches!(agent_err(c.raw_call(&short, 0, w)), AgentError::BadFrame { .. }));
    // still serving, on this connection and new ones
    c.hello().unwrap();
    a.client().hello().unwrap();
    // a raw stream of random garbage on another connection, then that connection dropped
    {
        let mut s = std::os::unix::net::UnixStream::connect(&a.sock).unwrap();
        let mut x: u64 = 12345;
        let junk: Vec<u8> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 7) as u8
            })
            .collect();
        let _ = s.write_all(&junk);
        s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf);
    }
    c.hello().unwrap();
    assert!(a.alive());
}

#[test]
fn env_readiness_identity_files() {
    let a = PlainAgent::start("env");
    let c = a.client();
    let mut vars = BTreeMap::new();
    vars.insert("FOO".to_string(), "it's here".to_string());
    vars.insert("URL".to_string(), "http://x:1".to_string());
    c.write_env(vars.clone()).unwrap();
    let env = std::fs::read_to_string(a.sysroot.join("etc/clade/env")).unwrap();
    assert!(env.contains("FOO='it'\\''s here'\n"), "{env}");
    let prof = a.sysroot.join("etc/profile.d/clade.sh").display().to_string();
    let out = c.run(sh(&format!(". {prof}; echo \"$FOO|$URL\""))).unwrap();
    assert_eq!(out.stdout, b"it's here|http://x:1\n");
    vars.insert("bad name".into(), "x".into());
    assert!(matches!(agent_err(c.write_env(vars)), AgentError::BadRequest { .. }));

    // readiness: a file made later, a listening port, an HTTP 200, and a timeout
    let later = a.dir.join("later");
    let l2 = later.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        std::fs::write(l2, b"").unwrap();
    });
    let waited = c.wait_ready(ReadyTarget::File { path: later.display().to_string() }, Duration::from_secs(5)).unwrap();
    assert!((50..3000).contains(&waited), "{waited}");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    c.wait_ready(ReadyTarget::Port { port }, Duration::from_secs(5)).unwrap();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let mut s = s.unwrap();
            let mut b = [0u8; 1024];
            let _ = s.read(&mut b);
            let _ = s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok");
        }
    });
    c.wait_ready(ReadyTarget::Url { url: format!("http://127.0.0.1:{port}/health") }, Duration::from_secs(5)).unwrap();
    let e = agent_err(c.wait_ready(ReadyTarget::Port { port: 1 }, Duration::from_millis(100)));
    assert!(matches!(e, AgentError::Timeout { .. }), "{e:?}");

    // identity without the privileged steps: machine id, generation, on-restore scripts, signals
    let script = a.sysroot.join("etc/clade/on-restore.d/10-mark");
    std::fs::create_dir_all(script.parent().unwrap()).unwrap();
    let marker = a.dir.join("restored");
    std::fs::write(&script, format!("#!/bin/sh\necho \"$CLADE_GENERATION $CLADE_RESTORE\" > {}\n", marker.display()))
        .unwrap();
    std::process::Command::new("chmod").arg("+x").arg(&script).status().unwrap();
    let p = c.exec(sh("trap 'exit 42' USR1; while :; do sleep 0.02; done")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    c.register_restore_signal(p.pid, 10).unwrap();
    let rep = c
        .set_identity(Identity {
            machine_id: Some("0123456789abcdef0123456789abcdef".into()),
            generation: Some(7),
            run_on_restore: true,
            signal_registered: true,
            ..Identity::default()
        })
        .unwrap();
    assert!(rep.machine_id_set, "{rep:?}");
    assert_eq!(rep.scripts.len(), 1);
    assert_eq!(rep.signalled, 1);
    assert!(rep.errors.is_empty(), "{rep:?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "7 sibling\n");
    assert_eq!(
        std::fs::read_to_string(a.sysroot.join("etc/machine-id")).unwrap(),
        "0123456789abcdef0123456789abcdef\n"
    );
    assert_eq!(p.output().unwrap().status.code, Some(42));
    assert_eq!(c.hello().unwrap().generation, 7);
    let rep = c.set_identity(Identity { machine_id: Some("XYZ".into()), ..Identity::default() }).unwrap();
    assert!(!rep.machine_id_set && rep.errors.len() == 1);
    // A resume or retake: the hooks are told the sandbox continues its own line.
    c.set_identity(Identity { run_on_restore: true, continues: true, ..Identity::default() }).unwrap();
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "7 continue\n");
}

#[test]
fn pre_mark_hooks_run_in_order_with_the_marks_cleanliness() {
    let a = PlainAgent::start("premark");
    let c = a.client();
    // No hook directory: nothing runs, nothing fails.
    let rep = c.pre_mark(true).unwrap();
    assert!(rep.scripts.is_empty() && rep.errors.is_empty(), "{rep:?}");
    let dir = a.sysroot.join("etc/clade/pre-mark.d");
    std::fs::create_dir_all(&dir).unwrap();
    let log = a.dir.join("pre-mark.log");
    for (name, body) in [
        ("20-second", format!("echo second $CLADE_MARK_CLEAN >> {}", log.display())),
        ("10-first", format!("echo first $CLADE_MARK_CLEAN >> {}", log.display())),
        ("30-fails", "exit 3".to_string()),
    ] {
        std::fs::write(dir.join(name), format!("#!/bin/sh\n{body}\n")).unwrap();
        std::process::Command::new("chmod").arg("+x").arg(dir.join(name)).status().unwrap();
    }
    std::fs::write(dir.join("40-not-executable"), "#!/bin/sh\nexit 9\n").unwrap();
    let rep = c.pre_mark(true).unwrap();
    let names: Vec<&str> = rep.scripts.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["10-first", "20-second", "30-fails"], "{rep:?}");
    assert_eq!(rep.errors.len(), 1, "{rep:?}");
    assert!(rep.errors[0].contains("30-fails"), "{rep:?}");
    c.pre_mark(false).unwrap();
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "first 1\nsecond 1\nfirst 0\nsecond 0\n");
}

#[test]
fn clock_read_and_sync_probe() {
    let a = PlainAgent::start("clock");
    let c = a.client();
    let r = c.clock_read().unwrap();
    let host = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as i64;
    assert!((r.realtime_ns - host).abs() < 1_000_000_000);
    assert!(r.monotonic_ns > 0 && r.boottime_ns >= r.monotonic_ns);
    // Same host, same clock: the probe reads (nearly) zero error and no shift is needed.
    let (err, rtt) = c.probe_clock(0, 5).unwrap();
    assert!(err.abs() < 3_000_000 && rtt > 0, "{err} {rtt}");
    // A target 10 s ahead would need a shift: test only that the probe sees it (shifting the host clock
    // is not something a test may do).
    let (err, _) = c.probe_clock(10_000_000_000, 3).unwrap();
    assert!((err + 10_000_000_000).abs() < 3_000_000, "{err}");
}

#[test]
fn privileged_clock_shift_by_zero() {
    let a = PlainAgent::start("shift");
    let c = a.client();
    let before = c.clock_read().unwrap();
    let after = c.clock_shift(0).unwrap();
    assert!(after.realtime_ns >= before.realtime_ns - 1_000_000);
    let s = c.sync_clock(0).unwrap();
    assert_eq!(s.steps, 0, "{s:?}");
    assert!(matches!(c.call(&clade_agent::Request::Hello).unwrap(), Reply::Hello(_)));
}

#[test]
fn connect_wait_finds_a_starting_agent() {
    let dir = common::tempdir("wait");
    let sock = dir.join("late.sock");
    let s2 = sock.clone();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        std::process::Command::new(common::agent_bin())
            .arg("serve")
            .arg("--listen")
            .arg(format!("unix:{}", s2.display()))
            .spawn()
            .unwrap()
    });
    let (c, h) = clade_agent::AgentClient::connect_unix_wait(&sock, Duration::from_secs(10)).unwrap();
    assert_eq!(h.role, "serve");
    c.hello().unwrap();
    let mut child = starter.join().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let missing = clade_agent::AgentClient::connect_unix_wait(dir.join("never.sock"), Duration::from_millis(50));
    assert!(matches!(missing, Err(ClientError::Io(_))));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stdout_events_are_tagged_and_ordered() {
    let a = PlainAgent::start("events");
    let c = a.client();
    let mut p = c.exec(sh("echo one; sleep 0.1; echo two >&2; exit 0")).unwrap();
    let mut seen = Vec::new();
    while let Some(ev) = p.next_event(Duration::from_secs(5)).unwrap() {
        seen.push(ev);
    }
    assert_eq!(seen.last(), Some(&ProcEvent::Exit(clade_agent::ExitStatus { code: Some(0), signal: None })));
    assert!(seen.contains(&ProcEvent::Stdout(b"one\n".to_vec())));
    assert!(seen.contains(&ProcEvent::Stderr(b"two\n".to_vec())));
}
