//! Standing grants over verbs (soft-RoCE in the test VM), with the
//! notices on the session's message QP (protocol 2.7): two Rust services
//! on one rcpd (rcpd its own peer, over rxe0), one exposing with
//! `grant: standing`, the other writing and reading it.
//!
//! - 64 writes of 4 KiB at once, twice, then 64 reads: every one done,
//!   the bytes where they belong, the owner told of each write;
//! - one write of 2048 ranges (its notice, 2048 digests, is longer than a
//!   receive of the message QP: it goes as fragments);
//! - every notify call came on the message QP (`rcpd_buffer_notify_frames`
//!   = `rcpd_buffer_notify_calls` > 0; rcpd logged the QP), none over
//!   gRPC;
//! - withdrawn, the next write fails naming the exposure and touches
//!   nothing.
//!
//! And the same QP at the protocol's level, a session made by hand
//! (`notices_on_a_message_qp_made_by_hand`).
//!
//! `cargo test --test buffers_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1 --nocapture`.

mod common;

use std::time::Duration;

use common::metrics::scrape;
use common::Rcpd;
use rcp::control::buffers::api::{Desc, OpRequest, OpStateName, OpStatus};
use rcp::control::buffers::client::ServiceClient;

const OPS: u64 = 64;
const LEN: u64 = 4096;
/// Ranges of the one long write.
const MANY: u64 = 2048;

/// A call that would hang fails the test instead (never a bound on how
/// long anything takes: only on waiting forever).
const HANG_GUARD: Duration = Duration::from_secs(600);

/// Every operation done, over verbs.
fn all_done(st: &[OpStatus]) {
    assert!(
        st.iter()
            .all(|s| s.state == OpStateName::Done && s.transport.as_deref() == Some("verbs")),
        "{st:?}"
    );
}

/// Counter `name` of rcpd's `/metrics` text `m`.
fn counter(m: &str, name: &str) -> u64 {
    common::metrics::sample(m, name).unwrap_or_else(|| panic!("{name} in {m}")) as u64
}

/// Run `scenario` on a runtime of its own, bounded by [`HANG_GUARD`].
fn run(scenario: impl std::future::Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { tokio::time::timeout(HANG_GUARD, scenario).await })
        .expect("the scenario did not hang");
}

/// An rcpd over verbs with its unix socket (in `dir`), and a service of
/// its own connected to it.
async fn rcpd_and_owner(dir: &std::path::Path) -> (Rcpd, std::path::PathBuf, ServiceClient) {
    let root = dir.join("root");
    std::fs::create_dir(&root).unwrap();
    let sock = dir.join("rcpd.sock");
    let d = Rcpd::start(
        &root,
        "verbs",
        None,
        &["--socket", sock.to_str().unwrap(), "--log", "info"],
    );
    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    (d, sock, owner)
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn standing_notices_go_on_the_message_qp() {
    run(many_operations());
}

async fn many_operations() {
    let dir = tempfile::tempdir().unwrap();
    let (d, sock, owner) = rcpd_and_owner(dir.path()).await;
    let addr = d.addr();
    let dst = owner.create_buffer(MANY * LEN).await.unwrap();
    owner
        .expose_standing(&dst, "st", 0, MANY * LEN, "rw", &[])
        .await
        .unwrap();
    let writer = ServiceClient::connect_with(Some(&sock), None, false)
        .await
        .unwrap();
    let src = writer.create_buffer(MANY * LEN + OPS * LEN).await.unwrap();
    let data: Vec<u8> = (0..MANY * LEN).map(|i| (i * 31 + 7) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let op = |i: u64, descs: Vec<Desc>| OpRequest {
        buffer: src.id,
        peer: addr.clone(),
        name: "st".into(),
        descs,
        message: format!("op {i}"),
        check: None,
    };
    let one = |local: u64, remote: u64| {
        vec![Desc {
            local,
            remote,
            len: LEN,
        }]
    };

    // 64 writes at once, twice (the grant kept between the batches).
    for _ in 0..2 {
        let writes = (0..OPS)
            .map(|i| op(i, one(i * LEN, (OPS - 1 - i) * LEN)))
            .collect();
        let hs = writer.start_many(true, writes).await.unwrap();
        let st = writer.wait_all(hs).await.unwrap();
        all_done(&st);
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
    for _ in 0..2 * OPS {
        let ev = owner.next_event().await.expect("an event");
        assert_eq!(ev["event"], "written", "{ev}");
    }

    // One write of 2048 ranges: its notice goes as fragments.
    let descs = (0..MANY)
        .map(|k| Desc {
            local: k * LEN,
            remote: k * LEN,
            len: LEN,
        })
        .collect();
    let hs = writer.start_many(true, vec![op(OPS, descs)]).await.unwrap();
    let st = writer.wait_all(hs).await.unwrap();
    all_done(&st);
    let mut all = vec![0u8; (MANY * LEN) as usize];
    assert!(dst.local.read_at(0, &mut all));
    assert!(all == data, "the 2048 ranges landed");
    let ev = owner.next_event().await.expect("an event");
    assert_eq!(ev["event"], "written", "{ev}");
    assert_eq!(ev["ranges"].as_array().unwrap().len() as u64, MANY, "{ev}");

    // 64 reads back.
    let reads = (0..OPS)
        .map(|i| op(i, one(MANY * LEN + i * LEN, i * LEN)))
        .collect();
    let hs = writer.start_many(false, reads).await.unwrap();
    let st = writer.wait_all(hs).await.unwrap();
    all_done(&st);
    let mut back = vec![0u8; (OPS * LEN) as usize];
    assert!(src.local.read_at(MANY * LEN, &mut back));
    assert!(back == data[..(OPS * LEN) as usize], "the reads landed");

    // Every notify call on the message QP.
    let m = scrape(d.metrics.as_ref().expect("rcpd's metrics"));
    let calls = counter(&m, "rcpd_buffer_notify_calls_total");
    let frames = counter(&m, "rcpd_buffer_notify_frames_total");
    let notices = counter(&m, "rcpd_buffer_notices_total");
    println!("{notices} notices in {calls} calls, {frames} on the message QP");
    assert!(
        calls > 0 && frames == calls,
        "{calls} calls, {frames} on the QP"
    );
    assert_eq!(notices, 2 * OPS + 1 + OPS);
    let log = d.log();
    assert!(log.contains("message QP connected"), "{log}");
    assert!(!log.contains("notices over gRPC"), "{log}");

    // Withdrawn: the next write fails naming it, and touches nothing.
    owner.unexpose("st").await.unwrap();
    assert!(src.local.write_at(0, &vec![0xee; LEN as usize]));
    let hs = writer
        .start_many(true, vec![op(0, one(0, 0))])
        .await
        .unwrap();
    let st = writer.wait_all(hs).await.unwrap();
    let f = st[0].failure.as_ref().expect("the write failed");
    assert_eq!(f.reason.name(), "not_found", "{f:?}");
    assert!(f.message.contains("\"st\""), "{f:?}");
    assert!(dst.local.read_at(0, &mut all));
    assert!(all == data, "untouched after the withdrawal");
}

/// The message QP at the protocol's level (a session made by hand, over
/// verbs): `BufferMessages` connects rcpd's side to ours; one message of
/// three notices (a wrong digest in round 0, the right one, a grant that
/// does not exist) is answered on it, each as the gRPC call would be, and
/// the owner hears of the one that ended; a session closed takes its QP
/// with it (the next call breaks) and refuses another.
#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn notices_on_a_message_qp_made_by_hand() {
    run(by_hand());
}

async fn by_hand() {
    use prost::Message;
    use rcp::proto::{self, BufferNotifyFrame, BufferNotifyRequest};
    use rcp::provider::ProviderKind;
    use rcp::verbs::messages::MessageError;

    let dir = tempfile::tempdir().unwrap();
    let (d, _sock, owner) = rcpd_and_owner(dir.path()).await;
    let buf = owner.create_buffer(1 << 20).await.unwrap();
    owner
        .expose_standing(&buf, "raw", 0, 1 << 20, "write", &[])
        .await
        .unwrap();
    let mut c = common::raw::grpc(d.port).await;
    let s = common::raw::Session::open(&mut c, ProviderKind::Verbs, 1 << 20).await;
    let session_id = s.id();
    let sg = c
        .buffer_grant(proto::BufferGrantRequest {
            session_id,
            name: "raw".into(),
            access: proto::BufferAccess::Write as i32,
            ranges: vec![proto::BufferRange {
                offset: 0,
                len: 4096,
            }],
            standing_ok: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .standing
        .expect("a standing grant");
    assert!(
        sg.frames,
        "a verbs session's notices may leave gRPC: {sg:?}"
    );

    // Our message QP on the session's rail, rcpd's connected to it.
    let rail = s.link.rails[0].channel.clone();
    let prep = rail.prepare_messages().unwrap();
    let theirs = c
        .buffer_messages(proto::BufferMessagesRequest {
            session_id,
            endpoint: Some(rcp::control::link::ep_to_proto(&prep.endpoint())),
        })
        .await
        .unwrap()
        .into_inner()
        .endpoint
        .expect("rcpd's endpoint");
    let theirs = rcp::control::link::ep_from_proto(&theirs).unwrap();
    // Retries bounded (6 of ~268 ms each, patient with a loaded VM): a
    // peer gone surfaces as an error on soft-RoCE too.
    let p = rcp::verbs::ConnectParams {
        timeout: 16,
        retry_cnt: 6,
        ..Default::default()
    };
    let m = prep.connect(&theirs, &p, None, "test-msg").unwrap();
    let zero = common::raw::sha256(&[0u8; 4096]);
    let notice = |standing: u64, offset: u64, digest: Vec<u8>| proto::BufferNotice {
        standing,
        ranges: vec![proto::BufferRange { offset, len: 4096 }],
        digests: vec![digest],
        message: format!("at {offset}"),
        round: 0,
        resent: 0,
    };
    let req = BufferNotifyRequest {
        session_id: 0,
        ops: vec![
            notice(sg.id, 0, vec![1; 32]),
            notice(sg.id, 4096, zero.clone()),
            notice(sg.id + 1000, 0, zero.clone()),
        ],
        node: String::new(),
    };
    let answer = m.call(req.encode_to_vec()).await.unwrap().unwrap();
    let f = BufferNotifyFrame::decode(answer.as_slice()).unwrap();
    assert!(f.error.is_empty(), "{f:?}");
    let r = f.response.expect("a response").results;
    assert_eq!(r.len(), 3, "{r:?}");
    assert_eq!((r[0].bad.clone(), r[0].ended), (vec![0], false), "{r:?}");
    assert_eq!((r[1].bad.clone(), r[1].ended), (vec![], true), "{r:?}");
    assert_eq!(r[2].reason, proto::Reason::FileNotFound as i32, "{r:?}");
    let ev = owner.next_event().await.expect("an event");
    assert_eq!(
        (ev["event"].as_str(), ev["message"].as_str()),
        (Some("written"), Some("at 4096")),
        "{ev}"
    );
    let metrics = scrape(d.metrics.as_ref().unwrap());
    assert_eq!(counter(&metrics, "rcpd_buffer_notify_frames_total"), 1);

    // The session closed: its QP went with it, and no other is made.
    c.close_session(proto::CloseSessionRequest { session_id })
        .await
        .unwrap();
    let r = m.call(req.encode_to_vec()).await.unwrap();
    assert!(matches!(r, Err(MessageError::Broken(_))), "{r:?}");
    let prep = rail.prepare_messages().unwrap();
    let e = c
        .buffer_messages(proto::BufferMessagesRequest {
            session_id,
            endpoint: Some(rcp::control::link::ep_to_proto(&prep.endpoint())),
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("unknown session"), "{e:?}");
    println!("message QP by hand: answered, then broken with its session");
}
