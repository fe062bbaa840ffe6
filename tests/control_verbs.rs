//! rcp and rcpd over verbs (soft-RoCE in the test VM): push and pull with
//! digests compared, two clients at once, a wrong token.
//!
//! `cargo build --workspace && cargo test --test control_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1`.

mod common;

use std::process::Stdio;

use common::*;

const V: &str = "verbs";
const IGNORE: &str = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)";

fn tmp() -> tempfile::TempDir {
    // The VM mounts the repository writable; /tmp may not be.
    tempfile::Builder::new()
        .prefix("control-verbs")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_push_pull_sizes() {
    let _ = IGNORE;
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, V, Some("s3cret"), &[]);
    let back = t.path().join("back");
    std::fs::create_dir(&back).unwrap();
    for (i, len) in [1u64, 4095, (33 << 20) + 7].into_iter().enumerate() {
        let name = format!("v{len}");
        let src = t.path().join(&name);
        make_file(&src, len, 40 + i as u64);
        let want = sha256sum(&src);
        let r = rcp(
            d.port,
            V,
            Some("s3cret"),
            &["push", src.to_str().unwrap(), "127.0.0.1:/"],
        );
        assert_eq!(
            r.code,
            0,
            "push {len}: {}{}\n{}",
            r.stdout,
            r.stderr,
            d.log()
        );
        assert!(r.stdout.contains("over verbs"), "{}", r.stdout);
        assert_eq!(sha256sum(&root.join(&name)), want, "pushed {len}");
        let r = rcp(
            d.port,
            V,
            Some("s3cret"),
            &["pull", &format!("127.0.0.1:{name}"), back.to_str().unwrap()],
        );
        assert_eq!(
            r.code,
            0,
            "pull {len}: {}{}\n{}",
            r.stdout,
            r.stderr,
            d.log()
        );
        assert_eq!(sha256sum(&back.join(&name)), want, "pulled {len}");
        println!("{len} bytes: {}", r.stdout.trim());
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_two_clients_at_once() {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, V, None, &[]);
    let mut kids = Vec::new();
    for i in 0..2u64 {
        let src = t.path().join(format!("c{i}"));
        make_file(&src, (9 << 20) + i, 70 + i);
        let child = rcp_cmd(
            d.port,
            V,
            None,
            &["push", src.to_str().unwrap(), "127.0.0.1:/"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        kids.push((src, child));
    }
    for (src, child) in kids {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
        assert_eq!(
            sha256sum(&src),
            sha256sum(&root.join(src.file_name().unwrap()))
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_wrong_token_is_refused() {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, V, Some("right"), &[]);
    let src = t.path().join("f");
    make_file(&src, 1000, 1);
    let r = rcp(
        d.port,
        V,
        Some("wrong"),
        &["push", src.to_str().unwrap(), "127.0.0.1:/"],
    );
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("invalid token"), "{}", r.stderr);
    assert!(!root.join("f").exists());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_metrics_are_scraped_during_a_copy() {
    let t = tmp();
    common::metrics::metrics_during_copy(V, t.path(), 12 << 20);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_doctor_cli_is_healthy() {
    let t = tmp();
    let d = Rcpd::start(t.path(), V, Some("tok"), &[]);
    let r = rcp(d.port, V, Some("tok"), &["doctor", "127.0.0.1"]);
    println!("{}", r.stdout);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(!r.stdout.contains("[FAIL]"), "{}", r.stdout);
    for check in ["devices", "port", "gid", "memlock", "rcpd"] {
        assert!(
            r.stdout
                .lines()
                .any(|l| l.starts_with("[ok  ] ") && l[7..].starts_with(check)),
            "no passing {check} check:\n{}",
            r.stdout
        );
    }
    assert!(
        r.stdout.contains("rxe0") && r.stdout.contains("active MTU"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("accepts the token"), "{}", r.stdout);
    // A wrong token: the local checks still pass, the rcpd check fails.
    let r = rcp(d.port, V, Some("nope"), &["doctor", "127.0.0.1"]);
    assert_eq!(r.code, 6, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("[FAIL] rcpd"), "{}", r.stdout);
}
