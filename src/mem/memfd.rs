//! A service's memory: a memfd handed to rcpd over its unix socket, checked,
//! mapped shared and held as an [`Arena`] (so every [`PeerSpan`](super::PeerSpan) and memory
//! registration of it keeps the mapping alive), and the [`RangeLeases`]
//! that give each range of it one user inside rcpd at a time.
//!
//! Why the checks (docs/buffers.md): an fd that is not a memfd may be a file
//! whose size changes under rcpd, and a memfd without `F_SEAL_SHRINK` may
//! be truncated by its service: either way rcpd's mapping would fault
//! (SIGBUS) on pages that are gone. A sealed memfd cannot shrink, so the
//! mapping stays backed for as long as rcpd holds it, whatever the service
//! does (it may even exit: the pages live until the last mapping goes).
//!
//! The service keeps its own mapping of the same pages and may write them
//! at any time; rcpd cannot stop it. What rcpd guarantees is about its own
//! users: the device (work requests, a peer's grant) and its own hashing
//! never reach a range at once in conflicting ways ([`RangeLeases`]).
//! Bytes a service writes during an operation on them fail the check.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use super::arena::{map_guarded, Arena, Backing, HUGE_PAGE};

/// `statfs.f_type` of hugetlbfs, where `MFD_HUGETLB` memfds live.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Why an fd was refused or could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MemfdError {
    #[error("fd {fd} is not a memfd ({what}); create the buffer with memfd_create(2)")]
    NotMemfd { fd: i32, what: String },
    #[error(
        "memfd {fd} is not sealed with F_SEAL_SHRINK (its seals: {seals:#x}): it could be \
         truncated under rcpd's mapping; add the seal with fcntl(F_ADD_SEALS, F_SEAL_SHRINK)"
    )]
    NotSealed { fd: i32, seals: i32 },
    #[error("buffer size {size} does not fit the memfd's {file} bytes")]
    TooLarge { size: u64, file: u64 },
    #[error("buffer size 0")]
    Empty,
    #[error("a MFD_HUGETLB memfd's buffer size must be a multiple of 2 MiB, not {size}")]
    HugeUnaligned { size: u64 },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
}

/// Check `fd` (a memfd sealed against shrinking, at least `size` bytes),
/// map its first `size` bytes shared and pre-faulted, and close it. The
/// returned arena's [`Backing`] is [`Backing::Memfd`].
pub fn map_memfd(fd: OwnedFd, size: u64) -> Result<Arena, MemfdError> {
    let raw = fd.as_raw_fd();
    let seals = match nix::fcntl::fcntl(raw, nix::fcntl::FcntlArg::F_GET_SEALS) {
        Ok(s) => s,
        Err(e) => {
            return Err(MemfdError::NotMemfd {
                fd: raw,
                what: format!("F_GET_SEALS: {e}"),
            })
        }
    };
    // tmpfs files answer F_GET_SEALS too (with F_SEAL_SEAL): the name tells
    // a memfd apart.
    let link = std::fs::read_link(format!("/proc/self/fd/{raw}"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !link.starts_with("/memfd:") {
        return Err(MemfdError::NotMemfd {
            fd: raw,
            what: format!("it is {link:?}"),
        });
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(MemfdError::NotSealed { fd: raw, seals });
    }
    if size == 0 {
        return Err(MemfdError::Empty);
    }
    let st = nix::sys::stat::fstat(raw).map_err(|e| MemfdError::Io {
        what: "fstat",
        source: e.into(),
    })?;
    let file = st.st_size as u64;
    if size > file {
        return Err(MemfdError::TooLarge { size, file });
    }
    let huge = nix::sys::statfs::fstatfs(fd.as_fd())
        .map(|s| s.filesystem_type().0 == HUGETLBFS_MAGIC)
        .unwrap_or(false);
    if huge && size % HUGE_PAGE as u64 != 0 {
        return Err(MemfdError::HugeUnaligned { size });
    }
    let len = usize::try_from(size).map_err(|_| MemfdError::TooLarge { size, file })?;
    // A shared mapping of `len` bytes of a file we hold, with the arena's
    // guard after it; the file cannot shrink below `len` (the seal was
    // checked above, and seals cannot be removed), so every page stays
    // backed while mapped.
    let p = map_guarded(len, libc::MAP_SHARED | libc::MAP_POPULATE, raw).map_err(|source| {
        MemfdError::Io {
            what: "mmap of the memfd",
            source,
        }
    })?;
    drop(fd);
    // SAFETY: `p` is what map_guarded returned for `len` just above; the
    // arena is its only holder in this process and unmaps it once.
    Ok(unsafe { Arena::adopt(p, len, Backing::Memfd { huge }) })
}

/// How a user of a range reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseKind {
    /// Reads only (a WRITE's source, a peer's READ, hashing): many at once.
    Shared,
    /// Bytes land in it (a READ's destination, a peer's WRITE): alone.
    Exclusive,
}

/// A range that another user holds in a conflicting way.
#[derive(Debug, thiserror::Error)]
#[error("range [{offset}, {end}) is busy: an operation in flight holds [{held_offset}, {held_end}) ({held:?})", end = offset + len, held_end = held_offset + held_len)]
pub struct Busy {
    pub offset: u64,
    pub len: u64,
    pub held_offset: u64,
    pub held_len: u64,
    pub held: LeaseKind,
}

#[derive(Default)]
struct Table {
    next: u64,
    live: Vec<(u64, u64, u64, LeaseKind)>,
}

/// The users of one buffer's ranges inside rcpd: a range held
/// [`LeaseKind::Exclusive`] has no other user; one held shared has only
/// shared ones. Leases are taken, never waited for: a conflicting one is
/// refused ([`Busy`]).
#[derive(Default)]
pub struct RangeLeases(Mutex<Table>);

impl fmt::Debug for RangeLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RangeLeases({} live)", self.0.lock().unwrap().live.len())
    }
}

impl RangeLeases {
    pub fn new() -> Arc<RangeLeases> {
        Arc::default()
    }

    /// Take `[offset, offset + len)` as `kind`, or say who holds it.
    pub fn take(self: &Arc<Self>, offset: u64, len: u64, kind: LeaseKind) -> Result<Lease, Busy> {
        let mut t = self.0.lock().unwrap();
        let end = offset.saturating_add(len);
        for &(_, o, l, k) in &t.live {
            let overlap = offset < o.saturating_add(l) && o < end;
            if overlap && (k == LeaseKind::Exclusive || kind == LeaseKind::Exclusive) {
                return Err(Busy {
                    offset,
                    len,
                    held_offset: o,
                    held_len: l,
                    held: k,
                });
            }
        }
        t.next += 1;
        let id = t.next;
        t.live.push((id, offset, len, kind));
        Ok(Lease {
            table: self.clone(),
            id,
            offset,
            len,
            kind,
        })
    }

    /// Leases held now.
    pub fn live(&self) -> usize {
        self.0.lock().unwrap().live.len()
    }
}

/// One user's hold on a range; dropping it lets the range go.
pub struct Lease {
    table: Arc<RangeLeases>,
    id: u64,
    offset: u64,
    len: u64,
    kind: LeaseKind,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Lease([{}, {}) {:?})",
            self.offset,
            self.offset + self.len,
            self.kind
        )
    }
}

impl Lease {
    pub fn offset(&self) -> u64 {
        self.offset
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn kind(&self) -> LeaseKind {
        self.kind
    }
    /// Whether this lease covers `[offset, offset + len)` of its buffer.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset
            && offset
                .checked_add(len)
                .is_some_and(|e| e <= self.offset + self.len)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.table.0.lock().unwrap().live.retain(|l| l.0 != self.id);
    }
}

/// A service's buffer as rcpd holds it: the mapping and the leases on its
/// ranges. Cheap to clone (shared).
#[derive(Clone)]
pub struct ServiceBuffer {
    arena: Arena,
    leases: Arc<RangeLeases>,
}

impl fmt::Debug for ServiceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ServiceBuffer({:#x}+{}, {:?})",
            self.arena.addr(),
            self.arena.len(),
            self.leases
        )
    }
}

impl ServiceBuffer {
    /// [`map_memfd`], with an empty lease table.
    pub fn from_memfd(fd: OwnedFd, size: u64) -> Result<ServiceBuffer, MemfdError> {
        Ok(ServiceBuffer::from_arena(map_memfd(fd, size)?))
    }

    /// Any arena as a buffer (tests, rcpd's own memory).
    pub fn from_arena(arena: Arena) -> ServiceBuffer {
        ServiceBuffer {
            arena,
            leases: RangeLeases::new(),
        }
    }

    pub fn addr(&self) -> u64 {
        self.arena.addr()
    }

    pub fn len(&self) -> u64 {
        self.arena.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.arena.is_empty()
    }

    pub fn huge(&self) -> bool {
        matches!(self.arena.backing(), Backing::Memfd { huge: true })
    }

    /// The whole buffer as a span (for registering it).
    pub fn span(&self) -> crate::mem::PeerSpan {
        crate::mem::PeerSpan::new(&self.arena, self.arena.addr(), self.arena.len())
            .expect("the arena is its own span")
    }

    /// `[offset, offset + len)` of the buffer as a span, if it lies inside.
    pub fn span_of(&self, offset: u64, len: u64) -> Option<crate::mem::PeerSpan> {
        crate::mem::PeerSpan::new(
            &self.arena,
            self.arena.addr().checked_add(offset)?,
            usize::try_from(len).ok()?,
        )
    }

    /// Leases held now.
    pub fn leases_live(&self) -> usize {
        self.leases.live()
    }

    /// Lease `[offset, offset + len)` as `kind`: `None` when the range is
    /// empty or reaches past the buffer, `Some(Err)` when it is busy.
    pub fn lease(
        &self,
        offset: u64,
        len: u64,
        kind: LeaseKind,
    ) -> Option<Result<LeasedRange, Busy>> {
        let end = offset.checked_add(len)?;
        if len == 0 || end > self.len() {
            return None;
        }
        let span = crate::mem::PeerSpan::new(
            &self.arena,
            self.arena.addr() + offset,
            usize::try_from(len).ok()?,
        )?;
        Some(
            self.leases
                .take(offset, len, kind)
                .map(|lease| LeasedRange { lease, span }),
        )
    }
}

/// A leased range with its span: whoever holds it is rcpd's only user of
/// the range in the lease's way, and the span keeps the bytes mapped.
pub struct LeasedRange {
    lease: Lease,
    span: crate::mem::PeerSpan,
}

impl fmt::Debug for LeasedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} at {:?}", self.lease, self.span)
    }
}

impl LeasedRange {
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
    pub fn span(&self) -> &crate::mem::PeerSpan {
        &self.span
    }
    /// The range's bytes as a shared slice (hashing). No device may be
    /// writing them: a range leased exclusively for bytes that land is
    /// read only between operations (after the grant was revoked, or after
    /// the data path reported its windows done).
    pub fn with<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        f(self.bytes())
    }

    /// The range's bytes as a shared slice borrowed from the range (to
    /// hash several ranges side by side), under the same rule as
    /// [`with`](Self::with).
    pub fn bytes(&self) -> &[u8] {
        self.span
            .slice(0, self.span.len())
            .expect("a lease's span covers itself")
    }

    /// The range's bytes as a mutable slice; `None` unless the lease is
    /// [`LeaseKind::Exclusive`] (no other user inside rcpd).
    ///
    /// # Safety
    ///
    /// No device reaches the range while `f` runs: no window posted from
    /// or into it is outstanding (the data path reported it done) and no
    /// grant's registration of it is live (revoked). The lease excludes
    /// every other user inside rcpd; the registrations are the caller's.
    pub unsafe fn with_mut<R>(&mut self, f: impl FnOnce(&mut [u8]) -> R) -> Option<R> {
        if self.lease.kind() != LeaseKind::Exclusive {
            return None;
        }
        // SAFETY: the lease is exclusive, so nothing else in rcpd reads or
        // writes the range (hashing, other operations and grants are
        // refused it), `&mut self` excludes this holder's own shared
        // borrows, and the caller vouches that no device reaches it.
        unsafe { self.span.with_mut(0, self.span.len(), f) }
    }
}

/// A service's own side of a buffer (the Rust client,
/// `control::buffers::client`): a memfd sealed against shrinking, mapped
/// shared here; rcpd maps the same pages. Bytes are copied in and out
/// (`write_at`, `read_at`), never lent as slices: rcpd's device may write
/// them at any time an operation runs.
pub struct LocalBuffer {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access copies through
// raw pointers, bounds checked, and no reference to it is handed out.
unsafe impl Send for LocalBuffer {}
// SAFETY: as above.
unsafe impl Sync for LocalBuffer {}

impl fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalBuffer({} bytes)", self.len)
    }
}

impl LocalBuffer {
    /// A new buffer of `len` bytes (normal pages), sealed with
    /// `F_SEAL_SHRINK`, mapped.
    pub fn create(len: u64) -> std::io::Result<LocalBuffer> {
        use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
        let io = |e: nix::Error| std::io::Error::from(e);
        let fd = memfd_create(
            c"rcp-buffer",
            MemFdCreateFlag::MFD_ALLOW_SEALING | MemFdCreateFlag::MFD_CLOEXEC,
        )
        .map_err(io)?;
        nix::unistd::ftruncate(&fd, len as i64).map_err(io)?;
        nix::fcntl::fcntl(
            fd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::F_SEAL_SHRINK),
        )
        .map_err(io)?;
        let n = usize::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a new shared mapping of a memfd we own that cannot shrink
        // (sealed above), at a kernel-chosen address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(LocalBuffer {
            fd,
            ptr: p.cast(),
            len: n,
        })
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to hand to rcpd.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn range(&self, off: u64, n: usize) -> Option<usize> {
        let o = usize::try_from(off).ok()?;
        (o.checked_add(n)? <= self.len).then_some(o)
    }

    /// Copy `data` in at `off`; false when it does not fit.
    pub fn write_at(&self, off: u64, data: &[u8]) -> bool {
        let Some(o) = self.range(off, data.len()) else {
            return false;
        };
        // SAFETY: [o, o + len) is inside the live mapping (checked); a copy
        // through raw pointers, no reference to the shared bytes is made.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(o), data.len()) };
        true
    }

    /// Copy `out.len()` bytes out from `off`; false when out of range.
    pub fn read_at(&self, off: u64, out: &mut [u8]) -> bool {
        let Some(o) = self.range(off, out.len()) else {
            return false;
        };
        // SAFETY: as in `write_at`, the other way.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(o), out.as_mut_ptr(), out.len()) };
        true
    }
}

impl Drop for LocalBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr/len are what mmap returned; nothing refers to them
        // (accesses copy and return).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn memfd(size: u64, seal: bool) -> OwnedFd {
        let fd = nix::sys::memfd::memfd_create(
            c"rcp-test",
            nix::sys::memfd::MemFdCreateFlag::MFD_ALLOW_SEALING
                | nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .unwrap();
        nix::unistd::ftruncate(&fd, size as i64).unwrap();
        if seal {
            nix::fcntl::fcntl(
                fd.as_raw_fd(),
                nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::F_SEAL_SHRINK),
            )
            .unwrap();
        }
        fd
    }

    #[test]
    fn a_sealed_memfd_maps_and_shares_its_pages() {
        let fd = memfd(1 << 20, true);
        let mut f = std::fs::File::from(fd.try_clone().unwrap());
        f.write_all(b"hello").unwrap();
        let a = map_memfd(fd, 1 << 20).unwrap();
        assert_eq!(a.len(), 1 << 20);
        assert_eq!(a.backing(), &Backing::Memfd { huge: false });
        let span = crate::mem::PeerSpan::new(&a, a.addr(), a.len()).unwrap();
        assert_eq!(span.with(0, 5, |s| s.to_vec()).unwrap(), b"hello");
        // Written through the service's side after mapping: rcpd sees it.
        use std::io::{Seek, SeekFrom};
        f.seek(SeekFrom::Start(100)).unwrap();
        f.write_all(b"late").unwrap();
        assert_eq!(span.with(100, 4, |s| s.to_vec()).unwrap(), b"late");
    }

    #[test]
    fn a_memfd_arena_has_its_guard_after_its_last_page() {
        // A size that is not a whole number of pages: the guard starts at
        // the end of the last page the mapping covers.
        for size in [1 << 20, 10_000] {
            let a = map_memfd(memfd(size, true), size).unwrap();
            assert_eq!(a.len() as u64, size);
            crate::mem::arena::assert_guarded(&a);
        }
    }

    #[test]
    fn an_unsealed_memfd_is_refused_naming_the_seal() {
        let e = map_memfd(memfd(4096, false), 4096).unwrap_err();
        assert!(matches!(e, MemfdError::NotSealed { .. }), "{e}");
        assert!(e.to_string().contains("F_SEAL_SHRINK"), "{e}");
    }

    #[test]
    fn a_file_that_is_not_a_memfd_is_refused() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(4096).unwrap();
        let e = map_memfd(OwnedFd::from(f), 4096).unwrap_err();
        assert!(matches!(e, MemfdError::NotMemfd { .. }), "{e}");
        // A pipe has no seals at all.
        let (r, _w) = nix::unistd::pipe().unwrap();
        let e = map_memfd(r, 4096).unwrap_err();
        assert!(matches!(e, MemfdError::NotMemfd { .. }), "{e}");
    }

    #[test]
    fn sizes_beyond_the_file_or_zero_are_refused() {
        let e = map_memfd(memfd(4096, true), 8192).unwrap_err();
        assert!(matches!(e, MemfdError::TooLarge { .. }), "{e}");
        let e = map_memfd(memfd(4096, true), 0).unwrap_err();
        assert!(matches!(e, MemfdError::Empty), "{e}");
    }

    #[test]
    fn leases_exclude_what_conflicts_and_release_on_drop() {
        let t = RangeLeases::new();
        let a = t.take(0, 100, LeaseKind::Shared).unwrap();
        let b = t.take(50, 100, LeaseKind::Shared).unwrap();
        let e = t.take(90, 20, LeaseKind::Exclusive).unwrap_err();
        assert_eq!((e.held_offset, e.held_len), (0, 100));
        let c = t.take(150, 10, LeaseKind::Exclusive).unwrap();
        assert!(t.take(159, 1, LeaseKind::Shared).is_err());
        assert!(t.take(160, 1, LeaseKind::Exclusive).is_ok());
        drop((a, b));
        assert!(t.take(0, 150, LeaseKind::Exclusive).is_ok());
        assert!(c.covers(150, 10) && !c.covers(149, 2));
        assert_eq!(t.live(), 1);
    }
}
