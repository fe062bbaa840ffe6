//! The verbs provider: [`Domain`] over a PD ([`VerbsDomain`]: a
//! registration per grant) or over memory windows bound to one QP
//! ([`MwDomain`]: the memory registered once), [`Channel`] over an RC QP.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cq::CompletionQueue;
use super::mw::{MemoryWindow, MwPool, MW_TIMEOUT};
use super::pd::{Access, MemoryRegion, ProtectionDomain};
use super::post::PostScratch;
use super::qp::{ConnectParams, QpEndpoint, QueuePair};
use super::VerbsError;
use crate::engine::{WorkCompletion, WorkRequest};
use crate::mem::{Arena, PeerSpan};
use crate::provider::{
    Bases, Channel, ChannelCaps, Domain, PostFailure, ProviderError, ProviderKind, Registration,
};

impl Registration for MemoryRegion {
    fn lkey(&self) -> u32 {
        MemoryRegion::lkey(self)
    }
    fn rkey(&self) -> u32 {
        MemoryRegion::rkey(self)
    }
    fn addr(&self) -> u64 {
        MemoryRegion::addr(self)
    }
    fn len(&self) -> usize {
        MemoryRegion::len(self)
    }
    fn access(&self) -> Access {
        MemoryRegion::access(self)
    }
}

/// A PD as a provider domain.
pub struct VerbsDomain {
    pub pd: Arc<ProtectionDomain>,
}

impl Domain for VerbsDomain {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Verbs
    }
    /// # Safety
    ///
    /// As [`Domain::register`].
    unsafe fn register(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        // SAFETY: the caller's contract (Domain::register) is register_span's.
        Ok(Arc::new(unsafe { self.pd.register_span(span, access) }?))
    }
}

/// An arena registered once, as one region per slot of `slot` bytes with
/// LOCAL_WRITE | MW_BIND and no remote access of its own: memory windows
/// are bound into the region of the slot a grant lies in. One region per
/// slot rather than one for the arena bounds what a window's rkey can reach
/// by the slot even on a device that checks only a window's region, not
/// the window (rxe), and a slot is granted to one session at a time.
pub struct RegisteredSlots {
    base: u64,
    slot: usize,
    regions: Vec<Arc<MemoryRegion>>,
}

impl fmt::Debug for RegisteredSlots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RegisteredSlots({:#x}, {} x {} bytes)",
            self.base,
            self.regions.len(),
            self.slot
        )
    }
}

impl RegisteredSlots {
    /// Register every whole slot of `slot` bytes of `arena` in `pd`, with
    /// `access` (`LOCAL_WRITE | MW_BIND`: a remote right is refused, remote
    /// access being granted window by window).
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        arena: &Arena,
        slot: usize,
        access: Access,
    ) -> Result<RegisteredSlots, VerbsError> {
        if access.remote() != Access::LOCAL_READ {
            return Err(VerbsError::new(
                "ibv_reg_mr",
                libc::EINVAL,
                format!("slots registered once with remote rights {access:?}"),
            ));
        }
        let count = arena.len() / slot.max(1);
        let regions = (0..count)
            .map(|i| {
                let span = PeerSpan::new(arena, arena.addr() + (i * slot) as u64, slot)
                    .expect("a slot lies inside its arena");
                // SAFETY: MW_BIND and local rights only (checked above):
                // the regions give no peer any access of their own.
                unsafe { pd.register_span(&span, access) }.map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RegisteredSlots {
            base: arena.addr(),
            slot,
            regions,
        })
    }

    /// The region holding all of `[addr, addr+len)`, if one slot does.
    pub fn region_of(&self, addr: u64, len: usize) -> Option<&Arc<MemoryRegion>> {
        let i = usize::try_from(addr.checked_sub(self.base)? / self.slot as u64).ok()?;
        self.regions.get(i).filter(|r| r.covers(addr, len))
    }

    /// How many slots (regions).
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    pub fn slot_size(&self) -> usize {
        self.slot
    }
}

/// One session's domain when the memory is registered once: a grant binds
/// a type-2 memory window of `pool` over the granted span (in the region of
/// its slot) to the session's QP (`channel`), so its rkey works through
/// that QP only, and the registration it returns invalidates the window
/// when dropped.
pub struct MwDomain {
    /// The arena, registered once per slot in the PD of `channel`'s QP.
    pub slots: Arc<RegisteredSlots>,
    pub pool: Arc<MwPool>,
    pub channel: Arc<VerbsChannel>,
}

impl Domain for MwDomain {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Verbs
    }

    /// A window's rkey reaches at most the slot it lies in: exactly the
    /// window where the device checks window bounds, as the verbs spec
    /// says; the whole slot where it checks only the region's (rxe).
    fn exact_bounds(&self) -> bool {
        false
    }

    /// # Safety
    ///
    /// As [`Domain::register`].
    unsafe fn register(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        let mr = self
            .slots
            .region_of(span.addr(), span.len())
            .ok_or_else(|| {
                ProviderError::Protocol(format!(
                    "{span:?} does not lie in one slot of {:?}",
                    self.slots
                ))
            })?;
        self.bind(mr, span, access)
    }

    /// A span of the window arena is bound into its slot's region, as
    /// [`MwDomain::register`]; any other span (a service's buffer) into a
    /// registration of `whole` in the PD made once (LOCAL_WRITE | MW_BIND,
    /// no remote access of its own) and kept in `bases`. On a device that
    /// checks only the bounds of the region a window is bound into (rxe),
    /// the window's rkey reaches all of `whole` through the session's QP,
    /// not only `span`: see [`Domain::exact_bounds`].
    unsafe fn register_in(
        &self,
        bases: &Bases,
        whole: &PeerSpan,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        if self.slots.region_of(span.addr(), span.len()).is_some() {
            // SAFETY: the caller's contract is register's.
            return unsafe { self.register(span, access) };
        }
        let pd = self.pool.pd();
        let mr = bases.find_or(
            |mr: &MemoryRegion| Arc::ptr_eq(mr.pd(), pd) && mr.covers(whole.addr(), whole.len()),
            || pd.register_span(whole, Access::LOCAL_WRITE | Access::MW_BIND),
        )?;
        self.bind(&mr, span, access)
    }
}

impl MwDomain {
    /// Bind a window of the pool over `span` of `mr` to the session's QP.
    fn bind(
        &self,
        mr: &Arc<MemoryRegion>,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        let mut mw = self.pool.take()?;
        // SAFETY: the caller's contract (Domain::register) is bind's: the
        // span is the caller's to lend until the registration returned
        // here, which invalidates the window when dropped, is dropped.
        match unsafe {
            self.channel
                .bind_window(&mut mw, mr, span.addr(), span.len(), access)
        } {
            Ok(rkey) => Ok(Arc::new(WindowRegistration {
                mw: Mutex::new(Some(mw)),
                pool: self.pool.clone(),
                channel: self.channel.clone(),
                lkey: mr.lkey(),
                rkey,
                addr: span.addr(),
                len: span.len(),
                access: access.remote(),
            })),
            Err(e) => {
                self.pool.put(mw);
                Err(e.into())
            }
        }
    }
}

/// A granted span as a bound memory window: dropping it invalidates the
/// window on its QP (or, when that fails, deallocates it) before the window
/// goes back to the pool, so its rkey fails from then on.
pub struct WindowRegistration {
    mw: Mutex<Option<MemoryWindow>>,
    pool: Arc<MwPool>,
    channel: Arc<VerbsChannel>,
    lkey: u32,
    rkey: u32,
    addr: u64,
    len: usize,
    access: Access,
}

impl fmt::Debug for WindowRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MW({:#x}+{} rkey={:#x} {:?})",
            self.addr, self.len, self.rkey, self.access
        )
    }
}

impl Registration for WindowRegistration {
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn access(&self) -> Access {
        self.access
    }
}

impl Drop for WindowRegistration {
    fn drop(&mut self) {
        let Some(mut mw) = self.mw.get_mut().unwrap().take() else {
            return;
        };
        if let Err(e) = self.channel.invalidate_window(&mut mw) {
            // Refused before posting (bound before a reconnect) or failed
            // (the QP is in the error state): the pool deallocates it, which
            // revokes the rkey whatever the device kept.
            if e.errno == libc::EINVAL {
                tracing::debug!(rkey = format_args!("{:#x}", self.rkey), error = %e, "memory window revoked by deallocation");
            } else {
                tracing::warn!(rkey = format_args!("{:#x}", self.rkey), error = %e, "memory window revoked by deallocation");
            }
        }
        self.pool.put(mw);
    }
}

/// An RC QP and its send CQ as a provider channel.
pub struct VerbsChannel {
    qp: Mutex<QueuePair>,
    cq: Arc<CompletionQueue>,
    scratch: Mutex<PostScratch>,
    caps: ChannelCaps,
}

impl VerbsChannel {
    /// Wrap a QP (in any state; connect it with [`VerbsChannel::handshake`]).
    pub fn new(qp: QueuePair) -> VerbsChannel {
        let caps = ChannelCaps {
            sq_depth: qp.sq_depth(),
            max_inline: qp.max_inline(),
            max_sge: qp.max_send_sge(),
        };
        let cq = qp.send_cq().clone();
        VerbsChannel {
            qp: Mutex::new(qp),
            cq,
            scratch: Mutex::new(PostScratch::with_capacity(64)),
            caps,
        }
    }

    pub fn endpoint(&self) -> QpEndpoint {
        self.qp.lock().unwrap().endpoint()
    }

    pub fn handshake(&self, remote: &QpEndpoint, p: &ConnectParams) -> Result<(), VerbsError> {
        self.qp.lock().unwrap().handshake(remote, p)
    }

    /// Reset the QP (RESET -> INIT, fresh PSN, GID re-queried) for a
    /// reconnect; returns the new endpoint to send to the peer.
    pub fn reset(&self) -> Result<QpEndpoint, VerbsError> {
        self.qp.lock().unwrap().reset()
    }

    /// Reset the QP and connect it to `remote` again in one step (nothing
    /// is bound or posted in between); returns the new endpoint.
    pub fn reconnect(
        &self,
        remote: &QpEndpoint,
        p: &ConnectParams,
    ) -> Result<QpEndpoint, VerbsError> {
        let mut qp = self.qp.lock().unwrap();
        let ep = qp.reset()?;
        qp.handshake(remote, p)?;
        Ok(ep)
    }

    /// Bind `mw` to this channel's QP over `[addr, addr+len)` of `mr`
    /// ([`MemoryWindow::bind`]); the new rkey. Only for a QP whose CQ no
    /// data path polls (rcpd's).
    ///
    /// # Safety
    ///
    /// As [`MemoryWindow::bind`].
    pub unsafe fn bind_window(
        &self,
        mw: &mut MemoryWindow,
        mr: &Arc<MemoryRegion>,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<u32, VerbsError> {
        let mut qp = self.qp.lock().unwrap();
        // SAFETY: the caller's contract, passed on.
        unsafe { mw.bind(&mut qp, mr, addr, len, access, MW_TIMEOUT) }
    }

    /// Invalidate `mw` on this channel's QP ([`MemoryWindow::invalidate`]).
    pub fn invalidate_window(&self, mw: &mut MemoryWindow) -> Result<(), VerbsError> {
        let mut qp = self.qp.lock().unwrap();
        mw.invalidate(&mut qp, MW_TIMEOUT)
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qp.lock().unwrap().qpn()
    }

    /// Force the QP into the error state (flushes outstanding WRs).
    pub fn set_error(&self) -> Result<(), VerbsError> {
        self.qp.lock().unwrap().set_error()
    }

    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }
}

impl Channel for VerbsChannel {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Verbs
    }

    fn caps(&self) -> ChannelCaps {
        self.caps
    }

    /// # Safety
    ///
    /// As [`Channel::post`]: every local segment is registered memory lent
    /// to the device until the request is retired.
    unsafe fn post(&self, wrs: &[WorkRequest]) -> Result<(), PostFailure> {
        let qp = self.qp.lock().unwrap();
        let mut scratch = self.scratch.lock().unwrap();
        // SAFETY: the caller's contract (Channel::post) is post_send's: it
        // owns each local buffer until the completion that retires its
        // request and leaves it to the device until then; lkeys come from
        // registrations in this QP's PD, so the device refuses anything
        // outside them.
        unsafe { qp.post_send(wrs, &mut scratch) }.map_err(|e| PostFailure {
            posted: e.posted,
            error: ProviderError::Verbs(VerbsError::new(
                "ibv_post_send",
                e.errno,
                format!("chain of {}", wrs.len()),
            )),
        })
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, ProviderError> {
        Ok(self.cq.poll(out)?)
    }

    fn arm(&self) -> Result<(), ProviderError> {
        Ok(self.cq.req_notify()?)
    }

    fn wait(&self, timeout: Duration) -> Result<bool, ProviderError> {
        Ok(self.cq.wait_event(timeout)?)
    }

    fn wake(&self) {
        self.cq.wake();
    }
}
