//! The Rust client of the service protocol (control::buffers::client)
//! against an in-process rcpd over the tcp provider: two services on one
//! rcpd, one exposing, the other writing into it and reading it back
//! through the rcpd's own gRPC address (rcpd is its own peer), bytes and
//! the owner's event checked; then an unknown name. And an operation to
//! a peer off rcpd's --copy-peers: refused, and nothing dials it. And a
//! grant revoked with the session it was made to. And a kept session the
//! peer rcpd no longer holds, given up for a new one. And an exposure
//! gone mid-write: only the write into it fails. And standing grants:
//! operations without a grant each, told by notices, revoked with their
//! exposure, its owner and their session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
mod common;

use std::time::Duration;

use rcp::control::buffers::api::{Desc, OpRequest};
use rcp::control::buffers::api::{OpStateName, ServiceReason};
use rcp::control::buffers::client::ServiceClient;
use rcp::control::daemon::{self, DaemonConfig};
use rcp::control::Transport;
use rcp::provider::tcp::wire::{self, Status};
use rcp::provider::ProviderKind;

fn config(root: &std::path::Path, socket: &std::path::Path) -> DaemonConfig {
    DaemonConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        health_listen: None,
        root: root.to_path_buf(),
        transport: Transport::Tcp,
        arena_mib: 16,
        max_transfers: 4,
        shutdown_grace: Duration::from_secs(1),
        timeout: Duration::from_secs(30),
        max_open_files: 64,
        checks: vec![rcp::files::Check::Sha256],
        socket: Some(socket.to_path_buf()),
        // The writer's peer is this rcpd itself: allowed with no list.
        copy_peers: Vec::new(),
        ..DaemonConfig::default()
    }
}

/// An in-process rcpd, stopped by [`Daemon::stop`].
struct Daemon {
    addr: String,
    /// Where it is bound (gRPC, metrics...).
    bound: daemon::Bound,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<rcp::control::error::Result<()>>,
}

impl Daemon {
    async fn start(cfg: DaemonConfig) -> Daemon {
        // On a port of the kernel's choosing, anything logged about the
        // address was about an earlier rcpd (a restart on a given
        // address keeps its history).
        let new_port = cfg.listen.port() == 0;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            daemon::run(
                cfg,
                async {
                    let _ = stop_rx.await;
                },
                move |b, _| {
                    let _ = tx.send(b.clone());
                },
            )
            .await
        });
        let bound: daemon::Bound = rx.await.unwrap();
        let addr = bound.grpc.to_string();
        if new_port {
            forget_peer(&addr);
        }
        Daemon {
            addr,
            bound,
            stop,
            server,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.server.await.unwrap().unwrap();
    }
}

/// The configuration of an rcpd on `dir` (its root beneath, created) and
/// its socket's path.
fn dir_config(dir: &std::path::Path) -> (DaemonConfig, std::path::PathBuf) {
    let root = dir.join("root");
    std::fs::create_dir(&root).unwrap();
    let sock = dir.join("rcpd.sock");
    (config(&root, &sock), sock)
}

/// An in-process rcpd on `dir` (its root beneath) with its socket.
async fn start_rcpd(dir: &std::path::Path) -> (Daemon, std::path::PathBuf) {
    let (cfg, sock) = dir_config(dir);
    (Daemon::start(cfg).await, sock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_service_writes_and_reads_another_services_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();

    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    // hello names the address peers dial this rcpd at: its gRPC address.
    assert_eq!(owner.node(), addr, "{:?}", owner.hello());
    let dst = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&dst, "rust0", 0, 2 << 20, "rw", &[])
        .await
        .unwrap();

    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(2 << 20).await.unwrap();
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let h = writer
        .write(&src, &addr, "rust0", &[(0, 1 << 20, 1 << 20)], Some("hi"))
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 1 << 20);
    let mut got = vec![0u8; 1 << 20];
    assert!(dst.local.read_at(1 << 20, &mut got));
    assert!(got == data, "the owner's buffer holds the writer's bytes");
    let ev = owner.next_event().await.unwrap();
    assert_eq!(ev["event"], "written", "{ev}");
    assert_eq!(ev["message"], "hi", "{ev}");
    // `length` (the Python package's name) is the protocol's `len`; not
    // both. Exposing a name again replaces one's own exposure.
    let f = |k: &str| serde_json::json!({"buffer": dst.id, "name": "rust0", "offset": 0, k: 4096});
    owner.request("expose", f("length"), &[]).await.unwrap();
    let mut both = f("length");
    both["len"] = 4096.into();
    let e = owner.request("expose", both, &[]).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    // A request outside the schema (api::Request) is refused, naming what
    // is wrong, and the connection goes on.
    let e = owner
        .request("expose", serde_json::json!({"buffer": dst.id}), &[])
        .await
        .unwrap_err();
    assert_eq!(e.reason, rcp::proto::Reason::Invalid, "{e}");
    assert!(e.message.contains("missing field `name`"), "{e}");
    let e = owner
        .request("frob", serde_json::json!({}), &[])
        .await
        .unwrap_err();
    assert!(e.message.contains("unknown variant `frob`"), "{e}");
    let h = writer
        .write(&src, &addr, "rust0", &[(0, 8192, 4096)], None)
        .await
        .unwrap();
    let e = writer.wait(h).await.unwrap_err();
    assert_eq!(
        ServiceReason::of(e.reason).name(),
        "invalid",
        "only [0, 4096) is exposed now: {e}"
    );
    // Another service's name is refused.
    let e = writer
        .expose(&src, "rust0", 0, 4096, "rw", &[])
        .await
        .unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "permission", "{e}");
    owner.request("expose", f("len"), &[]).await.unwrap();
    owner
        .expose(&dst, "rust0", 0, 2 << 20, "rw", &[])
        .await
        .unwrap();
    // The writer's rcpd as it is dialed (here rcpd itself), not a bare IP.
    assert_eq!(ev["peer"], addr.as_str(), "{ev}");
    assert_eq!(ev["ranges"][0][0], 1 << 20, "{ev}");

    // Read it back into another range of the writer's buffer.
    let h = writer
        .read(&src, &addr, "rust0", &[(1 << 20, 1 << 20, 1 << 20)])
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 1 << 20);
    let mut back = vec![0u8; 1 << 20];
    assert!(src.local.read_at(1 << 20, &mut back));
    assert!(back == data, "the read landed the same bytes");

    let h = writer
        .write(&src, &addr, "nope", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    let e = writer.wait(h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "not_found", "{e}");

    drop((owner, writer));
    d.stop().await;
    assert!(!sock.exists(), "rcpd removes its socket when it stops");
}

/// One write through `write_many`, waited for; its handle.
async fn hs_last(
    c: &ServiceClient,
    op: &impl Fn(u64, u64, u64) -> rcp::control::buffers::api::OpRequest,
) -> u64 {
    let h = c.start_many(true, vec![op(9, 0, 0)]).await.unwrap();
    assert_eq!(
        c.wait_all(h.clone()).await.unwrap()[0].state,
        OpStateName::Done
    );
    h[0]
}

/// `write_many` / `read_many` / `wait_all`: many operations in one request
/// each, every byte where it belongs; an operation that cannot start fails
/// the request, naming it, and none of the others starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_operations_start_and_end_in_one_request_each() {
    const OPS: u64 = 64;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(OPS * LEN).await.unwrap();
    owner
        .expose(&dst, "many", 0, OPS * LEN, "rw", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(2 * OPS * LEN).await.unwrap();
    let data: Vec<u8> = (0..OPS * LEN).map(|i| (i * 13 + 5) as u8).collect();
    assert!(src.local.write_at(0, &data));
    // Op i writes the writer's page i to the owner's page OPS-1-i.
    let op = |i: u64, local: u64, remote: u64| {
        one_op(
            src.id,
            &addr,
            "many",
            (local, remote, LEN),
            format!("op {i}"),
        )
    };
    let writes: Vec<OpRequest> = (0..OPS)
        .map(|i| op(i, i * LEN, (OPS - 1 - i) * LEN))
        .collect();
    let hs = writer.start_many(true, writes).await.unwrap();
    assert_eq!(hs.len() as u64, OPS);
    let st = writer.wait_all(hs.clone()).await.unwrap();
    assert_eq!(st.len() as u64, OPS);
    for (s, h) in st.iter().zip(&hs) {
        assert_eq!(
            (s.handle, s.state, s.bytes),
            (*h, OpStateName::Done, Some(LEN)),
            "{s:?}"
        );
    }
    let mut got = vec![0u8; (OPS * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    for i in 0..OPS {
        let (a, b) = ((i * LEN) as usize, ((OPS - 1 - i) * LEN) as usize);
        assert!(
            got[b..b + LEN as usize] == data[a..a + LEN as usize],
            "page {i}"
        );
    }
    // Read them all back, in place, into the second half.
    let reads: Vec<OpRequest> = (0..OPS)
        .map(|i| op(i, (OPS + i) * LEN, (OPS - 1 - i) * LEN))
        .collect();
    let hs = writer.start_many(false, reads).await.unwrap();
    let st = writer.wait_all(hs).await.unwrap();
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    let mut back = vec![0u8; (OPS * LEN) as usize];
    assert!(src.local.read_at(OPS * LEN, &mut back));
    assert!(back == data, "the reads landed the same bytes");
    // One prepared list, each descriptor its own operation: the writer's
    // pages in order onto the owner's, a handle and a result each.
    let each = OpRequest {
        descs: (0..OPS)
            .map(|i| Desc {
                local: i * LEN,
                remote: i * LEN,
                len: LEN,
            })
            .collect(),
        ..op(0, 0, 0)
    };
    let hs = writer.start_each(true, each).await.unwrap();
    assert_eq!(hs.len() as u64, OPS);
    let after = hs[hs.len() - 1] + 1;
    let st = writer.wait_all(hs).await.unwrap();
    assert!(
        st.iter()
            .all(|s| (s.state, s.bytes) == (OpStateName::Done, Some(LEN))),
        "{st:?}"
    );
    assert!(dst.local.read_at(0, &mut got));
    assert!(got == data, "each descriptor's page landed in place");
    // Started and waited for in one request (wait): the final states back,
    // a handle each after the list's before, the pages where they belong.
    let rev = OpRequest {
        descs: (0..OPS)
            .map(|i| Desc {
                local: i * LEN,
                remote: (OPS - 1 - i) * LEN,
                len: LEN,
            })
            .collect(),
        ..op(0, 0, 0)
    };
    let st = writer.run_each(true, rev).await.unwrap();
    let want: Vec<_> = (after..after + OPS)
        .map(|h| (h, OpStateName::Done, Some(LEN)))
        .collect();
    let ran: Vec<_> = st.iter().map(|s| (s.handle, s.state, s.bytes)).collect();
    assert_eq!(ran, want);
    assert!(dst.local.read_at(0, &mut got));
    for i in 0..OPS {
        let (a, b) = ((i * LEN) as usize, ((OPS - 1 - i) * LEN) as usize);
        assert!(
            got[b..b + LEN as usize] == data[a..a + LEN as usize],
            "page {i}"
        );
    }
    let reads: Vec<OpRequest> = (0..OPS).map(|i| op(i, (OPS + i) * LEN, i * LEN)).collect();
    let st = writer.run_many(false, reads).await.unwrap();
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    assert!(src.local.read_at(OPS * LEN, &mut back));
    assert!(
        back == got,
        "the reads in one request landed the owner's pages"
    );
    // One bad op (no such buffer) after a good one: refused, named, and
    // the good one did not start (no operation took the next handle: a
    // connection numbers its operations in order).
    let last = hs_last(&writer, &op).await;
    let mut bad = vec![op(0, 0, 0), op(1, LEN, LEN)];
    bad[1].buffer = 999;
    let e = writer.start_many(true, bad).await.unwrap_err();
    assert!(e.message.contains("operation 1"), "{e}");
    assert!(e.message.contains("no buffer 999"), "{e}");
    let e = writer.status(last + 1).await.unwrap_err();
    assert!(
        e.message.contains(&format!("no operation {}", last + 1)),
        "{e}"
    );
    // wait_all of a handle that does not exist: refused.
    let e = writer.wait_all(vec![12345]).await.unwrap_err();
    assert!(e.message.contains("no operation 12345"), "{e}");
    // The writer heard a `done` event per operation, each sent before its
    // reply; a connection that said done_events false hears none.
    let ev = writer.next_event().await.unwrap();
    assert_eq!(ev["event"], "done", "{ev}");
    let quiet = ServiceClient::connect_with(Some(&sock), None, false)
        .await
        .unwrap();
    let qsrc = quiet.create_buffer(OPS * LEN).await.unwrap();
    let qop = |i: u64| OpRequest {
        buffer: qsrc.id,
        ..op(i, i * LEN, i * LEN)
    };
    let hs = quiet
        .start_many(true, (0..OPS).map(qop).collect())
        .await
        .unwrap();
    let st = quiet.wait_all(hs).await.unwrap();
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    let none = tokio::time::timeout(Duration::from_millis(500), quiet.next_event()).await;
    assert!(none.is_err(), "no event: {none:?}");
    drop((owner, writer, quiet));
    d.stop().await;
}

/// The owner's next event (it starts no operations: no `done` events).
#[cfg(feature = "fault-injection")]
async fn owner_event(owner: &ServiceClient) -> serde_json::Value {
    tokio::time::timeout(Duration::from_secs(60), owner.next_event())
        .await
        .expect("the owner's event")
        .expect("the owner's connection is open")
}

/// Damaged ranges (the injected fault of the `fault-injection` feature,
/// one byte flipped before the check) are granted again and moved again, up to the retry
/// bound of the handshake (3), for writes (damage found by the exposing
/// rcpd) and reads (found by the reader); a range damaged every time fails
/// `integrity` after the bound, and the owner's event says so.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_ranges_move_again_up_to_the_retry_bound() {
    use rcp::control::buffers::faults::corrupt_ranges;
    use rcp::control::protocol::negotiate::DEFAULT_MAX_RETRIES;
    assert_eq!(DEFAULT_MAX_RETRIES, 3, "the counts below assume 3");
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    const MIB: u64 = 1 << 20;
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(4 * MIB).await.unwrap();
    owner
        .expose(&dst, "damaged-w", 0, 2 * MIB, "write", &[])
        .await
        .unwrap();
    owner
        .expose(&dst, "damaged-r", 2 * MIB, 2 * MIB, "read", &[])
        .await
        .unwrap();
    let data: Vec<u8> = (0..(2 * MIB as u32)).map(|i| (i * 13 + 5) as u8).collect();
    assert!(dst.local.write_at(2 * MIB, &data));

    let peer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = peer.create_buffer(4 * MIB).await.unwrap();
    assert!(src.local.write_at(0, &data));

    // Write: both ranges damaged once (round 0), then intact.
    corrupt_ranges("damaged-w", 2);
    let descs = [(0, 0, MIB), (MIB, MIB, MIB)];
    let h = peer
        .write(&src, &addr, "damaged-w", &descs, None)
        .await
        .unwrap();
    assert_eq!(peer.wait(h).await.unwrap(), 2 * MIB);
    let ev = owner_event(&owner).await;
    assert_eq!(ev["event"], "written", "{ev}");
    assert_eq!(ev["resent"], 2, "both ranges moved again: {ev}");
    assert!(ev.get("error").is_none(), "{ev}");
    let mut got = vec![0u8; 2 * MIB as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got == data, "the owner's buffer holds the writer's bytes");

    // One range damaged in rounds 0, 1 and 2: the third resend lands.
    corrupt_ranges("damaged-w", 3);
    let h = peer
        .write(&src, &addr, "damaged-w", &[(0, 0, MIB)], None)
        .await
        .unwrap();
    assert_eq!(peer.wait(h).await.unwrap(), MIB);
    let ev = owner_event(&owner).await;
    assert_eq!(ev["resent"], 3, "{ev}");
    assert!(ev.get("error").is_none(), "{ev}");

    // Damaged every time: integrity after the bound, on both ends.
    corrupt_ranges("damaged-w", u32::MAX);
    let h = peer
        .write(&src, &addr, "damaged-w", &[(0, 0, MIB)], None)
        .await
        .unwrap();
    let e = peer.wait(h).await.unwrap_err();
    corrupt_ranges("damaged-w", 0);
    assert_eq!(ServiceReason::of(e.reason).name(), "integrity", "{e}");
    assert!(e.message.contains("after 3 resends"), "{e}");
    let ev = owner_event(&owner).await;
    assert_eq!(ev["resent"], 3, "{ev}");
    assert_eq!(ev["error"]["reason"], "integrity", "{ev}");

    // Read: both ranges damaged once on the reader, then read again.
    corrupt_ranges("damaged-r", 2);
    let descs = [(2 * MIB, 2 * MIB, MIB), (3 * MIB, 3 * MIB, MIB)];
    let h = peer.read(&src, &addr, "damaged-r", &descs).await.unwrap();
    assert_eq!(peer.wait(h).await.unwrap(), 2 * MIB);
    let mut back = vec![0u8; 2 * MIB as usize];
    assert!(src.local.read_at(2 * MIB, &mut back));
    assert!(back == data, "the read landed the owner's bytes");
    let ev = owner_event(&owner).await;
    assert_eq!(ev["event"], "read", "{ev}");
    assert_eq!(ev["resent"], 2, "{ev}");
    assert!(ev.get("error").is_none(), "{ev}");

    corrupt_ranges("damaged-r", u32::MAX);
    let h = peer
        .read(&src, &addr, "damaged-r", &[(2 * MIB, 2 * MIB, MIB)])
        .await
        .unwrap();
    let e = peer.wait(h).await.unwrap_err();
    corrupt_ranges("damaged-r", 0);
    assert_eq!(ServiceReason::of(e.reason).name(), "integrity", "{e}");
    assert!(e.message.contains("after 3 re-reads"), "{e}");
    let ev = owner_event(&owner).await;
    assert_eq!(ev["resent"], 3, "{ev}");
    assert_eq!(ev["error"]["reason"], "integrity", "{ev}");

    drop((owner, peer));
    d.stop().await;
}

/// Writes of one request under a standing grant go together
/// (`peer::run_group`); one the owner's rcpd finds damaged goes on alone
/// from its next round, its rounds together counted toward the retry
/// bound (3): damaged in four rounds it fails `integrity`, as a write on
/// its own does; in three, the last resend lands. The others of its
/// request end as they were.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grouped_write_found_damaged_goes_on_within_the_retry_bound() {
    use rcp::control::buffers::faults::corrupt_ranges;
    use rcp::control::protocol::negotiate::DEFAULT_MAX_RETRIES;
    assert_eq!(DEFAULT_MAX_RETRIES, 3, "the counts below assume 3");
    const OPS: u64 = 8;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(OPS * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "dmg-st", 0, OPS * LEN, "write", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect_with(Some(&sock), None, false)
        .await
        .unwrap();
    let src = writer.create_buffer(OPS * LEN).await.unwrap();
    let data: Vec<u8> = (0..OPS * LEN).map(|i| (i * 29 + 3) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let op = |i: u64| {
        one_op(
            src.id,
            &addr,
            "dmg-st",
            (i * LEN, i * LEN, LEN),
            format!("op {i}"),
        )
    };
    let run = |n: u64| {
        let (writer, op) = (&writer, &op);
        async move {
            let hs = writer
                .start_many(true, (0..n).map(op).collect())
                .await
                .unwrap();
            writer.wait_all(hs).await.unwrap()
        }
    };
    // The session takes the standing grant; from then on a request's
    // writes go together.
    let st = run(OPS).await;
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    for _ in 0..OPS {
        assert_eq!(owner_event(&owner).await["resent"], 0);
    }

    // One range of the request damaged once: its write goes on alone and
    // lands, the others are done together.
    corrupt_ranges("dmg-st", 1);
    let st = run(OPS).await;
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    let mut resent = Vec::new();
    for _ in 0..OPS {
        let ev = owner_event(&owner).await;
        assert!(ev.get("error").is_none(), "{ev}");
        resent.push(ev["resent"].as_u64().unwrap());
    }
    resent.sort_unstable();
    assert_eq!(resent, [0, 0, 0, 0, 0, 0, 0, 1]);

    // Damaged in rounds 0 (together), 1 and 2: the third resend lands.
    corrupt_ranges("dmg-st", 3);
    let st = run(1).await;
    assert_eq!(st[0].state, OpStateName::Done, "{st:?}");
    let ev = owner_event(&owner).await;
    assert_eq!(ev["resent"], 3, "{ev}");
    assert!(ev.get("error").is_none(), "{ev}");

    // Damaged in four rounds: past the bound, whatever went together.
    corrupt_ranges("dmg-st", 4);
    let st = run(1).await;
    corrupt_ranges("dmg-st", 0);
    let f = st[0].failure.as_ref().expect("a failure");
    assert_eq!(f.reason.name(), "integrity", "{f:?}");
    assert!(f.message.contains("after 3 resends"), "{f:?}");
    let ev = owner_event(&owner).await;
    assert_eq!(ev["resent"], 3, "{ev}");
    assert_eq!(ev["error"]["reason"], "integrity", "{ev}");
    let mut got = vec![0u8; (OPS * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got == data, "the owner's buffer holds the writer's bytes");

    drop((owner, writer));
    d.stop().await;
}

/// A buffer operation to a peer rcpd does not list is refused naming
/// --copy-peers (rcpd's token and certificate would go there), and no
/// connection reaches that peer; rcpd itself stays reachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_to_an_unlisted_peer_is_refused_before_any_connection() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let sock = dir.path().join("rcpd.sock");
    let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stranger_addr = stranger.local_addr().unwrap().to_string();
    stranger.set_nonblocking(true).unwrap();
    let mut cfg = config(&root, &sock);
    // A list that names another port of the stranger's address only.
    cfg.copy_peers = vec!["127.0.0.1:1".parse().unwrap()];
    let d = Daemon::start(cfg).await;
    let addr = d.addr.clone();
    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(1 << 20).await.unwrap();
    let h = writer
        .write(&src, &stranger_addr, "kv", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    let e = writer.wait(h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "permission", "{e}");
    assert!(
        e.message.contains("--copy-peers") && e.message.contains(&stranger_addr),
        "{e}"
    );
    assert!(
        matches!(stranger.accept(), Err(ref x) if x.kind() == std::io::ErrorKind::WouldBlock),
        "the unlisted peer was connected to"
    );
    // rcpd itself is no peer of the list, and still reachable: an unknown
    // name there is not_found, not permission.
    let h = writer
        .write(&src, &addr, "nope", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    let e = writer.wait(h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "not_found", "{e}");
    drop(writer);
    d.stop().await;
}

/// Sessions rcpd closed for `--session-grace` (opened, no work started).
fn grace_closed(metrics: std::net::SocketAddr) -> u64 {
    let m = common::metrics::scrape(&format!("http://{metrics}/metrics"));
    common::metrics::sample(&m, "rcpd_client_limits_total{reason=\"session_grace\"}")
        .unwrap_or_else(|| panic!("no session_grace count in {m}")) as u64
}

/// A session kept for buffer operations is at work: the exposing rcpd does
/// not close it under `--session-grace` (for sessions that never start),
/// and an operation after a quiet time longer than the grace uses it. The
/// sweep is proved to have run by a bare session opened after the buffer
/// session's last grant, which it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_session_outlives_the_session_grace() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.session_grace = Duration::from_millis(500);
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let d = Daemon::start(cfg).await;
    let (addr, metrics) = (d.addr.clone(), d.bound.metrics.unwrap());
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&dst, "graced", 0, 2 << 20, "write", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(2 << 20).await.unwrap();
    let h = writer
        .write(&src, &addr, "graced", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 4096);
    assert_eq!(grace_closed(metrics), 0);

    let probe = rcp::control::Client::connect(
        &addr,
        rcp::control::ClientOptions {
            transport: Transport::Tcp,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let bare = probe.session().await.unwrap();
    // Hang guard only: the sweep runs every quarter second.
    let t0 = std::time::Instant::now();
    while grace_closed(metrics) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(600), "no sweep");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        grace_closed(metrics),
        1,
        "the sweep closed the bare session only, not the buffer session"
    );
    let h = writer
        .write(&src, &addr, "graced", &[(4096, 4096, 4096)], None)
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 4096);
    assert_eq!(grace_closed(metrics), 1);

    drop((bare, probe, owner, writer));
    d.stop().await;
}

/// A raw BufferGrant of `name`'s first 4 KiB on session `session_id`.
fn first_page(
    session_id: u64,
    name: &str,
    access: rcp::proto::BufferAccess,
) -> rcp::proto::BufferGrantRequest {
    rcp::proto::BufferGrantRequest {
        session_id,
        name: name.into(),
        access: access as i32,
        ranges: vec![rcp::proto::BufferRange {
            offset: 0,
            len: 4096,
        }],
        message: String::new(),
        node: String::new(),
        standing_ok: false,
    }
}

/// A grant dies with the session it was made to: after CloseSession its
/// BufferDone finds it revoked, where one made and done on the same open
/// session ends normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_session_revokes_its_buffer_grants() {
    use rcp::proto::{self, rcp_client::RcpClient};
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let buf = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&buf, "held", 0, 2 << 20, "read", &[])
        .await
        .unwrap();

    let mut c = RcpClient::connect(format!("http://{}", d.addr))
        .await
        .unwrap();
    let hs = c
        .handshake(common::raw::hello(ProviderKind::Tcp, 1 << 20))
        .await
        .unwrap()
        .into_inner();
    let session_id = hs.session_id;
    let grant = |c: &mut RcpClient<_>| {
        let mut c = c.clone();
        async move {
            c.buffer_grant(first_page(session_id, "held", proto::BufferAccess::Read))
                .await
                .unwrap()
                .into_inner()
                .grant
        }
    };
    let done = |grant: u64| proto::BufferDoneRequest {
        session_id,
        grant,
        ..Default::default()
    };
    let g = grant(&mut c).await;
    c.buffer_done(done(g)).await.expect("a live grant's done");

    let g = grant(&mut c).await;
    c.close_session(proto::CloseSessionRequest { session_id })
        .await
        .unwrap();
    let e = c.buffer_done(done(g)).await.unwrap_err();
    assert!(e.message().contains("not live"), "{e:?}");

    drop(owner);
    d.stop().await;
}

/// A grant's round is the exposer's core's: a BufferDone naming another
/// round (late, repeated) is refused and changes nothing, and a grant
/// whose peer then says nothing is revoked at rcpd's timeout (the range it
/// held exclusively is free again for the next writer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_done_changes_nothing_and_a_silent_peers_grant_is_revoked() {
    use rcp::proto::{self, rcp_client::RcpClient};
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.timeout = Duration::from_secs(1);
    let d = Daemon::start(cfg).await;
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let buf = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&buf, "slow", 0, 2 << 20, "rw", &[])
        .await
        .unwrap();

    let mut c = RcpClient::connect(format!("http://{}", d.addr))
        .await
        .unwrap();
    let hs = c
        .handshake(common::raw::hello(ProviderKind::Tcp, 1 << 20))
        .await
        .unwrap()
        .into_inner();
    let session_id = hs.session_id;
    let grant = |c: &mut RcpClient<_>, access: proto::BufferAccess| {
        let mut c = c.clone();
        async move { c.buffer_grant(first_page(session_id, "slow", access)).await }
    };
    let done = |grant: u64, round: u32| proto::BufferDoneRequest {
        session_id,
        grant,
        round: Some(round),
        ..Default::default()
    };

    // A read's grant in round 0: a BufferDone for round 1 is refused, and
    // the grant still ends normally with round 0's.
    let g = grant(&mut c, proto::BufferAccess::Read)
        .await
        .unwrap()
        .into_inner()
        .grant;
    let e = c.buffer_done(done(g, 1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
    assert!(e.message().contains("round 1 of grant"), "{e:?}");
    c.buffer_done(done(g, 0))
        .await
        .expect("round 0's BufferDone after a stale one");

    // A write's grant, then silence: the range is held (a second writer is
    // told to retry) until the timeout revokes the grant.
    let held = grant(&mut c, proto::BufferAccess::Write)
        .await
        .unwrap()
        .into_inner()
        .grant;
    let busy = grant(&mut c, proto::BufferAccess::Write).await.unwrap_err();
    assert_eq!(busy.code(), tonic::Code::Unavailable, "{busy:?}");
    let start = std::time::Instant::now();
    let next = loop {
        // A guard against a hang only; the timeout is 1 s.
        assert!(start.elapsed() < Duration::from_secs(120), "never revoked");
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(g) = grant(&mut c, proto::BufferAccess::Write).await {
            break g.into_inner().grant;
        }
    };
    let e = c.buffer_done(done(held, 0)).await.unwrap_err();
    assert!(e.message().contains("not live"), "{e:?}");
    assert_ne!(next, held);

    drop(owner);
    d.stop().await;
}

/// Where the initiating side of buffer operations logs: its operations
/// and its sessions to peers.
const PEER_LOG: [&str; 5] = [
    "rcp::control::buffers",
    "rcp::control::buffers::service",
    "rcp::control::buffers::peer",
    "rcp::control::buffers::sessions",
    "rcp::control::buffers::standing",
];

/// An event [`PEER_LOG`] logged: its message and fields.
#[derive(Clone, Debug, Default)]
struct Logged {
    /// `INFO`, `WARN`, ...
    level: String,
    message: String,
    fields: HashMap<&'static str, String>,
}

impl tracing::field::Visit for Logged {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        let v = format!("{v:?}");
        match f.name() {
            "message" => self.message = v,
            name => {
                self.fields.insert(name, v);
            }
        }
    }
}

/// Keeps what [`PEER_LOG`] logs at info and above.
struct Record(Arc<Mutex<Vec<Logged>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Record {
    fn enabled(
        &self,
        m: &tracing::Metadata<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        PEER_LOG.contains(&m.target()) && *m.level() <= tracing::Level::INFO
    }

    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut l = Logged {
            level: e.metadata().level().to_string(),
            ..Logged::default()
        };
        e.record(&mut l);
        self.0.lock().unwrap().push(l);
    }
}

/// What [`PEER_LOG`] logged about `peer`, in order, since the first call
/// (which installs the recorder, for every rcpd of this test binary).
fn peer_log(peer: &str) -> Vec<Logged> {
    // rcpd quotes the address (rcp::escape::esc).
    let quoted = format!("\"{peer}\"");
    logged(|l| l.fields.get("peer") == Some(&quoted))
}

/// What [`PEER_LOG`] logged that `which`, in order (the first call installs
/// the recorder, for every rcpd of this test binary).
fn logged(which: impl Fn(&Logged) -> bool) -> Vec<Logged> {
    let log = recorded().lock().unwrap();
    log.iter().filter(|l| which(l)).cloned().collect()
}

/// The recorder's lines, installed at the first call.
fn recorded() -> &'static Mutex<Vec<Logged>> {
    static LOG: OnceLock<Arc<Mutex<Vec<Logged>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        use tracing_subscriber::layer::SubscriberExt;
        let log = Arc::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(Record(Arc::clone(&log))),
        )
        .expect("no other subscriber in this test binary");
        log
    })
}

/// Forget what was logged about `peer`: an rcpd now listening there on a
/// port the kernel chose is new (an earlier test's rcpd may have had the
/// same port).
fn forget_peer(peer: &str) {
    let quoted = format!("\"{peer}\"");
    recorded()
        .lock()
        .unwrap()
        .retain(|l| l.fields.get("peer") != Some(&quoted));
}

/// The ids of the sessions opened to `peer` for buffer operations, and the
/// (session, error) of those given up on the peer's `retryable`.
fn peer_sessions(peer: &str) -> (Vec<String>, Vec<(String, String)>) {
    let log = peer_log(peer);
    let field = |l: &Logged, f: &str| l.fields.get(f).cloned().unwrap_or_default();
    let opened = log
        .iter()
        .filter(|l| l.message == "buffer session to a peer")
        .map(|l| field(l, "session"))
        .collect();
    let given_up = log
        .iter()
        .filter(|l| l.message == "buffer session given up: a new one")
        .map(|l| (field(l, "session"), field(l, "error")))
        .collect();
    (opened, given_up)
}

/// A service on `sock`'s rcpd exposing a buffer of 1 MiB as `name`, for
/// writes.
async fn exposed(
    sock: &std::path::Path,
    name: &str,
) -> (ServiceClient, rcp::control::buffers::client::Buffer) {
    let owner = ServiceClient::connect(Some(sock), None).await.unwrap();
    let buf = owner.create_buffer(1 << 20).await.unwrap();
    owner
        .expose(&buf, name, 0, 1 << 20, "write", &[])
        .await
        .unwrap();
    (owner, buf)
}

/// A hang guard only: nothing here takes near this long.
const HANG_GUARD: Duration = Duration::from_secs(300);

/// Operation `h`'s end, bounded by [`HANG_GUARD`].
async fn ended(c: &ServiceClient, h: u64) -> Result<u64, rcp::control::buffers::Failure> {
    tokio::time::timeout(HANG_GUARD, c.wait(h))
        .await
        .expect("the operation ended")
}

/// What [`PEER_LOG`] said about `peer` with `message`, counted.
fn peer_said(peer: &str, message: &str) -> usize {
    peer_log(peer)
        .iter()
        .filter(|l| l.message == message)
        .count()
}

/// Two peer rcpds (A, B) and an initiating one that may dial both, its
/// sessions to peers kept by `pool`, its `/metrics` served.
struct Three {
    a: Daemon,
    a_sock: std::path::PathBuf,
    b: Daemon,
    b_sock: std::path::PathBuf,
    init: Daemon,
    init_sock: std::path::PathBuf,
    init_root: std::path::PathBuf,
}

async fn three(dir: &std::path::Path, pool: rcp::control::jobs::PoolConfig) -> Three {
    let mk = |n: &str| {
        let d = dir.join(n);
        std::fs::create_dir(&d).unwrap();
        d
    };
    let (a_dir, b_dir, init_dir) = (mk("a"), mk("b"), mk("init"));
    let (a, a_sock) = start_rcpd(&a_dir).await;
    let (b, b_sock) = start_rcpd(&b_dir).await;
    // The recorder is installed at the first look.
    assert!(peer_log(&a.addr).is_empty() && peer_log(&b.addr).is_empty());
    let init_root = init_dir.join("root");
    std::fs::create_dir(&init_root).unwrap();
    let init_sock = init_dir.join("rcpd.sock");
    let mut cfg = config(&init_root, &init_sock);
    cfg.copy_peers = vec![a.addr.parse().unwrap(), b.addr.parse().unwrap()];
    cfg.copy_pool = pool;
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let init = Daemon::start(cfg).await;
    Three {
        a,
        a_sock,
        b,
        b_sock,
        init,
        init_sock,
        init_root,
    }
}

/// Sessions to peer rcpds follow Copy's warm-session policy: one unused
/// for `--copy-session-idle` is closed (the next operation opens a new
/// one), and with `--copy-sessions` of them kept, opening another closes
/// the one unused longest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_sessions_expire_when_idle_and_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let pool = rcp::control::jobs::PoolConfig {
        idle: Duration::from_millis(300),
        max: 1,
    };
    let Three {
        a,
        a_sock,
        b,
        b_sock,
        init,
        init_sock,
        ..
    } = three(dir.path(), pool).await;
    let (_oa, _da) = exposed(&a_sock, "a").await;
    let (_ob, _db) = exposed(&b_sock, "b").await;
    let writer = ServiceClient::connect(Some(&init_sock), None)
        .await
        .unwrap();
    let src = writer.create_buffer(1 << 20).await.unwrap();
    let write = |peer: String, name: &'static str| {
        let (w, s) = (&writer, &src);
        async move {
            let h = w
                .write(s, &peer, name, &[(0, 0, 4096)], None)
                .await
                .unwrap();
            assert_eq!(ended(w, h).await.unwrap(), 4096);
        }
    };
    const OPENED: &str = "buffer session to a peer";
    const IDLE: &str = "buffer session closed: unused for --copy-session-idle";
    const ROOM: &str = "buffer session closed: more sessions than --copy-sessions";

    write(a.addr.clone(), "a").await;
    assert_eq!(peer_said(&a.addr, OPENED), 1);
    // A buffer session maps no staging (a copy's maps eight windows): it
    // posts from the services' pages only.
    let opened = peer_log(&a.addr);
    assert_eq!(
        opened[0].fields.get("windows").map(String::as_str),
        Some("0"),
        "{opened:?}"
    );
    let start = std::time::Instant::now();
    while peer_said(&a.addr, IDLE) == 0 {
        assert!(
            start.elapsed() < HANG_GUARD,
            "the idle session was never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    write(a.addr.clone(), "a").await;
    assert_eq!(
        peer_said(&a.addr, OPENED),
        2,
        "a new session after the idle one closed"
    );

    // At most one kept: B's session closes A's (unused) one at once.
    write(b.addr.clone(), "b").await;
    assert_eq!(peer_said(&b.addr, OPENED), 1);
    assert_eq!(peer_said(&a.addr, ROOM), 1, "{:?}", peer_log(&a.addr));

    drop(writer);
    init.stop().await;
    a.stop().await;
    b.stop().await;
}

/// One bound for Copy's warm sessions and buffer sessions (one pool of
/// sessions to peers, `--copy-sessions`): a Copy's session kept warm takes
/// the room of an unused buffer session, and the next buffer session the
/// warm one's. (No session goes idle here: `--copy-session-idle` is long.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_and_buffer_sessions_share_one_bound() {
    let dir = tempfile::tempdir().unwrap();
    let pool = rcp::control::jobs::PoolConfig {
        idle: HANG_GUARD,
        max: 1,
    };
    let Three {
        a,
        b,
        b_sock,
        init,
        init_sock,
        init_root,
        ..
    } = three(dir.path(), pool).await;
    let (_ob, _db) = exposed(&b_sock, "b").await;
    let writer = ServiceClient::connect(Some(&init_sock), None)
        .await
        .unwrap();
    let src = writer.create_buffer(1 << 20).await.unwrap();
    let write = || async {
        let h = writer
            .write(&src, &b.addr, "b", &[(0, 0, 4096)], None)
            .await
            .unwrap();
        assert_eq!(ended(&writer, h).await.unwrap(), 4096);
    };
    const OPENED: &str = "buffer session to a peer";
    const ROOM: &str = "buffer session closed: more sessions than --copy-sessions";
    write().await;
    assert_eq!(peer_said(&b.addr, OPENED), 1);

    // One bound for Copy's warm sessions and buffer sessions: a Copy's
    // session kept warm closes B's (unused) buffer session, and the next
    // buffer session closes the warm one.
    std::fs::write(init_root.join("f"), vec![7u8; 100_000]).unwrap();
    let c = rcp::control::Client::connect(&init.addr, rcp::control::ClientOptions::default())
        .await
        .unwrap();
    let mut s = c
        .copy(rcp::proto::CopyRequest {
            direction: rcp::proto::Direction::Push as i32,
            local_path: "f".into(),
            remote: a.addr.clone(),
            remote_path: "f".into(),
            transport: "tcp".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut last = None;
    while let Some(p) = s.message().await.unwrap() {
        last = Some(p);
    }
    let p = last.expect("the Copy's last progress");
    assert!(p.done && p.error.is_empty(), "{p:?}");
    let url = format!("http://{}/metrics", init.bound.metrics.unwrap());
    let warm = || {
        let text = common::metrics::scrape(&url);
        common::metrics::sample(&text, "rcpd_copy_sessions_warm")
    };
    assert_eq!(warm(), Some(1.0), "the Copy's session is kept warm");
    assert_eq!(
        peer_said(&b.addr, ROOM),
        1,
        "the warm session took B's buffer session's room: {:?}",
        peer_log(&b.addr)
    );
    write().await;
    assert_eq!(peer_said(&b.addr, OPENED), 2);
    assert_eq!(
        warm(),
        Some(0.0),
        "the buffer session took the warm one's room"
    );

    drop(writer);
    init.stop().await;
    a.stop().await;
    b.stop().await;
}

/// A kept buffer session the peer rcpd no longer holds (it restarted on its
/// address: its sessions are gone, the exposure is made again) is given up
/// on the peer's `retryable` and the grant asked for once more on a new
/// session: the next operation succeeds. The initiator's tcp channel may
/// see the peer's connections close, but an idle channel fails nothing
/// before its next post and the grant comes before any: the data path is
/// still up, and the grant's answer is what gives the session up. The
/// given-up session is the one the first operation opened, for the peer's
/// unknown session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_the_peer_no_longer_holds_is_made_anew() {
    let dir = tempfile::tempdir().unwrap();
    let (peer_dir, init_dir) = (dir.path().join("peer"), dir.path().join("init"));
    std::fs::create_dir(&peer_dir).unwrap();
    std::fs::create_dir(&init_dir).unwrap();
    let (peer, peer_sock) = start_rcpd(&peer_dir).await;
    let peer_addr = peer.addr.clone();
    assert!(peer_sessions(&peer_addr).0.is_empty());
    let init_root = init_dir.join("root");
    std::fs::create_dir(&init_root).unwrap();
    let init_sock = init_dir.join("rcpd.sock");
    let mut cfg = config(&init_root, &init_sock);
    cfg.copy_peers = vec![peer_addr.parse().unwrap()];
    let init = Daemon::start(cfg).await;

    let (owner, dst) = exposed(&peer_sock, "kept").await;
    let writer = ServiceClient::connect(Some(&init_sock), None)
        .await
        .unwrap();
    let src = writer.create_buffer(1 << 20).await.unwrap();
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 11 + 1) as u8).collect();
    assert!(src.local.write_at(0, &data));
    const LEN: u64 = 64 << 10;
    let h = writer
        .write(&src, &peer_addr, "kept", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    let mut got = vec![0u8; LEN as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got[..] == data[..LEN as usize], "the first write landed");
    let (opened, given_up) = peer_sessions(&peer_addr);
    assert_eq!(opened.len(), 1, "one session to the peer: {opened:?}");
    assert!(given_up.is_empty(), "{given_up:?}");

    // The peer restarts on its address: it holds no session now, the
    // initiator still keeps its own.
    drop((owner, dst));
    peer.stop().await;
    let mut cfg = config(&peer_dir.join("root"), &peer_sock);
    cfg.listen = peer_addr.parse().unwrap();
    let peer = Daemon::start(cfg).await;
    assert_eq!(peer.addr, peer_addr);
    let (owner, dst) = exposed(&peer_sock, "kept").await;

    let h = writer
        .write(&src, &peer_addr, "kept", &[(LEN, LEN, LEN)], None)
        .await
        .unwrap();
    assert_eq!(
        ended(&writer, h)
            .await
            .expect("the write after the restart"),
        LEN
    );
    assert!(dst.local.read_at(LEN, &mut got));
    assert!(
        got[..] == data[LEN as usize..2 * LEN as usize],
        "the second write landed"
    );
    let (opened, given_up) = peer_sessions(&peer_addr);
    assert_eq!(given_up.len(), 1, "{given_up:?}");
    let (session, error) = &given_up[0];
    assert_eq!(session, &opened[0], "the first session was given up");
    assert!(error.contains("unknown session"), "{error}");
    assert_eq!(opened.len(), 2, "a new session after it: {opened:?}");
    assert_ne!(opened[1], opened[0]);

    drop((owner, dst, writer, src));
    init.stop().await;
    peer.stop().await;
}

/// Wait until the byte at `at` of `buf` is not zero (a write's bytes
/// landed there).
async fn landed(buf: &rcp::control::buffers::client::Buffer, at: u64) {
    let mut b = [0u8];
    for _ in 0..600 {
        assert!(buf.local.read_at(at, &mut b));
        if b[0] != 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("nothing landed at {at} in 60 s");
}

/// The owner of one exposure goes away while two operations of one
/// writer are on the same session (held mid-transfer by rcpd's
/// `--bwlimit`): the operation into the gone exposure fails saying so
/// (`not_found`, the exposure gone), not with a bare completion status;
/// the other, whose requests the peer never refused, runs again on a new
/// session and lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposure_gone_mid_write_fails_only_the_write_into_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.bwlimit = Some(1 << 20);
    let d = Daemon::start(cfg).await;
    let addr = d.addr.clone();
    peer_log(&addr);
    const MIB: u64 = 1 << 20;
    let (vsize, osize) = (8 * MIB, 2 * MIB);

    let victim = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let vbuf = victim.create_buffer(vsize).await.unwrap();
    victim
        .expose(&vbuf, "victim", 0, vsize, "write", &[])
        .await
        .unwrap();
    let other = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let obuf = other.create_buffer(osize).await.unwrap();
    other
        .expose(&obuf, "other", 0, osize, "write", &[])
        .await
        .unwrap();

    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(vsize + osize).await.unwrap();
    let data: Vec<u8> = (0..vsize + osize).map(|i| (i % 251 + 1) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let descs = |base: u64, size: u64| -> Vec<(u64, u64, u64)> {
        (0..size)
            .step_by(MIB as usize)
            .map(|o| (base + o, o, MIB))
            .collect()
    };
    // The victim's write; once its first bytes landed (1 MiB/s), the
    // other's on the same session; once another MiB of the victim's landed
    // (the other's grant made long since), the victim's owner goes.
    let hv = writer
        .write(&src, &addr, "victim", &descs(0, vsize), None)
        .await
        .unwrap();
    landed(&vbuf, 0).await;
    let ho = writer
        .write(&src, &addr, "other", &descs(vsize, osize), None)
        .await
        .unwrap();
    landed(&vbuf, 2 * MIB - 1).await;
    for h in [hv, ho] {
        let st = writer.status(h).await.unwrap();
        assert_eq!(st.state, OpStateName::Running, "{st:?}");
    }
    drop((victim, vbuf));

    let e = ended(&writer, hv).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "not_found", "{e}");
    assert!(e.message.contains("\"victim\" is gone"), "{e}");
    assert_eq!(
        ended(&writer, ho).await.unwrap(),
        osize,
        "the other write lands"
    );
    let mut got = vec![0u8; osize as usize];
    assert!(obuf.local.read_at(0, &mut got));
    assert!(
        got[..] == data[vsize as usize..],
        "the other owner has the bytes"
    );
    // It was on the failed session: it ran again on a new one.
    let again: Vec<_> = peer_log(&addr)
        .into_iter()
        .filter(|l| l.message.contains("moves again on a new session"))
        .map(|l| l.fields.get("name").cloned().unwrap_or_default())
        .collect();
    assert_eq!(again, ["\"other\""], "{again:?}");
    drop((writer, other));
    d.stop().await;
}

/// The owner's next event, bounded by [`HANG_GUARD`].
async fn next_event(c: &ServiceClient) -> serde_json::Value {
    tokio::time::timeout(HANG_GUARD, c.next_event())
        .await
        .expect("an event")
        .expect("the connection is open")
}

/// An exposure with standing grants: many writes and reads move under one
/// grant per access (the owner's rcpd grants each once, and the owner
/// hears an event per operation with its message); withdrawn, the next
/// write fails naming the exposure gone and touches nothing; exposed again
/// it serves again; its owner gone, the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_grants_serve_many_operations_until_their_exposure_goes() {
    const OPS: u64 = 32;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let d = Daemon::start(cfg).await;
    let (addr, metrics) = (d.addr.clone(), d.bound.metrics.unwrap());
    peer_log(&addr);
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(OPS * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "st", 0, OPS * LEN, "rw", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect_with(Some(&sock), None, false)
        .await
        .unwrap();
    let src = writer.create_buffer(2 * OPS * LEN).await.unwrap();
    let data: Vec<u8> = (0..OPS * LEN).map(|i| (i * 31 + 7) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let op = |i: u64, local: u64, remote: u64| {
        one_op(src.id, &addr, "st", (local, remote, LEN), format!("op {i}"))
    };
    // Every page written in one request, page i to page OPS - 1 - i.
    let write_all = || {
        let (writer, op) = (&writer, &op);
        async move {
            let writes = (0..OPS)
                .map(|i| op(i, i * LEN, (OPS - 1 - i) * LEN))
                .collect();
            let hs = writer.start_many(true, writes).await.unwrap();
            let st = writer.wait_all(hs).await.unwrap();
            assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
        }
    };
    // Twice over, to see the grant kept between batches.
    for _ in 0..2 {
        write_all().await;
    }
    let mut got = vec![0u8; (OPS * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    for i in 0..OPS {
        let (a, b) = ((i * LEN) as usize, ((OPS - 1 - i) * LEN) as usize);
        assert!(
            got[b..b + LEN as usize] == data[a..a + LEN as usize],
            "page {i}"
        );
    }
    let mut messages = std::collections::BTreeSet::new();
    for _ in 0..2 * OPS {
        let ev = next_event(&owner).await;
        assert_eq!(ev["event"], "written", "{ev}");
        assert_eq!(ev["peer"], addr.as_str(), "{ev}");
        assert_eq!(ev["ranges"][0][1], LEN, "{ev}");
        assert_eq!(ev["ranges"][0][2].as_str().unwrap().len(), 64, "{ev}");
        messages.insert(ev["message"].as_str().unwrap().to_string());
    }
    assert_eq!(messages.len() as u64, OPS, "an event per operation");
    let reads = (0..OPS)
        .map(|i| op(i, (OPS + i) * LEN, (OPS - 1 - i) * LEN))
        .collect();
    let hs = writer.start_many(false, reads).await.unwrap();
    let st = writer.wait_all(hs).await.unwrap();
    assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
    let mut back = vec![0u8; (OPS * LEN) as usize];
    assert!(src.local.read_at(OPS * LEN, &mut back));
    assert!(back == data, "the reads landed the same bytes");
    assert_eq!(next_event(&owner).await["event"], "read");
    // A range past the exposure is refused before anything is posted
    // (the device would refuse it and fail the session).
    let h = writer
        .write(&src, &addr, "st", &[(0, OPS * LEN, LEN)], None)
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    assert!(e.message.contains("outside the exposed"), "{e}");
    // One grant per access for all of them, and every operation told
    // (in batches: as many calls at most).
    assert_eq!(peer_said(&addr, "standing grant"), 2);
    let counter = |m: &str, name: &str| {
        common::metrics::sample(m, name).unwrap_or_else(|| panic!("{name} in {m}")) as u64
    };
    let m = common::metrics::scrape(&format!("http://{metrics}/metrics"));
    assert_eq!(counter(&m, "rcpd_buffer_standing_grants_total"), 2);
    assert_eq!(counter(&m, "rcpd_buffer_notices_total"), 3 * OPS);
    let calls = counter(&m, "rcpd_buffer_notify_calls_total");
    assert!((1..=3 * OPS).contains(&calls), "{calls} calls");
    // A tcp session: every call came on the data path, none over gRPC.
    assert_eq!(counter(&m, "rcpd_buffer_notify_frames_total"), calls);
    // Of the 2 * OPS writes, those a free connection took went with their
    // notice (the others through the data path, told in batches).
    let framed = counter(&m, "rcpd_buffer_framed_writes_total");
    assert!((1..=2 * OPS).contains(&framed), "{framed} framed writes");
    // One request's writes under the grant held go together: with their
    // notices in one entry on the session's connection, told in one call
    // (each alone, the first would leave at once and the rest after it).
    write_all().await;
    // (The reads' events before them.)
    let mut written = 0;
    while written < OPS {
        let ev = next_event(&owner).await;
        match ev["event"].as_str() {
            Some("read") => {}
            Some("written") => written += 1,
            _ => panic!("{ev}"),
        }
    }
    let m = common::metrics::scrape(&format!("http://{metrics}/metrics"));
    assert_eq!(counter(&m, "rcpd_buffer_notify_calls_total") - calls, 1);
    assert_eq!(counter(&m, "rcpd_buffer_framed_writes_total") - framed, OPS);
    assert_eq!(counter(&m, "rcpd_buffer_notices_total"), 4 * OPS);

    // Withdrawn: the next writes fail, naming the exposure, and the
    // owner's bytes stay as they were. Those of one request first (sent
    // together under the grant the writer's rcpd still holds, refused,
    // then each asks anew), then one alone.
    owner.unexpose("st").await.unwrap();
    assert!(src.local.write_at(0, &vec![0xee; LEN as usize]));
    let writes = (0..4).map(|i| op(i, 0, i * LEN)).collect();
    let hs = writer.start_many(true, writes).await.unwrap();
    for s in writer.wait_all(hs).await.unwrap() {
        let f = s.failure.as_ref().expect("a failure");
        assert_eq!(f.reason.name(), "not_found", "{f:?}");
        assert!(f.message.contains("\"st\""), "{f:?}");
    }
    let h = writer
        .write(&src, &addr, "st", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "not_found", "{e}");
    assert!(e.message.contains("\"st\""), "{e}");
    assert!(dst.local.read_at(0, &mut got));
    for i in 0..4 {
        let (a, b) = (((OPS - 1 - i) * LEN) as usize, (i * LEN) as usize);
        assert!(
            got[b..b + LEN as usize] == data[a..a + LEN as usize],
            "page {i} untouched"
        );
    }

    // Exposed again: served again, under a new standing grant.
    owner
        .expose_standing(&dst, "st", 0, OPS * LEN, "write", &[])
        .await
        .unwrap();
    let h = writer
        .write(&src, &addr, "st", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    assert!(dst.local.read_at(0, &mut got));
    assert!(got[..LEN as usize].iter().all(|&b| b == 0xee));
    assert_eq!(peer_said(&addr, "standing grant"), 3);

    // Its owner gone and another service exposing the name, per
    // operation: the next write lands there (the standing grant the
    // writer's rcpd still held was refused, and a grant asked anew).
    drop(owner);
    let owner2 = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst2 = owner2.create_buffer(OPS * LEN).await.unwrap();
    loop {
        match owner2.expose(&dst2, "st", 0, OPS * LEN, "write", &[]).await {
            Ok(()) => break,
            // The first owner's end not yet seen by its rcpd.
            Err(e) if ServiceReason::of(e.reason).name() == "permission" => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(src.local.write_at(0, &vec![0x11; LEN as usize]));
    let h = writer
        .write(&src, &addr, "st", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    assert!(dst2.local.read_at(0, &mut got));
    assert!(got[..LEN as usize].iter().all(|&b| b == 0x11));
    drop(owner2);
    drop(writer);
    d.stop().await;
}

/// A service on `sock` with no `done` events and a buffer of `len` bytes
/// filled with a pattern: the service, the buffer and its bytes.
async fn quiet_writer(
    sock: &std::path::Path,
    len: u64,
) -> (
    ServiceClient,
    rcp::control::buffers::client::Buffer,
    Vec<u8>,
) {
    let writer = ServiceClient::connect_with(Some(sock), None, false)
        .await
        .unwrap();
    let src = writer.create_buffer(len).await.unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
    assert!(src.local.write_at(0, &data));
    (writer, src, data)
}

/// An operation on the `i`th `len` bytes of buffer `buffer`, at the same
/// offset in exposure `name` of `peer`.
fn page_op(buffer: u64, peer: &str, name: &str, i: u64, len: u64) -> OpRequest {
    one_op(buffer, peer, name, (i * len, i * len, len), String::new())
}

/// An operation of one descriptor `(local, remote, len)` from (into)
/// `buffer` into (from) `peer`'s exposure `name`, with `message`.
fn one_op(buffer: u64, peer: &str, name: &str, d: (u64, u64, u64), message: String) -> OpRequest {
    OpRequest {
        buffer,
        peer: peer.into(),
        name: name.into(),
        descs: vec![Desc {
            local: d.0,
            remote: d.1,
            len: d.2,
        }],
        message,
        check: None,
    }
}

/// Small writes under standing grants of two exposures, one of them
/// withdrawn, started together (so that they share the exchanges that
/// carry them with their notices): each write to the withdrawn one fails
/// `not_found` naming it, each to the other is done and its bytes land;
/// the withdrawn one's buffer is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_only_its_own_operation_among_those_sent_with_it() {
    const OPS: u64 = 16;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let keep = owner.create_buffer(OPS * LEN).await.unwrap();
    let gone = owner.create_buffer(OPS * LEN).await.unwrap();
    for (b, name) in [(&keep, "keep"), (&gone, "gone")] {
        owner
            .expose_standing(b, name, 0, OPS * LEN, "write", &[])
            .await
            .unwrap();
    }
    let (writer, src, data) = quiet_writer(&sock, OPS * LEN).await;
    let op = |name: &str, i: u64| page_op(src.id, &addr, name, i, LEN);
    // Both granted to the writer's session (standing), then one withdrawn.
    for name in ["keep", "gone"] {
        let h = writer.start_many(true, vec![op(name, 0)]).await.unwrap();
        assert!(writer.wait_all(h).await.unwrap()[0].state == OpStateName::Done);
    }
    owner.unexpose("gone").await.unwrap();
    assert!(gone.local.write_at(0, &vec![0u8; (OPS * LEN) as usize]));
    let ops = (0..OPS)
        .flat_map(|i| [op("keep", i), op("gone", i)])
        .collect();
    let hs = writer.start_many(true, ops).await.unwrap();
    let st = tokio::time::timeout(HANG_GUARD, writer.wait_all(hs))
        .await
        .unwrap()
        .unwrap();
    for (k, s) in st.iter().enumerate() {
        if k % 2 == 0 {
            assert_eq!(s.state, OpStateName::Done, "{k}: {s:?}");
        } else {
            assert_eq!(s.state, OpStateName::Failed, "{k}: {s:?}");
            let f = s.failure.as_ref().expect("a failure");
            assert_eq!(f.reason.name(), "not_found", "{f:?}");
            assert!(f.message.contains("\"gone\""), "{f:?}");
        }
    }
    let mut got = vec![0u8; (OPS * LEN) as usize];
    assert!(keep.local.read_at(0, &mut got));
    assert!(got == data, "every write to keep landed");
    assert!(gone.local.read_at(0, &mut got));
    assert!(got.iter().all(|&b| b == 0), "nothing landed in gone");
    drop(writer);
    drop(owner);
    d.stop().await;
}

/// A peer that accepts and never answers holds up only the operations
/// to it: with a session to it being opened (its listener has taken the
/// connection), writes to a live peer started after it, in one request
/// with another operation to the silent peer, end (done, their bytes
/// landed) while both to the silent one still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_holds_up_only_the_operations_to_it() {
    const OPS: u64 = 16;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.copy_peers = vec!["127.0.0.1".parse().unwrap()];
    // Long enough that the silent peer is given up on only when the
    // writer goes, however slow this machine is.
    cfg.timeout = Duration::from_secs(3600);
    let d = Daemon::start(cfg).await;
    // A peer that takes connections and says nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let (accepted, mut dialed) = tokio::sync::mpsc::unbounded_channel();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            conns.push(c);
            let _ = accepted.send(());
        }
    });
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(OPS * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "dst", 0, OPS * LEN, "write", &[])
        .await
        .unwrap();
    let (writer, src, data) = quiet_writer(&sock, OPS * LEN).await;
    let op = |peer: &str, i: u64| page_op(src.id, peer, "dst", i, LEN);
    let first = writer
        .start_many(true, vec![op(&silent_addr, 0)])
        .await
        .unwrap();
    dialed.recv().await.expect("rcpd dials the silent peer");
    let mut ops = vec![op(&silent_addr, 0)];
    ops.extend((0..OPS).map(|i| op(&d.addr, i)));
    let hs = writer.start_many(true, ops).await.unwrap();
    let st = tokio::time::timeout(HANG_GUARD, writer.wait_all(hs[1..].to_vec()))
        .await
        .expect("the writes to a live peer end while one to a silent peer waits")
        .unwrap();
    for (k, s) in st.iter().enumerate() {
        assert_eq!(s.state, OpStateName::Done, "{k}: {s:?}");
    }
    for h in [first[0], hs[0]] {
        let waiting = writer.status(h).await.unwrap();
        assert_eq!(waiting.state, OpStateName::Running, "{waiting:?}");
    }
    let mut got = vec![0u8; (OPS * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got == data, "every write to the live peer landed");
    drop(writer);
    drop(owner);
    d.stop().await;
    held.abort();
}

/// A connection to a tcp session's data port carrying MESSAGE frames
/// (notices on the data path), raw.
struct Frames {
    s: tokio::net::TcpStream,
    tag: u64,
}

impl Frames {
    async fn open(hs: &rcp::proto::HandshakeResponse) -> Frames {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", hs.tcp_data_port as u16))
            .await
            .unwrap();
        let key = hs.tcp_session_key.as_slice().try_into().unwrap();
        s.write_all(&wire::Hello { key }.encode()).await.unwrap();
        Frames { s, tag: 0 }
    }

    /// One MESSAGE and its answer: status and payload.
    async fn send(&mut self, payload: &[u8]) -> (Status, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.tag += 1;
        let req = wire::Request {
            op: wire::Op::Message,
            tag: self.tag,
            addr: 0,
            rkey: 0,
            len: payload.len() as u32,
            prompt: true,
        };
        let mut out = req.encode().to_vec();
        out.extend_from_slice(payload);
        self.s.write_all(&out).await.unwrap();
        let mut h = [0u8; wire::RESP_LEN];
        self.s.read_exact(&mut h).await.unwrap();
        let r = wire::Response::decode(&h).unwrap();
        assert_eq!(r.tag, self.tag);
        let mut body = vec![0u8; r.len as usize];
        self.s.read_exact(&mut body).await.unwrap();
        (r.status, body)
    }
}

/// The protocol of standing grants, raw: an rcpd that does not ask for
/// one gets a grant per operation; one that asks gets the exposure whole,
/// the same grant every time; a notice is checked against what landed
/// (bad ranges are the peer's to move again, the owner hears nothing until
/// the operation ends: done, or failed at the retry bound); a notice
/// outside the exposure or for no such grant is refused; a BufferDone of
/// a standing grant is refused; and the grant dies with its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standing_grant_is_told_by_notices_and_dies_with_its_session() {
    use prost::Message;
    use rcp::proto::{self, rcp_client::RcpClient};

    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let buf = owner.create_buffer(1 << 20).await.unwrap();
    owner
        .expose_standing(&buf, "raw", 0, 1 << 20, "write", &[])
        .await
        .unwrap();
    logged(|_| false);
    let mut c = RcpClient::connect(format!("http://{}", d.addr))
        .await
        .unwrap();
    let hs = c
        .handshake(common::raw::hello(ProviderKind::Tcp, 1 << 20))
        .await
        .unwrap()
        .into_inner();
    let session_id = hs.session_id;
    let mut req = first_page(session_id, "raw", proto::BufferAccess::Write);
    let per_op = c.buffer_grant(req.clone()).await.unwrap().into_inner();
    assert!(per_op.standing.is_none() && per_op.grant != 0, "{per_op:?}");
    c.buffer_done(proto::BufferDoneRequest {
        session_id,
        grant: per_op.grant,
        failed: "not used".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    req.standing_ok = true;
    let sg = c
        .buffer_grant(req.clone())
        .await
        .unwrap()
        .into_inner()
        .standing
        .unwrap();
    assert_eq!((sg.offset, sg.len), (0, 1 << 20), "{sg:?}");
    let again = c
        .buffer_grant(req.clone())
        .await
        .unwrap()
        .into_inner()
        .standing
        .unwrap();
    assert_eq!(again.id, sg.id, "one standing grant per session and access");

    let zero = common::raw::sha256(&[0u8; 4096]);
    let notice = |offset: u64, digest: Vec<u8>, round: u32| proto::BufferNotice {
        standing: sg.id,
        ranges: vec![proto::BufferRange { offset, len: 4096 }],
        digests: vec![digest],
        message: format!("round {round}"),
        round,
        resent: round,
    };
    let nc = c.clone();
    let notify = |ops: Vec<proto::BufferNotice>, session_id: u64| {
        let mut c = nc.clone();
        async move {
            c.buffer_notify(proto::BufferNotifyRequest {
                session_id,
                ops,
                node: String::new(),
            })
            .await
        }
    };
    // One call, four notices: a wrong digest in round 0 (move it again),
    // the right one, a range outside, no such grant.
    let mut outside = notice((1 << 20) - 4096, zero.clone(), 0);
    outside.ranges[0].len = 8192;
    let mut unknown = notice(0, zero.clone(), 0);
    unknown.standing = sg.id + 1000;
    let r = notify(
        vec![
            notice(0, vec![1; 32], 0),
            notice(4096, zero.clone(), 0),
            outside,
            unknown,
        ],
        session_id,
    )
    .await
    .unwrap()
    .into_inner()
    .results;
    assert_eq!(r.len(), 4);
    assert_eq!(
        (r[0].bad.clone(), r[0].ended, r[0].error.as_str()),
        (vec![0], false, "")
    );
    assert_eq!(
        (r[1].bad.clone(), r[1].ended, r[1].error.as_str()),
        (vec![], true, "")
    );
    assert_eq!(r[2].reason, proto::Reason::Invalid as i32, "{:?}", r[2]);
    assert!(r[2].error.contains("outside the exposed"), "{:?}", r[2]);
    assert_eq!(
        r[3].reason,
        proto::Reason::FileNotFound as i32,
        "{:?}",
        r[3]
    );
    // The owner heard only of the operation that ended.
    let ev = next_event(&owner).await;
    assert_eq!(
        (ev["event"].as_str(), ev["message"].as_str()),
        (Some("written"), Some("round 0")),
        "{ev}"
    );
    assert_eq!(ev["ranges"][0][0], 4096, "{ev}");
    // Still wrong at the bound: ended, and the owner told it failed.
    let r = notify(vec![notice(0, vec![1; 32], hs.max_retries)], session_id)
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!((r[0].bad.clone(), r[0].ended), (vec![0], true));
    let ev = next_event(&owner).await;
    assert_eq!(ev["error"]["reason"], "integrity", "{ev}");
    // The same on the data path (protocol 2.6): the grant says so, and a
    // connection opened with the session's key carries MESSAGE frames.
    assert!(sg.frames, "{sg:?}");
    let mut fc = Frames::open(&hs).await;
    let (status, answer) = fc.send(&[0xff; 7]).await;
    assert_eq!(status, Status::Ok);
    let f = proto::BufferNotifyFrame::decode(answer.as_slice()).unwrap();
    assert!(f.response.is_none(), "{f:?}");
    assert_eq!(f.reason, proto::Reason::Protocol as i32, "{f:?}");
    assert!(f.error.contains("malformed"), "{f:?}");
    let req = proto::BufferNotifyRequest {
        ops: vec![notice(8192, zero.clone(), 0)],
        ..Default::default()
    };
    let (status, answer) = fc.send(&req.encode_to_vec()).await;
    assert_eq!(status, Status::Ok);
    let f = proto::BufferNotifyFrame::decode(answer.as_slice()).unwrap();
    let r = f.response.expect("an answer").results;
    assert_eq!((r.len(), r[0].ended, r[0].error.as_str()), (1, true, ""));
    let ev = next_event(&owner).await;
    assert_eq!(ev["ranges"][0][0], 8192, "{ev}");

    // BufferDone is not how a standing grant's operations end.
    let e = c
        .buffer_done(proto::BufferDoneRequest {
            session_id,
            grant: sg.id,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("standing grant"), "{e:?}");

    // The session ends: its standing grant with it. Asked on a new
    // session, the old grant is not there.
    c.close_session(proto::CloseSessionRequest { session_id })
        .await
        .unwrap();
    let closed = logged(|l| {
        l.message == "session closed: its buffer grants revoked"
            && l.fields.get("session") == Some(&format!("{session_id:#x}"))
    });
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(closed[0].fields["grants_revoked"], "1", "{closed:?}");
    let e = notify(vec![notice(4096, zero.clone(), 0)], session_id)
        .await
        .unwrap_err();
    assert!(e.message().contains("session"), "{e:?}");
    // Its frames reach no one now: answered, and nothing is told.
    let (status, _) = fc.send(&req.encode_to_vec()).await;
    assert_eq!(status, Status::NoMessages);
    let hs2 = c
        .handshake(common::raw::hello(ProviderKind::Tcp, 1 << 20))
        .await
        .unwrap()
        .into_inner();
    let r = notify(vec![notice(4096, zero, 0)], hs2.session_id)
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(
        r[0].reason,
        proto::Reason::FileNotFound as i32,
        "{:?}",
        r[0]
    );
    drop(owner);
    d.stop().await;
}

/// Releasing a buffer withdraws its exposures as `unexpose` does: the
/// standing grants peers hold on them are revoked, so a write after the
/// release fails `not_found` and touches nothing, and once another service
/// exposes the name the writes land there, not in the released buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_buffer_revokes_its_standing_grants() {
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(4 * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "rel", 0, 4 * LEN, "write", &[])
        .await
        .unwrap();
    let (writer, src, data) = quiet_writer(&sock, 4 * LEN).await;
    // Under the standing grant: it lands.
    let h = writer
        .write(&src, &addr, "rel", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    let mut got = vec![0u8; LEN as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got[..] == data[..LEN as usize]);
    assert_eq!(next_event(&owner).await["event"], "written");

    owner
        .request("release", serde_json::json!({ "buffer": dst.id }), &[])
        .await
        .unwrap();
    assert!(src.local.write_at(0, &vec![0xee; LEN as usize]));
    let h = writer
        .write(&src, &addr, "rel", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "not_found", "{e}");
    assert!(dst.local.read_at(0, &mut got));
    assert!(
        got[..] == data[..LEN as usize],
        "the released buffer is untouched"
    );

    // Another service exposes the name: the writes land in its buffer.
    let owner2 = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst2 = owner2.create_buffer(4 * LEN).await.unwrap();
    owner2
        .expose(&dst2, "rel", 0, 4 * LEN, "write", &[])
        .await
        .unwrap();
    let h = writer
        .write(&src, &addr, "rel", &[(0, 0, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    assert!(dst2.local.read_at(0, &mut got));
    assert!(
        got.iter().all(|&b| b == 0xee),
        "it landed in the new exposure"
    );
    assert!(dst.local.read_at(0, &mut got));
    assert!(
        got[..] == data[..LEN as usize],
        "the released buffer is untouched"
    );
    drop((owner, owner2, writer));
    d.stop().await;
}

/// `release` while a peer's per-operation write into the buffer is
/// moving (held by rcpd's `--bwlimit`): the write fails and no more of it
/// lands (at most the block being received when the grant went).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_buffer_stops_a_write_into_it() {
    const MIB: u64 = 1 << 20;
    let size = 8 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.bwlimit = Some(1 << 20);
    let d = Daemon::start(cfg).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(size).await.unwrap();
    owner
        .expose(&dst, "rel", 0, size, "write", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(size).await.unwrap();
    let data: Vec<u8> = (0..size).map(|i| (i % 251 + 1) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let descs: Vec<(u64, u64, u64)> = (0..size)
        .step_by(MIB as usize)
        .map(|o| (o, o, MIB))
        .collect();
    let h = writer
        .write(&src, &addr, "rel", &descs, None)
        .await
        .unwrap();
    landed(&dst, 2 * MIB - 1).await;
    owner
        .request("release", serde_json::json!({ "buffer": dst.id }), &[])
        .await
        .unwrap();
    // Whole MiB blocks that had landed when release answered.
    let mut got = vec![0u8; size as usize];
    assert!(dst.local.read_at(0, &mut got));
    let blocks = |got: &[u8]| {
        got.chunks(MIB as usize)
            .zip(data.chunks(MIB as usize))
            .take_while(|(g, d)| g == d)
            .count()
    };
    let at_release = blocks(&got);
    assert!(at_release < 8, "the write was still moving at release");
    let e = ended(&writer, h).await.unwrap_err();
    assert_ne!(ServiceReason::of(e.reason).name(), "done", "{e}");
    assert!(dst.local.read_at(0, &mut got));
    let after = got
        .chunks(MIB as usize)
        .zip(data.chunks(MIB as usize))
        .filter(|(g, d)| g == d)
        .count();
    assert!(
        after <= at_release + 1,
        "{after} MiB blocks landed in the released buffer, {at_release} when it was released"
    );
    drop((owner, writer));
    d.stop().await;
}

/// Under a standing grant with check `none`, a write and a read are done,
/// the write's bytes land and the owner hears of each (the writer's
/// notice and the exposer agree on how many digests it carries: none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_grants_serve_operations_under_check_none() {
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.checks = vec![rcp::files::Check::Sha256, rcp::files::Check::None];
    let d = Daemon::start(cfg).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(4 * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "nochk", 0, 4 * LEN, "rw", &[])
        .await
        .unwrap();
    let (writer, src, data) = quiet_writer(&sock, 4 * LEN).await;
    let none = |i: u64, local: u64| OpRequest {
        check: Some("none".into()),
        message: format!("op {i}"),
        descs: vec![Desc {
            local,
            remote: i * LEN,
            len: LEN,
        }],
        ..page_op(src.id, &addr, "nochk", i, LEN)
    };
    // Two ranges in one write too: one (empty) digest per range or none.
    let mut two = none(0, 0);
    two.descs.push(Desc {
        local: LEN,
        remote: LEN,
        len: LEN,
    });
    for (write, op) in [
        (true, two),
        (true, none(2, 2 * LEN)),
        (false, none(0, 3 * LEN)),
    ] {
        let hs = writer.start_many(write, vec![op]).await.unwrap();
        let st = writer.wait_all(hs).await.unwrap();
        assert!(st.iter().all(|s| s.state == OpStateName::Done), "{st:?}");
        let ev = next_event(&owner).await;
        let want = if write { "written" } else { "read" };
        assert_eq!(ev["event"], want, "{ev}");
        assert_eq!(ev["check"], "none", "{ev}");
        assert!(ev.get("error").is_none_or(|e| e.is_null()), "{ev}");
    }
    let mut got = vec![0u8; (3 * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got[..] == data[..(3 * LEN) as usize], "the writes landed");
    let mut back = vec![0u8; LEN as usize];
    assert!(src.local.read_at(3 * LEN, &mut back));
    assert!(back[..] == data[..LEN as usize], "the read landed");
    drop((owner, writer));
    d.stop().await;
}

/// A message over 256 bytes fails the operation `invalid` before anything
/// moves, under a standing grant (whose peer would see the message only
/// in the notice, after the WRITEs) as under a grant per operation: the
/// owner's bytes are untouched and it hears nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_limit_fails_before_anything_moves() {
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(2 * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "long-st", 0, LEN, "write", &[])
        .await
        .unwrap();
    owner
        .expose(&dst, "long-op", LEN, LEN, "write", &[])
        .await
        .unwrap();
    let (writer, src, _) = quiet_writer(&sock, LEN).await;
    // A write under the standing grant first, so that the grant is held.
    let h = writer
        .write(&src, &addr, "long-st", &[(0, 0, LEN)], Some("ok"))
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    assert_eq!(next_event(&owner).await["message"], "ok");
    assert!(src.local.write_at(0, &vec![0xee; LEN as usize]));
    let mut before = vec![0u8; (2 * LEN) as usize];
    assert!(dst.local.read_at(0, &mut before));
    let long = "m".repeat(257);
    for (name, remote) in [("long-st", 0), ("long-op", LEN)] {
        let h = writer
            .write(&src, &addr, name, &[(0, remote, LEN)], Some(&long))
            .await
            .unwrap();
        let e = ended(&writer, h).await.unwrap_err();
        assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{name}: {e}");
        assert!(e.message.contains("257 bytes (at most 256)"), "{name}: {e}");
    }
    let mut after = vec![0u8; (2 * LEN) as usize];
    assert!(dst.local.read_at(0, &mut after));
    assert!(after == before, "nothing landed");
    // The owner heard nothing of them: the next event is the next write's.
    let h = writer
        .write(&src, &addr, "long-st", &[(0, 0, LEN)], Some("next"))
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), LEN);
    assert_eq!(next_event(&owner).await["message"], "next");
    drop((owner, writer));
    d.stop().await;
}

/// An operation whose own exclusively leased ranges overlap (a write's
/// remote ones, a read's local ones) fails `invalid`, naming them, before
/// anything moves: it would conflict with itself on every retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_whose_own_ranges_overlap_is_invalid() {
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let addr = d.addr.clone();
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(4 * LEN).await.unwrap();
    let pattern = vec![0x33; (4 * LEN) as usize];
    assert!(dst.local.write_at(0, &pattern));
    owner
        .expose(&dst, "ovl", 0, 4 * LEN, "rw", &[])
        .await
        .unwrap();
    let (writer, src, data) = quiet_writer(&sock, 4 * LEN).await;
    let h = writer
        .write(
            &src,
            &addr,
            "ovl",
            &[(0, 0, 2 * LEN), (2 * LEN, LEN, LEN)],
            None,
        )
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    assert!(e.message.contains("own remote ranges overlap"), "{e}");
    let h = writer
        .read(&src, &addr, "ovl", &[(0, 0, 2 * LEN), (LEN, 2 * LEN, LEN)])
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    assert!(e.message.contains("own local ranges overlap"), "{e}");
    let mut got = vec![0u8; (4 * LEN) as usize];
    assert!(dst.local.read_at(0, &mut got));
    assert!(got == pattern, "nothing landed in the owner's buffer");
    assert!(src.local.read_at(0, &mut got));
    assert!(got == data, "nothing landed in the reader's buffer");
    // Ranges that overlap only where they are shared are fine: a write
    // from one local range to two remote ones, a read of one remote range
    // into two local ones.
    let h = writer
        .write(&src, &addr, "ovl", &[(0, 0, LEN), (0, LEN, LEN)], None)
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), 2 * LEN);
    let h = writer
        .read(&src, &addr, "ovl", &[(2 * LEN, 0, LEN), (3 * LEN, 0, LEN)])
        .await
        .unwrap();
    assert_eq!(ended(&writer, h).await.unwrap(), 2 * LEN);
    drop((owner, writer));
    d.stop().await;
}

/// File descriptors sent with a frame that takes none are closed when it
/// is handled: rcpd keeps no copy of them, and a later `register` takes
/// its own memfd, not one left over. A connection that sends more fds
/// than it may have queued ahead of their frames is closed, before the
/// frame they came with is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fds_sent_with_a_frame_that_takes_none_are_closed() {
    use rcp::control::buffers::wire as frames;
    use std::io::Read;
    use std::os::fd::AsFd;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let c = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let e = c
        .request(
            "status",
            serde_json::json!({ "handle": 12345 }),
            &[ours.as_fd()],
        )
        .await
        .unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    // Answered: rcpd closed its copy, so with ours the last one gone the
    // other end reads the end of the stream at once.
    drop(ours);
    theirs.set_nonblocking(true).unwrap();
    let r = theirs.read(&mut [0u8; 1]);
    assert!(matches!(r, Ok(0)), "rcpd kept the fd: {r:?}");
    // A register after it takes its own memfd.
    let b = c.create_buffer(1 << 20).await.unwrap();
    assert!(b.id > 0);

    // Fds sent byte by byte ahead of a frame (a hello) past the bound:
    // the connection is closed, the hello never answered.
    let s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    frames::send(&s, frames::MAGIC, &[]).await.unwrap();
    let hello = frames::encode(&serde_json::json!({ "op": "hello", "id": 1, "name": "fds" }));
    let (one, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    let eight = [one.as_fd(); 8];
    let sends = frames::MAX_QUEUED_FDS / 8 + 1;
    for i in 0..sends {
        if frames::send(&s, &hello[i..i + 1], &eight).await.is_err() {
            break;
        }
    }
    let _ = frames::send(&s, &hello[sends..], &[]).await;
    let mut r = frames::FrameReader::default();
    let got = tokio::time::timeout(HANG_GUARD, r.next(&s))
        .await
        .expect("rcpd answers or closes");
    assert!(!matches!(got, Ok(Some(_))), "answered: {got:?}");
    drop(c);
    d.stop().await;
}

/// A service that sends requests and reads no replies: rcpd stops reading
/// its requests once their replies are queued beyond its bound (and says
/// so) instead of queueing replies without end; once the service reads,
/// every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_reads_no_replies_gets_no_more_requests_read() {
    use rcp::control::buffers::service::MAX_QUEUED_OUT;
    use rcp::control::buffers::wire as frames;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    recorded();
    let s = Arc::new(tokio::net::UnixStream::connect(&sock).await.unwrap());
    let mut all = frames::MAGIC.to_vec();
    let hello = serde_json::json!({ "op": "hello", "id": 0, "name": "flood" });
    all.extend(frames::encode(&hello));
    // Replies of four times rcpd's bound (each more than 64 bytes): sent
    // whole only if rcpd reads every request without its replies read.
    let n = (4 * MAX_QUEUED_OUT / 64) as u64;
    for i in 1..=n {
        let status = serde_json::json!({ "op": "status", "id": i, "handle": 0 });
        all.extend(frames::encode(&status));
    }
    let w = s.clone();
    let mut sender = tokio::spawn(async move { frames::send(&w, &all, &[]).await });
    let paused = async {
        loop {
            let l = logged(|l| {
                l.message == "service reads no replies: its requests wait until it does"
                    && l.fields.get("name").map(String::as_str) == Some("\"flood\"")
            });
            if !l.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::select! {
        r = &mut sender => panic!("every request was read with no reply read: {r:?}"),
        r = tokio::time::timeout(HANG_GUARD, paused) => r.expect("rcpd says its reading waits"),
    }
    assert!(!sender.is_finished());
    // Read: every request is answered, in order.
    let mut r = frames::FrameReader::default();
    for i in 0..=n {
        let f = tokio::time::timeout(HANG_GUARD, r.next(&s))
            .await
            .expect("a reply")
            .unwrap()
            .expect("the connection is open");
        assert_eq!(f["re"], i, "{f}");
    }
    sender.await.unwrap().unwrap();
    d.stop().await;
}

/// Two rcpds, the initiator allowed to dial the peer: (peer, its socket,
/// initiator, its socket). `timeout` is both rcpds' `--timeout`.
async fn pair(
    dir: &std::path::Path,
    timeout: Duration,
) -> (Daemon, std::path::PathBuf, Daemon, std::path::PathBuf) {
    let (peer_dir, init_dir) = (dir.join("peer"), dir.join("init"));
    std::fs::create_dir(&peer_dir).unwrap();
    std::fs::create_dir(&init_dir).unwrap();
    let (mut cfg, peer_sock) = dir_config(&peer_dir);
    cfg.timeout = timeout;
    let peer = Daemon::start(cfg).await;
    let (mut cfg, init_sock) = dir_config(&init_dir);
    cfg.timeout = timeout;
    cfg.copy_peers = vec![peer.addr.parse().unwrap()];
    let init = Daemon::start(cfg).await;
    (peer, peer_sock, init, init_sock)
}

/// 4096 operations under grants per operation (the default), started at
/// once from one service towards another rcpd: the initiating rcpd keeps
/// a bounded number of its calls to that peer in flight (the rest wait
/// their turn), so the HTTP/2 connection between the two never trips its
/// flood guard; every operation ends done and every byte lands, for
/// writes and for reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_per_operation_grants_at_once_all_land() {
    const OPS: u64 = 4096;
    const LEN: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let (peer, peer_sock, init, init_sock) = pair(dir.path(), Duration::from_secs(3600)).await;
    let owner = ServiceClient::connect(Some(&peer_sock), None)
        .await
        .unwrap();
    let dst = owner.create_buffer(OPS * LEN).await.unwrap();
    owner
        .expose(&dst, "wide", 0, OPS * LEN, "rw", &[])
        .await
        .unwrap();
    let (writer, src, data) = quiet_writer(&init_sock, 2 * OPS * LEN).await;
    let each = |local: u64| OpRequest {
        descs: (0..OPS)
            .map(|i| Desc {
                local: local + i * LEN,
                remote: i * LEN,
                len: LEN,
            })
            .collect(),
        ..page_op(src.id, &peer.addr, "wide", 0, LEN)
    };
    // Twice, the second time with other bytes.
    for round in 0..2u64 {
        let data: Vec<u8> = data.iter().map(|b| b.wrapping_add(round as u8)).collect();
        assert!(src.local.write_at(0, &data[..(OPS * LEN) as usize]));
        let hs = writer.start_each(true, each(0)).await.unwrap();
        assert_eq!(hs.len() as u64, OPS);
        all_done(&writer, hs, LEN).await;
        let mut got = vec![0u8; (OPS * LEN) as usize];
        assert!(dst.local.read_at(0, &mut got));
        assert!(
            got[..] == data[..(OPS * LEN) as usize],
            "every write landed"
        );
        let hs = writer.start_each(false, each(OPS * LEN)).await.unwrap();
        all_done(&writer, hs, LEN).await;
        assert!(src.local.read_at(OPS * LEN, &mut got));
        assert!(got[..] == data[..(OPS * LEN) as usize], "every read landed");
    }
    drop((owner, writer));
    init.stop().await;
    peer.stop().await;
}

/// Operations `hs` of `c` all end done, `len` bytes each.
async fn all_done(c: &ServiceClient, hs: Vec<u64>, len: u64) {
    let st = tokio::time::timeout(HANG_GUARD, c.wait_all(hs))
        .await
        .expect("the operations end")
        .unwrap();
    for (k, s) in st.iter().enumerate() {
        assert_eq!(
            (s.state, s.bytes),
            (OpStateName::Done, Some(len)),
            "{k}: {s:?}"
        );
    }
}

/// A grant per operation goes with the connection it was asked on: when
/// that connection ends (here its client goes; a flood guard's GOAWAY or a
/// keepalive unanswered end it too), the exposing rcpd revokes the grant
/// and releases its leases then, not at its `--timeout` (an hour here):
/// the range it held exclusively is granted to the next writer, and the
/// old grant's BufferDone finds it gone. A grant on a connection still
/// open is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_goes_with_the_connection_it_was_asked_on() {
    use rcp::proto::{self, rcp_client::RcpClient};
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.timeout = Duration::from_secs(3600);
    let d = Daemon::start(cfg).await;
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let buf = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&buf, "conn", 0, 2 << 20, "write", &[])
        .await
        .unwrap();
    let connect = || RcpClient::connect(format!("http://{}", d.addr));
    let mut first = connect().await.unwrap();
    let session_id = first
        .handshake(common::raw::hello(ProviderKind::Tcp, 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .session_id;
    let write = || first_page(session_id, "conn", proto::BufferAccess::Write);
    let held = first
        .buffer_grant(write())
        .await
        .unwrap()
        .into_inner()
        .grant;
    // Another connection, the same session: the range is busy while the
    // first connection is open.
    let mut second = connect().await.unwrap();
    let busy = second.buffer_grant(write()).await.unwrap_err();
    assert_eq!(busy.code(), tonic::Code::Unavailable, "{busy:?}");
    drop(first);
    let start = std::time::Instant::now();
    let next = loop {
        assert!(start.elapsed() < HANG_GUARD, "the grant was never revoked");
        match second.buffer_grant(write()).await {
            Ok(g) => break g.into_inner().grant,
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(next, held);
    let done = |grant: u64| proto::BufferDoneRequest {
        session_id,
        grant,
        failed: "given up".into(),
        ..Default::default()
    };
    let e = second.buffer_done(done(held)).await.unwrap_err();
    assert!(e.message().contains("not live"), "{e:?}");
    second
        .buffer_done(done(next))
        .await
        .expect("the grant on the open connection is live");
    drop(owner);
    d.stop().await;
}

/// A peer that takes the connection and never says a word fails the
/// operation by rcpd's `--timeout` (2 s here), with an error that says it
/// did not answer (`retryable`: a stalled rcpd may come back), not that
/// it "answers but is not rcpd".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_answers_is_named_silent_not_another_program() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, sock) = dir_config(dir.path());
    cfg.copy_peers = vec!["127.0.0.1".parse().unwrap()];
    cfg.timeout = Duration::from_secs(2);
    let d = Daemon::start(cfg).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            conns.push(c);
        }
    });
    let (writer, src, _) = quiet_writer(&sock, 1 << 20).await;
    let h = writer
        .write(&src, &silent_addr, "x", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    let e = ended(&writer, h).await.unwrap_err();
    assert_eq!(e.reason, rcp::proto::Reason::Retryable, "{e}");
    assert!(
        e.message.contains(&format!(
            "{silent_addr} took the connection but did not answer within 2 s"
        )),
        "{e}"
    );
    assert!(!e.message.contains("not rcpd"), "{e}");
    drop(writer);
    d.stop().await;
    held.abort();
}

/// A malformed frame from a service is logged at warn, its first bytes
/// escaped (no newline or escape sequence of its own reaches the log): one
/// outside the schema is answered `invalid` and the connection goes on;
/// one that is not JSON closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_is_logged_at_warn_escaped() {
    use rcp::control::buffers::wire as frames;
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let warned = |message: &str, field: &str, marker: &str| {
        logged(|l| {
            l.message == message
                && l.level == "WARN"
                && l.fields.get(field).is_some_and(|f| f.contains(marker))
        })
    };
    let c = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let e = c
        .request(
            "expose",
            serde_json::json!({ "buffer": 1, "marker": "schema-mark\n\u{1b}[2J" }),
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{e}");
    let w = warned(
        "service sent a request outside the protocol: answered invalid",
        "frame",
        "schema-mark",
    );
    assert_eq!(w.len(), 1, "{w:?}");
    let frame = &w[0].fields["frame"];
    assert!(
        !frame.contains('\n') && !frame.contains('\u{1b}'),
        "{frame}"
    );
    assert!(w[0].fields["error"].contains("missing field"), "{w:?}");
    // The connection goes on.
    assert!(c.create_buffer(1 << 20).await.is_ok());

    let s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    frames::send(&s, frames::MAGIC, &[]).await.unwrap();
    let bad = b"json-mark\n\x1b[2J not json";
    let mut f = (bad.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(bad);
    frames::send(&s, &f, &[]).await.unwrap();
    let mut r = frames::FrameReader::default();
    let got = tokio::time::timeout(HANG_GUARD, r.next(&s))
        .await
        .expect("rcpd closes the connection");
    assert!(!matches!(got, Ok(Some(_))), "answered: {got:?}");
    let w = warned("service connection broke", "error", "json-mark");
    assert_eq!(w.len(), 1, "{w:?}");
    let error = &w[0].fields["error"];
    assert!(error.contains("not JSON"), "{error}");
    assert!(
        !error.contains('\n') && !error.contains('\u{1b}'),
        "{error}"
    );
    drop(c);
    d.stop().await;
}

/// A check is named exactly, in lower case, as everywhere in rcp: `BLAKE3`
/// or `Xxh3` is refused `invalid` before anything starts, the error
/// listing the names that are; `sha256` (the one this rcpd allows) runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_is_named_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (d, sock) = start_rcpd(dir.path()).await;
    let (_owner, _dst) = exposed(&sock, "exact").await;
    let (writer, src, _) = quiet_writer(&sock, 1 << 20).await;
    let op = |check: &str| OpRequest {
        check: Some(check.into()),
        ..page_op(src.id, &d.addr, "exact", 0, 4096)
    };
    for name in ["BLAKE3", "Xxh3", "SHA256", " sha256", "crc32"] {
        let e = writer.start_many(true, vec![op(name)]).await.unwrap_err();
        assert_eq!(ServiceReason::of(e.reason).name(), "invalid", "{name}: {e}");
        let want = format!("unknown check {name:?}: blake3, sha256, xxh3 or none");
        assert!(e.message.contains(&want), "{name}: {e}");
    }
    let hs = writer.start_many(true, vec![op("sha256")]).await.unwrap();
    all_done(&writer, hs, 4096).await;
    drop(writer);
    d.stop().await;
}
