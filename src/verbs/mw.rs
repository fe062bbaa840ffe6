//! Type-2 memory windows: remote access to one span of a region that was
//! registered once, given by a bind work request on one QP and taken back
//! by a local invalidate.
//!
//! rcpd registers its whole window arena once, with LOCAL_WRITE | MW_BIND
//! and no remote access of its own ([`Access::MW_BIND`]). A grant binds a
//! [`MemoryWindow`] over just the granted window, REMOTE_WRITE (push) or
//! REMOTE_READ (pull), to the session's QP (`IBV_WR_BIND_MW`): its rkey
//! works on that QP only (any other QP, even one in the same PD, gets
//! IBV_WC_REM_ACCESS_ERR) and only until the window is invalidated
//! (`IBV_WR_LOCAL_INV`); the next bind gives it a fresh rkey (the key byte
//! incremented, as `ibv_inc_rkey`).
//!
//! Binds and invalidates are signaled send requests whose completions the
//! binder waits for (a post and a poll of the QP's send CQ, microseconds):
//! they need exclusive use of the QP (`&mut QueuePair`) and a CQ nobody
//! else polls, which rcpd's QPs are (they only respond to their peer).
//!
//! Invariants (the `unsafe` here):
//! - the `ibv_mw` handle is valid from `ibv_alloc_mw` to the
//!   `ibv_dealloc_mw` of `Drop`;
//! - a window holds the region it is (or may be) bound into, so the region
//!   is never deregistered, nor its memory unmapped, under a bound window;
//! - a window whose bind or invalidate did not complete with success is in
//!   [`MwState::Unknown`]: whether its rkey still reaches memory is not
//!   known, and only deallocating it revokes it for sure, which
//!   [`MwPool::put`] does instead of reusing it. A window bound before its
//!   QP was reset is revoked the same way: after a reset the device may or
//!   may not have kept the binding, and an invalidate of a window it
//!   dropped would fail and take the QP to the error state.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_sys::*;

use super::error::{Hint, VerbsError};
use super::pd::{Access, MemoryRegion, ProtectionDomain};
use super::qp::QueuePair;
use crate::engine::WcStatus;

/// How long a bind or an invalidate may take before the window is given up
/// (deallocated): they are local operations of microseconds, even on rxe.
pub const MW_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a window is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MwState {
    /// Not bound: its rkey reaches nothing.
    Free,
    /// Bound to QP `qpn` (in its `resets`-th life): the rkey reaches
    /// `[addr, addr+len)` with `access`, through that QP only.
    Bound {
        qpn: u32,
        resets: u64,
        addr: u64,
        len: usize,
        access: Access,
    },
    /// A bind or invalidate failed or timed out, or the QP was reset under
    /// the binding: only deallocating the window revokes its rkey for sure.
    Unknown,
}

/// Work request ids of binds and invalidates: the top bit set, so a stray
/// completion is never mistaken for a data-path request's.
static NEXT_WR_ID: AtomicU64 = AtomicU64::new(1);

fn next_wr_id() -> u64 {
    (1 << 63) | NEXT_WR_ID.fetch_add(1, Ordering::Relaxed)
}

/// The next rkey of a window: the same index, the key byte incremented
/// (`ibv_inc_rkey`, without its overflow on 0xffff_ffff).
pub fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

/// A type-2 memory window (`ibv_alloc_mw(pd, IBV_MW_TYPE_2)`).
pub struct MemoryWindow {
    mw: *mut ibv_mw,
    /// The rkey it answers to while bound, or answered to last: the next
    /// bind increments its key byte.
    rkey: u32,
    state: MwState,
    /// The region it is (or may be) bound into: held while the binding may
    /// exist, dropped after the deallocation in `Drop` (fields drop after it).
    mr: Option<Arc<MemoryRegion>>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the MW handle is only passed to thread-safe libibverbs calls;
// every state change takes &mut self.
unsafe impl Send for MemoryWindow {}
// SAFETY: &self only reads plain fields.
unsafe impl Sync for MemoryWindow {}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MW(rkey={:#x} {:?})", self.rkey, self.state)
    }
}

impl MemoryWindow {
    /// Allocate a type-2 window in `pd` (not bound: its rkey reaches nothing).
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<MemoryWindow, VerbsError> {
        let name = pd.context().name().to_string();
        // SAFETY: pd is valid and outlives the window (we hold its Arc);
        // ibv_alloc_mw returns None (EOPNOTSUPP) when the provider has no
        // alloc_mw, NULL with errno set when the device refuses.
        let mw = match unsafe { ibv_alloc_mw(pd.pd, ibv_mw_type::IBV_MW_TYPE_2) } {
            None => {
                return Err(VerbsError::new(
                    "ibv_alloc_mw",
                    libc::EOPNOTSUPP,
                    format!("{name}'s provider has no memory windows"),
                ))
            }
            Some(p) if p.is_null() => {
                return Err(VerbsError::last(
                    "ibv_alloc_mw",
                    format!("a type-2 memory window on {name}"),
                ))
            }
            Some(p) => p,
        };
        // SAFETY: mw is the valid window just allocated.
        let rkey = unsafe { (*mw).rkey };
        Ok(MemoryWindow {
            mw,
            rkey,
            state: MwState::Free,
            mr: None,
            pd: pd.clone(),
        })
    }

    /// The rkey: the live one while bound.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    pub fn state(&self) -> MwState {
        self.state
    }

    /// Bind the window to `qp` over `[addr, addr+len)` of `mr` with the
    /// remote rights of `access`, under a fresh rkey, and wait for the
    /// bind's completion; returns the new rkey. The window must be
    /// [`MwState::Free`]; `mr` (registered with [`Access::MW_BIND`]), `qp`
    /// and the window must share one PD, and `qp` must be in RTS. The rkey
    /// works only through `qp`, until [`MemoryWindow::invalidate`] (or the
    /// window's deallocation).
    ///
    /// # Safety
    ///
    /// The span is lent to the peer of `qp` while the window is bound: it
    /// may write (`REMOTE_WRITE`) or read (`REMOTE_READ`) the bytes at any
    /// time until the window is invalidated (or deallocated), and nothing
    /// here can see when. The caller guarantees that until then nothing
    /// else writes `[addr, addr+len)`, nor reads it when the peer may write
    /// it (as [`crate::provider::Domain::register`]).
    pub unsafe fn bind(
        &mut self,
        qp: &mut QueuePair,
        mr: &Arc<MemoryRegion>,
        addr: u64,
        len: usize,
        access: Access,
        timeout: Duration,
    ) -> Result<u32, VerbsError> {
        let what = || {
            format!(
                "binding a window of {len} bytes at {addr:#x} ({:?}) to QP {:#x}",
                access.remote(),
                qp.qpn()
            )
        };
        let refuse =
            |why: String| Err(VerbsError::new("ibv_post_send(BIND_MW)", libc::EINVAL, why));
        if self.state != MwState::Free {
            return refuse(format!("{}: the window is {:?}", what(), self.state));
        }
        if len == 0 || !mr.covers(addr, len) {
            return refuse(format!("{}: outside {mr:?}", what()));
        }
        if !mr.access().contains(Access::MW_BIND) {
            return refuse(format!("{}: {mr:?} was registered without MW_BIND", what()));
        }
        if access.remote() == Access::LOCAL_READ {
            return refuse(format!("{}: no remote right asked for", what()));
        }
        if mr.pd().pd != self.pd.pd || qp.pd().pd != self.pd.pd {
            return refuse(format!(
                "{}: the window, region and QP are in different PDs",
                what()
            ));
        }
        let rkey = inc_rkey(self.rkey);
        let wr_id = next_wr_id();
        // SAFETY: ibv_send_wr is plain old data; all-zero is a valid value.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.bind_mw_tso_union.bind_mw = bind_mw_t {
            mw: self.mw,
            rkey,
            bind_info: ibv_mw_bind_info {
                mr: mr.raw(),
                addr,
                length: len as u64,
                mw_access_flags: access.remote().bits(),
            },
        };
        // From here the binding may exist: hold the region.
        self.mr = Some(mr.clone());
        // SAFETY: the window and the region are valid until the request
        // completes (we hold both, and the region stays held while the
        // binding may exist); the span lies inside the region, and the
        // caller lends it to the peer (this function's `# Safety`).
        if let Err(e) = unsafe { qp.post_one(&mut wr) } {
            if qp.state() != super::qp::QpState::Rts {
                // Refused before anything was posted.
                self.mr = None;
            } else {
                self.state = MwState::Unknown;
            }
            return Err(e);
        }
        self.state = MwState::Unknown;
        let status = qp.wait_send(wr_id, timeout)?;
        if status != WcStatus::Success {
            return Err(VerbsError::new(
                "ibv_post_send(BIND_MW)",
                libc::EIO,
                format!(
                    "{}: the bind completed with {} (the QP is in the error state now)",
                    what(),
                    status.label()
                ),
            ));
        }
        super::counts::bound();
        self.rkey = rkey;
        // SAFETY: mw is valid; providers (rxe) take the window's current
        // rkey from here when the next request names it.
        unsafe { (*self.mw).rkey = rkey };
        self.state = MwState::Bound {
            qpn: qp.qpn(),
            resets: qp.resets(),
            addr,
            len,
            access: access.remote(),
        };
        Ok(rkey)
    }

    /// Invalidate the window (`IBV_WR_LOCAL_INV` on the QP it is bound to)
    /// and wait for the completion: its rkey fails from then on, and the
    /// window can be bound again. A free window is left as it is. An error
    /// leaves the window [`MwState::Unknown`]: drop it (deallocating it
    /// revokes the rkey for sure). A window bound before `qp` was reset is
    /// not invalidated but refused that way at once.
    pub fn invalidate(&mut self, qp: &mut QueuePair, timeout: Duration) -> Result<(), VerbsError> {
        let (qpn, resets) = match self.state {
            MwState::Free => return Ok(()),
            MwState::Unknown => {
                return Err(VerbsError::new(
                    "ibv_post_send(LOCAL_INV)",
                    libc::EINVAL,
                    format!("window rkey {:#x} is in an unknown state", self.rkey),
                ))
            }
            MwState::Bound { qpn, resets, .. } => (qpn, resets),
        };
        if qpn != qp.qpn() || resets != qp.resets() {
            self.state = MwState::Unknown;
            return Err(VerbsError::new(
                "ibv_post_send(LOCAL_INV)",
                libc::EINVAL,
                format!(
                    "window rkey {:#x} was bound to QP {qpn:#x} before {} reset(s) of QP {:#x}: \
                     only deallocating it revokes it for sure",
                    self.rkey,
                    qp.resets().saturating_sub(resets),
                    qp.qpn()
                ),
            ));
        }
        let wr_id = next_wr_id();
        // SAFETY: ibv_send_wr is plain old data; all-zero is a valid value.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
        wr.imm_data_invalidated_rkey_union.invalidated_rkey = self.rkey;
        self.state = MwState::Unknown;
        // SAFETY: a local invalidate names no memory and no handle, only an
        // rkey; it takes access away and lends nothing.
        unsafe { qp.post_one(&mut wr) }?;
        let status = qp.wait_send(wr_id, timeout)?;
        if status != WcStatus::Success {
            return Err(VerbsError::new(
                "ibv_post_send(LOCAL_INV)",
                libc::EIO,
                format!(
                    "invalidating window rkey {:#x} on QP {:#x} completed with {}",
                    self.rkey,
                    qp.qpn(),
                    status.label()
                ),
            ));
        }
        self.state = MwState::Free;
        self.mr = None;
        Ok(())
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: mw came from ibv_alloc_mw and is deallocated once; a bound
        // window is unbound by it (its rkey fails from then on). The region
        // it may be bound into is released after this (the `mr` field).
        let rc = unsafe { ibv_dealloc_mw(self.mw) };
        if rc != 0 {
            tracing::warn!(
                rkey = format_args!("{:#x}", self.rkey),
                errno = rc,
                "ibv_dealloc_mw failed"
            );
        }
    }
}

/// Free type-2 windows of one PD, reused grant after grant (allocating a
/// window is a system call and, on hardware, a firmware command; a bind is
/// a work request). Windows in any state but free are deallocated instead
/// of being kept.
pub struct MwPool {
    pd: Arc<ProtectionDomain>,
    free: Mutex<Vec<MemoryWindow>>,
    allocated: AtomicU64,
}

impl MwPool {
    pub fn new(pd: &Arc<ProtectionDomain>) -> MwPool {
        MwPool {
            pd: pd.clone(),
            free: Mutex::new(Vec::new()),
            allocated: AtomicU64::new(0),
        }
    }

    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// A free window: one that was given back, or a new one.
    pub fn take(&self) -> Result<MemoryWindow, VerbsError> {
        if let Some(mw) = self.free.lock().unwrap().pop() {
            return Ok(mw);
        }
        let mw = MemoryWindow::alloc(&self.pd).map_err(|e| {
            if e.errno == libc::ENOMEM {
                e.with_hint(Hint::Resources)
            } else {
                e
            }
        })?;
        self.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(mw)
    }

    /// Give a window back: kept if free, deallocated otherwise.
    pub fn put(&self, mw: MemoryWindow) {
        if mw.state() == MwState::Free && Arc::ptr_eq(&mw.pd, &self.pd) {
            self.free.lock().unwrap().push(mw);
        } else {
            tracing::debug!(?mw, "memory window deallocated instead of reused");
            drop(mw);
        }
    }

    /// Windows allocated so far (reused ones counted once).
    pub fn allocated(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Free windows waiting to be reused.
    pub fn idle(&self) -> usize {
        self.free.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rkey_increments_its_key_byte_only() {
        assert_eq!(inc_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(inc_rkey(0xffff_ffff), 0xffff_ff00);
    }

    #[test]
    fn wr_ids_are_tagged_and_distinct() {
        let (a, b) = (next_wr_id(), next_wr_id());
        assert!(a >> 63 == 1 && b >> 63 == 1 && a != b);
    }
}
