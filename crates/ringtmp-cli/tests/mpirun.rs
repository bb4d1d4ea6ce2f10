//! A real external launcher end to end: Open MPI's `mpirun` starts three `ringtmp node`
//! processes, which take their rank and world size from `OMPI_COMM_WORLD_*`, meet at rendezvous and
//! run the selftest ring. `.ci/run` installs Debian's openmpi-bin and sets RINGTMP_REQUIRE_MPI=1, so
//! in CI a missing mpirun fails the test; elsewhere it is skipped with a notice.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ringtmp_testkit::process::free_port;

#[test]
fn mpirun_starts_a_three_node_selftest() {
    let Ok(found) = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    else {
        assert!(
            std::env::var_os("RINGTMP_REQUIRE_MPI").is_none(),
            "RINGTMP_REQUIRE_MPI is set but mpirun is not installed"
        );
        eprintln!("SKIPPED: mpirun not found (apt-get install openmpi-bin; .ci/run does)");
        return;
    };
    assert!(found.success());
    // Below the ephemeral range (testkit's rule): a port handed out for `:0` was taken once, in
    // CI, by one of mpirun's own PMIx sockets before rank 0 could bind it.
    let port = free_port();
    let mut child = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            "3",
            "-x",
            "RINGTMP_SECRET",
            "-x",
            "RINGTMP_LOG",
        ])
        .arg(env!("CARGO_BIN_EXE_ringtmp"))
        .args([
            "node",
            "--master-port",
            &port.to_string(),
            "--connect-timeout",
            "20",
        ])
        .args([
            "--job",
            "selftest",
            "--size-mib",
            "0.5",
            "--rounds",
            "3",
            "--pings",
            "20",
        ])
        .env("RINGTMP_SECRET", "0123456789abcdef-mpirun-test")
        .env("RINGTMP_LOG", "warn")
        // Open MPI refuses to start as root in some setups without these.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(90) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("selftest ok: 3 node(s)"), "{stdout}");
    for rank in 0..3 {
        assert!(
            stderr.contains(&format!("rank {rank} of 3 (from Open MPI")),
            "{stderr}"
        );
    }
}
