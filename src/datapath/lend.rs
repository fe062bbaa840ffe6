//! A data path over memory leased from services' buffers
//! ([`crate::mem::memfd`]): [`LendingPath::submit`] is safe because each
//! window comes with the [`LeasedRange`] of its local bytes, which the
//! lending path keeps until the data path has let go of them.
//!
//! [`DataPath::submit`]'s obligations, discharged here:
//! - the bytes are registered under the window's lkey: the caller's
//!   registration comes with the window and is held as long as the lease;
//! - they stay mapped: the lease's span holds the mapping;
//! - nobody else in rcpd touches them meanwhile: the lease is exclusive for
//!   a READ window (bytes land) and at least shared for a WRITE window
//!   (the device reads), so rcpd's other users of the buffer (grants,
//!   hashing, other operations) are refused the range;
//! - until the data path reports the window done: the lease is dropped on
//!   [`DpEvent::WindowDone`] for its id (taken by
//!   [`LendingPath::next_event`]), or after [`LendingPath::close`] when no
//!   request is left outstanding; a data path that closes with requests
//!   still in a device keeps its leases (and mappings) for the process's
//!   life rather than give the bytes back early.
//!
//! The service that owns the buffer maps the same pages and may write
//! them; it is another process, outside what rcpd can exclude. Bytes it
//! writes during an operation fail the operation's check.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::UnboundedReceiver;

use super::runner::{DataPath, DataPathError, DpEvent};
use super::Report;
use crate::engine::{OpKind, WindowJob};
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::provider::Registration;

/// What a window keeps from its submission to its end.
struct Held {
    range: LeasedRange,
    _reg: Arc<dyn Registration>,
}

/// A [`DataPath`] whose windows' local bytes are leased ranges of
/// services' buffers.
pub struct LendingPath {
    /// `None` once closed.
    dp: Option<DataPath>,
    events: tokio::sync::Mutex<UnboundedReceiver<DpEvent>>,
    held: Mutex<HashMap<u64, Held>>,
}

/// A window the lending path cannot take.
#[derive(Debug, thiserror::Error)]
pub enum LendError {
    #[error("window {id}: its local bytes [{start:#x}, {end:#x}) are not all in {range:?}")]
    OutsideLease {
        id: u64,
        start: u64,
        end: u64,
        range: String,
    },
    #[error("window {id}: a READ lands bytes, its range must be leased exclusively")]
    SharedForRead { id: u64 },
    #[error("window {id}: lkey {lkey:#x} is not the registration's {reg:#x} covering the range")]
    Key { id: u64, lkey: u32, reg: u32 },
    #[error("a lending data path runs on one rail, not {0}")]
    Rails(usize),
    #[error(transparent)]
    DataPath(#[from] DataPathError),
}

impl LendingPath {
    /// Take over `dp` and its events (from [`DataPath::take_events`]). A
    /// data path of several rails is refused: a window's lkey is the key
    /// of one rail's registration.
    pub fn new(dp: DataPath, events: UnboundedReceiver<DpEvent>) -> Result<LendingPath, LendError> {
        let rails = dp.stats().rails.len();
        if rails > 1 {
            return Err(LendError::Rails(rails));
        }
        Ok(LendingPath {
            dp: Some(dp),
            events: tokio::sync::Mutex::new(events),
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Submit `job`, whose local bytes lie in `range` and are registered
    /// by `reg` (under `job.lkey`); both are kept until the window's end.
    pub fn submit(
        &self,
        job: WindowJob,
        range: LeasedRange,
        reg: Arc<dyn Registration>,
    ) -> Result<(), LendError> {
        let id = job.id;
        let span = range.span();
        let end = job
            .extents
            .iter()
            .map(|e| e.offset + u64::from(e.len))
            .max()
            .unwrap_or(0);
        let (start, stop) = (job.local_addr, job.local_addr.saturating_add(end));
        if start < span.addr() || stop > span.addr() + span.len() as u64 {
            return Err(LendError::OutsideLease {
                id,
                start,
                end: stop,
                range: format!("{range:?}"),
            });
        }
        if job.op == OpKind::Read && range.lease().kind() != LeaseKind::Exclusive {
            return Err(LendError::SharedForRead { id });
        }
        if reg.lkey() != job.lkey
            || start < reg.addr()
            || stop > reg.addr().saturating_add(reg.len() as u64)
        {
            return Err(LendError::Key {
                id,
                lkey: job.lkey,
                reg: reg.lkey(),
            });
        }
        // Held before the submit: a WindowDone may come at once.
        self.held
            .lock()
            .unwrap()
            .insert(id, Held { range, _reg: reg });
        let r = match &self.dp {
            Some(dp) => {
                // SAFETY: (module docs) the bytes [local_addr + e.offset, + e.len)
                // of every extent lie in `range` (checked above) and are registered
                // under `job.lkey` by `reg` (checked above), which is held with the
                // range; the range's span keeps them mapped; its lease makes this
                // window rcpd's only user of them (exclusive for a READ, checked
                // above); both are dropped only on the window's WindowDone
                // (`next_event`) or after `close` left no request outstanding.
                // The data path runs on one rail here (a lending session has one),
                // so `job.lkey` is the key on every channel it posts on.
                unsafe { dp.submit(job) }
            }
            None => Err(DataPathError::Stopped),
        };
        if let Err(e) = r {
            // Refused before anything was posted (validation, stopped):
            // the device never saw the window.
            if matches!(
                e,
                DataPathError::Window { .. } | DataPathError::Stopped | DataPathError::Config(_)
            ) {
                self.held.lock().unwrap().remove(&id);
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// The next event; at a window's `WindowDone` its registration is let
    /// go and its leased range handed back (the caller reads a READ
    /// window's bytes through it, then drops it). `None` once the data
    /// path is closed.
    pub async fn next_event(&self) -> Option<(DpEvent, Option<LeasedRange>)> {
        let ev = self.events.lock().await.recv().await?;
        let range = match &ev {
            DpEvent::WindowDone { id } => self.held.lock().unwrap().remove(id).map(|h| h.range),
            _ => None,
        };
        Some((ev, range))
    }

    /// Whether the data path failed or is closing.
    pub fn is_stopped(&self) -> bool {
        self.dp.as_ref().is_none_or(DataPath::is_stopped)
    }

    /// Windows whose bytes are still lent.
    pub fn lent(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    /// Close the data path (blocking); then give back what every window
    /// held, unless requests were left in a device.
    pub fn close(mut self) -> Report {
        self.finish()
    }

    fn finish(&mut self) -> Report {
        let Some(dp) = self.dp.take() else {
            return Report::default();
        };
        let report = dp.close();
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        if report.outstanding_at_close > 0 && !held.is_empty() {
            tracing::warn!(
                outstanding = report.outstanding_at_close,
                windows = held.len(),
                "a buffer data path closed with requests still in the device: their ranges \
                 stay leased and mapped for the life of rcpd"
            );
            std::mem::forget(held);
        }
        report
    }
}

impl Drop for LendingPath {
    fn drop(&mut self) {
        if self.dp.is_some() {
            crate::control::in_place(|| self.finish());
        }
    }
}
