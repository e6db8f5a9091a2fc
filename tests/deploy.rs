//! The deployment files in `deploy/`, checked without a network or a container runtime: the
//! systemd unit passes `systemd-analyze verify` (where that tool exists; skipped with a message
//! otherwise), and both Containerfiles run `kvmesh` as a non-root user and expose the ports the
//! default configuration listens on. `scripts/build-image.sh` builds and runs the image itself
//! (it needs buildah and a release build, so it is not run here).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvmesh::node::config::{MeshSection, NodeConfig};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `cmd` for at most `limit`; `None` if it had to be killed.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Option<(bool, String)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().expect("output");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            return Some((out.status.success(), text));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn systemd_unit_verifies() {
    let probe = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    // `verify` insists that ExecStart's binary exists: point it at the one cargo built. The file
    // keeps its name, since `verify` derives the unit name (and %d) from it.
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kvmesh.service")).unwrap();
    assert!(
        unit.contains("/usr/local/bin/kvmesh serve"),
        "ExecStart changed?"
    );
    let unit = unit.replace("/usr/local/bin/kvmesh", env!("CARGO_BIN_EXE_kvmesh"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvmesh.service");
    std::fs::write(&path, unit).unwrap();
    let (ok, out) = run_bounded(
        Command::new("systemd-analyze")
            .args(["--man=no", "verify"])
            .arg(&path),
        Duration::from_secs(60),
    )
    .expect("systemd-analyze verify took over 60 s");
    // It reports problems on stderr, possibly with status 0: any output is a failure.
    assert!(
        ok && out.trim().is_empty(),
        "systemd-analyze verify:\n{out}"
    );
}

#[test]
fn systemd_unit_outlasts_the_drain() {
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/kvmesh.service")).unwrap();
    let stop: u64 = directive(&unit, "TimeoutStopSec")[0].parse().unwrap();
    let drain = NodeConfig::default().drain_s;
    assert!(
        stop > drain,
        "TimeoutStopSec={stop} must exceed drain_s={drain}"
    );
    assert_eq!(directive(&unit, "LimitNOFILE"), ["1048576"]);
    assert_eq!(directive(&unit, "CapabilityBoundingSet"), [""]);
}

/// Every value of `key=` in a unit file, or of `KEY ` in a Containerfile.
fn directive(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            l.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('=').or_else(|| rest.strip_prefix(' ')))
        })
        .map(|v| v.trim().to_string())
        .collect()
}

fn check_containerfile(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.display();
    // The runtime stage is the one after the last FROM.
    let lines: Vec<&str> = text.lines().collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.trim_start().starts_with("FROM "))
        .unwrap_or_else(|| panic!("{name}: no FROM"));
    let runtime = lines[last_from..].join("\n");

    let entry = directive(&runtime, "ENTRYPOINT");
    assert_eq!(
        entry.len(),
        1,
        "{name}: one ENTRYPOINT in the runtime stage"
    );
    assert!(
        entry[0].starts_with("[\"/") && entry[0].contains("kvmesh\""),
        "{name}: ENTRYPOINT must be the exec form naming the kvmesh binary: {}",
        entry[0]
    );

    let users = directive(&runtime, "USER");
    let user = users.last().unwrap_or_else(|| panic!("{name}: no USER"));
    let uid = user.split(':').next().unwrap();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "{name}: USER must be a numeric non-root uid (so runAsNonRoot can check it): {user}"
    );

    let exposed: Vec<String> = directive(&runtime, "EXPOSE")
        .iter()
        .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .collect();
    let http = format!("{}/tcp", NodeConfig::default().listen.port());
    let mesh = format!("{}/udp", MeshSection::default().listen.port());
    for port in [http, mesh] {
        assert!(
            exposed.contains(&port),
            "{name}: EXPOSE lacks {port}: {exposed:?}"
        );
    }
}

#[test]
fn containerfiles_run_kvmesh_as_non_root_on_the_default_ports() {
    let dir = repo().join("deploy/container");
    check_containerfile(&dir.join("Containerfile"));
    check_containerfile(&dir.join("Containerfile.local"));
    // The full build runs in a builder image and copies the binary into a scratch stage.
    let full = std::fs::read_to_string(dir.join("Containerfile")).unwrap();
    assert!(
        full.contains("AS build") && full.contains("FROM scratch"),
        "multi-stage"
    );
}
