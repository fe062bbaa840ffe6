//! What the process asked of the verbs layer that costs per call on a
//! device: memory registrations (`ibv_reg_mr`, pinning and a translation
//! table write, ~0.9 ms per 4 MiB on rxe) and memory window binds (one
//! work request on the QP). Counted once, here, where each call succeeds;
//! `/metrics` reads them (`rcp_verbs_registrations_total`,
//! `rcp_verbs_window_binds_total`, `rcp_verbs_window_binds_deferred_total`), so an operator sees whether a copy
//! registers memory per grant or only binds windows.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);
static WINDOW_BINDS: AtomicU64 = AtomicU64::new(0);
static BINDS_DEFERRED: AtomicU64 = AtomicU64::new(0);

/// The process's counts so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerbsCounts {
    /// Successful `ibv_reg_mr` calls.
    pub registrations: u64,
    /// Memory windows bound (the bind completed successfully).
    pub window_binds: u64,
    /// Grants whose window could not be bound at once (its QP was not
    /// ready to send: a rail cut and its reconnect not done yet), bound
    /// when the QP was connected again.
    pub binds_deferred: u64,
}

/// The process's counts so far.
pub fn counts() -> VerbsCounts {
    VerbsCounts {
        registrations: REGISTRATIONS.load(Relaxed),
        window_binds: WINDOW_BINDS.load(Relaxed),
        binds_deferred: BINDS_DEFERRED.load(Relaxed),
    }
}

pub(super) fn registered() {
    REGISTRATIONS.fetch_add(1, Relaxed);
}

pub(super) fn bound() {
    WINDOW_BINDS.fetch_add(1, Relaxed);
}

pub(crate) fn deferred() {
    BINDS_DEFERRED.fetch_add(1, Relaxed);
}
