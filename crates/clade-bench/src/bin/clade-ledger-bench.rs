//! Ledger figures, each printed as one JSON line: the latency of recording a mark (one durable
//! `BEGIN IMMEDIATE` transaction, `synchronous = FULL`), of reading a head, a branch's marks and the
//! GC roots, of a collection, and the throughput of two processes writing one ledger against one.
//!
//! `clade-ledger-bench [--marks N]` runs them in a fresh directory under the temp dir. The writing processes
//! are clade-ledger's `ledger-writer` (the concurrency test's second process too), found beside this binary.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use clade_ledger::{Backend, BranchId, CollectOptions, Ledger, NewBranch, NewMark, RetentionPolicy};
use serde_json::json;

fn new_mark(branch: &BranchId, i: usize) -> NewMark {
    NewMark::on(branch.clone(), Backend::Vm)
        .label(format!("m{i}"))
        .manifest("ram", format!("ram-{branch}-{i}"))
        .manifest("disk", format!("disk-{}", i / 10))
        .sizes(1 << 30, 4 << 20)
}

/// `ledger-writer PATH BRANCH COUNT`, started: cargo builds it beside this binary.
fn writer(path: &Path, branch: &BranchId, count: usize) -> std::io::Result<std::process::Child> {
    let exe = std::env::current_exe()?.with_file_name("ledger-writer");
    Command::new(&exe)
        .arg(path)
        .arg(branch.as_str())
        .arg(count.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e} (cargo build -p clade-ledger)", exe.display())))
}

/// A writer's answer line, and whether it succeeded.
fn finished(child: std::process::Child) -> std::io::Result<(bool, serde_json::Value)> {
    let out = child.wait_with_output()?;
    let v = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    Ok((out.status.success(), v))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed().as_secs_f64() * 1e3)
}

fn bench(dir: &Path, marks: usize) -> Result<(), Box<dyn std::error::Error>> {
    let path = dir.join("ledger.db");
    let l = Ledger::open(&path)?;
    let b = l.create_branch(&NewBranch { policy: RetentionPolicy::thin(10), ..Default::default() })?;
    let mut lat = Vec::with_capacity(marks);
    for i in 0..marks {
        let (r, ms) = timed(|| l.add_mark(&new_mark(&b.id, i)));
        r?;
        lat.push(ms);
    }
    lat.sort_by(f64::total_cmp);
    let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    println!(
        "{}",
        json!({"figure": "add_mark_ms", "marks": marks, "mean": mean, "p50": percentile(&lat, 0.5),
               "p99": percentile(&lat, 0.99), "max": percentile(&lat, 1.0)})
    );

    let reps = 200;
    let (_, head_ms) = timed(|| (0..reps).try_for_each(|_| l.head(&b.id).map(|_| ())));
    let (all, marks_ms) = timed(|| l.marks(&b.id));
    let (roots, roots_ms) = timed(|| l.live_manifests());
    println!(
        "{}",
        json!({"figure": "read_ms", "head": head_ms / reps as f64, "marks_of_branch": marks_ms,
               "marks": all?.len(), "live_manifests": roots_ms, "manifests": roots?.len()})
    );

    let (dry, dry_ms) = timed(|| l.collect(&CollectOptions { dry_run: true, branch: None }));
    let (real, real_ms) = timed(|| l.collect(&CollectOptions::default()));
    let (dry, real) = (dry?, real?);
    println!(
        "{}",
        json!({"figure": "collect_ms", "dry_run": dry_ms, "real": real_ms, "marks": marks,
               "deleted": real.deleted.len(), "kept": real.kept.len(),
               "unreferenced_manifests": real.unreferenced_manifests.len(),
               "dry_equals_real": dry.deleted == real.deleted})
    );

    // Throughput: one process writing 2n marks against two processes writing n each.
    let n = (marks / 4).max(50);
    let solo = l.create_branch(&NewBranch::default())?;
    let (one, solo_ms) = timed(|| writer(&path, &solo.id, 2 * n).and_then(finished));
    let pa = l.create_branch(&NewBranch::default())?;
    let pb = l.create_branch(&NewBranch::default())?;
    let t = Instant::now();
    let (a, b) = (writer(&path, &pa.id, n)?, writer(&path, &pb.id, n)?);
    let (a, b) = (finished(a)?, finished(b)?);
    let pair_ms = t.elapsed().as_secs_f64() * 1e3;
    let one = one?;
    println!(
        "{}",
        json!({"figure": "two_process_writes", "marks_each": n, "one_process_ms": solo_ms,
               "two_processes_ms": pair_ms, "ratio_two_over_one": pair_ms / solo_ms,
               "writers_ok": one.0 && a.0 && b.0, "writers": [one.1, a.1, b.1]})
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let marks = match args.as_slice() {
        [] => 1000,
        [flag, n] if flag == "--marks" => match n.parse() {
            Ok(n) => n,
            Err(_) => {
                eprintln!("--marks takes a number, got {n:?}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: clade-ledger-bench [--marks N]");
            return ExitCode::from(2);
        }
    };
    let dir: PathBuf = std::env::temp_dir().join(format!("clade-ledger-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let r = bench(&dir, marks);
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}
