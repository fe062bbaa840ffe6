//! The session-long stream state machine.
//!
//! A [`Stream`] moves *windows* over one reliable-connected queue pair (or
//! several, *rails*: see [`rail`]) for as long as a session lasts. A window ([`WindowJob`]) is a contiguous region
//! of the peer's registered memory and a local staging region of the same
//! layout, with a list of [`Extent`]s (blocks of possibly many small files,
//! packed): extent `e` is one work request from `local_addr + e.offset` to
//! `remote_addr + e.offset` (WRITE) or back (READ). The stream does no I/O:
//! whoever fills the staging region before a WRITE window and reads it after
//! a READ window does so outside, before [`Stream::add_window`] and after
//! [`Event::WindowDone`].
//!
//! # Protocol with the runtime
//!
//! 1. [`Stream::add_window`] queues a window (windows are served FIFO). An
//!    empty extent list is done at once.
//! 2. [`Stream::poll_transmit`] fills the caller's [`Batch`] (its capacity
//!    reused) with one chain and says which rail to post it on: one
//!    doorbell of up to `batch.chain_len(credits available)` requests,
//!    signaled per the [`BatchPolicy`](crate::engine::BatchPolicy). A chain never reaches past the last
//!    extent of a window, so that extent is signaled and the window is done
//!    as soon as it lands. Post the chain; if the provider took only a
//!    prefix, call [`Stream::post_failed`].
//! 3. Feed each rail's completions to [`Stream::on_completions`]. A
//!    successful signaled completion confirms its request and every earlier
//!    unsignaled one (the RC retirement rule); when the last extent of a
//!    window is confirmed, [`Event::WindowDone`].
//! 4. The first failure of an epoch (error completion, request timeout,
//!    [`Stream::rail_lost`]) stops posting and queues one
//!    [`Event::ErrorBatch`] saying whether to reconnect or give up (a
//!    non-retryable status, or `max_reconnects` epochs in a row that confirmed
//!    nothing). Later completions of the epoch (flushes) are absorbed; when
//!    nothing is outstanding, [`Event::ReadyToReconnect`]. After replacing
//!    the queue pair call [`Stream::rail_reconnected`]: credits are full
//!    again, completions of older epochs are stale, and exactly the
//!    unconfirmed extents are posted again, first. Confirmed extents never
//!    are.
//!
//! Events of both kinds come out of [`Stream::poll_event`] in order.
//!
//! A stream has no "complete" state: it is idle ([`Stream::is_idle`]) when
//! it holds no window. [`State::Failed`] is terminal: every window not yet
//! done is lost (the caller redoes it on a new session).
//!
//! Inline: a WRITE extent of at most [`StreamConfig::max_inline`] bytes is
//! posted inline. The rule lives here only; runtimes post what they get.
//!
//! [`Counters`] are the single source of truth for what was posted,
//! signaled, completed, confirmed and failed; runtimes publish them rather
//! than count again.
//!
//! Time is a `u64` of nanoseconds on any monotonic clock the runtime likes;
//! the stream only compares and adds.
//!
//! # Rails
//!
//! [`Stream::with_rails`] builds a stream over several queue pairs. The
//! protocol above holds with these differences (the [`rail`] module has the
//! whole model): [`Stream::poll_transmit`] picks the chain's rail (the
//! running rail with the most free credits); a rail's failure (an error
//! completion, a timeout, [`Stream::rail_lost`]) *fences* that rail and
//! queues its outstanding extents for the others at once, reported by
//! [`RailEvent`]s among the events;
//! the runtime reconnects the rail in the background and calls
//! [`Stream::rail_reconnected`]. [`Event::ErrorBatch`] then only reports
//! that the stream gave up. One rail is exactly the protocol above.

use std::collections::{HashMap, VecDeque};

pub mod rail;
mod types;

pub use rail::{AnyEvent, RailConfig, RailEvent, RailPolicy, RailState, MAX_RAILS};
pub use types::{
    Batch, Counters, ErrorCause, Event, Extent, Recovery, State, StreamConfig, StreamConfigError,
    StreamError, WindowError, WindowJob,
};

use super::credits::Credits;
use super::inflight::InFlight;
use super::slots::{Slots, WrId, MAX_SLOTS};
use super::wr::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};

/// A request's context: window slab index and extent index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ctx {
    win: u32,
    ext: u32,
}

/// Extents `start..end` of window slab `win`, ready to post.
#[derive(Clone, Copy, Debug)]
struct Run {
    win: u32,
    start: u32,
    end: u32,
}

#[derive(Debug)]
struct Win {
    job: WindowJob,
    /// Order of arrival (reposts go window by window in this order).
    seq: u64,
    /// Confirmed flags, one per extent.
    confirmed: Vec<bool>,
    /// Extents not yet confirmed.
    remaining: u32,
    /// Zombie requests of this window on fenced rails: the window is not
    /// done while a device may still touch its memory.
    held: u32,
}

/// One rail's state (see [`rail`]).
#[derive(Debug)]
struct Rail {
    cfg: RailConfig,
    credits: Credits,
    slots: Slots<Ctx>,
    inflight: InFlight,
    epoch: u32,
    state: RailState,
    /// Paused and reconnected already: rejoins when the cool-down ends.
    rejoin_ready: bool,
    /// One-rail error path: extents the failed epoch left unconfirmed, to
    /// post after the reconnect.
    unconfirmed: Vec<Ctx>,
    /// Failures in a row, each within the flap window of the one before.
    strikes: u32,
    last_failure: Option<u64>,
    counters: Counters,
}

/// The state of one session's data movement over one or more queue pairs
/// (rails). See the module docs and [`rail`].
#[derive(Debug)]
pub struct Stream {
    cfg: StreamConfig,
    rails: Vec<Rail>,
    /// Bits of a `wr_id`'s tag that number the rail (0 for one rail).
    rail_bits: u32,
    /// Live windows by slab index.
    wins: Vec<Option<Win>>,
    free_wins: Vec<u32>,
    /// Window id → slab index.
    live: HashMap<u64, u32>,
    next_seq: u64,
    /// Extents to post, in order.
    ready: VecDeque<Run>,
    /// `Some(State::Failed { .. })` once given up.
    failed: Option<State>,
    /// Extents confirmed since the stream last came up from having no rail
    /// running (one rail: since the epoch started).
    confirmed_since_up: u64,
    fruitless_epochs: u32,
    /// Events of both kinds, in the order they happened.
    events: VecDeque<AnyEvent>,
    counters: Counters,
    scratch: Vec<WrId>,
    /// The latest time the runtime passed in.
    now: u64,
    /// The rail of the last chain posted (ties go round from it).
    last_rail: usize,
}

impl Stream {
    /// A one-rail stream in epoch 0 with no windows.
    pub fn new(cfg: StreamConfig) -> Result<Self, StreamConfigError> {
        Self::with_rails(cfg, &[RailConfig::of(&cfg)])
    }

    /// A stream over `rails.len()` rails (`1..=`[`MAX_RAILS`]), each in
    /// epoch 0, with no windows. `cfg` gives the batch policy, the request
    /// timeout, the retry budget and the rail policy; each rail its own
    /// depth and inline limit (`cfg.sq_depth` and `cfg.max_inline` are
    /// those of a one-rail stream and are not used here). One rail is
    /// exactly [`Stream::new`].
    pub fn with_rails(cfg: StreamConfig, rails: &[RailConfig]) -> Result<Self, StreamConfigError> {
        cfg.validate()?;
        if !(1..=MAX_RAILS).contains(&rails.len()) {
            return Err(StreamConfigError::Rails(rails.len()));
        }
        for r in rails {
            if !(1..=MAX_SLOTS).contains(&r.sq_depth) {
                return Err(StreamConfigError::SqDepth(r.sq_depth));
            }
        }
        let n = rails.len();
        let rail_bits = usize::BITS - (n - 1).leading_zeros();
        let rails = rails
            .iter()
            .enumerate()
            .map(|(i, &rc)| Rail {
                cfg: rc,
                credits: Credits::new(rc.sq_depth),
                slots: Slots::new(rc.sq_depth, tag(rail_bits, i, 0)),
                inflight: InFlight::with_capacity(rc.sq_depth),
                epoch: 0,
                state: RailState::Running,
                rejoin_ready: false,
                unconfirmed: Vec::new(),
                strikes: 0,
                last_failure: None,
                counters: Counters::default(),
            })
            .collect();
        Ok(Stream {
            cfg,
            rails,
            rail_bits,
            wins: Vec::new(),
            free_wins: Vec::new(),
            live: HashMap::new(),
            next_seq: 0,
            ready: VecDeque::new(),
            failed: None,
            confirmed_since_up: 0,
            fruitless_epochs: 0,
            events: VecDeque::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
            now: 0,
            // The first chain goes to rail 0.
            last_rail: n - 1,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StreamConfig {
        &self.cfg
    }

    fn multi(&self) -> bool {
        self.rails.len() > 1
    }

    fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
    }

    fn push_event(&mut self, e: Event) {
        self.events.push_back(AnyEvent::Stream(e));
    }

    fn push_rail_event(&mut self, e: RailEvent) {
        self.events.push_back(AnyEvent::Rail(e));
    }

    /// Queue a window behind those already queued. An empty extent list
    /// yields [`Event::WindowDone`] at once. Refused when the extents are
    /// not sorted and disjoint, an extent is empty or overflows, a live
    /// window has the same id, or the stream has failed.
    pub fn add_window(&mut self, w: WindowJob) -> Result<(), WindowError> {
        if self.failed.is_some() {
            return Err(WindowError::Failed);
        }
        w.validate()?;
        if self.live.contains_key(&w.id) {
            return Err(WindowError::DuplicateId(w.id));
        }
        if w.extents.is_empty() {
            self.counters.windows_done += 1;
            self.push_event(Event::WindowDone { id: w.id });
            return Ok(());
        }
        let n = w.extents.len() as u32;
        let win = Win {
            seq: self.next_seq,
            confirmed: vec![false; n as usize],
            remaining: n,
            held: 0,
            job: w,
        };
        self.next_seq += 1;
        let id = win.job.id;
        let slab = match self.free_wins.pop() {
            Some(i) => {
                self.wins[i as usize] = Some(win);
                i
            }
            None => {
                self.wins.push(Some(win));
                (self.wins.len() - 1) as u32
            }
        };
        self.live.insert(id, slab);
        self.ready.push_back(Run {
            win: slab,
            start: 0,
            end: n,
        });
        Ok(())
    }

    fn win(&self, slab: u32) -> &Win {
        self.wins[slab as usize].as_ref().expect("live window")
    }

    fn win_mut(&mut self, slab: u32) -> &mut Win {
        self.wins[slab as usize].as_mut().expect("live window")
    }

    /// The rail the next chain goes to and how long it may be: the running
    /// rail with the most free credits; on a tie, the first after the rail
    /// of the previous chain (round robin: a stream that never fills a
    /// rail still spreads its chains over every running one).
    fn pick_rail(&self) -> Option<(usize, usize)> {
        if self.failed.is_some() {
            return None;
        }
        let n = self.rails.len();
        let mut best: Option<(usize, usize, usize)> = None;
        for k in 1..=n {
            let i = (self.last_rail + k) % n;
            let r = &self.rails[i];
            if r.state != RailState::Running {
                continue;
            }
            let avail = r.credits.available();
            let room = self.cfg.batch.chain_len(avail);
            if room > 0 && best.is_none_or(|(_, _, a)| avail > a) {
                best = Some((i, room, avail));
            }
        }
        best.map(|(i, room, _)| (i, room))
    }

    /// The rail and bytes of the chain [`poll_transmit`](Self::poll_transmit)
    /// would take now, without taking it (`None`: nothing can be posted). A
    /// rate limiter asks this before it lets the chain go.
    pub fn next_chain(&self) -> Option<(usize, u64)> {
        let (r, room) = self.pick_rail()?;
        let run = self.ready.iter().find(|r| r.start < r.end)?;
        let n = room.min((run.end - run.start) as usize);
        let job = &self.win(run.win).job;
        let first = run.start as usize;
        let bytes = job.extents[first..first + n]
            .iter()
            .map(|e| u64::from(e.len))
            .sum();
        Some((r, bytes))
    }

    /// The next chain to post, into `out` (cleared first, its capacity
    /// reused), and the rail to post it on; `None`, and `out` empty, if
    /// nothing can be posted now (no rail running with credits, or nothing
    /// queued). The requests are accounted as posted at `now`. Post the
    /// chain on that rail's channel; if the provider took only a prefix,
    /// call [`post_failed`](Self::post_failed).
    pub fn poll_transmit(&mut self, now: u64, out: &mut Batch) -> Option<usize> {
        self.tick(now);
        out.wrs.clear();
        out.epoch = self.rails[0].epoch;
        let (r, room) = self.pick_rail()?;
        out.epoch = self.rails[r].epoch;
        let run = loop {
            match self.ready.front() {
                None => return None,
                Some(r) if r.start >= r.end => {
                    self.ready.pop_front();
                }
                Some(&r) => break r,
            }
        };
        self.last_rail = r;
        // A chain ends with the run, and a window's runs end at its last
        // extent: that extent's request is signaled and the window is done
        // as soon as it lands, not when a chain reaching into the next
        // window does.
        let n = room.min((run.end - run.start) as usize);
        let batch = self.cfg.batch;
        let rail = &mut self.rails[r];
        let took = rail.credits.try_take(n);
        debug_assert_eq!(took, n);
        let job = &self.wins[run.win as usize].as_ref().expect("live").job;
        let (op, max_inline) = (job.op, rail.cfg.max_inline);
        out.wrs.reserve(n);
        let (mut signaled_n, mut inline_n, mut bytes) = (0u64, 0u64, 0u64);
        for i in 0..n {
            let ext = run.start + i as u32;
            let signaled = batch.is_signaled(i, n);
            let id = rail
                .slots
                .alloc(Ctx { win: run.win, ext }, now, signaled)
                .expect("a slot per credit");
            rail.inflight.push(id);
            let e = job.extents[ext as usize];
            let inline = op == OpKind::Write && max_inline > 0 && e.len <= max_inline;
            out.wrs.push(WorkRequest {
                wr_id: id.0,
                kind: op,
                local: LocalSeg {
                    addr: job.local_addr + e.offset,
                    len: e.len,
                    lkey: job.lkey,
                },
                remote: RemoteSeg {
                    addr: job.remote_addr + e.offset,
                    rkey: job.rkey,
                },
                signaled,
                inline,
            });
            signaled_n += u64::from(signaled);
            inline_n += u64::from(inline);
            bytes += u64::from(e.len);
        }
        for c in [&mut rail.counters, &mut self.counters] {
            c.posted += n as u64;
            c.doorbells += 1;
            c.signaled += signaled_n;
            c.inline += inline_n;
            c.bytes_posted += bytes;
        }
        let front = self.ready.front_mut().expect("run taken from the front");
        front.start += n as u32;
        if front.start >= front.end {
            self.ready.pop_front();
        }
        Some(r)
    }

    /// Put a run back at the front of the queue, joined with the front run
    /// when it continues into it.
    fn push_front_run(&mut self, r: Run) {
        if let Some(f) = self.ready.front_mut() {
            if f.win == r.win && f.start == r.end {
                f.start = r.start;
                return;
            }
        }
        self.ready.push_front(r);
    }

    /// Queue extents again, first: window by window in arrival order, each
    /// in extent order. Returns how many.
    fn requeue(&mut self, mut again: Vec<Ctx>) -> u64 {
        let seq = |s: &Self, c: &Ctx| s.win(c.win).seq;
        again.sort_unstable_by_key(|c| (seq(self, c), c.ext));
        again.dedup();
        let n = again.len() as u64;
        // Runs of consecutive extents, pushed to the front in order.
        let mut runs: Vec<Run> = Vec::new();
        for c in &again {
            match runs.last_mut() {
                Some(r) if r.win == c.win && r.end == c.ext => r.end += 1,
                _ => runs.push(Run {
                    win: c.win,
                    start: c.ext,
                    end: c.ext + 1,
                }),
            }
        }
        for r in runs.into_iter().rev() {
            self.push_front_run(r);
        }
        n
    }

    /// The rail a `wr_id` of this stream names (0 with one rail). Ids the
    /// stream did not issue may name a rail out of range.
    pub fn rail_of(&self, wr_id: u64) -> usize {
        let mask = (1u32 << self.rail_bits) - 1;
        (u32::from(WrId(wr_id).epoch_bits()) & mask) as usize
    }

    /// The provider accepted only the first `posted` requests of `batch`
    /// (the latest one from [`poll_transmit`](Self::poll_transmit) for its
    /// rail); the rest go back to the front of the queue with their credits
    /// and slots, and the counters forget them. A batch whose requests the
    /// error path already took back is ignored.
    pub fn post_failed(&mut self, batch: &Batch, posted: usize) -> Result<(), StreamError> {
        let unposted = &batch.wrs[posted.min(batch.wrs.len())..];
        let Some(first) = unposted.first() else {
            return Ok(());
        };
        let r = self.rail_of(first.wr_id);
        if r >= self.rails.len() {
            return Ok(());
        }
        let live = |s: &Self, wr: &WorkRequest| {
            s.rail_of(wr.wr_id) == r && s.rails[r].slots.get(WrId(wr.wr_id)).is_ok()
        };
        if batch.epoch != self.rails[r].epoch || !unposted.iter().any(|wr| live(self, wr)) {
            return Ok(());
        }
        if !unposted.iter().all(|wr| live(self, wr)) {
            return Err(StreamError::NotLastBatch);
        }
        // Fenced since the post (not by the runtime, which posts and undoes
        // at once): the fence queued these extents again already.
        let fenced = self.rails[r].state.is_fenced();
        for wr in unposted.iter().rev() {
            let id = WrId(wr.wr_id);
            let rail = &mut self.rails[r];
            if !rail.inflight.pop_newest_if(id) {
                return Err(StreamError::NotLastBatch);
            }
            let Ctx { win, ext } = rail.slots.free(id).expect("checked live").user;
            self.count(r, |c| {
                c.posted -= 1;
                c.signaled -= u64::from(wr.signaled);
                c.inline -= u64::from(wr.inline);
                c.bytes_posted -= u64::from(wr.local.len);
            });
            self.give_credits(r, 1);
            if fenced {
                // Never reached the device: not a zombie, and its requeue
                // is the only post it will have had.
                self.count(r, |c| {
                    c.reposted -= 1;
                    c.requeued -= 1;
                });
                self.win_mut(win).held -= 1;
                self.maybe_done(win);
            } else {
                self.push_front_run(Run {
                    win,
                    start: ext,
                    end: ext + 1,
                });
            }
        }
        if posted == 0 {
            self.count(r, |c| c.doorbells -= 1);
        }
        self.count(r, |c| c.post_failures += 1);
        Ok(())
    }

    /// Count on rail `r` (if the stream has it) and in the totals.
    fn count(&mut self, r: usize, f: impl Fn(&mut Counters)) {
        f(&mut self.counters);
        if let Some(rl) = self.rails.get_mut(r) {
            f(&mut rl.counters);
        }
    }

    fn give_credits(&mut self, rail: usize, n: usize) {
        let r = self.rails[rail].credits.give(n);
        debug_assert!(r.is_ok(), "stream over-returned credits: {r:?}");
    }

    fn stale(&mut self, rail: usize) {
        self.count(rail, |c| c.stale += 1);
    }

    /// Feed one completion that came from `rail`'s completion queue (stale:
    /// one naming another rail, an old epoch, a fenced rail, a reused slot,
    /// a duplicate: counted and ignored).
    fn on_completion(&mut self, rail: usize, wc: &WorkCompletion) {
        let r = rail;
        self.count(r, |c| {
            c.completions += 1;
            c.errors.count(wc.status);
        });
        let id = WrId(wc.wr_id);
        if r >= self.rails.len() || self.rail_of(wc.wr_id) != r {
            self.stale(r);
            return;
        }
        let ctx = match self.rails[r].slots.get(id) {
            Ok(s) => s.user,
            Err(_) => {
                self.stale(r);
                return;
            }
        };
        if self.failed.is_some() {
            // Requests still outstanding when the stream failed: retire
            // them (so `outstanding` tells when the device is done with the
            // memory), confirm nothing.
            self.retire_quietly(r, id);
            return;
        }
        let state = self.rails[r].state;
        match state {
            RailState::Running | RailState::Flushing => {}
            // A fenced epoch: its requests confirm nothing (their extents
            // were queued again); the completion only retires zombies.
            RailState::Down | RailState::Paused { .. } => {
                self.stale(r);
                self.retire_zombies(r, Some(id));
                return;
            }
            RailState::NeedsReconnect => unreachable!("nothing is outstanding once drained"),
        }
        if wc.status.is_success() {
            self.retire_confirmed(r, id);
        } else {
            let window = self.win(ctx.win).job.id;
            let cause = ErrorCause::Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                window,
                extent: ctx.ext,
            };
            let retryable = wc.status.is_retryable();
            if state == RailState::Running {
                if retryable && self.multi() {
                    self.retire_unconfirmed(r, id);
                    self.rail_failed(r, cause);
                    return;
                }
                self.enter_error(
                    r,
                    cause,
                    Some(wc.status),
                    Some((window, ctx.ext)),
                    retryable,
                );
            } else if !retryable {
                self.fail(
                    Some(wc.status),
                    Some((window, ctx.ext)),
                    "non-retryable completion status",
                );
                self.push_event(Event::ErrorBatch {
                    epoch: self.rails[r].epoch,
                    cause,
                    action: Recovery::Fail,
                });
            }
            self.retire_unconfirmed(r, id);
        }
        if self.rails[r].state == RailState::Flushing && self.rails[r].inflight.is_empty() {
            self.drained(r);
        }
    }

    /// Feed completions of `rail`'s completion queue, in order, at `now`
    /// (the time a rail failure among them is recorded at). A successful
    /// signaled completion confirms its request and every earlier
    /// unsignaled one of its rail; stale ones (naming another rail, an old
    /// epoch, a fenced rail, a reused slot, a duplicate) are counted and
    /// ignored.
    pub fn on_completions(&mut self, rail: usize, now: u64, wcs: &[WorkCompletion]) {
        self.tick(now);
        for wc in wcs {
            self.on_completion(rail, wc);
        }
    }

    /// `id` succeeded: it and every earlier request of its rail are
    /// confirmed.
    fn retire_confirmed(&mut self, r: usize, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.rails[r]
                .inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            let rail = &mut self.rails[r];
            let Ctx { win, ext } = rail.slots.free(rid).expect("queued ids are live").user;
            let r_ok = rail.credits.give(1);
            debug_assert!(r_ok.is_ok(), "stream over-returned credits: {r_ok:?}");
            let w = self.wins[win as usize].as_mut().expect("live window");
            assert!(
                !std::mem::replace(&mut w.confirmed[ext as usize], true),
                "extent {ext} of window {} confirmed twice",
                w.job.id
            );
            w.remaining -= 1;
            let len = u64::from(w.job.extents[ext as usize].len);
            self.count(r, |c| {
                c.extents_confirmed += 1;
                c.bytes_confirmed += len;
            });
            self.confirmed_since_up += 1;
            self.maybe_done(win);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// The window is done if every extent is confirmed and no zombie holds
    /// it.
    fn maybe_done(&mut self, slab: u32) {
        let w = self.win(slab);
        if w.remaining == 0 && w.held == 0 {
            self.window_done(slab);
        }
    }

    fn window_done(&mut self, slab: u32) {
        let w = self.wins[slab as usize].take().expect("live window");
        self.live.remove(&w.job.id);
        self.free_wins.push(slab);
        self.counters.windows_done += 1;
        self.push_event(Event::WindowDone { id: w.job.id });
    }

    /// `id` failed: it and every earlier request of its rail are
    /// unconfirmed.
    fn retire_unconfirmed(&mut self, r: usize, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.rails[r]
                .inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            self.unconfirm(r, rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Retire `id` and every earlier request of its rail without confirming
    /// anything (the stream has failed).
    fn retire_quietly(&mut self, r: usize, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.rails[r]
                .inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            self.rails[r].slots.free(rid).expect("queued ids are live");
            self.give_credits(r, 1);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Retire zombies of fenced rail `r`: through `id`, or all of them (the
    /// queue pair can touch no memory any more). Their windows may be done
    /// now.
    fn retire_zombies(&mut self, r: usize, id: Option<WrId>) {
        let mut ids = std::mem::take(&mut self.scratch);
        match id {
            Some(id) => ids.extend(
                self.rails[r]
                    .inflight
                    .retire_through(id)
                    .expect("live ids are queued"),
            ),
            None => ids.extend(self.rails[r].inflight.drain_all()),
        }
        for &rid in &ids {
            let Ctx { win, .. } = self.rails[r]
                .slots
                .free(rid)
                .expect("queued ids are live")
                .user;
            self.give_credits(r, 1);
            self.win_mut(win).held -= 1;
            self.maybe_done(win);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Every outstanding request of rail `r` is unconfirmed (its queue pair
    /// is gone).
    fn abandon_outstanding(&mut self, r: usize) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(self.rails[r].inflight.drain_all());
        for &rid in &ids {
            self.unconfirm(r, rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Free a request's slot; its extent waits for the reconnect. Its credit
    /// stays taken until the queue pair is replaced.
    fn unconfirm(&mut self, r: usize, id: WrId) {
        let rail = &mut self.rails[r];
        let slot = rail.slots.free(id).expect("queued ids are live");
        rail.unconfirmed.push(slot.user);
    }

    fn fail(&mut self, status: Option<WcStatus>, at: Option<(u64, u32)>, reason: &'static str) {
        self.failed = Some(State::Failed {
            status,
            window: at.map(|a| a.0),
            extent: at.map(|a| a.1),
            reason,
        });
    }

    /// Count a fruitless outage (no rail left running) against the retry
    /// budget; true if it is spent.
    fn budget_spent(&mut self) -> bool {
        if self.confirmed_since_up == 0 {
            self.fruitless_epochs += 1;
        } else {
            self.fruitless_epochs = 0;
        }
        self.fruitless_epochs > self.cfg.max_reconnects
    }

    /// One-rail error path (and any non-retryable failure): first failure
    /// of the epoch: stop posting, decide the recovery.
    fn enter_error(
        &mut self,
        r: usize,
        cause: ErrorCause,
        status: Option<WcStatus>,
        at: Option<(u64, u32)>,
        retryable: bool,
    ) {
        debug_assert_eq!(self.rails[r].state, RailState::Running);
        self.count(r, |c| c.failures += 1);
        let spent = self.budget_spent();
        let action = if !retryable {
            self.fail(status, at, "non-retryable completion status");
            Recovery::Fail
        } else if spent {
            self.fail(
                status,
                at,
                "retry budget exhausted: too many epochs in a row confirmed nothing",
            );
            Recovery::Fail
        } else {
            self.rails[r].state = RailState::Flushing;
            Recovery::Reconnect
        };
        self.push_event(Event::ErrorBatch {
            epoch: self.rails[r].epoch,
            cause,
            action,
        });
    }

    /// Record a failure of rail `r` at `now`; the cool-down to pause it
    /// for, if this is a repeat.
    fn note_failure(&mut self, r: usize, now: u64) -> Option<u64> {
        let window = self.cfg.rail_policy.flap_window_ns;
        let rail = &mut self.rails[r];
        let repeat = rail
            .last_failure
            .is_some_and(|t| now.saturating_sub(t) < window);
        rail.strikes = if repeat { rail.strikes + 1 } else { 1 };
        rail.last_failure = Some(now);
        let ns = self.cfg.rail_policy.cooldown(rail.strikes - 1);
        (ns > 0).then_some(ns)
    }

    fn any_running_but(&self, r: usize) -> bool {
        self.rails
            .iter()
            .enumerate()
            .any(|(i, x)| i != r && x.state == RailState::Running)
    }

    /// A retryable failure of running rail `r` in a stream of several
    /// rails: fence it, unless that spends the retry budget.
    fn rail_failed(&mut self, r: usize, cause: ErrorCause) {
        debug_assert!(self.multi());
        debug_assert_eq!(self.rails[r].state, RailState::Running);
        let epoch = self.rails[r].epoch;
        self.count(r, |c| c.failures += 1);
        let pause = self.note_failure(r, self.now);
        self.push_rail_event(RailEvent::Down {
            rail: r,
            epoch,
            cause,
        });
        let others = self.any_running_but(r);
        if !others && self.budget_spent() {
            let (status, at) = match cause {
                ErrorCause::Completion {
                    status,
                    window,
                    extent,
                    ..
                } => (Some(status), Some((window, extent))),
                _ => (None, None),
            };
            self.fail(
                status,
                at,
                "retry budget exhausted: too many epochs in a row confirmed nothing",
            );
            self.push_event(Event::ErrorBatch {
                epoch,
                cause,
                action: Recovery::Fail,
            });
            return;
        }
        // The last rail running is not paused: nothing else would carry the
        // copy meanwhile.
        self.fence(r, pause.filter(|_| others));
    }

    /// Fence rail `r`: its outstanding requests become zombies, their
    /// extents (and those its epoch left unconfirmed) go back to the front
    /// of the queue; it is down, or paused for `pause` nanoseconds.
    fn fence(&mut self, r: usize, pause: Option<u64>) {
        let now = self.now;
        let rail = &mut self.rails[r];
        let epoch = rail.epoch;
        let mut ctxs = std::mem::take(&mut rail.unconfirmed);
        let retired = ctxs.len();
        ctxs.extend(
            rail.inflight
                .iter()
                .map(|id| rail.slots.get(id).expect("queued ids are live").user),
        );
        for c in &ctxs[retired..] {
            let w = self.wins[c.win as usize].as_mut().expect("live window");
            debug_assert!(
                !w.confirmed[c.ext as usize],
                "a live request of a confirmed extent"
            );
            w.held += 1;
        }
        let mut windows: Vec<(u64, u64)> = ctxs
            .iter()
            .map(|c| {
                let w = self.win(c.win);
                (w.seq, w.job.id)
            })
            .collect();
        windows.sort_unstable();
        windows.dedup();
        let requeued = self.requeue(ctxs);
        self.count(r, |c| {
            c.reposted += requeued;
            c.requeued += requeued;
            c.fences += 1;
        });
        let rail = &mut self.rails[r];
        rail.rejoin_ready = false;
        rail.state = match pause {
            Some(ns) => RailState::Paused {
                until: now.saturating_add(ns),
            },
            None => RailState::Down,
        };
        self.push_rail_event(RailEvent::Fenced {
            rail: r,
            epoch,
            windows: windows.into_iter().map(|(_, id)| id).collect(),
            requeued,
        });
        if let Some(ns) = pause {
            self.paused(r, now, ns);
        }
    }

    fn paused(&mut self, r: usize, now: u64, ns: u64) {
        let until = now.saturating_add(ns);
        self.rails[r].state = RailState::Paused { until };
        self.count(r, |c| c.pauses += 1);
        self.push_rail_event(RailEvent::Paused {
            rail: r,
            until,
            for_ns: ns,
        });
    }

    /// Nothing outstanding in a failed epoch (one-rail error path).
    fn drained(&mut self, r: usize) {
        let rail = &mut self.rails[r];
        rail.state = RailState::NeedsReconnect;
        let (epoch, unconfirmed) = (rail.epoch, rail.unconfirmed.len() as u64);
        self.push_event(Event::ReadyToReconnect { epoch, unconfirmed });
    }

    /// When [`poll_timeout`](Self::poll_timeout) next has work: the oldest
    /// outstanding request's post time plus the timeout (on any running
    /// rail), or the end of the cool-down of a paused rail that is
    /// reconnected already. `None` if there is no such time (timeouts
    /// disabled or nothing outstanding, no such pause) or the stream has
    /// failed.
    pub fn next_timeout(&self) -> Option<u64> {
        if self.failed.is_some() {
            return None;
        }
        let mut t: Option<u64> = None;
        let mut at = |x: u64| t = Some(t.map_or(x, |t| t.min(x)));
        for r in &self.rails {
            match r.state {
                RailState::Paused { until } if r.rejoin_ready => at(until),
                RailState::Running | RailState::Flushing if self.cfg.request_timeout_ns > 0 => {
                    let oldest = r.inflight.oldest().and_then(|o| r.slots.get(o).ok());
                    if let Some(slot) = oldest {
                        at(slot.posted_at.saturating_add(self.cfg.request_timeout_ns));
                    }
                }
                _ => {}
            }
        }
        t
    }

    /// Expire requests outstanding for the timeout or longer: each is
    /// reported ([`Event::Timeout`]); the queue pair is then presumed stuck,
    /// so its rail fails: with one rail, every outstanding request is
    /// unconfirmed (the contexts freed) and the stream needs a reconnect
    /// (or fails if the retry budget is spent); with several, the rail is
    /// fenced (its requests held as zombies until it is quiesced). Also
    /// lets a reconnected paused rail rejoin once its cool-down has ended.
    pub fn poll_timeout(&mut self, now: u64) {
        self.tick(now);
        if self.failed.is_some() {
            return;
        }
        for r in 0..self.rails.len() {
            if let RailState::Paused { until } = self.rails[r].state {
                if self.rails[r].rejoin_ready && now >= until {
                    self.rail_up(r);
                }
            }
        }
        if self.cfg.request_timeout_ns == 0 {
            return;
        }
        for r in 0..self.rails.len() {
            if self.failed.is_some() {
                return;
            }
            if !matches!(
                self.rails[r].state,
                RailState::Running | RailState::Flushing
            ) {
                continue;
            }
            let expired = self.rails[r]
                .slots
                .expired(now, self.cfg.request_timeout_ns);
            let Some(&first) = expired.first() else {
                continue;
            };
            for id in &expired {
                let Ctx { win, ext } = self.rails[r]
                    .slots
                    .get(*id)
                    .expect("expired ids are live")
                    .user;
                self.count(r, |c| c.timeouts += 1);
                let window = self.win(win).job.id;
                self.push_event(Event::Timeout {
                    wr_id: id.0,
                    window,
                    extent: ext,
                });
            }
            let cause = ErrorCause::Timeout { wr_id: first.0 };
            if self.multi() {
                if self.rails[r].state == RailState::Running {
                    self.rail_failed(r, cause);
                }
                continue;
            }
            if self.rails[r].state == RailState::Running {
                self.enter_error(r, cause, None, None, true);
            }
            if self.failed.is_some() {
                self.forget_outstanding(r);
                return;
            }
            self.abandon_outstanding(r);
            self.drained(r);
        }
    }

    /// The stream failed and rail `r`'s requests are presumed lost: free
    /// their contexts, confirm nothing.
    fn forget_outstanding(&mut self, r: usize) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(self.rails[r].inflight.drain_all());
        for &rid in &ids {
            self.rails[r].slots.free(rid).expect("queued ids are live");
        }
        ids.clear();
        self.scratch = ids;
    }

    /// The runtime lost rail `rail` at `now` (its port went down, an async
    /// QP error, a TCP reset). With one rail: every outstanding request is
    /// unconfirmed and the stream needs a reconnect (or fails if the retry
    /// budget is spent). With several: the rail is fenced, its outstanding
    /// extents queued for the other rails at once (see [`rail`]). No-op
    /// unless the rail is running (or, one rail, flushing).
    pub fn rail_lost(&mut self, rail: usize, now: u64) {
        self.tick(now);
        if self.failed.is_some() || rail >= self.rails.len() {
            return;
        }
        let r = rail;
        match self.rails[r].state {
            RailState::Running if self.multi() => {
                self.rail_failed(r, ErrorCause::ConnectionLost);
                return;
            }
            RailState::Running => {
                self.enter_error(r, ErrorCause::ConnectionLost, None, None, true);
            }
            RailState::Flushing => {}
            _ => return,
        }
        if self.rails[r].state == RailState::Flushing {
            self.abandon_outstanding(r);
            self.drained(r);
        } else {
            self.forget_outstanding(r);
        }
    }

    /// Fenced rail `rail`'s queue pair can touch no memory any more (it was
    /// reset, or moved to the error state and its requests are gone): its
    /// zombies are retired, and windows they held may be done. No-op
    /// unless the rail is down or paused.
    pub fn rail_quiesced(&mut self, rail: usize) {
        if self.rails.get(rail).is_some_and(|r| r.state.is_fenced()) {
            self.retire_zombies(rail, None);
        }
    }

    /// The runtime gave up reconnecting rail `rail` for now (its attempts
    /// ran out) at `now`: the rail is paused (its next cool-down, at least
    /// the first one) and the runtime tries again when it ends. No-op
    /// unless the rail is down or paused in a stream of several rails.
    pub fn rail_reconnect_failed(&mut self, rail: usize, now: u64) {
        self.tick(now);
        if !self.multi()
            || self.failed.is_some()
            || !self.rails.get(rail).is_some_and(|r| r.state.is_fenced())
        {
            return;
        }
        self.count(rail, |c| c.reconnect_failures += 1);
        let ns = self
            .note_failure(rail, now)
            .unwrap_or(self.cfg.rail_policy.cooldown(1));
        if ns > 0 {
            self.paused(rail, now, ns);
        }
    }

    /// The runtime replaced rail `rail`'s queue pair at `now`. Starts the
    /// rail's next epoch and returns it: its credits are full again, slots
    /// of older epochs are gone (their completions count as stale), and
    /// exactly the unconfirmed extents of its failed epoch (one rail) are
    /// posted again, first (window by window in arrival order, each in
    /// extent order). Confirmed extents are never posted again. Anything
    /// still outstanding on it is abandoned (one rail: as unconfirmed;
    /// zombies of a fenced rail: retired). The rail runs again at once,
    /// or, if paused, when its cool-down ends ([`poll_timeout`](Self::poll_timeout)).
    pub fn rail_reconnected(&mut self, rail: usize, now: u64) -> Result<u32, StreamError> {
        self.tick(now);
        if self.failed.is_some() {
            return Err(StreamError::Terminal);
        }
        let r = rail;
        if r >= self.rails.len() {
            return Err(StreamError::NoSuchRail(r));
        }
        if self.rails[r].state.is_fenced() {
            self.retire_zombies(r, None);
        } else {
            self.abandon_outstanding(r);
        }
        let bits = self.rail_bits;
        let rl = &mut self.rails[r];
        rl.epoch = rl.epoch.wrapping_add(1);
        let leftover = rl.slots.clear(tag(bits, r, rl.epoch));
        debug_assert!(leftover.is_empty());
        rl.credits.reset();
        let epoch = rl.epoch;
        let again = std::mem::take(&mut rl.unconfirmed);
        let reposted = self.requeue(again);
        self.count(r, |c| {
            c.reposted += reposted;
            c.reconnects += 1;
        });
        match self.rails[r].state {
            RailState::Paused { until } if now < until => self.rails[r].rejoin_ready = true,
            _ => self.rail_up(r),
        }
        Ok(epoch)
    }

    /// Rail `r` runs (again).
    fn rail_up(&mut self, r: usize) {
        if !self.multi() || !self.any_running_but(r) {
            self.confirmed_since_up = 0;
        }
        let rail = &mut self.rails[r];
        rail.state = RailState::Running;
        rail.rejoin_ready = false;
        let epoch = rail.epoch;
        if self.multi() {
            self.push_rail_event(RailEvent::Up { rail: r, epoch });
        }
    }

    /// The oldest queued event: a stream [`Event`] or (streams of several
    /// rails) a [`RailEvent`], in the order they happened.
    pub fn poll_event(&mut self) -> Option<AnyEvent> {
        self.events.pop_front()
    }

    /// Whether an event of either kind is queued.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Where the stream stands. With several rails: running while any rail
    /// runs, else waiting for a reconnect ([`State::NeedsReconnect`]).
    pub fn state(&self) -> State {
        if let Some(f) = self.failed {
            return f;
        }
        if !self.multi() {
            return match self.rails[0].state {
                RailState::Running => State::Running,
                RailState::Flushing => State::Flushing,
                _ => State::NeedsReconnect,
            };
        }
        if self.rails.iter().any(|r| r.state == RailState::Running) {
            State::Running
        } else {
            State::NeedsReconnect
        }
    }

    /// No live window (nothing queued, nothing outstanding).
    pub fn is_idle(&self) -> bool {
        self.live.is_empty()
    }

    /// Live windows (queued, partly confirmed, or held).
    pub fn windows(&self) -> usize {
        self.live.len()
    }

    /// Requests posted and not yet retired, on all rails (zombies
    /// included: a device may still hold them).
    pub fn outstanding(&self) -> usize {
        self.rails.iter().map(|r| r.inflight.len()).sum()
    }

    /// Send-queue credits taken on all rails (on each, never above its
    /// depth).
    pub fn credits_in_use(&self) -> usize {
        self.rails.iter().map(|r| r.credits.in_use()).sum()
    }

    /// Extents the failed epoch left unconfirmed so far, as (window id,
    /// extent index), unordered; they are posted again after
    /// [`rail_reconnected`](Self::rail_reconnected). Empty while running (and always
    /// with several rails, whose fences queue them again at once).
    pub fn unconfirmed(&self) -> Vec<(u64, u32)> {
        self.rails
            .iter()
            .flat_map(|r| r.unconfirmed.iter())
            .map(|c| (self.win(c.win).job.id, c.ext))
            .collect()
    }

    /// Whether extent `extent` of live window `id` is confirmed; `None` if
    /// the window is not live.
    pub fn is_confirmed(&self, id: u64, extent: u32) -> Option<bool> {
        let w = self.win(*self.live.get(&id)?);
        w.confirmed.get(extent as usize).copied()
    }

    /// Zombie requests holding live window `id` (requests of it on fenced
    /// rails that a device may still touch); `None` if not live.
    pub fn held_by_zombies(&self, id: u64) -> Option<u32> {
        Some(self.win(*self.live.get(&id)?).held)
    }

    /// Running totals (all rails).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Number of rails.
    pub fn rails(&self) -> usize {
        self.rails.len()
    }

    /// Where rail `rail` stands. Panics if there is no such rail.
    pub fn rail_state(&self, rail: usize) -> RailState {
        self.rails[rail].state
    }

    /// Rail `rail`'s configuration.
    pub fn rail_config(&self, rail: usize) -> &RailConfig {
        &self.rails[rail].cfg
    }

    /// Rail `rail`'s running totals.
    pub fn rail_counters(&self, rail: usize) -> &Counters {
        &self.rails[rail].counters
    }

    /// Credits taken on rail `rail` (never above its depth).
    pub fn rail_credits_in_use(&self, rail: usize) -> usize {
        self.rails[rail].credits.in_use()
    }

    /// Requests outstanding on rail `rail` (zombies included).
    pub fn rail_outstanding(&self, rail: usize) -> usize {
        self.rails[rail].inflight.len()
    }
}

/// The 16-bit `wr_id` tag of `rail`'s `epoch`: `epoch << bits | rail`.
fn tag(bits: u32, rail: usize, epoch: u32) -> u32 {
    epoch.wrapping_shl(bits) | rail as u32
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod rail_tests;
