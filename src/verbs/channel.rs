//! The verbs provider: [`Domain`] over a PD, [`Channel`] over an RC QP.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cq::CompletionQueue;
use super::pd::{Access, MemoryRegion, ProtectionDomain};
use super::post::PostScratch;
use super::qp::{ConnectParams, QpEndpoint, QueuePair};
use super::VerbsError;
use crate::engine::{WorkCompletion, WorkRequest};
use crate::mem::PeerSpan;
use crate::provider::{
    Channel, ChannelCaps, Domain, PostFailure, ProviderError, ProviderKind, Registration,
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
    fn register(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        Ok(Arc::new(self.pd.register_span(span, access)?))
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
}
