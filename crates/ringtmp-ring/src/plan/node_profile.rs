//! Every node's own profile. At rendezvous rank 0 asks each node to time the
//! model's layers on its own hardware ([`ProfileRequest`]: the model, the micro-batch, the
//! threads, a time budget); each answers with a [`ProfileReply`]: its layer times, its free
//! memory and what machine it is. The planner then splits the model from every node's own
//! figures instead of rank 0's profile scaled by `--node-speed` guesses.
//!
//! Invariants: answering never panics and never hangs past the budget by more than one warm-up
//! pass per layer (a node that cannot profile says why, and rank 0 plans it from its own
//! profile); a profile is used only for the request it answers (rows, threads and layer count
//! are checked by the planner); the cache is keyed by the request, the machine and the binary's
//! version, and a cached file is used only if it parses and names the same request and machine.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::plan::profile::time_layers;

pub use ringtmp_contract::machine::{NodeProfile, ProfileRequest};

/// A node's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileReply {
    /// It timed the model (or found it in its cache).
    Measured(NodeProfile),
    /// It could not, and why.
    Failed(String),
}

/// What this machine is, as a profile names it.
pub fn machine_description() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!(
        "{}, {}, {cores} core{}",
        ringtmp_contract::machine::machine_name(),
        ringtmp_model::kernels::simd_level(),
        if cores == 1 { "" } else { "s" }
    )
}

/// Times the request's model on this machine, and what its links (private when `encrypt`) cost
/// it per byte.
pub fn measure(request: &ProfileRequest, encrypt: bool) -> Result<NodeProfile, String> {
    if request.rows == 0
        || request.threads == 0
        || request.budget_seconds.is_nan()
        || request.budget_seconds < 0.0
    {
        return Err(format!(
            "a request for {} rows on {} threads with a budget of {} s",
            request.rows, request.threads, request.budget_seconds
        ));
    }
    let (input, output) =
        ringtmp_contract::model_shapes(request.input, request.classes, request.sequence);
    let layers = request
        .model
        .build_for(&input, &output)
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let budget = Duration::try_from_secs_f64(request.budget_seconds).unwrap_or(Duration::ZERO);
    // Frames of the largest activation (at most 4 MiB), for a tenth of the budget.
    let frame_bytes = layers
        .iter()
        .map(|l| request.rows * l.output.numel() * 4)
        .max()
        .unwrap_or(4)
        .min(4 << 20);
    let timings = time_layers(
        &layers,
        &request.optimizer,
        request.rows,
        request.threads,
        9,
        Some(budget),
    );
    let link = ringtmp_transport::link_cost::seconds_per_byte(encrypt, frame_bytes, budget / 10);
    if let Err(e) = &link {
        tracing::warn!("could not time this node's link work: {e}");
    }
    Ok(NodeProfile {
        machine: machine_description(),
        rows: request.rows,
        threads: request.threads,
        layers: timings,
        available_memory: ringtmp_contract::machine::available_memory(),
        took_seconds: started.elapsed().as_secs_f64(),
        cached: false,
        card_mbit: None,
        latency_ms: 0.0,
        link_seconds_per_byte: link.ok(),
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    })
}

/// Where profiles are cached: `$RINGTMP_CACHE_DIR/profiles`, else `$XDG_CACHE_HOME/ringtmp/
/// profiles`, else `~/.cache/ringtmp/profiles`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("RINGTMP_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("ringtmp")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/ringtmp")))
        .map(|d| d.join("profiles"))
}

/// What a cache file holds: the request and machine it answers, so that a file is never used
/// for another (a stale or colliding file is measured again).
#[derive(Serialize, Deserialize)]
struct CacheEntry {
    version: String,
    machine: String,
    request: ProfileRequest,
    profile: NodeProfile,
}

/// FNV-1a, 64 bits: a stable key for the file name (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Largest cache file read (a profile of a 1,000-layer model is ~100 KB).
const CACHE_FILE_LIMIT: u64 = 4 << 20;

/// What a node knows of its own links from its command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OwnLinks {
    /// Its (emulated) card, Mbit/s; `None`: not known.
    pub card_mbit: Option<f64>,
    /// One-way latency its links add, ms.
    pub latency_ms: f64,
    /// Whether its links are private (sealed records), as by default.
    pub encrypt: bool,
}

/// What a profile measures, in the cache's key beside the binary's version: a profile cached
/// before a change to it is measured again rather than read without the new figures (2: each
/// layer's time after its input gradient, `LayerTiming::after_send_seconds`).
const PROFILE_FORMAT: u32 = 2;

/// Answers rank 0's request (JSON in, JSON out; never panics): from `cache` when it holds this
/// request on this machine and `fresh` is false, else measured (and stored there); with what
/// the node knows of its own `links`.
pub fn answer(request_json: &str, cache: Option<&Path>, fresh: bool, links: OwnLinks) -> String {
    let reply = match serde_json::from_str::<ProfileRequest>(request_json) {
        Err(e) => ProfileReply::Failed(format!("the request does not parse: {e}")),
        Ok(request) => {
            let machine = machine_description();
            let version = format!("{}/{PROFILE_FORMAT}", env!("CARGO_PKG_VERSION"));
            // The link cost depends on the cipher too (a profile measured before AES-GCM was
            // chosen where the CPU has AES priced ChaCha's sealing).
            let sealing = if links.encrypt {
                ringtmp_transport::secure::Cipher::between_two_like_this().name()
            } else {
                "plaintext"
            };
            let key = fnv1a(format!("{version}\n{machine}\n{sealing}\n{request_json}").as_bytes());
            let file = cache.map(|d| d.join(format!("{key:016x}.json")));
            let cached = file
                .as_ref()
                .filter(|_| !fresh)
                .and_then(|f| read_cached(f, &version, &machine, &request));
            match cached {
                Some(mut profile) => {
                    profile.cached = true;
                    profile.took_seconds = 0.0;
                    profile.available_memory = ringtmp_contract::machine::available_memory();
                    ProfileReply::Measured(profile)
                }
                // A bug in timing must cost the plan this node's figures, not the node.
                None => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    measure(&request, links.encrypt)
                }))
                .unwrap_or_else(|_| Err("timing the model panicked".into()))
                {
                    Ok(profile) => {
                        if let Some(f) = &file {
                            store(f, &version, &machine, &request, &profile);
                        }
                        ProfileReply::Measured(profile)
                    }
                    Err(e) => ProfileReply::Failed(e),
                },
            }
        }
    };
    let reply = match reply {
        ProfileReply::Measured(mut profile) => {
            (profile.card_mbit, profile.latency_ms) = (links.card_mbit, links.latency_ms);
            ProfileReply::Measured(profile)
        }
        failed => failed,
    };
    serde_json::to_string(&reply).unwrap_or_else(|e| format!("{{\"failed\":\"{e}\"}}"))
}

fn read_cached(
    file: &Path,
    version: &str,
    machine: &str,
    request: &ProfileRequest,
) -> Option<NodeProfile> {
    let len = std::fs::metadata(file).ok()?.len();
    if len > CACHE_FILE_LIMIT {
        tracing::warn!(
            "profile cache: {} is {len} bytes; measuring again",
            file.display()
        );
        return None;
    }
    let text = std::fs::read_to_string(file).ok()?;
    match serde_json::from_str::<CacheEntry>(&text) {
        Ok(e) if e.version == version && e.machine == machine && e.request == *request => {
            Some(e.profile)
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(
                "profile cache: {} does not parse ({e}); measuring again",
                file.display()
            );
            None
        }
    }
}

/// Stores a profile (temporary file, then rename: a reader never sees half a file). A cache
/// that cannot be written costs the next start a measurement, nothing more.
fn store(
    file: &Path,
    version: &str,
    machine: &str,
    request: &ProfileRequest,
    profile: &NodeProfile,
) {
    let entry = CacheEntry {
        version: version.into(),
        machine: machine.into(),
        request: request.clone(),
        profile: profile.clone(),
    };
    let result = (|| -> std::io::Result<()> {
        let dir = file.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(
            &tmp,
            serde_json::to_vec(&entry).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, file)
    })();
    if let Err(e) = result {
        tracing::warn!("profile cache: cannot write {}: {e}", file.display());
    }
}

/// Parses a node's reply (JSON from the network: any text is an answer, never a panic).
pub fn parse_reply(text: &str) -> ProfileReply {
    serde_json::from_str(text)
        .unwrap_or_else(|e| ProfileReply::Failed(format!("its reply does not parse: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtmp_model::{ModelSpec, OptimizerConfig};

    fn request() -> ProfileRequest {
        ProfileRequest {
            model: ModelSpec::preset("mlp", 10).unwrap(),
            input: (28, 28, 1),
            classes: 10,
            sequence: None,
            optimizer: OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            rows: 16,
            threads: 1,
            budget_seconds: 0.2,
        }
    }

    const NO_CARD: OwnLinks = OwnLinks {
        card_mbit: None,
        latency_ms: 0.0,
        encrypt: true,
    };

    fn layer_count() -> usize {
        let r = request();
        r.model
            .build(&ringtmp_model::Shape::image(28, 28, 1), 10)
            .unwrap()
            .len()
    }

    #[test]
    fn a_node_measures_every_layer_then_answers_from_its_cache() {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::to_string(&request()).unwrap();
        let first = parse_reply(&answer(&json, Some(dir.path()), false, NO_CARD));
        let ProfileReply::Measured(first) = first else {
            panic!("{first:?}")
        };
        assert!(!first.cached && first.took_seconds > 0.0);
        assert_eq!(first.layers.len(), layer_count());
        assert!(first.layers.iter().all(|t| t.compute_seconds > 0.0));
        assert!(first.link_seconds_per_byte.is_some_and(|s| s > 0.0) && first.cores >= 1);
        assert_eq!((first.rows, first.threads), (16, 1));
        let again = parse_reply(&answer(&json, Some(dir.path()), false, NO_CARD));
        let ProfileReply::Measured(again) = again else {
            panic!("{again:?}")
        };
        assert!(again.cached);
        assert_eq!(again.layers, first.layers);
        // Another request (rows) is not answered from that file; `fresh` measures again.
        let mut other = request();
        other.rows = 8;
        let other = parse_reply(&answer(
            &serde_json::to_string(&other).unwrap(),
            Some(dir.path()),
            false,
            OwnLinks {
                card_mbit: Some(100.0),
                latency_ms: 2.0,
                encrypt: true,
            },
        ));
        assert!(
            matches!(other, ProfileReply::Measured(p) if !p.cached && p.rows == 8
            && p.card_mbit == Some(100.0) && p.latency_ms == 2.0)
        );
        let fresh = parse_reply(&answer(&json, Some(dir.path()), true, NO_CARD));
        assert!(matches!(fresh, ProfileReply::Measured(p) if !p.cached));
        // A corrupt cache file is measured over, not trusted and not a panic.
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            std::fs::write(entry.unwrap().path(), b"{\"version\": 3").unwrap();
        }
        let over = parse_reply(&answer(&json, Some(dir.path()), false, NO_CARD));
        assert!(matches!(over, ProfileReply::Measured(p) if !p.cached));
    }

    #[test]
    fn bad_requests_and_replies_are_answers_not_panics() {
        let reply = parse_reply(&answer("{", None, false, NO_CARD));
        assert!(matches!(reply, ProfileReply::Failed(e) if e.contains("parse")));
        let mut bad = request();
        bad.rows = 0;
        let reply = parse_reply(&answer(
            &serde_json::to_string(&bad).unwrap(),
            None,
            false,
            NO_CARD,
        ));
        assert!(matches!(reply, ProfileReply::Failed(e) if e.contains("0 rows")));
        assert!(matches!(parse_reply("not json"), ProfileReply::Failed(_)));
    }

    #[test]
    fn the_budget_bounds_the_timed_runs() {
        // A zero budget still times each layer once after its warm-up.
        let mut quick = request();
        quick.budget_seconds = 0.0;
        let p = measure(&quick, true).unwrap();
        assert_eq!(p.layers.len(), layer_count());
        assert!(p.layers.iter().all(|t| t.compute_seconds > 0.0));
    }
}
