//! Where this process stands in the run: its rank, the world size and rank 0's rendezvous
//! address, taken from the first source that provides them, in this order:
//!
//! 1. command-line flags (`--rank`, `--world-size`, `--master-addr`, `--master-port`);
//! 2. `RINGTMP_RANK`, `RINGTMP_WORLD_SIZE`, `RINGTMP_MASTER_ADDR`, `RINGTMP_MASTER_PORT`;
//! 3. torchrun: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`;
//! 4. Slurm: `SLURM_PROCID`, `SLURM_NTASKS`, rank 0 on the first host of `SLURM_JOB_NODELIST`;
//! 5. Open MPI: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`;
//! 6. PMI (MPICH, Intel MPI): `PMI_RANK`, `PMI_SIZE`;
//! 7. Kubernetes indexed jobs: `JOB_COMPLETION_INDEX`, with the world size from `--world-size`.
//!
//! Rank and world size come together from one source. The rendezvous address is resolved on its
//! own: flag, then `RINGTMP_MASTER_ADDR`/`_PORT`, then `MASTER_ADDR`/`_PORT`, then (under Slurm)
//! the first host of the job, then 127.0.0.1:29500. The environment is passed in as a function so
//! tests can use fake ones.

use crate::hostlist;

/// Default rendezvous port (the one torchrun uses).
pub const DEFAULT_PORT: u16 = 29500;

/// The launcher (or flag set) that provided rank and world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `--rank` and `--world-size`.
    Flags,
    /// `RINGTMP_*` variables.
    Ringtmp,
    /// torchrun.
    Torchrun,
    /// Slurm.
    Slurm,
    /// Open MPI.
    OpenMpi,
    /// PMI.
    Pmi,
    /// Kubernetes indexed job.
    Kubernetes,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Flags => "command-line flags",
            Self::Ringtmp => "RINGTMP_* variables",
            Self::Torchrun => "torchrun (RANK/WORLD_SIZE)",
            Self::Slurm => "Slurm (SLURM_PROCID/SLURM_NTASKS)",
            Self::OpenMpi => "Open MPI (OMPI_COMM_WORLD_RANK/SIZE)",
            Self::Pmi => "PMI (PMI_RANK/PMI_SIZE)",
            Self::Kubernetes => "Kubernetes indexed job (JOB_COMPLETION_INDEX)",
        })
    }
}

/// Placement given on the command line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchFlags {
    /// `--rank`.
    pub rank: Option<u32>,
    /// `--world-size`.
    pub world_size: Option<u32>,
    /// `--master-addr`.
    pub master_addr: Option<String>,
    /// `--master-port`.
    pub master_port: Option<u16>,
}

/// This process's place in the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// This node's rank.
    pub rank: u32,
    /// Number of nodes.
    pub world_size: u32,
    /// Host rank 0 listens on for rendezvous.
    pub master_addr: String,
    /// Port rank 0 listens on.
    pub master_port: u16,
    /// Where rank and world size came from.
    pub source: Source,
}

/// Why no placement could be resolved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// No source provided rank and world size.
    #[error(
        "no rank/world size: pass --rank and --world-size, set RINGTMP_RANK and RINGTMP_WORLD_SIZE, \
         or start under torchrun, Slurm, Open MPI, PMI or a Kubernetes indexed job"
    )]
    Missing,
    /// A variable or flag holds something that is not a number in range.
    #[error("{name}={value:?} is not valid: {reason}")]
    Invalid {
        /// Variable or flag.
        name: String,
        /// Its value.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The Slurm node list could not be read.
    #[error(transparent)]
    HostList(#[from] hostlist::HostListError),
}

/// Resolves this process's placement from `flags` and the environment `env`.
pub fn resolve(
    flags: &LaunchFlags,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Placement, LaunchError> {
    let (rank, world_size, source) = rank_and_size(flags, env)?;
    if world_size == 0 {
        return Err(invalid("world size", "0", "must be at least 1"));
    }
    if rank >= world_size {
        return Err(invalid(
            "rank",
            &rank.to_string(),
            &format!("must be below the world size {world_size}"),
        ));
    }
    let master_addr = match flags
        .master_addr
        .clone()
        .or_else(|| env("RINGTMP_MASTER_ADDR"))
        .or_else(|| env("MASTER_ADDR"))
    {
        Some(a) => a,
        None => match env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")) {
            Some(list) if source == Source::Slurm => hostlist::first_host(&list)?,
            _ => "127.0.0.1".to_string(),
        },
    };
    let master_port = match flags.master_port {
        Some(p) => p,
        None => match env("RINGTMP_MASTER_PORT")
            .map(|v| ("RINGTMP_MASTER_PORT", v))
            .or_else(|| env("MASTER_PORT").map(|v| ("MASTER_PORT", v)))
        {
            Some((name, v)) => v
                .parse()
                .map_err(|_| invalid(name, &v, "not a port number"))?,
            None => DEFAULT_PORT,
        },
    };
    Ok(Placement {
        rank,
        world_size,
        master_addr,
        master_port,
        source,
    })
}

fn rank_and_size(
    flags: &LaunchFlags,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(u32, u32, Source), LaunchError> {
    if let (Some(r), Some(w)) = (flags.rank, flags.world_size) {
        return Ok((r, w, Source::Flags));
    }
    let pairs: [(&str, &str, Source); 5] = [
        ("RINGTMP_RANK", "RINGTMP_WORLD_SIZE", Source::Ringtmp),
        ("RANK", "WORLD_SIZE", Source::Torchrun),
        ("SLURM_PROCID", "SLURM_NTASKS", Source::Slurm),
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            Source::OpenMpi,
        ),
        ("PMI_RANK", "PMI_SIZE", Source::Pmi),
    ];
    for (rank_var, size_var, source) in pairs {
        if let (Some(r), Some(w)) = (env(rank_var), env(size_var)) {
            return Ok((number(rank_var, &r)?, number(size_var, &w)?, source));
        }
    }
    if let Some(index) = env("JOB_COMPLETION_INDEX") {
        let size = match flags.world_size {
            Some(w) => w,
            None => match env("RINGTMP_WORLD_SIZE") {
                Some(w) => number("RINGTMP_WORLD_SIZE", &w)?,
                None => {
                    return Err(invalid(
                        "JOB_COMPLETION_INDEX",
                        &index,
                        "a Kubernetes indexed job needs --world-size (or RINGTMP_WORLD_SIZE)",
                    ));
                }
            },
        };
        return Ok((
            number("JOB_COMPLETION_INDEX", &index)?,
            size,
            Source::Kubernetes,
        ));
    }
    // A lone flag (rank without world size, say) is a mistake worth naming.
    if flags.rank.is_some() != flags.world_size.is_some() {
        return Err(invalid("--rank/--world-size", "", "give both or neither"));
    }
    Err(LaunchError::Missing)
}

fn number(name: &str, value: &str) -> Result<u32, LaunchError> {
    value
        .trim()
        .parse()
        .map_err(|_| invalid(name, value, "not a non-negative integer"))
}

fn invalid(name: &str, value: &str, reason: &str) -> LaunchError {
    LaunchError::Invalid {
        name: name.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn resolve_env(pairs: &[(&str, &str)]) -> Result<Placement, LaunchError> {
        resolve(&LaunchFlags::default(), &env(pairs))
    }

    #[test]
    fn flags_win_over_everything() {
        let flags = LaunchFlags {
            rank: Some(1),
            world_size: Some(2),
            master_addr: Some("10.0.0.9".into()),
            master_port: Some(7000),
        };
        let p = resolve(
            &flags,
            &env(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "h")]),
        )
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.master_addr.as_str(),
                p.master_port,
                p.source
            ),
            (1, 2, "10.0.0.9", 7000, Source::Flags)
        );
    }

    #[test]
    fn ringtmp_variables_before_torchrun() {
        let p = resolve_env(&[
            ("RINGTMP_RANK", "2"),
            ("RINGTMP_WORLD_SIZE", "3"),
            ("RINGTMP_MASTER_ADDR", "a"),
            ("RINGTMP_MASTER_PORT", "1234"),
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "b"),
            ("MASTER_PORT", "99"),
        ])
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.master_addr.as_str(),
                p.master_port,
                p.source
            ),
            (2, 3, "a", 1234, Source::Ringtmp)
        );
    }

    #[test]
    fn torchrun() {
        let p = resolve_env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "trainer-0"),
            ("MASTER_PORT", "29400"),
        ])
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.master_addr.as_str(),
                p.master_port,
                p.source
            ),
            (3, 4, "trainer-0", 29400, Source::Torchrun)
        );
    }

    #[test]
    fn slurm_uses_first_host_of_the_node_list() {
        let p = resolve_env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_NODELIST", "cn[007-010],gpu1"),
        ])
        .unwrap();
        assert_eq!(
            (
                p.rank,
                p.world_size,
                p.master_addr.as_str(),
                p.master_port,
                p.source
            ),
            (5, 8, "cn007", DEFAULT_PORT, Source::Slurm)
        );
        let err = resolve_env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "cn[1-"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("cn[1-"), "{err}");
    }

    #[test]
    fn open_mpi_and_pmi() {
        let p =
            resolve_env(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "3")]).unwrap();
        assert_eq!(
            (p.rank, p.world_size, p.master_addr.as_str(), p.source),
            (1, 3, "127.0.0.1", Source::OpenMpi)
        );
        let p = resolve_env(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MASTER_ADDR", "head"),
        ])
        .unwrap();
        assert_eq!(
            (p.rank, p.world_size, p.master_addr.as_str(), p.source),
            (0, 2, "head", Source::Pmi)
        );
    }

    #[test]
    fn kubernetes_indexed_job_needs_a_world_size() {
        let flags = LaunchFlags {
            world_size: Some(4),
            ..Default::default()
        };
        let p = resolve(
            &flags,
            &env(&[("JOB_COMPLETION_INDEX", "2"), ("MASTER_ADDR", "job-0.svc")]),
        )
        .unwrap();
        assert_eq!(
            (p.rank, p.world_size, p.master_addr.as_str(), p.source),
            (2, 4, "job-0.svc", Source::Kubernetes)
        );
        let err = resolve_env(&[("JOB_COMPLETION_INDEX", "2")]).unwrap_err();
        assert!(err.to_string().contains("--world-size"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        let err = resolve_env(&[("RANK", "two"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(err.to_string().contains("RANK=\"two\""), "{err}");
        let err = resolve_env(&[("RANK", "4"), ("WORLD_SIZE", "4")]).unwrap_err();
        assert!(err.to_string().contains("below the world size 4"), "{err}");
        let err = resolve_env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")])
            .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        assert_eq!(resolve_env(&[]), Err(LaunchError::Missing));
        let lone = LaunchFlags {
            rank: Some(0),
            ..Default::default()
        };
        assert!(
            resolve(&lone, &env(&[]))
                .unwrap_err()
                .to_string()
                .contains("both or neither")
        );
    }
}
