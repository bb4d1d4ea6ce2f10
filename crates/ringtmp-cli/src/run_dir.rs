//! The output directory of a run: chosen (a fresh `runs/<time>-<strategy>` by default), checked
//! before anything starts, and never silently shared with another run.
//!
//! A directory *holds a run* when it has any of [`RUN_FILES`]. Such a directory is refused as
//! `--out` unless the run resumes from it (`--resume` points into it) or the user says
//! `--overwrite`, which removes the old run's files first (and nothing else).

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::error::UsageError;

/// What a run writes into its output directory.
pub const RUN_FILES: [&str; 5] = [
    "summary.json",
    "metrics.jsonl",
    "job.json",
    "train.toml",
    "checkpoints",
];

/// `runs/<time>-<strategy>`, with `-2`, `-3`, … appended when a run started in the same second;
/// created here, so it is this run's alone.
pub fn default_out(strategy: &str) -> PathBuf {
    fresh_in(Path::new("runs"), strategy)
}

/// `runs/<time>-<strategy>`, not created: what a command that writes nothing shows.
pub fn default_name(strategy: &str) -> PathBuf {
    name_in(Path::new("runs"), strategy)
}

fn name_in(root: &Path, strategy: &str) -> PathBuf {
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .replace(':', "");
    root.join(format!("{stamp}-{strategy}"))
}

/// Creates and returns the first free `<time>-<strategy>[-N]` under `root`. Creating is the
/// test: of runs started at once, each gets the name whose creation succeeded for it (a check
/// before creating let two take the same name). Where nothing can be created the name is
/// returned as it is, and [`prepare`] says why.
fn fresh_in(root: &Path, strategy: &str) -> PathBuf {
    let base = name_in(root, strategy);
    let _ = std::fs::create_dir_all(root);
    let mut candidate = base.clone();
    for n in 2..10_000 {
        match std::fs::create_dir(&candidate) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                candidate = PathBuf::from(format!("{}-{n}", base.display()));
            }
            _ => break,
        }
    }
    candidate
}

/// Makes `out` ready for a new run: creates it, refuses one that holds another run (see the
/// module header), and checks that it is writable. Every refusal is a usage error naming `out`.
pub fn prepare(out: &Path, resume: Option<&Path>, overwrite: bool) -> Result<()> {
    let held: Vec<&str> = RUN_FILES
        .into_iter()
        .filter(|f| out.join(f).exists())
        .collect();
    if !held.is_empty() && !resumes_from(out, resume) {
        if !overwrite {
            return Err(UsageError(format!(
                "--out {} already holds a run ({}); pass --overwrite to replace it, --resume {} \
                 to continue it, or choose another --out",
                out.display(),
                held.join(", "),
                out.display()
            ))
            .into());
        }
        for f in &held {
            let path = out.join(f);
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(|e| {
                UsageError(format!(
                    "--overwrite: cannot remove {}: {e}",
                    path.display()
                ))
            })?;
        }
        eprintln!("--overwrite: replaced the run in {}", out.display());
    }
    std::fs::create_dir_all(out).map_err(|e| {
        UsageError(format!(
            "cannot create the output directory {}: {e}",
            out.display()
        ))
    })?;
    // Fail now, not after an epoch of training, if nothing can be written there.
    let probe = out.join(format!(".ringtmp-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| {
        UsageError(format!(
            "cannot write to the output directory {}: {e}",
            out.display()
        ))
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Whether `resume` names `out` or something inside it (its checkpoints).
pub fn resumes_from(out: &Path, resume: Option<&Path>) -> bool {
    let Some(resume) = resume else { return false };
    match (out.canonicalize(), resume.canonicalize()) {
        (Ok(out), Ok(resume)) => resume.starts_with(out),
        _ => false,
    }
}

/// Writes the run's options and plan into its output directory `out` (`train.toml`, `job.json`;
/// docs/output.md): what was run, and what `--resume` reads. Returns the two files' paths.
pub fn write_run_files(
    out: &Path,
    train_args: &impl serde::Serialize,
    job: &ringtmp_strategy::Job,
) -> Result<(PathBuf, PathBuf)> {
    use anyhow::Context as _;
    let config = out.join("train.toml");
    let options = toml::to_string(train_args).context("encoding the training options")?;
    std::fs::write(&config, options).with_context(|| format!("writing {}", config.display()))?;
    let plan = out.join("job.json");
    let text = serde_json::to_string_pretty(job).context("encoding the job")?;
    std::fs::write(&plan, text).with_context(|| format!("writing {}", plan.display()))?;
    if let Some(base) = job.spec().config.init_from.as_deref()
        && ringtmp_strategy::config::is_pretrained(base)
    {
        crate::pretrained::write_run_vocabulary(out, base)?;
    }
    Ok((config, plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_directory_is_refused_unless_resumed_or_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("run");
        prepare(&out, None, false).unwrap();
        std::fs::write(out.join("summary.json"), "{}").unwrap();
        std::fs::create_dir_all(out.join("checkpoints/step-000000001")).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let e = prepare(&out, None, false).unwrap_err().to_string();
        assert!(
            e.contains("already holds a run") && e.contains("summary.json"),
            "{e}"
        );
        // Resuming from its checkpoints is allowed and touches nothing.
        prepare(&out, Some(&out.join("checkpoints")), false).unwrap();
        assert!(out.join("summary.json").exists());
        // Resuming from elsewhere is not.
        assert!(prepare(&out, Some(tmp.path()), false).is_err());
        // --overwrite removes the run's files and nothing else.
        prepare(&out, None, true).unwrap();
        assert!(!out.join("summary.json").exists() && !out.join("checkpoints").exists());
        assert!(out.join("notes.txt").exists());
    }

    /// Eight runs choosing at once each get a directory of their own, created.
    #[test]
    fn default_directories_are_never_shared() {
        let tmp = tempfile::tempdir().unwrap();
        let chosen: Vec<PathBuf> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| fresh_in(tmp.path(), "ring")))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let distinct: std::collections::BTreeSet<&PathBuf> = chosen.iter().collect();
        assert_eq!(distinct.len(), 8, "{chosen:?}");
        for dir in &chosen {
            assert!(dir.is_dir(), "{}", dir.display());
            prepare(dir, None, false).unwrap();
        }
    }
}
