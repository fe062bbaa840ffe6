//! A service connection's operations (docs/buffers.md): where each is,
//! running or how it ended, for `wait`, `wait_all`, `status` and
//! `cancel`, and for the connection's end. One table under one lock, no
//! channel per operation: a request's operations are entered together
//! (consecutive handles, one allocation for their cancel flags) and a
//! group that ends together is recorded in one pass, with one wake-up per
//! operation someone waits on while it runs.
//!
//! The table is a window of the last `kept` handles given, in order (a
//! request's operations are entered, looked up and ended where the last
//! ones were: no hashing, no jumps across a large map), and a map of the
//! older ones still running or that ended after leaving the window, the
//! last `kept` of those. Every running operation is kept; an older ended
//! one is forgotten (its handle then answers that it is no longer kept),
//! so a service that runs for days holds rcpd's memory to what is
//! running and about twice `kept` ended.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use tokio::sync::Notify;

use super::api::{ErrorBody, OpStateName, OpStatus};
use super::peer::Moved;
use super::Failure;

/// Ended operations a connection keeps answering `wait` and `status` for,
/// beyond those running.
pub const KEPT_ENDED: usize = 65_536;

/// Where an operation is.
#[derive(Clone, Debug)]
pub enum OpState {
    Running,
    Done(Moved),
    Failed(Failure),
    Cancelled,
}

impl OpState {
    /// The state as `wait`, `status`, `cancel` and the `done` event give
    /// it.
    pub fn status(&self, handle: u64) -> OpStatus {
        let mut st = OpStatus {
            handle,
            state: OpStateName::Running,
            bytes: None,
            transport: None,
            fell_back: None,
            failure: None,
        };
        match self {
            OpState::Running => {}
            OpState::Done(m) => {
                st.state = OpStateName::Done;
                st.bytes = Some(m.bytes);
                st.transport = Some(Cow::Borrowed(m.kind.name()));
                st.fell_back = m.fell_back.clone();
            }
            OpState::Failed(e) => {
                st.state = OpStateName::Failed;
                st.failure = Some(ErrorBody::from(e));
            }
            OpState::Cancelled => st.state = OpStateName::Cancelled,
        }
        st
    }

    fn running(&self) -> bool {
        matches!(self, OpState::Running)
    }
}

/// The cancel flags of operations entered together, one each.
pub type Flags = Arc<[AtomicBool]>;

struct Slot {
    /// The connection's number of the buffer it moves from or into.
    buffer: u64,
    /// Its flag is `flags[at]`.
    flags: Flags,
    at: usize,
    state: OpState,
    /// Woken when it ends (made when someone waits on it running).
    waiters: Option<Arc<Notify>>,
}

/// A connection's operations.
pub struct Ops {
    /// The last `kept` handles given, from `first`.
    recent: VecDeque<Slot>,
    first: u64,
    /// Older ones: running, or ended after they left `recent`.
    older: HashMap<u64, Slot>,
    /// Those of `older` that ended, in the order they did.
    older_ended: VecDeque<u64>,
    kept: usize,
}

/// Why a handle has no operation.
#[derive(Debug, PartialEq, Eq)]
pub enum Unknown {
    /// It ended and was forgotten.
    NoLongerKept,
    /// It was never given.
    Never,
}

impl Ops {
    pub fn new(kept: usize) -> Ops {
        Ops {
            recent: VecDeque::new(),
            first: 1,
            older: HashMap::new(),
            older_ended: VecDeque::new(),
            kept,
        }
    }

    /// Enter operations, one on each of `buffers`, running: the first's
    /// handle (the others' follow it) and their cancel flags, in order.
    pub fn start(&mut self, buffers: &[u64]) -> (u64, Flags) {
        let flags: Flags = buffers.iter().map(|_| AtomicBool::new(false)).collect();
        let h = self.first + self.recent.len() as u64;
        for (at, &buffer) in buffers.iter().enumerate() {
            self.recent.push_back(Slot {
                buffer,
                flags: flags.clone(),
                at,
                state: OpState::Running,
                waiters: None,
            });
        }
        while self.recent.len() > self.kept {
            let old = self.recent.pop_front().expect("more than kept");
            if old.state.running() {
                self.older.insert(self.first, old);
            }
            self.first += 1;
        }
        (h, flags)
    }

    fn slot(&self, h: u64) -> Option<&Slot> {
        match h.checked_sub(self.first) {
            Some(k) => self.recent.get(usize::try_from(k).ok()?),
            None => self.older.get(&h),
        }
    }

    fn slot_mut(&mut self, h: u64) -> Option<&mut Slot> {
        match h.checked_sub(self.first) {
            Some(k) => self.recent.get_mut(usize::try_from(k).ok()?),
            None => self.older.get_mut(&h),
        }
    }

    /// Operation `h` ended with `r`: its state (cancelled when it failed
    /// after it was asked to stop), and its waiters, to wake once the
    /// table is let go. An operation that already ended stays as it
    /// ended.
    pub fn end(
        &mut self,
        h: u64,
        r: Result<Moved, Failure>,
    ) -> Option<(OpState, Option<Arc<Notify>>)> {
        let slot = self.slot_mut(h)?;
        if !slot.state.running() {
            return None;
        }
        slot.state = match r {
            Ok(m) => OpState::Done(m),
            Err(_) if slot.flags[slot.at].load(Relaxed) => OpState::Cancelled,
            Err(e) => OpState::Failed(e),
        };
        let ended = (slot.state.clone(), slot.waiters.take());
        if h < self.first {
            self.older_ended.push_back(h);
            while self.older_ended.len() > self.kept {
                let old = self.older_ended.pop_front().expect("more than kept");
                self.older.remove(&old);
            }
        }
        Some(ended)
    }

    /// Where operation `h` is.
    pub fn state(&self, h: u64) -> Result<&OpState, Unknown> {
        match self.slot(h) {
            Some(s) => Ok(&s.state),
            None if h >= 1 && h < self.first + self.recent.len() as u64 => {
                Err(Unknown::NoLongerKept)
            }
            None => Err(Unknown::Never),
        }
    }

    /// Whether `h` ended (or is no longer kept: it ended long ago).
    pub fn over(&self, h: u64) -> bool {
        self.slot(h).is_none_or(|s| !s.state.running())
    }

    /// What wakes a waiter when running operation `h` ends; `None` when
    /// it is not running.
    pub fn waiters(&mut self, h: u64) -> Option<Arc<Notify>> {
        let slot = self.slot_mut(h).filter(|s| s.state.running())?;
        Some(slot.waiters.get_or_insert_with(Default::default).clone())
    }

    /// Ask the running operations that `which` picks (by their buffer) to
    /// stop: their handles.
    pub fn cancel(&self, which: impl Fn(u64) -> bool) -> Vec<u64> {
        let recent = (self.recent.iter().enumerate()).map(|(k, s)| (self.first + k as u64, s));
        let older = self.older.iter().map(|(&h, s)| (h, s));
        let mut picked = Vec::new();
        for (h, s) in recent.chain(older) {
            if s.state.running() && which(s.buffer) {
                s.flags[s.at].store(true, Relaxed);
                picked.push(h);
            }
        }
        picked
    }

    /// Ask operation `h` to stop (if it runs).
    pub fn cancel_one(&self, h: u64) {
        if let Some(s) = self.slot(h) {
            s.flags[s.at].store(true, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::error::Reason;
    use crate::provider::ProviderKind;

    fn done() -> Result<Moved, Failure> {
        Ok(Moved {
            bytes: 1,
            kind: ProviderKind::Tcp,
            fell_back: None,
        })
    }

    fn failed() -> Result<Moved, Failure> {
        Err(Failure::new(Reason::Retryable, "no"))
    }

    /// Running operations are all kept; an ended one while it is among
    /// the last `kept` handles given, or among the last `kept` that ended
    /// after leaving them; an older ended one is forgotten.
    #[test]
    fn a_connection_forgets_its_oldest_ended_operations() {
        let mut ops = Ops::new(3);
        assert_eq!(ops.start(&[1; 4]).0, 1);
        // 1 left the window running; 2 ended in it and went with it, 3
        // left it running.
        assert!(ops.end(2, done()).is_some());
        assert_eq!(ops.start(&[1; 2]).0, 5);
        let kept = |ops: &Ops| {
            (1..=8)
                .filter(|&h| ops.state(h).is_ok())
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(&ops), [1, 3, 4, 5, 6]);
        assert_eq!(ops.state(2).unwrap_err(), Unknown::NoLongerKept);
        assert_eq!(ops.state(7).unwrap_err(), Unknown::Never);
        assert_eq!(ops.state(0).unwrap_err(), Unknown::Never);
        assert!(ops.over(2) && !ops.over(1) && !ops.over(6));
        // Older ones that end are kept, the last `kept` of them.
        assert_eq!(ops.start(&[1; 3]).0, 7);
        for h in [1, 4, 5, 6] {
            assert!(ops.end(h, done()).is_some());
        }
        assert_eq!(kept(&ops), [3, 4, 5, 6, 7, 8]);
        assert!(matches!(ops.state(3).unwrap(), OpState::Running));
        assert!(matches!(ops.state(9).unwrap(), OpState::Running));
        assert_eq!(ops.state(1).unwrap_err(), Unknown::NoLongerKept);
    }

    /// Handles follow each other across requests; an operation asked to
    /// stop that then fails is cancelled, one that ends done is done, and
    /// an ended one stays as it ended.
    #[test]
    fn cancelled_failed_and_done_are_told_apart() {
        let mut ops = Ops::new(10);
        assert_eq!(ops.start(&[1, 2]).0, 1);
        let (third, flags) = ops.start(&[2, 3]);
        assert_eq!(third, 3);
        let mut picked = ops.cancel(|b| b == 2);
        picked.sort_unstable();
        assert_eq!(picked, [2, 3]);
        assert!(flags[0].load(Relaxed) && !flags[1].load(Relaxed));
        assert!(matches!(
            ops.end(2, failed()).unwrap().0,
            OpState::Cancelled
        ));
        assert!(matches!(ops.end(3, done()).unwrap().0, OpState::Done(_)));
        assert!(matches!(
            ops.end(4, failed()).unwrap().0,
            OpState::Failed(_)
        ));
        assert!(ops.end(4, done()).is_none(), "ended once");
        assert!(matches!(ops.state(4).unwrap(), OpState::Failed(_)));
        assert!(ops.cancel(|_| true) == [1]);
    }

    /// A waiter on a running operation is given what wakes it, and the
    /// end hands it over; nothing waits on an ended one.
    #[tokio::test]
    async fn the_end_of_an_operation_wakes_its_waiters() {
        let mut ops = Ops::new(10);
        ops.start(&[1]);
        let n = ops.waiters(1).expect("running");
        let woken = n.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let (_, w) = ops.end(1, done()).unwrap();
        w.expect("its waiters").notify_waiters();
        woken.await;
        assert!(ops.waiters(1).is_none());
    }
}
