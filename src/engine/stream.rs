//! The session-long stream state machine.
//!
//! A [`Stream`] moves *windows* over one reliable-connected queue pair for as
//! long as a session lasts. A window ([`WindowJob`]) is a contiguous region
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
//! 2. [`Stream::poll_transmit`] (or [`Stream::poll_transmit_into`], which
//!    reuses the caller's [`Batch`]) returns one chain: one doorbell of up to
//!    `batch.chain_len(credits available)` requests, signaled per the
//!    [`BatchPolicy`]. A chain never reaches past the last extent of a
//!    window, so that extent is signaled and the window is done as soon as
//!    it lands. Post the chain; if the provider took only a prefix, call
//!    [`Stream::post_failed`].
//! 3. Feed completions to [`Stream::on_completions`]. A successful signaled
//!    completion confirms its request and every earlier unsignaled one (the
//!    RC retirement rule); when the last extent of a window is confirmed,
//!    [`Event::WindowDone`].
//! 4. The first failure of an epoch (error completion, request timeout,
//!    [`Stream::connection_lost`]) stops posting and queues one
//!    [`Event::ErrorBatch`] saying whether to reconnect or give up (a
//!    non-retryable status, or `max_retries` epochs in a row that confirmed
//!    nothing). Later completions of the epoch (flushes) are absorbed; when
//!    nothing is outstanding, [`Event::ReadyToReconnect`]. After replacing
//!    the queue pair call [`Stream::reconnected`]: credits are full again,
//!    completions of older epochs are stale, and exactly the unconfirmed
//!    extents are posted again, first. Confirmed extents never are.
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

use std::collections::{HashMap, VecDeque};
use std::fmt;

use super::batch::{BatchPolicy, BatchPolicyError};
use super::credits::Credits;
use super::inflight::InFlight;
use super::slots::{Slots, WrId, MAX_SLOTS};
use super::wr::{ErrorCounts, LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};

/// Static parameters of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Send-queue depth of the queue pair (`1..=65536`): credits and slots.
    pub sq_depth: usize,
    /// Chain length and signaling.
    pub batch: BatchPolicy,
    /// WRITE extents of at most this many bytes are posted inline; 0
    /// disables.
    pub max_inline: u32,
    /// A request outstanding this long (nanoseconds) fails the epoch; 0
    /// disables.
    pub request_timeout_ns: u64,
    /// Reconnects allowed in a row without an extent confirmed in between;
    /// the next fruitless failure fails the stream.
    pub max_retries: u32,
}

impl StreamConfig {
    /// Defaults: chains of 32 signaled at the tail, no inline, no timeout,
    /// 3 fruitless retries.
    pub fn new(sq_depth: usize) -> Self {
        StreamConfig {
            sq_depth,
            batch: BatchPolicy::default(),
            max_inline: 0,
            request_timeout_ns: 0,
            max_retries: 3,
        }
    }

    /// Check the fields that have ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.batch.validate().map_err(ConfigError::Batch)?;
        if !(1..=MAX_SLOTS).contains(&self.sq_depth) {
            return Err(ConfigError::SqDepth(self.sq_depth));
        }
        Ok(())
    }
}

/// A [`StreamConfig`] that cannot work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// Bad batch policy.
    Batch(BatchPolicyError),
    /// `sq_depth` not in `1..=65536`.
    SqDepth(usize),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ConfigError::Batch(e) => e.fmt(f),
            ConfigError::SqDepth(d) => {
                write!(f, "sq_depth = {d} is out of range (1..={MAX_SLOTS})")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// One request's worth of a window: `len` bytes at `offset` from the start
/// of the window, the same offset on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Offset within the window (local and remote alike).
    pub offset: u64,
    /// Bytes, at least 1.
    pub len: u32,
}

/// A window to move: a local staging region and a remote region of the same
/// layout, and the extents of it to move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowJob {
    /// The caller's id, unique among the live windows of the stream.
    pub id: u64,
    /// WRITE (local → remote) or READ (remote → local).
    pub op: OpKind,
    /// Start of the local staging region.
    pub local_addr: u64,
    /// Its lkey.
    pub lkey: u32,
    /// Start of the remote region.
    pub remote_addr: u64,
    /// Its rkey.
    pub rkey: u32,
    /// Sorted by offset, non-overlapping, each at least one byte.
    pub extents: Vec<Extent>,
}

impl WindowJob {
    /// Bytes in all extents.
    pub fn bytes(&self) -> u64 {
        self.extents.iter().map(|e| u64::from(e.len)).sum()
    }

    /// Check the extents (sorted, non-overlapping, non-empty, every address
    /// computable without overflow). The id's liveness is the stream's to
    /// check.
    pub fn validate(&self) -> Result<(), WindowError> {
        if self.extents.len() > u32::MAX as usize {
            return Err(WindowError::TooManyExtents(self.extents.len()));
        }
        let mut prev_end = 0u64;
        for (i, e) in self.extents.iter().enumerate() {
            let index = i as u32;
            if e.len == 0 {
                return Err(WindowError::EmptyExtent { index });
            }
            let end = e
                .offset
                .checked_add(u64::from(e.len))
                .filter(|&end| {
                    self.local_addr.checked_add(end).is_some()
                        && self.remote_addr.checked_add(end).is_some()
                })
                .ok_or(WindowError::Overflow { index })?;
            if i > 0 {
                let prev = self.extents[i - 1].offset;
                if e.offset < prev {
                    return Err(WindowError::Unsorted { index });
                }
                if e.offset < prev_end {
                    return Err(WindowError::Overlap { index });
                }
            }
            prev_end = end;
        }
        Ok(())
    }
}

/// A window the stream refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowError {
    /// Extent `index` has length 0.
    EmptyExtent {
        /// Its position.
        index: u32,
    },
    /// Extent `index` starts before the one before it.
    Unsorted {
        /// Its position.
        index: u32,
    },
    /// Extent `index` starts inside the one before it.
    Overlap {
        /// Its position.
        index: u32,
    },
    /// Extent `index` ends beyond `u64::MAX` on one side.
    Overflow {
        /// Its position.
        index: u32,
    },
    /// More than `u32::MAX` extents.
    TooManyExtents(usize),
    /// A live window has this id.
    DuplicateId(u64),
    /// The stream has failed; it takes no more windows.
    Failed,
}

impl fmt::Display for WindowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WindowError::EmptyExtent { index } => write!(f, "extent {index} is empty"),
            WindowError::Unsorted { index } => {
                write!(f, "extent {index} starts before the extent before it")
            }
            WindowError::Overlap { index } => {
                write!(f, "extent {index} overlaps the extent before it")
            }
            WindowError::Overflow { index } => {
                write!(f, "extent {index} ends beyond the address space")
            }
            WindowError::TooManyExtents(n) => write!(f, "{n} extents in one window"),
            WindowError::DuplicateId(id) => write!(f, "window {id} is already live"),
            WindowError::Failed => f.write_str("the stream has failed"),
        }
    }
}

impl std::error::Error for WindowError {}

/// A call the stream's state does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamError {
    /// The stream has failed; nothing to reconnect.
    Terminal,
    /// [`Stream::post_failed`] got a batch that is not the latest one.
    NotLastBatch,
}

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamError::Terminal => f.write_str("the stream has failed"),
            StreamError::NotLastBatch => {
                f.write_str("post_failed must be given the latest batch, before the next poll")
            }
        }
    }
}

impl std::error::Error for StreamError {}

/// One chain to post with one doorbell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Epoch the requests belong to.
    pub epoch: u32,
    /// The requests, in post order.
    pub wrs: Vec<WorkRequest>,
}

/// What started the error path of an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCause {
    /// A completion with a non-success status.
    Completion {
        /// Its `wr_id`.
        wr_id: u64,
        /// Its status.
        status: WcStatus,
        /// The window of that request.
        window: u64,
        /// Its extent (index in the window's list).
        extent: u32,
    },
    /// A request outstanding longer than the timeout.
    Timeout {
        /// The oldest expired `wr_id`.
        wr_id: u64,
    },
    /// The runtime reported the connection gone.
    ConnectionLost,
}

/// What the runtime should do about an error batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Replace the queue pair, then call [`Stream::reconnected`].
    Reconnect,
    /// Give up; see [`State::Failed`].
    Fail,
}

/// Something the runtime must act on or report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Every extent of the window is confirmed; the window is no longer
    /// live (its staging region is the caller's again, its id free).
    WindowDone {
        /// Window id.
        id: u64,
    },
    /// The epoch failed: posting stopped.
    ErrorBatch {
        /// The failed epoch.
        epoch: u32,
        /// What failed first.
        cause: ErrorCause,
        /// Reconnect or give up.
        action: Recovery,
    },
    /// A request expired; its context is freed (log it).
    Timeout {
        /// Its `wr_id`.
        wr_id: u64,
        /// Its window.
        window: u64,
        /// Its extent.
        extent: u32,
    },
    /// Every request of the failed epoch is accounted for.
    ReadyToReconnect {
        /// The failed epoch.
        epoch: u32,
        /// Extents that will be posted again.
        unconfirmed: u64,
    },
}

/// Where the stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Posting and completing (idle when it has no window).
    Running,
    /// An error arrived: not posting, absorbing the epoch's remaining
    /// completions.
    Flushing,
    /// Nothing outstanding; waiting for [`Stream::reconnected`].
    NeedsReconnect,
    /// Given up (terminal).
    Failed {
        /// The status that decided it, if a completion did.
        status: Option<WcStatus>,
        /// The window of that completion.
        window: Option<u64>,
        /// Its extent.
        extent: Option<u32>,
        /// Why.
        reason: &'static str,
    },
}

/// Running totals: the one count of what the stream did, which runtimes
/// publish (reports, metrics) instead of counting again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests posted (accepted by the provider).
    pub posted: u64,
    /// Chains posted (doorbells rung).
    pub doorbells: u64,
    /// Signaled requests posted.
    pub signaled: u64,
    /// Inline requests posted.
    pub inline: u64,
    /// Bytes in requests posted.
    pub bytes_posted: u64,
    /// Completions received (all, including stale).
    pub completions: u64,
    /// Non-success completions by status.
    pub errors: ErrorCounts,
    /// Completions whose `wr_id` named no live request (old epoch, reused
    /// slot, duplicate).
    pub stale: u64,
    /// Requests that expired.
    pub timeouts: u64,
    /// Epochs that failed.
    pub error_batches: u64,
    /// Reconnects (epochs started after the first).
    pub reconnects: u64,
    /// Extents posted again after a reconnect.
    pub reposted: u64,
    /// Calls to [`Stream::post_failed`] that took requests back.
    pub post_failures: u64,
    /// Extents confirmed.
    pub extents_confirmed: u64,
    /// Bytes in extents confirmed.
    pub bytes_confirmed: u64,
    /// Windows done.
    pub windows_done: u64,
}

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
}

/// The state of one session's data movement over one queue pair. See the
/// module docs.
#[derive(Debug)]
pub struct Stream {
    cfg: StreamConfig,
    credits: Credits,
    slots: Slots<Ctx>,
    inflight: InFlight,
    /// Live windows by slab index.
    wins: Vec<Option<Win>>,
    free_wins: Vec<u32>,
    /// Window id → slab index.
    live: HashMap<u64, u32>,
    next_seq: u64,
    /// Extents to post, in order.
    ready: VecDeque<Run>,
    epoch: u32,
    state: State,
    /// Extents the failed epoch left unconfirmed, to post after the
    /// reconnect.
    unconfirmed: Vec<Ctx>,
    confirmed_in_epoch: u64,
    fruitless_epochs: u32,
    events: VecDeque<Event>,
    counters: Counters,
    scratch: Vec<WrId>,
}

impl Stream {
    /// A stream in epoch 0 with no windows.
    pub fn new(cfg: StreamConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Stream {
            cfg,
            credits: Credits::new(cfg.sq_depth),
            slots: Slots::new(cfg.sq_depth, 0),
            inflight: InFlight::with_capacity(cfg.sq_depth),
            wins: Vec::new(),
            free_wins: Vec::new(),
            live: HashMap::new(),
            next_seq: 0,
            ready: VecDeque::new(),
            epoch: 0,
            state: State::Running,
            unconfirmed: Vec::new(),
            confirmed_in_epoch: 0,
            fruitless_epochs: 0,
            events: VecDeque::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StreamConfig {
        &self.cfg
    }

    /// Queue a window behind those already queued. An empty extent list
    /// yields [`Event::WindowDone`] at once. Refused when the extents are
    /// not sorted and disjoint, an extent is empty or overflows, a live
    /// window has the same id, or the stream has failed.
    pub fn add_window(&mut self, w: WindowJob) -> Result<(), WindowError> {
        if matches!(self.state, State::Failed { .. }) {
            return Err(WindowError::Failed);
        }
        w.validate()?;
        if self.live.contains_key(&w.id) {
            return Err(WindowError::DuplicateId(w.id));
        }
        if w.extents.is_empty() {
            self.counters.windows_done += 1;
            self.events.push_back(Event::WindowDone { id: w.id });
            return Ok(());
        }
        let n = w.extents.len() as u32;
        let win = Win {
            seq: self.next_seq,
            confirmed: vec![false; n as usize],
            remaining: n,
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

    /// The next chain to post, or `None` if nothing can be posted now (not
    /// running, no credits, or nothing queued). The requests are accounted
    /// as posted at `now`. Allocates the batch; the runtime's hot path uses
    /// [`poll_transmit_into`](Self::poll_transmit_into).
    pub fn poll_transmit(&mut self, now: u64) -> Option<Batch> {
        let mut b = Batch::default();
        self.poll_transmit_into(now, &mut b).then_some(b)
    }

    /// Bytes of the chain [`poll_transmit`](Self::poll_transmit) would
    /// return now, without taking it (`None`: nothing can be posted). A
    /// rate limiter asks this before it lets the chain go.
    pub fn next_chain_bytes(&self) -> Option<u64> {
        if self.state != State::Running {
            return None;
        }
        let room = self.cfg.batch.chain_len(self.credits.available());
        if room == 0 {
            return None;
        }
        let run = self.ready.iter().find(|r| r.start < r.end)?;
        let n = room.min((run.end - run.start) as usize);
        let job = &self.win(run.win).job;
        let first = run.start as usize;
        Some(
            job.extents[first..first + n]
                .iter()
                .map(|e| u64::from(e.len))
                .sum(),
        )
    }

    /// [`poll_transmit`](Self::poll_transmit) into `out` (cleared first, its
    /// capacity reused); false, and `out` empty, if nothing can be posted.
    pub fn poll_transmit_into(&mut self, now: u64, out: &mut Batch) -> bool {
        out.wrs.clear();
        out.epoch = self.epoch;
        if self.state != State::Running {
            return false;
        }
        let room = self.cfg.batch.chain_len(self.credits.available());
        if room == 0 {
            return false;
        }
        let run = loop {
            match self.ready.front() {
                None => return false,
                Some(r) if r.start >= r.end => {
                    self.ready.pop_front();
                }
                Some(&r) => break r,
            }
        };
        // A chain ends with the run, and a window's runs end at its last
        // extent: that extent's request is signaled and the window is done
        // as soon as it lands, not when a chain reaching into the next
        // window does.
        let n = room.min((run.end - run.start) as usize);
        let took = self.credits.try_take(n);
        debug_assert_eq!(took, n);
        let (op, max_inline) = (self.win(run.win).job.op, self.cfg.max_inline);
        out.wrs.reserve(n);
        for i in 0..n {
            let ext = run.start + i as u32;
            let signaled = self.cfg.batch.is_signaled(i, n);
            let id = self
                .slots
                .alloc(Ctx { win: run.win, ext }, now, signaled)
                .expect("a slot per credit");
            self.inflight.push(id);
            let job = &self.wins[run.win as usize].as_ref().expect("live").job;
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
            self.counters.signaled += u64::from(signaled);
            self.counters.inline += u64::from(inline);
            self.counters.bytes_posted += u64::from(e.len);
        }
        self.counters.posted += n as u64;
        self.counters.doorbells += 1;
        let front = self.ready.front_mut().expect("run taken from the front");
        front.start += n as u32;
        if front.start >= front.end {
            self.ready.pop_front();
        }
        true
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

    /// The provider accepted only the first `posted` requests of `batch`
    /// (the latest one from [`poll_transmit`](Self::poll_transmit)); the rest
    /// go back to the front of the queue with their credits and slots, and
    /// the counters forget them. A batch whose requests the error path
    /// already took back is ignored.
    pub fn post_failed(&mut self, batch: &Batch, posted: usize) -> Result<(), StreamError> {
        let unposted = &batch.wrs[posted.min(batch.wrs.len())..];
        if unposted.is_empty() {
            return Ok(());
        }
        let live = |s: &Self, wr: &WorkRequest| s.slots.get(WrId(wr.wr_id)).is_ok();
        if batch.epoch != self.epoch || !unposted.iter().any(|wr| live(self, wr)) {
            return Ok(());
        }
        if !unposted.iter().all(|wr| live(self, wr)) {
            return Err(StreamError::NotLastBatch);
        }
        for wr in unposted.iter().rev() {
            let id = WrId(wr.wr_id);
            if !self.inflight.pop_newest_if(id) {
                return Err(StreamError::NotLastBatch);
            }
            let Ctx { win, ext } = self.slots.free(id).expect("checked live").user;
            self.push_front_run(Run {
                win,
                start: ext,
                end: ext + 1,
            });
            self.give_credits(1);
            self.counters.posted -= 1;
            self.counters.signaled -= u64::from(wr.signaled);
            self.counters.inline -= u64::from(wr.inline);
            self.counters.bytes_posted -= u64::from(wr.local.len);
        }
        if posted == 0 {
            self.counters.doorbells -= 1;
        }
        self.counters.post_failures += 1;
        Ok(())
    }

    fn give_credits(&mut self, n: usize) {
        let r = self.credits.give(n);
        debug_assert!(r.is_ok(), "stream over-returned credits: {r:?}");
    }

    /// Feed one completion. Stale ones (old epoch, reused slot, duplicate)
    /// are counted and ignored.
    pub fn on_completion(&mut self, wc: &WorkCompletion) {
        self.counters.completions += 1;
        self.counters.errors.count(wc.status);
        let id = WrId(wc.wr_id);
        let ctx = match self.slots.get(id) {
            Ok(s) => s.user,
            Err(_) => {
                self.counters.stale += 1;
                return;
            }
        };
        match self.state {
            State::Running | State::Flushing => {}
            // Requests still outstanding when the stream failed: retire
            // them (so `outstanding` tells when the device is done with the
            // memory), confirm nothing.
            State::Failed { .. } => {
                self.retire_quietly(id);
                return;
            }
            State::NeedsReconnect => unreachable!("nothing is outstanding once drained"),
        }
        if wc.status.is_success() {
            self.retire_confirmed(id);
        } else {
            let window = self.win(ctx.win).job.id;
            let cause = ErrorCause::Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                window,
                extent: ctx.ext,
            };
            if self.state == State::Running {
                self.enter_error(
                    cause,
                    Some(wc.status),
                    Some((window, ctx.ext)),
                    wc.status.is_retryable(),
                );
            } else if !wc.status.is_retryable() {
                self.fail(
                    Some(wc.status),
                    Some((window, ctx.ext)),
                    "non-retryable completion status",
                );
                self.events.push_back(Event::ErrorBatch {
                    epoch: self.epoch,
                    cause,
                    action: Recovery::Fail,
                });
            }
            self.retire_unconfirmed(id);
        }
        if self.state == State::Flushing && self.inflight.is_empty() {
            self.drained();
        }
    }

    /// Feed several completions in order.
    pub fn on_completions(&mut self, wcs: &[WorkCompletion]) {
        for wc in wcs {
            self.on_completion(wc);
        }
    }

    /// `id` succeeded: it and every earlier request are confirmed.
    fn retire_confirmed(&mut self, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            let Ctx { win, ext } = self.slots.free(rid).expect("queued ids are live").user;
            self.give_credits(1);
            let w = self.wins[win as usize].as_mut().expect("live window");
            assert!(
                !std::mem::replace(&mut w.confirmed[ext as usize], true),
                "extent {ext} of window {} confirmed twice",
                w.job.id
            );
            w.remaining -= 1;
            let len = u64::from(w.job.extents[ext as usize].len);
            let done = w.remaining == 0;
            self.counters.extents_confirmed += 1;
            self.counters.bytes_confirmed += len;
            self.confirmed_in_epoch += 1;
            if done {
                self.window_done(win);
            }
        }
        ids.clear();
        self.scratch = ids;
    }

    fn window_done(&mut self, slab: u32) {
        let w = self.wins[slab as usize].take().expect("live window");
        self.live.remove(&w.job.id);
        self.free_wins.push(slab);
        self.counters.windows_done += 1;
        self.events.push_back(Event::WindowDone { id: w.job.id });
    }

    /// `id` failed: it and every earlier request are unconfirmed.
    fn retire_unconfirmed(&mut self, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            self.unconfirm(rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Retire `id` and every earlier request without confirming anything
    /// (the stream has failed).
    fn retire_quietly(&mut self, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            self.slots.free(rid).expect("queued ids are live");
            self.give_credits(1);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Every outstanding request is unconfirmed (the queue pair is gone).
    fn abandon_outstanding(&mut self) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(self.inflight.drain_all());
        for &rid in &ids {
            self.unconfirm(rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Free a request's slot; its extent waits for the reconnect. Its credit
    /// stays taken until the queue pair is replaced.
    fn unconfirm(&mut self, id: WrId) {
        let slot = self.slots.free(id).expect("queued ids are live");
        self.unconfirmed.push(slot.user);
    }

    fn fail(&mut self, status: Option<WcStatus>, at: Option<(u64, u32)>, reason: &'static str) {
        self.state = State::Failed {
            status,
            window: at.map(|a| a.0),
            extent: at.map(|a| a.1),
            reason,
        };
    }

    /// First failure of the epoch: stop posting, decide the recovery.
    fn enter_error(
        &mut self,
        cause: ErrorCause,
        status: Option<WcStatus>,
        at: Option<(u64, u32)>,
        retryable: bool,
    ) {
        debug_assert_eq!(self.state, State::Running);
        self.counters.error_batches += 1;
        if self.confirmed_in_epoch == 0 {
            self.fruitless_epochs += 1;
        } else {
            self.fruitless_epochs = 0;
        }
        let action = if !retryable {
            self.fail(status, at, "non-retryable completion status");
            Recovery::Fail
        } else if self.fruitless_epochs > self.cfg.max_retries {
            self.fail(
                status,
                at,
                "retry budget exhausted: too many epochs in a row confirmed nothing",
            );
            Recovery::Fail
        } else {
            self.state = State::Flushing;
            Recovery::Reconnect
        };
        self.events.push_back(Event::ErrorBatch {
            epoch: self.epoch,
            cause,
            action,
        });
    }

    /// Nothing outstanding in a failed epoch.
    fn drained(&mut self) {
        self.state = State::NeedsReconnect;
        self.events.push_back(Event::ReadyToReconnect {
            epoch: self.epoch,
            unconfirmed: self.unconfirmed.len() as u64,
        });
    }

    /// When [`poll_timeout`](Self::poll_timeout) next has work: the oldest
    /// outstanding request's post time plus the timeout. `None` if timeouts
    /// are disabled, nothing is outstanding, or the stream has failed.
    pub fn next_timeout(&self) -> Option<u64> {
        if self.cfg.request_timeout_ns == 0
            || !matches!(self.state, State::Running | State::Flushing)
        {
            return None;
        }
        let oldest = self.inflight.oldest()?;
        let slot = self.slots.get(oldest).ok()?;
        Some(slot.posted_at.saturating_add(self.cfg.request_timeout_ns))
    }

    /// Expire requests outstanding for the timeout or longer: each is freed
    /// and reported ([`Event::Timeout`]); the queue pair is then presumed
    /// stuck, so every outstanding request is unconfirmed and the stream
    /// needs a reconnect (or fails if the retry budget is spent).
    pub fn poll_timeout(&mut self, now: u64) {
        if self.cfg.request_timeout_ns == 0
            || !matches!(self.state, State::Running | State::Flushing)
        {
            return;
        }
        let expired = self.slots.expired(now, self.cfg.request_timeout_ns);
        let Some(&first) = expired.first() else {
            return;
        };
        for id in &expired {
            let Ctx { win, ext } = self.slots.get(*id).expect("expired ids are live").user;
            self.counters.timeouts += 1;
            self.events.push_back(Event::Timeout {
                wr_id: id.0,
                window: self.win(win).job.id,
                extent: ext,
            });
        }
        if self.state == State::Running {
            self.enter_error(ErrorCause::Timeout { wr_id: first.0 }, None, None, true);
        }
        if matches!(self.state, State::Failed { .. }) {
            self.forget_outstanding();
            return;
        }
        self.abandon_outstanding();
        self.drained();
    }

    /// The stream failed and its requests are presumed lost: free their
    /// contexts, confirm nothing.
    fn forget_outstanding(&mut self) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(self.inflight.drain_all());
        for &rid in &ids {
            self.slots.free(rid).expect("queued ids are live");
        }
        ids.clear();
        self.scratch = ids;
    }

    /// The runtime lost the connection (async QP error, TCP reset): every
    /// outstanding request is unconfirmed and the stream needs a reconnect
    /// (or fails if the retry budget is spent). No-op unless running or
    /// flushing.
    pub fn connection_lost(&mut self) {
        match self.state {
            State::Running => self.enter_error(ErrorCause::ConnectionLost, None, None, true),
            State::Flushing => {}
            _ => return,
        }
        if self.state == State::Flushing {
            self.abandon_outstanding();
            self.drained();
        } else {
            self.forget_outstanding();
        }
    }

    /// The runtime replaced the queue pair. Starts the next epoch and returns
    /// it: credits are full again, slots of older epochs are gone (their
    /// completions count as stale), and exactly the unconfirmed extents are
    /// posted again, first (window by window in arrival order, each in
    /// extent order). Confirmed extents are never posted again. Anything
    /// still outstanding is abandoned as unconfirmed.
    pub fn reconnected(&mut self) -> Result<u32, StreamError> {
        if matches!(self.state, State::Failed { .. }) {
            return Err(StreamError::Terminal);
        }
        self.abandon_outstanding();
        self.epoch = self.epoch.wrapping_add(1);
        let leftover = self.slots.clear(self.epoch);
        debug_assert!(leftover.is_empty());
        self.credits.reset();
        let mut again = std::mem::take(&mut self.unconfirmed);
        let seq = |s: &Self, c: &Ctx| s.win(c.win).seq;
        again.sort_unstable_by_key(|c| (seq(self, c), c.ext));
        again.dedup();
        self.counters.reposted += again.len() as u64;
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
        again.clear();
        self.unconfirmed = again;
        self.counters.reconnects += 1;
        self.confirmed_in_epoch = 0;
        self.state = State::Running;
        Ok(self.epoch)
    }

    /// Next queued event, oldest first.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether [`poll_event`](Self::poll_event) has something.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Where the stream stands.
    pub fn state(&self) -> State {
        self.state
    }

    /// No live window (nothing queued, nothing outstanding).
    pub fn is_idle(&self) -> bool {
        self.live.is_empty()
    }

    /// Live windows (queued or partly confirmed).
    pub fn windows(&self) -> usize {
        self.live.len()
    }

    /// Whether a window with this id is live.
    pub fn is_live(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    /// Current epoch (0 until the first reconnect).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Requests posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.inflight.len()
    }

    /// Send-queue credits taken (never above `sq_depth`).
    pub fn credits_in_use(&self) -> usize {
        self.credits.in_use()
    }

    /// Extents the failed epoch left unconfirmed so far, as (window id,
    /// extent index), unordered; they are posted again after
    /// [`reconnected`](Self::reconnected). Empty while running.
    pub fn unconfirmed(&self) -> Vec<(u64, u32)> {
        self.unconfirmed
            .iter()
            .map(|c| (self.win(c.win).job.id, c.ext))
            .collect()
    }

    /// Whether extent `extent` of live window `id` is confirmed; `None` if
    /// the window is not live.
    pub fn is_confirmed(&self, id: u64, extent: u32) -> Option<bool> {
        let w = self.win(*self.live.get(&id)?);
        w.confirmed.get(extent as usize).copied()
    }

    /// Running totals.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

#[cfg(test)]
mod tests;
