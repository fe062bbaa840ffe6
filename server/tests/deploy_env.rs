//! The Kubernetes manifests configure rcpd through RCPD_* variables; every
//! one they set must be a setting rcpd actually reads, and the health probe
//! port in the manifests must be rcpd's health port.

use std::path::Path;
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

#[test]
fn every_rcpd_variable_in_deploy_is_accepted_by_rcpd() {
    let out = Command::new(env!("CARGO_BIN_EXE_rcpd"))
        .arg("--help")
        .output()
        .expect("run rcpd --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let listed = std::fs::read_to_string(repo().join("deploy/rcpd-env.txt")).unwrap();
    let names: Vec<&str> = listed
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("RCPD_"))
        .collect();
    assert!(
        names.len() >= 10,
        "deploy/rcpd-env.txt lists too few variables: {names:?}"
    );
    let missing: Vec<&&str> = names
        .iter()
        .filter(|n| !help.contains(&format!("[env: {n}")))
        .collect();
    assert!(
        missing.is_empty(),
        "rcpd does not read {missing:?} (from deploy/rcpd-env.txt)"
    );
}

#[test]
fn rcpd_rejects_an_unknown_setting_by_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_rcpd"))
        .arg("--no-such-flag")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
}

#[test]
fn manifests_probe_the_health_port_rcpd_listens_on() {
    let env = std::fs::read_to_string(repo().join("deploy/base/rcpd.env")).unwrap();
    let health = env
        .lines()
        .find_map(|l| l.strip_prefix("RCPD_HEALTH_LISTEN="))
        .expect("RCPD_HEALTH_LISTEN in deploy/base/rcpd.env");
    let port = health.rsplit(':').next().unwrap().trim();
    let ds = std::fs::read_to_string(repo().join("deploy/base/daemonset.yaml")).unwrap();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let at = ds.find(probe).unwrap_or_else(|| panic!("{probe} missing"));
        let block = &ds[at..ds.len().min(at + 400)];
        assert!(
            block.contains(&format!("port: {port}")),
            "{probe} does not probe port {port}: {block}"
        );
    }
}
