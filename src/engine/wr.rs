//! Work requests and completions as plain data.
//!
//! These are the words the engine and the providers share: the engine decides
//! *what* to post (which block, which remote address, signaled or not), a
//! provider turns a slice of [`WorkRequest`] into one doorbell (`ibv_post_send`
//! with a `next` chain, or one TCP write) and reports [`WorkCompletion`]s.

/// Direction of a one-sided operation, seen from the side that posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// RDMA WRITE: local memory -> remote memory.
    Write,
    /// RDMA READ: remote memory -> local memory.
    Read,
}

/// A span of local registered memory (one SGE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSeg {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// Where the operation lands (or reads from) on the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSeg {
    pub addr: u64,
    pub rkey: u32,
}

/// One work request. `wr_id` is chosen by the engine and comes back in the
/// completion; the provider treats it as opaque.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    pub wr_id: u64,
    pub kind: OpKind,
    pub local: LocalSeg,
    pub remote: RemoteSeg,
    /// Ask for a completion entry (IBV_SEND_SIGNALED). Unsignaled requests are
    /// retired by the next signaled one on the same queue; an error is always
    /// reported, signaled or not.
    pub signaled: bool,
    /// Copy the payload into the WQE (IBV_SEND_INLINE). Only for writes whose
    /// length is within the channel's `max_inline`.
    pub inline: bool,
}

/// Status of a completion, mapped from `ibv_wc_status` (or the TCP provider's
/// equivalent). Everything but `Success` goes to the error path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    Success,
    /// IBV_WC_WR_FLUSH_ERR: the QP was in error when this request was reached.
    Flushed,
    /// IBV_WC_REM_ACCESS_ERR: bad rkey, out of bounds, or missing access right.
    RemoteAccess,
    /// IBV_WC_REM_INV_REQ_ERR.
    RemoteInvalidRequest,
    /// IBV_WC_REM_OP_ERR.
    RemoteOperation,
    /// IBV_WC_RETRY_EXC_ERR: the peer stopped answering (link loss).
    RetryExceeded,
    /// IBV_WC_RNR_RETRY_EXC_ERR.
    RnrRetryExceeded,
    /// IBV_WC_LOC_PROT_ERR: local lkey or bounds wrong.
    LocalProtection,
    /// IBV_WC_LOC_LEN_ERR.
    LocalLength,
    /// IBV_WC_LOC_QP_OP_ERR.
    LocalQpOperation,
    /// IBV_WC_FATAL_ERR or a provider-level failure (connection gone).
    Fatal,
    /// Any other `ibv_wc_status` value.
    Other(u32),
}

impl WcStatus {
    pub fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }

    /// Statuses that mean the connection is gone and the work may be retried
    /// on a reconnected queue pair (as opposed to a programming or
    /// authorization error, which a retry would only repeat).
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            WcStatus::Flushed
                | WcStatus::RetryExceeded
                | WcStatus::RnrRetryExceeded
                | WcStatus::Fatal
                | WcStatus::LocalQpOperation
        )
    }

    /// A short stable label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::Flushed => "wr_flush_err",
            WcStatus::RemoteAccess => "rem_access_err",
            WcStatus::RemoteInvalidRequest => "rem_inv_req_err",
            WcStatus::RemoteOperation => "rem_op_err",
            WcStatus::RetryExceeded => "retry_exc_err",
            WcStatus::RnrRetryExceeded => "rnr_retry_exc_err",
            WcStatus::LocalProtection => "loc_prot_err",
            WcStatus::LocalLength => "loc_len_err",
            WcStatus::LocalQpOperation => "loc_qp_op_err",
            WcStatus::Fatal => "fatal_err",
            WcStatus::Other(_) => "other",
        }
    }
}

/// One completion entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    /// Bytes moved (meaningful for successful reads).
    pub byte_len: u32,
}

/// Every non-success status, in a fixed order: the index of
/// [`WcStatus::error_index`] and of [`ErrorCounts`].
pub const ERROR_STATUSES: [WcStatus; 11] = [
    WcStatus::Flushed,
    WcStatus::RemoteAccess,
    WcStatus::RemoteInvalidRequest,
    WcStatus::RemoteOperation,
    WcStatus::RetryExceeded,
    WcStatus::RnrRetryExceeded,
    WcStatus::LocalProtection,
    WcStatus::LocalLength,
    WcStatus::LocalQpOperation,
    WcStatus::Fatal,
    WcStatus::Other(0),
];

impl WcStatus {
    /// Position in [`ERROR_STATUSES`] (every `Other(_)` shares the last);
    /// `None` for `Success`.
    pub fn error_index(self) -> Option<usize> {
        match self {
            WcStatus::Success => None,
            WcStatus::Other(_) => Some(ERROR_STATUSES.len() - 1),
            s => ERROR_STATUSES.iter().position(|&x| x == s),
        }
    }
}

/// Error completions counted by status, a fixed array (no allocation, cheap
/// to copy). Shown (`{:?}`) as the non-zero counts by label.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorCounts(pub [u64; ERROR_STATUSES.len()]);

impl std::fmt::Debug for ErrorCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl ErrorCounts {
    /// Count one completion with `status` (success is not counted).
    pub fn count(&mut self, status: WcStatus) {
        if let Some(i) = status.error_index() {
            self.0[i] += 1;
        }
    }

    /// How many completions had `status`.
    pub fn get(&self, status: WcStatus) -> u64 {
        status.error_index().map_or(0, |i| self.0[i])
    }

    /// Non-zero counts by [`WcStatus::label`], in [`ERROR_STATUSES`] order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        ERROR_STATUSES
            .iter()
            .zip(self.0)
            .filter(|&(_, n)| n > 0)
            .map(|(s, n)| (s.label(), n))
    }

    /// All error completions.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}
