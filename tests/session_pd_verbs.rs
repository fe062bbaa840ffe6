//! Session isolation over verbs (soft-RoCE in the test VM), on both of
//! rcpd's paths: memory windows (`--memory-windows on`: the arena
//! registered once, each window a type-2 memory window bound to the
//! session's QP) and the fallback (`--memory-windows off`: a protection
//! domain per session, a registration per grant).
//!
//! - an rkey granted to one session's window is refused with
//!   IBV_WC_REM_ACCESS_ERR on another session's QP, and nothing is written;
//! - forged rkeys (nobody granted them), a WRITE into a READ window and an
//!   address past the window's slot are refused, and nothing changes;
//! - a window's rkey fails the moment the window is done (invalidated or
//!   deregistered when rcpd takes its WindowDone, before it answers);
//! - a pulled block damaged on the way is read again.
//!
//! (What a protection domain, a window registration and a memory-window
//! bind cost is `examples/pd_registration_cost.rs`.)
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

/// rcpd's two verbs paths: the flag that forces each, and the line its log
/// says once at start.
#[derive(Clone, Copy, Debug)]
enum Path {
    MemoryWindows,
    PerGrant,
}

impl Path {
    fn rcpd(self, root: &std::path::Path) -> Rcpd {
        let mode = match self {
            Path::MemoryWindows => "on",
            Path::PerGrant => "off",
        };
        let d = Rcpd::start(root, "verbs", None, &["--memory-windows", mode]);
        let want = match self {
            Path::MemoryWindows => "memory windows: the window arena is registered once",
            Path::PerGrant => "no memory windows: a protection domain per session",
        };
        // The line is logged before rcpd prints that it listens.
        assert!(d.log().contains(want), "{self:?}: {}", d.log());
        println!("rcpd path: {self:?}");
        d
    }
}

fn tmp() -> tempfile::TempDir {
    // RCP_TEST_TMPDIR (the guest's tmpfs in the VM suite) or cargo's.
    common::e2e::tmp()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_rkey_of_another_session_is_rem_access_err_memory_windows() {
    rkey_of_another_session(Path::MemoryWindows);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_rkey_of_another_session_is_rem_access_err_per_grant() {
    rkey_of_another_session(Path::PerGrant);
}

fn rkey_of_another_session(path: Path) {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = path.rcpd(&root);
    let good: Vec<u8> = (0..2 * BS as u32).map(|i| (i % 247) as u8).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        // Two sessions, each with its own QP (and, on rcpd, windows bound to
        // that QP, or a PD of its own).
        let s1 = Arc::new(Session::open(&mut c, ProviderKind::Verbs, BS).await);
        let s2 = Session::open(&mut c, ProviderKind::Verbs, BS).await;
        let open = proto::OpenFile {
            flat_sha256: true,
            ..raw::push(1, "victim", good.len() as u64)
        };
        let mut m = Move::open(&mut c, s1.id(), vec![open]).await;
        assert_eq!(m.opened().await.length, good.len() as u64);
        let g = m.grant().await;
        assert_eq!((g.round, g.extents.len()), (0, 2), "{g:?}");
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

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_forged_rkeys_are_refused_memory_windows() {
    forged_rkeys(Path::MemoryWindows);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_forged_rkeys_are_refused_per_grant() {
    forged_rkeys(Path::PerGrant);
}

/// Forged rkeys over verbs: a pull window's rkey with its key byte
/// changed (what the next bind would give) and with bits flipped, for a
/// WRITE and a READ; a WRITE into the READ window with its own rkey; a
/// READ past the window's slot with its own rkey. Every one fails with
/// IBV_WC_REM_ACCESS_ERR and nothing changes. A refused request takes the
/// QPs of its session to the error state, so each forgery runs on a
/// session of its own, and each victim session tries its own last.
fn forged_rkeys(path: Path) {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let len = 3 * BS + 100;
    make_file(&root.join("readonly"), len, 5);
    let data = std::fs::read(root.join("readonly")).unwrap();
    let d = path.rcpd(&root);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let mut victims = Vec::new();
        for _ in 0..2 {
            let v = Arc::new(Session::open(&mut c, ProviderKind::Verbs, BS).await);
            let mut m = Move::open(&mut c, v.id(), vec![raw::pull(1, "readonly")]).await;
            assert_eq!(m.opened().await.length, len);
            let g = m.grant().await;
            assert_eq!((g.extents.len(), g.digests.len()), (4, 4), "{g:?}");
            victims.push((v, m, g));
        }
        let mut forgers = Vec::new();
        for _ in 0..4 {
            forgers.push(Session::open(&mut c, ProviderKind::Verbs, BS).await);
        }
        let (v0, g0) = (victims[0].0.clone(), victims[0].2.clone());
        let (v1, g1) = (victims[1].0.clone(), victims[1].2.clone());
        let window = rcp::control::WINDOW_SIZE as u64;
        let (st, seen) = tokio::task::spawn_blocking(move || {
            // Each victim reads its window with its own rkey first.
            let seen: Vec<Vec<u8>> = [(&v0, &g0), (&v1, &g1)]
                .iter()
                .map(|(v, g)| {
                    let (ok, w) = v.read(g.addr, g.rkey, g.len as usize);
                    assert_eq!(ok, WcStatus::Success);
                    w
                })
                .collect();
            let next = (g0.rkey & !0xff) | (g0.rkey.wrapping_add(1) & 0xff);
            let flipped = g0.rkey ^ 0x5a5a_1234;
            let st = [
                (
                    "next rkey, WRITE",
                    forgers[0].write(g0.addr, next, &[0xee; BS as usize]),
                ),
                (
                    "next rkey, READ",
                    forgers[1].read(g0.addr, next, BS as usize).0,
                ),
                (
                    "flipped rkey, WRITE",
                    forgers[2].write(g0.addr, flipped, &[0xee; BS as usize]),
                ),
                (
                    "flipped rkey, READ",
                    forgers[3].read(g0.addr, flipped, BS as usize).0,
                ),
                // The victims, on their own QPs, with their own rkeys.
                (
                    "WRITE into a READ window",
                    v0.write(g0.addr, g0.rkey, &[0xee; BS as usize]),
                ),
                (
                    "READ past the window's slot",
                    v1.read(g1.addr + window, g1.rkey, BS as usize).0,
                ),
            ];
            (st, seen)
        })
        .await
        .unwrap();
        for (what, s) in &st {
            println!("{what}: {s:?}");
        }
        for (what, s) in &st {
            assert_eq!(*s, WcStatus::RemoteAccess, "{what}");
        }
        for ((_, m, g), w) in victims.iter_mut().zip(&seen) {
            for (e, dg) in g.extents.iter().zip(&g.digests) {
                let got = &w[e.offset as usize..][..e.len as usize];
                assert_eq!(got, &data[(e.block * BS) as usize..][..e.len as usize]);
                assert_eq!(&raw::sha256(got), dg, "block {}", e.block);
            }
            // Done: rcpd revokes the window (its session's QP is in the
            // error state now: the revocation cannot ride on it) and ends
            // the file.
            m.send_done(raw::pulled(g, vec![]));
            let end = m.end().await;
            assert_eq!(end.digest, raw::file_digest(&data, BS), "the file digest");
            m.close();
            m.finish().await;
        }
    });
    assert_eq!(std::fs::read(root.join("readonly")).unwrap(), data);
    println!("rcpd log:\n{}", d.log());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_a_windows_rkey_fails_once_it_is_done_memory_windows() {
    rkey_fails_once_done(Path::MemoryWindows);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_a_windows_rkey_fails_once_it_is_done_per_grant() {
    rkey_fails_once_done(Path::PerGrant);
}

/// A push window's rkey works until the window is done and fails from the
/// moment rcpd answers its WindowDone: rcpd invalidates the memory window
/// (or deregisters the registration) before it reads what landed, so the
/// Ack comes after the revocation. A WRITE right after the Ack fails with
/// IBV_WC_REM_ACCESS_ERR and the file commits with what was verified.
fn rkey_fails_once_done(path: Path) {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = path.rcpd(&root);
    let good: Vec<u8> = (0..2 * BS as u32).map(|i| (i % 251) as u8).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(Session::open(&mut c, ProviderKind::Verbs, BS).await);
        let mut m = Move::open(
            &mut c,
            s.id(),
            vec![raw::push(1, "late", good.len() as u64)],
        )
        .await;
        m.opened().await;
        let g = m.grant().await;
        let (e0, e1) = (g.extents[0], g.extents[1]);
        let (s1, g1, d1) = (s.clone(), g.clone(), good.clone());
        let before = tokio::task::spawn_blocking(move || {
            (
                s1.write(g1.addr + e0.offset, g1.rkey, &d1[..BS as usize]),
                s1.write(g1.addr + e1.offset, g1.rkey, &d1[BS as usize..]),
            )
        })
        .await
        .unwrap();
        assert_eq!(before, (WcStatus::Success, WcStatus::Success));
        m.send_done(raw::pushed(
            &g,
            vec![
                raw::sha256(&good[..BS as usize]),
                raw::sha256(&good[BS as usize..]),
            ],
        ));
        let a = m.ack().await;
        assert!(a.resend.is_empty(), "{a:?}");
        // The window is done: its rkey is dead already.
        let (s1, g1) = (s.clone(), g.clone());
        let late = tokio::task::spawn_blocking(move || {
            s1.write(g1.addr + e0.offset, g1.rkey, &[0xee; BS as usize])
        })
        .await
        .unwrap();
        println!("{path:?}: a WRITE with the window's rkey right after its Ack: {late:?}");
        assert_eq!(late, WcStatus::RemoteAccess, "IBV_WC_REM_ACCESS_ERR");
        let fd = raw::file_digest(&good, BS);
        m.send_end(1, fd.clone());
        assert_eq!(m.committed().await.digest, fd);
        m.close();
        m.finish().await;
    });
    assert_eq!(
        std::fs::read(root.join("late")).unwrap(),
        good,
        "nothing landed late"
    );
}

/// Over verbs too: a pulled block damaged once (rcp's injection, the
/// `fault-injection` feature) is read again under a fresh grant and the
/// copy ends with the right digest.
#[cfg(feature = "fault-injection")]
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
        "the fault was injected (was rcp built with --features rcp/fault-injection?): {stderr}"
    );
    for l in stderr.lines().filter(|l| l.contains("again")) {
        println!("{l}");
    }
    let (a, b) = (sha256sum(&root.join("src")), sha256sum(&dst));
    println!("source {a}\npulled {b}");
    assert_eq!(a, b);
    assert!(stdout.contains(&format!("sha256 {a}")), "{stdout}");
}
