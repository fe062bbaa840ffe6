//! What one client can do to rcpd's other clients, over the tcp provider:
//! strings it sends cannot forge rcpd's log lines; sessions it opens and
//! streams it runs without moving anything cannot take what the others
//! need (the session table, the transfer slots); rcpd says whom it cut
//! off, and why, in its log and in /metrics.
//!
//! The hostile client dials from 127.0.0.2 (another address of the
//! loopback: another client to rcpd), rcp from 127.0.0.1. Every test
//! asserts outcomes, never how long something took.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use common::metrics::{sample, scrape};
use common::raw::{self, grpc, Client};
use common::*;
use rcp::proto::{rcp_client::RcpClient, ClientFrame, ServerFrame};
use rcp::provider::ProviderKind;
use tokio::sync::mpsc;
use tonic::Code;

/// The other client's address.
const OTHER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));

/// A gRPC client of rcpd (on 127.0.0.1) dialing from `local`.
async fn grpc_from(port: u16, local: IpAddr) -> Client {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .local_address(Some(local))
        .connect()
        .await
        .unwrap();
    RcpClient::new(ch)
}

/// A tcp session's handshake: its id, or the status it was refused with.
async fn handshake(c: &mut Client) -> Result<u64, tonic::Status> {
    c.handshake(raw::hello(ProviderKind::Tcp, 0))
        .await
        .map(|r| r.into_inner().session_id)
}

/// A Move stream on `session` that sends nothing but keepalives (a frame
/// with only the session id, every 200 ms) until dropped; what rcpd sent
/// comes out of the receiver (frames, then the status it ended with).
struct Idle {
    _tx: mpsc::UnboundedSender<ClientFrame>,
    rx: tonic::Streaming<ServerFrame>,
    _keepalives: tokio::task::JoinHandle<()>,
}

impl Idle {
    async fn start(c: &mut Client, session: u64) -> Idle {
        let (tx, rx) = mpsc::unbounded_channel();
        let frame = ClientFrame {
            session_id: session,
            ..Default::default()
        };
        tx.send(frame.clone()).unwrap();
        let ka = tx.clone();
        let keepalives = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if ka.send(frame.clone()).is_err() {
                    return;
                }
            }
        });
        let rx = c
            .r#move(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Idle {
            _tx: tx,
            rx,
            _keepalives: keepalives,
        }
    }

    /// The status the stream ends with (keepalives skipped); a clean end,
    /// or a frame that carries something, panics.
    async fn status(&mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(raw::WAIT * 4, self.rx.message()).await {
                Err(_) => panic!("the stream did not end"),
                // Keepalives: a number and progress, nothing else.
                Ok(Ok(Some(f))) => assert_eq!(
                    f,
                    ServerFrame {
                        seq: f.seq,
                        progress: f.progress,
                        ..Default::default()
                    }
                ),
                Ok(Ok(None)) => panic!("the stream ended cleanly"),
                Ok(Err(s)) => return s,
            }
        }
    }
}

fn limit(d: &Rcpd, reason: &str) -> f64 {
    let m = scrape(d.metrics.as_deref().unwrap());
    let series = format!("rcpd_client_limits_total{{reason=\"{reason}\"}}");
    sample(&m, &series).unwrap_or_else(|| panic!("no {series} in {m}"))
}

/// rcp pushes a file from 127.0.0.1, and it arrives whole.
fn another_client_copies(d: &Rcpd, dir: &std::path::Path, name: &str) {
    let src = dir.join(name);
    make_file(&src, 3 << 20, 5);
    let r = rcp(
        d.port,
        "tcp",
        None,
        &["push", "-q", src.to_str().unwrap(), "127.0.0.1:/"],
    );
    assert_eq!(
        r.code,
        0,
        "the other client's copy failed: {}\n{}",
        r.stderr,
        d.log()
    );
    assert_eq!(sha256sum(&src), sha256sum(&d.root.join(name)));
}

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
            assert!(l.contains("name=\"rcp\\"), "{l:?}");
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

/// Handshakes at once, far beyond --max-sessions: exactly the limit get a
/// session, every other is refused naming the flag (and counted).
#[test]
fn concurrent_handshakes_beyond_the_limit() {
    const LIMIT: usize = 8;
    const TRIES: usize = 48;
    let (_tmp, _root, d) = setup(&["--max-sessions", &LIMIT.to_string()]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let results = rt.block_on(async {
        // A connection each, so the handshakes do run at once.
        let mut clients = Vec::new();
        for _ in 0..TRIES {
            clients.push(grpc(d.port).await);
        }
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(TRIES));
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|mut c| {
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    handshake(&mut c).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, LIMIT, "{results:?}");
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert_eq!(r.code(), Code::ResourceExhausted, "{r:?}");
        assert!(r.message().contains("--max-sessions"), "{r:?}");
    }
    assert_eq!(limit(&d, "sessions"), (TRIES - LIMIT) as f64);
}

/// ~4096 handshakes that never open a Move, from one client: it gets its
/// share (--max-sessions-per-client, 256 by default), the rest is refused,
/// and another client still copies.
#[test]
fn handshakes_without_move_do_not_lock_out_another_client() {
    const TRIES: usize = 4096;
    const SHARE: usize = 256;
    let (tmp, _root, d) = setup(&["--session-grace", "3600"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (ok, refused) = rt.block_on(async {
        let c = grpc_from(d.port, OTHER).await;
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    let (mut ok, mut refused) = (0, 0);
                    for _ in 0..TRIES / 16 {
                        match handshake(&mut c).await {
                            Ok(_) => ok += 1,
                            Err(s) => {
                                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                                assert!(s.message().contains("--max-sessions-per-client"), "{s:?}");
                                refused += 1;
                            }
                        }
                    }
                    (ok, refused)
                })
            })
            .collect();
        let (mut ok, mut refused) = (0, 0);
        for t in tasks {
            let (o, r) = t.await.unwrap();
            ok += o;
            refused += r;
        }
        (ok, refused)
    });
    assert_eq!((ok, refused), (SHARE, TRIES - SHARE));
    another_client_copies(&d, tmp.path(), "served");
    assert_eq!(limit(&d, "sessions_per_client"), (TRIES - SHARE) as f64);
    // Whom it refused, in the log.
    let log = d.log();
    assert!(
        log.lines().any(|l| l.contains("handshake refused")
            && l.contains("client=127.0.0.2")
            && l.contains("--max-sessions-per-client")),
        "{log}"
    );
}

/// 16 Move streams of one client that send only keepalives (the default
/// --max-transfers): the client runs its share of them, the others wait,
/// and another client's copy is served at once.
#[test]
fn keepalive_only_streams_do_not_hold_every_transfer_slot() {
    let (tmp, _root, d) = setup(&[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _streams = rt.block_on(async {
        let mut c = grpc_from(d.port, OTHER).await;
        let mut streams = Vec::new();
        for _ in 0..16 {
            let s = handshake(&mut c).await.unwrap();
            streams.push(Idle::start(&mut c, s).await);
        }
        streams
    });
    // Half of --max-transfers run, the other 8 wait for the client's share.
    wait_for("8 streams held back", Duration::from_secs(60), || {
        limit(&d, "transfers_per_client") >= 8.0
    });
    assert_eq!(limit(&d, "transfers_per_client"), 8.0);
    another_client_copies(&d, tmp.path(), "served");
    // The idle streams are still there (nothing cut them yet): the copy
    // was served beside them, not after them.
    assert_eq!(limit(&d, "no_progress"), 0.0, "{}", d.log());
}

/// A stream that moves nothing, though its client sends keepalives, is
/// ended after --timeout, and its slot goes to the next stream; rcpd logs
/// whom it cut off. Two such streams and one slot: the second waits (counted),
/// gets the slot when the first is ended, and is ended in its turn; no
/// step depends on how fast the machine is (a real copy beside them could
/// be cut by the short timeout on a loaded machine).
#[test]
fn a_stream_that_moves_nothing_is_ended() {
    let (_tmp, _root, d) = setup(&["--timeout", "2", "--max-transfers", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sts = rt.block_on(async {
        let mut c = grpc_from(d.port, OTHER).await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            let s = handshake(&mut c).await.unwrap();
            idle.push(Idle::start(&mut c, s).await);
        }
        let mut sts = Vec::new();
        for i in &mut idle {
            sts.push(i.status().await);
        }
        sts
    });
    for st in &sts {
        assert_eq!(st.code(), Code::Unavailable, "{st:?}");
        assert!(st.message().contains("nothing moved"), "{st:?}");
    }
    // One waited for the slot, and was ended only once it ran.
    assert_eq!(limit(&d, "transfers_per_client"), 1.0, "{}", d.log());
    assert_eq!(limit(&d, "no_progress"), 2.0, "{}", d.log());
    let log = d.log();
    assert!(
        log.lines().any(|l| l.contains("nothing moved")
            && l.contains("client=127.0.0.2")
            && l.contains("limit=\"no_progress\"")),
        "{log}"
    );
}

/// A session that opens no Move stream within --session-grace is closed
/// (a Move on it later is refused); one that ran a stream is not.
#[test]
fn a_session_without_move_is_closed_after_the_grace() {
    // A grace the used session's Move (opened right after its handshake)
    // comes well within on a loaded machine; the test waits it out.
    let (_tmp, _root, d) = setup(&["--session-grace", "10"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc_from(d.port, OTHER).await;
        // A session that runs an (empty) stream first...
        let used = handshake(&mut c).await.unwrap();
        let mut m = raw::Move::open(&mut c, used, vec![]).await;
        m.close();
        m.finish().await;
        // ...then one that never does.
        let unused = handshake(&mut c).await.unwrap();
        let t0 = std::time::Instant::now();
        let closed = loop {
            let n = limit(&d, "session_grace");
            if n >= 1.0 {
                break n;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "the unused session was not closed in 120 s (--session-grace 10): {}",
                d.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(closed, 1.0, "{}", d.log());
        let mut m = raw::Move::open(&mut c, unused, vec![]).await;
        let s = m.status().await;
        assert!(s.message().contains("unknown session"), "{s:?}");
        assert!(s.message().contains("--session-grace"), "{s:?}");
        // The used one, idle longer than the grace, still serves.
        let mut m = raw::Move::open(&mut c, used, vec![]).await;
        m.close();
        m.finish().await;
    });
    let log = d.log();
    assert!(
        log.lines().any(
            |l| l.contains("sessions closed: no Move stream within --session-grace")
                && l.contains("client=127.0.0.2")
        ),
        "{log}"
    );
}
