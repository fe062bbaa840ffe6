//! Completion queues and completion channels.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::*;

use super::device::Context;
use super::error::VerbsError;
use crate::engine::{WcStatus, WorkCompletion};

/// Completions taken per `ibv_poll_cq` call.
pub const POLL_BATCH: usize = 64;

/// A completion channel: the fd the CQ's events arrive on.
pub struct CompletionChannel {
    ch: *mut ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: the channel is only used through thread-safe libibverbs calls and
// its fd.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompletionChannel>, VerbsError> {
        // SAFETY: ctx is open and outlives the channel (Arc).
        let ch = unsafe { ibv_create_comp_channel(ctx.ctx) };
        if ch.is_null() {
            return Err(VerbsError::last(
                "ibv_create_comp_channel",
                ctx.name().to_string(),
            ));
        }
        Ok(Arc::new(CompletionChannel {
            ch,
            _ctx: ctx.clone(),
        }))
    }

    /// The fd that becomes readable when an armed CQ has a completion
    /// (usable with tokio's `AsyncFd` or poll(2)).
    pub fn fd(&self) -> RawFd {
        // SAFETY: ch is valid for self's lifetime.
        unsafe { (*self.ch).fd }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: CQs using the channel hold its Arc, so all are destroyed.
        unsafe {
            ibv_destroy_comp_channel(self.ch);
        }
    }
}

/// A completion queue, optionally tied to a completion channel.
pub struct CompletionQueue {
    pub(crate) cq: *mut ibv_cq,
    depth: u32,
    channel: Option<Arc<CompletionChannel>>,
    /// Events received but not yet acked (acked in batches).
    unacked: AtomicU32,
    /// An eventfd [`wake`](Self::wake) signals, polled beside the channel's
    /// fd by [`wait_event`](Self::wait_event) (with a channel only).
    waker: Option<OwnedFd>,
    ctx: Arc<Context>,
}

// SAFETY: ibv_poll_cq / ibv_req_notify_cq are thread-safe in libibverbs
// providers (they lock the CQ); the struct holds no Rust-side shared state
// other than an atomic.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

/// Events are acked once this many have accumulated (and at drop).
const ACK_BATCH: u32 = 16;

impl CompletionQueue {
    /// Create a CQ of at least `depth` entries (checked against the device's
    /// max_cqe).
    pub fn new(
        ctx: &Arc<Context>,
        depth: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>, VerbsError> {
        let max = ctx.caps().max_cqe;
        if depth == 0 || depth > max {
            return Err(VerbsError::new(
                "ibv_create_cq",
                libc::EINVAL,
                format!(
                    "CQ depth {depth} is outside 1..={max} (device max_cqe of {})",
                    ctx.name()
                ),
            ));
        }
        let waker = match channel {
            Some(_) => Some(new_eventfd().map_err(|e| {
                VerbsError::new("eventfd", e.raw_os_error().unwrap_or(0), "the CQ's waker")
            })?),
            None => None,
        };
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.ch);
        // SAFETY: ctx and (optional) channel outlive the CQ through their Arcs.
        let cq = unsafe { ibv_create_cq(ctx.ctx, depth as i32, std::ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(VerbsError::last(
                "ibv_create_cq",
                format!("{depth} entries on {}", ctx.name()),
            ));
        }
        // SAFETY: cq is valid; cqe is the depth actually granted (>= asked).
        let got = unsafe { (*cq).cqe }.max(0) as u32;
        Ok(Arc::new(CompletionQueue {
            cq,
            depth: got,
            channel: channel.cloned(),
            unacked: AtomicU32::new(0),
            waker,
            ctx: ctx.clone(),
        }))
    }

    /// Entries the CQ can hold.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.channel.as_ref()
    }

    /// Poll up to `out.len()` (at most [`POLL_BATCH`] per call) completions
    /// into `out`; returns how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let n = out.len().min(POLL_BATCH);
        // SAFETY: ibv_wc is plain old data; an all-zero value is valid, and
        // ibv_poll_cq writes at most `n` entries of the array.
        let mut wcs: [ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: cq is valid for self's lifetime; wcs has room for n entries.
        let got = unsafe { ibv_poll_cq(self.cq, n as i32, wcs.as_mut_ptr()) };
        if got < 0 {
            return Err(VerbsError::new(
                "ibv_poll_cq",
                libc::EIO,
                format!("on {}", self.ctx.name()),
            ));
        }
        for (dst, wc) in out.iter_mut().zip(wcs.iter().take(got as usize)) {
            *dst = WorkCompletion {
                wr_id: wc.wr_id,
                status: map_status(wc.status),
                byte_len: wc.byte_len,
            };
        }
        Ok(got as usize)
    }

    /// Arm the CQ: the channel fires on the next completion.
    pub fn req_notify(&self) -> Result<(), VerbsError> {
        // SAFETY: cq is valid.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(VerbsError::new("ibv_req_notify_cq", rc, ""));
        }
        Ok(())
    }

    /// Block until the channel delivers an event for this CQ,
    /// [`wake`](Self::wake) is called (now or since the last wait) or
    /// `timeout` passes. Returns whether an event came. Events are acked in batches.
    pub fn wait_event(&self, timeout: Duration) -> Result<bool, VerbsError> {
        let (Some(ch), Some(waker)) = (self.channel.as_ref(), self.waker.as_ref()) else {
            return Err(VerbsError::new(
                "ibv_get_cq_event",
                libc::EINVAL,
                "the CQ has no completion channel",
            ));
        };
        let (event, woken) = poll_two(ch.fd(), waker.as_raw_fd(), timeout)?;
        if woken {
            let mut count = 0u64;
            // SAFETY: the eventfd is open while self lives; an 8-byte read
            // into a local u64 resets its counter (non-blocking: at most
            // EAGAIN, if another wait took it first).
            let _ = unsafe { libc::read(waker.as_raw_fd(), (&raw mut count).cast(), 8) };
        }
        if !event {
            return Ok(false);
        }
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: the fd is readable, so ibv_get_cq_event does not block; the
        // out-pointers are valid locals.
        let rc = unsafe { ibv_get_cq_event(ch.ch, &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return Err(VerbsError::last("ibv_get_cq_event", ""));
        }
        if self.unacked.fetch_add(1, Ordering::AcqRel) + 1 >= ACK_BATCH {
            self.ack_pending();
        }
        Ok(true)
    }

    /// Make the [`wait_event`](Self::wait_event) blocked now, or else the
    /// next one, return at once. Without a channel nothing waits: a no-op.
    pub fn wake(&self) {
        if let Some(w) = &self.waker {
            let one = 1u64;
            // SAFETY: the eventfd is open while self lives; an 8-byte write
            // from a local u64 adds to its counter (non-blocking: a full
            // counter means a wake is pending anyway).
            let _ = unsafe { libc::write(w.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    }

    fn ack_pending(&self) {
        let n = self.unacked.swap(0, Ordering::AcqRel);
        if n > 0 {
            // SAFETY: n events were received for this CQ and not yet acked.
            unsafe { ibv_ack_cq_events(self.cq, n) };
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // Every event must be acked, or ibv_destroy_cq blocks forever.
        self.ack_pending();
        // SAFETY: QPs using this CQ hold its Arc, so none is left.
        unsafe {
            ibv_destroy_cq(self.cq);
        }
    }
}

/// A non-blocking, close-on-exec eventfd.
fn new_eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; a non-negative result is a new fd
    // that nothing else owns.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// poll(2) two fds for reading; (first readable, second readable). An
/// interrupted poll reports neither.
fn poll_two(a: RawFd, b: RawFd, timeout: Duration) -> Result<(bool, bool), VerbsError> {
    let pfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let mut fds = [pfd(a), pfd(b)];
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: two valid pollfds, borrowed for the call's duration.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok((false, false));
        }
        let errno = e.raw_os_error().unwrap_or(0);
        return Err(VerbsError::new("poll(comp_channel)", errno, ""));
    }
    let ready = |p: &libc::pollfd| p.revents & libc::POLLIN != 0;
    Ok((ready(&fds[0]), ready(&fds[1])))
}

/// `ibv_wc_status` to [`WcStatus`].
pub fn map_status(s: ibv_wc_status::Type) -> WcStatus {
    use ibv_wc_status::*;
    match s {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperation,
        IBV_WC_FATAL_ERR => WcStatus::Fatal,
        o => WcStatus::Other(o),
    }
}
