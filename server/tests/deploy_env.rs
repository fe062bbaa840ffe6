//! The Kubernetes manifests configure rcpd through RCPD_* variables; every
//! one they set must be a setting rcpd actually reads, and the health probe
//! port in the manifests must be rcpd's health port.

use std::path::Path;
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// `rcpd --print-env`: the RCPD_* names of rcpd's command definition.
fn print_env() -> Vec<String> {
    // RCPD_ROOT set (as in a pod) must not get in the way.
    let out = Command::new(env!("CARGO_BIN_EXE_rcpd"))
        .arg("--print-env")
        .env("RCPD_ROOT", "/nonexistent")
        .output()
        .expect("run rcpd --print-env");
    assert!(
        out.status.success(),
        "rcpd --print-env: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn print_env_lists_exactly_the_variables_of_rcpd_help() {
    let names = print_env();
    assert!(names.len() >= 10, "too few variables: {names:?}");
    assert!(names.iter().all(|n| n.starts_with("RCPD_")), "{names:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_rcpd"))
        .arg("--help")
        .output()
        .expect("run rcpd --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let mut in_help: Vec<String> = help
        .split("[env: ")
        .skip(1)
        .map(|s| s.split([']', '=']).next().unwrap().to_string())
        .collect();
    let mut listed = names.clone();
    in_help.sort();
    listed.sort();
    assert_eq!(listed, in_help, "--print-env vs the [env: ...] of --help");
    assert!(
        !help.contains("print-env"),
        "--print-env is a hidden flag:\n{help}"
    );
}

#[test]
fn every_rcpd_variable_in_deploy_is_accepted_by_rcpd() {
    let names = print_env();
    let mut bad = Vec::new();
    let mut seen = 0;
    let mut dirs = vec![repo().join("deploy")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            if p.extension().is_some_and(|x| x == "py" || x == "pyc") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            for (i, _) in text.match_indices("RCPD_") {
                let word: String = text[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if word == "RCPD_" {
                    continue; // "RCPD_*" in prose
                }
                seen += 1;
                if !names.contains(&word) {
                    bad.push(format!("{}: {word}", p.display()));
                }
            }
        }
    }
    assert!(seen >= 10, "deploy/ names only {seen} RCPD_* variables");
    assert!(bad.is_empty(), "rcpd does not read: {bad:?}");
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
