//! The session data path (`datapath::DataPath` over `engine::Stream`) on the
//! TCP provider, 127.0.0.1: windows of packed extents land byte-exact in
//! both directions, gaps between extents stay untouched, one data path
//! serves many windows and both directions, a bad rkey fails the data path
//! with a non-retryable error.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::pattern::pattern_into;
use rcp::datapath::{
    DataPath, DataPathConfig, DataPathError, DpEvent, PollMode, ReconnectError, ReconnectFn,
};
use rcp::engine::{Extent, OpKind, WcStatus, WindowJob};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::tcp::{TcpChannel, TcpDomain, TcpTarget, DEFAULT_CONNS};
use rcp::provider::{Access, Channel, Domain, Registration};
use tokio::sync::mpsc::UnboundedReceiver;

const MIB: usize = 1 << 20;
const WINDOW: u64 = 4 << 20;

struct Mem {
    arena: Arena,
    span: PeerSpan,
    domain: Arc<TcpDomain>,
    reg: Arc<dyn Registration>,
}

fn mem(bytes: usize, access: Access) -> Mem {
    let arena = Arena::new(&ArenaConfig::new(bytes)).unwrap();
    let span = PeerSpan::new(&arena, arena.addr(), arena.len()).unwrap();
    let domain = TcpDomain::new();
    // SAFETY: the tests touch the arena's bytes only while no request of
    // theirs names them (before a window is submitted, after it is done).
    let reg = unsafe { domain.register(&span, access) }.unwrap();
    Mem {
        arena,
        span,
        domain,
        reg,
    }
}

struct Rig {
    remote: Mem,
    local: Mem,
    _target: TcpTarget,
    ch: Arc<TcpChannel>,
}

fn rig() -> Rig {
    let remote = mem(32 * MIB, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let local = mem(32 * MIB, Access::LOCAL_WRITE);
    let target = TcpTarget::bind(remote.domain.clone(), "127.0.0.1:0").unwrap();
    let ch =
        TcpChannel::connect_endpoint(local.domain.clone(), &target.endpoint(), DEFAULT_CONNS, 128)
            .unwrap();
    Rig {
        remote,
        local,
        _target: target,
        ch: Arc::new(ch),
    }
}

fn start(r: &Rig) -> (DataPath, UnboundedReceiver<DpEvent>) {
    let cfg = DataPathConfig {
        poll_mode: PollMode::Event,
        batch: 16,
        signal_every: 8,
        flush_timeout: Duration::from_secs(1),
        ..DataPathConfig::default()
    };
    let reconnect: ReconnectFn =
        Box::new(|| Err(ReconnectError::permanent("no reconnect over this rig")));
    let ch: Arc<dyn Channel> = r.ch.clone();
    let dp = DataPath::start(cfg, ch, reconnect, None).unwrap();
    let ev = dp.take_events().unwrap();
    (dp, ev)
}

/// Packed "files": many sizes, back to back, a gap now and then.
fn extents(seed: u64) -> Vec<Extent> {
    let sizes = [1u32, 100, 4095, 4096, 4097, 65536, 1 << 20, 7, 300_000];
    let mut off = 0u64;
    let mut out = Vec::new();
    for i in 0..24u64 {
        let len = sizes[((i + seed) % sizes.len() as u64) as usize];
        if off + u64::from(len) > WINDOW {
            break;
        }
        out.push(Extent { offset: off, len });
        off += u64::from(len);
        if i % 5 == 4 {
            off += 512; // a hole no request covers
        }
    }
    out
}

fn window(r: &Rig, id: u64, slot: u64, op: OpKind, remote_rkey: u32) -> WindowJob {
    WindowJob {
        id,
        op,
        local_addr: r.local.arena.addr() + slot * WINDOW,
        lkey: r.local.reg.lkey(),
        remote_addr: r.remote.arena.addr() + slot * WINDOW,
        rkey: remote_rkey,
        extents: extents(id),
    }
}

fn wait_done(ev: &mut UnboundedReceiver<DpEvent>, n: usize) -> Vec<u64> {
    let mut done = Vec::new();
    while done.len() < n {
        match ev.blocking_recv().expect("data path ended") {
            DpEvent::WindowDone { id } => done.push(id),
            DpEvent::Failed(e) => panic!("{e}"),
            e => panic!("unexpected {e:?}"),
        }
    }
    done
}

fn bytes(span: &PeerSpan, at: u64, len: usize) -> Vec<u8> {
    span.with(at as usize, len, <[u8]>::to_vec).unwrap()
}

#[test]
fn windows_of_packed_extents_land_byte_exact_both_ways() {
    let r = rig();
    // SAFETY: nothing is posted yet; the test owns both arenas.
    unsafe {
        r.local
            .span
            .with_mut(0, r.local.span.len(), |b| pattern_into(b, 1))
            .unwrap();
        r.remote
            .span
            .with_mut(0, r.remote.span.len(), |b| b.fill(0))
            .unwrap();
    }
    let (dp, mut ev) = start(&r);
    let rkey = r.remote.reg.rkey();
    // Push: windows 0..8 WRITE slots 0..8 of the arena.
    for id in 0..8u64 {
        // SAFETY: slot `id` of the local arena is registered under its
        // lkey in the channel's domain; the test reads it only after all
        // windows are done, and never writes it meanwhile.
        unsafe { dp.submit(window(&r, id, id, OpKind::Write, rkey)) }.unwrap();
    }
    let mut done = wait_done(&mut ev, 8);
    done.sort_unstable();
    assert_eq!(done, (0..8).collect::<Vec<_>>());
    for id in 0..8u64 {
        let base = id * WINDOW;
        let ex = extents(id);
        for e in &ex {
            let at = base + e.offset;
            assert!(
                bytes(&r.remote.span, at, e.len as usize)
                    == bytes(&r.local.span, at, e.len as usize),
                "window {id} extent at {} differs",
                e.offset
            );
        }
        // The holes were never written.
        for w in ex.windows(2) {
            let end = w[0].offset + u64::from(w[0].len);
            if w[1].offset > end {
                let gap = bytes(&r.remote.span, base + end, (w[1].offset - end) as usize);
                assert!(gap.iter().all(|&b| b == 0), "window {id}: hole written");
            }
        }
    }

    // Pull on the same data path: fresh remote bytes, READ into a zeroed
    // local arena.
    // SAFETY: every window is done: no request names either arena now.
    unsafe {
        r.remote
            .span
            .with_mut(0, r.remote.span.len(), |b| pattern_into(b, 2))
            .unwrap();
        r.local
            .span
            .with_mut(0, r.local.span.len(), |b| b.fill(0))
            .unwrap();
    }
    for id in 100..108u64 {
        // SAFETY: as above; the test reads the local slot after its
        // WindowDone only.
        unsafe { dp.submit(window(&r, id, id - 100, OpKind::Read, rkey)) }.unwrap();
    }
    let done = wait_done(&mut ev, 8);
    for &id in &done {
        let base = (id - 100) * WINDOW;
        for e in &extents(id) {
            let at = base + e.offset;
            assert!(
                bytes(&r.local.span, at, e.len as usize)
                    == bytes(&r.remote.span, at, e.len as usize),
                "READ window {id} extent at {} differs",
                e.offset
            );
        }
    }
    let rep = dp.close();
    let extents_total: u64 = (0..8)
        .chain(100..108)
        .map(|id| extents(id).len() as u64)
        .sum();
    assert_eq!(rep.counters.extents_confirmed, extents_total);
    assert_eq!(rep.counters.windows_done, 16);
    assert_eq!(rep.counters.posted, extents_total, "nothing posted twice");
    assert_eq!(rep.counters.reconnects, 0);
    assert!(
        rep.counters.errors.total() == 0,
        "{:?}",
        rep.counters.errors
    );
    assert_eq!(rep.outstanding_at_close, 0);
}

#[test]
fn a_bad_rkey_fails_the_data_path_for_good() {
    let r = rig();
    let (dp, mut ev) = start(&r);
    // SAFETY: the local arena is registered in the channel's domain and the
    // test never touches it.
    unsafe { dp.submit(window(&r, 1, 0, OpKind::Write, 0xdead_beef)) }.unwrap();
    let e = match ev.blocking_recv().expect("data path ended") {
        DpEvent::Failed(e) => e,
        other => panic!("{other:?}"),
    };
    assert!(
        matches!(
            e,
            DataPathError::Failed {
                status: Some(WcStatus::RemoteAccess),
                window: Some(1),
                ..
            }
        ),
        "{e}"
    );
    assert!(!e.is_retryable());
    // SAFETY: as above.
    let again = unsafe { dp.submit(window(&r, 2, 1, OpKind::Write, r.remote.reg.rkey())) };
    assert!(matches!(again, Err(DataPathError::Stopped)), "{again:?}");
    let rep = dp.close();
    assert_eq!(rep.counters.windows_done, 0);
    assert_eq!(rep.counters.errors.get(WcStatus::RemoteAccess), 1);
}
