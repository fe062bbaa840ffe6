//! Per-session protection domains over verbs (soft-RoCE in the test VM):
//! an rkey granted to one session's window is refused with
//! IBV_WC_REM_ACCESS_ERR on another session's QP, and nothing is written;
//! a pulled block damaged on the way is read again. (What a protection
//! domain and a window registration cost is `examples/pd_registration_cost.rs`.)
//!
//! `cargo build --workspace --bins && cargo test
//! --test session_pd_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1 --nocapture`.

mod common;

use std::sync::Arc;

use common::raw::{self, grpc, Move, Session};
use common::*;
use rcp::engine::WcStatus;
use rcp::proto;
use rcp::provider::ProviderKind;

const BS: u64 = 4096;

fn tmp() -> tempfile::TempDir {
    // The VM mounts the repository writable; /tmp may not be.
    tempfile::Builder::new()
        .prefix("session-pd-verbs")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_rkey_of_another_session_is_rem_access_err() {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, "verbs", None, &[]);
    let good: Vec<u8> = (0..2 * BS as u32).map(|i| (i % 247) as u8).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        // Two sessions, each with its own QP (and, on rcpd, its own PD).
        let s1 = Arc::new(Session::open(&mut c, ProviderKind::Verbs, BS).await);
        let s2 = Session::open(&mut c, ProviderKind::Verbs, BS).await;
        let open = proto::OpenFile {
            flat_sha256: true,
            ..raw::push(1, "victim", good.len() as u64)
        };
        let mut m = Move::open(&mut c, s1.id(), vec![open]).await;
        assert_eq!(m.opened().await.length, good.len() as u64);
        let g = m.grant().await;
        assert_eq!((g.epoch, g.extents.len()), (0, 2), "{g:?}");
        let (e0, e1) = (g.extents[0], g.extents[1]);
        let (g2, s1b, good2) = (g.clone(), s1.clone(), good.clone());
        let (mine, other) = tokio::task::spawn_blocking(move || {
            let mine = (
                s1b.write(g2.addr + e0.offset, g2.rkey, &good2[..BS as usize]),
                s1b.write(g2.addr + e1.offset, g2.rkey, &good2[BS as usize..]),
            );
            // The window's rkey is live (session 1 just used it); session 2
            // forges it over its own QP.
            let other = s2.write(g2.addr + e0.offset, g2.rkey, &[0xee; BS as usize]);
            (mine, other)
        })
        .await
        .unwrap();
        println!("session 1 writes with its own rkey: {mine:?}");
        println!("session 2 writes with session 1's rkey: {other:?}");
        assert_eq!(mine, (WcStatus::Success, WcStatus::Success));
        assert_eq!(other, WcStatus::RemoteAccess, "IBV_WC_REM_ACCESS_ERR");
        // Nothing was overwritten: both blocks match their digests.
        m.send_done(raw::pushed(
            &g,
            vec![
                raw::sha256(&good[..BS as usize]),
                raw::sha256(&good[BS as usize..]),
            ],
        ));
        let a = m.ack().await;
        assert!(a.resend.is_empty(), "nothing was overwritten: {a:?}");
        let fd = raw::file_digest(&good, BS);
        m.send_end(1, fd.clone());
        let cm = m.committed().await;
        assert_eq!(cm.digest, fd, "the file digest");
        assert_eq!(cm.flat_sha256, raw::sha256(&good), "the flat SHA-256");
        m.close();
        m.finish().await;
    });
    assert_eq!(std::fs::read(root.join("victim")).unwrap(), good);
    let got = sha256sum(&root.join("victim"));
    assert_eq!(got, hex::encode(raw::sha256(&good)));
    println!("victim sha256 {got} (session 1's data, intact)");
}

/// Over verbs too: a pulled block damaged once (rcp's debug-build
/// injection) is read again under a fresh grant and the copy ends with the
/// right digest.
#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_damaged_pulled_block_is_read_again() {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, "verbs", None, &[]);
    make_file(&root.join("src"), (5 << 20) + 3, 23);
    let dst = t.path().join("back");
    let out = rcp_cmd(
        d.port,
        "verbs",
        None,
        &["pull", "--sha256", &remote("src"), dst.to_str().unwrap()],
    )
    .env("RCP_TEST_CORRUPT_PULLED_BLOCKS", "2")
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}\n{}", d.log());
    assert!(
        stderr.contains("does not match the server's digest: reading it again"),
        "the fault was injected (is rcp a debug build?): {stderr}"
    );
    for l in stderr.lines().filter(|l| l.contains("again")) {
        println!("{l}");
    }
    let (a, b) = (sha256sum(&root.join("src")), sha256sum(&dst));
    println!("source {a}\npulled {b}");
    assert_eq!(a, b);
    assert!(stdout.contains(&format!("sha256 {a}")), "{stdout}");
}
