//! The verbs provider: [`Domain`] over a PD ([`VerbsDomain`]: a
//! registration per grant) or over memory windows bound to one QP
//! ([`MwDomain`]: the memory registered once), [`Channel`] over an RC QP.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::{
    Bases, Channel, ChannelCaps, Domain, PostFailure, ProviderError, ProviderKind, Registration,
};
use crate::engine::{WorkCompletion, WorkRequest};
use crate::mem::{Arena, PeerSpan};
use crate::verbs::cq::CompletionQueue;
use crate::verbs::messages::PreparedMessages;
use crate::verbs::mw::{inc_rkey, MemoryWindow, MwPool, MW_TIMEOUT};
use crate::verbs::pd::{Access, MemoryRegion, ProtectionDomain};
use crate::verbs::post::PostScratch;
use crate::verbs::qp::{ConnectParams, PreparedQp, QpEndpoint, QueuePair};
use crate::verbs::VerbsError;

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
    /// Bind a window of the pool over `span` of `mr` to the session's QP,
    /// or, while the QP cannot send (a rail cut whose reconnect has not
    /// succeeded yet), reserve the rkey the window's next bind gives it and
    /// bind it when the QP is connected again ([`VerbsChannel::reconnect`]).
    /// Until then the rkey reaches nothing: a request naming it fails on
    /// the peer's side, and lands nowhere.
    fn bind(
        &self,
        mr: &Arc<MemoryRegion>,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        let pending = Pending {
            mr: mr.clone(),
            addr: span.addr(),
            len: span.len(),
            access,
        };
        // SAFETY: the caller's contract (Domain::register) is
        // bind_or_defer's: the span is the caller's to lend until the
        // registration returned here, which revokes the window (bound or
        // not yet) when dropped, is dropped.
        let (cell, rkey) = unsafe { self.channel.bind_or_defer(&self.pool, pending) }?;
        Ok(Arc::new(WindowRegistration {
            cell,
            pool: self.pool.clone(),
            channel: self.channel.clone(),
            lkey: mr.lkey(),
            rkey,
            addr: span.addr(),
            len: span.len(),
            access: access.remote(),
        }))
    }
}

/// What a window to bind is to reach: `[addr, addr+len)` of `mr`, with
/// `access`'s remote rights.
struct Pending {
    mr: Arc<MemoryRegion>,
    addr: u64,
    len: usize,
    access: Access,
}

/// Where a granted window is.
enum WindowCell {
    /// Bound to the channel's QP.
    Bound(MemoryWindow),
    /// Granted while the QP could not send: its rkey (the window's next)
    /// is reserved, and the window is bound when the QP is connected again.
    Deferred(MemoryWindow, Pending),
    /// Revoked (the registration dropped), or its deferred bind failed and
    /// the window was deallocated.
    Gone,
}

type Cell = Arc<Mutex<WindowCell>>;

/// A granted span as a memory window: dropping it invalidates the window
/// on its QP (or, when that fails, deallocates it) before the window goes
/// back to the pool, so its rkey fails from then on; a window whose bind
/// was deferred and not done yet goes back unbound.
pub struct WindowRegistration {
    cell: Cell,
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
        // Taken out under the cell's lock (a deferred bind in progress
        // finishes first, and none starts after), then revoked without it.
        let taken = std::mem::replace(&mut *self.cell.lock().unwrap(), WindowCell::Gone);
        let mut mw = match taken {
            WindowCell::Gone => return,
            WindowCell::Deferred(mw, _) => return self.pool.put(mw),
            WindowCell::Bound(mw) => mw,
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
    /// Windows granted while the QP could not send, to bind at its next
    /// reconnect (those revoked meanwhile are `Gone` or dropped).
    deferred: Mutex<Vec<Weak<Mutex<WindowCell>>>>,
}

impl PreparedQp {
    /// The QP as a provider channel, still in INIT: for a driver that hands
    /// the channel out before the peer's endpoint arrives, and connects it
    /// with [`VerbsChannel::handshake`] when it does.
    pub fn into_channel(self) -> VerbsChannel {
        VerbsChannel::new(self.qp)
    }
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
            deferred: Mutex::new(Vec::new()),
        }
    }

    pub fn endpoint(&self) -> QpEndpoint {
        self.qp.lock().unwrap().endpoint()
    }

    /// A message QP for the same session ([`crate::verbs::messages`]): in
    /// this QP's protection domain, on its port and GID.
    pub fn prepare_messages(&self) -> Result<PreparedMessages, VerbsError> {
        let qp = self.qp.lock().unwrap();
        let (port, gid_index) = qp.path();
        PreparedMessages::new(qp.pd(), port, gid_index)
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
    /// is bound or posted in between), then bind the windows granted while
    /// it could not send, before anything else can use it; returns the new
    /// endpoint.
    pub fn reconnect(
        &self,
        remote: &QpEndpoint,
        p: &ConnectParams,
    ) -> Result<QpEndpoint, VerbsError> {
        let mut qp = self.qp.lock().unwrap();
        let ep = qp.reset()?;
        qp.handshake(remote, p)?;
        self.bind_deferred(&mut qp);
        Ok(ep)
    }

    /// Bind a window of `pool` to this channel's QP as `p` says, or, while
    /// the QP cannot send (not in RTS, or its bind just completed in
    /// error), reserve the rkey the window's next bind gives it and leave
    /// the bind to the next [`VerbsChannel::reconnect`]; the window's cell
    /// and its rkey. Only for a QP whose CQ no data path polls (rcpd's).
    ///
    /// # Safety
    ///
    /// As [`MemoryWindow::bind`], for as long as the returned cell holds a
    /// window (bound now or later): the span is lent to the peer until the
    /// cell is emptied ([`WindowRegistration`]'s drop).
    unsafe fn bind_or_defer(&self, pool: &MwPool, p: Pending) -> Result<(Cell, u32), VerbsError> {
        let mut qp = self.qp.lock().unwrap();
        let mut mw = pool.take()?;
        if qp.state() == crate::verbs::qp::QpState::Rts {
            // SAFETY: the caller's contract, passed on.
            match unsafe { mw.bind(&mut qp, &p.mr, p.addr, p.len, p.access, MW_TIMEOUT) } {
                Ok(rkey) => return Ok((Arc::new(Mutex::new(WindowCell::Bound(mw))), rkey)),
                Err(e) if e.errno == libc::EIO => {
                    // Completed in error: the QP is in the error state and
                    // takes a reconnect; this window is given up (dealt
                    // with by the pool) and a fresh one waits for it.
                    tracing::warn!(error = %e, "memory window bind failed; the grant's window is bound at the QP's reconnect");
                    if let Err(e) = qp.set_error() {
                        tracing::warn!(error = %e, "moving the QP to the error state");
                    }
                    pool.put(mw);
                    mw = pool.take()?;
                }
                Err(e) => {
                    pool.put(mw);
                    return Err(e);
                }
            }
        }
        let rkey = inc_rkey(mw.rkey());
        tracing::debug!(
            qpn = format_args!("{:#x}", qp.qpn()),
            rkey = format_args!("{rkey:#x}"),
            state = ?qp.state(),
            "memory window granted while its QP cannot send: bound when it reconnects"
        );
        let cell = Arc::new(Mutex::new(WindowCell::Deferred(mw, p)));
        let mut d = self.deferred.lock().unwrap();
        d.retain(|w| w.strong_count() > 0);
        d.push(Arc::downgrade(&cell));
        crate::verbs::counts::deferred();
        Ok((cell, rkey))
    }

    /// Bind every deferred window still granted, on `qp` (just connected):
    /// each under the rkey reserved for it. One whose bind fails is
    /// deallocated (its rkey reaches nothing: the peer's requests naming it
    /// fail, and land nowhere).
    fn bind_deferred(&self, qp: &mut QueuePair) {
        let cells: Vec<Cell> = self
            .deferred
            .lock()
            .unwrap()
            .drain(..)
            .filter_map(|w| w.upgrade())
            .collect();
        for cell in cells {
            let mut c = cell.lock().unwrap();
            let WindowCell::Deferred(mut mw, p) = std::mem::replace(&mut *c, WindowCell::Gone)
            else {
                continue;
            };
            let want = inc_rkey(mw.rkey());
            // SAFETY: the cell held a window, so the registration that owns
            // it is not dropped (its drop empties the cell under this lock
            // first): the span is still lent, as bind_or_defer's caller
            // promised, until then.
            match unsafe { mw.bind(qp, &p.mr, p.addr, p.len, p.access, MW_TIMEOUT) } {
                Ok(rkey) => {
                    debug_assert_eq!(rkey, want, "a deferred window's rkey is the one reserved");
                    *c = WindowCell::Bound(mw);
                }
                Err(e) => {
                    tracing::warn!(
                        rkey = format_args!("{want:#x}"),
                        error = %e,
                        "a deferred memory window could not be bound: deallocated, its rkey reaches nothing"
                    );
                    drop(mw);
                }
            }
        }
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
