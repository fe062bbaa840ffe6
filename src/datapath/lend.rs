//! A data path whose windows' local bytes are lent to it: a session's
//! staging blocks (file streams) or ranges leased from services' buffers
//! ([`crate::mem::memfd`], buffer operations). [`LendingPath::submit`] is
//! safe because each window comes with its [`Loan`] (the [`Block`] or the
//! [`LeasedRange`] of its local bytes), which the lending path keeps until
//! the data path has let go of them. It is the only caller of the unsafe
//! [`DataPath::submit`] outside the data path's own tests and `rcp bench`.
//!
//! [`DataPath::submit`]'s obligations, discharged here:
//! - the bytes are registered under the window's lkey on every rail: the
//!   caller's registrations, one per rail ([`RailRegs`], made by
//!   [`LendingPath::rail_regs`]), come with the window and are held as
//!   long as the lease; with several rails their keys past rail 0 are
//!   entered in the path's [`RailKeys`] (which each rail's key map reads)
//!   for as long as they live, so every rail posts the window under its
//!   own registration's lkey;
//! - they stay mapped: a block holds its arena, a lease's span the
//!   service buffer's mapping;
//! - nobody else in rcpd touches them meanwhile: a block is its holder's
//!   alone (moved into the lending path), a lease is exclusive for a READ
//!   window (bytes land) and at least shared for a WRITE window (the
//!   device reads), so rcpd's other users of the buffer (grants, hashing,
//!   other operations) are refused the range;
//! - until the data path reports the window done: the loan is handed back
//!   on [`DpEvent::WindowDone`] for its id (by [`LendingPath::next_event`]),
//!   or dropped after [`LendingPath::close`] when no request is left
//!   outstanding; a data path that closes with requests still in a device
//!   keeps its loans (and mappings) for the process's life rather than
//!   give the bytes back early.
//!
//! The service that owns the buffer maps the same pages and may write
//! them; it is another process, outside what rcpd can exclude. Bytes it
//! writes during an operation fail the operation's check.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::UnboundedReceiver;

use super::keys::{KeyConflict, RailKeys};
use super::runner::{DataPath, DataPathError, DpEvent};
use super::Report;
use crate::engine::{OpKind, WindowJob};
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::mem::Block;
use crate::provider::Registration;

/// A window's local bytes, lent to the data path from its submission to
/// its end.
#[derive(Debug)]
pub enum Loan {
    /// A block of a session's staging (a file stream's window).
    Staging(Block),
    /// A range leased from a service's buffer (a buffer operation).
    Range(LeasedRange),
}

impl Loan {
    /// The bytes' address and length.
    fn bounds(&self) -> (u64, u64) {
        match self {
            Loan::Staging(b) => (b.addr(), b.len() as u64),
            Loan::Range(r) => (r.span().addr(), r.span().len() as u64),
        }
    }

    /// Whether rcpd has no other user of the bytes (a READ lands in them).
    fn exclusive(&self) -> bool {
        match self {
            Loan::Staging(_) => true,
            Loan::Range(r) => r.lease().kind() == LeaseKind::Exclusive,
        }
    }

    /// The staging block, when it is one.
    pub fn into_block(self) -> Option<Block> {
        match self {
            Loan::Staging(b) => Some(b),
            Loan::Range(_) => None,
        }
    }

    /// The leased range, when it is one.
    pub fn into_range(self) -> Option<LeasedRange> {
        match self {
            Loan::Range(r) => Some(r),
            Loan::Staging(_) => None,
        }
    }
}

impl From<Block> for Loan {
    fn from(b: Block) -> Loan {
        Loan::Staging(b)
    }
}

impl From<LeasedRange> for Loan {
    fn from(r: LeasedRange) -> Loan {
        Loan::Range(r)
    }
}

/// What a lent window keeps from its submission to its end.
struct Lent {
    loan: Loan,
    _regs: Arc<RailRegs>,
    /// Several rails: its rail-0 rkey, entered in the key map until then.
    rkey: Option<u32>,
}

/// Memory's registrations on every rail of a [`LendingPath`], in the data
/// path's order; with several rails, their lkeys are entered in the path's
/// key map (by rail 0's) while this lives.
pub struct RailRegs {
    regs: Vec<Arc<dyn Registration>>,
    keys: Option<Arc<RailKeys>>,
}

impl RailRegs {
    /// The key on rail 0 (a window's `lkey`).
    pub fn lkey(&self) -> u32 {
        self.regs[0].lkey()
    }

    /// Whether every rail's registration covers `[start, stop)`.
    fn cover(&self, start: u64, stop: u64) -> bool {
        self.regs
            .iter()
            .all(|r| start >= r.addr() && stop <= r.addr().saturating_add(r.len() as u64))
    }
}

impl std::fmt::Debug for RailRegs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.regs.iter().map(|r| r.lkey()))
            .finish()
    }
}

impl Drop for RailRegs {
    fn drop(&mut self) {
        // Before the registrations drop: no key map names a key freed.
        if let Some(k) = &self.keys {
            k.release_lkeys(self.lkey());
        }
    }
}

/// A [`DataPath`] whose windows' local bytes are lent to it ([`Loan`]).
pub struct LendingPath {
    /// `None` once closed.
    dp: Option<DataPath>,
    rails: usize,
    /// Several rails: the keys the rails past the first map rail 0's to.
    keys: Option<Arc<RailKeys>>,
    events: tokio::sync::Mutex<UnboundedReceiver<DpEvent>>,
    lent: Mutex<HashMap<u64, Lent>>,
}

/// A window the lending path cannot take.
#[derive(Debug, thiserror::Error)]
pub enum LendError {
    #[error("window {id}: its local bytes [{start:#x}, {end:#x}) are not all in {range}")]
    OutsideLease {
        id: u64,
        start: u64,
        end: u64,
        range: String,
    },
    #[error("window {id}: a READ lands bytes, its range must be lent exclusively")]
    SharedForRead { id: u64 },
    #[error(
        "window {id}: lkey {lkey:#x} is not rail 0's of registrations {regs} covering the range"
    )]
    Key { id: u64, lkey: u32, regs: String },
    #[error("window {id}: a window with this id is live")]
    LiveId { id: u64 },
    #[error("a data path of {0} rails needs a key map (RailKeys) to lend memory")]
    NoKeyMap(usize),
    #[error("{got} registrations for a data path of {rails} rails")]
    RegsPerRail { got: usize, rails: usize },
    #[error("window {id}: registrations {regs} are not of this lending path")]
    OtherPath { id: u64, regs: String },
    #[error(
        "window {id}: rkeys {rkeys:x?} per rail for a data path of {rails} rails, rail 0's \
         being {rkey:#x}"
    )]
    RailRkeys {
        id: u64,
        rkey: u32,
        rkeys: Vec<u32>,
        rails: usize,
    },
    #[error(transparent)]
    Keys(#[from] KeyConflict),
    #[error(transparent)]
    DataPath(#[from] DataPathError),
}

impl LendingPath {
    /// Take over `dp` and its events (from [`DataPath::take_events`]). A
    /// data path of several rails needs `keys`, the map its rails past the
    /// first were started with ([`RailKeys::map_for`] as their
    /// [`RailSpec::keys`](super::RailSpec::keys), as a session's are): a
    /// window's lkey is rail 0's registration's, and each rail posts it
    /// under its own, entered there by [`LendingPath::rail_regs`].
    pub fn new(
        dp: DataPath,
        events: UnboundedReceiver<DpEvent>,
        keys: Option<Arc<RailKeys>>,
    ) -> Result<LendingPath, LendError> {
        let rails = dp.stats().rails.len().max(1);
        if rails > 1 && keys.is_none() {
            return Err(LendError::NoKeyMap(rails));
        }
        Ok(LendingPath {
            dp: Some(dp),
            rails,
            keys: keys.filter(|_| rails > 1),
            events: tokio::sync::Mutex::new(events),
            lent: Mutex::new(HashMap::new()),
        })
    }

    /// The rails of the data path.
    pub fn rails(&self) -> usize {
        self.rails
    }

    /// The data path's live counters (`None` once closed).
    pub fn stats(&self) -> Option<&Arc<super::DataPathStats>> {
        self.dp.as_ref().map(DataPath::stats)
    }

    /// Memory's registrations on every rail (`regs[k]` in rail `k`'s
    /// domain, the data path's order), its keys entered in the key map for
    /// as long as the result lives.
    pub fn rail_regs(&self, regs: Vec<Arc<dyn Registration>>) -> Result<Arc<RailRegs>, LendError> {
        if regs.len() != self.rails {
            return Err(LendError::RegsPerRail {
                got: regs.len(),
                rails: self.rails,
            });
        }
        if let Some(k) = &self.keys {
            k.hold_lkeys(regs[0].lkey(), regs.iter().map(|r| r.lkey()).collect())?;
        }
        Ok(Arc::new(RailRegs {
            regs,
            keys: self.keys.clone(),
        }))
    }

    /// Check `job` against its loan, registrations and rkeys per rail.
    fn validate(
        &self,
        job: &WindowJob,
        loan: &Loan,
        regs: &RailRegs,
        rail_rkeys: &[u32],
    ) -> Result<(), LendError> {
        let id = job.id;
        let (addr, len) = loan.bounds();
        let end = job
            .extents
            .iter()
            .map(|e| e.offset + u64::from(e.len))
            .max()
            .unwrap_or(0);
        let (start, stop) = (job.local_addr, job.local_addr.saturating_add(end));
        if start < addr || stop > addr.saturating_add(len) {
            return Err(LendError::OutsideLease {
                id,
                start,
                end: stop,
                range: format!("{loan:?}"),
            });
        }
        if job.op == OpKind::Read && !loan.exclusive() {
            return Err(LendError::SharedForRead { id });
        }
        let same_map = match (&self.keys, &regs.keys) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if regs.regs.len() != self.rails || !same_map {
            return Err(LendError::OtherPath {
                id,
                regs: format!("{regs:?}"),
            });
        }
        if regs.lkey() != job.lkey || !regs.cover(start, stop) {
            return Err(LendError::Key {
                id,
                lkey: job.lkey,
                regs: format!("{regs:?}"),
            });
        }
        if self.rails > 1
            && (rail_rkeys.len() != self.rails || rail_rkeys.first() != Some(&job.rkey))
        {
            return Err(LendError::RailRkeys {
                id,
                rkey: job.rkey,
                rkeys: rail_rkeys.to_vec(),
                rails: self.rails,
            });
        }
        Ok(())
    }

    /// Submit `job`, whose local bytes lie in `loan` and are registered
    /// on every rail by `regs` (rail 0's under `job.lkey`); both are kept
    /// until the window's end. With several rails, `rail_rkeys` is the
    /// window's rkey on each (rail 0's first, `job.rkey`), entered in the
    /// key map until the window's end; with one, it is not read. Refused
    /// (the loan dropped, nothing posted) when any of that does not hold.
    pub fn submit(
        &self,
        job: WindowJob,
        loan: impl Into<Loan>,
        regs: Arc<RailRegs>,
        rail_rkeys: &[u32],
    ) -> Result<(), LendError> {
        let loan = loan.into();
        self.validate(&job, &loan, &regs, rail_rkeys)?;
        let id = job.id;
        {
            let mut held = self.lent.lock().unwrap();
            // A live window's id: refused before anything of the live
            // window is touched (its range and registrations stay held).
            if held.contains_key(&id) {
                return Err(LendError::LiveId { id });
            }
            let mut rkey = None;
            if let Some(k) = &self.keys {
                // Before the submit: a rail may post the window at once.
                // Counted: windows of one remote registration share it.
                k.hold_rkeys(job.rkey, rail_rkeys.to_vec())?;
                rkey = Some(job.rkey);
            }
            // Kept before the submit: a WindowDone may come at once.
            held.insert(
                id,
                Lent {
                    loan,
                    _regs: regs,
                    rkey,
                },
            );
        }
        let r = match &self.dp {
            Some(dp) => {
                // SAFETY: (module docs) the bytes [local_addr + e.offset, + e.len)
                // of every extent lie in `loan` and are registered on every rail
                // by `regs` (checked above: one registration per rail, covering
                // them, rail 0's under `job.lkey`), held with the loan. With
                // several rails each rail past the first posts under the lkey its
                // key map gives for `job.lkey`: the one `regs` entered in this
                // path's `RailKeys` (the map the rails read, checked above), which
                // stays entered while `regs` lives (a counted entry, refused to
                // anyone entering other keys under the same lkey). The loan keeps
                // the bytes mapped (a block its arena, a range its span) and makes
                // this window rcpd's only user of them (a block is owned; a lease is
                // exclusive for a READ, checked above); loan and
                // registrations are dropped only on the window's WindowDone
                // (`next_event`) or after `close` left no request outstanding.
                // Were a rail's map not `keys` (`new`'s caller's word), the rail
                // would post under its default lkey, its staging's, whose
                // region does not hold these bytes: the device refuses the
                // request (local protection error), it reaches no other memory.
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
                let h = self.lent.lock().unwrap().remove(&id);
                self.forget_rkey(h.as_ref());
            }
            return Err(e.into());
        }
        Ok(())
    }

    fn forget_rkey(&self, h: Option<&Lent>) {
        if let (Some(k), Some(rkey)) = (&self.keys, h.and_then(|h| h.rkey)) {
            k.release_rkeys(rkey);
        }
    }

    /// The next event; at a window's `WindowDone` its rkeys per rail are
    /// forgotten, its registrations let go and its loan handed back (the
    /// caller reads a READ window's bytes through it, then drops or reuses
    /// it). `None` once the data path is closed.
    pub async fn next_event(&self) -> Option<(DpEvent, Option<Loan>)> {
        let ev = self.events.lock().await.recv().await?;
        let loan = match &ev {
            DpEvent::WindowDone { id } => {
                let h = self.lent.lock().unwrap().remove(id);
                self.forget_rkey(h.as_ref());
                h.map(|h| h.loan)
            }
            _ => None,
        };
        Some((ev, loan))
    }

    /// Windows whose bytes are still lent.
    pub fn lent(&self) -> usize {
        self.lent.lock().unwrap().len()
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
        let held = std::mem::take(&mut *self.lent.lock().unwrap());
        if report.outstanding_at_close > 0 && !held.is_empty() {
            tracing::warn!(
                outstanding = report.outstanding_at_close,
                windows = held.len(),
                "a data path closed with requests still in the device: their windows' bytes \
                 stay lent (and mapped) for the life of the process"
            );
            std::mem::forget(held);
        }
        report
    }
}

impl Drop for LendingPath {
    fn drop(&mut self) {
        if self.dp.is_some() {
            crate::blocking::in_place(|| self.finish());
        }
    }
}
