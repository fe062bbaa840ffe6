//! Messages on a QP of their own (`rcp::verbs::messages`), over verbs
//! (soft-RoCE in the test VM): requests and answers as SENDs into posted
//! receives, between two message QPs on one device.
//!
//! - a small request is answered; a request of 1 MiB (16 fragments and
//!   more) and its answer come back whole; 2000 calls at once each get
//!   their own answer;
//! - a side with no handler refuses requests (the call says so);
//! - the answering side gone, the caller's calls fail (the channel broke)
//!   and every call after that fails at once.
//!
//! `cargo test --test messages_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1 --nocapture`.

use std::sync::Arc;

use rcp::verbs::messages::{Handler, MessageError, Messenger, PreparedMessages, SLOT};
use rcp::verbs::{ConnectParams, Context, ProtectionDomain};

/// Two message QPs on the first device with an ACTIVE port, connected to
/// each other: the caller (no handler) and the answerer (`handler`).
/// Retries bounded (`retry_cnt` 6 of ~268 ms each, patient with a loaded
/// VM): a peer that went away surfaces as an error in about 2 s, also on
/// soft-RoCE, which retries 7 forever.
fn pair(handler: Option<Handler>) -> (Messenger, Messenger) {
    let ctx = Context::open(None).expect("an RDMA device");
    let (port, gid) = ctx.select_port(None).expect("an ACTIVE port with a GID");
    let prep = || {
        let pd = ProtectionDomain::new(&ctx).unwrap();
        PreparedMessages::new(&pd, port.port, gid.entry.index).unwrap()
    };
    let (a, b) = (prep(), prep());
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let p = ConnectParams {
        timeout: 16,
        retry_cnt: 6,
        ..ConnectParams::default()
    };
    let answerer = b.connect(&ea, &p, handler, "msg-answer").unwrap();
    let caller = a.connect(&eb, &p, None, "msg-call").unwrap();
    (caller, answerer)
}

/// The answer to `req`: its length, then its bytes reversed.
fn reverse() -> Handler {
    Box::new(|req: &[u8]| {
        let mut v = (req.len() as u64).to_le_bytes().to_vec();
        v.extend(req.iter().rev());
        v
    })
}

fn expected(req: &[u8]) -> Vec<u8> {
    reverse()(req)
}

fn answer(m: &Messenger, req: Vec<u8>) -> Result<Vec<u8>, MessageError> {
    m.call(req)
        .blocking_recv()
        .expect("the messenger answers every call")
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn requests_are_answered_whole_small_large_and_many_at_once() {
    let (caller, _answerer) = pair(Some(reverse()));
    assert_eq!(
        answer(&caller, b"hello".to_vec()).unwrap(),
        expected(b"hello")
    );
    assert_eq!(answer(&caller, Vec::new()).unwrap(), expected(b""));
    // Longer than 16 slots: fragments beyond the receives posted at once.
    let big: Vec<u8> = (0..(1 << 20) + 12345).map(|i| (i % 253) as u8).collect();
    assert!(big.len() > 16 * SLOT);
    assert_eq!(answer(&caller, big.clone()).unwrap(), expected(&big));
    let caller = Arc::new(caller);
    let waits: Vec<_> = (0..2000u32)
        .map(|i| {
            let req = format!("call {i}").into_bytes();
            (req.clone(), caller.call(req))
        })
        .collect();
    for (req, rx) in waits {
        assert_eq!(rx.blocking_recv().unwrap().unwrap(), expected(&req));
    }
    assert!(caller.broken().is_none());
    println!("messages: small, empty, 1 MiB and 2000 at once answered");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_side_without_a_handler_refuses_and_a_gone_peer_breaks_the_channel() {
    let (caller, answerer) = pair(None);
    let r = answer(&caller, b"anyone?".to_vec());
    assert!(matches!(r, Err(MessageError::Refused)), "{r:?}");

    let (caller, answerer2) = pair(Some(reverse()));
    assert_eq!(answer(&caller, b"x".to_vec()).unwrap(), expected(b"x"));
    drop(answerer2);
    drop(answerer);
    let r = answer(&caller, b"still there?".to_vec());
    assert!(matches!(r, Err(MessageError::Broken(_))), "{r:?}");
    let why = caller.broken().expect("broken");
    println!("after the peer went: {why}");
    let r = answer(&caller, b"and now?".to_vec());
    assert!(matches!(r, Err(MessageError::Broken(_))), "{r:?}");
}
