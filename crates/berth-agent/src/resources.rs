//! Host resource usage from /proc and statvfs: CPU busy share between two samples, memory in
//! use, and space on the file system holding the state directory.

use std::path::Path;

use berth_proto::agent::ResourceUsage;

/// Keeps the previous CPU sample so each report covers the time since the last one.
#[derive(Default)]
pub struct Sampler {
    previous_cpu: Option<(u64, u64)>,
}

impl Sampler {
    pub fn sample(&mut self, state_dir: &Path) -> ResourceUsage {
        let cpu = read_cpu_times();
        let cpu_percent = match (self.previous_cpu, cpu) {
            (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
                (busy1.saturating_sub(busy0)) as f64 * 100.0 / (total1 - total0) as f64
            }
            _ => 0.0,
        };
        if cpu.is_some() {
            self.previous_cpu = cpu;
        }
        let (memory_total_bytes, memory_used_bytes) = read_memory().unwrap_or((0, 0));
        let (disk_free_bytes, disk_total_bytes) = disk_space(state_dir).unwrap_or((0, 0));
        ResourceUsage {
            cpu_percent: (cpu_percent * 10.0).round() / 10.0,
            cpu_cores: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            memory_used_bytes,
            memory_total_bytes,
            disk_free_bytes,
            disk_total_bytes,
        }
    }
}

/// (busy, total) jiffies from the first line of /proc/stat.
fn read_cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    if fields.len() < 5 {
        return None;
    }
    let total: u64 = fields.iter().sum();
    let idle = fields[3] + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// (total, used) bytes, used = MemTotal − MemAvailable.
fn read_memory() -> Option<(u64, u64)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:")?;
    Some((total, total.saturating_sub(available)))
}

/// (free for unprivileged users, total) bytes.
pub(crate) fn disk_space(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c_path is a valid NUL-terminated string and stat a properly sized out-parameter.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    let frsize = stat.f_frsize as u64;
    Some((stat.f_bavail as u64 * frsize, stat.f_blocks as u64 * frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_this_host() {
        let mut s = Sampler::default();
        let first = s.sample(Path::new("/"));
        assert!(first.memory_total_bytes > 0);
        assert!(first.memory_used_bytes <= first.memory_total_bytes);
        assert!(first.disk_total_bytes > 0 && first.disk_free_bytes <= first.disk_total_bytes);
        let second = s.sample(Path::new("/"));
        assert!((0.0..=100.0).contains(&second.cpu_percent));
    }
}
