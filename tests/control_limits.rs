//! What one client can do to rcpd's other clients, over the tcp provider:
//! strings it sends cannot forge rcpd's log lines.

mod common;

use common::raw::{self, grpc};
use common::*;
use rcp::provider::ProviderKind;

fn setup(extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, Rcpd) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, "tcp", None, extra);
    (tmp, root, d)
}

/// A client name with a newline (and a terminal escape) stays inside its
/// own field of its own line; a long one is cut, and says by how much.
#[test]
fn a_client_name_cannot_forge_a_log_line() {
    let (_tmp, _root, d) = setup(&[]);
    let forged = "2026-12-01T00:00:00.000000Z  INFO rcp::control::server: FORGED root=/etc";
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        for name in [
            format!("rcp\n{forged}"),
            format!("rcp\r{forged}\u{1b}[2K"),
            format!("LONG{}", "n".repeat(10_000)),
        ] {
            let req = rcp::proto::HandshakeRequest {
                client_name: name,
                ..raw::hello(ProviderKind::Tcp, 0)
            };
            c.handshake(req).await.unwrap();
        }
    });
    let log = d.log();
    let opened: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("session opened"))
        .collect();
    assert_eq!(opened.len(), 3, "{log}");
    for l in log.lines() {
        // The forged text only ever appears inside a real line's field.
        if l.contains("FORGED") {
            assert!(l.contains("session opened"), "a forged line: {l:?}");
            assert!(l.contains("client=\"rcp\\"), "{l:?}");
        }
        assert!(!l.contains('\u{1b}'), "a raw escape reached the log: {l:?}");
        assert!(
            !l.contains('\r'),
            "a raw carriage return reached the log: {l:?}"
        );
    }
    let long = opened.iter().find(|l| l.contains("LONG")).unwrap();
    assert!(
        long.len() < 1000 && long.contains(&format!("...(+{} bytes)", 10_004 - 256)),
        "{long}"
    );
}
