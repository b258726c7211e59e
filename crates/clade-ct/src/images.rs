//! What a restore will read from the files its tasks map, found in CRIU's images before CRIU runs.
//!
//! Why: CRIU restores a task's dumped pages by writing them over its mappings. Where a mapping is a private
//! mapping of a file (a program's or a library's data), the kernel first reads that page of the file. For a
//! sandbox resumed on another host the files live in a lazily mounted lower layer (crate::lower), so each such
//! read is a FUSE request answered by one ranged GET, one after another inside CRIU: ~1.5 s of a roaming ct
//! resume on this project's 2-core host (docs/roam.md). The images say exactly which ranges those are, so a
//! restore fetches them first, several at once ([`mapped_ranges`], then `Store::prefetch_ranges`).
//!
//! The format (CRIU 4's `images/*.proto`): an image file is one or two 32-bit magics, then entries, each a
//! 32-bit little-endian length and a protobuf message. Only these fields are read:
//! - `files.img`: `file_entry { type = 1 (1: regular file); id = 2; reg = 3 { name = 6 } }`;
//! - `mm-<pid>.img`: `mm_entry { vmas = 14 { start = 1; end = 2; pgoff = 3 (bytes); shmid = 4 (the file's id
//!   for a file mapping); flags = 6 (mmap flags) } }`;
//! - `pagemap-<pid>.img`: a head entry, then `pagemap_entry { vaddr = 1; nr_pages = 2 (old); nr_pages = 5 }`.
//!
//! Anything it cannot parse yields no ranges: the prefetch is an optimisation, CRIU still reads what it needs.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// The first magic of most CRIU images (`IMG_COMMON_MAGIC`); a second, per-image magic follows it.
const COMMON_MAGIC: u32 = 0x5456_4319;
const PAGE: u64 = 4096;
const MAP_SHARED: u64 = 0x01;
const MAP_ANONYMOUS: u64 = 0x20;
const FD_TYPE_REG: u64 = 1;

/// A protobuf field's value: what this module reads of the wire format.
enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

fn varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let c = *b.get(*i)?;
        *i += 1;
        v |= u64::from(c & 0x7f) << shift;
        if c < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The fields of one message, in order; `None` if it is not well formed.
fn fields(b: &[u8]) -> Option<Vec<(u64, Value<'_>)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let key = varint(b, &mut i)?;
        let v = match key & 7 {
            0 => Value::Int(varint(b, &mut i)?),
            1 => {
                i += 8;
                Value::Bytes(b.get(i - 8..i)?)
            }
            2 => {
                let n = usize::try_from(varint(b, &mut i)?).ok()?;
                let end = i.checked_add(n)?;
                let s = b.get(i..end)?;
                i = end;
                Value::Bytes(s)
            }
            5 => {
                i += 4;
                Value::Bytes(b.get(i - 4..i)?)
            }
            _ => return None,
        };
        out.push((key >> 3, v));
    }
    Some(out)
}

fn int(f: &[(u64, Value<'_>)], n: u64) -> Option<u64> {
    f.iter().rev().find_map(|(k, v)| match v {
        Value::Int(x) if *k == n => Some(*x),
        _ => None,
    })
}

fn bytes<'a, 'f>(f: &'f [(u64, Value<'a>)], n: u64) -> impl Iterator<Item = &'a [u8]> + 'f {
    f.iter().filter_map(move |(k, v)| match v {
        Value::Bytes(b) if *k == n => Some(*b),
        _ => None,
    })
}

/// The entries of an image file; `None` if it is cut short.
fn entries(b: &[u8]) -> Option<Vec<&[u8]>> {
    let u32_at = |i: usize| b.get(i..i + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
    let mut i = if u32_at(0)? == COMMON_MAGIC { 8 } else { 4 };
    let mut out = Vec::new();
    while i < b.len() {
        let n = u32_at(i)? as usize;
        out.push(b.get(i + 4..i + 4 + n)?);
        i += 4 + n;
    }
    Some(out)
}

/// Regular files by their id in `files.img`.
fn file_names(b: &[u8]) -> Option<BTreeMap<u64, String>> {
    let mut out = BTreeMap::new();
    for e in entries(b)? {
        let f = fields(e)?;
        if int(&f, 1) != Some(FD_TYPE_REG) {
            continue;
        }
        let (Some(id), Some(reg)) = (int(&f, 2), bytes(&f, 3).next()) else { continue };
        if let Some(name) = bytes(&fields(reg)?, 6).next() {
            out.insert(id, String::from_utf8_lossy(name).into_owned());
        }
    }
    Some(out)
}

struct Vma {
    span: Range<u64>,
    pgoff: u64,
    file: u64,
}

/// The private file mappings of one task (`mm-<pid>.img`).
fn private_file_vmas(b: &[u8]) -> Option<Vec<Vma>> {
    let mut out = Vec::new();
    for e in entries(b)? {
        for v in bytes(&fields(e)?, 14) {
            let f = fields(v)?;
            let (start, end, pgoff, file, flags) = (int(&f, 1)?, int(&f, 2)?, int(&f, 3)?, int(&f, 4)?, int(&f, 6)?);
            if file != 0 && flags & (MAP_SHARED | MAP_ANONYMOUS) == 0 && start < end {
                out.push(Vma { span: start..end, pgoff, file });
            }
        }
    }
    Some(out)
}

/// The dumped page runs of one task (`pagemap-<pid>.img`), as address ranges.
fn dumped(b: &[u8]) -> Option<Vec<Range<u64>>> {
    let mut out = Vec::new();
    for e in entries(b)?.into_iter().skip(1) {
        let f = fields(e)?;
        let (Some(vaddr), Some(pages)) = (int(&f, 1), int(&f, 5).or_else(|| int(&f, 2))) else { continue };
        out.push(vaddr..vaddr.saturating_add(pages.saturating_mul(PAGE)));
    }
    Some(out)
}

/// For each file a restore from the image directory `img` will read because CRIU writes dumped pages over a
/// private mapping of it: the file's path inside the sandbox (as CRIU names it, from its root) and the byte
/// ranges, merged. Empty when the images cannot be read or parsed.
pub fn mapped_ranges(img: &Path) -> BTreeMap<String, Vec<Range<u64>>> {
    let names: Vec<String> = std::fs::read_dir(img)
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    mapped_ranges_of(&names, |name| std::fs::read(img.join(name)).ok())
}

/// [`mapped_ranges`] of an image directory given as its file `names` and a way to `read` one (a store tree
/// read before it is laid out).
pub fn mapped_ranges_of(names: &[String], read: impl Fn(&str) -> Option<Vec<u8>>) -> BTreeMap<String, Vec<Range<u64>>> {
    try_mapped_ranges(names, read).unwrap_or_default()
}

fn try_mapped_ranges(
    names: &[String],
    read: impl Fn(&str) -> Option<Vec<u8>>,
) -> Option<BTreeMap<String, Vec<Range<u64>>>> {
    let files = file_names(&read("files.img")?)?;
    let mut out: BTreeMap<String, Vec<Range<u64>>> = BTreeMap::new();
    for name in names {
        let Some(pid) = name.strip_prefix("mm-").and_then(|s| s.strip_suffix(".img")) else { continue };
        let vmas = private_file_vmas(&read(name)?)?;
        let Some(pm) = read(&format!("pagemap-{pid}.img")) else { continue };
        for run in dumped(&pm)? {
            for v in &vmas {
                let (lo, hi) = (run.start.max(v.span.start), run.end.min(v.span.end));
                if lo >= hi {
                    continue;
                }
                let Some(path) = files.get(&v.file) else { continue };
                let at = v.pgoff + (lo - v.span.start);
                out.entry(path.clone()).or_default().push(at..at + (hi - lo));
            }
        }
    }
    for ranges in out.values_mut() {
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<u64>> = Vec::new();
        for r in ranges.drain(..) {
            match merged.last_mut() {
                Some(m) if r.start <= m.end => m.end = m.end.max(r.end),
                _ => merged.push(r),
            }
        }
        *ranges = merged;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn int_field(n: u64, v: u64, out: &mut Vec<u8>) {
        var(n << 3, out);
        var(v, out);
    }
    fn bytes_field(n: u64, b: &[u8], out: &mut Vec<u8>) {
        var((n << 3) | 2, out);
        var(b.len() as u64, out);
        out.extend_from_slice(b);
    }
    fn image(magic: u32, entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out = COMMON_MAGIC.to_le_bytes().to_vec();
        out.extend_from_slice(&magic.to_le_bytes());
        for e in entries {
            out.extend_from_slice(&(e.len() as u32).to_le_bytes());
            out.extend_from_slice(e);
        }
        out
    }
    fn vma(start: u64, end: u64, pgoff: u64, file: u64, flags: u64) -> Vec<u8> {
        let mut v = Vec::new();
        for (n, x) in [(1, start), (2, end), (3, pgoff), (4, file), (5, 3), (6, flags), (7, 0x41)] {
            int_field(n, x, &mut v);
        }
        v
    }

    #[test]
    fn dumped_pages_over_private_file_mappings_become_file_ranges() {
        let dir = tempfile::tempdir().unwrap();
        // files.img: file 7 is /usr/bin/python3.11, file 8 a shared mapping's file.
        let reg = |id: u64, name: &str| {
            let mut r = Vec::new();
            int_field(1, id, &mut r);
            bytes_field(6, name.as_bytes(), &mut r);
            let mut e = Vec::new();
            int_field(1, FD_TYPE_REG, &mut e);
            int_field(2, id, &mut e);
            bytes_field(3, &r, &mut e);
            e
        };
        std::fs::write(dir.path().join("files.img"), image(1, &[reg(7, "/usr/bin/python3.11"), reg(8, "/dev/shm/x")]))
            .unwrap();
        let mut mm = Vec::new();
        int_field(1, 0x400000, &mut mm);
        bytes_field(14, &vma(0x400000, 0x41f000, 0, 7, 0x2), &mut mm); // private file mapping (text)
        bytes_field(14, &vma(0x947000, 0xa85000, 0x546000, 7, 0x2), &mut mm); // private file mapping (data)
        bytes_field(14, &vma(0xa85000, 0xaca000, 0, 0, 0x22), &mut mm); // anonymous
        bytes_field(14, &vma(0xb00000, 0xb10000, 0, 8, 0x1), &mut mm); // shared: written through, not read
        std::fs::write(dir.path().join("mm-10.img"), image(2, &[mm])).unwrap();
        let run = |vaddr: u64, pages: u64| {
            let mut e = Vec::new();
            int_field(1, vaddr, &mut e);
            int_field(2, 0, &mut e);
            int_field(4, 4, &mut e);
            int_field(5, pages, &mut e);
            e
        };
        let mut head = Vec::new();
        int_field(1, 2, &mut head);
        let pm = image(3, &[head, run(0x946000, 3), run(0xa84000, 2), run(0xb00000, 1), run(0x401000, 1)]);
        std::fs::write(dir.path().join("pagemap-10.img"), pm).unwrap();

        let got = mapped_ranges(dir.path());
        let want: BTreeMap<String, Vec<Range<u64>>> = [(
            "/usr/bin/python3.11".to_string(),
            // 0x401000 (text) ; 0x947000-0x949000 -> 0x546000.. ; 0xa84000 -> 0x683000 (its last page)
            vec![0x1000..0x2000, 0x546000..0x548000, 0x683000..0x684000],
        )]
        .into();
        assert_eq!(got, want);
        // Cut short or missing: nothing, and no panic.
        std::fs::write(dir.path().join("files.img"), &image(1, &[reg(7, "/x")])[..20]).unwrap();
        assert!(mapped_ranges(dir.path()).is_empty());
        assert!(mapped_ranges(&dir.path().join("nothing")).is_empty());
    }
}
