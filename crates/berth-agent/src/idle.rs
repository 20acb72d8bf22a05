//! An idle agent gives back what only its start-up, or a task, needed: the pages of its own
//! binary that are mapped but no longer used, and the free memory at the top of its heap.
//!
//! Start-up (argument parsing, the capability probes, the first TLS handshakes, the session)
//! runs code that an idle agent never runs again, and so does a task's executor. Each page fault
//! also maps the neighbours that are in the page cache (the kernel's fault-around, 64 KiB), so
//! after start-up about 80 % of the binary's text is resident, while heartbeats and the task
//! stream touch about a quarter of it (BENCHMARKS.md, "Agent size and idle cost"). Unmapping the
//! pages (`MADV_DONTNEED`) alone does not help: the next heartbeat faults the fault-around
//! windows back in from the cache. So a release also drops the binary's unmapped pages from the
//! page cache (`POSIX_FADV_DONTNEED`), which frees that memory for the whole host, and marks the
//! mappings `MADV_RANDOM`, so that a later fault reads back the one page it needs rather than a
//! read-ahead window. The cost is a small disk read for each page of code the agent needs
//! again: the idle loop's few hundred pages once, and a task's executor the first time it runs
//! after a release.
//!
//! Only mappings of the agent's own executable are released, never a library's: other processes
//! map libc's pages too, so unmapping them here would free nothing. A mapping is released only
//! when it is not writable and holds no anonymous (copied-on-write) page, so what comes back
//! from the file is exactly what was there. The relocated read-only data (RELRO) holds such
//! pages and is always skipped.

use std::convert::Infallible;
use std::time::Duration;

use crate::tasks::Runner;

/// The first release, after a session is acquired: its start-up is over by then.
const FIRST_RELEASE: Duration = Duration::from_secs(30);
/// How often the agent looks for something to give back: a release follows only when tasks
/// ran since the last one and none runs now.
const CHECK_EVERY: Duration = Duration::from_secs(60);

/// Releases unused pages [`FIRST_RELEASE`] after it starts, and again whenever tasks have run
/// since and none is running. Never returns: it ends with the session's loops.
pub(crate) async fn release_while_idle(runner: &Runner) -> Infallible {
    tokio::time::sleep(FIRST_RELEASE).await;
    // How many tasks had been dispatched at the last release; `None` before the first.
    let mut released_at: Option<u64> = None;
    loop {
        let dispatched = runner.dispatched();
        if released_at != Some(dispatched) && runner.running().is_empty() {
            match release_unused_pages() {
                Ok(kib) => tracing::debug!(released_kib = kib, "idle: released unused pages"),
                Err(e) => tracing::debug!(error = %e, "idle: could not release unused pages"),
            }
            released_at = Some(dispatched);
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }
}

/// Unmaps the resident pages of this executable's read-only, never-written mappings, drops the
/// executable's unmapped pages from the page cache, and trims the heap. Returns the KiB that
/// were resident in the released mappings.
#[cfg(target_os = "linux")]
pub(crate) fn release_unused_pages() -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;

    let exe = std::fs::read_link("/proc/self/exe")?;
    let exe = exe.to_string_lossy();
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut released = 0;
    for m in releasable(&smaps, &exe) {
        for advice in [libc::MADV_RANDOM, libc::MADV_DONTNEED] {
            // SAFETY: `m` is a whole mapping of this executable that is not writable and holds
            // no anonymous page (checked just above in `releasable`, and a mapping that is not
            // writable cannot gain one). Dropping its pages only makes the next access map the
            // same bytes again from the file: no reference into it is invalidated.
            let done = unsafe { libc::madvise(m.start as *mut libc::c_void, m.len, advice) };
            if done != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        released += m.rss_kib;
    }
    // The running file, even after an upgrade renamed another over its path. Pages that another
    // process still maps stay in the cache.
    let file = std::fs::File::open("/proc/self/exe")?;
    // SAFETY: a plain libc call on a descriptor this function holds open.
    let done = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if done != 0 {
        return Err(std::io::Error::from_raw_os_error(done));
    }
    // glibc keeps freed heap memory for reuse; give back what it can.
    #[cfg(target_env = "gnu")]
    // SAFETY: a plain libc call with no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
    Ok(released)
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn release_unused_pages() -> std::io::Result<u64> {
    Ok(0)
}

/// A mapping that may be released.
#[derive(Debug, PartialEq)]
struct Mapping {
    start: usize,
    len: usize,
    rss_kib: u64,
}

/// The mappings of `exe` in `smaps` (the text of `/proc/self/smaps`) that are not writable and
/// hold no anonymous page.
fn releasable(smaps: &str, exe: &str) -> Vec<Mapping> {
    let mut found = Vec::new();
    // The mapping being read: (start, len, candidate), then its Rss and Anonymous fields.
    let mut current: Option<(usize, usize, bool)> = None;
    let mut rss = 0;
    let mut anonymous = None;
    let mut finish = |current: Option<(usize, usize, bool)>, rss: u64, anonymous: Option<u64>| {
        if let Some((start, len, true)) = current {
            if anonymous == Some(0) {
                found.push(Mapping {
                    start,
                    len,
                    rss_kib: rss,
                });
            }
        }
    };
    for line in smaps.lines() {
        if let Some(header) = mapping_header(line) {
            finish(current.take(), rss, anonymous.take());
            rss = 0;
            let (start, end, perms, path) = header;
            current = Some((start, end - start, path == exe && !perms.contains('w')));
        } else if let Some(kib) = field_kib(line, "Rss:") {
            rss = kib;
        } else if let Some(kib) = field_kib(line, "Anonymous:") {
            anonymous = Some(kib);
        }
    }
    finish(current, rss, anonymous);
    found
}

/// `start-end perms offset dev inode [path]`: (start, end, perms, path), the path "" when none.
fn mapping_header(line: &str) -> Option<(usize, usize, &str, &str)> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    // offset, dev and inode; a field line ("Rss:   4 kB") has none of this shape.
    for _ in 0..3 {
        fields.next()?;
    }
    let path = fields.next().unwrap_or("").trim_start();
    (perms.len() == 4).then_some((start, end, perms, path))
}

fn field_kib(line: &str, name: &str) -> Option<u64> {
    line.strip_prefix(name)?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXE: &str = "/usr/bin/berth-agent";

    fn smaps(mappings: &[(&str, &str, u64, u64)]) -> String {
        mappings
            .iter()
            .map(|(range, perms_path, rss, anon)| {
                let (perms, path) = perms_path.split_once(' ').unwrap_or((perms_path, ""));
                format!(
                    "{range} {perms} 00000000 fe:01 1234                       {path}\n\
                     Size:               8 kB\nRss:             {rss} kB\n\
                     Anonymous:       {anon} kB\nVmFlags: rd ex mr mw me\n"
                )
            })
            .collect()
    }

    #[test]
    fn only_the_executables_clean_read_only_mappings_are_released() {
        let text = smaps(&[
            // Read-only data and text of the agent: released.
            ("1000-3000", &format!("r--p {EXE}"), 8, 0),
            ("3000-9000", &format!("r-xp {EXE}"), 20, 0),
            // RELRO: read-only now, but relocated (copied on write): kept.
            ("9000-a000", &format!("r--p {EXE}"), 4, 4),
            // Writable data of the agent: kept.
            ("a000-b000", &format!("rw-p {EXE}"), 4, 4),
            // A library's text, the heap, an anonymous mapping: kept.
            (
                "c000-d000",
                "r-xp /usr/lib/x86_64-linux-gnu/libc.so.6",
                4,
                0,
            ),
            ("d000-e000", "rw-p [heap]", 4, 4),
            ("e000-f000", "rw-p", 4, 4),
        ]);
        assert_eq!(
            releasable(&text, EXE),
            vec![
                Mapping {
                    start: 0x1000,
                    len: 0x2000,
                    rss_kib: 8
                },
                Mapping {
                    start: 0x3000,
                    len: 0x6000,
                    rss_kib: 20
                },
            ]
        );
    }

    #[test]
    fn a_replaced_binary_is_still_this_executable() {
        // After an upgrade renamed a new binary over it, both name the old file "(deleted)".
        let exe = format!("{EXE} (deleted)");
        let text = smaps(&[("3000-9000", &format!("r-xp {exe}"), 20, 0)]);
        assert_eq!(releasable(&text, &exe).len(), 1);
        assert!(releasable(&text, EXE).is_empty());
    }

    /// On this very process: its text is resident, releasing unmaps it, and the code on those
    /// pages runs again (this test returns), while the relocated data keeps its pages.
    #[cfg(target_os = "linux")]
    #[test]
    fn releasing_unmaps_this_process_text_and_it_keeps_running() {
        let resident = || {
            let exe = std::fs::read_link("/proc/self/exe").unwrap();
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            releasable(&smaps, &exe.to_string_lossy())
                .iter()
                .map(|m| m.rss_kib)
                .sum::<u64>()
        };
        let before = resident();
        assert!(before > 0, "the test binary's text is resident");
        let released = release_unused_pages().unwrap();
        assert!(
            released >= before / 2,
            "released {released} of {before} KiB"
        );
        let after = resident();
        assert!(
            after < before,
            "resident text after releasing: {after} KiB, before: {before} KiB"
        );
        // Code and data on released pages still work (read from the file again).
        assert_eq!(format!("{:?}", Some(1_u8)), "Some(1)");
    }
}
