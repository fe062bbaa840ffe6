//! The TCP provider end to end on 127.0.0.1: data lands byte-exact, the
//! target enforces rkey / bounds / access like a NIC, completions follow RC
//! rules (selective signaling, flush after an error), garbage and dead
//! connections don't hang or crash anything.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pattern::{pattern, pattern_into};
use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::tcp::{TcpChannel, TcpDomain, TcpTarget, DEFAULT_CONNS};
use rcp::provider::{Access, Channel, Domain, ProviderKind, Registration};

const MIB: usize = 1 << 20;

/// One side's memory: an arena, its whole-arena span, a domain.
struct Mem {
    arena: Arena,
    span: PeerSpan,
    domain: Arc<TcpDomain>,
}

impl Mem {
    fn new(bytes: usize) -> Mem {
        let arena = Arena::new(&ArenaConfig::new(bytes)).unwrap();
        let span = PeerSpan::new(&arena, arena.addr(), arena.len()).unwrap();
        Mem {
            arena,
            span,
            domain: TcpDomain::new(),
        }
    }

    fn reg(&self, off: usize, len: usize, access: Access) -> Arc<dyn Registration> {
        let s = PeerSpan::new(&self.arena, self.arena.addr() + off as u64, len).unwrap();
        // SAFETY: the tests touch the arena's bytes only while no request
        // of theirs names them.
        unsafe { self.domain.register(&s, access) }.unwrap()
    }

    fn addr(&self, off: usize) -> u64 {
        self.arena.addr() + off as u64
    }

    fn fill(&self, off: usize, len: usize, seed: u64) {
        // SAFETY: the test touches this range only between requests: none in flight names it now.
        unsafe { self.span.with_mut(off, len, |b| pattern_into(b, seed)) }.unwrap();
    }

    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.span.with(off, len, |b| b.to_vec()).unwrap()
    }

    fn snapshot(&self) -> Vec<u8> {
        self.bytes(0, self.arena.len())
    }
}

/// A target side and an initiator side joined by one channel.
struct Rig {
    remote: Mem,
    local: Mem,
    target: TcpTarget,
    /// Registration of the whole remote arena (write + read).
    rreg: Arc<dyn Registration>,
    /// Registration of the whole local arena (local write).
    lreg: Arc<dyn Registration>,
    ch: TcpChannel,
}

fn rig(remote_bytes: usize, local_bytes: usize, depth: u32) -> Rig {
    let remote = Mem::new(remote_bytes);
    let local = Mem::new(local_bytes);
    let target = TcpTarget::bind(remote.domain.clone(), "127.0.0.1:0").unwrap();
    let rreg = remote.reg(
        0,
        remote.arena.len(),
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let lreg = local.reg(0, local.arena.len(), Access::LOCAL_WRITE);
    let ch = TcpChannel::connect_endpoint(
        local.domain.clone(),
        &target.endpoint(),
        DEFAULT_CONNS,
        depth,
    )
    .unwrap();
    assert_eq!(ch.kind(), ProviderKind::Tcp);
    Rig {
        remote,
        local,
        target,
        rreg,
        lreg,
        ch,
    }
}

impl Rig {
    fn channel(&self, depth: u32) -> TcpChannel {
        TcpChannel::connect(
            self.local.domain.clone(),
            self.target.local_addr(),
            DEFAULT_CONNS,
            depth,
        )
        .unwrap()
    }

    #[allow(clippy::too_many_arguments)]
    fn wr(
        &self,
        wr_id: u64,
        kind: OpKind,
        loff: usize,
        roff: usize,
        len: usize,
        rkey: u32,
        signaled: bool,
    ) -> WorkRequest {
        WorkRequest {
            wr_id,
            kind,
            local: LocalSeg {
                addr: self.local.addr(loff),
                len: len as u32,
                lkey: self.lreg.lkey(),
            },
            remote: RemoteSeg {
                addr: self.remote.addr(roff),
                rkey,
            },
            signaled,
            inline: false,
        }
    }
}

/// Collect exactly `n` completions or panic after `timeout`.
fn collect(ch: &dyn Channel, n: usize, timeout: Duration) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 64];
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        let k = ch.poll(&mut buf[..want]).unwrap();
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            let now = Instant::now();
            assert!(
                now < deadline,
                "timed out with {} of {n} completions: {out:?}",
                out.len()
            );
            ch.arm().unwrap();
            ch.wait(deadline - now).unwrap();
        }
    }
    out
}

/// No further completion shows up within `quiet`.
fn assert_quiet(ch: &dyn Channel, quiet: Duration) {
    ch.wait(quiet).unwrap();
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 8];
    let k = ch.poll(&mut buf).unwrap();
    assert_eq!(k, 0, "unexpected completions: {:?}", &buf[..k]);
}

/// A hang guard: long enough for any machine, the tests wait for events.
const T: Duration = Duration::from_secs(120);

/// `wait(timeout)` on a thread of its own: what it returned, or `None` if it
/// had not returned within the hang guard `T` (a wait longer than `T`).
fn wait_elsewhere(ch: &TcpChannel, woken_from: impl FnOnce()) -> Option<bool> {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || tx.send(ch.wait(T * 10).unwrap()));
        woken_from();
        let got = rx.recv_timeout(T).ok();
        if got.is_none() {
            // Let the scope end: the waiter would block for 10 T.
            ch.wake();
        }
        got
    })
}

#[test]
fn wake_ends_a_blocked_wait_without_an_event_and_is_kept_until_one_waits() {
    let r = rig(1 << 20, 1 << 20, 16);
    // Woken before the wait starts: the wait sees it and returns at once.
    r.ch.wake();
    assert_eq!(
        wait_elsewhere(&r.ch, || {}),
        Some(false),
        "a wake before the wait"
    );
    // Woken while (or before) it blocks, a wait far longer than the guard.
    assert_eq!(
        wait_elsewhere(&r.ch, || r.ch.wake()),
        Some(false),
        "a wake during the wait"
    );
    // A wake is consumed by the wait it ended (a later wait runs to its
    // timeout), and the channel still completes what is posted after.
    assert!(!r.ch.wait(Duration::from_millis(1)).unwrap());
    let wr = r.wr(1, OpKind::Write, 0, 0, 4096, r.rreg.rkey(), true);
    // SAFETY: both ranges lie in the rig's registered arenas, which outlive
    // the request; the test touches neither until its completion.
    unsafe { r.ch.post(&[wr]).unwrap() };
    let got = collect(&r.ch, 1, T);
    assert_eq!(got[0].status, WcStatus::Success);
}

#[test]
fn write_then_read_blocks_from_4k_to_4m() {
    let r = rig(16 * MIB, 16 * MIB, 64);
    let rkey = r.rreg.rkey();
    let mut size = 4096;
    let mut id = 0;
    while size <= 4 * MIB {
        let seed = size as u64;
        r.local.fill(0, size, seed);
        id += 1;
        // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
        unsafe {
            r.ch.post(&[r.wr(id, OpKind::Write, 0, 4 * MIB, size, rkey, true)])
        }
        .unwrap();
        let wcs = collect(&r.ch, 1, T);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (id, WcStatus::Success));
        assert!(
            r.remote.bytes(4 * MIB, size) == pattern(size, seed),
            "WRITE of {size} bytes differs"
        );
        // Read it back into a zeroed, different local region.
        // SAFETY: the test touches this range only between requests: none in flight names it now.
        unsafe { r.local.span.with_mut(8 * MIB, size, |b| b.fill(0)) }.unwrap();
        id += 1;
        // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
        unsafe {
            r.ch.post(&[r.wr(id, OpKind::Read, 8 * MIB, 4 * MIB, size, rkey, true)])
        }
        .unwrap();
        let wcs = collect(&r.ch, 1, T);
        assert_eq!(
            wcs[0],
            WorkCompletion {
                wr_id: id,
                status: WcStatus::Success,
                byte_len: size as u32
            }
        );
        assert!(
            r.local.bytes(8 * MIB, size) == pattern(size, seed),
            "READ of {size} bytes differs"
        );
        size *= 4;
    }
    assert_quiet(&r.ch, Duration::from_millis(50));
    assert_eq!(r.ch.outstanding(), 0);
}

#[test]
fn chain_of_32_with_only_the_last_signaled_completes_once() {
    let r = rig(16 * MIB, 16 * MIB, 64);
    let blk = 64 << 10;
    // 2 MiB in the chain: split over every connection, so the last request's
    // completion must wait for the others.
    for i in 0..32 {
        r.local.fill(i * blk, blk, 1000 + i as u64);
    }
    let chain: Vec<_> = (0..32)
        .map(|i| {
            r.wr(
                i as u64,
                OpKind::Write,
                i * blk,
                (31 - i) * blk,
                blk,
                r.rreg.rkey(),
                i == 31,
            )
        })
        .collect();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&chain) }.unwrap();
    let wcs = collect(&r.ch, 1, T);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (31, WcStatus::Success));
    // Every write retired by that completion has landed.
    for i in 0..32 {
        assert!(
            r.remote.bytes((31 - i) * blk, blk) == pattern(blk, 1000 + i as u64),
            "write {i} did not land"
        );
    }
    assert_quiet(&r.ch, Duration::from_millis(200));
    assert_eq!(r.ch.outstanding(), 0);
}

/// Post one request expected to fail remotely; check the status and that the
/// target's memory is untouched.
fn expect_remote_access(r: &Rig, wr: WorkRequest) {
    let before = r.remote.snapshot();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&[wr]) }.unwrap();
    let wcs = collect(&r.ch, 1, T);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (wr.wr_id, WcStatus::RemoteAccess)
    );
    assert!(r.remote.snapshot() == before, "target memory changed");
    assert!(r.ch.is_broken());
}

#[test]
fn wrong_rkey_is_a_remote_access_error_and_writes_nothing() {
    let r = rig(4 * MIB, 4 * MIB, 16);
    r.local.fill(0, 65536, 7);
    let bad = r.rreg.rkey() ^ 0x00a5_5a00;
    expect_remote_access(&r, r.wr(9, OpKind::Write, 0, 0, 65536, bad, true));
}

#[test]
fn out_of_bounds_is_a_remote_access_error_and_writes_nothing() {
    let r = rig(4 * MIB, 4 * MIB, 16);
    r.local.fill(0, 65536, 8);
    // A window in the middle of the arena: one byte past its end is still
    // arena memory, which must not be written.
    let win = r.remote.reg(MIB, 64 << 10, Access::REMOTE_WRITE);
    expect_remote_access(
        &r,
        r.wr(1, OpKind::Write, 0, MIB + 4096, 64 << 10, win.rkey(), false),
    );
    // Below the start, on a fresh channel.
    let r2 = Rig {
        ch: r.channel(16),
        ..r
    };
    expect_remote_access(
        &r2,
        r2.wr(2, OpKind::Write, 0, MIB - 1, 16, win.rkey(), true),
    );
}

#[test]
fn read_without_remote_read_right_is_a_remote_access_error() {
    let r = rig(4 * MIB, 4 * MIB, 16);
    let win = r.remote.reg(0, MIB, Access::REMOTE_WRITE);
    let before = r.local.snapshot();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe {
        r.ch.post(&[r.wr(3, OpKind::Read, 0, 0, 4096, win.rkey(), true)])
    }
    .unwrap();
    let wcs = collect(&r.ch, 1, T);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (3, WcStatus::RemoteAccess));
    assert!(r.local.snapshot() == before, "local memory changed");
    // A WRITE-only window does accept writes (on a fresh channel).
    let ch = r.channel(16);
    r.local.fill(0, 4096, 33);
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { ch.post(&[r.wr(4, OpKind::Write, 0, 0, 4096, win.rkey(), true)]) }.unwrap();
    assert_eq!(collect(&ch, 1, T)[0].status, WcStatus::Success);
    assert!(r.remote.bytes(0, 4096) == pattern(4096, 33));
}

#[test]
fn revoked_registration_is_a_remote_access_error() {
    let r = rig(4 * MIB, 4 * MIB, 16);
    let win = r
        .remote
        .reg(0, MIB, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let rkey = win.rkey();
    r.local.fill(0, 4096, 5);
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&[r.wr(1, OpKind::Write, 0, 0, 4096, rkey, true)]) }.unwrap();
    assert_eq!(collect(&r.ch, 1, T)[0].status, WcStatus::Success);
    drop(win);
    r.local.fill(0, 4096, 6);
    expect_remote_access(&r, r.wr(2, OpKind::Write, 0, 0, 4096, rkey, true));
    assert!(r.remote.bytes(0, 4096) == pattern(4096, 5));
}

#[test]
fn after_an_error_the_rest_and_later_posts_are_flushed() {
    let r = rig(4 * MIB, 4 * MIB, 64);
    let blk = 4096;
    r.local.fill(0, 8 * blk, 77);
    let before = r.remote.snapshot();
    // All unsignaled; #3 names a bad rkey. Small chain: one connection.
    let chain: Vec<_> = (0..8)
        .map(|i| {
            let rkey = if i == 3 { 0xdead_beef } else { r.rreg.rkey() };
            r.wr(i as u64, OpKind::Write, i * blk, i * blk, blk, rkey, false)
        })
        .collect();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&chain) }.unwrap();
    // The error first, then flushes; #0..#2 may have succeeded silently.
    let first = collect(&r.ch, 1, T);
    assert_eq!(
        (first[0].wr_id, first[0].status),
        (3, WcStatus::RemoteAccess)
    );
    let rest = collect(&r.ch, 4, T);
    for (k, wc) in rest.iter().enumerate() {
        assert_eq!(wc.status, WcStatus::Flushed, "{k}: {wc:?}");
    }
    let mut flushed: Vec<u64> = rest.iter().map(|w| w.wr_id).collect();
    // Anything more can only be flushes of #0..#2.
    let mut buf = [first[0]; 8];
    std::thread::sleep(Duration::from_millis(100));
    let k = r.ch.poll(&mut buf).unwrap();
    for wc in &buf[..k] {
        assert_eq!(wc.status, WcStatus::Flushed);
        assert!(wc.wr_id < 3, "{wc:?}");
        flushed.push(wc.wr_id);
    }
    flushed.sort();
    flushed.dedup();
    assert_eq!(flushed.len(), 4 + k, "every request completes once");
    assert!((4..8).all(|i| flushed.contains(&i)));
    // Nothing after the bad request was executed.
    assert!(r.remote.bytes(3 * blk, 5 * blk) == before[3 * blk..8 * blk]);
    // Later posts complete with Flushed, signaled or not.
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe {
        r.ch.post(&[
            r.wr(100, OpKind::Write, 0, 0, blk, r.rreg.rkey(), false),
            r.wr(101, OpKind::Read, 0, 0, blk, r.rreg.rkey(), true),
        ])
    }
    .unwrap();
    let later = collect(&r.ch, 2, T);
    assert_eq!(
        later
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        vec![(100, WcStatus::Flushed), (101, WcStatus::Flushed)]
    );
    assert_eq!(r.ch.outstanding(), 0);
}

#[test]
fn bad_local_segments_are_local_protection_errors_and_post_nothing() {
    let r = rig(4 * MIB, 4 * MIB, 16);
    let before = r.remote.snapshot();
    let mut wr = r.wr(1, OpKind::Write, 0, 0, 4096, r.rreg.rkey(), true);
    wr.local.lkey ^= 1;
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&[wr]) }.unwrap();
    let wcs = collect(&r.ch, 1, T);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (1, WcStatus::LocalProtection)
    );
    assert!(r.ch.is_broken());
    // A READ into a registration without LOCAL_WRITE, on a fresh channel.
    let ro = r.local.reg(0, MIB, Access::LOCAL_READ);
    let ch = r.channel(16);
    let mut wr = r.wr(2, OpKind::Read, 0, 0, 4096, r.rreg.rkey(), true);
    wr.local.lkey = ro.lkey();
    let lbefore = r.local.snapshot();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { ch.post(&[wr]) }.unwrap();
    assert_eq!(collect(&ch, 1, T)[0].status, WcStatus::LocalProtection);
    // Out of the local registration's bounds.
    let ch = r.channel(16);
    let mut wr = r.wr(3, OpKind::Write, MIB - 100, 0, 4096, r.rreg.rkey(), true);
    wr.local.lkey = ro.lkey();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { ch.post(&[wr]) }.unwrap();
    assert_eq!(collect(&ch, 1, T)[0].status, WcStatus::LocalProtection);
    assert!(r.local.snapshot() == lbefore);
    assert!(r.remote.snapshot() == before);
}

#[test]
fn posting_past_the_depth_is_refused() {
    let r = rig(4 * MIB, 4 * MIB, 4);
    assert_eq!(r.ch.caps().sq_depth, 4);
    assert_eq!(r.ch.caps().max_sge, 1);
    let chain: Vec<_> = (0..5)
        .map(|i| r.wr(i, OpKind::Write, 0, 0, 4096, r.rreg.rkey(), true))
        .collect();
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    let e = unsafe { r.ch.post(&chain) }.unwrap_err();
    assert_eq!(e.posted, 0);
    assert!(e.to_string().contains("depth 4"), "{e}");
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&chain[..4]) }.unwrap();
    assert_eq!(collect(&r.ch, 4, T).len(), 4);
}

#[test]
fn garbage_on_one_connection_does_not_disturb_a_valid_channel() {
    let r = rig(16 * MIB, 16 * MIB, 128);
    let addr = r.target.local_addr();
    // Several kinds of garbage, each on its own raw connection.
    let mut junk: Vec<Vec<u8>> = Vec::new();
    junk.push(pattern(1 << 20, 99)); // random bytes
    let mut hdr = vec![0u8; 32];
    hdr[..4].copy_from_slice(b"RCPT");
    hdr[4] = 1;
    hdr[5] = 7; // unknown op
    junk.push(hdr.clone());
    hdr[5] = 1;
    hdr[28..32].copy_from_slice(&u32::MAX.to_le_bytes()); // absurd length
    junk.push(hdr.clone());
    hdr[4] = 200; // unknown version
    junk.push(hdr);
    junk.push(b"RCPT\x01\x01".to_vec()); // truncated header, then EOF
    let attackers: Vec<_> = junk
        .into_iter()
        .map(|bytes| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let _ = s.write_all(&bytes);
                let _ = s.shutdown(std::net::Shutdown::Write);
                // The target closes the connection without answering.
                let mut sink = Vec::new();
                let n = s.read_to_end(&mut sink);
                assert!(
                    matches!(n, Ok(0))
                        || n.is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock),
                    "target answered garbage with {} bytes",
                    sink.len()
                );
            })
        })
        .collect();
    // Meanwhile: 64 x 128 KiB written then read back.
    let blk = 128 << 10;
    for round in 0..4u64 {
        for i in 0..64 {
            r.local.fill(i * blk, blk, round * 100 + i as u64);
        }
        let writes: Vec<_> = (0..64)
            .map(|i| {
                r.wr(
                    i as u64,
                    OpKind::Write,
                    i * blk,
                    i * blk,
                    blk,
                    r.rreg.rkey(),
                    i % 16 == 15,
                )
            })
            .collect();
        // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
        unsafe { r.ch.post(&writes) }.unwrap();
        let wcs = collect(&r.ch, 4, T);
        assert!(wcs.iter().all(|w| w.status.is_success()), "{wcs:?}");
        // SAFETY: the test touches this range only between requests: none in flight names it now.
        unsafe { r.local.span.with_mut(8 * MIB, 8 * MIB, |b| b.fill(0)) }.unwrap();
        let reads: Vec<_> = (0..64)
            .map(|i| {
                r.wr(
                    i as u64,
                    OpKind::Read,
                    8 * MIB + i * blk,
                    i * blk,
                    blk,
                    r.rreg.rkey(),
                    true,
                )
            })
            .collect();
        // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
        unsafe { r.ch.post(&reads) }.unwrap();
        let wcs = collect(&r.ch, 64, T);
        assert!(wcs.iter().all(|w| w.status.is_success()), "{wcs:?}");
        for i in 0..64 {
            assert!(r.local.bytes(8 * MIB + i * blk, blk) == pattern(blk, round * 100 + i as u64));
        }
    }
    for a in attackers {
        a.join().unwrap();
    }
    assert!(!r.ch.is_broken());
    // And the target still accepts new channels.
    let ch = r.channel(16);
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { ch.post(&[r.wr(1, OpKind::Read, 0, 0, 4096, r.rreg.rkey(), true)]) }.unwrap();
    assert_eq!(collect(&ch, 1, T)[0].status, WcStatus::Success);
}

#[test]
fn hundred_thousand_small_writes_respecting_depth() {
    const N: usize = 100_000;
    const CHAIN: usize = 32;
    const DEPTH: usize = 128;
    const BLK: usize = 4096;
    let r = rig(4 * MIB, 2 * MIB, DEPTH as u32);
    // 256 distinct local sources, 1024 target slots.
    for k in 0..256 {
        r.local.fill(k * BLK, BLK, 5000 + k as u64);
    }
    let mut outstanding = 0;
    let mut posted = 0;
    let mut retired = 0;
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 16];
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut chain = Vec::with_capacity(CHAIN);
    while retired < N {
        while posted < N && outstanding + CHAIN <= DEPTH {
            chain.clear();
            for i in posted..posted + CHAIN {
                chain.push(r.wr(
                    i as u64,
                    OpKind::Write,
                    (i % 256) * BLK,
                    (i % 1024) * BLK,
                    BLK,
                    r.rreg.rkey(),
                    i % CHAIN == CHAIN - 1,
                ));
            }
            // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
            unsafe { r.ch.post(&chain) }.unwrap();
            posted += CHAIN;
            outstanding += CHAIN;
        }
        let k = r.ch.poll(&mut buf).unwrap();
        for wc in &buf[..k] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_eq!(wc.wr_id as usize % CHAIN, CHAIN - 1);
            // A signaled completion retires its whole chain.
            outstanding -= CHAIN;
            retired += CHAIN;
        }
        if k == 0 {
            assert!(Instant::now() < deadline, "stuck at {retired}/{N}");
            r.ch.arm().unwrap();
            r.ch.wait(Duration::from_millis(100)).unwrap();
        }
    }
    assert_eq!(r.ch.outstanding(), 0);
    // The last write to slot s came from local block s % 256.
    for s in 0..1024 {
        assert!(
            r.remote.bytes(s * BLK, BLK) == pattern(BLK, 5000 + (s % 256) as u64),
            "slot {s}"
        );
    }
}

#[test]
fn killing_the_target_mid_stream_fails_in_flight_requests_without_hanging() {
    let mut r = rig(16 * MIB, 4 * MIB, 128);
    let ch = Arc::new(r.channel(128));
    let blk = 64 << 10;
    r.local.fill(0, 4 * MIB, 1);
    let rkey = r.rreg.rkey();
    let raddr = r.remote.addr(0);
    let lkey = r.lreg.lkey();
    let laddr = r.local.addr(0);
    // Requests completed so far: the target is killed once some have, so
    // the kill lands mid-stream on any machine.
    let completed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let poster = {
        let (ch, completed) = (ch.clone(), completed.clone());
        std::thread::spawn(move || {
            // Every request signaled: each must complete exactly once.
            let mut posted = 0u64;
            let mut done: Vec<WorkCompletion> = Vec::new();
            let mut buf = [WorkCompletion {
                wr_id: 0,
                status: WcStatus::Success,
                byte_len: 0,
            }; 64];
            let deadline = Instant::now() + T;
            loop {
                let errored = done.iter().any(|w| !w.status.is_success());
                if !errored && posted - (done.len() as u64) <= 112 {
                    let chain: Vec<_> = (posted..posted + 16)
                        .map(|i| WorkRequest {
                            wr_id: i,
                            kind: OpKind::Write,
                            local: LocalSeg {
                                addr: laddr + (i % 64) * blk as u64,
                                len: blk as u32,
                                lkey,
                            },
                            // 256 target slots, at most 128 in flight: disjoint.
                            remote: RemoteSeg {
                                addr: raddr + (i % 256) * blk as u64,
                                rkey,
                            },
                            signaled: true,
                            inline: false,
                        })
                        .collect();
                    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
                    unsafe { ch.post(&chain) }.unwrap();
                    posted += 16;
                }
                let k = ch.poll(&mut buf).unwrap();
                done.extend_from_slice(&buf[..k]);
                completed.store(done.len() as u64, std::sync::atomic::Ordering::Relaxed);
                if errored && done.len() as u64 == posted {
                    return done;
                }
                assert!(
                    Instant::now() < deadline,
                    "hung: {} of {posted} completed",
                    done.len()
                );
                if k == 0 {
                    ch.wait(Duration::from_millis(10)).unwrap();
                }
            }
        })
    };
    let guard = Instant::now() + T;
    while completed.load(std::sync::atomic::Ordering::Relaxed) < 256 {
        assert!(Instant::now() < guard, "no requests completed");
        assert!(!poster.is_finished(), "the poster ended before the kill");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    r.target.shutdown();
    let done = poster.join().unwrap();
    eprintln!(
        "{} requests completed, {} ok, all within {:?} of the kill",
        done.len(),
        done.iter().filter(|w| w.status.is_success()).count(),
        t0.elapsed()
    );
    let first_err = done.iter().position(|w| !w.status.is_success()).unwrap();
    assert!(
        matches!(
            done[first_err].status,
            WcStatus::RetryExceeded | WcStatus::Fatal
        ),
        "{:?}",
        done[first_err]
    );
    assert!(
        done[first_err + 1..]
            .iter()
            .all(|w| w.status == WcStatus::Flushed),
        "only flushes after the first error"
    );
    let mut ids: Vec<u64> = done.iter().map(|w| w.wr_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), done.len(), "each request completes once");
    // Later posts are flushed too.
    let mut wr = r.wr(1 << 40, OpKind::Write, 0, 0, 4096, rkey, true);
    wr.signaled = false;
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { ch.post(&[wr]) }.unwrap();
    assert_eq!(collect(&*ch, 1, T)[0].status, WcStatus::Flushed);
    // The first channel of the rig is dead too.
    // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
    unsafe { r.ch.post(&[r.wr(7, OpKind::Read, 0, 0, 4096, rkey, true)]) }.unwrap();
    assert!(!collect(&r.ch, 1, T)[0].status.is_success());
}

/// 1 MiB WRITEs over loopback at depth 64 in chains of 16 on several
/// connections: every write completes, and the target's 64 MiB hold what
/// was sent (they held another pattern before, so each of the first 64
/// writes must have landed). It prints the throughput, a figure to compare
/// with iperf3 (scripts/bench-native.sh runs it in release with
/// `RCP_TCP_BW_GIB`; by default 256 MiB move), never an assertion.
#[test]
fn bandwidth_of_1mib_writes_over_loopback() {
    const BLK: usize = MIB;
    const DEPTH: usize = 64;
    const CHAIN: usize = 16;
    let total: usize = std::env::var("RCP_TCP_BW_GIB")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .map_or(256 * MIB, |g| g << 30);
    let conns: usize = std::env::var("RCP_TCP_BW_CONNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_CONNS);
    let r = rig(64 * MIB, 64 * MIB, DEPTH as u32);
    let ch = TcpChannel::connect(
        r.local.domain.clone(),
        r.target.local_addr(),
        conns,
        DEPTH as u32,
    )
    .unwrap();
    r.local.fill(0, 64 * MIB, 3);
    r.remote.fill(0, 64 * MIB, 4);
    let n = total / BLK;
    let (mut posted, mut retired, mut outstanding) = (0, 0, 0);
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 16];
    let t0 = Instant::now();
    while retired < n {
        while posted < n && outstanding + CHAIN <= DEPTH {
            let chain: Vec<_> = (posted..posted + CHAIN)
                .map(|i| {
                    r.wr(
                        i as u64,
                        OpKind::Write,
                        (i % 64) * BLK,
                        (i % 64) * BLK,
                        BLK,
                        r.rreg.rkey(),
                        i % CHAIN == CHAIN - 1,
                    )
                })
                .collect();
            // SAFETY: the rig's arenas are registered in the channel's domain; the test touches a posted range again only after collecting the completion that retires it (or the channel's error and its flushes).
            unsafe { ch.post(&chain) }.unwrap();
            posted += CHAIN;
            outstanding += CHAIN;
        }
        let k = ch.poll(&mut buf).unwrap();
        for wc in &buf[..k] {
            assert!(wc.status.is_success(), "{wc:?}");
            outstanding -= CHAIN;
            retired += CHAIN;
        }
        if k == 0 {
            ch.wait(Duration::from_millis(100)).unwrap();
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    assert_eq!((posted, retired, outstanding), (n, n, 0));
    assert!(
        r.remote.bytes(0, 64 * MIB) == r.local.bytes(0, 64 * MIB),
        "the target's bytes differ from what was written"
    );
    let bytes = (n * BLK) as f64;
    println!(
        "tcp provider: {} x 1 MiB WRITEs over loopback, {conns} connections, depth {DEPTH}, \
         chains of {CHAIN}: {:.2} GiB in {dt:.2} s = {:.2} GiB/s ({:.1} Gbit/s)",
        n,
        bytes / (1u64 << 30) as f64,
        bytes / dt / (1u64 << 30) as f64,
        bytes * 8.0 / dt / 1e9
    );
}

/// Takes a session's messages: answers with the first byte of `span` as
/// it is when the message is handled, then the payload reversed.
struct FirstByteThenReversed(PeerSpan, Arc<AfterAnswer>);

/// What a taker's work after its answer saw: whether the peer had read
/// the answer by then.
#[derive(Default)]
struct AfterAnswer {
    read: AtomicBool,
    ran: AtomicUsize,
    ran_after_read: AtomicBool,
}

impl rcp::provider::tcp::Messages for FirstByteThenReversed {
    fn message(&self, payload: &[u8]) -> rcp::provider::tcp::Answer {
        let mut a = self.0.with(0, 1, |b| b.to_vec()).unwrap();
        a.extend(payload.iter().rev());
        let w = self.1.clone();
        rcp::provider::tcp::Answer {
            bytes: a,
            // Runs once the answer is sent, so the peer can read it while
            // this waits. Run before (the answer held back), it would wait
            // out its bound and record that it ran first.
            then: Some(Box::new(move || {
                let t0 = Instant::now();
                while !w.read.load(SeqCst) && t0.elapsed() < Duration::from_secs(30) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                w.ran_after_read.store(w.read.load(SeqCst), SeqCst);
                w.ran.fetch_add(1, SeqCst);
            })),
        }
    }
}

/// A MESSAGE on a session's connection goes to whoever takes the
/// session's messages, after every request the connection carried before
/// it (the WRITE before it has landed when it is handled), and its answer
/// comes back in order; on a session that takes none it is answered
/// "no messages" and the connection goes on; one longer than the limit
/// drops the connection.
#[test]
fn messages_reach_their_sessions_taker_in_order_and_no_one_else() {
    use rcp::provider::tcp::wire::{Hello, Op, Request, Response, Status, MAX_MESSAGE, RESP_LEN};
    let target = TcpTarget::bind_sessions("127.0.0.1:0").unwrap();
    let taken = Mem::new(MIB);
    let d1 = taken.domain.clone();
    let reg = taken.reg(0, 4096, Access::REMOTE_WRITE);
    let addr = taken.addr(0);
    let after = Arc::new(AfterAnswer::default());
    d1.take_messages(Arc::new(FirstByteThenReversed(
        taken.span.clone(),
        after.clone(),
    )));
    let d2 = TcpDomain::new();
    let (b1, b2) = (
        target.bind_session(&d1).unwrap(),
        target.bind_session(&d2).unwrap(),
    );
    let open = |key| {
        let mut s = TcpStream::connect(target.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(&Hello { key }.encode()).unwrap();
        s
    };
    let message = |tag, payload: &[u8]| {
        let mut b = Request {
            op: Op::Message,
            tag,
            addr: 0,
            rkey: 0,
            len: payload.len() as u32,
            prompt: false,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(payload);
        b
    };
    let answer = |s: &mut TcpStream| {
        let mut h = [0u8; RESP_LEN];
        s.read_exact(&mut h).unwrap();
        let r = Response::decode(&h).unwrap();
        let mut body = vec![0u8; r.len as usize];
        s.read_exact(&mut body).unwrap();
        (r.status, r.tag, body)
    };

    // A WRITE of 0x5a and a MESSAGE, pipelined in one send.
    let mut s = open(b1.key());
    let mut out = Request {
        op: Op::Write,
        tag: 1,
        addr,
        rkey: reg.rkey(),
        len: 4096,
        prompt: false,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(&[0x5a; 4096]);
    out.extend(message(2, b"abc"));
    s.write_all(&out).unwrap();
    assert_eq!(answer(&mut s), (Status::Ok, 1, vec![]));
    assert_eq!(answer(&mut s), (Status::Ok, 2, b"\x5acba".to_vec()));
    // What the taker left for after its answer ran once that was sent.
    after.read.store(true, SeqCst);
    let t0 = Instant::now();
    while after.ran.load(SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "never ran");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        after.ran_after_read.load(SeqCst),
        "ran before its answer was sent"
    );

    // No taker: answered, and the connection serves the next one.
    let mut s2 = open(b2.key());
    s2.write_all(&message(7, b"x")).unwrap();
    assert_eq!(answer(&mut s2), (Status::NoMessages, 7, vec![]));
    s2.write_all(&message(8, b"y")).unwrap();
    assert_eq!(answer(&mut s2), (Status::NoMessages, 8, vec![]));

    // Too long: the connection is dropped unanswered.
    let mut hdr = message(9, b"")[..32].to_vec();
    hdr[28..32].copy_from_slice(&(MAX_MESSAGE + 1).to_le_bytes());
    s.write_all(&hdr).unwrap();
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "dropped, unanswered");
}

#[test]
fn a_write_is_answered_before_the_target_waits_for_the_next_one() {
    // A stream of WRITEs keeps part of the next one in the target's
    // buffer: the answer to the one executed must leave then, not when
    // the stream pauses (a window that landed would be told only with the
    // windows after it: docs/fanout.md). Here the initiator sends one
    // WRITE whole and the next one in part, then waits for the first
    // answer before it sends the rest.
    use rcp::provider::tcp::wire::{Op, Request, Response, Status, RESP_LEN};
    let r = rig(MIB, MIB, 16);
    let write = |tag, off: usize, len: usize| {
        let mut b = Request {
            op: Op::Write,
            tag,
            addr: r.remote.addr(off),
            rkey: r.rreg.rkey(),
            len: len as u32,
            // Waited on: answered before the target reads on.
            prompt: true,
        }
        .encode()
        .to_vec();
        b.extend(std::iter::repeat_n(tag as u8, len));
        b
    };
    let mut s = TcpStream::connect(r.target.local_addr()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let (first, second) = (write(1, 0, 64 << 10), write(2, 64 << 10, 64 << 10));
    let mut out = first;
    out.extend_from_slice(&second[..32 + 1000]);
    s.write_all(&out).unwrap();
    let mut h = [0u8; RESP_LEN];
    s.read_exact(&mut h)
        .expect("the first WRITE answered while the second is incomplete");
    let resp = Response::decode(&h).unwrap();
    assert_eq!((resp.status, resp.tag), (Status::Ok, 1));
    s.write_all(&second[32 + 1000..]).unwrap();
    s.read_exact(&mut h).unwrap();
    assert_eq!(Response::decode(&h).unwrap().tag, 2);
    assert_eq!(r.remote.bytes(64 << 10, 64 << 10), vec![2u8; 64 << 10]);
}

#[test]
fn a_post_does_not_wait_for_the_link_and_a_closed_channel_lets_go() {
    // A target that accepts and never reads: the sockets fill. Like a
    // NIC's send queue, `post` queues and returns (the data path's thread
    // that posts also takes the completions); dropping the channel then
    // ends its threads. The payload is larger than any socket buffers.
    let remote = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = remote.local_addr().unwrap();
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for c in remote.incoming().take(DEFAULT_CONNS) {
            conns.push(c.unwrap());
        }
        conns
    });
    let local = Mem::new(64 * MIB);
    let lreg = local.reg(0, 64 * MIB, Access::LOCAL_WRITE);
    let ch = TcpChannel::connect(local.domain.clone(), addr, DEFAULT_CONNS, 64).unwrap();
    let conns = held.join().unwrap();
    let wrs: Vec<WorkRequest> = (0..64)
        .map(|i| WorkRequest {
            wr_id: i,
            kind: OpKind::Write,
            local: LocalSeg {
                addr: local.addr(i as usize * MIB),
                len: MIB as u32,
                lkey: lreg.lkey(),
            },
            remote: RemoteSeg {
                addr: 0x1000,
                rkey: 1,
            },
            signaled: i == 63,
            inline: false,
        })
        .collect();
    let ch = Arc::new(ch);
    let (tx, rx) = std::sync::mpsc::channel();
    let poster = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            // SAFETY: `local` outlives the channel (its threads are joined
            // when the last clone drops, before the arena); nothing else
            // touches those bytes.
            unsafe { ch.post(&wrs) }.unwrap();
            tx.send(()).unwrap();
        })
    };
    let posted = rx.recv_timeout(T);
    if posted.is_err() {
        // Cut the connections under the post so the test ends.
        drop(conns);
        poster.join().unwrap();
        panic!("post waited for a link that carries nothing");
    }
    poster.join().unwrap();
    assert_eq!(ch.outstanding(), 64);
    drop(ch);
    drop(conns);
}
