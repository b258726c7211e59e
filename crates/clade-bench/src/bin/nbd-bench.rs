//! nbd-bench: clade's NBD server side by side with `qemu-nbd -f raw` serving a raw file of the same
//! content, in one run, printing one JSON line per figure and per ratio.
//!
//! - `seq_read`: `nbdcopy URI null:` of the whole image, warm cache, best of `--reps`.
//! - `rand_read`: `qemu-img bench -t none -s 4k -d 32` with a 1 MiB + 4 KiB stride (which wraps
//!   around the image, so every request lands on a different MiB), IOPS, best of `--reps`.
//! - `snapshot` (with a store backend): the same 256 MiB dirty set written through NBD into a
//!   1 GiB and an 8 GiB disk, then `Export::snapshot()` timed on each.
//!
//! Usage: `nbd-bench [--size-mib 1024] [--reps 3] [--rand-count 100000] [--snapshot-mib 256]
//! [--only read|snapshot] [--dir DIR] [--quick]` (`--quick`: 256 MiB image, one rep, 20k random
//! reads, 64 MiB dirty; flags after it override it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clade_nbd::control::{control_path, serve_control};
use clade_nbd::{BlockSource, Export, FileSource, Server};
use serde_json::json;

struct Opts {
    size_mib: u64,
    reps: usize,
    rand_count: u64,
    dir: Option<PathBuf>,
    snapshot_mib: u64,
    only: String,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts { size_mib: 1024, reps: 3, rand_count: 100_000, dir: None, snapshot_mib: 256, only: "all".into() };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--size-mib" => o.size_mib = val()?.parse().map_err(|e| format!("--size-mib: {e}"))?,
            "--reps" => o.reps = val()?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--rand-count" => o.rand_count = val()?.parse().map_err(|e| format!("--rand-count: {e}"))?,
            "--snapshot-mib" => o.snapshot_mib = val()?.parse().map_err(|e| format!("--snapshot-mib: {e}"))?,
            "--dir" => o.dir = Some(PathBuf::from(val()?)),
            "--only" => o.only = val()?,
            "--quick" => {
                (o.size_mib, o.reps, o.rand_count, o.snapshot_mib) = (256, 1, 20_000, 64);
            }
            other => return Err(format!("unknown argument {other}; see the module docs for usage")),
        }
    }
    Ok(o)
}

fn emit(v: serde_json::Value) {
    println!("{v}");
}

/// A figure line for the report: `value` against `bar` (`at_least` or at most), with the verdict.
fn figure(name: &str, value: f64, unit: &str, at_least: bool, bar: f64, extra: serde_json::Value) {
    let (cmp, pass) = if at_least { (">=", value >= bar) } else { ("<=", value <= bar) };
    let mut v = json!({"name": name, "value": value, "unit": unit, "bar": format!("{cmp} {bar}"), "pass": pass});
    if let serde_json::Value::Object(m) = extra {
        for (k, x) in m {
            v[k] = x;
        }
    }
    emit(v);
}

/// Writes `size` bytes of fast pseudo-random data (incompressible, no zero blocks).
fn make_raw(path: &Path, size: u64) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::with_capacity(4 << 20, std::fs::File::create(path)?);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..size / (1 << 20) {
        for c in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&buf)?;
    }
    f.flush()
}

fn wait_socket(p: &Path) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(p).is_err() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn uri(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

fn timed(cmd: &mut Command) -> Result<(f64, String), String> {
    let t = Instant::now();
    let out = cmd.output().map_err(|e| format!("spawn: {e}"))?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(format!("{:?} failed: {}", cmd, String::from_utf8_lossy(&out.stderr)));
    }
    Ok((secs, String::from_utf8_lossy(&out.stdout).into_owned()))
}

struct QemuNbd(Child);
impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts clade's server in this process (its own runtime) on `sock` with `export`.
fn clade_server(rt: &tokio::runtime::Runtime, sock: &Path, export: Arc<Export>) -> Result<Arc<Server>, String> {
    let server = Server::new();
    server.add_export("bench", export);
    let _g = rt.enter();
    let l = Server::bind_unix(sock).map_err(|e| format!("bind {}: {e}", sock.display()))?;
    let c = Server::bind_unix(&control_path(sock)).map_err(|e| format!("bind control: {e}"))?;
    rt.spawn(server.clone().serve_unix(l));
    rt.spawn(serve_control(server.clone(), c));
    Ok(server)
}

fn seq_read(targets: &[(&str, String)], reps: usize, size: u64) -> Result<Vec<f64>, String> {
    let mut best = vec![0f64; targets.len()];
    for (_, u) in targets {
        timed(Command::new("nbdcopy").arg(u).arg("null:"))?; // warm up
    }
    for rep in 0..reps {
        for (i, (name, u)) in targets.iter().enumerate() {
            let (secs, _) = timed(Command::new("nbdcopy").arg(u).arg("null:"))?;
            let mbs = size as f64 / secs / 1e6;
            emit(json!({"bench":"seq_read","server":name,"rep":rep,"secs":secs,"mb_per_s":mbs}));
            best[i] = best[i].max(mbs);
        }
    }
    Ok(best)
}

fn rand_read(targets: &[(&str, String)], reps: usize, count: u64) -> Result<Vec<f64>, String> {
    let mut best = vec![0f64; targets.len()];
    for rep in 0..reps {
        for (i, (name, u)) in targets.iter().enumerate() {
            let (secs, _) = timed(
                Command::new("qemu-img")
                    .args(["bench", "-f", "raw", "-t", "none", "-d", "32", "-s", "4k", "-S", "1052672", "-c"])
                    .arg(count.to_string())
                    .arg(u),
            )?;
            let iops = count as f64 / secs;
            emit(json!({"bench":"rand_read_4k","server":name,"rep":rep,"secs":secs,"iops":iops}));
            best[i] = best[i].max(iops);
        }
    }
    Ok(best)
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("nbd-bench: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<(), String> {
    let o = parse()?;
    let tmp = tempfile_dir(o.dir.as_deref())?;
    let dir = tmp.as_path();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    if o.only != "snapshot" {
        reads(&o, &rt, dir)?;
    }
    if o.only != "read" {
        store_bench::snapshot(&rt, dir, o.snapshot_mib)?;
    }
    Ok(())
}

fn reads(o: &Opts, rt: &tokio::runtime::Runtime, dir: &Path) -> Result<(), String> {
    let size = o.size_mib << 20;
    let raw = dir.join("image.raw");
    let t = Instant::now();
    make_raw(&raw, size).map_err(|e| format!("writing {}: {e}", raw.display()))?;
    emit(json!({"bench":"setup","what":"raw image","mib":o.size_mib,"secs":t.elapsed().as_secs_f64()}));

    let qsock = dir.join("qemu-nbd.sock");
    let child = Command::new("qemu-nbd")
        .args(["-f", "raw", "-r", "-t", "-e", "8", "-x", "", "-k"])
        .arg(&qsock)
        .arg(&raw)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("qemu-nbd: {e}"))?;
    let _qemu = QemuNbd(child);
    wait_socket(&qsock);

    let csock = dir.join("clade-file.sock");
    let file: Arc<dyn BlockSource> = Arc::new(FileSource::open(&raw).map_err(|e| e.to_string())?);
    clade_server(rt, &csock, Arc::new(Export::new(file, true, None)))?;

    let mut targets = vec![("qemu-nbd", uri(&qsock)), ("clade-file", uri(&csock))];
    let store_target = store_bench::setup(rt, dir, &raw)?;
    if let Some((name, sock)) = &store_target {
        targets.push((name, uri(sock)));
    }

    let seq = seq_read(&targets, o.reps, size)?;
    for (i, (name, _)) in targets.iter().enumerate().skip(1) {
        let n = format!("nbd sequential read, {name} / qemu-nbd");
        figure(&n, seq[i] / seq[0], "x", true, 0.9, json!({"bench": "seq_read", "server": name}));
    }
    let rnd = rand_read(&targets, o.reps, o.rand_count)?;
    for (i, (name, _)) in targets.iter().enumerate().skip(1) {
        let n = format!("nbd random 4 KiB reads, {name} / qemu-nbd");
        figure(&n, rnd[i] / rnd[0], "x", true, 0.8, json!({"bench": "rand_read_4k", "server": name}));
    }
    Ok(())
}

/// The temporary directory (removed at exit unless `--dir` was given).
enum TmpDir {
    Kept(PathBuf),
    Temp(tempfile::TempDir),
}
impl TmpDir {
    fn as_path(&self) -> &Path {
        match self {
            TmpDir::Kept(p) => p,
            TmpDir::Temp(t) => t.path(),
        }
    }
}
fn tempfile_dir(dir: Option<&Path>) -> Result<TmpDir, String> {
    match dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            Ok(TmpDir::Kept(d.to_owned()))
        }
        None => tempfile::Builder::new()
            .prefix("nbd-bench")
            .tempdir_in("/var/tmp")
            .map(TmpDir::Temp)
            .map_err(|e| e.to_string()),
    }
}

/// The store-backed parts: the same image served from a manifest, and snapshot cost vs disk size.
mod store_bench {
    use super::*;
    use clade_nbd::store_export;
    use clade_store::{ImageKind, Store, StoreConfig};

    fn open(dir: &Path, cache: u64) -> Result<Store, String> {
        Store::open(&dir.join("store"), StoreConfig { cache_bytes: cache, ..StoreConfig::default() })
            .map_err(|e| e.to_string())
    }

    pub fn setup(
        rt: &tokio::runtime::Runtime,
        dir: &Path,
        raw: &Path,
    ) -> Result<Option<(&'static str, PathBuf)>, String> {
        let size = std::fs::metadata(raw).map_err(|e| e.to_string())?.len();
        let store = open(dir, 2 * size + (64 << 20))?;
        let t = Instant::now();
        let put = store.put_file(raw, ImageKind::Disk).map_err(|e| e.to_string())?;
        emit(
            json!({"bench":"setup","what":"store put_file","secs":t.elapsed().as_secs_f64(),"bytes_stored":put.bytes_stored}),
        );
        let id = put.id.ok_or("no manifest")?;
        let sock = dir.join("clade-store.sock");
        let export = store_export(&store, &id, true).map_err(|e| e.to_string())?;
        clade_server(rt, &sock, Arc::new(export))?;
        Ok(Some(("clade-store", sock)))
    }

    /// A base of `size` bytes with one distinct 4 KiB data block per MiB, so its manifest grows with
    /// the disk; then `mib` MiB of distinct 4 KiB blocks at a 16 KiB stride over the first GiB.
    pub fn snapshot(_rt: &tokio::runtime::Runtime, dir: &Path, mib: u64) -> Result<(), String> {
        let store = open(dir, 256 << 20)?;
        let mut best = [f64::MAX; 2];
        let mut seed: u64 = 0x1234_5678_9abc_def1;
        let mut block = move |buf: &mut [u8]| {
            for c in buf.chunks_exact_mut(8) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                c.copy_from_slice(&seed.to_le_bytes());
            }
        };
        let mut buf = vec![0u8; 4096];
        // Alternate sizes and keep the best of each, and sync before each snapshot, so page-cache
        // writeback of earlier steps is not billed to whichever snapshot happens to run next.
        for (slot, gib) in [(0usize, 1u64), (1, 8), (0, 1), (1, 8)] {
            let size = gib << 30;
            let t = Instant::now();
            let mut b = store.derive(None, size).map_err(|e| e.to_string())?.kind(ImageKind::Disk);
            for mb in 0..size >> 20 {
                block(&mut buf);
                b.write(mb << 20, &buf).map_err(|e| e.to_string())?;
            }
            let base = b.finish().map_err(|e| e.to_string())?.id.ok_or("no manifest")?;
            let base_secs = t.elapsed().as_secs_f64();
            let export = store_export(&store, &base, false).map_err(|e| e.to_string())?;
            let t = Instant::now();
            let blocks = (mib << 20) / 4096;
            for i in 0..blocks {
                block(&mut buf);
                export.write((i * 16384) % (1 << 30), &buf).map_err(|e| e.to_string())?;
            }
            let write_secs = t.elapsed().as_secs_f64();
            let dirty = export.stats().dirty_blocks;
            let _ = Command::new("sync").status();
            let t = Instant::now();
            let id = export.snapshot().map_err(|e| e.to_string())?;
            let snap = t.elapsed().as_secs_f64();
            let extents = store
                .manifest(&id.parse().map_err(|e: clade_store::StoreError| e.to_string())?)
                .map_err(|e| e.to_string())?
                .extents
                .len();
            emit(
                json!({"bench":"snapshot","disk_gib":gib,"dirty_mib":mib,"dirty_blocks":dirty,"base_build_secs":base_secs,
                "overlay_write_secs":write_secs,"snapshot_secs":snap,"manifest_extents":extents}),
            );
            best[slot] = best[slot].min(snap);
        }
        figure(
            "nbd snapshot time, 8 GiB / 1 GiB export (same dirty data)",
            best[1] / best[0],
            "x",
            false,
            1.5,
            json!({"bench": "snapshot", "best_1gib_secs": best[0], "best_8gib_secs": best[1]}),
        );
        Ok(())
    }
}
