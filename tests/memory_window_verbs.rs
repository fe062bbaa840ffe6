//! Type-2 memory windows on a real device (soft-RoCE in the test VM), the
//! way rcpd uses them: an arena registered once, a region per slot with
//! LOCAL_WRITE | MW_BIND and no remote access, two "session" QPs in its
//! PD, each connected to a client QP of its own; a window bound to one
//! session's QP over a span of a slot.
//!
//! - the window's rkey reaches its span through its own QP only: the other
//!   session's QP (same PD), a span outside its slot's region, a right it
//!   was not bound with, and the region's own rkey all fail with
//!   IBV_WC_REM_ACCESS_ERR, and nothing is written; past the window inside
//!   its slot is refused where the device checks window bounds as the
//!   verbs spec says (rxe does not: printed);
//! - it fails the moment the window is invalidated; the next bind has a
//!   fresh rkey and the old one stays dead;
//! - across a reconnect (both QPs through ERR, RESET and back to RTS, as
//!   the data path's and rcpd's `reconnect` do) a window bound before is
//!   either still usable for its own span or refused, never anything else:
//!   what the device does is printed (`--nocapture`); rcpd then revokes it
//!   by deallocation, never by an invalidate the device could refuse;
//! - a grant made while the session's QP cannot send (in the error state:
//!   a rail cut whose reconnect has not succeeded) is not refused: its
//!   window's rkey is reserved and the window is bound when the QP
//!   reconnects, before the reconnect returns; the peer's WRITE through it
//!   lands in its span then, and fails once the grant is revoked. A grant
//!   revoked before the reconnect is never bound.
//!
//! Devices: `RCP_TEST_DEV_A` (clients) / `RCP_TEST_DEV_B` (the "server").
//! `cargo test --test memory_window_verbs --no-run`, then
//! `scripts/testbed.sh run lo -- <test binary> --ignored --test-threads=1 --nocapture`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::verbs_rig::dev;
use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::verbs::{MwDomain, RegisteredSlots, VerbsChannel};
use rcp::verbs::*;

const NEEDS: &str = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)";

const WIN: usize = 64 << 10;
const ARENA: usize = 4 << 20;

/// One QP with its CQ, in INIT.
fn qp(ctx: &Arc<Context>, pd: &Arc<ProtectionDomain>, remote: Access) -> PreparedQp {
    let (port, choice) = ctx.select_port(None).expect("an ACTIVE port");
    QpBuilder::new(pd, port.port, choice.entry.index)
        .sq_depth(16)
        .remote_access(remote)
        .build()
        .unwrap()
}

/// A client: its own device context, PD, QP and a staging arena.
struct Client {
    qp: QueuePair,
    mr: MemoryRegion,
    arena: Arena,
}

/// The server: one PD, the arena registered once as regions of `SLOT`
/// bytes (as rcpd registers one per window slot), a QP per session.
struct Server {
    sessions: Vec<QueuePair>,
    slots: Vec<Arc<MemoryRegion>>,
    arena: Arena,
    pd: Arc<ProtectionDomain>,
}

/// The arena's slots (rcpd's are 4 MiB windows).
const SLOT: usize = 1 << 20;

fn rig(sessions: usize) -> (Server, Vec<Client>) {
    assert!(!device_names().is_empty(), "no RDMA device: {NEEDS}");
    let sctx = Context::open(dev("RCP_TEST_DEV_B").as_deref()).unwrap();
    let mwc = sctx.caps().mem_windows;
    println!(
        "server device {}: {mwc}, max_mw {}",
        sctx.name(),
        sctx.caps().max_mw
    );
    assert!(mwc.type_2(), "the device offers no type-2 memory windows");
    let pd = ProtectionDomain::new(&sctx).unwrap();
    let arena = Arena::new(&ArenaConfig::new(ARENA)).unwrap();
    let slots = (0..ARENA / SLOT)
        .map(|i| {
            let span = PeerSpan::new(&arena, arena.addr() + (i * SLOT) as u64, SLOT).unwrap();
            // SAFETY: no remote right (MW_BIND: windows grant it).
            Arc::new(
                unsafe { pd.register_span(&span, Access::LOCAL_WRITE | Access::MW_BIND) }.unwrap(),
            )
        })
        .collect();
    let mut server = Server {
        sessions: Vec::new(),
        slots,
        arena,
        pd,
    };
    let cctx = Context::open(dev("RCP_TEST_DEV_A").as_deref()).unwrap();
    let mut clients = Vec::new();
    for _ in 0..sessions {
        let s = qp(
            &sctx,
            &server.pd,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
        );
        let cpd = ProtectionDomain::new(&cctx).unwrap();
        let c = qp(&cctx, &cpd, Access::LOCAL_READ);
        let carena = Arena::new(&ArenaConfig::new(2 << 20)).unwrap();
        // SAFETY: no remote right.
        let cmr = unsafe { cpd.register_arena(&carena, Access::LOCAL_WRITE) }.unwrap();
        let (ec, es) = (c.endpoint(), s.endpoint());
        let c = c.handshake(&es, &params()).unwrap();
        let s = s.handshake(&ec, &params()).unwrap();
        server.sessions.push(s);
        clients.push(Client {
            qp: c,
            mr: cmr,
            arena: carena,
        });
    }
    (server, clients)
}

fn params() -> ConnectParams {
    ConnectParams {
        retry_cnt: 3,
        timeout: 10,
        ..ConnectParams::default()
    }
}

/// Both ends back to RTS after an error: ERR, RESET, INIT, RTR, RTS.
fn reconnect(c: &mut QueuePair, s: &mut QueuePair) {
    let _ = c.set_error();
    let _ = s.set_error();
    drain(c);
    let ec = c.reset().unwrap();
    let es = s.reset().unwrap();
    c.handshake(&es, &params()).unwrap();
    s.handshake(&ec, &params()).unwrap();
}

fn drain(q: &QueuePair) {
    let mut wc = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 16];
    std::thread::sleep(Duration::from_millis(20));
    while q.send_cq().poll(&mut wc).unwrap() > 0 {}
}

impl Client {
    fn span(&self) -> PeerSpan {
        PeerSpan::new(&self.arena, self.arena.addr(), self.arena.len()).unwrap()
    }

    /// One signaled request from the start of the staging arena; its status.
    fn op(&self, kind: OpKind, len: usize, addr: u64, rkey: u32) -> WcStatus {
        let wr = WorkRequest {
            wr_id: 1,
            kind,
            local: LocalSeg {
                addr: self.arena.addr(),
                len: len as u32,
                lkey: self.mr.lkey(),
            },
            remote: RemoteSeg { addr, rkey },
            signaled: true,
            inline: false,
        };
        let mut scratch = PostScratch::with_capacity(1);
        // SAFETY: the staging arena is the test's; it is not touched until
        // the completion below retires the request.
        unsafe { self.qp.post_send(&[wr], &mut scratch) }.unwrap();
        let mut wc = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            byte_len: 0,
        }; 4];
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if self.qp.send_cq().poll(&mut wc).unwrap() > 0 {
                return wc[0].status;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        panic!("no completion for a {kind:?} to {addr:#x}");
    }

    fn write(&self, byte: u8, len: usize, addr: u64, rkey: u32) -> WcStatus {
        // SAFETY: nothing is in flight on the staging arena.
        unsafe { self.span().with_mut(0, len, |b| b.fill(byte)) }.unwrap();
        self.op(OpKind::Write, len, addr, rkey)
    }
}

impl Server {
    /// The region's bytes at `addr` (nothing is in flight when called).
    fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let s = PeerSpan::new(&self.arena, addr, len).unwrap();
        s.with(0, len, <[u8]>::to_vec).unwrap()
    }

    fn zero(&self) {
        let s = PeerSpan::new(&self.arena, self.arena.addr(), self.arena.len()).unwrap();
        // SAFETY: no window is bound and nothing is in flight.
        unsafe { s.with_mut(0, s.len(), |b| b.fill(0)) }.unwrap();
    }

    /// The region of the slot holding offset `at`.
    fn slot(&self, at: u64) -> &Arc<MemoryRegion> {
        &self.slots[at as usize / SLOT]
    }

    fn bind(&mut self, mw: &mut MemoryWindow, session: usize, at: u64, access: Access) -> u32 {
        let addr = self.arena.addr() + at;
        let mr = self.slot(at).clone();
        let t = Instant::now();
        // SAFETY: the tests read or write the server's arena only while no
        // client request names it.
        let rkey = unsafe {
            mw.bind(
                &mut self.sessions[session],
                &mr,
                addr,
                WIN,
                access,
                Duration::from_secs(5),
            )
        }
        .unwrap();
        println!(
            "bound {WIN} bytes at +{at:#x} to session {session}'s QP: rkey {rkey:#x} in {:?}",
            t.elapsed()
        );
        rkey
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_window_reaches_its_span_through_its_own_qp_only() {
    let (mut s, mut cs) = rig(2);
    s.zero();
    let mut mw = MemoryWindow::alloc(&s.pd).unwrap();
    let at = 1 << 20;
    let base = s.arena.addr() + at;
    let rkey = s.bind(&mut mw, 0, at, Access::REMOTE_WRITE);
    assert!(matches!(mw.state(), MwState::Bound { .. }));
    // Its own session, inside the window: lands.
    assert_eq!(cs[0].write(0x11, 4096, base, rkey), WcStatus::Success);
    assert_eq!(
        cs[0].write(0x12, 4096, base + (WIN - 4096) as u64, rkey),
        WcStatus::Success
    );
    // The other session's QP, same PD, same rkey: refused.
    let other = cs[1].write(0xee, 4096, base, rkey);
    println!("session 1 with session 0's rkey: {other:?}");
    assert_eq!(other, WcStatus::RemoteAccess);
    {
        let (c, q) = (&mut cs[1], &mut s.sessions[1]);
        reconnect(&mut c.qp, q);
    }
    // The region's own rkey (no remote access of its own): refused.
    let mrk = s.slot(at).rkey();
    let own = cs[1].write(0xee, 4096, base, mrk);
    println!("the region's own rkey {mrk:#x}: {own:?}");
    assert_eq!(own, WcStatus::RemoteAccess);
    // Session 0 outside its slot (past its end, straddling it, before its
    // start) and a READ through the write-only window: refused. Each
    // refusal takes both QPs to ERR, so each probe gets a window bound anew
    // after the reconnect. The window is bound at the start of slot 1.
    let slot_end = s.arena.addr() + (at as usize / SLOT + 1) as u64 * SLOT as u64;
    let probes: [(&str, OpKind, u64); 4] = [
        ("past its slot", OpKind::Write, slot_end),
        ("straddling the slot's end", OpKind::Write, slot_end - 2048),
        ("before its slot", OpKind::Write, base - 4096),
        ("a READ through a REMOTE_WRITE window", OpKind::Read, base),
    ];
    for (what, kind, addr) in probes {
        let mut probe = MemoryWindow::alloc(&s.pd).unwrap();
        let k = s.bind(&mut probe, 0, at, Access::REMOTE_WRITE);
        let st = match kind {
            OpKind::Write => cs[0].write(0xee, 4096, addr, k),
            OpKind::Read => cs[0].op(OpKind::Read, 4096, addr, k),
        };
        println!("session 0, {what}: {st:?}");
        assert_eq!(st, WcStatus::RemoteAccess, "{what}");
        reconnect(&mut cs[0].qp, &mut s.sessions[0]);
        drop(probe);
    }
    // Past the window but inside its slot: the verbs spec refuses it; a
    // device that checks only the region's bounds (rxe) lets it land in
    // the slot, which rcpd grants to one session at a time (and whose
    // unused tail it zeroes before a pull window is bound on such a device).
    let mut probe = MemoryWindow::alloc(&s.pd).unwrap();
    let k = s.bind(&mut probe, 0, at, Access::REMOTE_WRITE);
    let past = cs[0].write(0x13, 4096, base + WIN as u64, k);
    println!(
        "session 0, past the window inside its slot: {past:?} (device {} {} window bounds)",
        s.pd.context().name(),
        if past == WcStatus::RemoteAccess {
            "checks"
        } else {
            "does NOT check"
        }
    );
    assert!(
        matches!(past, WcStatus::Success | WcStatus::RemoteAccess),
        "{past:?}"
    );
    if past == WcStatus::RemoteAccess {
        reconnect(&mut cs[0].qp, &mut s.sessions[0]);
    }
    drop(probe);
    let past_ok = past == WcStatus::Success;
    // Only the two writes of session 0 landed, nothing else anywhere.
    let all = s.bytes(s.arena.addr(), ARENA);
    let w = at as usize;
    assert!(all[w..w + 4096].iter().all(|&b| b == 0x11));
    assert!(all[w + WIN - 4096..w + WIN].iter().all(|&b| b == 0x12));
    let past = w + WIN..w + WIN + 4096;
    if past_ok {
        assert!(all[past.clone()].iter().all(|&b| b == 0x13));
    }
    let stray = all
        .iter()
        .enumerate()
        .filter(|&(i, &b)| {
            let allowed = (w..w + 4096).contains(&i)
                || (w + WIN - 4096..w + WIN).contains(&i)
                || (past_ok && past.contains(&i));
            b != 0 && !allowed
        })
        .count();
    assert_eq!(stray, 0, "bytes written outside what the window allowed");
    // Refused requests moved the QPs to ERR and back, as a reconnect does:
    // invalidating the window bound before that is refused here (rcpd
    // deallocates such windows), and dropping it deallocates it.
    let inv = mw.invalidate(&mut s.sessions[0], Duration::from_secs(5));
    println!("invalidate after the QP was reset: {inv:?}");
    assert!(inv.is_err() && mw.state() == MwState::Unknown);
    drop(mw);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn an_invalidated_window_fails_at_once_and_rebinds_with_a_fresh_rkey() {
    let (mut s, cs) = rig(1);
    s.zero();
    let at = 256 << 10;
    let base = s.arena.addr() + at;
    let mut mw = MemoryWindow::alloc(&s.pd).unwrap();
    let first = s.bind(&mut mw, 0, at, Access::REMOTE_WRITE);
    assert_eq!(cs[0].write(0x21, 4096, base, first), WcStatus::Success);
    let t = Instant::now();
    mw.invalidate(&mut s.sessions[0], Duration::from_secs(5))
        .unwrap();
    println!("invalidated in {:?}", t.elapsed());
    assert_eq!(mw.state(), MwState::Free);
    // The very next request with the rkey fails.
    let after = cs[0].write(0x22, 4096, base, first);
    println!("WRITE right after the invalidate: {after:?}");
    assert_eq!(after, WcStatus::RemoteAccess, "IBV_WC_REM_ACCESS_ERR");
    assert!(
        s.bytes(base, 4096).iter().all(|&b| b == 0x21),
        "nothing written"
    );
    let mut cs = cs;
    reconnect(&mut cs[0].qp, &mut s.sessions[0]);
    // Rebound (after the reconnect, on the reset QP): a fresh rkey that
    // works; the old one still fails.
    let second = s.bind(&mut mw, 0, at, Access::REMOTE_READ);
    assert_ne!(second, first, "a fresh rkey");
    assert_eq!(second >> 8, first >> 8, "the same window");
    let (st, _) = (cs[0].op(OpKind::Read, 4096, base, second), ());
    assert_eq!(st, WcStatus::Success, "READ through the rebound window");
    let mut staged = vec![0u8; 4096];
    cs[0]
        .span()
        .with(0, 4096, |b| staged.copy_from_slice(b))
        .unwrap();
    assert!(staged.iter().all(|&b| b == 0x21), "read what is there");
    let old = cs[0].op(OpKind::Read, 4096, base, first);
    println!("READ with the rkey of the first binding: {old:?}");
    assert_eq!(old, WcStatus::RemoteAccess);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_window_across_a_reconnect_is_usable_or_refused_never_elsewhere() {
    let (mut s, mut cs) = rig(1);
    s.zero();
    let at = 2 << 20;
    let base = s.arena.addr() + at;
    let mut mw = MemoryWindow::alloc(&s.pd).unwrap();
    let rkey = s.bind(&mut mw, 0, at, Access::REMOTE_WRITE);
    assert_eq!(cs[0].write(0x31, 4096, base, rkey), WcStatus::Success);
    // A link loss as the data path sees it: the client's QP in ERR (its
    // outstanding work flushed), then both reset and connected again with
    // fresh PSNs, the server's QP going through ERR too.
    reconnect(&mut cs[0].qp, &mut s.sessions[0]);
    let again = cs[0].write(0x32, 4096, base + 4096, rkey);
    println!(
        "device {}: a window bound before the QP went ERR -> RESET -> RTS: WRITE with its rkey {again:?}",
        s.pd.context().name()
    );
    assert!(
        matches!(again, WcStatus::Success | WcStatus::RemoteAccess),
        "{again:?}"
    );
    let landed = s.bytes(base + 4096, 4096);
    match again {
        WcStatus::Success => {
            assert!(landed.iter().all(|&b| b == 0x32), "landed in its own span");
            println!(
                "  -> still bound: the rkeys of windows granted before a reconnect keep working"
            );
        }
        _ => {
            assert!(landed.iter().all(|&b| b == 0), "nothing written");
            println!("  -> dropped: windows live at a reconnect must be bound again");
            reconnect(&mut cs[0].qp, &mut s.sessions[0]);
        }
    }
    // rcpd's rule: a window bound before a reset is revoked by
    // deallocation; after that its rkey fails.
    assert!(mw
        .invalidate(&mut s.sessions[0], Duration::from_secs(5))
        .is_err());
    drop(mw);
    let gone = cs[0].write(0x33, 4096, base, rkey);
    println!("after the window was deallocated: {gone:?}");
    assert_eq!(gone, WcStatus::RemoteAccess);
    reconnect(&mut cs[0].qp, &mut s.sessions[0]);
    // A new window binds on the reconnected QP.
    let mut mw2 = MemoryWindow::alloc(&s.pd).unwrap();
    let k2 = s.bind(&mut mw2, 0, at, Access::REMOTE_WRITE);
    assert_eq!(cs[0].write(0x34, 4096, base, k2), WcStatus::Success);
    mw2.invalidate(&mut s.sessions[0], Duration::from_secs(5))
        .unwrap();
    assert!(s.bytes(base, 4096).iter().all(|&b| b == 0x34));
}

/// Binds and invalidates never touch a data path's CQ: rcpd's QPs post
/// nothing else. Many in a row on one QP, windows reused from a pool.
#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_pool_reuses_windows_grant_after_grant() {
    let (mut s, cs) = rig(1);
    let pool = MwPool::new(&s.pd);
    let at = 0;
    let base = s.arena.addr() + at;
    let mut last = None;
    let t = Instant::now();
    for i in 0..50u32 {
        let mut mw = pool.take().unwrap();
        let mr = s.slot(at).clone();
        // SAFETY: the test does not touch the arena while the window is
        // bound.
        let k = unsafe {
            mw.bind(
                &mut s.sessions[0],
                &mr,
                base,
                WIN,
                Access::REMOTE_WRITE,
                Duration::from_secs(5),
            )
        }
        .unwrap();
        assert_ne!(Some(k), last);
        last = Some(k);
        if i % 10 == 0 {
            assert_eq!(cs[0].write(i as u8, 4096, base, k), WcStatus::Success);
        }
        mw.invalidate(&mut s.sessions[0], Duration::from_secs(5))
            .unwrap();
        pool.put(mw);
    }
    println!(
        "50 binds + invalidates in {:?}, {} window(s) allocated",
        t.elapsed(),
        pool.allocated()
    );
    assert_eq!(pool.allocated(), 1);
    assert_eq!(pool.idle(), 1);
}

/// rcpd's grants on a session QP that cannot send: the session's domain
/// ([`MwDomain`]) reserves each window's rkey, and [`VerbsChannel::reconnect`]
/// binds the windows still granted before it returns.
#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_grant_while_the_qp_is_down_is_bound_when_it_reconnects() {
    use rcp::provider::Domain;
    let (mut s, mut cs) = rig(1);
    s.zero();
    let slots = Arc::new(
        RegisteredSlots::register(&s.pd, &s.arena, SLOT, Access::LOCAL_WRITE | Access::MW_BIND)
            .unwrap(),
    );
    let ch = Arc::new(VerbsChannel::new(s.sessions.remove(0)));
    let domain = MwDomain {
        slots,
        pool: Arc::new(MwPool::new(&s.pd)),
        channel: ch.clone(),
    };
    let c = &mut cs[0];
    // The link lost: both QPs in the error state, the server's reconnect
    // not done yet.
    let _ = c.qp.set_error();
    drain(&c.qp);
    ch.set_error().unwrap();
    let span = |at: u64| PeerSpan::new(&s.arena, s.arena.addr() + at, WIN).unwrap();
    let before = counts();
    // SAFETY: the test touches the arena only while no client request
    // names it, and reads what landed after the grants are dropped or
    // while nothing is in flight.
    let kept =
        unsafe { domain.register(&span(0), Access::REMOTE_WRITE) }.expect("granted while down");
    // SAFETY: as above.
    let revoked = unsafe { domain.register(&span(SLOT as u64), Access::REMOTE_WRITE) }
        .expect("granted while down");
    let after = counts();
    println!(
        "two grants on a QP in the error state: rkeys {:#x} {:#x}; counts {before:?} -> {after:?}",
        kept.rkey(),
        revoked.rkey()
    );
    assert_eq!(after.binds_deferred, before.binds_deferred + 2);
    assert_eq!(after.window_binds, before.window_binds, "nothing bound yet");
    let dead = revoked.rkey();
    drop(revoked);
    // The client's reconnect, as rcp's: reset, rcpd's reconnect, handshake.
    let ec = c.qp.reset().unwrap();
    let es = ch.reconnect(&ec, &params()).unwrap();
    c.qp.handshake(&es, &params()).unwrap();
    assert_eq!(
        counts().window_binds,
        after.window_binds + 1,
        "the reconnect binds the window still granted, not the revoked one"
    );
    assert_eq!(
        c.write(0x41, 4096, kept.addr() + 8192, kept.rkey()),
        WcStatus::Success
    );
    assert!(s.bytes(kept.addr() + 8192, 4096).iter().all(|&b| b == 0x41));
    // The grant revoked before the reconnect reaches nothing.
    let st = c.write(0x42, 4096, s.arena.addr() + SLOT as u64, dead);
    assert_eq!(st, WcStatus::RemoteAccess);
    assert!(s
        .bytes(s.arena.addr() + SLOT as u64, 4096)
        .iter()
        .all(|&b| b == 0));
    // Revoking the bound one: its rkey fails from then on.
    let _ = c.qp.set_error();
    drain(&c.qp);
    let ec = c.qp.reset().unwrap();
    let es = ch.reconnect(&ec, &params()).unwrap();
    c.qp.handshake(&es, &params()).unwrap();
    let (addr, rkey) = (kept.addr(), kept.rkey());
    drop(kept);
    assert_eq!(c.write(0x43, 4096, addr, rkey), WcStatus::RemoteAccess);
    assert!(s.bytes(addr, 4096).iter().all(|&b| b == 0));
}
