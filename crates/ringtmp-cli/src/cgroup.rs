//! Real limits for local node processes, through cgroups:
//! - `--node-cpu RANK:CORES`: a CFS quota of CORES × period, so a node emulating a half-core
//!   board gets half a core from the kernel, not a sleep after each computation;
//! - `--enforce-memory-limit`: `--node-memory-limit` as the process's hard memory limit (swap
//!   included), so a node that does not fit is killed as on a board with that much memory, and
//!   the launcher says which limit it exceeded (the group counts the OOM kill).
//!
//! Works on cgroup v2 (controllers enabled for the group's parent: `cpu.max`, `memory.max`) and
//! on cgroup v1 (the `cpu` and `memory` hierarchies). Where neither is writable the run is
//! refused before any node starts, with what was tried and why it failed. Invariant: every group
//! created is removed when the [`NodeCgroups`] is dropped (after the nodes have exited); a group
//! that cannot be removed is reported, not silently left.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::error::UsageError;

/// CFS period: 100 ms, the kernel's default.
const PERIOD_US: u64 = 100_000;

/// Which cgroup interface a group is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// The groups of one launch's limited nodes.
#[derive(Debug, Default)]
pub struct NodeCgroups {
    groups: Vec<(u32, PathBuf, Version)>,
    /// Memory-limited nodes: rank, limit, group.
    memory: Vec<(u32, u64, PathBuf, Version)>,
}

/// `RANK:CORES` entries (comma-separated or repeated; `all:CORES` for every node, which later
/// entries may override) → cores per rank (`None`: unlimited).
pub fn parse_node_cpu(entries: &[String], nodes: u32) -> Result<Vec<Option<f64>>> {
    let mut cores = vec![None; nodes as usize];
    for entry in entries {
        for part in entry.split(',') {
            let bad = |why: String| UsageError(format!("--node-cpu {part:?}: {why}"));
            let (rank, share) = part
                .split_once(':')
                .ok_or_else(|| bad("expected RANK:CORES, e.g. 2:0.5, or all:CORES".into()))?;
            let ranks = if rank.trim() == "all" {
                0..nodes
            } else {
                let rank: u32 = rank
                    .trim()
                    .parse()
                    .map_err(|_| bad(format!("{rank:?} is not a rank")))?;
                if rank >= nodes {
                    return Err(bad(format!(
                        "rank {rank} does not exist in a run of {nodes} nodes"
                    ))
                    .into());
                }
                rank..rank + 1
            };
            let share: f64 = share
                .trim()
                .parse()
                .map_err(|_| bad(format!("{share:?} is not a number of cores")))?;
            if !(share.is_finite() && share > 0.0) {
                return Err(bad(format!(
                    "a CPU share must be more than zero cores, got {share}"
                ))
                .into());
            }
            // The kernel's smallest quota is 1 ms per period.
            if share * (PERIOD_US as f64) < 1000.0 {
                return Err(bad(format!(
                    "{share} cores is below the kernel's 0.01-core minimum"
                ))
                .into());
            }
            for rank in ranks {
                cores[rank as usize] = Some(share);
            }
        }
    }
    Ok(cores)
}

/// A cgroup controller this module uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    /// CPU quotas.
    Cpu,
    /// Memory limits.
    Memory,
}

impl Controller {
    fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Memory => "memory",
        }
    }
}

/// Where a new group with `controller` can be made: the v2 root with the controller enabled for
/// its children, else the controller's v1 hierarchy. An error says what was tried.
fn parent(controller: Controller) -> std::result::Result<(PathBuf, Version), String> {
    let name = controller.name();
    let mut tried = Vec::new();
    let v2 = Path::new("/sys/fs/cgroup");
    match std::fs::read_to_string(v2.join("cgroup.controllers")) {
        Ok(controllers) if controllers.split_whitespace().any(|c| c == name) => {
            let control = v2.join("cgroup.subtree_control");
            match std::fs::write(&control, format!("+{name}")) {
                Ok(()) => return Ok((v2.to_path_buf(), Version::V2)),
                Err(e) => tried.push(format!("{} (v2): {e}", control.display())),
            }
        }
        Ok(_) => tried.push(format!("{} (v2): no {name} controller", v2.display())),
        Err(e) => tried.push(format!(
            "{} (v2): {e}",
            v2.join("cgroup.controllers").display()
        )),
    }
    let v1 = v2.join(name);
    let probe_file = match controller {
        Controller::Cpu => "cpu.cfs_quota_us",
        Controller::Memory => "memory.limit_in_bytes",
    };
    if v1.join(probe_file).is_file() {
        let probe = v1.join(format!("ringtmp-probe-{}", std::process::id()));
        match std::fs::create_dir(&probe) {
            Ok(()) => {
                let _ = std::fs::remove_dir(&probe);
                return Ok((v1, Version::V1));
            }
            Err(e) => tried.push(format!("{} (v1): {e}", v1.display())),
        }
    } else {
        tried.push(format!("{} (v1): no {probe_file}", v1.display()));
    }
    Err(tried.join("; "))
}

impl NodeCgroups {
    /// Checks that groups can be made for what is asked (before any node starts).
    pub fn check(cores: &[Option<f64>], memory: &[Option<u64>]) -> Result<()> {
        let wanted = [
            (
                Controller::Cpu,
                cores.iter().any(Option::is_some),
                "--node-cpu",
            ),
            (
                Controller::Memory,
                memory.iter().any(Option::is_some),
                "--enforce-memory-limit",
            ),
        ];
        for (controller, asked, flag) in wanted {
            if !asked {
                continue;
            }
            parent(controller).map_err(|tried| {
                UsageError(format!(
                    "{flag} needs a writable cgroup {} controller, and none was found \
                     (tried {tried}); run as root, or in a container or systemd unit with a \
                     delegated cgroup{}",
                    controller.name(),
                    match controller {
                        Controller::Cpu => ", or use --node-speed to emulate slow nodes instead",
                        Controller::Memory => "",
                    }
                ))
            })?;
        }
        Ok(())
    }

    /// The group of node `rank` for `controller` (made on first use).
    fn join(&mut self, controller: Controller, rank: u32) -> Result<(PathBuf, Version)> {
        let (parent, version) =
            parent(controller).map_err(|tried| anyhow::anyhow!("cgroups: {tried}"))?;
        let dir = parent.join(format!("ringtmp-{}-rank{rank}", std::process::id()));
        if !self.groups.iter().any(|(_, d, _)| *d == dir) {
            std::fs::create_dir_all(&dir)
                .map_err(|e| anyhow::anyhow!("making {}: {e}", dir.display()))?;
            self.groups.push((rank, dir.clone(), version));
        }
        Ok((dir, version))
    }

    fn write(dir: &Path, file: &str, value: &str, rank: u32) -> Result<()> {
        std::fs::write(dir.join(file), value)
            .map_err(|e| anyhow::anyhow!("limiting rank {rank}: {}: {e}", dir.join(file).display()))
    }

    /// Puts process `pid` (node `rank`) under a quota of `cores` cores.
    pub fn limit(&mut self, rank: u32, pid: u32, cores: f64) -> Result<()> {
        let (dir, version) = self.join(Controller::Cpu, rank)?;
        let quota = (cores * PERIOD_US as f64).round() as u64;
        match version {
            Version::V2 => Self::write(&dir, "cpu.max", &format!("{quota} {PERIOD_US}"), rank)?,
            Version::V1 => {
                Self::write(&dir, "cpu.cfs_period_us", &PERIOD_US.to_string(), rank)?;
                Self::write(&dir, "cpu.cfs_quota_us", &quota.to_string(), rank)?;
            }
        }
        Self::write(&dir, "cgroup.procs", &pid.to_string(), rank)
    }

    /// Holds process `pid` (node `rank`) to `bytes` of memory, swap included.
    pub fn limit_memory(&mut self, rank: u32, pid: u32, bytes: u64) -> Result<()> {
        let (dir, version) = self.join(Controller::Memory, rank)?;
        match version {
            Version::V2 => {
                Self::write(&dir, "memory.max", &bytes.to_string(), rank)?;
                // No swap to spill into: a board without swap is what the limit stands for.
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            }
            Version::V1 => {
                Self::write(&dir, "memory.limit_in_bytes", &bytes.to_string(), rank)?;
                if dir.join("memory.memsw.limit_in_bytes").is_file() {
                    Self::write(
                        &dir,
                        "memory.memsw.limit_in_bytes",
                        &bytes.to_string(),
                        rank,
                    )?;
                }
            }
        }
        self.memory.push((rank, bytes, dir.clone(), version));
        Self::write(&dir, "cgroup.procs", &pid.to_string(), rank)
    }

    /// Why node `rank` died, if the kernel killed it for exceeding its memory limit.
    pub fn explain(&self, rank: u32) -> Option<String> {
        let (_, bytes, dir, version) = self.memory.iter().find(|m| m.0 == rank)?;
        let killed = match version {
            Version::V2 => counter(&dir.join("memory.events"), "oom_kill"),
            Version::V1 => counter(&dir.join("memory.oom_control"), "oom_kill").or_else(|| {
                std::fs::read_to_string(dir.join("memory.failcnt"))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            }),
        }?;
        (killed > 0).then(|| {
            format!(
                "rank {rank} exceeded its {} memory limit (the kernel's OOM killer ended it; \
                 --node-memory-limit with --enforce-memory-limit)",
                show(*bytes)
            )
        })
    }
}

/// `key N` from a cgroup file of such lines.
fn counter(path: &Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
}

fn show(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes}-byte")
    }
}

/// `--strategy local --node-cpu 0:CORES`: this process under a quota of its own for the run, as
/// a node process would be, so a one-board baseline runs on the same share as each ring node.
/// Dropping it moves the process back to the group it came from and removes the quota's group.
#[derive(Debug)]
pub struct ProcessQuota {
    groups: NodeCgroups,
    /// The `cgroup.procs` of the group the process was in.
    home: PathBuf,
}

impl ProcessQuota {
    /// Moves this process into a new group with a quota of `cores` cores.
    pub fn apply(cores: f64) -> Result<Self> {
        NodeCgroups::check(&[Some(cores)], &[None])?;
        let (_, version) =
            parent(Controller::Cpu).map_err(|tried| anyhow::anyhow!("cgroups: {tried}"))?;
        let home = home_group(version).ok_or_else(|| {
            anyhow::anyhow!("cgroups: this process's own cpu group is not in /proc/self/cgroup")
        })?;
        let mut groups = NodeCgroups::default();
        groups.limit(0, std::process::id(), cores)?;
        Ok(Self {
            groups,
            home: home.join("cgroup.procs"),
        })
    }
}

impl Drop for ProcessQuota {
    fn drop(&mut self) {
        // A group with a process in it cannot be removed: leave it first.
        if let Err(e) = std::fs::write(&self.home, std::process::id().to_string()) {
            eprintln!(
                "could not leave the quota's cgroup for {}: {e}",
                self.home.display()
            );
        }
        drop(std::mem::take(&mut self.groups));
    }
}

/// The directory of this process's own group in the hierarchy of `version`'s cpu controller
/// (the launcher makes v1 groups under `/sys/fs/cgroup/cpu`).
fn home_group(version: Version) -> Option<PathBuf> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let v1_root = Path::new("/sys/fs/cgroup/cpu");
    ringtmp_metrics::resources::cpu_group_candidates(&cgroups)
        .into_iter()
        .find(|(dir, v1)| match version {
            Version::V1 => *v1 && dir.starts_with(v1_root),
            Version::V2 => !*v1,
        })
        .map(|(dir, _)| dir)
}

impl Drop for NodeCgroups {
    fn drop(&mut self) {
        for (rank, dir, _) in self.groups.drain(..) {
            // The node has exited, but the kernel may take a moment to empty the group.
            let mut removed = false;
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    removed = true;
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if !removed {
                eprintln!(
                    "launcher: could not remove rank {rank}'s cgroup {}; remove it with rmdir",
                    dir.display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_and_bad_ones_are_named() {
        let cores = parse_node_cpu(&["1:0.5,3:2".into()], 4).unwrap();
        assert_eq!(cores, [None, Some(0.5), None, Some(2.0)]);
        let cores = parse_node_cpu(&["all:0.25,2:1".into()], 3).unwrap();
        assert_eq!(
            cores,
            [Some(0.25), Some(0.25), Some(1.0)],
            "all, then one overridden"
        );
        for (bad, needle) in [
            ("1:0", "more than zero"),
            ("all:0", "more than zero"),
            ("every:1", "not a rank"),
            ("4:1", "rank 4 does not exist"),
            ("1", "expected RANK:CORES"),
            ("1:x", "not a number"),
            ("1:0.001", "minimum"),
        ] {
            let e = parse_node_cpu(&[bad.into()], 4).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
