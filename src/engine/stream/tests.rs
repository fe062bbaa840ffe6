//! Stream tests against an in-test fake device: an RC send queue that
//! completes in order, reports only signaled successes, always reports an
//! error, and flushes everything behind an error.

use std::collections::{BTreeSet, HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::engine::batch::BatchPolicy;

const SLOT: u64 = 4096;

fn remote_base(id: u64) -> u64 {
    0x8000_0000_0000 + (id << 32)
}

fn local_base(id: u64) -> u64 {
    0x1000_0000_0000 + (id << 32)
}

/// A window of `n` extents of `len` bytes, one every 4 KiB.
fn job(id: u64, op: OpKind, n: u32, len: u32) -> WindowJob {
    WindowJob {
        id,
        op,
        local_addr: local_base(id),
        lkey: 42,
        remote_addr: remote_base(id),
        rkey: 0x77,
        extents: (0..n)
            .map(|i| Extent {
                offset: u64::from(i) * SLOT,
                len,
            })
            .collect(),
    }
}

/// The next chain of a one-rail stream, in a batch of its own.
fn transmit(s: &mut Stream, now: u64) -> Option<Batch> {
    let mut b = Batch::default();
    let rail = s.poll_transmit(now, &mut b)?;
    assert_eq!(rail, 0, "one rail");
    Some(b)
}

/// The next event of a one-rail stream, which raises no rail events.
fn event(s: &mut Stream) -> Option<Event> {
    match s.poll_event()? {
        AnyEvent::Stream(e) => Some(e),
        AnyEvent::Rail(e) => panic!("a one-rail stream raised {e:?}"),
    }
}

fn config(depth: usize, batch: usize) -> StreamConfig {
    let mut c = StreamConfig::new(depth);
    c.batch = BatchPolicy::with_batch(batch).unwrap();
    c
}

#[derive(Default)]
struct Device {
    depth: usize,
    queue: VecDeque<(WorkRequest, Option<WcStatus>)>,
    /// Ring slots in use: posted and not yet retired by a completion (an
    /// executed unsignaled request holds its slot until a later CQE).
    occupied: usize,
    executed_unretired: usize,
    max_outstanding: usize,
    /// Fail the n-th request ever posted (0-based) with this status; with
    /// `true`, the first signaled one from there on that follows an
    /// unsignaled one.
    fail: Option<(u64, WcStatus, bool)>,
    posted: u64,
    prev_unsignaled: bool,
    broken: bool,
    /// Remote addresses written or read successfully (the data landed).
    landed: HashSet<u64>,
}

impl Device {
    fn new(depth: usize) -> Self {
        Device {
            depth,
            ..Default::default()
        }
    }

    fn post(&mut self, b: &Batch) {
        assert!(!self.broken, "posted to a queue pair in error");
        for wr in &b.wrs {
            let fail = match self.fail {
                Some((n, st, false)) if n == self.posted => Some(st),
                Some((n, st, true)) if n <= self.posted && wr.signaled && self.prev_unsignaled => {
                    Some(st)
                }
                _ => None,
            };
            if fail.is_some() {
                self.fail = None;
            }
            self.prev_unsignaled = !wr.signaled;
            self.queue.push_back((*wr, fail));
            self.posted += 1;
            self.occupied += 1;
        }
        assert!(
            self.occupied <= self.depth,
            "send queue over-filled: {} > {}",
            self.occupied,
            self.depth
        );
        self.max_outstanding = self.max_outstanding.max(self.occupied);
    }

    /// Fail the next request executed with `status`.
    fn fail_next(&mut self, status: WcStatus) {
        if let Some(front) = self.queue.front_mut() {
            front.1 = Some(status);
        }
    }

    /// Execute up to `n` requests in order.
    fn complete(&mut self, n: usize) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        for _ in 0..n {
            let Some((wr, fail)) = self.queue.pop_front() else {
                break;
            };
            if let Some(status) = fail {
                out.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status,
                    byte_len: 0,
                });
                self.broken = true;
                self.occupied = 0;
                self.executed_unretired = 0;
                for (w, _) in self.queue.drain(..) {
                    out.push(WorkCompletion {
                        wr_id: w.wr_id,
                        status: WcStatus::Flushed,
                        byte_len: 0,
                    });
                }
                break;
            }
            self.landed.insert(wr.remote.addr);
            self.executed_unretired += 1;
            if wr.signaled {
                self.occupied -= self.executed_unretired;
                self.executed_unretired = 0;
                out.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Success,
                    byte_len: wr.local.len,
                });
            }
        }
        out
    }

    /// A fresh queue pair (what the runtime does before `reconnected`).
    fn replace(&mut self) {
        self.queue.clear();
        self.occupied = 0;
        self.executed_unretired = 0;
        self.prev_unsignaled = false;
        self.broken = false;
        self.fail = None;
    }
}

/// What the runtime saw.
#[derive(Default)]
struct Log {
    windows_done: Vec<u64>,
    /// Per epoch, (window, extent index) of every request posted.
    posted: HashMap<u32, Vec<(u64, u32)>>,
    errors: Vec<(ErrorCause, Recovery)>,
    timeouts: Vec<u64>,
    ready_to_reconnect: Vec<u64>,
    chains: Vec<Batch>,
}

/// remote address → (window, extent)
fn locate(wr: &WorkRequest) -> (u64, u32) {
    let off = wr.remote.addr - 0x8000_0000_0000;
    (off >> 32, ((off & 0xffff_ffff) / SLOT) as u32)
}

/// Post everything the stream offers.
fn post_all(s: &mut Stream, dev: &mut Device, log: &mut Log, now: u64) {
    while let Some(b) = transmit(s, now) {
        assert!(s.credits_in_use() <= dev.depth);
        for wr in &b.wrs {
            let (w, e) = locate(wr);
            assert_eq!(
                s.is_confirmed(w, e),
                Some(false),
                "posted a confirmed extent"
            );
            assert_eq!(
                wr.local.addr - local_base(w),
                wr.remote.addr - remote_base(w)
            );
            log.posted.entry(b.epoch).or_default().push((w, e));
        }
        dev.post(&b);
        log.chains.push(b);
    }
}

fn drain_events(s: &mut Stream, log: &mut Log) {
    while let Some(e) = event(s) {
        match e {
            Event::WindowDone { id } => log.windows_done.push(id),
            Event::ErrorBatch { cause, action, .. } => log.errors.push((cause, action)),
            Event::Timeout { wr_id, .. } => log.timeouts.push(wr_id),
            Event::ReadyToReconnect { unconfirmed, .. } => log.ready_to_reconnect.push(unconfirmed),
        }
    }
}

/// Post, execute `n` requests, complete, handle events.
fn step(s: &mut Stream, dev: &mut Device, log: &mut Log, now: u64, n: usize) {
    post_all(s, dev, log, now);
    let wcs = dev.complete(n);
    s.on_completions(0, 0, &wcs);
    drain_events(s, log);
}

fn run_to_idle(s: &mut Stream, dev: &mut Device, log: &mut Log, n: usize) {
    for i in 0..1_000_000 {
        if s.state() != State::Running || s.is_idle() {
            return;
        }
        step(s, dev, log, i, n);
    }
    panic!("no progress");
}

fn wc(wr: &WorkRequest, status: WcStatus) -> WorkCompletion {
    WorkCompletion {
        wr_id: wr.wr_id,
        status,
        byte_len: wr.local.len,
    }
}

#[test]
fn chain_of_32_signals_only_its_last() {
    let mut s = Stream::new(config(64, 32)).unwrap();
    s.add_window(job(1, OpKind::Write, 32, 4096)).unwrap();
    let b = transmit(&mut s, 0).unwrap();
    assert_eq!(b.wrs.len(), 32);
    let signaled: Vec<usize> = (0..32).filter(|&i| b.wrs[i].signaled).collect();
    assert_eq!(signaled, vec![31]);
    assert!(transmit(&mut s, 0).is_none(), "one chain, one doorbell");
    assert_eq!(s.counters().doorbells, 1);
    assert_eq!(s.counters().signaled, 1);
    // Both sides at the same offset; kinds follow the window.
    assert_eq!(b.wrs[5].remote.addr, remote_base(1) + 5 * SLOT);
    assert_eq!(b.wrs[5].local.addr, local_base(1) + 5 * SLOT);
    assert_eq!((b.wrs[5].remote.rkey, b.wrs[5].local.lkey), (0x77, 42));
    assert!(b.wrs.iter().all(|w| w.kind == OpKind::Write));
    // The signaled tail retires the whole chain.
    s.on_completions(0, 0, &[wc(&b.wrs[31], WcStatus::Success)]);
    let mut log = Log::default();
    drain_events(&mut s, &mut log);
    assert_eq!(log.windows_done, vec![1]);
    assert!(s.is_idle());
    assert_eq!(s.state(), State::Running, "no Complete: idle and running");
    assert_eq!(s.credits_in_use(), 0);
    let c = s.counters();
    assert_eq!((c.extents_confirmed, c.bytes_confirmed), (32, 32 * 4096));
    assert_eq!(
        (c.windows_done, c.posted, c.bytes_posted),
        (1, 32, 32 * 4096)
    );
}

#[test]
fn a_chain_ends_at_the_end_of_its_window() {
    // Four windows of 4 extents, room for 32 per chain: one chain per
    // window, each signaled at its window's last extent.
    let mut s = Stream::new(config(64, 32)).unwrap();
    for k in 0..4 {
        s.add_window(job(k + 1, OpKind::Write, 4, 100)).unwrap();
    }
    let mut log = Log::default();
    for k in 0..4u64 {
        let b = transmit(&mut s, 0).unwrap();
        let got: Vec<(u64, u32)> = b.wrs.iter().map(locate).collect();
        assert_eq!(got, (0..4).map(|e| (k + 1, e)).collect::<Vec<_>>());
        let signaled: Vec<usize> = (0..4).filter(|&i| b.wrs[i].signaled).collect();
        assert_eq!(signaled, vec![3]);
        // Its one completion confirms the whole window at once.
        s.on_completions(0, 0, &[wc(&b.wrs[3], WcStatus::Success)]);
        drain_events(&mut s, &mut log);
        assert_eq!(log.windows_done, (1..=k + 1).collect::<Vec<_>>());
    }
    assert!(transmit(&mut s, 0).is_none());
    assert!(s.is_idle());
    assert_eq!(s.counters().doorbells, 4);
}

#[test]
fn next_chain_is_the_chain_poll_transmit_takes() {
    // Depth 6, chains of 4: a window of 3 extents of 100, one of 5 of 7.
    let mut s = Stream::new(config(6, 4)).unwrap();
    assert_eq!(s.next_chain().map(|(_, n)| n), None, "nothing queued");
    s.add_window(job(1, OpKind::Write, 3, 100)).unwrap();
    s.add_window(job(2, OpKind::Write, 5, 7)).unwrap();
    let mut sizes = Vec::new();
    loop {
        let peek = s.next_chain().map(|(_, n)| n);
        // Peeking takes nothing.
        assert_eq!(s.next_chain().map(|(_, n)| n), peek);
        match transmit(&mut s, 0) {
            Some(b) => {
                let bytes: u64 = b.wrs.iter().map(|w| u64::from(w.local.len)).sum();
                assert_eq!(peek, Some(bytes));
                sizes.push(bytes);
            }
            None => {
                assert_eq!(peek, None);
                break;
            }
        }
    }
    // The first window's run, then the second's up to the credits left
    // (6 - 3 = 3), then nothing until completions return credits.
    assert_eq!(sizes, vec![300, 21]);
}

#[test]
fn long_run_confirms_every_extent_exactly_once() {
    let mut c = StreamConfig::new(64);
    c.batch = BatchPolicy::new(16, 5).unwrap();
    let mut s = Stream::new(c).unwrap();
    let mut dev = Device::new(64);
    let mut log = Log::default();
    // Windows of 250 extents, two queued at a time, the next when one is
    // done; the last extent of each is short.
    let mk = |id: u64| {
        let mut j = job(id, OpKind::Read, 250, 4096);
        j.extents.last_mut().unwrap().len = 123;
        j
    };
    s.add_window(mk(10)).unwrap();
    s.add_window(mk(11)).unwrap();
    let mut next = 12;
    let mut now = 0;
    while !(s.is_idle() && next == 14) {
        now += 1;
        assert!(now < 100_000, "stalled");
        step(&mut s, &mut dev, &mut log, now, 3);
        while next < 14 && log.windows_done.len() + 2 > (next - 10) as usize {
            s.add_window(mk(next)).unwrap();
            next += 1;
        }
    }
    assert_eq!(log.windows_done, vec![10, 11, 12, 13]);
    let n = 1000;
    let posted: BTreeSet<(u64, u32)> = log.posted[&0].iter().copied().collect();
    assert_eq!(posted.len(), n, "each extent posted once");
    assert_eq!(log.posted[&0].len(), n);
    let c = s.counters();
    assert_eq!(c.extents_confirmed, n as u64);
    assert_eq!(c.bytes_confirmed, 4 * (249 * 4096 + 123));
    assert_eq!(c.posted, n as u64);
    assert!(c.signaled < n as u64, "selective signaling");
    assert_eq!((c.stale, c.windows_done), (0, 4));
    assert_eq!(s.credits_in_use(), 0);
}

#[test]
fn credits_never_exceed_depth_over_100k_requests() {
    let n = 100_000u32;
    let mut s = Stream::new(config(128, 32)).unwrap();
    // 100 windows of 1000 extents.
    for w in 0..100 {
        s.add_window(job(w, OpKind::Write, n / 100, 64)).unwrap();
    }
    let mut dev = Device::new(128);
    let mut log = Log::default();
    let mut now = 0;
    let mut starved = 0;
    while !s.is_idle() {
        now += 1;
        post_all(&mut s, &mut dev, &mut log, now);
        assert!(s.credits_in_use() <= 128);
        assert_eq!(s.credits_in_use(), dev.occupied);
        if s.credits_in_use() == 128 {
            starved += 1;
            assert!(transmit(&mut s, now).is_none(), "waits for credits");
        }
        let wcs = dev.complete(7);
        s.on_completions(0, 0, &wcs);
        drain_events(&mut s, &mut log);
    }
    assert_eq!(dev.max_outstanding, 128, "fills the queue, never more");
    assert!(starved > 0);
    assert_eq!(log.windows_done.len(), 100);
    assert_eq!(s.counters().posted, u64::from(n));
    assert_eq!(s.counters().extents_confirmed, u64::from(n));
}

#[test]
fn error_mid_run_reposts_exactly_the_unconfirmed_extents() {
    let mut c = config(32, 8);
    c.batch = BatchPolicy::new(8, 3).unwrap();
    let mut s = Stream::new(c).unwrap();
    // Two windows, 100 extents each.
    s.add_window(job(1, OpKind::Write, 100, 4096)).unwrap();
    s.add_window(job(2, OpKind::Write, 100, 4096)).unwrap();
    let mut dev = Device::new(32);
    let mut log = Log::default();
    // A signaled request after the 100th fails, with an unsignaled one
    // just before it and requests behind it in the queue.
    dev.fail = Some((100, WcStatus::RetryExceeded, true));
    let mut now = 0;
    while s.state() == State::Running {
        now += 1;
        step(&mut s, &mut dev, &mut log, now, 5);
    }
    assert_eq!(s.state(), State::NeedsReconnect, "flush CQEs drained");
    assert_eq!(log.errors.len(), 1);
    let (cause, action) = log.errors[0];
    assert_eq!(action, Recovery::Reconnect);
    let ErrorCause::Completion {
        status: WcStatus::RetryExceeded,
        window,
        extent,
        ..
    } = cause
    else {
        panic!("{cause:?}");
    };
    assert_eq!(window, 2, "request 100 is the first of window 2");
    let posted0: BTreeSet<(u64, u32)> = log.posted[&0].iter().copied().collect();
    let confirmed: BTreeSet<(u64, u32)> = posted0
        .iter()
        .copied()
        .filter(|&(w, e)| s.is_confirmed(w, e) != Some(false))
        .collect();
    let unconfirmed: BTreeSet<(u64, u32)> = posted0.difference(&confirmed).copied().collect();
    assert_eq!(
        s.unconfirmed().into_iter().collect::<BTreeSet<_>>(),
        unconfirmed
    );
    assert!(!confirmed.is_empty());
    assert!(unconfirmed.contains(&(window, extent)));
    assert!(
        unconfirmed.contains(&(window, extent - 1)),
        "unsignaled requests before the error are not confirmed"
    );
    assert_eq!(log.windows_done, vec![1]);
    assert_eq!(log.ready_to_reconnect, vec![unconfirmed.len() as u64]);
    assert!(transmit(&mut s, now).is_none(), "no posting while failed");
    assert_eq!(s.counters().errors.get(WcStatus::RetryExceeded), 1);
    assert!(s.counters().errors.get(WcStatus::Flushed) > 0);

    // Reconnect: a late completion from the old queue pair is stale.
    let old = log.chains.last().unwrap().wrs[0];
    dev.replace();
    assert_eq!(s.rail_reconnected(0, 0), Ok(1));
    assert_eq!(s.credits_in_use(), 0);
    s.on_completions(0, 0, &[wc(&old, WcStatus::Success)]);
    assert_eq!(s.counters().stale, 1);
    assert!(event(&mut s).is_none(), "stale completion confirms nothing");

    run_to_idle(&mut s, &mut dev, &mut log, 5);
    assert!(s.is_idle());
    let posted1 = log.posted[&1].clone();
    // The unconfirmed extents go first, in order...
    assert_eq!(
        posted1[..unconfirmed.len()].to_vec(),
        unconfirmed.iter().copied().collect::<Vec<_>>()
    );
    // ...and no confirmed one is posted again.
    let posted1: BTreeSet<(u64, u32)> = posted1.into_iter().collect();
    assert!(posted1.is_disjoint(&confirmed));
    assert_eq!(posted1.len() + confirmed.len(), 200);
    assert_eq!(log.windows_done, vec![1, 2]);
    let c = s.counters();
    assert_eq!(
        c.extents_confirmed, 200,
        "each extent confirmed exactly once"
    );
    assert_eq!(c.reposted, unconfirmed.len() as u64);
    assert_eq!((c.reconnects, c.failures), (1, 1));
}

#[test]
fn non_retryable_error_fails_without_reconnect() {
    let mut s = Stream::new(config(32, 8)).unwrap();
    s.add_window(job(7, OpKind::Write, 64, 4096)).unwrap();
    let mut dev = Device::new(32);
    dev.fail = Some((10, WcStatus::RemoteAccess, false));
    let mut log = Log::default();
    let mut now = 0;
    while s.state() == State::Running {
        now += 1;
        step(&mut s, &mut dev, &mut log, now, 4);
    }
    assert_eq!(
        s.state(),
        State::Failed {
            status: Some(WcStatus::RemoteAccess),
            window: Some(7),
            extent: Some(10),
            reason: "non-retryable completion status"
        }
    );
    assert_eq!(log.errors.len(), 1);
    assert_eq!(log.errors[0].1, Recovery::Fail);
    assert!(log.ready_to_reconnect.is_empty());
    assert_eq!(s.rail_reconnected(0, 0), Err(StreamError::Terminal));
    assert!(transmit(&mut s, now).is_none());
    assert!(!s.is_idle(), "the window is lost, not done");
    assert_eq!(
        s.add_window(job(8, OpKind::Write, 1, 1)),
        Err(WindowError::Failed)
    );
}

#[test]
fn non_retryable_status_during_a_flush_fails() {
    let mut s = Stream::new(config(32, 4)).unwrap();
    s.add_window(job(1, OpKind::Write, 8, 4096)).unwrap();
    let b1 = transmit(&mut s, 0).unwrap();
    let b2 = transmit(&mut s, 0).unwrap();
    s.on_completions(0, 0, &[wc(&b1.wrs[3], WcStatus::RetryExceeded)]);
    assert_eq!(s.state(), State::Flushing);
    s.on_completions(0, 0, &[wc(&b2.wrs[0], WcStatus::RemoteAccess)]);
    assert!(matches!(
        s.state(),
        State::Failed {
            status: Some(WcStatus::RemoteAccess),
            ..
        }
    ));
    let mut log = Log::default();
    drain_events(&mut s, &mut log);
    let actions: Vec<Recovery> = log.errors.iter().map(|e| e.1).collect();
    assert_eq!(actions, vec![Recovery::Reconnect, Recovery::Fail]);
    // What is still outstanding retires quietly, so the runtime can tell
    // when the device is done with the memory.
    assert_eq!(s.outstanding(), 3);
    s.on_completions(0, 0, &[wc(&b2.wrs[3], WcStatus::Flushed)]);
    assert_eq!(s.outstanding(), 0);
    assert!(event(&mut s).is_none());
}

#[test]
fn retry_budget_bounds_fruitless_reconnects() {
    let mut c = config(16, 8);
    c.max_reconnects = 2;
    let mut s = Stream::new(c).unwrap();
    s.add_window(job(1, OpKind::Write, 8, 4096)).unwrap();
    let mut dev = Device::new(16);
    let mut log = Log::default();
    // Two fruitless retries are allowed; the third failure in a row fails.
    for attempt in 0..2 {
        dev.replace();
        if attempt > 0 {
            s.rail_reconnected(0, 0).unwrap();
        }
        // The first request of every epoch fails.
        dev.fail = Some((dev.posted, WcStatus::RetryExceeded, false));
        step(&mut s, &mut dev, &mut log, attempt, 8);
        assert_eq!(s.state(), State::NeedsReconnect);
    }
    dev.replace();
    s.rail_reconnected(0, 0).unwrap();
    dev.fail = Some((dev.posted, WcStatus::RetryExceeded, false));
    step(&mut s, &mut dev, &mut log, 9, 8);
    assert!(matches!(s.state(), State::Failed { .. }), "{:?}", s.state());
    assert_eq!(log.errors.last().unwrap().1, Recovery::Fail);
    assert_eq!(s.counters().failures, 3);
    assert_eq!(s.counters().reconnects, 2);
    assert_eq!(s.rail_reconnected(0, 0), Err(StreamError::Terminal));
}

#[test]
fn progress_resets_the_retry_budget() {
    let mut c = config(16, 4);
    c.max_reconnects = 1;
    let mut s = Stream::new(c).unwrap();
    s.add_window(job(1, OpKind::Write, 64, 4096)).unwrap();
    let mut dev = Device::new(16);
    let mut log = Log::default();
    // Every epoch confirms one chain, then fails: never fruitless.
    for e in 0..10 {
        dev.fail = Some((dev.posted + 4, WcStatus::RetryExceeded, false));
        step(&mut s, &mut dev, &mut log, e, 16);
        assert_eq!(s.state(), State::NeedsReconnect, "epoch {e}");
        dev.replace();
        s.rail_reconnected(0, 0).unwrap();
    }
    run_to_idle(&mut s, &mut dev, &mut log, 16);
    assert!(s.is_idle());
    assert_eq!(s.counters().extents_confirmed, 64);
}

#[test]
fn timeouts_free_contexts_and_force_reconnect() {
    let mut c = config(16, 4);
    c.request_timeout_ns = 1_000;
    let mut s = Stream::new(c).unwrap();
    s.add_window(job(3, OpKind::Read, 20, 4096)).unwrap();
    assert_eq!(s.next_timeout(), None, "nothing outstanding");
    let mut dev = Device::new(16);
    let mut log = Log::default();
    post_all(&mut s, &mut dev, &mut log, 100);
    assert_eq!(s.outstanding(), 16);
    assert_eq!(s.next_timeout(), Some(1_100));
    s.poll_timeout(1_099);
    assert!(event(&mut s).is_none(), "not yet");
    assert_eq!(s.state(), State::Running);
    s.poll_timeout(1_100);
    let expired: Vec<Event> = std::iter::from_fn(|| event(&mut s)).collect();
    assert!(matches!(
        expired[0],
        Event::Timeout {
            window: 3,
            extent: 0,
            ..
        }
    ));
    for e in expired {
        match e {
            Event::Timeout { wr_id, .. } => log.timeouts.push(wr_id),
            Event::ErrorBatch { cause, action, .. } => log.errors.push((cause, action)),
            Event::ReadyToReconnect { unconfirmed, .. } => log.ready_to_reconnect.push(unconfirmed),
            Event::WindowDone { id } => log.windows_done.push(id),
        }
    }
    assert_eq!(log.timeouts.len(), 16, "every expired request reported");
    assert_eq!(s.counters().timeouts, 16);
    assert_eq!(s.outstanding(), 0, "contexts freed");
    assert_eq!(s.state(), State::NeedsReconnect);
    assert!(matches!(log.errors[0].0, ErrorCause::Timeout { .. }));
    assert_eq!(log.ready_to_reconnect, vec![16]);
    // A completion arriving after the timeout is stale.
    let late = dev.complete(4);
    s.on_completions(0, 0, &late);
    assert_eq!(s.counters().stale, 1);
    assert!(event(&mut s).is_none());
    dev.replace();
    s.rail_reconnected(0, 0).unwrap();
    run_to_idle(&mut s, &mut dev, &mut log, 4);
    assert_eq!(log.windows_done, vec![3]);
    assert_eq!(s.counters().extents_confirmed, 20);
}

#[test]
fn a_lost_connection_requeues_in_flight() {
    let mut s = Stream::new(config(16, 4)).unwrap();
    s.add_window(job(1, OpKind::Write, 10, 4096)).unwrap();
    let mut dev = Device::new(16);
    let mut log = Log::default();
    step(&mut s, &mut dev, &mut log, 0, 4);
    assert_eq!(s.counters().extents_confirmed, 4);
    s.rail_lost(0, 0);
    drain_events(&mut s, &mut log);
    assert_eq!(s.state(), State::NeedsReconnect);
    assert_eq!(log.ready_to_reconnect, vec![6]);
    assert!(matches!(log.errors[0].0, ErrorCause::ConnectionLost));
    dev.replace();
    s.rail_reconnected(0, 0).unwrap();
    run_to_idle(&mut s, &mut dev, &mut log, 4);
    assert_eq!(log.posted[&1], (4..10).map(|e| (1, e)).collect::<Vec<_>>());
    assert_eq!(s.counters().extents_confirmed, 10);
    assert_eq!(log.windows_done, vec![1]);
}

#[test]
fn post_failure_returns_the_unposted_suffix() {
    let mut s = Stream::new(config(32, 8)).unwrap();
    s.add_window(job(1, OpKind::Write, 16, 4096)).unwrap();
    let b = transmit(&mut s, 0).unwrap();
    assert_eq!(b.wrs.len(), 8);
    // The provider took the first 3 (unsignaled) then refused.
    s.post_failed(&b, 3).unwrap();
    assert_eq!(s.outstanding(), 3);
    assert_eq!(s.credits_in_use(), 3);
    let c = s.counters();
    assert_eq!(
        (c.posted, c.signaled, c.doorbells, c.post_failures),
        (3, 0, 1, 1)
    );
    assert_eq!(c.bytes_posted, 3 * 4096);
    let mut dev = Device::new(32);
    dev.post(&Batch {
        epoch: b.epoch,
        wrs: b.wrs[..3].to_vec(),
    });
    // The returned extents go first; the next chain's signaled tail also
    // retires the posted unsignaled prefix.
    let b2 = transmit(&mut s, 1).unwrap();
    assert_eq!(
        b2.wrs.iter().map(|w| locate(w).1).collect::<Vec<_>>(),
        vec![3, 4, 5, 6, 7, 8, 9, 10]
    );
    // An older batch cannot be undone any more.
    assert_eq!(s.post_failed(&b, 0), Err(StreamError::NotLastBatch));
    dev.post(&b2);
    let mut log = Log::default();
    s.on_completions(0, 0, &dev.complete(100));
    drain_events(&mut s, &mut log);
    assert_eq!(s.counters().extents_confirmed, 11);
    run_to_idle(&mut s, &mut dev, &mut log, 8);
    assert_eq!(s.counters().extents_confirmed, 16);
    assert_eq!(log.windows_done, vec![1]);
    // A whole chain refused: no doorbell counted.
    s.add_window(job(2, OpKind::Write, 4, 4096)).unwrap();
    let b3 = transmit(&mut s, 2).unwrap();
    let before = s.counters().doorbells;
    s.post_failed(&b3, 0).unwrap();
    assert_eq!(s.counters().doorbells, before - 1);
    assert_eq!(s.outstanding(), 0);
    let again = transmit(&mut s, 3).unwrap();
    assert_eq!(again.wrs.len(), 4);
}

#[test]
fn duplicate_and_unknown_completions_are_stale() {
    let mut s = Stream::new(config(8, 4)).unwrap();
    s.add_window(job(1, OpKind::Write, 4, 4096)).unwrap();
    let b = transmit(&mut s, 0).unwrap();
    let done = wc(&b.wrs[3], WcStatus::Success);
    s.on_completions(0, 0, &[done]);
    s.on_completions(0, 0, &[done]);
    s.on_completions(
        0,
        0,
        &[WorkCompletion {
            wr_id: 12345,
            ..done
        }],
    );
    let mut log = Log::default();
    drain_events(&mut s, &mut log);
    assert_eq!(log.windows_done, vec![1]);
    assert_eq!(s.counters().extents_confirmed, 4);
    assert_eq!(s.counters().stale, 2);
    assert_eq!(s.counters().completions, 3);
}

#[test]
fn inline_only_for_small_writes() {
    for (op, expect) in [
        (OpKind::Write, vec![false, true, true]),
        (OpKind::Read, vec![false; 3]),
    ] {
        let mut c = StreamConfig::new(8);
        c.max_inline = 100;
        let mut s = Stream::new(c).unwrap();
        let mut j = job(1, op, 3, 4096);
        j.extents[1].len = 100;
        j.extents[2].len = 1;
        s.add_window(j).unwrap();
        let b = transmit(&mut s, 0).unwrap();
        assert_eq!(b.wrs.iter().map(|w| w.inline).collect::<Vec<_>>(), expect);
        assert_eq!(
            s.counters().inline,
            expect.iter().filter(|&&i| i).count() as u64
        );
    }
    // max_inline 0 disables.
    let mut s = Stream::new(StreamConfig::new(8)).unwrap();
    s.add_window(job(1, OpKind::Write, 2, 1)).unwrap();
    assert!(transmit(&mut s, 0).unwrap().wrs.iter().all(|w| !w.inline));
}

#[test]
fn mixed_read_and_write_windows() {
    let mut s = Stream::new(config(64, 32)).unwrap();
    let ops = [OpKind::Write, OpKind::Read, OpKind::Read, OpKind::Write];
    for (i, op) in ops.iter().enumerate() {
        s.add_window(job(i as u64, *op, 10, 4096)).unwrap();
    }
    let mut dev = Device::new(64);
    let mut log = Log::default();
    let mut kinds = Vec::new();
    while let Some(b) = transmit(&mut s, 0) {
        let w = locate(&b.wrs[0]).0;
        assert!(b.wrs.iter().all(|wr| wr.kind == ops[w as usize]));
        kinds.push(b.wrs[0].kind);
        dev.post(&b);
    }
    assert_eq!(kinds, ops, "one chain per window, FIFO");
    s.on_completions(0, 0, &dev.complete(100));
    drain_events(&mut s, &mut log);
    assert_eq!(log.windows_done, vec![0, 1, 2, 3]);
    assert!(s.is_idle());
}

#[test]
fn many_tiny_windows() {
    let mut s = Stream::new(config(128, 32)).unwrap();
    let mut dev = Device::new(128);
    let mut log = Log::default();
    let n = 5000u64;
    for id in 0..n {
        s.add_window(job(id, OpKind::Write, 1, 1 + (id % 64) as u32))
            .unwrap();
    }
    assert_eq!(s.windows(), n as usize);
    run_to_idle(&mut s, &mut dev, &mut log, 50);
    assert_eq!(log.windows_done, (0..n).collect::<Vec<_>>());
    let c = s.counters();
    assert_eq!((c.extents_confirmed, c.windows_done, c.signaled), (n, n, n));
    assert_eq!(c.doorbells, n, "a chain ends with its window");
    // Window ids are free again once done.
    s.add_window(job(0, OpKind::Read, 1, 1)).unwrap();
}

#[test]
fn an_empty_window_is_done_at_once() {
    let mut s = Stream::new(config(8, 4)).unwrap();
    let mut j = job(5, OpKind::Write, 0, 1);
    j.extents.clear();
    s.add_window(j.clone()).unwrap();
    assert_eq!(event(&mut s), Some(Event::WindowDone { id: 5 }));
    assert!(transmit(&mut s, 0).is_none());
    assert!(s.is_idle());
    assert_eq!(s.counters().windows_done, 1);
    // Not live, so the id may come again.
    s.add_window(j).unwrap();
    assert_eq!(event(&mut s), Some(Event::WindowDone { id: 5 }));
}

#[test]
fn windows_are_validated() {
    let mut s = Stream::new(config(8, 4)).unwrap();
    let e = |offset, len| Extent { offset, len };
    let with = |extents: Vec<Extent>| WindowJob {
        extents,
        ..job(1, OpKind::Write, 0, 1)
    };
    let cases = [
        (
            vec![e(0, 10), e(20, 0)],
            WindowError::EmptyExtent { index: 1 },
        ),
        (
            vec![e(100, 10), e(20, 5)],
            WindowError::Unsorted { index: 1 },
        ),
        (
            vec![e(0, 10), e(10, 5), e(14, 5)],
            WindowError::Overlap { index: 2 },
        ),
        (
            vec![e(u64::MAX - 3, 10)],
            WindowError::Overflow { index: 0 },
        ),
    ];
    for (extents, want) in cases {
        assert_eq!(s.add_window(with(extents)), Err(want));
    }
    // The base address counts too.
    let mut j = with(vec![e(0, 10)]);
    j.remote_addr = u64::MAX - 5;
    assert_eq!(s.add_window(j), Err(WindowError::Overflow { index: 0 }));
    // Adjacent is fine; a live id is refused.
    s.add_window(with(vec![e(0, 10), e(10, 5)])).unwrap();
    assert_eq!(
        s.add_window(with(vec![e(0, 1)])),
        Err(WindowError::DuplicateId(1))
    );
    assert!(event(&mut s).is_none());
    assert!(WindowError::Overlap { index: 2 }.to_string().contains('2'));
}

#[test]
fn config_is_validated() {
    let mut c = StreamConfig::new(8);
    c.batch.batch = 0;
    assert!(matches!(Stream::new(c), Err(StreamConfigError::Batch(_))));
    assert_eq!(
        Stream::new(StreamConfig::new(0)).err(),
        Some(StreamConfigError::SqDepth(0))
    );
    assert_eq!(
        Stream::new(StreamConfig::new(MAX_SLOTS + 1)).err(),
        Some(StreamConfigError::SqDepth(MAX_SLOTS + 1))
    );
    assert!(StreamConfigError::SqDepth(0)
        .to_string()
        .contains("sq_depth = 0"));
}

#[test]
fn poll_transmit_reuses_the_batch() {
    let mut s = Stream::new(config(64, 8)).unwrap();
    s.add_window(job(1, OpKind::Write, 20, 64)).unwrap();
    let mut b = Batch::default();
    assert!(s.poll_transmit(0, &mut b).is_some());
    let cap = b.wrs.capacity();
    let first = b.wrs[0];
    assert!(s.poll_transmit(0, &mut b).is_some());
    assert_eq!(b.wrs.len(), 8);
    assert_ne!(b.wrs[0], first);
    assert_eq!(b.wrs.capacity(), cap, "no new allocation");
    assert!(s.poll_transmit(0, &mut b).is_some());
    assert_eq!(b.wrs.len(), 4, "the window's last chain");
    assert!(s.poll_transmit(0, &mut b).is_none());
    assert!(b.wrs.is_empty());
}

// ---------------------------------------------------------------------------
// Property: whatever the windows, completion timing, errors and reconnects,
// every extent is confirmed exactly once (the stream asserts it never
// confirms one twice; the counters say each once), only after its data
// landed, and never posted once confirmed; every window is done exactly
// once.

#[derive(Clone, Debug)]
enum Step {
    /// Execute up to n requests.
    Complete(usize),
    /// The next request executed fails with a retryable status.
    Fail,
    /// The next request executed fails with a non-retryable status.
    FailHard,
    /// The runtime reports the connection gone.
    Lost,
    /// The device stalls past the request timeout.
    Stall,
    /// A new window of these extent (gap, len) pairs, READ or WRITE.
    Window(bool, Vec<(u16, u16)>),
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => (0usize..40).prop_map(Step::Complete),
        1 => Just(Step::Fail),
        1 => Just(Step::Lost),
        1 => Just(Step::Stall),
        3 => (any::<bool>(), prop::collection::vec((0u16..3, 1u16..200), 0..40))
            .prop_map(|(r, e)| Step::Window(r, e)),
    ]
}

struct Harness {
    s: Stream,
    dev: Device,
    now: u64,
    next_id: u64,
    /// window id → remote address of each extent.
    windows: HashMap<u64, Vec<u64>>,
    done: HashMap<u64, u32>,
    extents: u64,
    failed: bool,
}

impl Harness {
    fn window(&mut self, read: bool, spec: &[(u16, u16)]) {
        let id = self.next_id;
        self.next_id += 1;
        let mut off = 0u64;
        let mut extents = Vec::new();
        for &(gap, len) in spec {
            off += u64::from(gap) * 64;
            extents.push(Extent {
                offset: off,
                len: u32::from(len),
            });
            off += u64::from(len);
        }
        let op = if read { OpKind::Read } else { OpKind::Write };
        let j = WindowJob {
            id,
            op,
            local_addr: local_base(id),
            lkey: 1,
            remote_addr: remote_base(id),
            rkey: 2,
            extents,
        };
        self.windows.insert(
            id,
            j.extents.iter().map(|e| j.remote_addr + e.offset).collect(),
        );
        self.extents += j.extents.len() as u64;
        match self.s.add_window(j) {
            Ok(()) => {}
            Err(WindowError::Failed) => assert!(self.failed),
            Err(e) => panic!("{e}"),
        }
    }

    fn post(&mut self) {
        let mut b = Batch::default();
        while self.s.poll_transmit(self.now, &mut b).is_some() {
            assert!(self.s.credits_in_use() <= self.dev.depth);
            self.dev.post(&b);
        }
    }

    fn events(&mut self) {
        while let Some(e) = event(&mut self.s) {
            match e {
                Event::WindowDone { id } => {
                    *self.done.entry(id).or_default() += 1;
                    for a in &self.windows[&id] {
                        assert!(
                            self.dev.landed.contains(a),
                            "window {id} done before {a:#x} landed"
                        );
                    }
                }
                Event::ErrorBatch { action, .. } => {
                    if action == Recovery::Fail {
                        self.failed = true;
                    }
                }
                Event::Timeout { .. } | Event::ReadyToReconnect { .. } => {}
            }
        }
        if self.s.state() == State::NeedsReconnect {
            self.dev.replace();
            self.s.rail_reconnected(0, self.now).unwrap();
        }
        if let State::Failed { .. } = self.s.state() {
            self.failed = true;
        }
    }

    fn run(&mut self, st: &Step) {
        self.now += 10;
        match st {
            Step::Complete(n) => {
                let wcs = self.dev.complete(*n);
                self.s.on_completions(0, self.now, &wcs);
            }
            Step::Fail => self.dev.fail_next(WcStatus::RetryExceeded),
            Step::FailHard => self.dev.fail_next(WcStatus::RemoteAccess),
            Step::Lost => self.s.rail_lost(0, self.now),
            Step::Stall => {
                self.now += 1_000_000;
                self.s.poll_timeout(self.now);
            }
            Step::Window(r, e) => self.window(*r, e),
        }
        self.events();
        self.post();
    }
}

fn check(
    windows: Vec<(bool, Vec<(u16, u16)>)>,
    steps: Vec<Step>,
    depth: usize,
    batch: (usize, usize),
) {
    let mut c = StreamConfig::new(depth);
    c.batch = BatchPolicy::new(batch.0, batch.1.min(batch.0)).unwrap();
    c.max_inline = 64;
    c.request_timeout_ns = 500_000;
    c.max_reconnects = 1_000;
    let mut h = Harness {
        s: Stream::new(c).unwrap(),
        dev: Device::new(depth),
        now: 0,
        next_id: 0,
        windows: HashMap::new(),
        done: HashMap::new(),
        extents: 0,
        failed: false,
    };
    for (r, e) in &windows {
        h.window(*r, e);
    }
    h.events();
    h.post();
    for st in &steps {
        h.run(st);
        if h.failed {
            break;
        }
    }
    // Then let it finish without faults.
    let mut rounds = 0;
    while !h.failed && !h.s.is_idle() {
        rounds += 1;
        assert!(rounds < 100_000, "stalled: {:?}", h.s.state());
        h.run(&Step::Complete(16));
    }
    h.events();
    let c = *h.s.counters();
    assert!(h.done.values().all(|&n| n == 1), "a window done twice");
    if h.failed {
        assert!(c.extents_confirmed <= h.extents);
        return;
    }
    assert_eq!(h.done.len() as u64, h.next_id, "every window done");
    assert_eq!(
        c.extents_confirmed, h.extents,
        "every extent confirmed once"
    );
    assert_eq!(c.windows_done, h.next_id);
    assert_eq!(h.s.outstanding(), 0);
    assert_eq!(h.s.credits_in_use(), 0);
    assert!(c.posted >= h.extents);
    assert_eq!(c.posted - c.reposted, h.extents, "only reposts post twice");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_extent_confirmed_exactly_once(
        windows in prop::collection::vec(
            (any::<bool>(), prop::collection::vec((0u16..3, 1u16..5000), 0..60)),
            1..8,
        ),
        steps in prop::collection::vec(step_strategy(), 0..150),
        depth in 1usize..96,
        batch in (1usize..33, 1usize..33),
    ) {
        check(windows, steps, depth, batch);
    }

    #[test]
    fn a_non_retryable_error_loses_windows_but_confirms_nothing_twice(
        windows in prop::collection::vec(
            (any::<bool>(), prop::collection::vec((0u16..3, 1u16..300), 1..30)),
            1..5,
        ),
        before in prop::collection::vec(step_strategy(), 0..30),
        depth in 1usize..64,
    ) {
        let mut steps = before;
        steps.push(Step::Complete(1));
        steps.push(Step::FailHard);
        steps.push(Step::Complete(100));
        check(windows, steps, depth, (8, 4));
    }
}
