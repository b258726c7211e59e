//! `agent-bench`: the agent's figures (docs/agent.md), as ratios measured side by side in one run.
//!
//! It starts `clade-agent serve` on a unix socket (the `ct` channel) as a plain process and again as
//! as a process inside `unshare -p -m -n -u -i --fork` (a namespaced process), and
//! prints one JSON line per figure with its bar:
//! hello round trip p50 (<= 1 ms), exec of /bin/true to exit p50 vs host fork+exec (<= 3x), 100 MiB file
//! read and write vs `cat` on the host (>= 30%), binary size (<= 8 MiB), idle RSS (<= 8 MiB).
//!
//! Usage: `agent-bench [--agent PATH] [--mib N] [--iters N]` (the agent defaults to `clade-agent` next
//! to this binary; build both with `--profile release-small` for the size figure).

use clade_agent::{AgentClient, ExecSpec};
use serde_json::json;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn emit(figure: &str, value: f64, unit: &str, bar: Option<(&str, f64)>, extra: serde_json::Value) {
    // A figure line for the report (name, value, unit, bar, pass); reported figures have no bar.
    let mut v = json!({"bench": "agent", "figure": figure, "name": format!("agent {figure}"),
                       "value": (value * 1000.0).round() / 1000.0, "unit": unit, "bar": "reported", "pass": true});
    if let Some((cmp, b)) = bar {
        let ok = if cmp == "<=" { value <= b } else { value >= b };
        v["bar"] = json!(format!("{cmp} {b}"));
        v["ok"] = json!(ok);
        v["pass"] = json!(ok);
    }
    if let serde_json::Value::Object(m) = extra {
        for (k, x) in m {
            v[k] = x;
        }
    }
    println!("{v}");
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn time_us(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

struct Agent {
    child: Child,
    sock: PathBuf,
}

impl Agent {
    fn start(agent: &Path, dir: &Path, name: &str, namespaced: bool) -> Agent {
        let sock = dir.join(format!("{name}.sock"));
        let mut cmd = if namespaced {
            let mut c = Command::new("unshare");
            c.args(["-p", "-m", "-n", "-u", "-i", "--fork"]).arg(agent);
            c
        } else {
            Command::new(agent)
        };
        cmd.arg("serve").arg("--listen").arg(format!("unix:{}", sock.display()));
        let child = cmd.stdin(Stdio::null()).stderr(Stdio::null()).spawn().expect("starting the agent");
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "agent socket {} never appeared", sock.display());
            std::thread::sleep(Duration::from_millis(5));
        }
        Agent { child, sock }
    }

    fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock).expect("connecting to the agent")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // the namespaced agent is unshare's child: kill it by its pid first
        let id = self.child.id();
        if let Ok(kids) = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children")) {
            for k in kids.split_whitespace() {
                let _ = Command::new("kill").arg("-KILL").arg(k).status();
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn hello_p50(c: &AgentClient, iters: usize) -> (f64, f64) {
    for _ in 0..100 {
        c.hello().unwrap();
    }
    let v: Vec<f64> = (0..iters).map(|_| time_us(|| drop(c.hello().unwrap()))).collect();
    (pct(v.clone(), 0.5), pct(v, 0.99))
}

fn exec_p50(c: &AgentClient, iters: usize) -> f64 {
    let v: Vec<f64> = (0..iters)
        .map(|_| time_us(|| assert!(c.run(ExecSpec::new(["/bin/true"])).unwrap().status.success())))
        .collect();
    pct(v, 0.5)
}

fn host_exec_p50(iters: usize) -> f64 {
    let v: Vec<f64> =
        (0..iters).map(|_| time_us(|| assert!(Command::new("/bin/true").status().unwrap().success()))).collect();
    pct(v, 0.5)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut agent_path = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("clade-agent")));
    let (mut mib, mut iters) = (100usize, 1000usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--agent" => agent_path = args.next().map(PathBuf::from),
            "--mib" => mib = args.next().and_then(|v| v.parse().ok()).unwrap_or(mib),
            "--iters" => iters = args.next().and_then(|v| v.parse().ok()).unwrap_or(iters),
            _ => {
                eprintln!("usage: agent-bench [--agent PATH] [--mib N] [--iters N]");
                std::process::exit(2);
            }
        }
    }
    let agent_path = agent_path.expect("no agent binary: pass --agent");
    let dir = std::env::temp_dir().join(format!("agent-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let size = std::fs::metadata(&agent_path).map(|m| m.len()).unwrap_or(0);
    emit(
        "binary_size_mib",
        size as f64 / 1048576.0,
        "MiB",
        Some(("<=", 8.0)),
        json!({"path": agent_path.display().to_string()}),
    );

    let plain = Agent::start(&agent_path, &dir, "plain", false);
    let c = plain.client();
    c.hello().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    emit(
        "idle_rss_mib",
        rss_kib(plain.child.id()) as f64 / 1024.0,
        "MiB",
        Some(("<=", 8.0)),
        json!({"backend": "ct-plain"}),
    );

    let (p50, p99) = hello_p50(&c, iters);
    emit(
        "hello_rtt_p50_us",
        p50,
        "us",
        Some(("<=", 1000.0)),
        json!({"backend": "ct-plain", "p99_us": p99, "n": iters}),
    );

    let n = (iters / 3).max(50);
    let host = host_exec_p50(n);
    let agent = exec_p50(&c, n);
    let host2 = host_exec_p50(n);
    let host = host.min(host2);
    emit(
        "exec_true_ratio",
        agent / host,
        "x host fork+exec",
        Some(("<=", 3.0)),
        json!({"backend": "ct-plain", "agent_p50_us": agent, "host_p50_us": host, "n": n}),
    );

    // 100 MiB through the agent vs cat on the host (page cache hot, best of 3 each)
    let src = dir.join("src.bin");
    let data: Vec<u8> = (0..mib * 1048576).map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[3]).collect();
    std::fs::write(&src, &data).unwrap();
    let bytes = data.len() as f64;
    let src_s = src.display().to_string();
    let cat_read = max_of(3, || {
        let t = Instant::now();
        let st = Command::new("cat").arg(&src).stdout(Stdio::null()).status().unwrap();
        assert!(st.success());
        bytes / t.elapsed().as_secs_f64()
    });
    let agent_read = max_of(3, || {
        let t = Instant::now();
        let n = c.read_file(&src_s, &mut std::io::sink()).unwrap();
        assert_eq!(n as usize, data.len());
        bytes / t.elapsed().as_secs_f64()
    });
    emit(
        "file_read_vs_cat",
        agent_read / cat_read,
        "fraction of cat",
        Some((">=", 0.30)),
        json!({"backend": "ct-plain", "mib": mib, "agent_mib_s": agent_read / 1048576.0, "cat_mib_s": cat_read / 1048576.0}),
    );
    let dst = dir.join("dst.bin");
    let cat_write = max_of(3, || {
        let out = std::fs::File::create(&dst).unwrap();
        let t = Instant::now();
        Command::new("cat").arg(&src).stdout(out).status().unwrap();
        bytes / t.elapsed().as_secs_f64()
    });
    let dst_s = dir.join("dst-agent.bin").display().to_string();
    let agent_write = max_of(3, || {
        // like cat's File::create above, the old file goes before the clock starts
        let _ = std::fs::remove_file(&dst_s);
        let t = Instant::now();
        c.write_file_bytes(&dst_s, &data, None).unwrap();
        bytes / t.elapsed().as_secs_f64()
    });
    let mut check = Vec::new();
    std::fs::File::open(&dst_s).unwrap().read_to_end(&mut check).unwrap();
    assert!(check == data, "the written file differs");
    emit(
        "file_write_vs_cat",
        agent_write / cat_write,
        "fraction of cat",
        Some((">=", 0.30)),
        json!({"backend": "ct-plain", "mib": mib, "agent_mib_s": agent_write / 1048576.0, "cat_mib_s": cat_write / 1048576.0}),
    );
    emit("loaded_rss_mib", rss_kib(plain.child.id()) as f64 / 1024.0, "MiB", None, json!({"backend": "ct-plain"}));
    drop(c);
    drop(plain);

    // the same agent as a namespaced process (pid, mount, net, uts, ipc namespaces)
    let ns = Agent::start(&agent_path, &dir, "ns", true);
    let c = ns.client();
    let (p50, p99) = hello_p50(&c, iters);
    emit("hello_rtt_p50_us", p50, "us", Some(("<=", 1000.0)), json!({"backend": "ct-ns", "p99_us": p99, "n": iters}));
    let host = host_exec_p50(n);
    let agent = exec_p50(&c, n);
    emit(
        "exec_true_ratio",
        agent / host,
        "x host fork+exec",
        Some(("<=", 3.0)),
        json!({"backend": "ct-ns", "agent_p50_us": agent, "host_p50_us": host, "n": n}),
    );
    drop(c);
    drop(ns);
    let _ = std::fs::remove_dir_all(&dir);
}

fn max_of<F: FnMut() -> f64>(n: usize, mut f: F) -> f64 {
    (0..n).map(|_| f()).fold(0.0, f64::max)
}
