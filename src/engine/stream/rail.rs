//! Rails: the queue pairs one [`Stream`](super::Stream) runs over.
//!
//! A *rail* is one channel (one RC queue pair, typically one RDMA port). A
//! stream built with [`Stream::with_rails`](super::Stream::with_rails) runs
//! over several; [`Stream::new`](super::Stream::new) builds the one-rail
//! stream, which behaves exactly as a stream did before rails existed
//! (rail 0, no rail events, no pauses).
//!
//! # What belongs to a rail, and what does not
//!
//! Each rail has its own send-queue credits, `wr_id` slots, in-flight queue
//! (the RC retirement rule holds per queue pair), epoch, state
//! ([`RailState`]) and [`Counters`](super::Counters). Windows do not belong to a rail:
//! they are queued once, for the whole stream, and their extents are
//! assigned to rails only when they are posted. Each chain goes to the
//! running rail with the most free credits, so a rail whose completions
//! return credits sooner (a faster link) is offered more chains and carries
//! more bytes. A window is done when every one of its extents is confirmed,
//! on whichever rails, and no request of it is still held by a fenced rail
//! (below).
//!
//! # `wr_id`s, epochs and why a fenced rail cannot confirm anything
//!
//! A `wr_id` is a [`WrId`](crate::engine::slots::WrId): slot index, slot
//! generation and a 16-bit *tag*. With `N > 1` rails the tag is
//! `epoch << b | rail` (`b` = bits to number the rails, 0 for one rail, so
//! a one-rail stream's ids are exactly the old ones), so an id names the
//! rail that issued it and the epoch of that rail. A completion is looked up
//! in the slots of the rail the id names (and of the rail it arrived on, if
//! the runtime says: [`Stream::on_completions`](super::Stream::on_completions));
//! a slot is live only in its rail's current epoch. Three rules make a late
//! completion of a failed rail harmless:
//!
//! 1. When a rail fails (error completion, request timeout, or
//!    [`Stream::rail_lost`](super::Stream::rail_lost), the runtime's word for
//!    a port-down event) while another rail runs, it is *fenced*: it posts
//!    no more, and each of its outstanding requests becomes a *zombie*: its
//!    slot stays allocated (so the stream knows the device may still hold
//!    the request) but can never confirm. Its extent goes back to the front
//!    of the stream's queue at once, for the surviving rails.
//! 2. A completion that names a zombie (a late success, a flush) retires it
//!    and the zombies before it (RC rule) and confirms nothing; it counts as
//!    stale.
//! 3. [`Stream::rail_reconnected`](super::Stream::rail_reconnected) starts
//!    the rail's next epoch: every slot of the old epoch is freed, and an id
//!    of the old epoch fails the tag check (stale) from then on.
//!
//! An extent therefore has at most one request that can confirm it at any
//! time (the one posted after its last requeue), and a zombie's completion
//! is never credited to the request posted again elsewhere.
//!
//! Zombies also keep their window *held*: a window whose extents are all
//! confirmed is not done while a zombie of it remains, because the fenced
//! rail's device might still read (WRITE) or write (READ) the window's
//! staging memory. Zombies go when their completions come (a queue pair in
//! the error state flushes them), when the runtime says the rail's queue
//! pair can no longer touch memory
//! ([`Stream::rail_quiesced`](super::Stream::rail_quiesced): reset, or moved
//! to the error state and drained), or when the rail reconnects.
//!
//! # The fencing contract (what the caller must do)
//!
//! Fencing a rail emits [`RailEvent::Fenced`] naming the live windows that
//! had requests on it. Their extents are posted again on other rails with
//! the *same* remote address and rkey (the same bytes: idempotent while the
//! window is live). The stream fences the local side (no window is done
//! while the failed rail may touch its staging); the remote side is the
//! caller's: the failed rail's queue pair could still land a delayed
//! WRITE in a named window's remote region. Before the remote region of a
//! named window is reused for other data (a new grant on it), the caller
//! must make sure that cannot happen: the peer's queue pair of that rail is
//! reset or in the error state (the rail's reconnect does this on both
//! sides), or the region's rkey is invalidated and the next data granted
//! under a new one. Invalidating the rkey of a named window while it is
//! still live would fail its reposts.
//!
//! # Failure, pauses, all rails down
//!
//! A rail failure with no other rail running leaves every rail down: the
//! stream waits (its extents queued) until a rail is reconnected, and the
//! retry budget ([`StreamConfig::max_reconnects`](super::StreamConfig::max_reconnects))
//! counts such outages in a row that confirmed nothing, as the one-rail
//! stream counts fruitless epochs. A rail that fails again within
//! [`RailPolicy::flap_window_ns`] of its previous failure is *paused*
//! ([`RailState::Paused`], [`RailEvent::Paused`]): it does not rejoin before
//! its cool-down ends ([`RailPolicy::cooldown`]: 1 s, 2 s, 4 s, ... capped
//! by default), even if it is reconnected sooner. The last rail running is
//! never paused (nothing would carry the copy meanwhile). A rail whose
//! reconnect the runtime gives up on is paused too
//! ([`Stream::rail_reconnect_failed`](super::Stream::rail_reconnect_failed)).
//!
//! With one rail none of this applies: the error path is the one-rail
//! protocol of the [stream docs](super) (flush, `ReadyToReconnect`,
//! `rail_reconnected`), and `Event::ErrorBatch` tells the runtime what to do.
//! With several, the runtime follows [`RailEvent`]s and
//! [`Stream::rail_state`](super::Stream::rail_state); `Event::ErrorBatch`
//! only reports that the stream gave up.

use super::{ErrorCause, Event, StreamConfig};

/// Most rails one stream runs over (the rail index takes up to 6 bits of
/// the `wr_id`'s 16-bit tag, leaving at least 10 bits of epoch).
pub const MAX_RAILS: usize = 64;

/// Static parameters of one rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailConfig {
    /// Send-queue depth of the rail's queue pair (`1..=65536`): its credits
    /// and slots.
    pub sq_depth: usize,
    /// WRITE extents of at most this many bytes go inline on this rail; 0
    /// disables.
    pub max_inline: u32,
}

impl RailConfig {
    /// The rail a one-rail stream of `cfg` has.
    pub fn of(cfg: &StreamConfig) -> Self {
        RailConfig {
            sq_depth: cfg.sq_depth,
            max_inline: cfg.max_inline,
        }
    }
}

/// How rails that fail repeatedly are paused (nanoseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailPolicy {
    /// A failure within this long of the rail's previous failure is a
    /// repeat; a failure later than that starts the count afresh.
    pub flap_window_ns: u64,
    /// The cool-down of the first repeat; each further repeat doubles it.
    /// 0 disables pauses.
    pub cooldown_ns: u64,
    /// Longest cool-down.
    pub cooldown_cap_ns: u64,
}

impl Default for RailPolicy {
    /// Repeats within 60 s; cool-downs of 1 s, 2 s, 4 s, ... up to 32 s.
    fn default() -> Self {
        RailPolicy {
            flap_window_ns: 60_000_000_000,
            cooldown_ns: 1_000_000_000,
            cooldown_cap_ns: 32_000_000_000,
        }
    }
}

impl RailPolicy {
    /// The cool-down after repeat number `repeat` (1 = the second failure in
    /// a row within the window): `cooldown_ns * 2^(repeat - 1)`, capped.
    /// 0 when pauses are disabled or `repeat` is 0.
    pub fn cooldown(&self, repeat: u32) -> u64 {
        if repeat == 0 || self.cooldown_ns == 0 {
            return 0;
        }
        let mul = 1u64.checked_shl(repeat - 1).unwrap_or(u64::MAX);
        self.cooldown_ns
            .saturating_mul(mul)
            .min(self.cooldown_cap_ns.max(self.cooldown_ns))
    }
}

/// Where one rail stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RailState {
    /// Posting and completing.
    Running,
    /// One-rail stream only: an error arrived; not posting, absorbing the
    /// epoch's remaining completions.
    Flushing,
    /// One-rail stream only: nothing outstanding; waiting for a reconnect.
    NeedsReconnect,
    /// Fenced and cooling down: not posting, waiting for a reconnect, and
    /// not rejoining before `until` (stream time) even if reconnected.
    Paused {
        /// When the cool-down ends.
        until: u64,
    },
    /// Fenced: not posting, waiting for a reconnect.
    Down,
}

impl RailState {
    /// Whether the rail is fenced (down or paused): its outstanding
    /// requests, if any, are zombies.
    pub fn is_fenced(self) -> bool {
        matches!(self, RailState::Down | RailState::Paused { .. })
    }

    /// Every state's label ([`RailState::label`]), by [`RailState::index`].
    pub const LABELS: [&'static str; 5] =
        ["running", "flushing", "needs_reconnect", "paused", "down"];

    /// The state's index in [`RailState::LABELS`] (a metrics gauge's value).
    pub fn index(self) -> usize {
        match self {
            RailState::Running => 0,
            RailState::Flushing => 1,
            RailState::NeedsReconnect => 2,
            RailState::Paused { .. } => 3,
            RailState::Down => 4,
        }
    }

    /// A short stable label for logs and metrics.
    pub fn label(self) -> &'static str {
        Self::LABELS[self.index()]
    }
}

/// What happened to a rail (streams of more than one rail only), in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RailEvent {
    /// The rail failed: it posts no more. Reconnect it (after the
    /// cool-down if a [`RailEvent::Paused`] follows).
    Down {
        /// The rail.
        rail: usize,
        /// Its failed epoch.
        epoch: u32,
        /// What failed.
        cause: ErrorCause,
    },
    /// The rail's outstanding extents went back to be posted on the other
    /// rails. `windows` are the live windows that had requests on it (in
    /// arrival order): the caller fences their remote regions (module
    /// docs).
    Fenced {
        /// The rail.
        rail: usize,
        /// The epoch whose requests were fenced.
        epoch: u32,
        /// Live windows with requests on the rail.
        windows: Vec<u64>,
        /// Extents queued again.
        requeued: u64,
    },
    /// The rail failed again soon after its last failure (or could not be
    /// reconnected): it rejoins no sooner than `until`.
    Paused {
        /// The rail.
        rail: usize,
        /// When the cool-down ends (stream time).
        until: u64,
        /// Its length, nanoseconds.
        for_ns: u64,
    },
    /// The rail runs again in a new epoch.
    Up {
        /// The rail.
        rail: usize,
        /// Its new epoch.
        epoch: u32,
    },
}

/// Either kind of event, as [`Stream::poll_event`](super::Stream::poll_event)
/// returns them: in the order they happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnyEvent {
    /// A stream event.
    Stream(Event),
    /// A rail event.
    Rail(RailEvent),
}
