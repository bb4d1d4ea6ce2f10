//! Resource readings of the current process, from the kernel's own accounting.

/// Peak resident set size in bytes (`VmHWM` of `/proc/self/status`); `None` where unavailable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// User plus system CPU seconds consumed by this process (all threads) so far.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes into the zero-initialised struct we pass.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return 0.0;
        }
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// The cores this process is held to and their steal (seconds) when [`mark_start`] ran.
static START: std::sync::OnceLock<(Vec<usize>, Option<f64>)> = std::sync::OnceLock::new();

/// Notes the hypervisor's steal on this process's cores now, for [`steal_seconds`]; call it once
/// the process is on its cores (a node after pinning itself). Later calls do nothing.
pub fn mark_start() {
    START.get_or_init(|| {
        let cores = held_cores();
        let steal = proc_stat_steal(&cores);
        (cores, steal)
    });
}

/// Seconds a hypervisor gave this process's cores to other guests since [`mark_start`]
/// (`/proc/stat`'s steal column, summed over the cores): time the node's code could not run
/// though it was not waiting, so its compute and waits include it. `None` where the process may
/// run on every core (its steal is then the machine's, not its own), or `mark_start` never ran.
pub fn steal_seconds() -> Option<f64> {
    let (cores, start) = START.get()?;
    if cores.is_empty() {
        return None;
    }
    Some((proc_stat_steal(cores)? - (*start)?).max(0.0))
}

/// Steal seconds of `cores` since boot (`/proc/stat`); the difference of two readings is the
/// time the hypervisor gave those cores to other guests in between. `None` where a core's line
/// is missing (not Linux, or no such core).
pub fn cores_steal_seconds(cores: &[usize]) -> Option<f64> {
    proc_stat_steal(cores)
}

/// Every core this process may run on (its affinity mask), in order; empty where the mask
/// cannot be read.
pub fn allowed_cores() -> Vec<usize> {
    // SAFETY: sched_getaffinity writes into the zero-initialised set we pass, of its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        set
    };
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `core` is below CPU_SETSIZE, the set's size.
        .filter(|&core| unsafe { libc::CPU_ISSET(core, &set) })
        .collect()
}

/// The cores this process may run on, where that is fewer than the machine's online cores;
/// empty otherwise.
fn held_cores() -> Vec<usize> {
    let cores = allowed_cores();
    // SAFETY: sysconf only reads.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if usize::try_from(online).is_ok_and(|online| cores.len() < online) {
        cores
    } else {
        Vec::new()
    }
}

/// Steal seconds of `cores` so far, from `/proc/stat`.
fn proc_stat_steal(cores: &[usize]) -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    // SAFETY: sysconf only reads.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    steal_of(&text, cores, if ticks > 0 { ticks as f64 } else { 100.0 })
}

/// Steal seconds of `cores` in a `/proc/stat` text (the 8th value of each `cpuN` line, in clock
/// ticks of `ticks_per_second`); `None` where a core's line is missing or short.
fn steal_of(proc_stat: &str, cores: &[usize], ticks_per_second: f64) -> Option<f64> {
    let mut ticks = 0u64;
    for core in cores {
        let label = format!("cpu{core}");
        let line = proc_stat
            .lines()
            .find(|l| l.split_whitespace().next() == Some(label.as_str()))?;
        ticks += line.split_whitespace().nth(8)?.parse::<u64>().ok()?;
    }
    Some(ticks as f64 / ticks_per_second)
}

/// Seconds the kernel held this process off the CPU for exceeding its cgroup's CPU quota (the
/// CFS bandwidth limit `--node-cpu` sets), since the group was made: `throttled_time` of cgroup
/// v1's `cpu.stat`, `throttled_usec` of v2's. `None` where the process's group has no CPU quota.
///
/// Under a quota, the wall time of a node's compute includes the periods its group was held off
/// (every thread stops until the next period), so a node's compute can read twice its CPU time
/// while another's, throttled during its waits instead, does not: this figure says which.
pub fn quota_throttled_seconds() -> Option<f64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    throttled_seconds_of(&cgroups, |path| std::fs::read_to_string(path).ok())
}

/// Where this process's group of the cpu controller may be, from the text of
/// `/proc/self/cgroup`: cgroup v1's directories (true: v1) under the hierarchy's mount, named by
/// its controllers ("cpu,cpuacct" where the two share one) or "cpu", then v2's (false) in its
/// single hierarchy. Several may be listed (a hybrid machine has both); the first that exists
/// with the files wanted is the group.
pub fn cpu_group_candidates(proc_cgroup: &str) -> Vec<(std::path::PathBuf, bool)> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut v1 = Vec::new();
    let mut v2 = Vec::new();
    for line in proc_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if id != "0" && controllers.split(',').any(|c| c == "cpu") {
            v1.push((root.join(controllers).join(path), true));
            if controllers != "cpu" {
                v1.push((root.join("cpu").join(path), true));
            }
        } else if id == "0" && controllers.is_empty() {
            v2.push((root.join(path), false));
        }
    }
    v1.extend(v2);
    v1
}

/// [`quota_throttled_seconds`] from the text of `/proc/self/cgroup` and a file reader.
fn throttled_seconds_of(
    proc_cgroup: &str,
    read: impl Fn(&std::path::Path) -> Option<String>,
) -> Option<f64> {
    let stat_value = |dir: &std::path::Path, key: &str| -> Option<f64> {
        read(&dir.join("cpu.stat"))?
            .lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse::<f64>().ok())
    };
    for (dir, v1) in cpu_group_candidates(proc_cgroup) {
        if v1 {
            // No quota: -1.
            if let Some(quota) = read(&dir.join("cpu.cfs_quota_us")) {
                let limited = quota.trim().parse::<i64>().is_ok_and(|q| q > 0);
                return limited
                    .then(|| stat_value(&dir, "throttled_time "))
                    .flatten()
                    .map(|ns| ns / 1e9);
            }
        } else if let Some(max) = read(&dir.join("cpu.max")) {
            // No quota: "max 100000".
            if max.split_whitespace().next().is_some_and(|q| q != "max") {
                return stat_value(&dir, "throttled_usec ").map(|us| us / 1e6);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_plausible() {
        let rss = peak_rss_bytes().expect("Linux has /proc/self/status");
        assert!(rss > 1 << 20, "peak RSS {rss}");
        let before = cpu_seconds();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(cpu_seconds() > before);
    }

    #[test]
    fn steal_is_summed_over_the_given_cores() {
        let stat = "cpu  647502 0 61923 506893 8387 0 2570 974 0 0\n\
                    cpu0 320842 0 27027 262632 1682 0 1166 489 0 0\n\
                    cpu1 326660 0 34895 244261 6704 0 1404 485 0 0\n";
        assert_eq!(steal_of(stat, &[0], 100.0), Some(4.89));
        assert_eq!(steal_of(stat, &[1], 100.0), Some(4.85));
        assert_eq!(steal_of(stat, &[0, 1], 100.0), Some(9.74));
        assert_eq!(steal_of(stat, &[2], 100.0), None);
        assert_eq!(steal_of("cpu0 1 2 3\n", &[0], 100.0), None);
        // Not marked in this test process: nothing to report.
        assert_eq!(steal_seconds(), None);
    }

    #[test]
    fn throttling_is_read_from_the_quota_group_of_either_cgroup_version() {
        use std::collections::HashMap;
        let files = |entries: &[(&str, &str)]| {
            let map: HashMap<std::path::PathBuf, String> = entries
                .iter()
                .map(|(p, t)| (std::path::PathBuf::from(p), t.to_string()))
                .collect();
            move |p: &std::path::Path| map.get(p).cloned()
        };
        let v1_stat = "nr_periods 860\nnr_throttled 855\nthrottled_time 42603524116\nnr_bursts 0\n";
        // v1, a group of its own with a quota (a hybrid machine also lists the empty v2 line).
        let v1 = "2:cpuacct:/\n1:cpu:/ringtmp-7-1\n0::/\n";
        let limited = files(&[
            ("/sys/fs/cgroup/cpu/ringtmp-7-1/cpu.cfs_quota_us", "50000\n"),
            ("/sys/fs/cgroup/cpu/ringtmp-7-1/cpu.stat", v1_stat),
        ]);
        let seconds = throttled_seconds_of(v1, &limited).unwrap();
        assert!((seconds - 42.603524116).abs() < 1e-9, "{seconds}");
        // The same group without a quota, and the root group: nothing to report.
        let unlimited = files(&[
            ("/sys/fs/cgroup/cpu/ringtmp-7-1/cpu.cfs_quota_us", "-1\n"),
            ("/sys/fs/cgroup/cpu/ringtmp-7-1/cpu.stat", v1_stat),
        ]);
        assert_eq!(throttled_seconds_of(v1, &unlimited), None);
        assert_eq!(throttled_seconds_of("1:cpu:/\n0::/\n", &limited), None);
        // v1 with cpu and cpuacct mounted together.
        let shared = files(&[
            ("/sys/fs/cgroup/cpu,cpuacct/g/cpu.cfs_quota_us", "25000"),
            ("/sys/fs/cgroup/cpu,cpuacct/g/cpu.stat", v1_stat),
        ]);
        assert!(throttled_seconds_of("3:cpu,cpuacct:/g\n", &shared).is_some());
        // v2.
        let v2 = "0::/ringtmp-7-1\n";
        let stat = "usage_usec 5\nnr_periods 9\nnr_throttled 3\nthrottled_usec 2500000\n";
        let quota = files(&[
            ("/sys/fs/cgroup/ringtmp-7-1/cpu.max", "50000 100000\n"),
            ("/sys/fs/cgroup/ringtmp-7-1/cpu.stat", stat),
        ]);
        assert_eq!(throttled_seconds_of(v2, &quota), Some(2.5));
        let no_quota = files(&[
            ("/sys/fs/cgroup/ringtmp-7-1/cpu.max", "max 100000\n"),
            ("/sys/fs/cgroup/ringtmp-7-1/cpu.stat", stat),
        ]);
        assert_eq!(throttled_seconds_of(v2, &no_quota), None);
        assert_eq!(throttled_seconds_of("garbage\n", &quota), None);
    }
}
