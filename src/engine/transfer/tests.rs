//! Transfer tests against an in-test fake device: an RC send queue that
//! completes in order, reports only signaled successes, always reports an
//! error, and flushes everything behind an error.

use std::collections::{BTreeSet, HashMap};

use super::*;

const BS: u64 = 4096;

fn bufs(n: usize) -> Vec<LocalSeg> {
    (0..n)
        .map(|i| LocalSeg {
            addr: 0x1000_0000 + i as u64 * BS,
            len: BS as u32,
            lkey: 42,
        })
        .collect()
}

/// A window over blocks `first..first + n` (clipped to the file).
fn window(id: u64, file_len: u64, first: u64, n: u64) -> Window {
    let file_offset = first * BS;
    let end = ((first + n) * BS).min(file_len);
    Window {
        id,
        remote_addr: 0x8000_0000_0000 + file_offset,
        rkey: 0x77,
        len: end - file_offset,
        file_offset,
        epoch: 0,
    }
}

fn config(op: OpKind, blocks: u64, depth: usize, batch: usize) -> TransferConfig {
    let mut c = TransferConfig::new(op, blocks * BS, BS, depth);
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
    done: Vec<u64>,
    windows_done: Vec<u64>,
    posted: HashMap<u32, Vec<u64>>,
    errors: Vec<(ErrorCause, Recovery)>,
    timeouts: Vec<u64>,
    ready_to_reconnect: Vec<u64>,
    chains: Vec<Batch>,
}

impl Log {
    fn done_set(&self) -> BTreeSet<u64> {
        self.done.iter().copied().collect()
    }
}

/// Post everything the transfer offers.
fn post_all(t: &mut Transfer, dev: &mut Device, log: &mut Log, now: u64) {
    while let Some(b) = t.poll_transmit(now) {
        assert!(t.credits_in_use() <= dev.depth);
        assert_eq!(b.wrs.len(), b.blocks.len());
        for (wr, span) in b.wrs.iter().zip(&b.blocks) {
            assert_eq!(wr.local.len, span.len);
            log.posted.entry(b.epoch).or_default().push(span.index);
        }
        dev.post(&b);
        log.chains.push(b);
    }
}

/// Handle events; release buffers right away unless `hold`.
fn drain_events(t: &mut Transfer, log: &mut Log, hold: bool) {
    while let Some(e) = t.poll_event() {
        match e {
            Event::BlockDone { block, local, .. } => {
                log.done.push(block);
                if !hold {
                    t.release_buffer(local).unwrap();
                }
            }
            Event::WindowDone { window_id } => log.windows_done.push(window_id),
            Event::ErrorBatch { cause, action, .. } => log.errors.push((cause, action)),
            Event::Timeout { wr_id, .. } => log.timeouts.push(wr_id),
            Event::ReadyToReconnect { unconfirmed, .. } => log.ready_to_reconnect.push(unconfirmed),
        }
    }
}

/// Post, execute `step` requests, complete, handle events.
fn step(t: &mut Transfer, dev: &mut Device, log: &mut Log, now: u64, step: usize) {
    post_all(t, dev, log, now);
    let wcs = dev.complete(step);
    t.on_completions(&wcs);
    drain_events(t, log, false);
}

fn run_to_end(t: &mut Transfer, dev: &mut Device, log: &mut Log, n: usize) {
    for i in 0..1_000_000 {
        if t.state() != State::Running {
            return;
        }
        step(t, dev, log, i, n);
    }
    panic!("no progress");
}

#[test]
fn chain_of_32_signals_only_its_last() {
    let mut t = Transfer::new(config(OpKind::Write, 32, 64, 32), bufs(64)).unwrap();
    t.add_window(window(1, 32 * BS, 0, 32)).unwrap();
    let b = t.poll_transmit(0).unwrap();
    assert_eq!(b.wrs.len(), 32);
    let signaled: Vec<usize> = (0..32).filter(|&i| b.wrs[i].signaled).collect();
    assert_eq!(signaled, vec![31]);
    assert!(t.poll_transmit(0).is_none(), "one chain, one doorbell");
    assert_eq!(t.counters().doorbells, 1);
    assert_eq!(t.counters().signaled, 1);
    // Remote addresses follow the window; kinds follow the op.
    assert_eq!(b.wrs[5].remote.addr, 0x8000_0000_0000 + 5 * BS);
    assert_eq!(b.wrs[5].remote.rkey, 0x77);
    assert!(b.wrs.iter().all(|w| w.kind == OpKind::Write));
    // The signaled tail retires the whole chain.
    t.on_completion(&WorkCompletion {
        wr_id: b.wrs[31].wr_id,
        status: WcStatus::Success,
        byte_len: BS as u32,
    });
    let mut log = Log::default();
    drain_events(&mut t, &mut log, false);
    assert_eq!(log.done, (0..32).collect::<Vec<_>>());
    assert_eq!(log.windows_done, vec![1]);
    assert!(t.is_complete());
    assert_eq!(t.state(), State::Complete);
    assert_eq!(t.credits_in_use(), 0);
}

#[test]
fn a_chain_ends_at_the_end_of_its_window() {
    // Four windows of 4 blocks, room for 32 per chain: one chain per
    // window, each signaled at its window's last block.
    let mut t = Transfer::new(config(OpKind::Write, 16, 64, 32), bufs(64)).unwrap();
    for k in 0..4 {
        t.add_window(window(k + 1, 16 * BS, k * 4, 4)).unwrap();
    }
    let mut log = Log::default();
    for k in 0..4u64 {
        let b = t.poll_transmit(0).unwrap();
        let blocks: Vec<u64> = b.blocks.iter().map(|s| s.index).collect();
        assert_eq!(blocks, (k * 4..k * 4 + 4).collect::<Vec<_>>());
        let signaled: Vec<usize> = (0..4).filter(|&i| b.wrs[i].signaled).collect();
        assert_eq!(signaled, vec![3]);
        // Its one completion confirms the whole window at once.
        t.on_completion(&WorkCompletion {
            wr_id: b.wrs[3].wr_id,
            status: WcStatus::Success,
            byte_len: BS as u32,
        });
        drain_events(&mut t, &mut log, false);
        assert_eq!(log.windows_done, (1..=k + 1).collect::<Vec<_>>());
    }
    assert!(t.poll_transmit(0).is_none());
    assert!(t.is_complete());
    assert_eq!(t.counters().doorbells, 4);
}

#[test]
fn full_run_confirms_every_block_exactly_once() {
    let n = 1000;
    let file_len = n * BS - 123; // short last block
    let mut c = TransferConfig::new(OpKind::Read, file_len, BS, 64);
    c.batch = BatchPolicy::new(16, 5).unwrap();
    let mut t = Transfer::new(c, bufs(40)).unwrap();
    let mut dev = Device::new(64);
    let mut log = Log::default();
    // The server grants 250-block windows one at a time, the next when the
    // previous is done, plus one ahead.
    t.add_window(window(10, file_len, 0, 250)).unwrap();
    t.add_window(window(11, file_len, 250, 250)).unwrap();
    let mut next = 2;
    let mut now = 0;
    while !t.is_complete() {
        now += 1;
        assert!(now < 100_000, "stalled");
        step(&mut t, &mut dev, &mut log, now, 3);
        while next < 4 && log.windows_done.len() + 2 > next as usize {
            t.add_window(window(10 + next, file_len, next * 250, 250))
                .unwrap();
            next += 1;
        }
    }
    assert_eq!(log.done.len() as u64, n, "each block confirmed once");
    assert_eq!(log.done_set(), (0..n).collect());
    assert_eq!(log.windows_done, vec![10, 11, 12, 13]);
    assert_eq!(t.bytes_confirmed(), file_len);
    assert_eq!(t.state(), State::Complete);
    assert_eq!(t.counters().posted, n);
    assert_eq!(t.counters().blocks_confirmed, n);
    assert!(t.counters().signaled < n, "selective signaling");
    assert_eq!(t.counters().stale, 0);
    assert_eq!(t.free_buffers(), 40);
    assert_eq!(t.credits_in_use(), 0);
    assert!(dev.max_outstanding <= 40, "bounded by local buffers");
}

#[test]
fn credits_never_exceed_depth_over_100k_requests() {
    let n = 100_000;
    let mut t = Transfer::new(config(OpKind::Write, n, 128, 32), bufs(256)).unwrap();
    t.add_window(window(1, n * BS, 0, n)).unwrap();
    let mut dev = Device::new(128);
    let mut log = Log::default();
    let mut now = 0;
    let mut starved = 0;
    while !t.is_complete() {
        now += 1;
        post_all(&mut t, &mut dev, &mut log, now);
        assert!(t.credits_in_use() <= 128);
        assert_eq!(t.credits_in_use(), dev.occupied);
        if t.credits_in_use() == 128 {
            starved += 1;
            assert!(t.poll_transmit(now).is_none(), "waits for credits");
        }
        let wcs = dev.complete(7);
        t.on_completions(&wcs);
        drain_events(&mut t, &mut log, false);
    }
    assert_eq!(dev.max_outstanding, 128, "fills the queue, never more");
    assert!(starved > 0);
    assert_eq!(log.done.len() as u64, n);
    assert_eq!(t.counters().posted, n);
}

#[test]
fn local_buffer_bound_is_respected() {
    let mut t = Transfer::new(config(OpKind::Read, 10, 128, 32), bufs(3)).unwrap();
    t.add_window(window(1, 10 * BS, 0, 10)).unwrap();
    let mut dev = Device::new(128);
    let mut log = Log::default();
    post_all(&mut t, &mut dev, &mut log, 0);
    assert_eq!(dev.queue.len(), 3, "three buffers, three blocks in flight");
    let wcs = dev.complete(3);
    t.on_completions(&wcs);
    // Hold the buffers (the file write has not happened yet).
    drain_events(&mut t, &mut log, true);
    assert_eq!(log.done, vec![0, 1, 2]);
    assert_eq!(t.free_buffers(), 0);
    assert!(t.poll_transmit(1).is_none(), "no buffer, no post");
    // Releasing one lets exactly one block go.
    let b0 = bufs(3)[2];
    t.release_buffer(b0).unwrap();
    assert_eq!(
        t.release_buffer(b0),
        Err(TransferError::BufferNotLent { addr: b0.addr })
    );
    let b = t.poll_transmit(2).unwrap();
    assert_eq!(b.blocks.len(), 1);
    assert_eq!(b.blocks[0].index, 3);
    assert_eq!(b.wrs[0].local.addr, b0.addr);
}

#[test]
fn error_mid_run_reposts_exactly_the_unconfirmed_blocks() {
    let n = 200;
    let mut c = config(OpKind::Write, n, 32, 8);
    c.batch = BatchPolicy::new(8, 3).unwrap();
    let mut t = Transfer::new(c, bufs(32)).unwrap();
    t.add_window(window(1, n * BS, 0, n)).unwrap();
    let mut dev = Device::new(32);
    let mut log = Log::default();
    // A signaled request after the 100th fails, with an unsignaled one
    // just before it and requests behind it in the queue.
    dev.fail = Some((100, WcStatus::RetryExceeded, true));
    let mut now = 0;
    while t.state() == State::Running {
        now += 1;
        step(&mut t, &mut dev, &mut log, now, 5);
    }
    assert_eq!(t.state(), State::NeedsReconnect, "flush CQEs drained");
    assert_eq!(log.errors.len(), 1);
    let (cause, action) = log.errors[0];
    assert_eq!(action, Recovery::Reconnect);
    let ErrorCause::Completion {
        status: WcStatus::RetryExceeded,
        block: failed,
        ..
    } = cause
    else {
        panic!("{cause:?}");
    };
    assert!(failed >= 100);
    let confirmed = log.done_set();
    let posted0: BTreeSet<u64> = log.posted[&0].iter().copied().collect();
    let unconfirmed: BTreeSet<u64> = posted0.difference(&confirmed).copied().collect();
    assert!(!confirmed.is_empty());
    assert!(unconfirmed.contains(&failed));
    assert!(
        unconfirmed.contains(&(failed - 1)),
        "unsignaled requests before the error are not confirmed"
    );
    assert_eq!(log.ready_to_reconnect, vec![unconfirmed.len() as u64]);
    for &b in &unconfirmed {
        assert_eq!(t.block_state(b), BlockState::Pending);
    }
    for &b in &confirmed {
        assert_eq!(t.block_state(b), BlockState::Done);
    }
    assert!(t.poll_transmit(now).is_none(), "no posting while failed");
    assert_eq!(t.counters().errors["retry_exc_err"], 1);
    assert!(t.counters().errors["wr_flush_err"] > 0);

    // Reconnect: a late completion from the old queue pair is stale.
    let old = log.chains.last().unwrap().wrs[0];
    dev.replace();
    assert_eq!(t.reconnected(), Ok(1));
    assert_eq!(t.credits_in_use(), 0);
    t.on_completion(&WorkCompletion {
        wr_id: old.wr_id,
        status: WcStatus::Success,
        byte_len: 0,
    });
    assert_eq!(t.counters().stale, 1);
    assert!(
        t.poll_event().is_none(),
        "stale completion confirms nothing"
    );

    run_to_end(&mut t, &mut dev, &mut log, 5);
    assert!(t.is_complete());
    let posted1: Vec<u64> = log.posted[&1].clone();
    // The unconfirmed blocks go first, in order...
    let first: Vec<u64> = posted1[..unconfirmed.len()].to_vec();
    assert_eq!(first, unconfirmed.iter().copied().collect::<Vec<_>>());
    // ...and no confirmed block is posted again.
    let posted1: BTreeSet<u64> = posted1.into_iter().collect();
    assert!(posted1.is_disjoint(&confirmed));
    assert_eq!(
        posted1.union(&confirmed).copied().collect::<BTreeSet<_>>(),
        (0..n).collect()
    );
    assert_eq!(
        log.done.len() as u64,
        n,
        "each block confirmed exactly once"
    );
    assert_eq!(t.counters().reposted, unconfirmed.len() as u64);
    assert_eq!(t.counters().reconnects, 1);
}

#[test]
fn non_retryable_error_fails_without_reconnect() {
    let mut t = Transfer::new(config(OpKind::Write, 64, 32, 8), bufs(32)).unwrap();
    t.add_window(window(1, 64 * BS, 0, 64)).unwrap();
    let mut dev = Device::new(32);
    dev.fail = Some((10, WcStatus::RemoteAccess, false));
    let mut log = Log::default();
    let mut now = 0;
    while t.state() == State::Running {
        now += 1;
        step(&mut t, &mut dev, &mut log, now, 4);
    }
    assert_eq!(
        t.state(),
        State::Failed {
            status: Some(WcStatus::RemoteAccess),
            block: Some(10),
            reason: "non-retryable completion status"
        }
    );
    assert_eq!(log.errors.len(), 1);
    assert_eq!(log.errors[0].1, Recovery::Fail);
    assert!(log.ready_to_reconnect.is_empty());
    assert_eq!(t.reconnected(), Err(TransferError::Terminal));
    assert!(t.poll_transmit(now).is_none());
    assert!(!t.is_complete());
}

#[test]
fn retry_budget_bounds_fruitless_reconnects() {
    let mut c = config(OpKind::Write, 8, 16, 8);
    c.max_retries = 2;
    let mut t = Transfer::new(c, bufs(8)).unwrap();
    t.add_window(window(1, 8 * BS, 0, 8)).unwrap();
    let mut dev = Device::new(16);
    let mut log = Log::default();
    // Two fruitless retries are allowed; the third failure in a row fails.
    for attempt in 0..2 {
        dev.replace();
        if attempt > 0 {
            t.reconnected().unwrap();
        }
        // The first request of every epoch fails.
        dev.fail = Some((dev.posted, WcStatus::RetryExceeded, false));
        step(&mut t, &mut dev, &mut log, attempt, 8);
        assert_eq!(t.state(), State::NeedsReconnect);
    }
    dev.replace();
    t.reconnected().unwrap();
    dev.fail = Some((dev.posted, WcStatus::RetryExceeded, false));
    step(&mut t, &mut dev, &mut log, 9, 8);
    assert!(matches!(t.state(), State::Failed { .. }), "{:?}", t.state());
    assert_eq!(log.errors.last().unwrap().1, Recovery::Fail);
    assert_eq!(t.counters().error_batches, 3);
    assert_eq!(t.counters().reconnects, 2);
    assert_eq!(t.reconnected(), Err(TransferError::Terminal));
}

#[test]
fn timeouts_free_contexts_and_force_reconnect() {
    let mut c = config(OpKind::Read, 20, 16, 4);
    c.request_timeout_ns = 1_000;
    let mut t = Transfer::new(c, bufs(16)).unwrap();
    t.add_window(window(1, 20 * BS, 0, 20)).unwrap();
    assert_eq!(t.next_timeout(), None, "nothing outstanding");
    let mut dev = Device::new(16);
    let mut log = Log::default();
    post_all(&mut t, &mut dev, &mut log, 100);
    assert_eq!(t.outstanding(), 16);
    assert_eq!(t.next_timeout(), Some(1_100));
    t.poll_timeout(1_099);
    assert!(t.poll_event().is_none(), "not yet");
    assert_eq!(t.state(), State::Running);
    t.poll_timeout(1_100);
    drain_events(&mut t, &mut log, false);
    assert_eq!(log.timeouts.len(), 16, "every expired request reported");
    assert_eq!(t.counters().timeouts, 16);
    assert_eq!(t.outstanding(), 0, "contexts freed");
    assert_eq!(t.free_buffers(), 16);
    assert_eq!(t.state(), State::NeedsReconnect);
    assert!(matches!(log.errors[0].0, ErrorCause::Timeout { .. }));
    assert_eq!(log.ready_to_reconnect, vec![16]);
    // A completion arriving after the timeout is stale.
    let late = dev.complete(4);
    t.on_completions(&late);
    assert_eq!(t.counters().stale, 1);
    assert!(t.poll_event().is_none());
    dev.replace();
    t.reconnected().unwrap();
    run_to_end(&mut t, &mut dev, &mut log, 4);
    assert!(t.is_complete());
    assert_eq!(log.done_set(), (0..20).collect());
    assert_eq!(log.done.len(), 20);
}

#[test]
fn connection_lost_requeues_in_flight() {
    let mut t = Transfer::new(config(OpKind::Write, 10, 16, 4), bufs(16)).unwrap();
    t.add_window(window(1, 10 * BS, 0, 10)).unwrap();
    let mut dev = Device::new(16);
    let mut log = Log::default();
    step(&mut t, &mut dev, &mut log, 0, 4);
    assert_eq!(log.done, vec![0, 1, 2, 3]);
    t.connection_lost();
    drain_events(&mut t, &mut log, false);
    assert_eq!(t.state(), State::NeedsReconnect);
    assert_eq!(log.ready_to_reconnect, vec![6]);
    dev.replace();
    t.reconnected().unwrap();
    run_to_end(&mut t, &mut dev, &mut log, 4);
    assert_eq!(log.posted[&1], (4..10).collect::<Vec<_>>());
    assert_eq!(log.done.len(), 10);
}

#[test]
fn post_failure_returns_the_unposted_suffix() {
    let mut t = Transfer::new(config(OpKind::Write, 16, 32, 8), bufs(32)).unwrap();
    t.add_window(window(1, 16 * BS, 0, 16)).unwrap();
    let b = t.poll_transmit(0).unwrap();
    assert_eq!(b.wrs.len(), 8);
    // The provider took the first 3 (unsignaled) then refused.
    t.post_failed(&b, 3).unwrap();
    assert_eq!(t.outstanding(), 3);
    assert_eq!(t.credits_in_use(), 3);
    assert_eq!(t.counters().posted, 3);
    for i in 3..8 {
        assert_eq!(t.block_state(i), BlockState::Pending);
    }
    let mut dev = Device::new(32);
    dev.post(&Batch {
        epoch: b.epoch,
        wrs: b.wrs[..3].to_vec(),
        blocks: b.blocks[..3].to_vec(),
    });
    // The returned blocks go first; the next chain's signaled tail also
    // retires the posted unsignaled prefix.
    let b2 = t.poll_transmit(1).unwrap();
    assert_eq!(
        b2.blocks.iter().map(|s| s.index).collect::<Vec<_>>(),
        vec![3, 4, 5, 6, 7, 8, 9, 10]
    );
    // An older batch cannot be undone any more.
    assert_eq!(t.post_failed(&b, 0), Err(TransferError::NotLastBatch));
    dev.post(&b2);
    let mut log = Log::default();
    t.on_completions(&dev.complete(100));
    drain_events(&mut t, &mut log, false);
    assert_eq!(log.done, (0..11).collect::<Vec<_>>());
    run_to_end(&mut t, &mut dev, &mut log, 8);
    assert_eq!(log.done, (0..16).collect::<Vec<_>>());
}

#[test]
fn duplicate_and_unknown_completions_are_stale() {
    let mut t = Transfer::new(config(OpKind::Write, 4, 8, 4), bufs(8)).unwrap();
    t.add_window(window(1, 4 * BS, 0, 4)).unwrap();
    let b = t.poll_transmit(0).unwrap();
    let wc = WorkCompletion {
        wr_id: b.wrs[3].wr_id,
        status: WcStatus::Success,
        byte_len: 0,
    };
    t.on_completion(&wc);
    t.on_completion(&wc);
    t.on_completion(&WorkCompletion { wr_id: 12345, ..wc });
    let mut log = Log::default();
    drain_events(&mut t, &mut log, false);
    assert_eq!(log.done, vec![0, 1, 2, 3]);
    assert_eq!(t.counters().stale, 2);
    assert_eq!(t.counters().completions, 3);
}

#[test]
fn zero_and_one_byte_transfers() {
    let zero = Transfer::new(TransferConfig::new(OpKind::Write, 0, BS, 8), bufs(1)).unwrap();
    assert!(zero.is_complete());
    assert_eq!(zero.state(), State::Complete);
    let mut zero = zero;
    assert!(zero.poll_transmit(0).is_none());
    assert!(zero.add_window(window(1, 0, 0, 1)).is_err());

    let mut c = TransferConfig::new(OpKind::Write, 1, BS, 8);
    c.max_inline = 64;
    let mut one = Transfer::new(c, bufs(1)).unwrap();
    // A server may grant the whole (registered) block.
    one.add_window(Window {
        id: 1,
        remote_addr: 0x5000,
        rkey: 1,
        len: BS,
        file_offset: 0,
        epoch: 0,
    })
    .unwrap();
    let b = one.poll_transmit(0).unwrap();
    assert_eq!(b.wrs.len(), 1);
    assert_eq!(b.wrs[0].local.len, 1);
    assert!(b.wrs[0].signaled);
    assert!(b.wrs[0].inline, "1 byte <= max_inline");
    one.on_completion(&WorkCompletion {
        wr_id: b.wrs[0].wr_id,
        status: WcStatus::Success,
        byte_len: 1,
    });
    assert!(one.is_complete());
    assert_eq!(one.bytes_confirmed(), 1);
    let mut log = Log::default();
    drain_events(&mut one, &mut log, false);
    assert_eq!(log.windows_done, vec![1]);
}

#[test]
fn inline_only_for_small_writes() {
    let len = 2 * BS + 50;
    for (op, expect) in [
        (OpKind::Write, vec![false, false, true]),
        (OpKind::Read, vec![false; 3]),
    ] {
        let mut c = TransferConfig::new(op, len, BS, 8);
        c.max_inline = 100;
        let mut t = Transfer::new(c, bufs(4)).unwrap();
        t.add_window(window(1, len, 0, 3)).unwrap();
        let b = t.poll_transmit(0).unwrap();
        assert_eq!(b.wrs.iter().map(|w| w.inline).collect::<Vec<_>>(), expect);
    }
}

#[test]
fn window_already_confirmed_is_done_at_once_and_nothing_reposted() {
    let mut t = Transfer::new(config(OpKind::Write, 8, 8, 8), bufs(8)).unwrap();
    t.add_window(window(1, 8 * BS, 0, 4)).unwrap();
    let mut dev = Device::new(8);
    let mut log = Log::default();
    step(&mut t, &mut dev, &mut log, 0, 8);
    assert_eq!(log.windows_done, vec![1]);
    // The server re-grants the finished range plus new blocks: only new ones go.
    assert_eq!(
        t.add_window(window(2, 8 * BS, 2, 1)).err(),
        None,
        "range is free again once its window is done"
    );
    drain_events(&mut t, &mut log, false);
    assert_eq!(log.windows_done, vec![1, 2]);
    t.add_window(window(3, 8 * BS, 0, 8)).unwrap();
    run_to_end(&mut t, &mut dev, &mut log, 8);
    assert_eq!(log.posted[&0], (0..8).collect::<Vec<_>>());
    assert!(t.is_complete());
}

#[test]
fn config_is_validated() {
    let ok = TransferConfig::new(OpKind::Write, 10, BS, 8);
    let mut c = ok;
    c.batch.batch = 0;
    assert!(matches!(
        Transfer::new(c, bufs(1)),
        Err(ConfigError::Batch(_))
    ));
    c = ok;
    c.block_size = 1000;
    assert!(matches!(
        Transfer::new(c, bufs(1)),
        Err(ConfigError::BlockSize(_))
    ));
    c = ok;
    c.sq_depth = 0;
    assert_eq!(
        Transfer::new(c, bufs(1)).err(),
        Some(ConfigError::SqDepth(0))
    );
    assert_eq!(
        Transfer::new(ok, vec![]).err(),
        Some(ConfigError::NoBuffers)
    );
    let mut small = bufs(2);
    small[1].len = 100;
    assert_eq!(
        Transfer::new(ok, small).err(),
        Some(ConfigError::BufferTooSmall {
            index: 1,
            len: 100,
            block_size: BS
        })
    );
    let mut dup = bufs(2);
    dup[1].addr = dup[0].addr;
    let addr = dup[0].addr;
    assert_eq!(
        Transfer::new(ok, dup).err(),
        Some(ConfigError::DuplicateBuffer { addr })
    );
}
