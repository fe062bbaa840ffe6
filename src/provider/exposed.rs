//! Memory lent to a peer, and reachable by rcpd again only once revoked:
//! [`Exposed`] holds a server window's arena [`Block`] (file streams) or a
//! [`LeasedRange`] of a service's buffer (buffer operations) and, while
//! granted, its registrations in the session's domains, one per rail.
//!
//! [`Domain::register`]'s obligation (nothing else in rcpd writes the
//! bytes, nor reads them while the peer may write, until every
//! registration is dropped) is discharged here once, for both:
//! - the memory is its holder's: a block is owned, a lease makes its
//!   holder rcpd's only user of the range in the lease's way; a grant that
//!   lets the peer write needs it held alone ([`Exposable::exclusive`]),
//!   one that lets it read may share it with other readers;
//! - its bytes are reachable only through [`Exposed::revoke`], which drops
//!   every registration first (the `Exposed` holds the only references:
//!   it hands them out only as a borrow, for their keys), or
//!   [`Exposed::get`], which gives nothing while granted;
//! - the registrations drop before the memory when the `Exposed` does.

use std::fmt;
use std::sync::Arc;

use super::{Access, Bases, Domain, ProviderError, Registration};
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::mem::{Block, PeerSpan};

/// Memory that can be lent to a peer through an [`Exposed`].
pub trait Exposable: fmt::Debug {
    /// The span of the memory's first `len` bytes, if it can lend them.
    fn span_of(&self, len: usize) -> Option<PeerSpan>;
    /// Whether its holder is rcpd's only user of the bytes.
    fn exclusive(&self) -> bool;
    /// Its length in bytes.
    fn bytes(&self) -> usize;
}

impl Exposable for Block {
    fn span_of(&self, len: usize) -> Option<PeerSpan> {
        PeerSpan::new(self.arena(), self.addr(), len).filter(|_| len <= self.len())
    }
    fn exclusive(&self) -> bool {
        true
    }
    fn bytes(&self) -> usize {
        self.len()
    }
}

impl Exposable for LeasedRange {
    /// The whole range only (a grant lends a range whole).
    fn span_of(&self, len: usize) -> Option<PeerSpan> {
        (len == self.span().len()).then(|| self.span().clone())
    }
    fn exclusive(&self) -> bool {
        self.lease().kind() == LeaseKind::Exclusive
    }
    fn bytes(&self) -> usize {
        self.span().len()
    }
}

/// A service's whole exposure lent to one peer's session for as long as it
/// stands (a standing grant, docs/buffers.md): the owner trusts that peer
/// with it as with its own mapping. A service's buffer is memory rcpd
/// already treats as changing under it at any time (the service writes it
/// whenever it likes, src/mem/memfd.rs): rcpd reads such bytes only to
/// hash them (a byte changed meanwhile fails the check, it cannot mislead
/// rcpd) and writes them only through the device (a read's window, under
/// an exclusive lease), which the standing peer's writes can overlap only
/// as the owner's own writes can. So a standing grant takes no lease: the
/// owner's other operations and per-operation grants go on beside it, and
/// [`Domain::register`]'s obligation holds for this memory the way it
/// holds for a shared mapping the owner writes.
#[derive(Debug)]
pub struct Standing {
    span: PeerSpan,
}

impl Standing {
    /// The exposure's span (the buffer's arena in it keeps the mapping
    /// alive past every registration).
    pub fn new(span: PeerSpan) -> Standing {
        Standing { span }
    }
}

impl Exposable for Standing {
    fn span_of(&self, len: usize) -> Option<PeerSpan> {
        (len == self.span.len()).then(|| self.span.clone())
    }
    /// The owner lent the peer the right to write it (the type's docs).
    fn exclusive(&self) -> bool {
        true
    }
    fn bytes(&self) -> usize {
        self.span.len()
    }
}

/// Memory and, while granted, its registrations (module docs). Fields
/// drop in order: the registrations (revoking every key) before the
/// memory.
pub struct Exposed<M> {
    regs: Vec<Arc<dyn Registration>>,
    mem: M,
}

impl<M: Exposable> Exposed<M> {
    /// `mem`, granted to nobody yet.
    pub fn new(mem: M) -> Self {
        Exposed {
            regs: Vec::new(),
            mem,
        }
    }

    /// Revoke every grant (its keys fail from the peer's next request on)
    /// and hand out the memory.
    pub fn revoke(&mut self) -> &mut M {
        self.regs.clear();
        &mut self.mem
    }

    /// The memory, when nothing of it is granted.
    pub fn get(&self) -> Option<&M> {
        self.regs.is_empty().then_some(&self.mem)
    }

    /// Revoke what was granted before, then lend the first `len` bytes to
    /// the peer with `access` through each of `domains` (a memory window
    /// bound to the session's QP, or a registration in its PD, per rail):
    /// into the bases made once for `whole` (a service's exposure,
    /// [`Domain::register_in`]) when `within` names them. The
    /// registrations, in the order of `domains`. On an error nothing stays
    /// granted.
    pub fn grant<'d>(
        &mut self,
        domains: impl IntoIterator<Item = &'d dyn Domain>,
        len: usize,
        access: Access,
        within: Option<(&Bases, &PeerSpan)>,
    ) -> Result<&[Arc<dyn Registration>], ProviderError> {
        self.regs.clear();
        let span = self.mem.span_of(len).ok_or_else(|| {
            ProviderError::Protocol(format!("{len} bytes cannot be lent of {:?}", self.mem))
        })?;
        if access.remote_write() && !self.mem.exclusive() {
            return Err(ProviderError::Protocol(format!(
                "{:?} is shared: a peer may not write it",
                self.mem
            )));
        }
        for d in domains {
            // SAFETY: (module docs) the memory is this `Exposed`'s alone in
            // the way `access` needs (owned, or leased; exclusively when the
            // peer may write, checked above), and rcpd reaches its bytes only
            // through `revoke` (which drops every registration first) or
            // `get` (nothing while granted); the registrations are handed out
            // only as a borrow and drop before the memory.
            let r = match within {
                Some((bases, whole)) => unsafe { d.register_in(bases, whole, &span, access) },
                None => unsafe { d.register(&span, access) },
            };
            match r {
                Ok(r) => self.regs.push(r),
                Err(e) => {
                    self.regs.clear();
                    return Err(e);
                }
            }
        }
        Ok(&self.regs)
    }
}

impl<M: fmt::Debug> fmt::Debug for Exposed<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({} registrations)", self.mem, self.regs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::memfd::{LocalBuffer, ServiceBuffer};
    use crate::mem::{Arena, ArenaConfig};
    use crate::provider::tcp::TcpDomain;

    #[test]
    fn a_block_is_reachable_only_revoked() {
        let pool = Arena::new(&ArenaConfig::new(1 << 20))
            .unwrap()
            .into_pool(64 << 10)
            .unwrap();
        let d = TcpDomain::new();
        let mut x = Exposed::new(pool.take().unwrap());
        assert!(x.get().is_some());
        let regs = x
            .grant([&*d as &dyn Domain], 4096, Access::REMOTE_WRITE, None)
            .unwrap();
        assert_eq!(regs.len(), 1);
        assert!(x.get().is_none(), "nothing while granted");
        let e = x
            .grant(
                [&*d as &dyn Domain],
                (64 << 10) + 1,
                Access::REMOTE_WRITE,
                None,
            )
            .unwrap_err();
        assert!(e.to_string().contains("cannot be lent"), "{e}");
        assert!(x.get().is_some(), "a failed grant leaves nothing granted");
        x.grant([&*d as &dyn Domain], 4096, Access::REMOTE_READ, None)
            .unwrap();
        x.revoke().as_mut_slice()[0] = 1;
        assert!(x.get().is_some());
    }

    #[test]
    fn a_shared_range_is_lent_for_reading_only() {
        let svc = LocalBuffer::create(1 << 20).unwrap();
        let buf =
            ServiceBuffer::from_memfd(svc.fd().try_clone_to_owned().unwrap(), 1 << 20).unwrap();
        let d = TcpDomain::new();
        let shared = buf.lease(0, 8192, LeaseKind::Shared).unwrap().unwrap();
        let mut x = Exposed::new(shared);
        let e = x
            .grant([&*d as &dyn Domain], 8192, Access::REMOTE_WRITE, None)
            .unwrap_err();
        assert!(e.to_string().contains("shared"), "{e}");
        x.grant([&*d as &dyn Domain], 8192, Access::REMOTE_READ, None)
            .unwrap();
        let e = x
            .grant([&*d as &dyn Domain], 4096, Access::REMOTE_READ, None)
            .unwrap_err();
        assert!(
            e.to_string().contains("cannot be lent"),
            "a range lends whole: {e}"
        );
        let own = buf
            .lease(8192, 8192, LeaseKind::Exclusive)
            .unwrap()
            .unwrap();
        let mut y = Exposed::new(own);
        y.grant([&*d as &dyn Domain], 8192, Access::REMOTE_WRITE, None)
            .unwrap();
        assert!(y.get().is_none());
        drop(y);
        assert_eq!(buf.leases_live(), 1, "the shared one is still held");
    }
}
