//! rcp and rcpd over verbs (soft-RoCE in the test VM): the end-to-end
//! scenarios of tests/common/e2e.rs (sizes, trees, resume after a kill, eight
//! clients with back-pressure), a wrong token, metrics, doctor.
//!
//! `cargo build --workspace && cargo test --test control_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1`.

mod common;

use common::*;

const V: &str = "verbs";

// The VM is slow (TCG), more so with small blocks: the resumed file is six
// 4 MiB windows of rcp's default 1 MiB blocks (killed once a window's worth
// is verified: the manifest is saved about once a second, and the copy must
// still be running then), the eight clients push 1 MiB each.
e2e_tests!(
    V,
    e2e::Scale {
        resume_len: (24 << 20) + 123,
        resume_block: 1 << 20,
        client_len: 1 << 20,
    },
    #[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
);

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_wrong_token_is_refused() {
    let (t, root) = e2e::tmp_with_root();
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
    let t = e2e::tmp();
    common::metrics::metrics_during_copy(V, t.path(), 12 << 20);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_doctor_cli_is_healthy() {
    let (_t, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, V, Some("tok"), &[]);
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
