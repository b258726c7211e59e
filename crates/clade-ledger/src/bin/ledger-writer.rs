//! ledger-writer: a second process writing one ledger file, as the daemon and a CLI do at once. The concurrency
//! test and the ledger bench (`clade-bench`'s `clade-ledger-bench`) run it beside their own writes.
//!
//! `ledger-writer PATH BRANCH COUNT` adds COUNT marks to BRANCH (retrying a `Busy`, of which there should be
//! none within the busy timeout) and prints `{"writer_ms", "marks", "busy_retries"}`.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use clade_ledger::{Backend, BranchId, Ledger, LedgerError, NewMark};

fn write_marks(path: &Path, branch: &BranchId, count: usize) -> Result<(f64, usize), LedgerError> {
    let l = Ledger::open(path)?;
    let mut busy = 0;
    let t = Instant::now();
    for i in 0..count {
        let mark = NewMark::on(branch.clone(), Backend::Vm)
            .label(format!("m{i}"))
            .manifest("ram", format!("ram-{branch}-{i}"))
            .manifest("disk", format!("disk-{}", i / 10))
            .sizes(1 << 30, 4 << 20);
        loop {
            match l.add_mark(&mark) {
                Ok(_) => break,
                Err(LedgerError::Busy(_)) => busy += 1,
                Err(e) => return Err(e),
            }
        }
    }
    Ok((t.elapsed().as_secs_f64() * 1e3, busy))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, branch, count] = args.as_slice() else {
        eprintln!("usage: ledger-writer PATH BRANCH COUNT");
        return ExitCode::from(2);
    };
    let Ok(count) = count.parse::<usize>() else {
        eprintln!("COUNT must be a number, got {count:?}");
        return ExitCode::from(2);
    };
    match write_marks(Path::new(path), &BranchId::new(branch.as_str()), count) {
        Ok((ms, busy)) => {
            println!(r#"{{"writer_ms": {ms}, "marks": {count}, "busy_retries": {busy}}}"#);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ledger-writer: {e}");
            ExitCode::FAILURE
        }
    }
}
