//! The pages a clone changed, read straight from the kernel. A clone maps its mark's RAM file `share=off`
//! (MAP_PRIVATE): a page it never wrote is still the file's page cache, a page it wrote is a private anonymous
//! copy. `/proc/PID/pagemap` tells them apart (present, bit 63, and not file-backed, bit 61 clear), so a mark of a
//! clone reads only its diverged pages from `/proc/PID/mem` while the guest is paused: work proportional to what
//! changed, not to the guest's size. The same file, written, puts pages into a paused clone's private mapping
//! (a child of a mark taken from a clone gets the mark's pages before it first runs).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const PAGE: u64 = 4096;

/// Where a process maps a file: the guest RAM region in QEMU's address space.
#[derive(Debug, Clone, Copy)]
pub struct Mapping {
    pub start: u64,
    pub len: u64,
    /// Offset in the file of the mapping's first byte.
    pub file_offset: u64,
}

/// The mapping of `file` in process `pid` (the largest, if several).
pub fn find_mapping(pid: u32, file: &Path) -> io::Result<Mapping> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let want = file.to_string_lossy();
    let mut best: Option<Mapping> = None;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(_perms), Some(off), Some(_dev), Some(_ino)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path: Vec<&str> = f.collect();
        if path.join(" ") != want {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b), Ok(off)) =
            (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16), u64::from_str_radix(off, 16))
        else {
            continue;
        };
        if best.is_none_or(|m| m.len < b - a) {
            best = Some(Mapping { start: a, len: b - a, file_offset: off });
        }
    }
    best.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("process {pid} does not map {want}")))
}

const PM_PRESENT: u64 = 1 << 63;
const PM_FILE: u64 = 1 << 61;

/// Page indexes (relative to the mapping) whose content is the process's own private copy.
pub fn diverged_pages(pid: u32, m: &Mapping) -> io::Result<Vec<u64>> {
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
    let pages = m.len / PAGE;
    let mut out = Vec::new();
    let chunk = 1 << 16; // entries per read: 512 KiB
    let mut buf = vec![0u8; chunk * 8];
    let mut i = 0u64;
    while i < pages {
        let n = (pages - i).min(chunk as u64) as usize;
        let bytes = &mut buf[..n * 8];
        pagemap.read_exact_at(bytes, (m.start / PAGE + i) * 8)?;
        for (j, e) in bytes.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            if v & PM_PRESENT != 0 && v & PM_FILE == 0 {
                out.push(i + j as u64);
            }
        }
        i += n as u64;
    }
    Ok(out)
}

/// Read the given pages of the mapping, in runs of consecutive pages, calling `sink(page_index, bytes)` per run.
pub fn read_pages(
    pid: u32,
    m: &Mapping,
    pages: &[u64],
    mut sink: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut buf = Vec::new();
    for run in runs(pages) {
        buf.resize((run.1 * PAGE) as usize, 0);
        mem.read_exact_at(&mut buf, m.start + run.0 * PAGE)?;
        sink(run.0, &buf)?;
    }
    Ok(())
}

/// Write `data` at page `page` of the mapping of a (paused) process.
pub fn write_pages(mem: &File, m: &Mapping, page: u64, data: &[u8]) -> io::Result<()> {
    if page * PAGE + data.len() as u64 > m.len {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "pages beyond the guest RAM mapping"));
    }
    mem.write_all_at(data, m.start + page * PAGE)
}

/// Consecutive page indexes as (first, count) runs.
pub fn runs(pages: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((first, n)) if *first + *n == p && *n < 256 => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_and_cap() {
        assert_eq!(runs(&[1, 2, 3, 7, 8, 10]), vec![(1, 3), (7, 2), (10, 1)]);
        let long: Vec<u64> = (0..300).collect();
        assert_eq!(runs(&long), vec![(0, 256), (256, 44)]);
    }

    /// Our own process: map a file privately (through a child `dd`-free path: read the test binary's own maps),
    /// check that the mapping is found and that a file-backed, untouched mapping has no diverged pages.
    #[test]
    fn own_mapping_of_executable_is_file_backed() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let pid = std::process::id();
        let m = find_mapping(pid, &exe).unwrap();
        assert!(m.len >= PAGE);
        let d = diverged_pages(pid, &m).unwrap();
        // Text pages of our own binary are never private copies.
        assert!(d.len() < (m.len / PAGE) as usize);
    }
}
