//! Multi-rail stream tests against simulated rails: each rail is an RC send
//! queue that executes its requests in order, each `delay` nanoseconds of
//! simulated time after it was posted (a rail with a smaller delay returns
//! its credits sooner: a faster link), reports signaled successes and every
//! error, flushes everything behind an error, and can be held (a port that
//! went down: nothing executes, nothing is reported) and later let go
//! (late completions of a fenced rail).

use std::collections::{BTreeSet, HashMap};

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

/// remote address → (window, extent)
fn locate(addr: u64) -> (u64, u32) {
    let off = addr - 0x8000_0000_0000;
    (off >> 32, ((off & 0xffff_ffff) / SLOT) as u32)
}

fn cfg(batch: usize) -> StreamConfig {
    let mut c = StreamConfig::new(1);
    c.batch = BatchPolicy::with_batch(batch).unwrap();
    c
}

fn rails(depths: &[usize]) -> Vec<RailConfig> {
    depths
        .iter()
        .map(|&d| RailConfig {
            sq_depth: d,
            max_inline: 0,
        })
        .collect()
}

/// One simulated rail.
struct Dev {
    depth: usize,
    delay: u64,
    /// Posted, not executed: the request and when it executes.
    queue: VecDeque<(WorkRequest, u64)>,
    /// Ring slots in use (an executed unsignaled request holds its slot
    /// until a later signaled one completes).
    occupied: usize,
    executed_unretired: usize,
    fail_next: Option<WcStatus>,
    broken: bool,
    held: bool,
    /// Completions made, not yet delivered.
    cq: Vec<WorkCompletion>,
}

impl Dev {
    fn new(depth: usize, delay: u64) -> Self {
        Dev {
            depth,
            delay,
            queue: VecDeque::new(),
            occupied: 0,
            executed_unretired: 0,
            fail_next: None,
            broken: false,
            held: false,
            cq: Vec::new(),
        }
    }

    fn post(&mut self, b: &Batch, now: u64) {
        for wr in &b.wrs {
            if self.broken {
                self.cq.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Flushed,
                    byte_len: 0,
                });
                continue;
            }
            let due = (now + self.delay).max(self.queue.back().map_or(0, |q| q.1));
            self.queue.push_back((*wr, due));
            self.occupied += 1;
        }
        assert!(
            self.occupied <= self.depth,
            "send queue over-filled: {} > {}",
            self.occupied,
            self.depth
        );
    }

    fn next_due(&self) -> Option<u64> {
        if self.held {
            return None;
        }
        self.queue.front().map(|q| q.1)
    }

    /// Execute what is due at `now`; the completions made so far.
    fn run(&mut self, now: u64, landed: &mut HashMap<u64, u32>) -> Vec<WorkCompletion> {
        while !self.held {
            match self.queue.front() {
                Some(&(_, due)) if due <= now => {}
                _ => break,
            }
            let (wr, _) = self.queue.pop_front().unwrap();
            if let Some(status) = self.fail_next.take() {
                self.cq.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status,
                    byte_len: 0,
                });
                self.break_and_flush();
                break;
            }
            *landed.entry(wr.remote.addr).or_default() += 1;
            self.executed_unretired += 1;
            if wr.signaled {
                self.occupied -= self.executed_unretired;
                self.executed_unretired = 0;
                self.cq.push(WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::Success,
                    byte_len: wr.local.len,
                });
            }
        }
        std::mem::take(&mut self.cq)
    }

    /// The queue pair goes to the error state: everything queued flushes.
    fn break_and_flush(&mut self) {
        self.broken = true;
        self.occupied = 0;
        self.executed_unretired = 0;
        for (w, _) in self.queue.drain(..) {
            self.cq.push(WorkCompletion {
                wr_id: w.wr_id,
                status: WcStatus::Flushed,
                byte_len: 0,
            });
        }
    }

    /// Reset: the queue is dropped, nothing reported (completions made
    /// before stay in the CQ and are delivered later, stale).
    fn reset(&mut self) {
        self.queue.clear();
        self.occupied = 0;
        self.executed_unretired = 0;
        self.broken = false;
        self.held = false;
        self.fail_next = None;
    }

    /// Whether a request touching `[lo, hi)` is still in the device.
    fn holds(&self, lo: u64, hi: u64) -> bool {
        self.queue
            .iter()
            .any(|(wr, _)| (lo..hi).contains(&wr.remote.addr))
    }
}

/// A stream over simulated rails, stepped in simulated time.
struct Sim {
    s: Stream,
    devs: Vec<Dev>,
    now: u64,
    landed: HashMap<u64, u32>,
    /// window id → remote address of each extent
    windows: HashMap<u64, Vec<u64>>,
    done: HashMap<u64, u32>,
    /// (time, rail, window, extent) of every request posted.
    posts: Vec<(u64, usize, u64, u32)>,
    rail_events: Vec<(u64, RailEvent)>,
    errors: Vec<(ErrorCause, Recovery)>,
    failed: bool,
}

impl Sim {
    fn new(c: StreamConfig, depths: &[usize], delays: &[u64]) -> Sim {
        Sim {
            s: Stream::with_rails(c, &rails(depths)).unwrap(),
            devs: depths
                .iter()
                .zip(delays)
                .map(|(&d, &l)| Dev::new(d, l))
                .collect(),
            now: 0,
            landed: HashMap::new(),
            windows: HashMap::new(),
            done: HashMap::new(),
            posts: Vec::new(),
            rail_events: Vec::new(),
            errors: Vec::new(),
            failed: false,
        }
    }

    fn add(&mut self, j: WindowJob) {
        self.windows.insert(
            j.id,
            j.extents.iter().map(|e| j.remote_addr + e.offset).collect(),
        );
        match self.s.add_window(j) {
            Ok(()) => {}
            Err(WindowError::Failed) => assert!(self.failed),
            Err(e) => panic!("{e}"),
        }
    }

    fn post(&mut self) {
        let mut b = Batch::default();
        while let Some(r) = self.s.poll_transmit(self.now, &mut b) {
            assert_eq!(self.s.rail_state(r), RailState::Running);
            assert!(self.s.rail_credits_in_use(r) <= self.devs[r].depth);
            for wr in &b.wrs {
                assert_eq!(self.s.rail_of(wr.wr_id), r);
                let (w, _) = locate(wr.remote.addr);
                let e = self.windows[&w]
                    .binary_search(&wr.remote.addr)
                    .expect("an extent's address") as u32;
                assert_eq!(
                    self.s.is_confirmed(w, e),
                    Some(false),
                    "posted a confirmed extent"
                );
                self.posts.push((self.now, r, w, e));
            }
            self.devs[r].post(&b, self.now);
        }
        for r in 0..self.devs.len() {
            assert!(self.s.rail_credits_in_use(r) <= self.devs[r].depth);
        }
    }

    fn deliver(&mut self) {
        for r in 0..self.devs.len() {
            let wcs = self.devs[r].run(self.now, &mut self.landed);
            self.s.on_completions(r, self.now, &wcs);
        }
    }

    fn events(&mut self) {
        while let Some(e) = self.s.poll_event() {
            match e {
                AnyEvent::Stream(Event::WindowDone { id }) => {
                    *self.done.entry(id).or_default() += 1;
                    assert_eq!(self.done[&id], 1, "window {id} done twice");
                    for a in &self.windows[&id] {
                        assert!(
                            self.landed.contains_key(a),
                            "window {id} done before {a:#x} landed"
                        );
                    }
                    // No device still holds a request of the window (each
                    // window has a 4 GiB region of its own).
                    let lo = remote_base(id);
                    for (r, d) in self.devs.iter().enumerate() {
                        assert!(
                            !d.holds(lo, lo + (1 << 32)),
                            "window {id} done while rail {r} still holds a request of it"
                        );
                    }
                }
                AnyEvent::Stream(Event::ErrorBatch { cause, action, .. }) => {
                    if action == Recovery::Fail {
                        self.failed = true;
                    }
                    self.errors.push((cause, action));
                }
                AnyEvent::Stream(_) => {}
                AnyEvent::Rail(e) => self.rail_events.push((self.now, e)),
            }
        }
        if matches!(self.s.state(), State::Failed { .. }) {
            self.failed = true;
        }
    }

    /// One round at the current time.
    fn round(&mut self) {
        if let Some(t) = self.s.next_timeout() {
            if t <= self.now {
                self.s.poll_timeout(self.now);
            }
        }
        self.deliver();
        self.events();
        self.post();
        self.events();
    }

    /// When something next happens on its own.
    fn next_time(&self) -> Option<u64> {
        let dues = self.devs.iter().filter_map(Dev::next_due);
        dues.chain(self.s.next_timeout()).min()
    }

    /// Step until `until` (simulated time) or until nothing happens.
    fn run_until(&mut self, until: u64) {
        self.round();
        while let Some(t) = self.next_time() {
            if t > until {
                break;
            }
            self.now = self.now.max(t);
            self.round();
        }
        self.now = self.now.max(until);
        self.round();
    }

    /// Step until the stream is idle.
    fn run_to_idle(&mut self) {
        self.round();
        let mut n = 0;
        while !self.s.is_idle() && !self.failed {
            n += 1;
            assert!(n < 10_000_000, "stalled: {:?}", self.s.state());
            let t = self.next_time().expect("stuck: nothing will happen");
            self.now = self.now.max(t);
            self.round();
        }
    }

    fn reconnect(&mut self, r: usize) -> u32 {
        self.devs[r].reset();
        let e = self.s.rail_reconnected(r, self.now).unwrap();
        self.events();
        self.post();
        self.events();
        e
    }

    fn rail_bytes(&self, r: usize) -> u64 {
        self.s.rail_counters(r).bytes_confirmed
    }
}

#[test]
fn faster_rails_carry_proportionally_more_bytes() {
    // Three rails of the same depth; rail r takes 1, 2 and 4 us a request.
    let mut sim = Sim::new(cfg(8), &[32, 32, 32], &[1_000, 2_000, 4_000]);
    let (windows, per) = (70u64, 100u32);
    for id in 0..windows {
        sim.add(job(id, OpKind::Write, per, 4096));
    }
    sim.run_to_idle();
    let total = windows * u64::from(per) * 4096;
    let c = sim.s.counters();
    assert_eq!(c.extents_confirmed, windows * u64::from(per));
    assert_eq!(c.bytes_confirmed, total);
    assert_eq!(c.posted, windows * u64::from(per), "nothing posted twice");
    assert_eq!(sim.done.len() as u64, windows);
    let bytes: Vec<u64> = (0..3).map(|r| sim.rail_bytes(r)).collect();
    assert_eq!(bytes.iter().sum::<u64>(), total);
    // Each rail carries its share of the speed: 4 : 2 : 1.
    for (r, want) in [(0usize, 4.0 / 7.0), (1, 2.0 / 7.0), (2, 1.0 / 7.0)] {
        let share = bytes[r] as f64 / total as f64;
        assert!(
            (share - want).abs() < 0.15 * want,
            "rail {r} carried {share:.3} of the bytes, expected {want:.3}: {bytes:?}"
        );
    }
    // Every extent confirmed exactly once across rails.
    let posted: BTreeSet<(u64, u32)> = sim.posts.iter().map(|p| (p.2, p.3)).collect();
    assert_eq!(posted.len() as u64, windows * u64::from(per));
    let sum: u64 = (0..3)
        .map(|r| sim.s.rail_counters(r).extents_confirmed)
        .sum();
    assert_eq!(sum, c.extents_confirmed);
    for r in 0..3 {
        assert_eq!(sim.s.rail_credits_in_use(r), 0);
    }
    assert!(sim.rail_events.is_empty());
}

#[test]
fn a_stream_that_never_fills_a_rail_still_uses_every_rail() {
    // One window at a time, each done before the next arrives: every rail
    // has all its credits free at every post. Ties go round, so both rails
    // carry chains (and a rail back from a failure is used again).
    let mut sim = Sim::new(cfg(4), &[64, 64], &[1_000, 1_000]);
    for id in 0..8 {
        sim.add(job(id, OpKind::Write, 4, 4096));
        sim.run_to_idle();
    }
    let chains: Vec<usize> = (0..2)
        .map(|r| sim.posts.iter().filter(|p| p.1 == r).count())
        .collect();
    assert_eq!(chains, [16, 16], "{:?}", sim.posts);
    // Alternating, window by window.
    let first: Vec<usize> = sim.posts.chunks(4).map(|c| c[0].1).collect();
    assert_eq!(first, [0, 1, 0, 1, 0, 1, 0, 1]);
}

#[test]
fn an_error_batch_moves_the_rail_s_extents_to_the_others_in_the_same_step() {
    // Two rails, 64 credits each, one window of 64 extents: each rail takes
    // 32 and keeps 32 credits free. Rail 1's first request fails.
    let mut sim = Sim::new(cfg(8), &[64, 64], &[10_000, 1_000]);
    sim.add(job(1, OpKind::Write, 64, 4096));
    sim.devs[1].fail_next = Some(WcStatus::RetryExceeded);
    sim.round();
    let on = |sim: &Sim, r: usize| sim.posts.iter().filter(|p| p.1 == r).count();
    assert_eq!((on(&sim, 0), on(&sim, 1)), (32, 32));
    // Rail 1 fails at 1 us; rail 0's first completion is due at 10 us.
    sim.run_until(1_000);
    let fail_at = 1_000;
    assert_eq!(sim.s.rail_state(1), RailState::Down);
    assert_eq!(sim.s.rail_state(0), RailState::Running);
    // Its 32 extents went out on rail 0 at the very time of the error.
    let moved: Vec<_> = sim.posts.iter().skip(64).collect();
    assert_eq!(moved.len(), 32);
    assert!(
        moved.iter().all(|p| p.0 == fail_at && p.1 == 0),
        "{moved:?}"
    );
    let first_rail1: BTreeSet<u32> = sim.posts[..64]
        .iter()
        .filter(|p| p.1 == 1)
        .map(|p| p.3)
        .collect();
    let moved_ext: BTreeSet<u32> = moved.iter().map(|p| p.3).collect();
    assert_eq!(moved_ext, first_rail1, "exactly rail 1's extents, once");
    // Down, then Fenced naming the window, in that order.
    let evs: Vec<&RailEvent> = sim.rail_events.iter().map(|e| &e.1).collect();
    assert!(
        matches!(
            evs[..],
            [
                RailEvent::Down {
                    rail: 1,
                    epoch: 0,
                    cause: ErrorCause::Completion {
                        status: WcStatus::RetryExceeded,
                        ..
                    }
                },
                RailEvent::Fenced {
                    rail: 1,
                    epoch: 0,
                    requeued: 32,
                    ..
                }
            ]
        ),
        "{evs:?}"
    );
    let RailEvent::Fenced { windows, .. } = evs[1] else {
        unreachable!()
    };
    assert_eq!(windows, &vec![1]);
    // The failed rail's flushes were stale: they confirmed nothing.
    assert_eq!(sim.s.rail_counters(1).extents_confirmed, 0);
    assert_eq!(
        sim.s.rail_counters(1).stale,
        31,
        "31 flushed behind the error"
    );
    assert_eq!(sim.s.outstanding(), 64, "rail 0's 32 + the 32 reposted");
    sim.run_to_idle();
    assert_eq!(sim.done[&1], 1);
    let c = sim.s.counters();
    assert_eq!((c.extents_confirmed, c.reposted, c.fences), (64, 32, 1));
    assert_eq!(c.posted, 96);
    assert_eq!(sim.s.rail_counters(0).extents_confirmed, 64);
    assert_eq!(sim.s.rail_counters(1).errors.get(WcStatus::Flushed), 31);
    // The rail rejoins in its next epoch and carries work again.
    assert_eq!(sim.reconnect(1), 1);
    assert!(matches!(
        sim.rail_events.last().unwrap().1,
        RailEvent::Up { rail: 1, epoch: 1 }
    ));
    sim.add(job(2, OpKind::Read, 64, 4096));
    sim.run_to_idle();
    assert!(sim.s.rail_counters(1).extents_confirmed > 0);
    assert!(sim.errors.is_empty(), "no stream error: {:?}", sim.errors);
}

#[test]
fn a_lost_rail_s_late_completions_confirm_nothing() {
    // The port goes down: rail 1's device holds its requests (rxe retries
    // forever), the runtime says `rail_lost`.
    let mut sim = Sim::new(cfg(8), &[64, 64], &[5_000, 5_000]);
    sim.add(job(1, OpKind::Read, 64, 4096));
    sim.round();
    sim.devs[1].held = true;
    let old: Vec<u64> = sim.devs[1].queue.iter().map(|q| q.0.wr_id).collect();
    assert_eq!(old.len(), 32);
    sim.s.rail_lost(1, 100);
    sim.now = 100;
    sim.events();
    sim.post();
    assert_eq!(sim.s.rail_state(1), RailState::Down);
    assert!(
        sim.posts[64..].iter().all(|p| p.0 == 100 && p.1 == 0),
        "reposted at once on rail 0"
    );
    assert_eq!(sim.posts.len(), 96);
    // Rail 0 confirms all 64 extents, but the window is held: rail 1's
    // device may still write into its staging.
    sim.run_until(50_000);
    assert_eq!(sim.s.counters().extents_confirmed, 64);
    assert!(sim.done.is_empty(), "done while a zombie may write into it");
    assert_eq!(sim.s.held_by_zombies(1), Some(32));
    // The link comes back for a moment: rail 1's old requests complete
    // successfully, late. They are stale: nothing is confirmed twice.
    let stale0 = sim.s.counters().stale;
    sim.devs[1].held = false;
    sim.run_until(100_000);
    assert_eq!(
        sim.s.counters().stale - stale0,
        4,
        "its 4 signaled completions"
    );
    assert_eq!(sim.s.counters().extents_confirmed, 64);
    assert_eq!(sim.s.rail_counters(1).extents_confirmed, 0);
    // Those retired the zombies: now the window is done, once.
    assert_eq!(sim.done[&1], 1);
    assert_eq!(sim.s.rail_outstanding(1), 0);
    // After the reconnect, a completion of the old epoch fails the epoch
    // check, and one delivered on the wrong rail is stale too.
    sim.add(job(2, OpKind::Read, 8, 4096));
    sim.reconnect(1);
    let stale1 = sim.s.counters().stale;
    for &id in &old {
        sim.s.on_completions(
            1,
            sim.now,
            &[WorkCompletion {
                wr_id: id,
                status: WcStatus::Success,
                byte_len: 4096,
            }],
        );
    }
    let live_on_1 = sim.devs[1].queue.front().map(|q| q.0.wr_id);
    if let Some(id) = live_on_1 {
        sim.s.on_completions(
            0,
            sim.now,
            &[WorkCompletion {
                wr_id: id,
                status: WcStatus::Success,
                byte_len: 4096,
            }],
        );
    }
    assert_eq!(
        sim.s.counters().stale - stale1,
        old.len() as u64 + u64::from(live_on_1.is_some())
    );
    sim.run_to_idle();
    assert_eq!(sim.done[&2], 1);
    assert_eq!(sim.s.counters().extents_confirmed, 72);
}

#[test]
fn quiescing_a_fenced_rail_releases_its_windows() {
    let mut sim = Sim::new(cfg(4), &[16, 16], &[1_000, 1_000]);
    sim.add(job(7, OpKind::Write, 8, 4096));
    sim.round();
    sim.devs[1].held = true;
    sim.s.rail_lost(1, 0);
    sim.run_until(20_000);
    assert_eq!(sim.s.counters().extents_confirmed, 8);
    assert!(sim.done.is_empty());
    // The runtime moved the QP to reset: the device can touch nothing.
    sim.devs[1].reset();
    sim.s.rail_quiesced(1);
    sim.events();
    assert_eq!(sim.done[&7], 1);
    assert_eq!(sim.s.rail_state(1), RailState::Down, "still to reconnect");
}

#[test]
fn a_flapping_rail_is_paused_with_growing_cooldowns() {
    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;
    let mut c = cfg(4);
    c.rail_policy = RailPolicy {
        flap_window_ns: 20 * S,
        cooldown_ns: S,
        cooldown_cap_ns: 4 * S,
    };
    // 10 ms a request: a slow simulation of a long copy.
    let mut sim = Sim::new(c, &[8, 8], &[10 * MS, 10 * MS]);
    for id in 0..40 {
        sim.add(job(id, OpKind::Write, 100, 4096));
    }
    let cut = |sim: &mut Sim, at: u64| {
        sim.run_until(at);
        sim.s.rail_lost(1, at);
        sim.events();
        sim.post();
    };
    // Three cuts in 20 s; the runtime reconnects 100 ms after each.
    cut(&mut sim, S);
    sim.run_until(S + 100 * MS);
    sim.reconnect(1);
    cut(&mut sim, 8 * S);
    sim.run_until(8 * S + 100 * MS);
    sim.reconnect(1);
    assert_eq!(sim.s.rail_state(1), RailState::Paused { until: 9 * S });
    sim.run_until(9 * S - 1);
    assert_eq!(
        sim.s.rail_state(1),
        RailState::Paused { until: 9 * S },
        "not before its cool-down ends"
    );
    sim.run_until(9 * S);
    assert_eq!(sim.s.rail_state(1), RailState::Running);
    cut(&mut sim, 15 * S);
    sim.run_until(15 * S + 100 * MS);
    sim.reconnect(1);
    sim.run_until(17 * S);
    // The fourth cut in a row pauses it for 4 s, the cap; a reconnect the
    // runtime then gives up on pauses it again.
    cut(&mut sim, 18 * S);
    sim.run_until(22 * S + 500 * MS);
    sim.s.rail_reconnect_failed(1, 22 * S + 500 * MS);
    sim.events();
    sim.run_until(26 * S + 500 * MS);
    sim.reconnect(1);
    // A cut long after the last one is not a repeat: no pause.
    cut(&mut sim, 60 * S);
    sim.run_until(60 * S + 100 * MS);
    sim.reconnect(1);
    let got: Vec<String> = sim
        .rail_events
        .iter()
        .map(|(t, e)| {
            let t = *t as f64 / S as f64;
            match e {
                RailEvent::Down { rail, .. } => format!("{t} down {rail}"),
                RailEvent::Fenced { rail, .. } => format!("{t} fenced {rail}"),
                RailEvent::Paused { rail, for_ns, .. } => {
                    format!("{t} paused {rail} {}", *for_ns as f64 / S as f64)
                }
                RailEvent::Up { rail, .. } => format!("{t} up {rail}"),
            }
        })
        .collect();
    assert_eq!(
        got,
        [
            "1 down 1",
            "1 fenced 1",
            "1.1 up 1",
            "8 down 1",
            "8 fenced 1",
            "8 paused 1 1",
            "9 up 1",
            "15 down 1",
            "15 fenced 1",
            "15 paused 1 2",
            "17 up 1",
            "18 down 1",
            "18 fenced 1",
            "18 paused 1 4",
            "22.5 paused 1 4",
            "26.5 up 1",
            "60 down 1",
            "60 fenced 1",
            "60.1 up 1",
        ],
        "{got:#?}"
    );
    let rc = sim.s.rail_counters(1);
    assert_eq!((rc.failures, rc.fences, rc.pauses), (5, 5, 4));
    assert_eq!((rc.reconnects, rc.reconnect_failures), (5, 1));
    // Rail 0 carried the copy throughout.
    sim.run_to_idle();
    assert_eq!(sim.done.len(), 40);
    assert_eq!(sim.s.counters().extents_confirmed, 4000);
    assert!(sim.rail_bytes(1) > 0 && sim.rail_bytes(0) > sim.rail_bytes(1));
}

#[test]
fn all_rails_down_waits_for_a_reconnect_then_reposts_first() {
    let mut c = cfg(8);
    c.max_reconnects = 2;
    let mut sim = Sim::new(c, &[32, 32], &[1_000, 1_000]);
    for id in 0..4 {
        sim.add(job(id, OpKind::Write, 40, 4096));
    }
    sim.run_until(2_500);
    let confirmed = sim.s.counters().extents_confirmed;
    assert!(confirmed > 0);
    for r in 0..2 {
        sim.devs[r].held = true;
        sim.s.rail_lost(r, 2_500);
    }
    sim.events();
    // The last rail is down too: no pause, the stream waits.
    assert_eq!(sim.s.rail_state(0), RailState::Down);
    assert_eq!(sim.s.rail_state(1), RailState::Down);
    assert_eq!(sim.s.state(), State::NeedsReconnect);
    let posts = sim.posts.len();
    sim.run_until(1_000_000);
    assert_eq!(sim.posts.len(), posts, "nothing posts with every rail down");
    assert!(!sim.failed);
    // Rail 1 comes back first: the extents that were in flight go first.
    let in_flight: BTreeSet<(u64, u32)> = sim
        .devs
        .iter()
        .flat_map(|d| d.queue.iter().map(|q| locate(q.0.remote.addr)))
        .collect();
    sim.devs[0].reset();
    sim.s.rail_quiesced(0);
    sim.reconnect(1);
    assert_eq!(sim.s.state(), State::Running);
    let first: BTreeSet<(u64, u32)> = sim.posts[posts..]
        .iter()
        .take(in_flight.len())
        .map(|p| (p.2, p.3))
        .collect();
    assert_eq!(first, in_flight);
    sim.run_to_idle();
    assert_eq!(sim.done.len(), 4);
    assert_eq!(sim.s.counters().extents_confirmed, 160);
    sim.reconnect(0);

    // Outages in a row that confirm nothing spend the retry budget.
    sim.add(job(9, OpKind::Write, 10, 4096));
    // The first outage after progress is not fruitless; the next three
    // (max_reconnects + 1) in a row are.
    for attempt in 0..4 {
        for r in 0..2 {
            sim.devs[r].held = true;
            sim.s.rail_lost(r, sim.now);
        }
        sim.events();
        if attempt < 3 {
            assert!(!sim.failed, "attempt {attempt}");
            sim.devs[0].reset();
            sim.devs[1].reset();
            sim.reconnect(0);
            sim.reconnect(1);
        }
    }
    assert!(sim.failed);
    assert!(matches!(
        sim.s.state(),
        State::Failed {
            reason: "retry budget exhausted: too many epochs in a row confirmed nothing",
            ..
        }
    ));
    assert_eq!(sim.errors.last().unwrap().1, Recovery::Fail);
    assert_eq!(
        sim.s.rail_reconnected(0, sim.now),
        Err(StreamError::Terminal)
    );
}

#[test]
fn one_rail_streams_raise_no_rail_events_and_keep_their_wr_ids() {
    let mut a = Stream::new(cfg(4).tap(|c| c.sq_depth = 8)).unwrap();
    let mut b = Stream::with_rails(cfg(4), &rails(&[8])).unwrap();
    for s in [&mut a, &mut b] {
        s.add_window(job(1, OpKind::Write, 8, 64)).unwrap();
    }
    let (mut x, mut y) = (Batch::default(), Batch::default());
    assert_eq!(a.poll_transmit(0, &mut x), Some(0));
    assert_eq!(b.poll_transmit(0, &mut y), Some(0));
    assert_eq!(x, y, "with_rails of one rail is Stream::new");
    assert_eq!(a.rail_of(x.wrs[0].wr_id), 0);
    a.rail_lost(0, 0);
    assert_eq!(a.rail_state(0), RailState::NeedsReconnect);
    let evs: Vec<AnyEvent> = std::iter::from_fn(|| a.poll_event()).collect();
    assert!(
        matches!(
            evs.first(),
            Some(AnyEvent::Stream(Event::ErrorBatch { .. }))
        ),
        "{evs:?}"
    );
    assert!(
        evs.iter().all(|e| matches!(e, AnyEvent::Stream(_))),
        "no rail event: {evs:?}"
    );
    assert_eq!(
        Stream::with_rails(cfg(4), &[]).err(),
        Some(StreamConfigError::Rails(0))
    );
    assert_eq!(
        Stream::with_rails(cfg(4), &rails(&[8; MAX_RAILS + 1])).err(),
        Some(StreamConfigError::Rails(MAX_RAILS + 1))
    );
    assert_eq!(
        Stream::with_rails(cfg(4), &rails(&[8, 0])).err(),
        Some(StreamConfigError::SqDepth(0))
    );
}

trait Tap: Sized {
    fn tap(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}
impl Tap for StreamConfig {}

#[test]
fn rail_policy_cooldowns_double_up_to_the_cap() {
    let p = RailPolicy::default();
    let s = 1_000_000_000;
    let got: Vec<u64> = (0..8).map(|k| p.cooldown(k) / s).collect();
    assert_eq!(got, [0, 1, 2, 4, 8, 16, 32, 32]);
    assert_eq!(p.cooldown(200), 32 * s);
    let off = RailPolicy {
        cooldown_ns: 0,
        ..p
    };
    assert_eq!(off.cooldown(3), 0);
}

// ---------------------------------------------------------------------------
// Property: whatever the rails (count, depth, speed), windows, failures,
// losses, quiescing and reconnects: every extent is confirmed exactly once
// (the stream asserts it never confirms one twice; the counters say each
// once), only after it landed; no window is done while a device still holds
// a request of it; every window is done exactly once; and no rail ever has
// more credits taken than its depth.

#[derive(Clone, Debug)]
enum Step {
    /// Let this much simulated time pass.
    Advance(u64),
    /// The rail's next request executed fails (retryable).
    Fail(usize),
    /// The runtime loses the rail; its device stalls (`true`) or goes on.
    Lost(usize, bool),
    /// A stalled device goes on (late completions).
    Resume(usize),
    /// The rail's queue pair is reset; the runtime says so.
    Quiesce(usize),
    /// The runtime reconnects the rail (if it needs it).
    Reconnect(usize),
    /// Every device stalls past the request timeout.
    Stall,
    /// A window of (gap, len) extents, READ or WRITE.
    Window(bool, Vec<(u16, u16)>),
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        12 => (1u64..20_000).prop_map(Step::Advance),
        2 => (0usize..4).prop_map(Step::Fail),
        2 => (0usize..4, any::<bool>()).prop_map(|(r, h)| Step::Lost(r, h)),
        1 => (0usize..4).prop_map(Step::Resume),
        1 => (0usize..4).prop_map(Step::Quiesce),
        3 => (0usize..4).prop_map(Step::Reconnect),
        1 => Just(Step::Stall),
        3 => (any::<bool>(), prop::collection::vec((0u16..3, 1u16..200), 0..30))
            .prop_map(|(r, e)| Step::Window(r, e)),
    ]
}

struct Prop {
    sim: Sim,
    next_id: u64,
    extents: u64,
}

impl Prop {
    fn window(&mut self, read: bool, spec: &[(u16, u16)]) {
        let id = self.next_id;
        self.next_id += 1;
        // One extent a 4 KiB slot at most, so `locate` finds the window;
        // gaps skip slots.
        let mut slot = 0u64;
        let mut extents = Vec::new();
        for &(gap, len) in spec {
            slot += u64::from(gap);
            extents.push(Extent {
                offset: slot * SLOT,
                len: u32::from(len),
            });
            slot += 1;
        }
        self.extents += extents.len() as u64;
        let op = if read { OpKind::Read } else { OpKind::Write };
        self.sim.add(WindowJob {
            id,
            op,
            local_addr: local_base(id),
            lkey: 1,
            remote_addr: remote_base(id),
            rkey: 2,
            extents,
        });
    }

    fn needs_reconnect(&self, r: usize) -> bool {
        let st = self.sim.s.rail_state(r);
        st.is_fenced() || st == RailState::NeedsReconnect
    }

    fn run(&mut self, st: &Step) {
        let n = self.sim.devs.len();
        match *st {
            Step::Advance(dt) => {
                let until = self.sim.now + dt;
                self.sim.run_until(until);
            }
            Step::Fail(r) => self.sim.devs[r % n].fail_next = Some(WcStatus::RetryExceeded),
            Step::Lost(r, hold) => {
                self.sim.devs[r % n].held |= hold;
                self.sim.s.rail_lost(r % n, self.sim.now);
            }
            Step::Resume(r) => self.sim.devs[r % n].held = false,
            Step::Quiesce(r) => {
                let r = r % n;
                if self.sim.s.rail_state(r).is_fenced() {
                    self.sim.devs[r].reset();
                    self.sim.s.rail_quiesced(r);
                }
            }
            Step::Reconnect(r) => {
                let r = r % n;
                if self.needs_reconnect(r) && !self.sim.failed {
                    self.sim.reconnect(r);
                }
            }
            Step::Stall => {
                for d in &mut self.sim.devs {
                    d.held = true;
                }
                self.sim.now += 1_000_000;
                self.sim.s.poll_timeout(self.sim.now);
                for d in &mut self.sim.devs {
                    d.held = false;
                }
            }
            Step::Window(read, ref e) => self.window(read, e),
        }
        self.sim.round();
    }

    /// Without faults: devices go on, rails are reconnected (after their
    /// cool-downs), until every window is done.
    fn finish(&mut self) {
        for d in &mut self.sim.devs {
            d.held = false;
            d.fail_next = None;
        }
        let mut rounds = 0;
        while !self.sim.failed && !self.sim.s.is_idle() {
            rounds += 1;
            assert!(rounds < 100_000, "stalled: {:?}", self.sim.s.state());
            for r in 0..self.sim.devs.len() {
                if let RailState::Paused { until } = self.sim.s.rail_state(r) {
                    self.sim.now = self.sim.now.max(until);
                }
                if self.needs_reconnect(r) {
                    self.sim.reconnect(r);
                }
            }
            let until = self.sim.now + 50_000;
            self.sim.run_until(until);
        }
        self.sim.events();
    }
}

fn check(
    rails_spec: Vec<(usize, u64)>,
    windows: Vec<(bool, Vec<(u16, u16)>)>,
    steps: Vec<Step>,
    batch: (usize, usize),
) {
    let mut c = StreamConfig::new(1);
    c.batch = BatchPolicy::new(batch.0, batch.1.min(batch.0)).unwrap();
    c.request_timeout_ns = 500_000;
    c.max_reconnects = 1_000;
    c.rail_policy = RailPolicy {
        flap_window_ns: 100_000,
        cooldown_ns: 10_000,
        cooldown_cap_ns: 80_000,
    };
    let depths: Vec<usize> = rails_spec.iter().map(|r| r.0).collect();
    let delays: Vec<u64> = rails_spec.iter().map(|r| r.1 * 500).collect();
    let mut p = Prop {
        sim: Sim::new(c, &depths, &delays),
        next_id: 0,
        extents: 0,
    };
    for (r, e) in &windows {
        p.window(*r, e);
    }
    p.sim.round();
    for st in &steps {
        p.run(st);
        if p.sim.failed {
            break;
        }
    }
    p.finish();
    let s = &p.sim.s;
    let c = *s.counters();
    assert!(p.sim.done.values().all(|&n| n == 1), "a window done twice");
    if p.sim.failed {
        assert!(c.extents_confirmed <= p.extents);
        return;
    }
    assert_eq!(p.sim.done.len() as u64, p.next_id, "every window done");
    assert_eq!(
        c.extents_confirmed, p.extents,
        "every extent confirmed once"
    );
    assert_eq!(c.windows_done, p.next_id);
    let per_rail: u64 = (0..s.rails())
        .map(|r| s.rail_counters(r).extents_confirmed)
        .sum();
    assert_eq!(per_rail, p.extents);
    let posted: u64 = (0..s.rails()).map(|r| s.rail_counters(r).posted).sum();
    assert_eq!(posted, c.posted);
    assert!(c.posted >= p.extents);
    assert_eq!(c.posted - c.reposted, p.extents, "only reposts post twice");
    for (r, &d) in depths.iter().enumerate() {
        assert!(s.rail_credits_in_use(r) <= d);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn every_extent_confirmed_once_over_rails(
        rails_spec in prop::collection::vec((1usize..40, 1u64..10), 1..5),
        windows in prop::collection::vec(
            (any::<bool>(), prop::collection::vec((0u16..3, 1u16..4097), 0..60)),
            1..8,
        ),
        steps in prop::collection::vec(step_strategy(), 0..150),
        batch in (1usize..17, 1usize..17),
    ) {
        check(rails_spec, windows, steps, batch);
    }
}
