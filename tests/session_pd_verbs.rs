//! Per-session protection domains over verbs (soft-RoCE in the test VM):
//! an rkey granted to one session's window is refused with
//! IBV_WC_REM_ACCESS_ERR on another session's QP, and nothing is written;
//! plus what a protection domain and a window registration cost.
//!
//! `cargo build --workspace && cargo test --test session_pd_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1 --nocapture`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rcp::control::link::ClientLink;
use rcp::engine::{OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::proto::{self, client_msg, rcp_client::RcpClient, server_msg, ClientMsg};
use rcp::provider::{Access, Channel, ProviderKind};
use rcp::verbs::{Context, ProtectionDomain};
use sha2::{Digest, Sha256};

const BS: usize = 4096;

fn tmp() -> tempfile::TempDir {
    // The VM mounts the repository writable; /tmp may not be.
    tempfile::Builder::new()
        .prefix("session-pd-verbs")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

/// A verbs session made by hand: its link (staging + QP) and data channel.
struct VerbsSession {
    id: u64,
    link: Arc<ClientLink>,
    ch: Arc<dyn Channel>,
}

async fn verbs_session(c: &mut RcpClient<tonic::transport::Channel>) -> VerbsSession {
    let link = ClientLink::open(ProviderKind::Verbs, None, None, BS, 4, 0).unwrap();
    let hs = c
        .handshake(proto::HandshakeRequest {
            version_major: 1,
            providers: vec![proto::Provider::Verbs as i32],
            block_size: BS as u64,
            verbs: link.verbs_params(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let ch = link.connect(&hs, "127.0.0.1", Default::default()).unwrap();
    VerbsSession {
        id: hs.session_id,
        link: Arc::new(link),
        ch,
    }
}

/// WRITE `data` (one block) from staging buffer 0 to (addr, rkey); the status.
fn write(s: &VerbsSession, addr: u64, rkey: u32, data: &[u8]) -> WcStatus {
    let local = s.link.buffers[0];
    let o = (local.addr - s.link.staging.addr()) as usize;
    // SAFETY: staging buffer 0 is this function's alone: the one request below is posted after the copy and polled to completion before it returns.
    unsafe { s.link.staging.with_mut(o, BS, |b| b.copy_from_slice(data)) }.unwrap();
    // SAFETY: the local buffer is in the session's staging registration and left alone until the completion below is polled.
    unsafe {
        s.ch.post(&[WorkRequest {
            wr_id: 7,
            kind: OpKind::Write,
            local,
            remote: RemoteSeg { addr, rkey },
            signaled: true,
            inline: false,
        }])
    }
    .unwrap();
    let mut wc = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 4];
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if s.ch.poll(&mut wc).unwrap() > 0 {
            return wc[0].status;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("no completion");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_rkey_of_another_session_is_rem_access_err() {
    let t = tmp();
    let root = t.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, "verbs", None, &[]);
    let good: Vec<u8> = (0..2 * BS as u32).map(|i| (i % 247) as u8).collect();
    let digest = |b: &[u8]| Sha256::digest(b).to_vec();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = RcpClient::connect(format!("http://127.0.0.1:{}", d.port))
            .await
            .unwrap();
        let s1 = verbs_session(&mut c).await;
        let s2 = verbs_session(&mut c).await;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::Open(proto::Open {
                session_id: s1.id,
                direction: proto::Direction::Push as i32,
                path: "victim".into(),
                block_size: BS as u64,
                length: good.len() as u64,
                ..Default::default()
            })),
        })
        .unwrap();
        let mut st = c
            .transfer(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let next = |m: Option<proto::ServerMsg>| m.unwrap().msg.unwrap();
        assert!(matches!(
            next(st.message().await.unwrap()),
            server_msg::Msg::Opened(_)
        ));
        let server_msg::Msg::Grant(g) = next(st.message().await.unwrap()) else {
            panic!("no grant")
        };
        let (g2, good2) = (g.clone(), good.clone());
        let (mine, other) = tokio::task::spawn_blocking(move || {
            let mine = (
                write(&s1, g2.addr, g2.rkey, &good2[..BS]),
                write(&s1, g2.addr + BS as u64, g2.rkey, &good2[BS..]),
            );
            // The window's rkey is live (session 1 just used it); session 2
            // forges it over its own QP.
            let other = write(&s2, g2.addr, g2.rkey, &[0xee; BS]);
            (mine, other)
        })
        .await
        .unwrap();
        println!("session 1 writes with its own rkey: {mine:?}");
        println!("session 2 writes with session 1's rkey: {other:?}");
        assert_eq!(mine, (WcStatus::Success, WcStatus::Success));
        assert_eq!(other, WcStatus::RemoteAccess, "IBV_WC_REM_ACCESS_ERR");
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: g.window_id,
                epoch: 0,
                block_sha256: vec![digest(&good[..BS]), digest(&good[BS..])],
                ..Default::default()
            })),
        })
        .unwrap();
        let server_msg::Msg::Ack(a) = next(st.message().await.unwrap()) else {
            panic!("no ack")
        };
        assert!(a.resend_blocks.is_empty(), "nothing was overwritten");
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::Commit(proto::Commit {
                sha256: digest(&good),
            })),
        })
        .unwrap();
        let server_msg::Msg::Committed(cm) = next(st.message().await.unwrap()) else {
            panic!("no commit")
        };
        assert_eq!(cm.sha256, digest(&good));
    });
    assert_eq!(std::fs::read(root.join("victim")).unwrap(), good);
    println!(
        "victim sha256 {} (session 1's data, intact)",
        sha256sum(&root.join("victim"))
    );
}

/// What per-session PDs and per-transfer registrations cost: ibv_alloc_pd,
/// ibv_reg_mr of one 4 MiB window (and the matching dealloc / dereg).
#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn verbs_pd_and_window_registration_cost() {
    const N: u32 = 200;
    const WIN: usize = 4 << 20;
    let ctx = Context::open(None).unwrap();
    let arena = Arena::new(&ArenaConfig::new(WIN)).unwrap();
    println!("arena backing: {:?}", arena.backing());
    let span = PeerSpan::new(&arena, arena.addr(), WIN).unwrap();
    let shared_pd = ProtectionDomain::new(&ctx).unwrap();
    // Warm up (first registration pins the pages).
    drop(
        shared_pd
            .register_span(&span, Access::REMOTE_WRITE)
            .unwrap(),
    );
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..N {
            f();
        }
        t.elapsed().as_secs_f64() * 1e6 / f64::from(N)
    };
    let pd_us = time(&mut || drop(ProtectionDomain::new(&ctx).unwrap()));
    let mr_us = time(&mut || {
        drop(
            shared_pd
                .register_span(&span, Access::REMOTE_WRITE)
                .unwrap(),
        );
    });
    let both_us = time(&mut || {
        let pd = ProtectionDomain::new(&ctx).unwrap();
        drop(pd.register_span(&span, Access::REMOTE_WRITE).unwrap());
    });
    println!(
        "per-session PD alloc+dealloc: {pd_us:.1} us; 4 MiB window reg_mr+dereg: {mr_us:.1} us; \
         both (new PD + window per transfer): {both_us:.1} us  (mean of {N}, device {})",
        ctx.name()
    );
}

/// Over verbs too: a pulled block damaged once is read again under a fresh
/// grant and the copy ends with the right digest.
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
        &["pull", "127.0.0.1:src", dst.to_str().unwrap()],
    )
    .env("RCP_TEST_CORRUPT_PULLED_BLOCKS", "2")
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}\n{}", d.log());
    assert!(stderr.contains("reading it again"), "{stderr}");
    for l in stderr.lines().filter(|l| l.contains("again")) {
        println!("{l}");
    }
    let (a, b) = (sha256sum(&root.join("src")), sha256sum(&dst));
    println!("source {a}\npulled {b}");
    assert_eq!(a, b);
}
