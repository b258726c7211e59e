//! The pages a clone changed, read straight from the kernel. A clone maps its mark's RAM file `share=off`
//! (MAP_PRIVATE): a page it never wrote is still the file's page cache, a page it wrote is a private anonymous
//! copy. `/proc/PID/pagemap` tells them apart (present, bit 63, and not file-backed, bit 61 clear), so a mark of a
//! clone reads only its diverged pages from `/proc/PID/mem` while the guest is paused: work proportional to what
//! changed, not to the guest's size. The same file, written, puts pages into a paused clone's private mapping
//! (a child of a mark taken from a clone gets the mark's pages before it first runs).
//!
//! Copying the pages is most of a clone mark's pause, so it is made as cheap as it gets from outside the
//! process (docs/vm.md, "Mark pause"): the destination buffer is faulted in *before* the guest stops (a page
//! fault costs microseconds on this host's nested virtualization: 13k of them were half the copy), sized from a
//! scan taken while the guest still runs, and the pages are read with `process_vm_readv`, up to 1,024 runs a
//! call, one copy straight from QEMU's pages (`/proc/PID/mem` reads through a bounce page per 4 KiB).

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

/// A zeroed buffer of `bytes` whose pages are already faulted in, so copying into it takes no page faults.
pub fn prefaulted(bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    // vec! of zeros maps the shared zero page lazily; a write per page gives each its own frame now.
    for b in v.iter_mut().step_by(PAGE as usize) {
        *b = std::hint::black_box(1);
    }
    v
}

/// Read the given pages of the mapping into `dst` (exactly `pages.len()` pages, in order) with
/// `process_vm_readv`, up to 1,024 runs per call.
pub fn read_pages_into(pid: u32, m: &Mapping, pages: &[u64], dst: &mut [u8]) -> io::Result<()> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    if dst.len() as u64 != pages.len() as u64 * PAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "destination is not the size of the pages"));
    }
    let all = runs(pages);
    if let Some(&(first, n)) = all.last() {
        if (first + n) * PAGE > m.len {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "pages beyond the guest RAM mapping"));
        }
    }
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    let mut rest = dst;
    for batch in all.chunks(1024) {
        let remote: Vec<RemoteIoVec> = batch
            .iter()
            .map(|&(first, n)| RemoteIoVec { base: (m.start + first * PAGE) as usize, len: (n * PAGE) as usize })
            .collect();
        let want: usize = remote.iter().map(|r| r.len).sum();
        let (now, later) = rest.split_at_mut(want);
        let mut done = 0;
        while done < want {
            // A partial read stops at a run boundary or inside one; go on from where it stopped.
            let mut skip = done;
            let tail: Vec<RemoteIoVec> = remote
                .iter()
                .filter_map(|r| {
                    if skip >= r.len {
                        skip -= r.len;
                        None
                    } else {
                        let v = RemoteIoVec { base: r.base + skip, len: r.len - skip };
                        skip = 0;
                        Some(v)
                    }
                })
                .collect();
            let n =
                process_vm_readv(pid, &mut [io::IoSliceMut::new(&mut now[done..])], &tail).map_err(io::Error::from)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "process_vm_readv read nothing"));
            }
            done += n;
        }
        rest = later;
    }
    Ok(())
}

/// [`read_pages_into`] split over `threads` threads (contiguous shares of the page list): the copy is bound by
/// per-page work in the kernel (pinning each remote page) as much as by memory bandwidth, so it scales with
/// cores while the guest is stopped and QEMU needs none.
pub fn read_pages_parallel(pid: u32, m: &Mapping, pages: &[u64], dst: &mut [u8], threads: usize) -> io::Result<()> {
    let threads = threads.clamp(1, 8);
    if threads == 1 || pages.len() < 1024 {
        return read_pages_into(pid, m, pages, dst);
    }
    let share = pages.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = pages
            .chunks(share)
            .zip(dst.chunks_mut(share * PAGE as usize))
            .map(|(p, d)| s.spawn(move || read_pages_into(pid, m, p, d)))
            .collect();
        handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|_| Err(io::Error::other("copy thread panicked"))))
    })
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

    /// `process_vm_readv` of scattered runs of our own pages lands them in order.
    #[test]
    fn read_pages_into_copies_scattered_runs() {
        let mut src = vec![0u8; 2048 * PAGE as usize];
        for (i, c) in src.chunks_mut(PAGE as usize).enumerate() {
            c.fill((i % 251) as u8);
        }
        let m = Mapping { start: src.as_ptr() as u64, len: src.len() as u64, file_offset: 0 };
        // More than 1,024 runs, so the copy takes several calls.
        let pages: Vec<u64> = (0..2048u64).filter(|p| p % 2 == 0 || p % 7 == 0).collect();
        let mut dst = prefaulted(pages.len() * PAGE as usize);
        read_pages_into(std::process::id(), &m, &pages, &mut dst).unwrap();
        for (k, &p) in pages.iter().enumerate() {
            assert!(dst[k * PAGE as usize..(k + 1) * PAGE as usize].iter().all(|&b| b == (p % 251) as u8), "page {p}");
        }
        assert!(read_pages_into(std::process::id(), &m, &[4096], &mut dst[..PAGE as usize]).is_err());
        let mut par = prefaulted(pages.len() * PAGE as usize);
        read_pages_parallel(std::process::id(), &m, &pages, &mut par, 3).unwrap();
        assert!(par == dst);
        std::hint::black_box(&src);
    }
}
