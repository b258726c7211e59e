//! `clade pool fill|ls|drain`: the warm pool of a mark (see `supervisor/pool.rs`). A fork from a mark with a
//! pool claims prepared members and refills the pool in the background.

use std::time::{Duration, Instant};

use clade_core::backend::BackendKind;
use clade_core::engine::Engine;
use clade_core::CladeHome;
use clap::Subcommand;

use clade_host::supervisor::pool;

#[derive(Subcommand)]
pub enum Command {
    /// Keep N prepared restores of a mark (or a template's base) waiting; returns when they are ready.
    Fill {
        from: String,
        #[arg(long)]
        size: usize,
        #[arg(long)]
        backend: Option<BackendKind>,
        /// Return at once instead of waiting for the members to be ready.
        #[arg(long)]
        no_wait: bool,
        #[arg(long)]
        json: bool,
    },
    /// List pools: size, waiting and preparing members.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// End a pool's waiting members and forget its size.
    Drain {
        from: String,
        #[arg(long)]
        backend: Option<BackendKind>,
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: Command) -> anyhow::Result<i32> {
    let home = CladeHome::from_env();
    match cmd {
        Command::Fill { from, size, backend, no_wait, json } => {
            let engine = Engine::open(&home)?;
            let mark = engine.resolve_mark(&from, backend)?;
            let m = mark.id.as_str();
            if engine.mark_state(&mark)?.boots_cold() {
                anyhow::bail!(
                    "{m} is a disk-only mark: its sandboxes boot cold, so there is nothing to restore ahead; \
                     fork it directly, or pool a whole mark of a sandbox booted from it"
                );
            }
            // The members it adds run and hold memory like sandboxes: admission says whether they fit.
            let (ready, starting) = pool::members(&home, m);
            let adding = size.saturating_sub(ready.len() + starting) as u32;
            clade_host::admit::admit(&engine, &mark, adding, false, &|id| {
                anyhow::bail!("a pool fill does not suspend sandboxes ({id})")
            })?;
            pool::set_size(&home, m, size)?;
            let start = Instant::now();
            let started = pool::refill(&home, m)?;
            if !no_wait {
                let log = pool::pool_dir(&home, m).join("pool.log");
                // Members that end before they wait failed: start them again, but not forever.
                let mut restarted = 0;
                loop {
                    let (ready, starting) = pool::members(&home, m);
                    if ready.len() >= size {
                        break;
                    }
                    if start.elapsed() > Duration::from_secs(300) {
                        anyhow::bail!("pool of {m} not full after 300 s; see {}", log.display());
                    }
                    if starting == 0 {
                        if restarted >= size {
                            let text = std::fs::read_to_string(&log).unwrap_or_default();
                            let tail: Vec<&str> = text.lines().rev().take(5).collect();
                            anyhow::bail!(
                                "pool members of {m} keep failing before they are ready; last lines of {}:\n{}",
                                log.display(),
                                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                            );
                        }
                        restarted += pool::refill(&home, m)?;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let (ready, starting) = pool::members(&home, m);
            let out = serde_json::json!({"mark": m, "size": size, "started": started, "ready": ready.len(), "starting": starting, "fill_ms": start.elapsed().as_secs_f64() * 1e3});
            if json {
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!("pool of {m}: {} ready, {} preparing (size {size})", ready.len(), starting);
            }
            Ok(0)
        }
        Command::Ls { json } => {
            let mut rows = Vec::new();
            if let Ok(rd) = std::fs::read_dir(home.run_dir().join("pool")) {
                for e in rd.flatten() {
                    let m = e.file_name().to_string_lossy().into_owned();
                    let (ready, starting) = pool::members(&home, &m);
                    let size = pool::size(&home, &m);
                    if size == 0 && ready.is_empty() && starting == 0 {
                        continue; // a drained pool: nothing to show
                    }
                    rows.push(serde_json::json!({"mark": m, "size": size, "ready": ready.len(), "starting": starting}));
                }
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                for r in rows {
                    println!(
                        "{}  size {} ready {} preparing {}",
                        r["mark"].as_str().unwrap_or(""),
                        r["size"],
                        r["ready"],
                        r["starting"]
                    );
                }
            }
            Ok(0)
        }
        Command::Drain { from, backend, json } => {
            let engine = Engine::open(&home)?;
            let mark = engine.resolve_mark(&from, backend)?;
            let n = pool::drain(&home, mark.id.as_str());
            if json {
                println!("{}", serde_json::json!({"mark": mark.id.as_str(), "ended": n}));
            } else {
                println!("pool of {}: {n} waiting member(s) ended (members still preparing end on their own)", mark.id);
            }
            Ok(0)
        }
    }
}
