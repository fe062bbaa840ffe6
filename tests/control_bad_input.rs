//! Hostile and broken input against rcpd over TCP: path escapes, wrong
//! tokens, forged rkeys, garbage on the gRPC port, malformed messages, a
//! killed daemon. Each is refused with the right error while another copy
//! in flight finishes, and nothing stored is lost.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::proto::{self, client_msg, rcp_client::RcpClient, server_msg, ClientMsg};
use rcp::provider::tcp::{TcpChannel, TcpDomain};
use rcp::provider::{Access, Channel};
use tonic::Code;

const T: &str = "tcp";

struct Bg {
    child: Child,
    src: std::path::PathBuf,
}

/// A 24 MiB push running in the background.
fn copy_in_flight(d: &Rcpd, dir: &Path, token: Option<&str>) -> Bg {
    let src = dir.join("inflight");
    make_file(&src, 24 << 20, 99);
    let child = rcp_cmd(
        d.port,
        T,
        token,
        &["push", "-q", src.to_str().unwrap(), "127.0.0.1:/"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    Bg { child, src }
}

impl Bg {
    fn finishes(self, root: &Path) {
        let out = self.child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "the copy in flight failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(sha256sum(&self.src), sha256sum(&root.join("inflight")));
    }
}

fn setup(token: Option<&str>) -> (tempfile::TempDir, std::path::PathBuf, Rcpd) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, token, &[]);
    (tmp, root, d)
}

#[test]
fn path_escapes_are_refused() {
    let (tmp, root, d) = setup(None);
    std::fs::write(tmp.path().join("secret"), b"outside").unwrap();
    std::os::unix::fs::symlink(tmp.path(), root.join("link")).unwrap();
    let bg = copy_in_flight(&d, tmp.path(), None);
    let f = tmp.path().join("small");
    std::fs::write(&f, b"x").unwrap();
    let fs = f.to_str().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let os = out.to_str().unwrap();
    for (args, what) in [
        (vec!["push", fs, "127.0.0.1:../escaped"], "escapes"),
        (vec!["push", fs, "127.0.0.1:a/../../escaped"], "escapes"),
        (vec!["push", fs, "127.0.0.1:link/escaped"], "symlink"),
        (vec!["pull", "127.0.0.1:../secret", os], "escapes"),
        (vec!["pull", "127.0.0.1:link/secret", os], "symlink"),
    ] {
        let r = rcp(d.port, T, None, &args);
        assert_eq!(r.code, 6, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains(what), "{args:?}: {}", r.stderr);
    }
    assert!(!tmp.path().join("escaped").exists());
    assert!(!out.join("secret").exists());
    assert_eq!(
        std::fs::read(tmp.path().join("secret")).unwrap(),
        b"outside"
    );
    bg.finishes(&root);
}

#[test]
fn wrong_or_missing_token_is_refused() {
    let (tmp, root, d) = setup(Some("good-token"));
    let bg = copy_in_flight(&d, tmp.path(), Some("good-token"));
    let f = tmp.path().join("small");
    std::fs::write(&f, b"hello").unwrap();
    let args = ["push", f.to_str().unwrap(), "127.0.0.1:/"];
    let r = rcp(d.port, T, Some("bad-token"), &args);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("invalid token"), "{}", r.stderr);
    let r = rcp(d.port, T, None, &args);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("missing authorization"), "{}", r.stderr);
    assert!(!root.join("small").exists());
    let r = rcp(d.port, T, Some("good-token"), &args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    bg.finishes(&root);
    // The refusals were counted.
    let m = common::metrics::scrape(d.metrics.as_deref().unwrap());
    assert!(m.contains("rcpd_auth_failures_total 2"), "{m}");
}

async fn grpc(port: u16) -> RcpClient<tonic::transport::Channel> {
    RcpClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

async fn tcp_session(c: &mut RcpClient<tonic::transport::Channel>) -> proto::HandshakeResponse {
    c.handshake(proto::HandshakeRequest {
        version_major: 1,
        version_minor: rcp::control::VERSION_MINOR,
        providers: vec![proto::Provider::Tcp as i32],
        block_size: 1 << 20,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
}

fn open_msg(session: u64, dir: proto::Direction, path: &str, bs: u64) -> ClientMsg {
    ClientMsg {
        msg: Some(client_msg::Msg::Open(proto::Open {
            session_id: session,
            direction: dir as i32,
            path: path.into(),
            block_size: bs,
            ..Default::default()
        })),
    }
}

/// Where a session's data connections go, and the key that binds them to it.
#[derive(Clone)]
struct DataPort {
    port: u32,
    key: Option<[u8; 16]>,
}

fn data_port(hs: &proto::HandshakeResponse) -> DataPort {
    DataPort {
        port: hs.tcp_data_port,
        key: Some(
            hs.tcp_session_key
                .as_slice()
                .try_into()
                .expect("a 16-byte session key"),
        ),
    }
}

/// Post one WRITE of 4 KiB to (addr, rkey) over a fresh channel; the status.
fn forged_write(dp: &DataPort, addr: u64, rkey: u32) -> WcStatus {
    write_block(dp, addr, rkey, &[0xee; 4096])
}

/// Post one WRITE of `data` (4 KiB) to (addr, rkey) over a fresh channel of
/// the session `dp` belongs to.
fn write_block(dp: &DataPort, addr: u64, rkey: u32, data: &[u8]) -> WcStatus {
    let domain = TcpDomain::new();
    let arena = Arena::new(&ArenaConfig::new(2 << 20)).unwrap();
    let span = PeerSpan::new(&arena, arena.addr(), 4096).unwrap();
    // SAFETY: a fresh arena of this function's own; nothing is posted yet.
    unsafe { span.with_mut(0, 4096, |b| b.copy_from_slice(data)) }.unwrap();
    let reg = domain.register_span(&span, Access::LOCAL_WRITE).unwrap();
    let addr_port = format!("127.0.0.1:{}", dp.port).parse().unwrap();
    let ch = TcpChannel::connect_session(domain, addr_port, 1, 8, dp.key).unwrap();
    // SAFETY: the span is registered in the channel's domain and left alone until the completion below is polled (the arena outlives it).
    unsafe {
        ch.post(&[WorkRequest {
            wr_id: 1,
            kind: OpKind::Write,
            local: LocalSeg {
                addr: span.addr(),
                len: 4096,
                lkey: rcp::provider::Registration::lkey(&*reg),
            },
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
    for _ in 0..500 {
        let n = ch.poll(&mut wc).unwrap();
        if n > 0 {
            return wc[0].status;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no completion for the forged write");
}

#[test]
fn forged_rkeys_are_refused() {
    let (tmp, root, d) = setup(None);
    make_file(&root.join("readonly"), 3 << 20, 5);
    let before = sha256sum(&root.join("readonly"));
    let bg = copy_in_flight(&d, tmp.path(), None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hs = tcp_session(&mut c).await;
        // A real grant, for a pull: REMOTE_READ only.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(open_msg(
            hs.session_id,
            proto::Direction::Pull,
            "readonly",
            1 << 20,
        ))
        .unwrap();
        let mut s = c
            .transfer(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut grant = None;
        while grant.is_none() {
            match s.message().await.unwrap().unwrap().msg.unwrap() {
                server_msg::Msg::Grant(g) => grant = Some(g),
                server_msg::Msg::Opened(_) => {}
                m => panic!("unexpected {m:?}"),
            }
        }
        let g = grant.unwrap();
        let port = data_port(&hs);
        let st = tokio::task::spawn_blocking(move || {
            (
                // WRITE into a window granted for READ: no access.
                forged_write(&port, g.addr, g.rkey),
                // An rkey nobody granted.
                forged_write(&port, g.addr, g.rkey ^ 0x5a5a_1234),
            )
        })
        .await
        .unwrap();
        assert_eq!(st.0, WcStatus::RemoteAccess);
        assert_eq!(st.1, WcStatus::RemoteAccess);
        drop(tx);
    });
    bg.finishes(&root);
    assert_eq!(
        sha256sum(&root.join("readonly")),
        before,
        "nothing stored changed"
    );
}

#[test]
fn garbage_and_malformed_messages_are_refused() {
    let (tmp, root, d) = setup(None);
    let bg = copy_in_flight(&d, tmp.path(), None);
    // Random bytes, and an HTTP/2 preface followed by junk.
    for junk in [
        (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect::<Vec<u8>>(),
        [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(), &[0xff; 300]].concat(),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        let _ = s.write_all(&junk);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut sink);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        // Unknown major version.
        let e = c
            .handshake(proto::HandshakeRequest {
                version_major: 2,
                providers: vec![proto::Provider::Tcp as i32],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("major version 2"), "{e}");
        // A 1.0 client on tcp: its data connections would carry no
        // session key, so it is refused by version, not by access errors.
        let e = c
            .handshake(proto::HandshakeRequest {
                version_major: 1,
                version_minor: 0,
                providers: vec![proto::Provider::Tcp as i32],
                block_size: 1 << 20,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(
            e.message().contains("1.0 is too old") && e.message().contains("session keys"),
            "{e}"
        );
        // Provider the server does not run.
        let e = c
            .handshake(proto::HandshakeRequest {
                version_major: 1,
                version_minor: rcp::control::VERSION_MINOR,
                providers: vec![proto::Provider::Verbs as i32],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        // Bad block size in the handshake.
        let e = c
            .handshake(proto::HandshakeRequest {
                version_major: 1,
                version_minor: rcp::control::VERSION_MINOR,
                providers: vec![proto::Provider::Tcp as i32],
                block_size: 5000,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        let hs = tcp_session(&mut c).await;

        async fn stream_err(
            c: &mut RcpClient<tonic::transport::Channel>,
            msgs: Vec<ClientMsg>,
        ) -> tonic::Status {
            let mut s = c
                .transfer(tokio_stream::iter(msgs).chain(tokio_stream::pending()))
                .await
                .unwrap()
                .into_inner();
            loop {
                match s.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("stream ended without an error"),
                    Err(e) => return e,
                }
            }
        }
        use tokio_stream::StreamExt as _;
        let sid = hs.session_id;
        let wd = |id| ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: id,
                epoch: 0,
                block_sha256: vec![],
                ..Default::default()
            })),
        };
        let cases: Vec<(Vec<ClientMsg>, Code, &str)> = vec![
            (vec![wd(1)], Code::InvalidArgument, "must be Open"),
            (
                vec![ClientMsg { msg: None }],
                Code::InvalidArgument,
                "empty",
            ),
            (
                vec![open_msg(12345, proto::Direction::Push, "x", 1 << 20)],
                Code::InvalidArgument,
                "unknown session",
            ),
            (
                vec![open_msg(sid, proto::Direction::Push, "x", 5000)],
                Code::InvalidArgument,
                "block size",
            ),
            (
                vec![open_msg(sid, proto::Direction::Unspecified, "x", 1 << 20)],
                Code::InvalidArgument,
                "neither push nor pull",
            ),
            (
                vec![open_msg(sid, proto::Direction::Pull, "nope", 1 << 20)],
                Code::NotFound,
                "nope",
            ),
            (
                vec![
                    open_msg(sid, proto::Direction::Push, "y", 1 << 20),
                    wd(999_999),
                ],
                Code::InvalidArgument,
                "not granted",
            ),
        ];
        for (msgs, code, what) in cases {
            let e = stream_err(&mut c, msgs).await;
            assert_eq!(e.code(), code, "{what}: {e}");
            assert!(e.message().contains(what), "{what}: {e}");
        }
        // Push with a window done but wrong digests: refused, nothing stored.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut o = open_msg(sid, proto::Direction::Push, "forged", 1 << 20);
        if let Some(client_msg::Msg::Open(op)) = o.msg.as_mut() {
            op.length = 8192;
        }
        tx.send(o).unwrap();
        let mut s = c
            .transfer(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut gid = None;
        while gid.is_none() {
            if let server_msg::Msg::Grant(g) = s.message().await.unwrap().unwrap().msg.unwrap() {
                gid = Some(g.window_id);
            }
        }
        // Digests that never match: asked again 3 times, then DATA_LOSS.
        let mut epoch = 0;
        let e = 'outer: loop {
            tx.send(ClientMsg {
                msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                    window_id: gid.unwrap(),
                    epoch,
                    block_sha256: vec![vec![0u8; 32]],
                    ..Default::default()
                })),
            })
            .unwrap();
            loop {
                match s.message().await {
                    Ok(Some(m)) => match m.msg.unwrap() {
                        server_msg::Msg::Ack(a) => assert_eq!(a.resend_blocks, vec![0]),
                        server_msg::Msg::Grant(g) => {
                            assert_eq!(g.epoch, epoch + 1);
                            epoch = g.epoch;
                            break;
                        }
                        m => panic!("unexpected {m:?}"),
                    },
                    Ok(None) => panic!("no error"),
                    Err(e) => break 'outer e,
                }
            }
        };
        assert_eq!(epoch, 3, "three resends before giving up");
        assert_eq!(e.code(), Code::DataLoss, "{e}");
        // An oversized message.
        let mut big = open_msg(sid, proto::Direction::Push, "z", 1 << 20);
        if let Some(client_msg::Msg::Open(op)) = big.msg.as_mut() {
            op.path = "a".repeat(5 << 20);
        }
        let e = stream_err(&mut c, vec![big]).await;
        assert!(
            matches!(
                e.code(),
                Code::OutOfRange | Code::ResourceExhausted | Code::Internal
            ),
            "{e}"
        );
    });
    assert!(!root.join("forged").exists());
    bg.finishes(&root);
    // Still serving.
    let f = tmp.path().join("after");
    std::fs::write(&f, b"still here").unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &["push", f.to_str().unwrap(), "127.0.0.1:/"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn killed_daemon_leaves_no_file_under_the_final_name() {
    let (tmp, root, mut d) = setup(None);
    let src = tmp.path().join("big");
    make_file(&src, 64 << 20, 3);
    let bs = ["--block-size", "64K"];
    let child = rcp_cmd(
        d.port,
        T,
        None,
        &[
            &bs[..],
            &["push", "-q", src.to_str().unwrap(), "127.0.0.1:/"],
        ]
        .concat(),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_verified(&root, "big", 64);
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(5),
        "a dead server is a retryable error: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!root.join("big").exists());
    // Another rcpd on the same root resumes it.
    let d2 = Rcpd::start(&root, T, None, &[]);
    let r = rcp(
        d2.port,
        T,
        None,
        &[
            &bs[..],
            &["push", "--resume", src.to_str().unwrap(), "127.0.0.1:/"],
        ]
        .concat(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(moved(&r.stdout) < 64 << 20, "{}", r.stdout);
    assert_eq!(sha256sum(&src), sha256sum(&root.join("big")));
}

#[test]
fn sigterm_lets_the_running_copy_finish() {
    let (tmp, root, d) = setup(None);
    let bg = copy_in_flight(&d, tmp.path(), None);
    wait_for("the copy to start", Duration::from_secs(60), || {
        find_manifest(&root, "inflight").is_some()
    });
    nix_kill(d.child.id(), "TERM");
    bg.finishes(&root);
    let mut d = d;
    let st = d.child.wait().unwrap();
    assert!(st.success(), "rcpd exit {st:?}: {}", d.log());
}

#[test]
fn health_port_serves_without_auth() {
    let (_tmp, _root, d) = setup(Some("tok"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = d.health.clone().unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        let r = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "rcp.v1.Rcp".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    });
    let _ = Arc::new(());
}

fn nix_kill(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn a_damaged_block_is_sent_again() {
    use sha2::{Digest, Sha256};
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let digest = |b: &[u8]| Sha256::digest(b).to_vec();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hs = tcp_session(&mut c).await;
        let port = data_port(&hs);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut o = open_msg(hs.session_id, proto::Direction::Push, "resent", 4096);
        if let Some(client_msg::Msg::Open(op)) = o.msg.as_mut() {
            op.length = 8192;
        }
        tx.send(o).unwrap();
        let mut s = c
            .transfer(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let next = |m: Option<proto::ServerMsg>| m.unwrap().msg.unwrap();
        assert!(matches!(
            next(s.message().await.unwrap()),
            server_msg::Msg::Opened(_)
        ));
        let server_msg::Msg::Grant(g) = next(s.message().await.unwrap()) else {
            panic!("no grant")
        };
        assert_eq!((g.len, g.epoch), (8192, 0));
        // Block 0 intact, block 1 damaged on the way.
        let (b0, b1) = (good[..4096].to_vec(), good[4096..].to_vec());
        let (g2, p2) = (g.clone(), port.clone());
        let st = tokio::task::spawn_blocking(move || {
            (
                write_block(&p2, g2.addr, g2.rkey, &b0),
                write_block(&p2, g2.addr + 4096, g2.rkey, &[0u8; 4096]),
            )
        })
        .await
        .unwrap();
        assert_eq!(st, (WcStatus::Success, WcStatus::Success));
        let done = |epoch| ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: g.window_id,
                epoch,
                block_sha256: vec![digest(&good[..4096]), digest(&good[4096..])],
                ..Default::default()
            })),
        };
        tx.send(done(0)).unwrap();
        let server_msg::Msg::Ack(a) = next(s.message().await.unwrap()) else {
            panic!("no ack")
        };
        assert_eq!(a.resend_blocks, vec![1]);
        let server_msg::Msg::Grant(again) = next(s.message().await.unwrap()) else {
            panic!("no new grant")
        };
        assert_eq!((again.window_id, again.epoch), (g.window_id, 1));
        assert_ne!(again.rkey, g.rkey, "a fresh rkey");
        let old = g.rkey;
        let st = tokio::task::spawn_blocking(move || {
            (
                // The old rkey is revoked.
                write_block(&port, again.addr, old, &[1u8; 4096]),
                write_block(&port, again.addr + 4096, again.rkey, &b1),
            )
        })
        .await
        .unwrap();
        assert_eq!(st, (WcStatus::RemoteAccess, WcStatus::Success));
        tx.send(done(1)).unwrap();
        let server_msg::Msg::Ack(a) = next(s.message().await.unwrap()) else {
            panic!("no ack")
        };
        assert!(a.resend_blocks.is_empty());
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::Commit(proto::Commit {
                sha256: digest(&good),
            })),
        })
        .unwrap();
        let server_msg::Msg::Committed(c) = next(s.message().await.unwrap()) else {
            panic!("no commit")
        };
        assert_eq!(c.sha256, digest(&good));
    });
    assert_eq!(std::fs::read(root.join("resent")).unwrap(), good);
}

/// Two sessions at once: session 2 uses session 1's currently valid window
/// rkey and address over its own data connection. The target refuses it
/// (each session has its own protection domain), session 1's bytes stay
/// as written and its copy commits with the right digest.
#[test]
fn an_rkey_works_only_in_its_own_session() {
    use sha2::{Digest, Sha256};
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good: Vec<u8> = (0..8192u32).map(|i| (i % 249) as u8).collect();
    let digest = |b: &[u8]| Sha256::digest(b).to_vec();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hs1 = tcp_session(&mut c).await;
        let hs2 = tcp_session(&mut c).await;
        assert_ne!(hs1.tcp_session_key, hs2.tcp_session_key);
        let (p1, p2) = (data_port(&hs1), data_port(&hs2));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut o = open_msg(hs1.session_id, proto::Direction::Push, "victim", 4096);
        if let Some(client_msg::Msg::Open(op)) = o.msg.as_mut() {
            op.length = 8192;
        }
        tx.send(o).unwrap();
        let mut s = c
            .transfer(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let next = |m: Option<proto::ServerMsg>| m.unwrap().msg.unwrap();
        assert!(matches!(
            next(s.message().await.unwrap()),
            server_msg::Msg::Opened(_)
        ));
        let server_msg::Msg::Grant(g) = next(s.message().await.unwrap()) else {
            panic!("no grant")
        };
        let (b0, b1) = (good[..4096].to_vec(), good[4096..].to_vec());
        let g2 = g.clone();
        let st = tokio::task::spawn_blocking(move || {
            let mine = (
                write_block(&p1, g2.addr, g2.rkey, &b0),
                write_block(&p1, g2.addr + 4096, g2.rkey, &b1),
            );
            // Session 1's window is live and its rkey valid: session 2
            // tries it over its own data connection...
            let other = forged_write(&p2, g2.addr, g2.rkey);
            let other_hi = forged_write(&p2, g2.addr + 4096, g2.rkey);
            // ...and so do a connection bound to no session and one naming
            // a key nobody was given.
            let unbound = forged_write(
                &DataPort {
                    key: None,
                    ..p2.clone()
                },
                g2.addr,
                g2.rkey,
            );
            let unknown = forged_write(
                &DataPort {
                    key: Some([0x42; 16]),
                    ..p2.clone()
                },
                g2.addr,
                g2.rkey,
            );
            (mine, other, other_hi, unbound, unknown)
        })
        .await
        .unwrap();
        assert_eq!(st.0, (WcStatus::Success, WcStatus::Success));
        assert_eq!(st.1, WcStatus::RemoteAccess, "cross-session rkey");
        assert_eq!(st.2, WcStatus::RemoteAccess, "cross-session rkey");
        assert_eq!(st.3, WcStatus::RemoteAccess, "no session");
        assert_eq!(st.4, WcStatus::RemoteAccess, "unknown session");
        // Session 1's bytes are intact: no block needs resending.
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: g.window_id,
                epoch: 0,
                block_sha256: vec![digest(&good[..4096]), digest(&good[4096..])],
                ..Default::default()
            })),
        })
        .unwrap();
        let server_msg::Msg::Ack(a) = next(s.message().await.unwrap()) else {
            panic!("no ack")
        };
        assert!(a.resend_blocks.is_empty(), "{:?}", a.resend_blocks);
        tx.send(ClientMsg {
            msg: Some(client_msg::Msg::Commit(proto::Commit {
                sha256: digest(&good),
            })),
        })
        .unwrap();
        let server_msg::Msg::Committed(cm) = next(s.message().await.unwrap()) else {
            panic!("no commit")
        };
        assert_eq!(cm.sha256, digest(&good));
    });
    assert_eq!(std::fs::read(root.join("victim")).unwrap(), good);
    assert_eq!(
        sha256sum(&root.join("victim")),
        hex_digest(&good),
        "session 1's copy has the right digest"
    );
}

fn hex_digest(b: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}
