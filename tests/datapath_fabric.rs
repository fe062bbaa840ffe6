//! The session data path on a real RDMA device (soft-RoCE in the test VM):
//! `datapath::DataPath` over `engine::Stream` on a `VerbsChannel`, two QPs
//! connected in-process, data verified byte for byte. The same runner as
//! src/datapath/tests.rs (a fake channel: the bookkeeping) and
//! tests/tcp_datapath.rs (the TCP provider); here the device does the
//! moving, flushing and refusing.
//!
//! `#[ignore]`d in a plain `cargo test` (no device); run them in the VM:
//! `cargo test --test datapath_fabric --no-run`, then
//! `bash scripts/testbed.sh run lo -- target/debug/deps/datapath_fabric-<hash> --ignored --test-threads=1`.
//! Devices: `RCP_TEST_DEV_A` / `RCP_TEST_DEV_B` (default: the first device).
//!
//! Memory: A posts. Its arena is the staging of every window (registered
//! under `a.mr`); B's arena is the remote region. The test touches a
//! staging region only before the window over it is submitted and after
//! its `WindowDone`; B's only before the data path starts and after it is
//! closed.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pattern::{pattern, pattern_into};
use common::verbs_rig::{self, whole, Side};
use rcp::datapath::{
    DataPath, DataPathConfig, DataPathError, DpEvent, PollMode, ReconnectError, ReconnectFn,
};
use rcp::engine::{Extent, OpKind, WcStatus, WindowJob};
use rcp::mem::{Arena, PeerSpan};
use rcp::provider::verbs::VerbsChannel;
use rcp::provider::Channel;
use rcp::verbs::{ConnectParams, MemoryRegion};
use tokio::sync::mpsc::UnboundedReceiver;

/// Send-queue depth asked for (the device may grant more: rxe 255 for 128).
const SQ: u32 = 128;

/// One end: its QP as a provider channel, and its registered arena. The
/// channel drops first (the QP is destroyed before the memory it names).
struct End {
    ch: Arc<VerbsChannel>,
    mr: MemoryRegion,
    arena: Arena,
}

impl End {
    fn span(&self) -> PeerSpan {
        whole(&self.arena)
    }
}

fn end(s: Side) -> End {
    End {
        ch: Arc::new(VerbsChannel::new(s.qp)),
        mr: s.mr,
        arena: s.arena,
    }
}

fn pair(a_bytes: usize, b_bytes: usize) -> (End, End) {
    let (a, b) = verbs_rig::pair(a_bytes, b_bytes, SQ);
    (end(a), end(b))
}

/// The reconnect the control plane does: reset both QPs, exchange the new
/// endpoints (in-process here), handshake. Counts its calls.
fn reconnect(a: &End, b: &End) -> (ReconnectFn, Arc<AtomicU32>) {
    let (ca, cb) = (a.ch.clone(), b.ch.clone());
    let calls = Arc::new(AtomicU32::new(0));
    let n = calls.clone();
    let f: ReconnectFn = Box::new(move || {
        n.fetch_add(1, Relaxed);
        let step = ReconnectError::retryable;
        let ea = ca.reset().map_err(step)?;
        let eb = cb.reset().map_err(step)?;
        ca.handshake(&eb, &ConnectParams::default()).map_err(step)?;
        cb.handshake(&ea, &ConnectParams::default()).map_err(step)?;
        Ok(())
    });
    (f, calls)
}

fn dp_cfg() -> DataPathConfig {
    DataPathConfig {
        poll_mode: PollMode::Hybrid { empty_polls: 256 },
        ..DataPathConfig::default()
    }
}

/// A data path on A's channel, and its events.
fn start(
    cfg: DataPathConfig,
    a: &End,
    reconnect: ReconnectFn,
) -> (DataPath, UnboundedReceiver<DpEvent>) {
    let ch: Arc<dyn Channel> = a.ch.clone();
    let dp = DataPath::start(cfg, ch, reconnect, None).unwrap();
    let ev = dp.take_events().unwrap();
    (dp, ev)
}

/// `n` extents of `len` bytes, back to back from offset 0.
fn extents(n: u64, len: u32) -> Vec<Extent> {
    (0..n)
        .map(|k| Extent {
            offset: k * u64::from(len),
            len,
        })
        .collect()
}

/// Window `id`: staging at `a_at` in A's arena, remote region at `b_at` in
/// B's, `extents` of both.
fn job(
    id: u64,
    op: OpKind,
    a: &End,
    a_at: u64,
    b: &End,
    b_at: u64,
    extents: Vec<Extent>,
) -> WindowJob {
    WindowJob {
        id,
        op,
        local_addr: a.arena.addr() + a_at,
        lkey: a.mr.lkey(),
        remote_addr: b.arena.addr() + b_at,
        rkey: b.mr.rkey(),
        extents,
    }
}

/// Wait for every window in `ids` to be done, each exactly once; the other
/// events (reconnects) are returned, a failure panics.
fn wait_done(ev: &mut UnboundedReceiver<DpEvent>, ids: &[u64]) -> Vec<DpEvent> {
    let mut done: HashMap<u64, u32> = HashMap::new();
    let mut other = Vec::new();
    while done.len() < ids.len() {
        match ev.blocking_recv().expect("data path ended") {
            DpEvent::WindowDone { id } => {
                assert!(ids.contains(&id), "unknown window {id}");
                *done.entry(id).or_default() += 1;
                assert_eq!(done[&id], 1, "window {id} done twice");
            }
            DpEvent::Failed(e) => panic!("data path failed: {e}"),
            e => other.push(e),
        }
    }
    other
}

fn bytes_at(span: &PeerSpan, at: usize, len: usize) -> Vec<u8> {
    span.with(at, len, <[u8]>::to_vec).unwrap()
}

/// Move `len` bytes in `windows` windows of `extent`-byte extents, through
/// a staging of two window slots on A (a window is submitted into a slot
/// when the one before it there is done), to or from B's region; verify
/// every byte.
fn move_and_verify(op: OpKind, len: usize, extent: u32, windows: u64) {
    let wlen = len as u64 / windows;
    let per = wlen / u64::from(extent);
    let slots = 2u64;
    let (a, b) = pair((slots * wlen) as usize, len);
    let (sa, sb) = (a.span(), b.span());
    let data = pattern(len, 0xfeed + len as u64);
    // WRITE: the source "file"; READ: where the pulled bytes go.
    let mut file = match op {
        OpKind::Write => data.clone(),
        OpKind::Read => {
            // SAFETY: no data path runs yet: no request names B's arena.
            unsafe { sb.with_mut(0, len, |d| d.copy_from_slice(&data)) }.unwrap();
            vec![0u8; len]
        }
    };
    let (reconnect, calls) = reconnect(&a, &b);
    let (dp, mut ev) = start(dp_cfg(), &a, reconnect);
    // Window `w`: bytes [w * wlen, +wlen) of the file, through staging slot
    // `k`, to or from the same bytes of B's region.
    let submit = |w: u64, k: u64, file: &[u8]| {
        let slot = k * wlen;
        if op == OpKind::Write {
            let at = (w * wlen) as usize;
            // SAFETY: the slot is not lent: no window went through it yet,
            // or the last one that did is done.
            unsafe {
                sa.with_mut(slot as usize, wlen as usize, |s| {
                    s.copy_from_slice(&file[at..at + wlen as usize])
                })
            }
            .unwrap();
        }
        let w = job(w, op, &a, slot, &b, w * wlen, extents(per, extent));
        // SAFETY: the slot lies in A's arena, registered under `a.mr` in
        // the PD of the channel the data path runs on, and is lent to the
        // device from here until this window's WindowDone: the test neither
        // writes it (the next window's bytes go in only after) nor reads it
        // (a READ's bytes are copied out only after). If the data path fails
        // instead, the test panics and the slot is never touched again (`dp`
        // is closed, and the channel dropped, before `a`'s arena goes).
        unsafe { dp.submit(w) }.unwrap();
    };
    let t0 = Instant::now();
    // Window id -> its slot, while it is lent.
    let mut lent: HashMap<u64, u64> = HashMap::new();
    let first = slots.min(windows);
    for w in 0..first {
        submit(w, w, &file);
        lent.insert(w, w);
    }
    let mut next = first;
    let mut done = 0;
    while done < windows {
        match ev.blocking_recv().expect("data path ended") {
            DpEvent::WindowDone { id } => {
                let k = lent.remove(&id).expect("a lent window, done once");
                done += 1;
                if op == OpKind::Read {
                    let at = (id * wlen) as usize;
                    // The window is done: its slot is the test's again.
                    sa.with((k * wlen) as usize, wlen as usize, |s| {
                        file[at..at + wlen as usize].copy_from_slice(s)
                    })
                    .unwrap();
                }
                if next < windows {
                    submit(next, k, &file);
                    lent.insert(next, k);
                    next += 1;
                }
            }
            DpEvent::Failed(e) => panic!("{op:?}: data path failed: {e}"),
            e => panic!("{op:?}: unexpected {e:?}"),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let r = dp.close();
    eprintln!(
        "{op:?} {len} bytes in {extent}-byte extents: {secs:.3} s, {:.1} MB/s, doorbells {}, p50 {:.1} us p99 {:.1} us",
        r.counters.bytes_confirmed as f64 / secs / 1e6,
        r.counters.doorbells,
        r.p50_us(),
        r.p99_us()
    );
    assert_eq!(r.counters.bytes_confirmed, len as u64);
    assert_eq!(r.counters.extents_confirmed, windows * per);
    assert_eq!(r.counters.windows_done, windows);
    assert_eq!(r.counters.posted, windows * per, "no extent posted twice");
    assert_eq!((r.counters.reconnects, calls.load(Relaxed)), (0, 0));
    assert!(r.counters.errors.total() == 0, "{:?}", r.counters.errors);
    assert_eq!(r.outstanding_at_close, 0);
    let got = match op {
        OpKind::Write => bytes_at(&sb, 0, len),
        OpKind::Read => file,
    };
    assert!(got == data, "{op:?}: data differs");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn push_64mib_in_1mib_blocks_verified() {
    move_and_verify(OpKind::Write, 64 << 20, 1 << 20, 4);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn pull_64mib_in_1mib_blocks_verified() {
    move_and_verify(OpKind::Read, 64 << 20, 1 << 20, 4);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_batch_of_32_is_one_doorbell() {
    let len = 32 * 4096;
    let (a, b) = pair(len, len);
    let data = pattern(len, 3);
    // SAFETY: no data path runs yet: no request names A's arena.
    unsafe { a.span().with_mut(0, len, |s| s.copy_from_slice(&data)) }.unwrap();
    let (reconnect, calls) = reconnect(&a, &b);
    let (dp, mut ev) = start(dp_cfg(), &a, reconnect);
    // SAFETY: A's first 128 KiB, registered under `a.mr` in the channel's
    // PD, is lent to the device until window 1's WindowDone; the test does
    // not touch A's arena again.
    unsafe { dp.submit(job(1, OpKind::Write, &a, 0, &b, 0, extents(32, 4096))) }.unwrap();
    wait_done(&mut ev, &[1]);
    let r = dp.close();
    assert_eq!(
        (
            r.counters.doorbells,
            r.counters.posted,
            r.counters.signaled,
            r.counters.completions
        ),
        (1, 32, 1, 1),
        "{r:?}"
    );
    assert_eq!(
        (
            r.counters.extents_confirmed,
            r.counters.bytes_confirmed,
            r.counters.windows_done
        ),
        (32, len as u64, 1)
    );
    assert_eq!((r.counters.reconnects, calls.load(Relaxed)), (0, 0));
    assert!(bytes_at(&b.span(), 0, len) == data);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn burst_of_100k_4k_writes_into_a_128_deep_sq() {
    let n: u64 = 100_000;
    let block = 4096u32;
    // Every window goes from the same 4 MiB of A to the same 4 MiB of B.
    let region = 4usize << 20;
    let per = region as u64 / u64::from(block);
    let (a, b) = pair(region, region);
    let data = pattern(region, 4);
    // SAFETY: no data path runs yet: no request names A's arena.
    unsafe { a.span().with_mut(0, region, |s| s.copy_from_slice(&data)) }.unwrap();
    // The device may grant a deeper SQ than asked (rxe: 255 for 128); hold
    // the engine to 128 credits.
    let c = DataPathConfig {
        tx_depth: Some(SQ as usize),
        ..dp_cfg()
    };
    let (reconnect, calls) = reconnect(&a, &b);
    let (dp, mut ev) = start(c, &a, reconnect);
    assert_eq!(dp.stream_config().sq_depth, SQ as usize);
    assert!(a.ch.caps().sq_depth >= SQ);
    let stats = dp.stats().clone();
    let t0 = Instant::now();
    let mut ids = Vec::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(per);
        let id = ids.len() as u64;
        // SAFETY: A's first 4 MiB, registered under `a.mr` in the channel's
        // PD, is lent to the device by every window at once, until the last
        // WindowDone: WRITE windows only read their staging, and the test
        // does not touch A's arena again.
        unsafe { dp.submit(job(id, OpKind::Write, &a, 0, &b, 0, extents(k, block))) }.unwrap();
        ids.push(id);
        left -= k;
    }
    wait_done(&mut ev, &ids);
    let secs = t0.elapsed().as_secs_f64();
    let r = dp.close();
    eprintln!(
        "100k x 4 KiB: {secs:.2} s, {:.0} msg/s, doorbells {}, completions {}, post failures {}",
        r.counters.extents_confirmed as f64 / secs,
        r.counters.doorbells,
        r.counters.completions,
        r.counters.post_failures
    );
    assert_eq!(r.counters.extents_confirmed, n, "every write landed");
    assert_eq!(r.counters.posted, n, "none posted twice");
    assert_eq!(r.counters.windows_done, ids.len() as u64);
    assert_eq!(r.counters.post_failures, 0, "the SQ was never over-posted");
    assert!(r.counters.errors.total() == 0, "{:?}", r.counters.errors);
    assert_eq!((r.counters.reconnects, calls.load(Relaxed)), (0, 0));
    assert!(
        r.counters.doorbells >= n / 32 && r.counters.doorbells < n,
        "{}",
        r.counters.doorbells
    );
    // Every credit back at the end.
    assert_eq!(stats.sq_free.load(Relaxed), u64::from(SQ));
    assert!(bytes_at(&b.span(), 0, region) == data);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn qp_error_mid_stream_reconnects_once_and_every_block_verifies() {
    let len = 32usize << 20;
    let extent = 256u32 << 10; // 128 extents
    let windows = 8u64; // of 16 extents, 4 MiB each
    let wlen = len as u64 / windows;
    let total = len as u64 / u64::from(extent);
    // At most 16 requests in flight: what an error can leave unconfirmed.
    let depth = 16usize;
    let (a, b) = pair(len, len);
    let data = pattern(len, 99);
    // SAFETY: no data path runs yet: no request names A's arena.
    unsafe { a.span().with_mut(0, len, |s| s.copy_from_slice(&data)) }.unwrap();
    let c = DataPathConfig {
        tx_depth: Some(depth),
        ..dp_cfg()
    };
    let (reconnect, calls) = reconnect(&a, &b);
    let (dp, mut ev) = start(c, &a, reconnect);
    let stats = dp.stats().clone();
    for w in 0..windows {
        let at = w * wlen;
        // SAFETY: A's [at, +4 MiB), registered under `a.mr` in the
        // channel's PD, is lent to the device until window w's WindowDone
        // (through the reconnect: the data path reposts what the error left
        // unconfirmed); the test does not touch A's arena again.
        unsafe {
            dp.submit(job(
                w,
                OpKind::Write,
                &a,
                at,
                &b,
                at,
                extents(total / windows, extent),
            ))
        }
        .unwrap();
    }
    let breaker = {
        let (ch, stats) = (a.ch.clone(), stats.clone());
        std::thread::spawn(move || {
            // Break the QP once a quarter of the extents is confirmed.
            let deadline = Instant::now() + Duration::from_secs(60);
            while stats.counters().extents_confirmed < total / 4 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(100));
            }
            eprintln!(
                "set_error after {} extents",
                stats.counters().extents_confirmed
            );
            ch.set_error().unwrap();
        })
    };
    let ids: Vec<u64> = (0..windows).collect();
    let other = wait_done(&mut ev, &ids);
    breaker.join().unwrap();
    let r = dp.close();
    let reposted = stats.counters().reposted;
    eprintln!(
        "reconnects {} ({} attempts) in {:?} s, errors {:?}, reposted {reposted}",
        r.counters.reconnects,
        calls.load(Relaxed),
        r.reconnect_seconds,
        r.counters.errors
    );
    assert!(
        matches!(other[..], [DpEvent::Reconnected { epoch: 1, .. }]),
        "{other:?}"
    );
    assert_eq!(r.counters.reconnects, 1);
    assert!(calls.load(Relaxed) >= 1);
    assert_eq!(
        stats.counters().failures,
        1,
        "the flush was one error batch"
    );
    assert!(r.counters.errors.get(WcStatus::Flushed) > 0);
    assert_eq!(
        r.counters.extents_confirmed, total,
        "every extent confirmed once"
    );
    assert_eq!(r.counters.windows_done, windows);
    assert!(
        reposted > 0 && reposted <= depth as u64,
        "only the unconfirmed (at most {depth} in flight) are reposted: {reposted}"
    );
    assert_eq!(
        r.counters.posted,
        total + reposted,
        "nothing else posted twice"
    );
    assert!(bytes_at(&b.span(), 0, len) == data);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn wrong_rkey_is_a_remote_access_error_not_a_hang() {
    let len = 1usize << 20;
    let (a, b) = pair(len, len);
    // SAFETY: no data path runs yet: no request names A's arena.
    unsafe { a.span().with_mut(0, len, |s| pattern_into(s, 1)) }.unwrap();
    let before = bytes_at(&b.span(), 0, len);
    let (reconnect, calls) = reconnect(&a, &b);
    let (dp, mut ev) = start(dp_cfg(), &a, reconnect);
    let mut w = job(1, OpKind::Write, &a, 0, &b, 0, extents(16, 65536));
    w.rkey ^= 0x5a5a_0000;
    let t0 = Instant::now();
    // SAFETY: A's first MiB, registered under `a.mr` in the channel's PD,
    // is lent to the device until window 1's WindowDone, or, as it fails,
    // until the data path is closed and the channel dropped; the test does
    // not touch A's arena again.
    unsafe { dp.submit(w) }.unwrap();
    let e = match ev.blocking_recv().expect("data path ended") {
        DpEvent::Failed(e) => e,
        other => panic!("{other:?}: a remote access error must not reconnect or finish"),
    };
    eprintln!("after {:?}: {e}", t0.elapsed());
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
    // Failed at once with the device's status: not a request timeout, not a
    // reconnect (the status says which).
    assert!(!e.is_retryable(), "{e}");
    assert!(dp.is_stopped());
    // SAFETY: as above; a stopped data path refuses the window at once.
    let again = unsafe { dp.submit(job(2, OpKind::Write, &a, 0, &b, 0, extents(1, 4096))) };
    assert!(matches!(again, Err(DataPathError::Stopped)), "{again:?}");
    let r = dp.close();
    assert_eq!(
        calls.load(Relaxed),
        0,
        "a remote access error must not reconnect"
    );
    assert_eq!(r.counters.windows_done, 0);
    assert!(
        r.counters.errors.get(WcStatus::RemoteAccess) >= 1,
        "{:?}",
        r.counters.errors
    );
    assert!(
        bytes_at(&b.span(), 0, len) == before,
        "the target's memory changed"
    );
}
