//! Blocking work called from async code and from plain threads alike
//! (dropping a data path, a registration, closing files): [`in_place`].
//! Crate-level, below both the control plane and the data path, which call it.

/// Run blocking work from async code: on a worker of the multi-threaded
/// runtime without stalling it, inline elsewhere.
pub(crate) fn in_place<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}
