//! Providers: what the data path runs on, libfabric-style.
//!
//! A provider gives a [`Domain`] (memory registration with lkeys/rkeys and
//! access rights) and connected [`Channel`]s that post chains of one-sided
//! [`WorkRequest`]s with one doorbell and report [`WorkCompletion`]s. The
//! engine and the data path run unchanged on either provider:
//! - `verbs` ([`verbs`], over the RAII types of [`crate::verbs`]): RC
//!   queue pairs over libibverbs; a domain registers each span in a PD
//!   ([`verbs::VerbsDomain`]),
//!   or grants spans of memory registered once through type-2 memory
//!   windows bound to one QP ([`verbs::MwDomain`], rcpd where the
//!   device has them);
//! - `tcp` ([`tcp`]): one-sided WRITE/READ emulated over TCP for hosts
//!   without RDMA, with the same registration, bounds, rkey and access
//!   rules. Its registration stays per grant: an entry in the session's
//!   table, nothing pinned, so there is nothing to register once.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::engine::{WorkCompletion, WorkRequest};
use crate::mem::PeerSpan;
pub use crate::verbs::Access;
use crate::verbs::QpEndpoint;

pub mod exposed;
pub mod tcp;
pub mod verbs;

/// Which provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    Verbs,
    Tcp,
}

impl ProviderKind {
    /// `verbs` or `tcp`.
    pub fn name(self) -> &'static str {
        match self {
            ProviderKind::Verbs => "verbs",
            ProviderKind::Tcp => "tcp",
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a channel can do, from the device (verbs) or the implementation (tcp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelCaps {
    /// Send-queue depth granted: at most this many WRs outstanding.
    pub sq_depth: u32,
    /// Inline bytes granted (0: none).
    pub max_inline: u32,
    pub max_sge: u32,
}

/// A provider failure outside completions (setup, posting, polling).
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error(transparent)]
    Verbs(#[from] crate::verbs::VerbsError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Protocol(String),
    #[error("the channel is closed")]
    Closed,
}

/// `post` accepted the first `posted` requests of the chain and then failed.
#[derive(Debug, thiserror::Error)]
#[error("post failed after {posted} requests: {error}")]
pub struct PostFailure {
    pub posted: usize,
    pub error: ProviderError,
}

/// The address a peer uses to reach a channel, exchanged by the control plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Verbs(QpEndpoint),
    Tcp(std::net::SocketAddr),
}

/// A memory registration: keys plus what it covers.
pub trait Registration: Send + Sync + fmt::Debug {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn addr(&self) -> u64;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn access(&self) -> Access;
}

/// Memory registration (a protection domain), or access to memory
/// registered once (memory windows). Dropping a registration revokes its
/// rkey.
pub trait Domain: Send + Sync {
    fn kind(&self) -> ProviderKind;
    /// Whether a registration's rkey reaches exactly its span (true), or
    /// possibly more of the arena slot the span lies in (false: memory
    /// windows on a device that checks only the bounds of the region a
    /// window is bound into). Where false, whoever registers a span that
    /// does not fill its slot keeps the rest of the slot free of anything
    /// the peer may not see.
    fn exact_bounds(&self) -> bool {
        true
    }
    /// Register `span` with `access`: its lkey for local requests and,
    /// with a remote right in `access` (`REMOTE_WRITE`, `REMOTE_READ`), its
    /// rkey for the peer, until the registration is dropped.
    ///
    /// # Safety
    ///
    /// With a remote right, the span is lent to the peer: it may write
    /// (`REMOTE_WRITE`) or read (`REMOTE_READ`) the bytes at any time while
    /// the registration lives, and nothing here can see when. The caller
    /// guarantees that until the registration is dropped (every clone of
    /// the `Arc`: the last one revokes the rkey) nothing else writes the
    /// span, nor reads it when the peer may write it: no block or slice
    /// over it, no [`PeerSpan::with`]/[`PeerSpan::with_mut`] borrower, no
    /// request posted with it as a local segment. Without a remote right
    /// there is nothing to uphold: [`register_local`](Self::register_local)
    /// is the safe call for that.
    unsafe fn register(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError>;
    /// Register `span`, which lies inside `whole`, for one grant. A domain
    /// that binds grants into memory registered once (memory windows)
    /// registers `whole` once, keeps that in `bases` (which the caller
    /// holds as long as grants inside `whole` may be made) and binds the
    /// grant into it; the others register `span` alone, as
    /// [`Domain::register`] does.
    ///
    /// # Safety
    ///
    /// As [`Domain::register`]'s, for `span`; on a device that checks only
    /// the bounds of the region a window is bound into
    /// ([`Domain::exact_bounds`]), for all of `whole`.
    unsafe fn register_in(
        &self,
        bases: &Bases,
        whole: &PeerSpan,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        let _ = (bases, whole);
        // SAFETY: the caller's contract is register's.
        unsafe { self.register(span, access) }
    }

    /// Register `span` for local access only (the staging of requests this
    /// side posts): refused if `access` has a remote right.
    fn register_local(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        if access.remote() != Access::LOCAL_READ {
            return Err(ProviderError::Protocol(format!(
                "{span:?}: a local registration with remote rights {:?}",
                access.remote()
            )));
        }
        // SAFETY: no remote right: no peer can reach the span through this
        // registration (requests posted under its lkey are Channel::post's
        // contract).
        unsafe { self.register(span, access) }
    }
}

/// Registrations made once, into which later grants are made
/// ([`Domain::register_in`]): what they are is the domains' business (a
/// memory region per protection domain, for memory windows). Dropping
/// this drops the holder's references; a grant made into one keeps it.
#[derive(Default)]
pub struct Bases(Mutex<Vec<Arc<dyn Any + Send + Sync>>>);

impl Bases {
    /// The first kept base of type `T` that `fits`, or else the one `make`
    /// makes (kept from then on).
    pub fn find_or<T: Any + Send + Sync, E>(
        &self,
        fits: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Arc<T>, E> {
        let mut v = self.0.lock().unwrap();
        for b in v.iter() {
            if let Ok(t) = b.clone().downcast::<T>() {
                if fits(&t) {
                    return Ok(t);
                }
            }
        }
        let t = Arc::new(make()?);
        v.push(t.clone());
        Ok(t)
    }

    /// How many are kept.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connected channel. `post` is called from the posting thread, `poll`,
/// `arm` and `wait` from the completion thread.
pub trait Channel: Send + Sync {
    fn kind(&self) -> ProviderKind;
    fn caps(&self) -> ChannelCaps;
    /// Post the chain with one doorbell. The requests the provider accepted
    /// (all, or the `posted` prefix of a [`PostFailure`]) are executed and
    /// retired in order; each one is retired by its own completion or by a
    /// later signaled one of the same channel, or by the channel being
    /// reset or dropped.
    ///
    /// # Safety
    ///
    /// For every accepted request, `[local.addr, local.addr + local.len)`
    /// is memory registered with this channel's provider under
    /// `local.lkey`, stays mapped, and is lent to the device until the
    /// request is retired: the caller (and everyone else) neither writes it
    /// (WRITE: the device reads it, possibly after `post` returns) nor reads
    /// or writes it (READ: the device writes it) before then. The provider
    /// checks lkeys and bounds against its registrations, but it cannot see
    /// who else holds the bytes.
    unsafe fn post(&self, wrs: &[WorkRequest]) -> Result<(), PostFailure>;
    /// Take up to `out.len()` completions; returns how many.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, ProviderError>;
    /// Ask for an event on the next completion (then poll once more before
    /// waiting, to close the race).
    fn arm(&self) -> Result<(), ProviderError>;
    /// Block until an event, [`wake`](Self::wake) or `timeout`; true if an
    /// event came.
    fn wait(&self, timeout: Duration) -> Result<bool, ProviderError>;
    /// Make the `wait` blocked now, or else the next one, return at once:
    /// how a completion thread told to stop sees it without waiting out
    /// its slice (closing a session would otherwise cost up to a slice).
    fn wake(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_is_made_once_then_found_by_type_and_fit() {
        let b = Bases::default();
        let x = b.find_or(|v: &u32| *v == 7, || Ok::<_, ()>(7u32)).unwrap();
        // Found: `make` is not called again.
        let y = b.find_or(|v: &u32| *v == 7, || Err(())).unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        // One that does not fit, or of another type, is made and kept.
        assert_eq!(
            *b.find_or(|v: &u32| *v == 8, || Ok::<_, ()>(8u32)).unwrap(),
            8
        );
        assert_eq!(*b.find_or(|_: &u64| true, || Ok::<_, ()>(1u64)).unwrap(), 1);
        assert_eq!(b.len(), 3);
        // A failed make keeps nothing.
        assert!(b.find_or(|_: &i8| true, || Err::<i8, _>("no")).is_err());
        assert_eq!(b.len(), 3);
    }
}
