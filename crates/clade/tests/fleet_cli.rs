//! `clade fleet`: the real binary over a temp `$CLADE_HOME`, with costs from a bench output file and from a real
//! ledger (SQLite, written through clade-ledger as the supervisor and the CLI write it). No guest is started.

use std::path::Path;
use std::process::{Command, Output};

use clade_ledger::{Backend, Ledger, NewBranch, NewMark, NewOp, NewSandbox};

fn clade(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_clade")).env("CLADE_HOME", home).args(args).output().expect("run clade")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ct_bench(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("ct.jsonl"),
        [
            r#"{"bench":"mark","payload_mib":32,"pause_ms_first":95.0,"pause_ms_second":62.0,"stored_bytes_second":3000000}"#,
            r#"{"bench":"start","i":0,"cold_ms":1500.0,"restore_hygiene_ms":310.0}"#,
            r#"{"bench":"start","i":1,"cold_ms":1500.0,"restore_hygiene_ms":350.0}"#,
        ]
        .join("\n"),
    )
    .unwrap();
}

#[test]
fn without_measured_costs_it_says_how_to_measure() {
    let d = tempfile::tempdir().unwrap();
    let o =
        clade(&d.path().join("home"), &["fleet", "simulate", "--bench-dir", d.path().join("none").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("./x bench vm --quick") && e.contains("--measure") && e.contains("no ledger"), "{e}");
    // It did not create a ledger (or anything) in the home it looked at.
    assert!(!d.path().join("home").exists());
}

#[test]
fn seed004_from_bench_costs_json_with_series_and_sources() {
    let d = tempfile::tempdir().unwrap();
    let bench = d.path().join("bench");
    ct_bench(&bench);
    let home = d.path().join("home");
    let o = clade(&home, &["fleet", "simulate", "--json", "--bench-dir", bench.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["sessions"], 18);
    assert_eq!(v["costs"]["backend"], "ct");
    assert!(v["cost_sources"]["resume_ms"].as_str().unwrap().contains("ct.jsonl"), "{}", v["cost_sources"]);
    let keep = &v["keep_running"];
    let susp = &v["suspend_idle"];
    assert_eq!(keep["peak_hosts"], 3);
    let ratio = v["host_hours_ratio"].as_f64().unwrap();
    assert!(ratio <= 0.5, "ratio {ratio}");
    assert_eq!(v["figure"]["pass"], true);
    // p99 resume wait comes from the measured samples (310/350 ms, plus a measured suspend when room was made).
    let p99 = susp["p99_resume_wait_ms"].as_f64().unwrap();
    assert!((310.0..=350.0 + 95.0).contains(&p99), "{p99}");
    // Both series are step functions of hosts billed, from the first host to none.
    for arm in [keep, susp] {
        let s = arm["series"].as_array().unwrap();
        assert!(s.len() >= 2);
        assert_eq!(s.last().unwrap()[1], 0.0);
        assert!(s.iter().all(|p| p[1].as_f64().unwrap() <= 3.0));
    }
    for k in ["vcpu_h", "memory_base_gib_h", "memory_dirty_gib_h", "disk_base_gib_h", "disk_dirty_gib_h"] {
        assert!(susp["terms"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    // The text form prints the same figure and where each cost came from.
    let o = clade(&home, &["fleet", "simulate", "--bench-dir", bench.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("PASS") && text.contains("ct.jsonl") && text.contains("suspend-idle"), "{text}");
}

#[test]
fn replays_a_trace_file_and_rejects_a_bad_one() {
    let d = tempfile::tempdir().unwrap();
    let bench = d.path().join("bench");
    ct_bench(&bench);
    let home = d.path().join("home");
    let o = clade(&home, &["fleet", "trace", "--scenario", "seed004-independent", "--hours", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let trace = d.path().join("t.jsonl");
    std::fs::write(&trace, &o.stdout).unwrap();
    let o =
        clade(&home, &["fleet", "simulate", trace.to_str().unwrap(), "--json", "--bench-dir", bench.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!((v["hours"].as_f64().unwrap() - 2.0).abs() < 1e-9);
    assert!(v["keep_running"]["host_hours"].as_f64().unwrap() > v["suspend_idle"]["host_hours"].as_f64().unwrap());

    let bad = d.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"kind\":\"session\",\"id\":\"a\",\"shape\":\"coding\",\"arrive_s\":0,\"leave_s\":10}\n{\"kind\":\"session\",\"id\":\"b\",\"shape\":\"coding\",\"arrive_s\":5,\"leave_s\":1}\n").unwrap();
    let o = clade(&home, &["fleet", "simulate", bad.to_str().unwrap(), "--bench-dir", bench.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("line 2") && stderr(&o).contains("arrive_s < leave_s"), "{}", stderr(&o));
    // A host too small for the build agent is refused with what to change.
    let o = clade(&home, &["fleet", "simulate", "--host-disk-gib", "100", "--bench-dir", bench.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("does not fit") && stderr(&o).contains("--host-disk-gib"), "{}", stderr(&o));
}

#[test]
fn costs_from_the_ledgers_suspend_and_resume_ops() {
    let d = tempfile::tempdir().unwrap();
    let home = d.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    {
        let l = Ledger::open(home.join("ledger.db")).unwrap();
        let b = l.create_branch(&NewBranch::default()).unwrap();
        let s = l
            .create_sandbox(&NewSandbox {
                id: None,
                backend: Backend::Ct,
                branch: b.id.clone(),
                origin_mark: None,
                supervisor_pid: None,
                host: None,
            })
            .unwrap();
        for (i, (sus, res)) in [(120u64, 800u64), (140, 900)].into_iter().enumerate() {
            let m =
                l.add_mark(&NewMark::on(b.id.clone(), Backend::Ct).label("suspend").sizes(1 << 30, 8 << 20)).unwrap();
            let t0 = 1_000_000 + i as i64 * 10_000;
            let mut op = NewOp::ok("suspend", sus).sandbox(s.id.clone()).mark(m.id.clone());
            op.started_ms = Some(t0);
            l.record_op(&op).unwrap();
            let mut op = NewOp::ok("resume", res).sandbox(s.id.clone()).mark(m.id.clone());
            op.started_ms = Some(t0 + 5000);
            l.record_op(&op).unwrap();
        }
    }
    let o = clade(&home, &["fleet", "simulate", "--json", "--source", "ledger"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["costs"]["resume_ms"], serde_json::json!([900.0, 800.0]));
    assert_eq!(v["costs"]["suspend_bytes"], serde_json::json!((8u64 << 20) as f64));
    assert!(v["cost_sources"]["resume_ms"].as_str().unwrap().contains("ledger.db"));
    let p99 = v["suspend_idle"]["p99_resume_wait_ms"].as_f64().unwrap();
    assert!((800.0..=900.0 + 140.0).contains(&p99), "{p99}");
    // Asking for vm costs where only ct ones exist fails with the way out.
    let o = clade(&home, &["fleet", "simulate", "--source", "ledger", "--backend", "vm"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(stderr(&o).contains("no successful vm suspend"), "{}", stderr(&o));
}
