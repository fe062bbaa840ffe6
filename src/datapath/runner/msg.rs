//! What the runner's threads pass each other: the posting thread's one
//! input queue ([`Input`], with the completion threads' [`CqBatch`] and
//! [`CqEnd`]), what it asks a rail's helper ([`Cmd`]), and what the
//! caller's side and the posting thread share ([`Shared`]). Types only, so
//! that `handle`, `poster` and `helpers` each import them and not each
//! other.

use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
#[cfg(test)]
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::ReconnectError;
use crate::engine::{WindowJob, WorkCompletion};
use crate::provider::ProviderError;

/// What the caller's side and the posting thread share.
#[derive(Default)]
pub(super) struct Shared {
    /// Failed or closing: `submit` refuses.
    pub(super) stopped: AtomicBool,
    /// Ids submitted and not yet done (so `submit` refuses a live id at
    /// once instead of the posting thread later).
    pub(super) live: Mutex<HashSet<u64>>,
    /// Times the posting thread blocked on its input queue with no timeout
    /// (idle: only an input wakes it), and whether it is blocked so now.
    #[cfg(test)]
    pub(super) parks: AtomicU64,
    #[cfg(test)]
    pub(super) parked: AtomicBool,
    /// Times the posting thread waited for an input (any wait: a poster
    /// that spins shows as many).
    #[cfg(test)]
    pub(super) waits: AtomicU64,
}

/// A completion thread's batch, stamped with the time it was polled.
pub(super) struct CqBatch {
    pub(super) at: Instant,
    pub(super) wcs: Vec<WorkCompletion>,
}

/// How a completion thread ended.
pub(super) enum CqEnd {
    Stopped,
    Error(ProviderError),
    Panicked,
}

/// The posting thread's one input queue.
pub(super) enum Input {
    Cq(usize, CqBatch),
    Submit(WindowJob),
    CqEnded(usize, CqEnd),
    /// A rail's helper brought it back, or gave up after `attempts`.
    Reconnected {
        rail: usize,
        result: Result<(), (u32, ReconnectError)>,
    },
    /// A rail's fence callback returned `Ok`: its queue pair touches no
    /// memory any more.
    Fenced(usize),
    /// A rail's port went down.
    PortDown(usize),
    /// A rail's helper is stopping (its last word: the close waits for it).
    HelperEnded(usize),
    Close,
}

/// What the posting thread asks a rail's helper.
pub(super) enum Cmd {
    /// Bring the rail back: fence it first (if `fence`), wait `after`, then
    /// reconnect.
    Reconnect {
        fence: bool,
        after: Duration,
    },
    Stop,
}
