//! A stream's public types: its configuration, the windows it is given
//! ([`WindowJob`], [`Extent`]), what it hands back ([`Batch`], [`Event`],
//! [`State`]), its errors and its [`Counters`].

use std::fmt;

use super::rail::{RailPolicy, MAX_RAILS};
use crate::engine::batch::{BatchPolicy, BatchPolicyError};
use crate::engine::slots::MAX_SLOTS;
use crate::engine::wr::{ErrorCounts, OpKind, WcStatus, WorkRequest};

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
    /// the next fruitless failure fails the stream. With several rails, a
    /// failure counts when it leaves no rail running.
    pub max_reconnects: u32,
    /// How rails that fail repeatedly are paused (streams of several
    /// rails).
    pub rail_policy: RailPolicy,
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
            max_reconnects: 3,
            rail_policy: RailPolicy::default(),
        }
    }

    /// Check the fields that have ranges.
    pub fn validate(&self) -> Result<(), StreamConfigError> {
        self.batch.validate().map_err(StreamConfigError::Batch)?;
        if !(1..=MAX_SLOTS).contains(&self.sq_depth) {
            return Err(StreamConfigError::SqDepth(self.sq_depth));
        }
        Ok(())
    }
}

/// A [`StreamConfig`] that cannot work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamConfigError {
    /// Bad batch policy.
    Batch(BatchPolicyError),
    /// `sq_depth` not in `1..=65536`.
    SqDepth(usize),
    /// Not `1..=MAX_RAILS` rails.
    Rails(usize),
}

impl fmt::Display for StreamConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            StreamConfigError::Batch(e) => e.fmt(f),
            StreamConfigError::SqDepth(d) => {
                write!(f, "sq_depth = {d} is out of range (1..={MAX_SLOTS})")
            }
            StreamConfigError::Rails(n) => write!(f, "{n} rails (1..={MAX_RAILS})"),
        }
    }
}

impl std::error::Error for StreamConfigError {}

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
    /// [`Stream::post_failed`](super::Stream::post_failed) got a batch that is not the latest one.
    NotLastBatch,
    /// The stream has no rail with this index.
    NoSuchRail(usize),
}

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamError::Terminal => f.write_str("the stream has failed"),
            StreamError::NotLastBatch => {
                f.write_str("post_failed must be given the latest batch, before the next poll")
            }
            StreamError::NoSuchRail(r) => write!(f, "the stream has no rail {r}"),
        }
    }
}

impl std::error::Error for StreamError {}

/// One chain to post with one doorbell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Epoch the requests belong to (of their rail).
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
    /// Replace the queue pair, then call [`Stream::rail_reconnected`](super::Stream::rail_reconnected).
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
    /// Nothing outstanding; waiting for [`Stream::rail_reconnected`](super::Stream::rail_reconnected).
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
/// publish (live stats, reports, metrics) instead of counting again. The
/// same struct counts each rail ([`Stream::rail_counters`](super::Stream::rail_counters)) and the whole
/// stream ([`Stream::counters`](super::Stream::counters)); the totals are the sums of the rails',
/// except [`windows_done`](Self::windows_done) (windows belong to no rail,
/// 0 per rail) and completions naming no rail of the stream (stale in the
/// totals only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Non-success completions by status (error CQEs).
    pub errors: ErrorCounts,
    /// Completions whose `wr_id` named no live request (old epoch, fenced
    /// request, reused slot, duplicate).
    pub stale: u64,
    /// Requests that expired.
    pub timeouts: u64,
    /// Epochs that failed (error batches).
    pub failures: u64,
    /// Reconnects (epochs started after the first).
    pub reconnects: u64,
    /// Reconnects the runtime gave up on (several rails: the rail was
    /// paused instead).
    pub reconnect_failures: u64,
    /// Extents queued to be posted again: after a reconnect, or taken off a
    /// fenced rail.
    pub reposted: u64,
    /// Extents taken off fenced rails (queued for the others); part of
    /// [`reposted`](Self::reposted).
    pub requeued: u64,
    /// Rails fenced (several rails).
    pub fences: u64,
    /// Rails paused (several rails).
    pub pauses: u64,
    /// Calls to [`Stream::post_failed`](super::Stream::post_failed) that took requests back.
    pub post_failures: u64,
    /// Extents confirmed.
    pub extents_confirmed: u64,
    /// Bytes in extents confirmed.
    pub bytes_confirmed: u64,
    /// Windows done (stream totals only).
    pub windows_done: u64,
}

impl Counters {
    /// Add `o`'s counts to these (runs of several streams, such as
    /// `rcp bench`'s threads, summed).
    pub fn add(&mut self, o: &Counters) {
        let Counters {
            posted,
            doorbells,
            signaled,
            inline,
            bytes_posted,
            completions,
            errors,
            stale,
            timeouts,
            failures,
            reconnects,
            reconnect_failures,
            reposted,
            requeued,
            fences,
            pauses,
            post_failures,
            extents_confirmed,
            bytes_confirmed,
            windows_done,
        } = *o;
        self.posted += posted;
        self.doorbells += doorbells;
        self.signaled += signaled;
        self.inline += inline;
        self.bytes_posted += bytes_posted;
        self.completions += completions;
        for (a, b) in self.errors.0.iter_mut().zip(errors.0) {
            *a += b;
        }
        self.stale += stale;
        self.timeouts += timeouts;
        self.failures += failures;
        self.reconnects += reconnects;
        self.reconnect_failures += reconnect_failures;
        self.reposted += reposted;
        self.requeued += requeued;
        self.fences += fences;
        self.pauses += pauses;
        self.post_failures += post_failures;
        self.extents_confirmed += extents_confirmed;
        self.bytes_confirmed += bytes_confirmed;
        self.windows_done += windows_done;
    }
}
