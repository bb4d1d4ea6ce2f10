//! Nodes on machines of their own: network namespaces on a bridge, made by the test and removed
//! after it, so that what loopback hides shows (a wildcard address reaches the local host on
//! loopback, and nobody else's). Needs root for `ip netns`; skipped, saying why, without it.

use std::process::{Command, Stdio};
use std::time::Duration;

use ringtmp_testkit::process::{finish, stderr};

use super::common::*;

/// Namespaces `<tag>0..n` on the bridge `<tag>br`, each with `10.231.<net>.<r+1>/24`; removed on
/// drop.
struct Hosts {
    tag: String,
    n: usize,
    net: u8,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    fn new(n: usize) -> Result<Self, String> {
        let net = (std::process::id() % 200) as u8 + 20;
        let hosts = Self {
            tag: format!("rt{}h", std::process::id() % 100_000),
            n,
            net,
        };
        let bridge = format!("{}br", hosts.tag);
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["link", "set", &bridge, "up"])?;
        for r in 0..n {
            let (ns, veth) = (hosts.ns(r), format!("{}v{r}", hosts.tag));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &veth, "master", &bridge, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", hosts.addr(r)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    fn ns(&self, r: usize) -> String {
        format!("{}{r}", self.tag)
    }

    fn addr(&self, r: usize) -> String {
        format!("10.231.{}.{}", self.net, r + 1)
    }

    /// `ringtmp ARGS` inside host `r`.
    fn ringtmp(&self, r: usize, args: &[&str]) -> std::process::Child {
        let bin = ringtmp().get_program().to_owned();
        Command::new("ip")
            .args(["netns", "exec", &self.ns(r)])
            .arg(bin)
            .args(args)
            .env("RINGTMP_SECRET", SECRET)
            .env("RINGTMP_LOG", "warn")
            .env(
                "RINGTMP_CACHE_DIR",
                concat!(env!("CARGO_TARGET_TMPDIR"), "/ringtmp-cache"),
            )
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for r in 0..self.n {
            let _ = ip(&["netns", "del", &self.ns(r)]);
        }
        let _ = ip(&["link", "del", &format!("{}br", self.tag)]);
    }
}

// Every node listening on all interfaces (the README's cluster lines): rank 0 is advertised at
// an address its peers reach, whether it knows one (its rendezvous host) or not (it listens on
// the wildcard too, and each node fills in the address it reached rank 0 at).
#[test]
fn nodes_listening_on_every_interface_reach_each_other_across_hosts() {
    let hosts = match Hosts::new(3) {
        Ok(h) => h,
        Err(why) => {
            if std::env::var_os("RINGTMP_REQUIRE_NETNS").is_some() {
                panic!("network namespaces are required here: {why}");
            }
            println!("skipped: cannot make network namespaces here ({why})");
            return;
        }
    };
    for rank_0_host in ["0.0.0.0", &hosts.addr(0)] {
        let port = "29561";
        let nodes: Vec<_> = (0..3)
            .map(|r| {
                let master = if r == 0 {
                    rank_0_host.to_string()
                } else {
                    hosts.addr(0)
                };
                let rank = r.to_string();
                hosts.ringtmp(
                    r,
                    &[
                        "node",
                        "--rank",
                        &rank,
                        "--world-size",
                        "3",
                        "--master-addr",
                        &master,
                        "--master-port",
                        port,
                        "--listen",
                        "0.0.0.0",
                        "--job",
                        "selftest",
                        "--rounds",
                        "3",
                        "--size-mib",
                        "0.25",
                        "--pings",
                        "3",
                        "--connect-timeout",
                        "15",
                    ],
                )
            })
            .collect();
        for (r, node) in nodes.into_iter().enumerate() {
            let (out, _) = finish(node, Duration::from_secs(40));
            assert!(
                out.status.success(),
                "rank {r} (rank 0 at {rank_0_host}): {}",
                stderr(&out)
            );
        }
    }

    // Training options after `--` on rank 0 (one command line for every rank, as mpirun gives);
    // each node on a host of its own computes on all of that host's cores, and rank 0 writes
    // the run's options and plan.
    let out = tempfile::tempdir().unwrap();
    let run = out.path().join("run");
    let nodes: Vec<_> = (0..3)
        .map(|r| {
            let rank = r.to_string();
            let mut args = vec![
                "node",
                "--rank",
                &rank,
                "--world-size",
                "3",
                "--master-port",
                "29562",
                "--listen",
                "0.0.0.0",
                "--connect-timeout",
                "15",
                "--job",
                "train",
                "--",
                "--strategy",
                "allreduce",
                "--dataset",
                "digits",
                "--max-steps",
                "3",
                "--eval-every",
                "0",
                "--out",
                run.to_str().unwrap(),
            ];
            let master = hosts.addr(0);
            args.splice(5..5, ["--master-addr", master.as_str()]);
            hosts.ringtmp(r, &args)
        })
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (r, node) in nodes.into_iter().enumerate() {
        let (out, _) = finish(node, Duration::from_secs(60));
        let err = stderr(&out);
        assert!(out.status.success(), "rank {r}: {err}");
        if r > 0 {
            assert!(
                err.contains(&format!("; {cores} thread(s)")),
                "rank {r}: {err}"
            );
        }
    }
    assert!(run.join("job.json").is_file() && run.join("train.toml").is_file());
}
