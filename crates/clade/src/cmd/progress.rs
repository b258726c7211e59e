//! Progress for the CLI's long operations (template and base builds, suspends, pulls from the blob tier): an
//! indicatif spinner or bar when stderr is a terminal, plain lines otherwise (logs, CI, pipes). Everything goes
//! to stderr, so stdout carries only the result (one JSON document with `--json`). The libraries only report
//! (clade-template's `on_progress`, the base build's step lines); drawing is this layer's business.
//! `CLADE_PROGRESS=plain` forces plain lines on a terminal.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Whether to draw (stderr is a terminal and plain lines were not asked for).
pub fn interactive() -> bool {
    std::io::stderr().is_terminal() && std::env::var("CLADE_PROGRESS").map_or(true, |v| v != "plain")
}

fn spinner(prefix: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    let style = ProgressStyle::with_template("{spinner:.cyan} [{elapsed_precise}] {prefix}: {wide_msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    pb.set_style(style);
    pb.set_prefix(prefix.to_string());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// A build's step lines: on a terminal each finished step is printed above a spinner that shows the step in
/// progress and the time so far; otherwise each line is printed as it comes.
#[derive(Clone)]
pub struct Steps {
    bar: Option<ProgressBar>,
}

impl Steps {
    pub fn new(what: &str) -> Steps {
        Steps { bar: interactive().then(|| spinner(what)) }
    }

    /// One step line (already formatted, e.g. `[  1.2 s] base: marking`).
    pub fn line(&self, line: &str) {
        match &self.bar {
            Some(pb) => {
                pb.println(line);
                pb.set_message(line.trim().to_string());
            }
            None => eprintln!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
    }
}

/// Runs `f` (a long blocking call with no progress of its own, such as a suspend) under a spinner naming it;
/// without a terminal, one line before and one after with the time taken.
pub fn around<T>(what: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let start = Instant::now();
    let bar = if interactive() {
        let pb = spinner(what);
        pb.set_message("working");
        Some(pb)
    } else {
        eprintln!("clade: {what} ...");
        None
    };
    let out = f();
    match bar {
        Some(pb) => pb.finish_and_clear(),
        None => eprintln!(
            "clade: {what}: {} after {:.1} s",
            if out.is_ok() { "done" } else { "failed" },
            start.elapsed().as_secs_f64()
        ),
    }
    out
}

/// Bytes arriving towards a known total (a pull from the blob tier): a bar with rate and ETA on a terminal;
/// otherwise a line every 5 s and one at the end.
pub struct Bytes {
    bar: Option<ProgressBar>,
    what: String,
    total: u64,
    start: Instant,
    last_line: Instant,
}

impl Bytes {
    pub fn new(what: &str, total: u64) -> Bytes {
        let bar = interactive().then(|| {
            let pb = ProgressBar::new(total);
            let style = ProgressStyle::with_template(
                "{prefix} [{bar:30.cyan/blue}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            pb.set_style(style.progress_chars("=> "));
            pb.set_prefix(what.to_string());
            pb.enable_steady_tick(Duration::from_millis(200));
            pb
        });
        if bar.is_none() {
            eprintln!("clade: {what}: {} MiB", total >> 20);
        }
        Bytes { bar, what: what.to_string(), total, start: Instant::now(), last_line: Instant::now() }
    }

    /// How far it got (bytes, at most the total).
    pub fn set(&mut self, pos: u64) {
        let pos = pos.min(self.total);
        match &self.bar {
            Some(pb) => pb.set_position(pos),
            None if self.last_line.elapsed() >= Duration::from_secs(5) => {
                self.last_line = Instant::now();
                eprintln!(
                    "clade: {}: {} of {} MiB ({:.0}%)",
                    self.what,
                    pos >> 20,
                    self.total >> 20,
                    pos as f64 * 100.0 / self.total.max(1) as f64
                );
            }
            None => {}
        }
    }

    pub fn finish(self, ok: bool) {
        let secs = self.start.elapsed().as_secs_f64();
        match &self.bar {
            Some(pb) => pb.finish_and_clear(),
            None => eprintln!(
                "clade: {}: {} ({} MiB in {secs:.1} s)",
                self.what,
                if ok { "done" } else { "failed" },
                self.total >> 20
            ),
        }
    }
}
