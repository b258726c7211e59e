//! store-bench: the store's figures as ratios measured side by side in one run, printed as JSON lines.
//!
//! `store-bench [--size-mib N] [--dir DIR] [--store-dir DIR] [--reps N] [--no-zstd]`: builds an N MiB
//! (default 1024) image of guest-RAM-like pages (zero pages, binaries, text, random bytes in runs) under DIR
//! (default /dev/shm), then measures put vs `b3sum` (each round: b3sum, a put into a fresh store, and
//! writing just the put's new bytes into the store's file system, for reference), a second put, a
//! 1%-changed copy (both as a full put and as a derived mark), get vs `cp`, and compression levels.
//! `--image FILE...` (first on the command line) uses the concatenation of real files instead, e.g. guest RAM
//! files of clade-vm, copied with their holes. Each bar's figure carries name/value/bar/pass for `./x bench`.
//! Everything it creates is deleted at the end.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clade_store::{ImageKind, Store, StoreConfig, BLOCK};
use rand::{Rng, SeedableRng};

fn main() {
    if let Err(e) = run() {
        eprintln!("store-bench: {e}");
        std::process::exit(1);
    }
}

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1).cloned())
}

fn emit(v: serde_json::Value) {
    println!("{v}");
    let _ = std::io::stdout().flush();
}

/// Bytes of files under `dirs` (binaries and text), as material for pages.
fn corpus(dirs: &[&str], limit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = dirs.iter().map(PathBuf::from).collect();
    while let Some(p) = stack.pop() {
        if out.len() >= limit {
            break;
        }
        let Ok(md) = std::fs::symlink_metadata(&p) else { continue };
        if md.is_dir() {
            if let Ok(rd) = std::fs::read_dir(&p) {
                let mut v: Vec<_> = rd.flatten().map(|e| e.path()).collect();
                v.sort();
                stack.extend(v);
            }
        } else if md.is_file() && md.len() > 0 && md.len() < 64 << 20 {
            if let Ok(b) = std::fs::read(&p) {
                out.extend_from_slice(&b);
            }
        }
    }
    out.truncate(limit);
    out
}

fn make_image(path: &Path, size: usize) -> std::io::Result<()> {
    let bins = corpus(&["/usr/bin", "/usr/lib/x86_64-linux-gnu"], 256 << 20);
    let text = corpus(&["/usr/share/doc", "/usr/share/perl", "/usr/include", "/usr/share/man"], 128 << 20);
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(path)?);
    let mut written = 0usize;
    let mut page = vec![0u8; BLOCK];
    while written < size {
        let run = rng.random_range(1..=64usize).min((size - written) / BLOCK);
        let kind = rng.random_range(0..100);
        for _ in 0..run {
            match kind {
                0..=29 => page.fill(0),
                30..=59 if bins.len() > BLOCK => {
                    let o = rng.random_range(0..bins.len() - BLOCK);
                    page.copy_from_slice(&bins[o..o + BLOCK]);
                }
                60..=84 if text.len() > BLOCK => {
                    let o = rng.random_range(0..text.len() - BLOCK);
                    page.copy_from_slice(&text[o..o + BLOCK]);
                }
                _ => rng.fill(&mut page[..]),
            }
            f.write_all(&page)?;
        }
        written += run * BLOCK;
    }
    f.flush()
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn secs<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let t = Instant::now();
    let r = f();
    (t.elapsed().as_secs_f64(), r)
}

/// CPU seconds used so far by this process and by its waited-for children (from /proc/self/stat).
fn cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    let g = |i: usize| f.get(i).copied().unwrap_or(0.0) / 100.0;
    // after ')': state is index 0, utime 11, stime 12, cutime 13, cstime 14
    (g(11) + g(12), g(13) + g(14))
}

fn du(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        if let Ok(rd) = std::fs::read_dir(&p) {
            for e in rd.flatten() {
                match e.metadata() {
                    Ok(m) if m.is_dir() => stack.push(e.path()),
                    Ok(m) => total += m.len(),
                    Err(_) => {}
                }
            }
        }
    }
    total
}

fn sh(cmd: &mut Command) -> Result<(), String> {
    let st = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !st.success() {
        return Err(format!("{cmd:?} failed: {st}"));
    }
    Ok(())
}

/// The data (non-hole) ranges of a file, as `SEEK_DATA`/`SEEK_HOLE` report them.
fn data_ranges(path: &Path) -> std::io::Result<Vec<(u64, u64)>> {
    use rustix::fs::{seek, SeekFrom};
    let f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut out = Vec::new();
    let mut off = 0;
    while off < size {
        let Ok(d) = seek(&f, SeekFrom::Data(off)) else { break };
        let h = seek(&f, SeekFrom::Hole(d)).map_err(std::io::Error::from)?.min(size);
        out.push((d, h));
        off = h.max(d + 1);
    }
    Ok(out)
}

/// Append `src` to `out` at `at`, copying only its data ranges: holes stay holes (a guest RAM file on tmpfs is
/// sparse where the guest never wrote, and that is what clade stores), zero pages inside data stay data.
fn sparse_copy(src: &Path, out: &std::fs::File, at: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(src)?;
    let size = f.metadata()?.len();
    let mut buf = vec![0u8; 8 << 20];
    for (a, b) in data_ranges(src)? {
        let mut p = a;
        while p < b {
            let n = ((b - p) as usize).min(buf.len());
            f.read_exact_at(&mut buf[..n], p)?;
            out.write_all_at(&buf[..n], at + p)?;
            p += n as u64;
        }
    }
    if out.metadata()?.len() < at + size {
        out.set_len(at + size)?;
    }
    Ok(size)
}

/// Punch holes back where `path` had them before (`data` = its data ranges then), without changing a byte:
/// `b3sum` maps its input, and a read fault on a tmpfs hole allocates a zero page, so every b3sum run would
/// make a sparse input dense for the next put.
fn restore_holes(path: &Path, data: &[(u64, u64)]) -> std::io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    let size = f.metadata()?.len();
    let mut prev = 0;
    for &(a, b) in data.iter().chain(std::iter::once(&(size, size))) {
        if a > prev {
            fallocate(&f, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, prev, a - prev)
                .map_err(std::io::Error::from)?;
        }
        prev = b;
    }
    Ok(())
}

/// The file system a directory is on, by `statfs` magic.
fn fs_type(dir: &Path) -> String {
    let mut p = dir.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            break;
        }
    }
    match rustix::fs::statfs(&p).map(|s| s.f_type as u64) {
        Ok(0x0102_1994) => "tmpfs".into(),
        Ok(0xEF53) => "ext4".into(),
        Ok(0x5846_5342) => "xfs".into(),
        Ok(0x9123_683E) => "btrfs".into(),
        Ok(m) => format!("0x{m:x}"),
        Err(e) => format!("unknown ({e})"),
    }
}

/// Write `bytes` (from `src`, repeated) to a new file `path`, fsync it, remove it: what writing the new
/// data of a put costs by itself on that file system, without reading or hashing anything.
fn write_only(path: &Path, src: &[u8], bytes: u64) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    let mut left = bytes;
    while left > 0 {
        let n = (left as usize).min(src.len());
        f.write_all(&src[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    drop(f);
    std::fs::remove_file(path)
}

/// A figure with its bar, in the form `./x bench` summarizes (name, value, unit, bar, pass). Figures of a run
/// on given files (`--image`, e.g. real guest RAM) are named apart from the synthetic image's, so a report
/// holding both keeps both.
fn bar_fields(v: &mut serde_json::Value, name: &str, value: f64, unit: &str, bar: &str, pass: bool) {
    let input = if std::env::args().any(|a| a == "--image") { ", on the given files (real guest RAM)" } else { "" };
    if let Some(o) = v.as_object_mut() {
        o.insert("name".into(), format!("{name}{input}").into());
        o.insert("value".into(), serde_json::json!(value));
        o.insert("unit".into(), unit.into());
        o.insert("bar".into(), bar.into());
        o.insert("pass".into(), pass.into());
    }
}

/// Real guest RAM files (`--ram FILE` ..., e.g. clade-vm's tmpfs RAM files): copied (sparse) into the work
/// dir, then stored one after another into one store per zstd level, reporting dedup and compression.
fn real_ram(work: &Path, files: &[PathBuf]) -> Result<(), Box<dyn std::error::Error>> {
    let mut copies = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let c = work.join(format!("ram-{i}.bin"));
        sh(Command::new("cp").arg("--sparse=always").arg(f).arg(&c))?;
        copies.push(c);
    }
    for level in [None, Some(1), Some(3)] {
        let d = work.join(format!("ram-store-{level:?}"));
        let s = Store::open(&d, StoreConfig { compression_level: level, ..Default::default() })?;
        let mut total = clade_store::PutReport::default();
        let t0 = Instant::now();
        for (c, orig) in copies.iter().zip(files) {
            let (t, r) = secs(|| s.put_file_rehash(c, ImageKind::Mem));
            let r = r?;
            emit(serde_json::json!({
                "figure": "real_guest_ram_put", "file": orig.display().to_string(), "zstd": level, "secs": t,
                "size": r.size, "bytes_zero": r.bytes_zero, "bytes_dedup": r.bytes_dedup, "bytes_new": r.bytes_new,
                "bytes_stored": r.bytes_stored, "manifest_bytes": r.manifest_bytes,
            }));
            total.size += r.size;
            total.bytes_zero += r.bytes_zero;
            total.bytes_dedup += r.bytes_dedup;
            total.bytes_new += r.bytes_new;
            total.bytes_stored += r.bytes_stored;
        }
        let secs_all = t0.elapsed().as_secs_f64();
        emit(serde_json::json!({
            "figure": "real_guest_ram_total", "files": files.len(), "zstd": level, "secs": secs_all,
            "size": total.size, "bytes_zero": total.bytes_zero, "bytes_dedup": total.bytes_dedup,
            "bytes_new": total.bytes_new, "bytes_stored": total.bytes_stored, "store_bytes": du(&d),
            "stored_to_nonzero": total.bytes_stored as f64 / (total.size - total.bytes_zero) as f64,
        }));
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
    }
    Ok(())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ram: Vec<PathBuf> = {
        let a: Vec<String> = std::env::args().collect();
        match a.iter().position(|x| x == "--ram") {
            Some(i) => a[i + 1..].iter().take_while(|x| !x.starts_with("--")).map(PathBuf::from).collect(),
            None => Vec::new(),
        }
    };
    if let Some(file) = arg("--make-image") {
        // For profiling: just write the synthetic image.
        let mib: usize = arg("--size-mib").map(|s| s.parse()).transpose()?.unwrap_or(1024);
        make_image(Path::new(&file), mib << 20)?;
        return Ok(());
    }
    if let Some(file) = arg("--get-only") {
        // For profiling: FILE is stored once into FILE.store (kept), then got into FILE.out.
        let d = PathBuf::from(format!("{file}.get-store"));
        let fresh = !d.exists();
        let s = Store::open(&d, StoreConfig { compression_level: None, ..Default::default() })?;
        let id = s.put_file(Path::new(&file), ImageKind::Mem)?.id.ok_or("no id")?;
        if fresh {
            return Ok(());
        }
        let out = PathBuf::from(format!("{file}.out"));
        let c0 = cpu().0;
        let (t, r) = secs(|| s.get_file(&id, &out));
        r?;
        emit(serde_json::json!({"figure": "get_only", "secs": t, "cpu_secs": cpu().0 - c0}));
        let _ = std::fs::remove_file(&out);
        return Ok(());
    }
    if let Some(file) = arg("--put-only") {
        // For profiling: one put of FILE into a fresh store next to it, zstd off.
        let d = PathBuf::from(format!("{file}.store"));
        let _ = std::fs::remove_dir_all(&d);
        let s = Store::open(&d, StoreConfig { compression_level: None, ..Default::default() })?;
        let c0 = cpu().0;
        let (t, r) = secs(|| s.put_file_rehash(Path::new(&file), ImageKind::Mem));
        emit(serde_json::json!({"figure": "put_only", "secs": t, "cpu_secs": cpu().0 - c0, "bytes_new": r?.bytes_new}));
        drop(s);
        let _ = std::fs::remove_dir_all(&d);
        return Ok(());
    }
    if !ram.is_empty() {
        let base = PathBuf::from(arg("--dir").unwrap_or_else(|| "/dev/shm".into()));
        let work = base.join(format!("clade-store-bench.{}", std::process::id()));
        std::fs::create_dir_all(&work)?;
        let res = real_ram(&work, &ram);
        let _ = std::fs::remove_dir_all(&work);
        return res;
    }
    let mib: usize = arg("--size-mib").map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let base = PathBuf::from(arg("--dir").unwrap_or_else(|| "/dev/shm".into()));
    let work = base.join(format!("clade-store-bench.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let res = bench(&work, mib, arg("--store-dir").map(PathBuf::from));
    let _ = std::fs::remove_dir_all(&work);
    res
}

fn bench(work: &Path, mib: usize, store_dir: Option<PathBuf>) -> Result<(), Box<dyn std::error::Error>> {
    let size = mib << 20;
    let img = work.join("image.bin");
    // `--image A [B ...]` (before any other flag): the concatenation of real files (e.g. guest RAM) instead.
    let given: Vec<PathBuf> = {
        let a: Vec<String> = std::env::args().collect();
        match a.iter().position(|x| x == "--image") {
            Some(i) => a[i + 1..].iter().take_while(|x| !x.starts_with("--")).map(PathBuf::from).collect(),
            None => Vec::new(),
        }
    };
    let (t, r) = secs(|| -> std::io::Result<()> {
        if given.is_empty() {
            return make_image(&img, size);
        }
        let out = std::fs::File::create(&img)?;
        let mut at = 0;
        for g in &given {
            at += sparse_copy(g, &out, at)?;
        }
        Ok(())
    });
    r?;
    let size = std::fs::metadata(&img)?.len() as usize / BLOCK * BLOCK;
    let layout = data_ranges(&img)?;
    let data_bytes: u64 = layout.iter().map(|(a, b)| b - a).sum();
    emit(
        serde_json::json!({"step": "make_image", "bytes": size, "data_bytes": data_bytes, "data_extents": layout.len(),
        "secs": t, "dir": work.display().to_string(),
        "from": given.iter().map(|g| g.display().to_string()).collect::<Vec<_>>()}),
    );

    let data_dir =
        store_dir.map(|d| d.join(format!("clade-store-bench.{}", std::process::id()))).unwrap_or(work.join("store"));
    let cfg = StoreConfig { compression_level: None, gc_grace: std::time::Duration::ZERO, ..Default::default() };

    // Warm the page cache, then b3sum (all cores) vs put (compression off).
    sh(Command::new("cat").arg(&img).stdout(std::process::Stdio::null()))?;
    // Alternate b3sum and a put into a fresh store, `--reps` times (default 5): the machine is shared, so
    // each figure is the median of the per-round ratios, with their spread.
    let reps: usize = arg("--reps").map(|s| s.parse()).transpose()?.unwrap_or(5).max(1);
    let (mut b3s, mut b3_cpus, mut puts, mut put_cpus, mut put_ratios) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut wos, mut wo_cpus) = (vec![], vec![]);
    let sparse = data_bytes < size as u64;
    let mut chunk = vec![0u8; 1 << 20];
    rand::rngs::StdRng::seed_from_u64(3).fill(&mut chunk[..]);
    let mut r1 = None;
    for _ in 0..reps {
        let c0 = cpu();
        let (t, r) = secs(|| sh(Command::new("b3sum").arg(&img).stdout(std::process::Stdio::null())));
        r?;
        let c1 = cpu();
        b3s.push(t);
        b3_cpus.push(c1.1 - c0.1);
        if sparse {
            restore_holes(&img, &layout)?;
            if data_ranges(&img)? != layout {
                return Err("could not restore the input's holes after b3sum".into());
            }
        }
        let _ = std::fs::remove_dir_all(&data_dir);
        let s = Store::open(&data_dir, cfg.clone())?;
        let c0 = cpu();
        let (tp, r) = secs(|| s.put_file_rehash(&img, ImageKind::Mem));
        let c1 = cpu();
        puts.push(tp);
        put_cpus.push(c1.0 - c0.0);
        put_ratios.push(t / tp);
        let r = r?;
        // Reference: writing just the new bytes into the store's file system (no read, no hash).
        let c0 = cpu();
        let (tw, w) = secs(|| write_only(&data_dir.with_extension("write-only"), &chunk, r.bytes_new));
        w?;
        wos.push(tw);
        wo_cpus.push(cpu().0 - c0.0);
        r1 = Some(r);
    }
    let (b3, b3_cpu, t_put1, put_cpu) = (median(&b3s), median(&b3_cpus), median(&puts), median(&put_cpus));
    let r1 = r1.ok_or("no put")?;
    let store = Store::open(&data_dir, cfg)?;
    let stored1 = du(&data_dir);
    let ratio = median(&put_ratios);
    let mut v = serde_json::json!({
        "figure": "put_vs_b3sum", "bytes": size, "data_bytes": data_bytes, "b3sum_secs": b3, "put_secs": t_put1,
        "b3sum_mb_s": size as f64 / b3 / 1e6, "put_mb_s": size as f64 / t_put1 / 1e6,
        "ratio": ratio, "ratio_min": min(&put_ratios), "ratio_max": max(&put_ratios), "reps": reps,
        "ratios": put_ratios, "compression": "off",
        "b3sum_cpu_secs": b3_cpu, "put_cpu_secs": put_cpu, "cpu_ratio": b3_cpu / put_cpu,
        "write_only_secs": median(&wos), "write_only_cpu_secs": median(&wo_cpus),
        // The best ratio a put could have if it cost no more than b3sum's own pass plus writing its new bytes.
        "floor_ratio": b3_cpu / (b3_cpu + median(&wo_cpus)),
        "bytes_new": r1.bytes_new, "bytes_zero": r1.bytes_zero, "bytes_dedup": r1.bytes_dedup,
        "manifest_bytes": r1.manifest_bytes, "store_bytes": stored1, "store_dir": data_dir.display().to_string(),
        "store_fs": fs_type(&data_dir), "input_fs": fs_type(work),
        "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
    });
    bar_fields(&mut v, "store put / b3sum (same file, zstd off)", ratio, "x", ">= 0.7x", ratio >= 0.7);
    emit(v);
    // The stat cache only trusts files whose ctime is older than the put that read them.
    let (_, r) = secs(|| store.put_file(&img, ImageKind::Mem));
    r?;

    let (t_put2, r2) = secs(|| store.put_file(&img, ImageKind::Mem));
    let r2 = r2?;
    let growth2 = du(&data_dir) - stored1;
    let mut v = serde_json::json!({
        "figure": "second_put", "first_secs": t_put1, "second_secs": t_put2, "ratio": t_put1 / t_put2,
        "new_objects": r2.new_objects, "bytes_new": r2.bytes_new, "same_id": r1.id == r2.id, "unchanged_file": r2.unchanged_file,
        "store_growth_bytes": growth2,
    });
    let pass = t_put1 / t_put2 >= 5.0 && r2.new_objects == 0 && r1.id == r2.id;
    bar_fields(&mut v, "store second put / first (0 new objects)", t_put1 / t_put2, "x", ">= 5x, 0 new", pass);
    emit(v);

    let (t_put2r, r2r) = secs(|| store.put_file_rehash(&img, ImageKind::Mem));
    let r2r = r2r?;
    emit(serde_json::json!({
        "figure": "second_put_rehash", "first_secs": t_put1, "second_secs": t_put2r, "ratio": t_put1 / t_put2r,
        "new_objects": r2r.new_objects, "same_id": r1.id == r2r.id,
    }));

    // A copy with 1% of pages changed at random.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let npages = size / BLOCK;
    let changed: Vec<usize> = {
        let mut v: Vec<usize> = rand::seq::index::sample(&mut rng, npages, npages / 100).into_vec();
        v.sort_unstable();
        v
    };
    let copy = work.join("copy.bin");
    sparse_copy(&img, &std::fs::File::create(&copy)?, 0)?;
    let mut new_pages: Vec<Vec<u8>> = Vec::new();
    {
        let f = std::fs::OpenOptions::new().write(true).open(&copy)?;
        for &p in &changed {
            let mut page = vec![0u8; BLOCK];
            rng.fill(&mut page[..]);
            std::os::unix::fs::FileExt::write_all_at(&f, &page, (p * BLOCK) as u64)?;
            new_pages.push(page);
        }
    }
    let changed_bytes = (changed.len() * BLOCK) as u64;
    let before = du(&data_dir);
    let (t_put3, r3) = secs(|| store.put_file(&copy, ImageKind::Mem));
    let r3 = r3?;
    let grown = du(&data_dir) - before;
    let g3 = grown as f64 / changed_bytes as f64;
    let mut v = serde_json::json!({
        "figure": "one_percent_copy_put", "changed_pages": changed.len(), "changed_bytes": changed_bytes,
        "store_growth_bytes": grown, "ratio": g3,
        "bytes_new": r3.bytes_new, "manifest_bytes": r3.manifest_bytes, "secs": t_put3,
    });
    bar_fields(&mut v, "store growth of a 1%-changed copy / 1%", g3, "x", "<= 1.25x", g3 <= 1.25);
    emit(v);

    // The same change as a mark: base manifest + only the changed pages.
    let before = du(&data_dir);
    // Fresh random content for the same pages, so this measures the mark on its own.
    for page in new_pages.iter_mut() {
        rng.fill(&mut page[..]);
    }
    let (t_mark, r4) = secs(|| -> Result<_, clade_store::StoreError> {
        let mut b = store.derive(r1.id.as_ref(), size as u64)?;
        for (&p, page) in changed.iter().zip(&new_pages) {
            b.write((p * BLOCK) as u64, page)?;
        }
        b.finish()
    });
    let r4 = r4?;
    let grown4 = du(&data_dir) - before;
    emit(serde_json::json!({
        "figure": "one_percent_mark_derive", "changed_bytes": changed_bytes, "store_growth_bytes": grown4,
        "ratio": grown4 as f64 / changed_bytes as f64, "bar": "<= 1.25x", "secs": t_mark,
        "bytes_new": r4.bytes_new, "manifest_bytes": r4.manifest_bytes,
        "frames_in_manifest": store.manifest(r4.id.as_ref().ok_or("no id")?)?.frames.len(),
    }));

    // get vs cp (same destination directory, page cache warm).
    let id = r3.id.ok_or("no id")?;
    let dest_cp = work.join("cp.out");
    let dest_get = work.join("get.out");
    let (mut cps, mut gets, mut cp_cpus, mut get_cpus, mut get_ratios) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let _ = std::fs::remove_file(&dest_cp);
        let _ = std::fs::remove_file(&dest_get);
        let c0 = cpu();
        let (t, r) = secs(|| sh(Command::new("cp").arg(&copy).arg(&dest_cp)));
        r?;
        let c1 = cpu();
        cps.push(t);
        cp_cpus.push(c1.1 - c0.1);
        let fresh = Store::open(&data_dir, StoreConfig { compression_level: None, ..Default::default() })?;
        let c1 = cpu();
        let (tg, r) = secs(|| fresh.get_file(&id, &dest_get));
        r?;
        get_cpus.push(cpu().0 - c1.0);
        gets.push(tg);
        get_ratios.push(t / tg);
    }
    let (t_cp, t_get, cp_cpu, get_cpu) = (median(&cps), median(&gets), median(&cp_cpus), median(&get_cpus));
    let same = std::fs::read(&dest_get)? == std::fs::read(&copy)?;
    let gr = median(&get_ratios);
    let mut v = serde_json::json!({
        "figure": "get_vs_cp", "bytes": size, "cp_secs": t_cp, "get_secs": t_get, "ratio": gr,
        "ratio_min": min(&get_ratios), "ratio_max": max(&get_ratios), "reps": reps, "ratios": get_ratios,
        "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(), "cp_cpu_secs": cp_cpu, "get_cpu_secs": get_cpu,
        "identical": same,
    });
    bar_fields(&mut v, "store get / cp (same data, local tier)", gr, "x", ">= 0.8x", gr >= 0.8 && same);
    emit(v);
    let _ = std::fs::remove_file(&dest_cp);
    let _ = std::fs::remove_file(&dest_get);
    let _ = std::fs::remove_file(&copy);
    drop(store);
    let _ = std::fs::remove_dir_all(&data_dir);

    // Compression levels on the same image.
    let levels: &[i32] = if std::env::args().any(|a| a == "--no-zstd") { &[] } else { &[1, 3, 9] };
    for &level in levels {
        let d = work.join(format!("store-z{level}"));
        let s = Store::open(&d, StoreConfig { compression_level: Some(level), ..Default::default() })?;
        let c0 = cpu().0;
        let (t, r) = secs(|| s.put_file_rehash(&img, ImageKind::Mem));
        let put_cpu = cpu().0 - c0;
        let r = r?;
        let fresh = Store::open(&d, StoreConfig::default())?;
        let out = work.join("z.out");
        let c0 = cpu().0;
        let (tg, g) = secs(|| fresh.get_file(r.id.as_ref().ok_or("no id")?, &out).map_err(|e| e.to_string()));
        let get_cpu = cpu().0 - c0;
        g?;
        emit(serde_json::json!({
            "figure": "compression", "level": level, "put_secs": t, "put_mb_s": size as f64 / t / 1e6,
            "get_secs": tg, "get_mb_s": size as f64 / tg / 1e6, "put_cpu_secs": put_cpu, "get_cpu_secs": get_cpu,
            "bytes_new": r.bytes_new, "bytes_stored": r.bytes_stored,
            "ratio_stored_to_new": r.bytes_stored as f64 / r.bytes_new as f64,
        }));
        let _ = std::fs::remove_file(&out);
        drop((s, fresh));
        let _ = std::fs::remove_dir_all(&d);
    }
    Ok(())
}
