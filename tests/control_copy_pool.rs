//! The Copy API's warm sessions: a second Copy to the same peer with the
//! same settings reuses the first one's session (counted in rcpd's
//! /metrics, and seen by the peer as one handshake); the pool is bounded,
//! its sessions expire, and a warm session the peer forgot is replaced.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::metrics::{sample, scrape};
use common::*;
use rcp::control::{Client, ClientOptions};
use rcp::proto::{CopyRequest, Direction};

fn push(local: &str, remote: &Rcpd, remote_path: &str) -> CopyRequest {
    push_to(local, &remote.addr(), remote_path)
}

fn push_to(local: &str, addr: &str, remote_path: &str) -> CopyRequest {
    CopyRequest {
        direction: Direction::Push as i32,
        local_path: local.into(),
        remote: addr.to_string(),
        remote_path: remote_path.into(),
        transport: "tcp".into(),
        ..Default::default()
    }
}

fn copy(a: &Rcpd, req: CopyRequest) -> rcp::proto::CopyProgress {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = Client::connect(
            &a.addr(),
            ClientOptions {
                token: Some("tok".into()),
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap();
        let mut s = c.copy(req).await.unwrap();
        let mut last = None;
        while let Some(p) = s.message().await.unwrap() {
            last = Some(p);
        }
        let p = last.expect("a final progress message");
        assert!(p.done && p.error.is_empty(), "{p:?}");
        p
    })
}

/// A Copy that fails: its status.
fn copy_err(a: &Rcpd, req: CopyRequest) -> tonic::Status {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = Client::connect(
            &a.addr(),
            ClientOptions {
                token: Some("tok".into()),
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap();
        let mut s = c.copy(req).await.map_err(tonic::Status::from)?;
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    })
    .expect_err("the copy fails")
}

/// A's pool counters: (opened, reused, warm).
fn pool(a: &Rcpd) -> (f64, f64, f64) {
    let m = scrape(a.metrics.as_ref().expect("metrics"));
    let get = |s: &str| sample(&m, s).unwrap_or_else(|| panic!("{s} missing:\n{m}"));
    (
        get("rcpd_copy_sessions_opened_total"),
        get("rcpd_copy_sessions_reused_total"),
        get("rcpd_copy_sessions_warm"),
    )
}

/// `rcpd_copy_sessions_expired_total` of `a`.
fn expired(a: &Rcpd) -> f64 {
    let m = scrape(a.metrics.as_ref().expect("metrics"));
    sample(&m, "rcpd_copy_sessions_expired_total").unwrap_or_else(|| panic!("{m}"))
}

/// Sessions the peer opened, from its log.
fn handshakes(b: &Rcpd) -> usize {
    b.log().matches("session opened").count()
}

fn roots(n: usize) -> (tempfile::TempDir, Vec<std::path::PathBuf>) {
    let tmp = tempfile::tempdir().unwrap();
    let rs: Vec<_> = (0..n)
        .map(|k| {
            let r = tmp.path().join(format!("r{k}"));
            std::fs::create_dir_all(&r).unwrap();
            r
        })
        .collect();
    (tmp, rs)
}

#[test]
fn a_second_copy_reuses_the_warm_session() {
    let (_tmp, r) = roots(2);
    let a = Rcpd::start(&r[0], "tcp", Some("tok"), &["--copy-peers", &copy_peers()]);
    let b = Rcpd::start(&r[1], "tcp", Some("tok"), &[]);
    make_file(&r[0].join("x"), 4096, 1);
    make_file(&r[0].join("y"), 3 << 20, 2);
    assert_eq!(pool(&a), (0.0, 0.0, 0.0));
    copy(&a, push("x", &b, "x1"));
    assert_eq!(pool(&a), (1.0, 0.0, 1.0), "one session opened, kept warm");
    let p = copy(&a, push("y", &b, "y1"));
    assert_eq!(pool(&a), (1.0, 1.0, 1.0), "the second Copy reused it");
    assert_eq!(handshakes(&b), 1, "B saw one handshake:\n{}", b.log());
    assert_eq!(p.sha256, sha256sum(&r[0].join("y")));
    assert_eq!(sha256sum(&r[1].join("x1")), sha256sum(&r[0].join("x")));
    assert_eq!(sha256sum(&r[1].join("y1")), sha256sum(&r[0].join("y")));
    // Other settings are another key: a different block size opens anew.
    let mut req = push("x", &b, "x2");
    req.block_size = 64 << 10;
    copy(&a, req);
    assert_eq!(pool(&a), (2.0, 1.0, 2.0));
    assert_eq!(handshakes(&b), 2);
    // So are other checks, and another token (B accepts only its own: the
    // warm sessions of the right one are not lent to a wrong one).
    let mut req = push("x", &b, "x3");
    req.checks = vec![rcp::proto::Check::Xxh3 as i32];
    copy(&a, req);
    assert_eq!(pool(&a), (3.0, 1.0, 3.0));
    let mut req = push("x", &b, "x4");
    req.remote_token = "wrong".into();
    let e = copy_err(&a, req);
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    assert!(!r[1].join("x4").exists());
}

#[test]
fn the_pool_keeps_at_most_its_bound_least_recently_used_out_first() {
    let (_tmp, r) = roots(3);
    let a = Rcpd::start(
        &r[0],
        "tcp",
        Some("tok"),
        &["--copy-sessions", "1", "--copy-peers", &copy_peers()],
    );
    let b = Rcpd::start(&r[1], "tcp", Some("tok"), &[]);
    let c = Rcpd::start(&r[2], "tcp", Some("tok"), &[]);
    make_file(&r[0].join("x"), 4096, 3);
    copy(&a, push("x", &b, "x"));
    copy(&a, push("x", &c, "x"));
    assert_eq!(pool(&a), (2.0, 0.0, 1.0), "B's session made room for C's");
    copy(&a, push("x", &c, "x2"));
    assert_eq!(pool(&a), (2.0, 1.0, 1.0), "C's is the warm one");
    copy(&a, push("x", &b, "x2"));
    assert_eq!(pool(&a), (3.0, 1.0, 1.0), "B's was closed");
    assert_eq!((handshakes(&b), handshakes(&c)), (2, 1));
}

#[test]
fn an_idle_session_is_closed_and_zero_keeps_none() {
    let (_tmp, r) = roots(3);
    let a = Rcpd::start(
        &r[0],
        "tcp",
        Some("tok"),
        &["--copy-session-idle", "1", "--copy-peers", &copy_peers()],
    );
    let b = Rcpd::start(&r[1], "tcp", Some("tok"), &[]);
    make_file(&r[0].join("x"), 4096, 4);
    copy(&a, push("x", &b, "x"));
    // The session was kept warm, then closed by the pool itself (not by
    // the next Copy): counted as expired, however long the scrapes take
    // (a warm gauge read now may already be 0 on a slow machine).
    wait_for(
        "the pool to close its idle session",
        Duration::from_secs(120),
        || expired(&a) == 1.0,
    );
    assert_eq!(pool(&a), (1.0, 0.0, 0.0));
    copy(&a, push("x", &b, "x2"));
    assert_eq!(pool(&a), (2.0, 0.0, 1.0), "the next Copy opened a new one");
    // --copy-session-idle 0: nothing is kept.
    let a0 = Rcpd::start(
        &r[2],
        "tcp",
        Some("tok"),
        &["--copy-session-idle", "0", "--copy-peers", &copy_peers()],
    );
    make_file(&r[2].join("x"), 4096, 5);
    copy(&a0, push("x", &b, "y"));
    copy(&a0, push("x", &b, "y2"));
    assert_eq!(pool(&a0), (2.0, 0.0, 0.0));
    assert_eq!(expired(&a0), 0.0, "nothing was kept to expire");
}

/// rcpd on a given address (to restart a peer where it was).
fn rcpd_at(root: &Path, addr: &str) -> Child {
    let mut c = Command::new(bin("rcpd"))
        .args(["--root", root.to_str().unwrap(), "--listen", addr])
        .args(["--health-listen", "none", "--transport", "tcp"])
        .args(["--arena-mib", "64"])
        .env("RCPD_TOKEN", "tok")
        .env_remove("RCPD_TOKEN_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(c.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("rcpd listening on "), "{line:?}");
    c
}

#[test]
fn a_warm_session_the_peer_forgot_is_replaced_by_a_fresh_one() {
    let (_tmp, r) = roots(2);
    let a = Rcpd::start(&r[0], "tcp", Some("tok"), &["--copy-peers", &copy_peers()]);
    make_file(&r[0].join("x"), 1 << 20, 6);
    let addr = {
        let b = Rcpd::start(&r[1], "tcp", Some("tok"), &[]);
        copy(&a, push("x", &b, "x1"));
        b.addr()
        // B stops here: A's warm session to it is now unknown to anyone.
    };
    assert_eq!(pool(&a), (1.0, 0.0, 1.0));
    let mut b2 = rcpd_at(&r[1], &addr);
    let p = copy(&a, push_to("x", &addr, "x2"));
    let _ = b2.kill();
    let _ = b2.wait();
    assert_eq!(p.sha256, sha256sum(&r[0].join("x")));
    assert_eq!(sha256sum(&r[1].join("x2")), sha256sum(&r[0].join("x")));
    // The warm one was tried (and failed at once), then a fresh one opened.
    assert_eq!(pool(&a), (2.0, 1.0, 1.0));
}
