//! The TCP provider's protection domain: a table of registrations keyed by
//! rkey (for peers) and lkey (for local segments of posted requests).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock, Weak};

use crate::mem::PeerSpan;
use crate::provider::{Access, Domain, ProviderError, ProviderKind, Registration};

/// One live registration, as the table holds it.
pub(crate) struct Entry {
    pub(crate) span: PeerSpan,
    pub(crate) access: Access,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

impl Entry {
    /// Offset of `[addr, addr+len)` inside the registration, if it lies inside.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.span.addr())?;
        let end = off.checked_add(len)?;
        (end <= self.span.len() as u64).then_some(off as usize)
    }
}

#[derive(Default)]
struct Tables {
    by_rkey: HashMap<u32, Arc<Entry>>,
    by_lkey: HashMap<u32, Arc<Entry>>,
}

/// Whoever takes the messages (two-sided SENDs, [`Op::Message`]) that
/// arrive on connections bound to a domain's session: the target calls it
/// on the connection's thread, in the connection's order, and sends back
/// what it returns. Ordered after every request the same connection
/// carried before it, as a SEND after WRITEs on an RC QP.
///
/// [`Op::Message`]: super::wire::Op::Message
pub trait Messages: Send + Sync {
    /// The answer to `payload`.
    fn message(&self, payload: &[u8]) -> Answer;
}

/// A message's answer: its bytes, and work the peer need not wait for,
/// run by the connection's thread once the answer is sent (or the
/// connection ends).
pub struct Answer {
    pub bytes: Vec<u8>,
    pub then: Option<Box<dyn FnOnce() + Send>>,
}

impl Answer {
    /// An answer with nothing to run after it.
    pub fn of(bytes: Vec<u8>) -> Answer {
        Answer { bytes, then: None }
    }
}

/// A registration table shared by a process's target and channels.
#[derive(Default)]
pub struct TcpDomain {
    tables: Arc<RwLock<Tables>>,
    messages: RwLock<Option<Arc<dyn Messages>>>,
}

impl fmt::Debug for TcpDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.tables.read().map(|t| t.by_rkey.len()).unwrap_or(0);
        f.debug_struct("TcpDomain")
            .field("registrations", &n)
            .finish()
    }
}

fn random_key(taken: &HashMap<u32, Arc<Entry>>) -> Result<u32, ProviderError> {
    loop {
        let mut b = [0u8; 4];
        getrandom::getrandom(&mut b).map_err(|e| ProviderError::Io {
            context: "drawing a random memory key".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let k = u32::from_ne_bytes(b);
        if k != 0 && !taken.contains_key(&k) {
            return Ok(k);
        }
    }
}

impl TcpDomain {
    pub fn new() -> Arc<TcpDomain> {
        Arc::new(TcpDomain::default())
    }

    /// Register `span` with `access`; the concrete type (the trait method
    /// returns it as `Arc<dyn Registration>`).
    ///
    /// # Safety
    ///
    /// As [`Domain::register`]: with a remote right, the peer's requests
    /// write or read the span until the registration (every clone) is
    /// dropped, and the caller keeps everything else off it until then.
    pub unsafe fn register_span(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<TcpRegistration>, ProviderError> {
        let mut t = self.tables.write().unwrap_or_else(|e| e.into_inner());
        let rkey = random_key(&t.by_rkey)?;
        let lkey = random_key(&t.by_lkey)?;
        let entry = Arc::new(Entry {
            span: span.clone(),
            access,
            lkey,
            rkey,
        });
        t.by_rkey.insert(rkey, entry.clone());
        t.by_lkey.insert(lkey, entry.clone());
        Ok(Arc::new(TcpRegistration {
            entry,
            tables: Arc::downgrade(&self.tables),
        }))
    }

    /// From now on `m` takes the messages of connections bound to this
    /// domain (until the domain goes).
    pub fn take_messages(&self, m: Arc<dyn Messages>) {
        *self.messages.write().unwrap_or_else(|e| e.into_inner()) = Some(m);
    }

    /// Who takes this domain's messages, if anyone.
    pub(crate) fn messages(&self) -> Option<Arc<dyn Messages>> {
        self.messages
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Number of live registrations.
    pub fn registrations(&self) -> usize {
        self.tables
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_rkey
            .len()
    }

    pub(crate) fn by_rkey(&self, rkey: u32) -> Option<Arc<Entry>> {
        let t = self.tables.read().unwrap_or_else(|e| e.into_inner());
        t.by_rkey.get(&rkey).cloned()
    }

    pub(crate) fn by_lkey(&self, lkey: u32) -> Option<Arc<Entry>> {
        let t = self.tables.read().unwrap_or_else(|e| e.into_inner());
        t.by_lkey.get(&lkey).cloned()
    }
}

impl Domain for TcpDomain {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Tcp
    }

    /// # Safety
    ///
    /// As [`Domain::register`].
    unsafe fn register(
        &self,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>, ProviderError> {
        // SAFETY: the caller's contract, passed on.
        Ok(unsafe { self.register_span(span, access) }?)
    }
}

/// A registration in a [`TcpDomain`]. Dropping it (the last clone of the
/// `Arc`) revokes its keys: later requests naming them fail with a remote
/// access error (rkey) or local protection error (lkey).
pub struct TcpRegistration {
    entry: Arc<Entry>,
    tables: Weak<RwLock<Tables>>,
}

impl fmt::Debug for TcpRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TcpReg({:#x}+{} lkey={:#x} rkey={:#x} {:?})",
            self.entry.span.addr(),
            self.entry.span.len(),
            self.entry.lkey,
            self.entry.rkey,
            self.entry.access
        )
    }
}

impl Registration for TcpRegistration {
    fn lkey(&self) -> u32 {
        self.entry.lkey
    }
    fn rkey(&self) -> u32 {
        self.entry.rkey
    }
    fn addr(&self) -> u64 {
        self.entry.span.addr()
    }
    fn len(&self) -> usize {
        self.entry.span.len()
    }
    fn access(&self) -> Access {
        self.entry.access
    }
}

impl Drop for TcpRegistration {
    fn drop(&mut self) {
        if let Some(tables) = self.tables.upgrade() {
            let mut t = tables.write().unwrap_or_else(|e| e.into_inner());
            t.by_rkey.remove(&self.entry.rkey);
            t.by_lkey.remove(&self.entry.lkey);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Arena, ArenaConfig};

    #[test]
    fn keys_are_unique_nonzero_and_revoked_on_drop() {
        let a = Arena::new(&ArenaConfig::new(2 << 20)).unwrap();
        let d = TcpDomain::new();
        let span = PeerSpan::new(&a, a.addr(), 8192).unwrap();
        // SAFETY: no peer is connected to the domain: nothing reaches the
        // span through these keys.
        let regs: Vec<_> = (0..64)
            .map(|_| unsafe { d.register(&span, Access::REMOTE_WRITE) }.unwrap())
            .collect();
        let mut rk: Vec<u32> = regs.iter().map(|r| r.rkey()).collect();
        rk.sort();
        rk.dedup();
        assert_eq!(rk.len(), 64);
        assert!(regs.iter().all(|r| r.rkey() != 0 && r.lkey() != 0));
        let (rkey, lkey) = (regs[0].rkey(), regs[0].lkey());
        assert!(d.by_rkey(rkey).is_some() && d.by_lkey(lkey).is_some());
        let clone = regs[0].clone();
        drop(regs);
        assert_eq!(d.registrations(), 1, "a live clone keeps its keys");
        drop(clone);
        assert!(d.by_rkey(rkey).is_none() && d.by_lkey(lkey).is_none());
        assert_eq!(d.registrations(), 0);
    }

    #[test]
    fn offsets_are_bounds_checked() {
        let a = Arena::new(&ArenaConfig::new(2 << 20)).unwrap();
        let d = TcpDomain::new();
        let span = PeerSpan::new(&a, a.addr() + 4096, 8192).unwrap();
        // SAFETY: no peer is connected to the domain.
        let r = unsafe { d.register_span(&span, Access::REMOTE_READ) }.unwrap();
        let e = d.by_rkey(r.rkey()).unwrap();
        assert_eq!(e.offset_of(a.addr() + 4096, 8192), Some(0));
        assert_eq!(e.offset_of(a.addr() + 8192, 4096), Some(4096));
        assert_eq!(e.offset_of(a.addr() + 8192, 4097), None);
        assert_eq!(e.offset_of(a.addr(), 1), None);
        assert_eq!(e.offset_of(u64::MAX, 2), None);
    }
}
