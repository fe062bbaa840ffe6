//! Protection domains and memory registration.

use std::fmt;
use std::sync::Arc;

use rdma_sys::*;

use super::device::Context;
use super::error::VerbsError;
use crate::mem::arena::Region;
use crate::mem::{Arena, PeerSpan};

/// Access rights of a registration. Least privilege: ask only for what the
/// transfer's direction needs.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(u32);

impl Access {
    /// Local read only (the source of RDMA WRITEs).
    pub const LOCAL_READ: Access = Access(0);
    /// The device may write into it (the target of RDMA READs, or needed with
    /// REMOTE_WRITE).
    pub const LOCAL_WRITE: Access = Access(ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// Peers may RDMA WRITE into it (push windows). Implies LOCAL_WRITE.
    pub const REMOTE_WRITE: Access = Access(
        ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0,
    );
    /// Peers may RDMA READ from it (pull windows).
    pub const REMOTE_READ: Access = Access(ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// Memory windows may be bound to it (a region registered once whose
    /// remote access is granted window by window, [`super::mw`]). Gives no
    /// remote access of its own.
    pub const MW_BIND: Access = Access(ibv_access_flags::IBV_ACCESS_MW_BIND.0);

    pub fn bits(self) -> u32 {
        self.0
    }

    pub fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }

    pub fn remote_write(self) -> bool {
        self.0 & ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 != 0
    }

    pub fn remote_read(self) -> bool {
        self.0 & ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 != 0
    }

    /// Only the remote rights (what a memory window may carry).
    pub fn remote(self) -> Access {
        Access(
            self.0
                & (ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0),
        )
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut v = Vec::new();
        if self.0 & ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 != 0 {
            v.push("LOCAL_WRITE");
        }
        if self.remote_write() {
            v.push("REMOTE_WRITE");
        }
        if self.remote_read() {
            v.push("REMOTE_READ");
        }
        if self.contains(Access::MW_BIND) {
            v.push("MW_BIND");
        }
        if v.is_empty() {
            v.push("LOCAL_READ");
        }
        write!(f, "{}", v.join("|"))
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    pub(crate) pd: *mut ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: ibv_pd is used only through thread-safe libibverbs calls.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<ProtectionDomain>, VerbsError> {
        // SAFETY: ctx is open and outlives the PD (we hold its Arc).
        let pd = unsafe { ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(VerbsError::last(
                "ibv_alloc_pd",
                format!("on {}", ctx.name()),
            ));
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: ctx.clone(),
        }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Register the whole arena (done once at start-up; blocks are then
    /// addressed by offset under one lkey).
    ///
    /// # Safety
    ///
    /// As [`register_span`](Self::register_span), for the whole arena.
    pub unsafe fn register_arena(
        self: &Arc<Self>,
        arena: &Arena,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        self.register_region(arena.region().clone(), arena.addr(), arena.len(), access)
    }

    /// Register a span of the arena (a window granted to one transfer: its
    /// rkey reaches only these bytes and dies with the registration).
    ///
    /// # Safety
    ///
    /// With a remote right in `access` (`REMOTE_WRITE`, `REMOTE_READ`), the
    /// span is lent to the peers of this PD's QPs: they may write or read
    /// it at any time until the region is dropped. The caller guarantees
    /// that until then nothing else writes the span, nor reads it when a
    /// peer may write it (as [`crate::provider::Domain::register`]).
    /// Without a remote right (`LOCAL_WRITE`, `MW_BIND`: remote access is
    /// then granted window by window, by the `unsafe`
    /// [`MemoryWindow::bind`](super::MemoryWindow::bind)) there is nothing
    /// to uphold.
    pub unsafe fn register_span(
        self: &Arc<Self>,
        span: &PeerSpan,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        self.register_region(span.region().clone(), span.addr(), span.len(), access)
    }

    fn register_region(
        self: &Arc<Self>,
        region: Arc<Region>,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        debug_assert!(
            addr >= region.ptr() as u64
                && addr + len as u64 <= region.ptr() as u64 + region.len() as u64
        );
        crate::mem::ensure_lockable(len as u64)
            .map_err(|e| VerbsError::new("ibv_reg_mr", libc::ENOMEM, e.to_string()))?;
        // SAFETY: [addr, addr+len) lies in `region`, which the MemoryRegion keeps
        // mapped (Arc) until after ibv_dereg_mr.
        let mr = unsafe { ibv_reg_mr(self.pd, addr as *mut _, len, access.bits() as i32) };
        if mr.is_null() {
            return Err(VerbsError::last(
                "ibv_reg_mr",
                format!(
                    "registering {len} bytes at {addr:#x} with {access:?} on {}",
                    self.ctx.name()
                ),
            ));
        }
        super::counts::registered();
        // SAFETY: mr is a valid registration returned just now.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            mr,
            lkey,
            rkey,
            addr,
            len,
            access,
            _pd: self.clone(),
            _mem: region,
        })
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR/QP made from this PD holds its Arc, so none is left.
        unsafe {
            ibv_dealloc_pd(self.pd);
        }
    }
}

/// A memory registration. The memory stays mapped while it lives; its keys
/// stop working when it is dropped (ibv_dereg_mr).
pub struct MemoryRegion {
    mr: *mut ibv_mr,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    access: Access,
    _pd: Arc<ProtectionDomain>,
    _mem: Arc<Region>,
}

// SAFETY: the MR handle is only passed to thread-safe libibverbs calls.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MR({:#x}+{} lkey={:#x} rkey={:#x} {:?})",
            self.addr, self.len, self.lkey, self.rkey, self.access
        )
    }
}

impl MemoryRegion {
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn access(&self) -> Access {
        self.access
    }

    /// Whether `[addr, addr+len)` lies inside the registration.
    pub fn covers(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && (addr - self.addr)
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64)
    }

    /// The PD it is registered in.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self._pd
    }

    /// The handle, for work requests that name the region (a memory-window
    /// bind). Valid while `self` lives.
    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.mr
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: mr came from ibv_reg_mr and is deregistered once. Work
        // requests naming it must have completed: the data path drops MRs
        // only after the transfer's last completion (or after the QP that
        // could use it was reset).
        unsafe {
            ibv_dereg_mr(self.mr);
        }
    }
}
