//! RC queue pairs: built by [`QpBuilder`] (the one place a QP and its CQ are
//! sized) into a [`PreparedQp`] in INIT, taken INIT -> RTR -> RTS by a
//! handshake with the peer's endpoint, and back to RESET (and up again) on
//! reconnect.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::cq::{CompletionChannel, CompletionQueue};
use super::device::{mtu_enum, DeviceCaps, PortState};
use super::error::{Hint, VerbsError};
use super::gid::Gid;
use super::pd::{Access, ProtectionDomain};
use super::post::PostScratch;
use crate::engine::{LocalSeg, OpKind, WcStatus, WorkCompletion, WorkRequest};

/// What the peer needs to reach this QP (exchanged over the control plane).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qpn: u32,
    /// Initial packet sequence number, random 24-bit, fresh every epoch.
    pub psn: u32,
    pub gid: Gid,
    pub lid: u16,
    /// The sender's active MTU in bytes; the path MTU is the min of both.
    pub mtu: u32,
}

/// Sizes asked for at creation ([`QpBuilder`] fills them); the device may
/// grant more.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpConfig {
    pub port: u8,
    pub gid_index: u32,
    pub sq_depth: u32,
    pub max_send_sge: u32,
    /// Inline bytes asked for (0 = none). What the device granted is in
    /// [`QueuePair::max_inline`].
    pub max_inline: u32,
    /// Remote access the QP accepts as a responder (least privilege: only
    /// what the transfer needs).
    pub remote_access: Access,
    /// Receives that may be posted (0: a QP that only takes one-sided
    /// requests and never posts one).
    pub rq_depth: u32,
}

/// Link parameters for RTR/RTS.
#[derive(Clone, Copy, Debug)]
pub struct ConnectParams {
    /// Outstanding RDMA READs / atomics this QP may issue (initiator depth).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs this QP accepts as a responder.
    pub max_dest_rd_atomic: u8,
    /// Local ACK timeout exponent: 4.096 us * 2^timeout.
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
}

impl Default for ConnectParams {
    fn default() -> Self {
        // timeout 14 (~67 ms) x retry 7: on hardware a dead link surfaces
        // as RETRY_EXC_ERR after about half a second, quick enough to
        // reconnect. Soft-RoCE (rxe) treats retry_cnt 7 as "retry forever"
        // (it never counts 7 down): there a dead link is retried until it
        // comes back and no error surfaces; a lower count makes it fail
        // (`RCP_QP_RETRY_CNT`, `DataPathConfig::qp_retry`).
        ConnectParams {
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// Where the QP is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

/// An RC queue pair. Holds its PD and CQs alive.
pub struct QueuePair {
    qp: *mut ibv_qp,
    pd: Arc<ProtectionDomain>,
    send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    cfg: QpConfig,
    granted_sq: u32,
    granted_inline: u32,
    granted_sge: u32,
    local: QpEndpoint,
    state: QpState,
    path_mtu: u32,
    /// Resets so far: a memory window bound before one is revoked by
    /// deallocating it, never by an invalidate the device may refuse.
    resets: u64,
}

// SAFETY: ibv_post_send and ibv_modify_qp are thread-safe in libibverbs;
// state changes take &mut self.
unsafe impl Send for QueuePair {}
// SAFETY: as above; the only &self entry that touches the QP is post_send,
// which libibverbs serializes per QP.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.local.qpn)
            .field("state", &self.state)
            .field("sq", &self.granted_sq)
            .field("inline", &self.granted_inline)
            .finish()
    }
}

/// A random 24-bit PSN.
pub fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    getrandom::getrandom(&mut b).expect("getrandom");
    u32::from_le_bytes(b) & 0x00ff_ffff
}

/// One RC queue pair to build (rust-ibverbs' `QueuePairBuilder` shape):
/// [`build`](Self::build) gives a [`PreparedQp`] in INIT with its local
/// endpoint, and [`PreparedQp::handshake`] with the peer's endpoint takes it
/// to RTS.
///
/// Each QP gets a completion queue of its own, sized here and nowhere else:
/// a send-queue entry yields at most one completion (every one of them when
/// an error flushes the queue), and so does each receive a QP built with
/// [`recv_depth`](Self::recv_depth) may post (the data path's QPs post
/// none), so the CQ has as many entries as the two queues, and all stay
/// within what the device reports (`max_qp_wr`, `max_cqe`;
/// [`sq_entries`]). The send-queue depth
/// the QP reports ([`QueuePair::sq_depth`], the data path's credits) never
/// exceeds the CQ's entries.
#[derive(Clone)]
pub struct QpBuilder {
    pd: Arc<ProtectionDomain>,
    port: u8,
    gid_index: u32,
    sq_depth: u32,
    max_inline: u32,
    remote_access: Access,
    events: bool,
    rq_depth: u32,
}

impl fmt::Debug for QpBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QpBuilder")
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("sq_depth", &self.sq_depth)
            .field("max_inline", &self.max_inline)
            .field("remote_access", &self.remote_access)
            .field("events", &self.events)
            .field("rq_depth", &self.rq_depth)
            .finish_non_exhaustive()
    }
}

impl QpBuilder {
    /// The send-queue depth asked for unless [`sq_depth`](Self::sq_depth)
    /// says otherwise.
    pub const DEFAULT_SQ_DEPTH: u32 = 256;

    /// A QP in `pd`, on `port`, addressed by GID `gid_index`: a send queue
    /// of [`DEFAULT_SQ_DEPTH`](Self::DEFAULT_SQ_DEPTH) entries, no inline
    /// data, no remote access, a CQ without a completion channel.
    pub fn new(pd: &Arc<ProtectionDomain>, port: u8, gid_index: u32) -> QpBuilder {
        QpBuilder {
            pd: pd.clone(),
            port,
            gid_index,
            sq_depth: Self::DEFAULT_SQ_DEPTH,
            max_inline: 0,
            remote_access: Access::LOCAL_READ,
            events: false,
            rq_depth: 0,
        }
    }

    /// Receive-queue entries, for a QP that takes SENDs into posted
    /// receives ([`QueuePair::post_recv`]); the CQ gets as many entries
    /// more. 0 (the default): a QP that only serves and issues one-sided
    /// requests.
    pub fn recv_depth(mut self, n: u32) -> QpBuilder {
        self.rq_depth = n;
        self
    }

    /// Send-queue entries asked for (the device's limits bound them).
    pub fn sq_depth(mut self, n: u32) -> QpBuilder {
        self.sq_depth = n;
        self
    }

    /// Inline bytes asked for (what the device granted is
    /// [`QueuePair::max_inline`]).
    pub fn max_inline(mut self, n: u32) -> QpBuilder {
        self.max_inline = n;
        self
    }

    /// Remote access the QP accepts as a responder (least privilege: only
    /// what the transfer needs).
    pub fn remote_access(mut self, a: Access) -> QpBuilder {
        self.remote_access = a;
        self
    }

    /// Give the CQ a completion channel, so a thread can sleep until
    /// completions arrive ([`CompletionQueue::wait_event`]).
    pub fn events(mut self, on: bool) -> QpBuilder {
        self.events = on;
        self
    }

    /// Create the CQ and the QP and take the QP to INIT.
    pub fn build(self) -> Result<PreparedQp, VerbsError> {
        let ctx = self.pd.context();
        let caps = ctx.caps();
        let sq = sq_entries(self.sq_depth, &caps);
        let rq = self.rq_depth.min(caps.max_qp_wr);
        let ch = if self.events {
            Some(CompletionChannel::new(ctx)?)
        } else {
            None
        };
        // A receive yields one completion too.
        let cq = CompletionQueue::new(ctx, (sq + rq).min(caps.max_cqe), ch.as_ref())?;
        let qp = QueuePair::new(
            &self.pd,
            &cq,
            &cq,
            QpConfig {
                port: self.port,
                gid_index: self.gid_index,
                sq_depth: sq,
                max_send_sge: 1,
                max_inline: self.max_inline,
                remote_access: self.remote_access,
                rq_depth: rq,
            },
        )?;
        Ok(PreparedQp { qp })
    }
}

/// The send-queue entries of a QP asked `asked` on a device with `caps`,
/// and so its CQ's: at least 1, at most `max_qp_wr` and `max_cqe`.
pub fn sq_entries(asked: u32, caps: &DeviceCaps) -> u32 {
    asked.min(caps.max_qp_wr).min(caps.max_cqe).max(1)
}

/// A queue pair in INIT with its local endpoint ([`QpBuilder::build`]),
/// waiting for the peer's.
#[derive(Debug)]
pub struct PreparedQp {
    pub(crate) qp: QueuePair,
}

impl PreparedQp {
    /// This side's endpoint for the peer.
    pub fn endpoint(&self) -> QpEndpoint {
        self.qp.endpoint()
    }

    /// Send-queue depth granted ([`QueuePair::sq_depth`]).
    pub fn sq_depth(&self) -> u32 {
        self.qp.sq_depth()
    }

    /// Inline bytes granted ([`QueuePair::max_inline`]).
    pub fn max_inline(&self) -> u32 {
        self.qp.max_inline()
    }

    /// INIT -> RTR -> RTS against the peer's `remote` endpoint.
    pub fn handshake(
        mut self,
        remote: &QpEndpoint,
        p: &ConnectParams,
    ) -> Result<QueuePair, VerbsError> {
        self.qp.handshake(remote, p)?;
        Ok(self.qp)
    }
}

impl QueuePair {
    /// Create an RC QP (in RESET) and take it to INIT, ready for a handshake.
    fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        cfg: QpConfig,
    ) -> Result<QueuePair, VerbsError> {
        let ctx = pd.context();
        let caps = ctx.caps();
        if cfg.sq_depth == 0 || cfg.sq_depth > caps.max_qp_wr {
            return Err(VerbsError::new(
                "ibv_create_qp",
                libc::EINVAL,
                format!(
                    "SQ depth {} outside 1..={} (max_qp_wr of {})",
                    cfg.sq_depth,
                    caps.max_qp_wr,
                    ctx.name()
                ),
            ));
        }
        if send_cq.depth() < cfg.sq_depth + cfg.rq_depth {
            return Err(VerbsError::new(
                "ibv_create_qp",
                libc::EINVAL,
                format!(
                    "CQ depth {} < SQ depth {} + RQ depth {}: a CQ overrun would move the QP to the \
                     error state",
                    send_cq.depth(),
                    cfg.sq_depth,
                    cfg.rq_depth
                ),
            ));
        }
        let port = ctx.port(cfg.port)?;
        let gid = super::device::query_gid(ctx, cfg.port, cfg.gid_index)?;
        // SAFETY: zeroed init attrs are valid; we set the fields that matter.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq;
        init.recv_cq = recv_cq.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0; // selective signaling
        init.cap.max_send_wr = cfg.sq_depth;
        // (At least one: some providers refuse a receive queue of none.)
        init.cap.max_recv_wr = cfg.rq_depth.max(1);
        init.cap.max_send_sge = cfg.max_send_sge.clamp(1, caps.max_sge.max(1));
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = cfg.max_inline;
        // SAFETY: pd and CQs are valid and outlive the QP (Arcs held).
        let qp = unsafe { ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(VerbsError::last(
                "ibv_create_qp",
                format!(
                    "RC QP sq={} inline={} on {}",
                    cfg.sq_depth,
                    cfg.max_inline,
                    ctx.name()
                ),
            ));
        }
        // SAFETY: qp is valid.
        let qpn = unsafe { (*qp).qp_num };
        let mut me = QueuePair {
            qp,
            pd: pd.clone(),
            send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            cfg,
            // Credits never exceed the CQ's entries (the device may grant
            // more send-queue entries than asked).
            granted_sq: init.cap.max_send_wr.min(send_cq.depth()),
            granted_inline: init.cap.max_inline_data,
            granted_sge: init.cap.max_send_sge,
            local: QpEndpoint {
                qpn,
                psn: random_psn(),
                gid,
                lid: port.lid,
                mtu: port.active_mtu,
            },
            state: QpState::Reset,
            path_mtu: port.active_mtu,
            resets: 0,
        };
        me.move_to_init()?;
        Ok(me)
    }

    /// This side's endpoint for the peer.
    pub fn endpoint(&self) -> QpEndpoint {
        self.local
    }

    pub fn state(&self) -> QpState {
        self.state
    }

    pub fn qpn(&self) -> u32 {
        self.local.qpn
    }

    /// Send-queue depth the device granted.
    pub fn sq_depth(&self) -> u32 {
        self.granted_sq
    }

    /// Inline bytes the device granted (may be 0 or more than asked).
    pub fn max_inline(&self) -> u32 {
        self.granted_inline
    }

    pub fn max_send_sge(&self) -> u32 {
        self.granted_sge
    }

    /// Path MTU after the handshake (min of both ends).
    pub fn path_mtu(&self) -> u32 {
        self.path_mtu
    }

    pub fn send_cq(&self) -> &Arc<CompletionQueue> {
        &self.send_cq
    }

    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    fn modify(
        &mut self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        call: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: qp is valid; attr is a fully initialized struct for `mask`.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            let mut e = VerbsError::new(
                call,
                rc,
                format!("QP {:#x} on {}", self.local.qpn, self.pd.context().name()),
            );
            if call == "ibv_modify_qp(RTR)" || call == "ibv_modify_qp(RTS)" {
                if let Ok(p) = self.pd.context().port(self.cfg.port) {
                    if p.state != PortState::Active {
                        e = e.with_hint(Hint::PortDown);
                    }
                }
            }
            self.state = QpState::Error;
            return Err(e);
        }
        Ok(())
    }

    fn move_to_init(&mut self) -> Result<(), VerbsError> {
        // SAFETY: zeroed attrs are valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.cfg.port;
        let ra = self.cfg.remote_access;
        let mut flags = 0u32;
        if ra.remote_write() {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if ra.remote_read() {
            flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        a.qp_access_flags = flags;
        use ibv_qp_attr_mask as M;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        self.state = QpState::Init;
        Ok(())
    }

    /// INIT -> RTR -> RTS against `remote`. Path MTU = min(local, remote).
    pub fn handshake(&mut self, remote: &QpEndpoint, p: &ConnectParams) -> Result<(), VerbsError> {
        if self.state != QpState::Init {
            return Err(VerbsError::new(
                "ibv_modify_qp(RTR)",
                libc::EINVAL,
                format!(
                    "QP {:#x} is {:?}, not INIT: reset it first",
                    self.local.qpn, self.state
                ),
            ));
        }
        let caps = self.pd.context().caps();
        let init_depth = p.max_rd_atomic.min(caps.max_qp_init_rd_atom.min(255) as u8);
        let resp_depth = p.max_dest_rd_atomic.min(caps.max_qp_rd_atom.min(255) as u8);
        self.path_mtu = self.local.mtu.min(remote.mtu);
        use ibv_qp_attr_mask as M;
        // SAFETY: zeroed attrs are valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(self.path_mtu);
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = resp_depth;
        a.min_rnr_timer = p.min_rnr_timer;
        a.ah_attr.is_global = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.cfg.port;
        a.ah_attr.grh.dgid.raw = remote.gid.0;
        a.ah_attr.grh.sgid_index = self.cfg.gid_index as u8;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.grh.flow_label = 0;
        a.ah_attr.grh.traffic_class = 0;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        self.state = QpState::Rtr;
        // SAFETY: zeroed attrs are valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = self.local.psn;
        a.timeout = p.timeout;
        a.retry_cnt = p.retry_cnt;
        a.rnr_retry = p.rnr_retry;
        a.max_rd_atomic = init_depth;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )?;
        self.state = QpState::Rts;
        tracing::debug!(
            qpn = self.local.qpn,
            peer = remote.qpn,
            mtu = self.path_mtu,
            init_depth,
            resp_depth,
            "QP in RTS"
        );
        Ok(())
    }

    /// Back to RESET and up to INIT with a fresh PSN and re-queried GID and
    /// port (the reconnect path). Outstanding WRs are gone after this: their
    /// completions were flushed (or are discarded with the reset).
    pub fn reset(&mut self) -> Result<QpEndpoint, VerbsError> {
        // SAFETY: zeroed attrs are valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RESET;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(RESET)",
        )?;
        self.state = QpState::Reset;
        self.resets += 1;
        let ctx = self.pd.context().clone();
        let port = ctx.port(self.cfg.port)?;
        self.local.gid = super::device::query_gid(&ctx, self.cfg.port, self.cfg.gid_index)?;
        self.local.lid = port.lid;
        self.local.mtu = port.active_mtu;
        self.local.psn = random_psn();
        self.move_to_init()?;
        Ok(self.local)
    }

    /// How many times the QP was reset ([`QueuePair::reset`]).
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// Post one signaled work request built by hand (a memory-window bind
    /// or a local invalidate, [`super::mw`]). Only in RTS: a request posted
    /// in another state is refused here, not queued.
    ///
    /// # Safety
    /// Every handle `wr` names (a memory window, the memory region of a
    /// bind) stays valid until the request completes, and the remote access
    /// a bind gives (to the span it names, for the peer of this QP) is the
    /// caller's to give: nothing else owns those bytes while the window is
    /// bound (as for a registration with remote access).
    pub(crate) unsafe fn post_one(&self, wr: &mut ibv_send_wr) -> Result<(), VerbsError> {
        if self.state != QpState::Rts {
            return Err(VerbsError::new(
                "ibv_post_send",
                libc::EINVAL,
                format!(
                    "QP {:#x} is {:?}, not RTS: nothing can be bound or invalidated on it",
                    self.local.qpn, self.state
                ),
            ));
        }
        wr.next = std::ptr::null_mut();
        wr.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp is valid; `wr` is one complete request (next is null)
        // that lives for the call; the handles it names are valid until its
        // completion (the caller's contract).
        let rc = unsafe { ibv_post_send(self.qp, wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::new(
                "ibv_post_send",
                rc,
                format!("opcode {} on QP {:#x}", wr.opcode, self.local.qpn),
            ));
        }
        Ok(())
    }

    /// Wait up to `timeout` for the completion of `wr_id` on the send CQ
    /// and return its status. Completions of other requests are dropped:
    /// use it only on a QP whose CQ nobody else polls (rcpd's, which only
    /// respond to their peer and post nothing but binds and invalidates).
    /// Spins for a few microseconds (what a local operation takes on
    /// hardware), then sleeps on the CQ's completion channel if it has one
    /// (on rxe a kernel worker runs the request: a spinning or yielding
    /// poller only keeps it waiting), else polls every 50 us.
    pub(crate) fn wait_send(&self, wr_id: u64, timeout: Duration) -> Result<WcStatus, VerbsError> {
        const SPIN: Duration = Duration::from_micros(20);
        let mut wc = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            byte_len: 0,
        }; 4];
        let t = Instant::now();
        let mut find = |cq: &CompletionQueue| -> Result<Option<WcStatus>, VerbsError> {
            let n = cq.poll(&mut wc)?;
            for c in &wc[..n] {
                if c.wr_id == wr_id {
                    return Ok(Some(c.status));
                }
                tracing::debug!(
                    wr_id = c.wr_id,
                    status = c.status.label(),
                    qpn = self.local.qpn,
                    "a stale completion dropped"
                );
            }
            Ok(None)
        };
        loop {
            if let Some(st) = find(&self.send_cq)? {
                return Ok(st);
            }
            let spent = t.elapsed();
            if spent >= timeout {
                return Err(VerbsError::new(
                    "ibv_poll_cq",
                    libc::ETIMEDOUT,
                    format!(
                        "waiting {timeout:?} for request {wr_id:#x} on QP {:#x}",
                        self.local.qpn
                    ),
                ));
            }
            if spent < SPIN {
                std::hint::spin_loop();
            } else if self.send_cq.channel().is_some() {
                // Arm, poll once more (a completion that came before the
                // arm raises no event), then sleep until one comes.
                self.send_cq.req_notify()?;
                if let Some(st) = find(&self.send_cq)? {
                    return Ok(st);
                }
                self.send_cq.wait_event(timeout - spent)?;
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Move to the error state (flushes every outstanding WR with
    /// WR_FLUSH_ERR completions).
    pub fn set_error(&mut self) -> Result<(), VerbsError> {
        // SAFETY: zeroed attrs are valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)")?;
        self.state = QpState::Error;
        Ok(())
    }

    /// Post `wrs` as one chain: one `ibv_post_send`, one doorbell.
    ///
    /// # Safety
    /// Every local segment must lie in memory registered under its lkey that
    /// the caller owns until the completion that retires the request (a
    /// signaled completion of it or of a later request on this QP, or a
    /// flush): the device reads it (WRITE) or writes it (READ) until then.
    /// Inline requests are copied during the call and may be reused at once.
    pub unsafe fn post_send(
        &self,
        wrs: &[WorkRequest],
        scratch: &mut PostScratch,
    ) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let head = scratch.build(wrs, |k| match k {
            OpKind::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            OpKind::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
        });
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: head is a valid chain of `wrs.len()` requests in scratch
        // (alive for the call); the caller guarantees the buffers.
        let rc = unsafe { ibv_post_send(self.qp, head, &mut bad) };
        if rc != 0 {
            let index = scratch.index_of(bad);
            return Err(PostError {
                errno: rc,
                index,
                posted: index.unwrap_or(0),
            });
        }
        Ok(())
    }
}

impl QueuePair {
    /// Post one receive of `seg` (a SEND from the peer lands there; its
    /// completion carries `wr_id` and the bytes that came).
    ///
    /// # Safety
    /// `seg` must lie in memory registered under its lkey with local write
    /// access, which the caller neither reads nor writes and keeps mapped
    /// from this call until the completion that retires the receive (its
    /// own, successful or flushed) or the QP's destruction or reset: the
    /// device writes the peer's message there at any time until then.
    pub unsafe fn post_recv(&self, wr_id: u64, seg: LocalSeg) -> Result<(), VerbsError> {
        let mut sge = ibv_sge {
            addr: seg.addr,
            length: seg.len,
            lkey: seg.lkey,
        };
        // SAFETY: ibv_recv_wr is plain old data; all-zero is a valid value.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid; wr and its SGE live for the call (the
        // device copies them); the caller guarantees the buffer.
        let rc = unsafe { ibv_post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::new(
                "ibv_post_recv",
                rc,
                format!("QP {:#x}", self.local.qpn),
            ));
        }
        Ok(())
    }

    /// Post one SEND of `seg`, signaled (its completion carries `wr_id`):
    /// the peer's next posted receive takes it.
    ///
    /// # Safety
    /// `seg` must lie in memory registered under its lkey, which the caller
    /// does not write and keeps mapped from this call until this SEND's
    /// completion (successful or flushed) or the QP's destruction or
    /// reset: the device reads it until then.
    pub unsafe fn post_message(&self, wr_id: u64, seg: LocalSeg) -> Result<(), VerbsError> {
        let mut sge = ibv_sge {
            addr: seg.addr,
            length: seg.len,
            lkey: seg.lkey,
        };
        // SAFETY: ibv_send_wr is plain old data; all-zero is a valid value.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid; wr and its SGE live for the call; the
        // caller guarantees the buffer.
        let rc = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::new(
                "ibv_post_send(SEND)",
                rc,
                format!("QP {:#x}", self.local.qpn),
            ));
        }
        Ok(())
    }

    /// The port the QP is on, and the index of the GID it is addressed by
    /// (another QP on the same path is built with these).
    pub fn path(&self) -> (u8, u32) {
        (self.cfg.port, self.cfg.gid_index)
    }
}

/// A failed `ibv_post_send`: requests before `index` were posted.
#[derive(Debug, thiserror::Error)]
#[error("ibv_post_send failed: {} (errno {errno}) at request {index:?}", std::io::Error::from_raw_os_error(*.errno))]
pub struct PostError {
    pub errno: i32,
    pub index: Option<usize>,
    pub posted: usize,
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP is destroyed once; memory its WRs named is kept by
        // the data path until their completions (or this reset) are seen.
        unsafe {
            ibv_destroy_qp(self.qp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_is_24_bit_and_varies() {
        let a: Vec<u32> = (0..16).map(|_| random_psn()).collect();
        assert!(a.iter().all(|&p| p < (1 << 24)));
        assert!(a.iter().any(|&p| p != a[0]));
    }

    #[test]
    fn the_send_queue_and_its_cq_stay_within_the_device() {
        let caps = |max_qp_wr, max_cqe| DeviceCaps {
            max_qp_wr,
            max_cqe,
            max_sge: 1,
            max_qp_rd_atom: 1,
            max_qp_init_rd_atom: 1,
            max_mr_size: 1 << 30,
            max_mw: 0,
            mem_windows: Default::default(),
            phys_port_cnt: 1,
        };
        assert_eq!(sq_entries(256, &caps(16384, 32767)), 256, "as asked");
        assert_eq!(sq_entries(256, &caps(128, 32767)), 128, "max_qp_wr");
        assert_eq!(sq_entries(256, &caps(16384, 100)), 100, "max_cqe");
        assert_eq!(sq_entries(0, &caps(16384, 32767)), 1, "at least one");
    }
}
