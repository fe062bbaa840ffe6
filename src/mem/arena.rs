//! The registered-memory arena: one large mapping, huge pages when the host
//! has them, bound to the device's NUMA node, registered once and carved into
//! fixed blocks that are handed out by offset.
//!
//! Every arena is followed by a read-only guard page (`guard_len`) that is
//! never handed out nor registered: code that reads a few bytes past the
//! end of the slice it was given must not fault on the arena's last block.
//! Such code exists under emulation: QEMU TCG before 10.1 (upstream commit
//! feea87cd6b, "fix width of third operand of VINSERTx128") loads 32 bytes
//! for the 16-byte memory operand of `vinsertf128`, which blake3's AVX2
//! assembly (`blake3_hash_many_avx2`) uses on every block, so hashing a
//! block that ended at the end of an unguarded arena killed rcpd with
//! SIGSEGV in the soft-RoCE VM.

use std::fmt;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::numa;

/// 2 MiB, the huge page size the arena is built from.
pub const HUGE_PAGE: usize = 2 << 20;

/// How the arena's memory is backed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Anonymous `MAP_HUGETLB` 2 MiB pages.
    HugeTlb,
    /// A file on a hugetlbfs mount (Kubernetes `emptyDir: medium: HugePages`).
    HugeTlbFs(PathBuf),
    /// Normal pages with `MADV_HUGEPAGE` (no huge pages configured).
    Transparent,
    /// A service's memfd, mapped shared (`crate::mem::memfd`): the
    /// service maps the same pages.
    Memfd {
        /// The memfd is `MFD_HUGETLB`.
        huge: bool,
    },
}

/// How to build an arena.
#[derive(Clone, Debug)]
pub struct ArenaConfig {
    /// Bytes; rounded up to a whole number of huge pages.
    pub size: usize,
    /// Bind the memory to this NUMA node (the device's).
    pub numa_node: Option<u32>,
    /// A hugetlbfs mount to allocate from instead of anonymous huge pages.
    pub hugepage_dir: Option<PathBuf>,
    /// Fail instead of falling back to normal pages.
    pub require_huge: bool,
    /// Touch every page when mapping (true): registration then pins
    /// resident pages on the bound node, and the data path never faults.
    /// False: pages are faulted in on first use, so memory that a job does
    /// not reach is never zeroed (a tcp client's staging, whose
    /// registration pins nothing).
    pub prefault: bool,
}

impl ArenaConfig {
    pub fn new(size: usize) -> Self {
        ArenaConfig {
            size,
            numa_node: None,
            hugepage_dir: None,
            require_huge: false,
            prefault: true,
        }
    }
}

/// Errors building or carving an arena.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("arena size must be > 0")]
    Empty,
    #[error("mmap of {size} bytes for the arena failed: {source}")]
    Map { size: usize, source: std::io::Error },
    #[error(
        "no huge pages available for a {size}-byte arena ({source}); configure them with \
         `echo N > /proc/sys/vm/nr_hugepages` (N = MiB / 2) or the hugepages-2Mi resource"
    )]
    NoHugePages { size: usize, source: std::io::Error },
    #[error("hugetlbfs file in {dir}: {source}")]
    HugeTlbFs {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("block size {block} must be a power of two, >= 4096 and <= the arena size {arena}")]
    BadBlockSize { block: usize, arena: usize },
    #[error(transparent)]
    Memlock(#[from] super::memlock::MemlockError),
}

/// The mapping itself (with its guard page after it, see [`map_guarded`]).
/// Unmapped when the last holder (arena, block, memory registration) is
/// dropped.
pub(crate) struct Region {
    ptr: *mut u8,
    /// The arena's bytes; the guard after them is not part of it.
    len: usize,
    backing: Backing,
    numa_node: Option<u32>,
}

// SAFETY: the region is a plain mapping; ownership of its bytes is handed out
// as disjoint `Block`s (or to the device through registrations), never as
// shared `&mut`.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: ptr is what map_guarded returned for len, so
        // [ptr, ptr + mapped_len(len)) is the arena and its guard, ours
        // alone; every registration and block holds an Arc<Region>, so
        // nothing refers to it any more.
        unsafe {
            libc::munmap(self.ptr.cast(), mapped_len(self.len));
        }
    }
}

/// A registered-memory arena (cheap to clone: shared).
#[derive(Clone)]
pub struct Arena {
    region: Arc<Region>,
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("backing", &self.region.backing)
            .field("numa_node", &self.region.numa_node)
            .finish()
    }
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Arena {
    /// Map the arena. Huge pages first (hugetlbfs dir if given, else
    /// `MAP_HUGETLB`); without them, normal pages with `MADV_HUGEPAGE` and a
    /// warning that says how to configure huge pages. The memory is bound to
    /// `numa_node` before it is touched and then pre-faulted, so registration
    /// pins resident pages on the right node.
    pub fn new(cfg: &ArenaConfig) -> Result<Arena, ArenaError> {
        if cfg.size == 0 {
            return Err(ArenaError::Empty);
        }
        let size = round_up(cfg.size, HUGE_PAGE);
        super::memlock::ensure_lockable(size as u64)?;
        let (ptr, backing) = match &cfg.hugepage_dir {
            Some(dir) => (map_hugetlbfs(dir, size)?, Backing::HugeTlbFs(dir.clone())),
            None => match map_anon(size, true) {
                Ok(p) => (p, Backing::HugeTlb),
                Err(e) if cfg.require_huge => {
                    return Err(ArenaError::NoHugePages { size, source: e })
                }
                Err(e) => {
                    tracing::warn!(
                        size,
                        error = %e,
                        "no 2 MiB huge pages for the arena; using normal pages with MADV_HUGEPAGE. \
                         Configure huge pages: echo {} > /proc/sys/vm/nr_hugepages",
                        size / HUGE_PAGE
                    );
                    let p =
                        map_anon(size, false).map_err(|source| ArenaError::Map { size, source })?;
                    // SAFETY: advice on a mapping we just created; no effect on contents.
                    unsafe {
                        libc::madvise(p.cast(), size, libc::MADV_HUGEPAGE);
                    }
                    (p, Backing::Transparent)
                }
            },
        };
        let region = Region {
            ptr,
            len: size,
            backing,
            numa_node: cfg.numa_node,
        };
        if let Some(node) = cfg.numa_node {
            if let Err(e) = numa::bind_to_node(ptr, size, node) {
                tracing::warn!(node, error = %e, "could not bind the arena to the device's NUMA node");
            }
        }
        // Pre-fault every page now (on the bound node) instead of on the data path.
        if cfg.prefault {
            // SAFETY: [ptr, ptr+size) is our fresh writable mapping; nobody else has it yet.
            unsafe {
                std::ptr::write_bytes(ptr, 0, size);
            }
        }
        tracing::info!(size, backing = ?region.backing, numa_node = ?cfg.numa_node, "arena mapped");
        Ok(Arena {
            region: Arc::new(region),
        })
    }

    pub fn addr(&self) -> u64 {
        self.region.ptr as u64
    }

    pub fn len(&self) -> usize {
        self.region.len
    }

    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    pub fn backing(&self) -> &Backing {
        &self.region.backing
    }

    pub fn numa_node(&self) -> Option<u32> {
        self.region.numa_node
    }

    /// Carve the arena into blocks of `block` bytes (a power of two >= 4096).
    pub fn into_pool(self, block: usize) -> Result<BlockPool, ArenaError> {
        if !block.is_power_of_two() || block < 4096 || block > self.len() {
            return Err(ArenaError::BadBlockSize {
                block,
                arena: self.len(),
            });
        }
        let count = self.len() / block;
        let free = (0..count).rev().map(|i| i * block).collect();
        Ok(BlockPool {
            inner: Arc::new(PoolInner {
                arena: self,
                block,
                count,
                free: Mutex::new(free),
            }),
        })
    }

    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// An arena over a mapping made elsewhere in this module tree (a
    /// service's memfd) with [`map_guarded`], unmapped (guard included)
    /// when the last holder goes.
    ///
    /// # Safety
    ///
    /// `ptr` is what `map_guarded(len, ..)` returned: `[ptr, ptr + len)` is
    /// a live mapping, readable and writable, followed by its guard; nothing
    /// else unmaps either, and no Rust reference to their bytes exists.
    pub(crate) unsafe fn adopt(ptr: *mut u8, len: usize, backing: Backing) -> Arena {
        Arena {
            region: Arc::new(Region {
                ptr,
                len,
                backing,
                numa_node: None,
            }),
        }
    }
}

/// Bytes of the guard after every arena: one page of the (shared, read-only)
/// zero page, so it costs no memory.
pub(crate) fn guard_len() -> usize {
    page_size()
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096)
}

/// Bytes that [`map_guarded`] maps for a `size`-byte arena: its pages, then
/// the guard (which starts at `guard_start(size)` from the arena's start).
fn mapped_len(size: usize) -> usize {
    guard_start(size) + guard_len()
}

/// Where the guard starts, from the arena's start: the end of its last
/// page (the arena's end, but for a memfd of a size that is not a whole
/// number of pages).
pub(crate) fn guard_start(size: usize) -> usize {
    round_up(size, page_size())
}

/// Map `size` bytes read-write at a `HUGE_PAGE`-aligned address with
/// `flags` and `fd` (-1 for anonymous memory), followed by [`guard_len`]
/// bytes of read-only zero page that nothing else maps. The guard is why:
/// a read a few bytes past the last block (see the module doc) finds
/// readable memory instead of whatever the kernel put after the arena, or
/// nothing. Unmap [`mapped_len`] bytes from the returned address.
///
/// Other threads map and unmap meanwhile (thread stacks, allocator
/// arenas), so this never maps over, nor unmaps, a range it does not hold
/// at that moment. A failed `MAP_FIXED` may leave a hole where it was
/// asked to map (Linux 6.12+ does for a file mapping such as `MAP_HUGETLB`
/// without huge pages), and a clean-up that unmapped that range then took
/// another thread's stack with it. Hence: the arena's part of the
/// reservation is given back first and mapped with `MAP_FIXED_NOREPLACE`,
/// which fails rather than replace what another thread put there meanwhile
/// (then the attempt is made again elsewhere); after a failure only the
/// guard part, still ours, is unmapped.
pub(crate) fn map_guarded(
    size: usize,
    flags: libc::c_int,
    fd: libc::c_int,
) -> std::io::Result<*mut u8> {
    const ATTEMPTS: usize = 8;
    for _ in 0..ATTEMPTS {
        match map_guarded_once(size, flags, fd) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            other => return other,
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!(
            "{ATTEMPTS} tries to map {size} bytes each found the address taken by another thread"
        ),
    ))
}

/// One try of [`map_guarded`]: `EEXIST` when another thread mapped into the
/// gap before we did.
fn map_guarded_once(size: usize, flags: libc::c_int, fd: libc::c_int) -> std::io::Result<*mut u8> {
    let total = mapped_len(size);
    let pages = guard_start(size);
    // Reserve the arena, its guard and room to align the arena: read-only
    // private anonymous memory, backed by nothing until read (the zero page).
    let slack = total + HUGE_PAGE;
    // SAFETY: a new mapping at an address the kernel chooses.
    let resv = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            slack,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if resv == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let resv = resv as usize;
    let base = round_up(resv, HUGE_PAGE);
    // SAFETY: the three ranges are the parts of our reservation before the
    // aligned arena, after its guard, and the arena's own pages (given back
    // so that the arena can be mapped without MAP_FIXED replacing anything);
    // nothing else uses them. What stays ours is the guard.
    unsafe {
        if base > resv {
            libc::munmap(resv as *mut libc::c_void, base - resv);
        }
        let end = resv + slack;
        if end > base + total {
            libc::munmap((base + total) as *mut libc::c_void, end - (base + total));
        }
        libc::munmap(base as *mut libc::c_void, pages);
    }
    // SAFETY: NOREPLACE maps at `base` only if nothing is mapped in
    // [base, base + size) now: it never replaces another thread's mapping.
    let p = unsafe {
        libc::mmap(
            base as *mut libc::c_void,
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            flags | libc::MAP_FIXED_NOREPLACE,
            fd,
            0,
        )
    };
    if p as usize == base {
        return Ok(base as *mut u8);
    }
    let e = if p == libc::MAP_FAILED {
        std::io::Error::last_os_error()
    } else {
        // A kernel before 4.17 takes NOREPLACE as a hint and mapped
        // elsewhere: that mapping is ours, give it back and try again.
        // SAFETY: `p` is the mapping just made, of `size` bytes, unused.
        unsafe {
            libc::munmap(p, size);
        }
        std::io::Error::from_raw_os_error(libc::EEXIST)
    };
    // SAFETY: the guard part of the reservation is still ours alone; the
    // arena's part was given back above and is not touched.
    unsafe {
        libc::munmap((base + pages) as *mut libc::c_void, guard_len());
    }
    Err(e)
}

fn map_anon(size: usize, huge: bool) -> std::io::Result<*mut u8> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        flags |= libc::MAP_HUGETLB; // default huge page size: 2 MiB on x86-64
    }
    map_guarded(size, flags, -1)
}

fn map_hugetlbfs(dir: &Path, size: usize) -> Result<*mut u8, ArenaError> {
    let err = |source| ArenaError::HugeTlbFs {
        dir: dir.to_path_buf(),
        source,
    };
    // An unnamed file: the mapping keeps the pages, nothing is left behind.
    let file = tempfile_in(dir).map_err(err)?;
    file.set_len(size as u64).map_err(err)?;
    map_guarded(size, libc::MAP_SHARED, file.as_raw_fd()).map_err(err)
}

fn tempfile_in(dir: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir)
}

struct PoolInner {
    arena: Arena,
    block: usize,
    count: usize,
    free: Mutex<Vec<usize>>,
}

/// Fixed-size blocks of an arena, handed out by offset. A [`Block`] goes
/// back to the pool when dropped.
#[derive(Clone)]
pub struct BlockPool {
    inner: Arc<PoolInner>,
}

impl BlockPool {
    pub fn block_size(&self) -> usize {
        self.inner.block
    }

    pub fn capacity(&self) -> usize {
        self.inner.count
    }

    pub fn available(&self) -> usize {
        self.inner.free.lock().unwrap().len()
    }

    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// Take a free block, or `None` when all are in use.
    pub fn take(&self) -> Option<Block> {
        let off = self.inner.free.lock().unwrap().pop()?;
        Some(Block {
            pool: self.inner.clone(),
            offset: off,
            len: self.inner.block,
        })
    }
}

/// One block of arena memory, owned exclusively by its holder: the only way
/// to reach its bytes from safe code. While a work request that names this
/// block is in flight, the holder must not touch the bytes (the device owns
/// them until the completion that retires the request); the data path keeps
/// blocks in its slot table for exactly that span.
pub struct Block {
    pool: Arc<PoolInner>,
    offset: usize,
    len: usize,
}

impl fmt::Debug for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Block({:#x}+{})", self.addr(), self.len)
    }
}

impl Block {
    /// Virtual address of the first byte (what goes into an SGE).
    pub fn addr(&self) -> u64 {
        self.pool.arena.addr() + self.offset as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset inside the arena.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [offset, offset+len) lies inside the live region (held by the
        // pool's Arc) and belongs to this block alone.
        unsafe { std::slice::from_raw_parts(self.pool.arena.region.ptr.add(self.offset), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; &mut self makes this the only reference.
        unsafe {
            std::slice::from_raw_parts_mut(self.pool.arena.region.ptr.add(self.offset), self.len)
        }
    }

    /// The arena this block belongs to.
    pub fn arena(&self) -> &Arena {
        &self.pool.arena
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Ok(mut free) = self.pool.free.lock() {
            free.push(self.offset);
        }
    }
}

/// A span of arena memory that a peer may access through a registration
/// (an RDMA window, or the TCP provider's emulation of one). Accesses are
/// bounds-checked.
///
/// A `PeerSpan` is `Clone`, and clones (and other spans over the same
/// arena) alias: the same bytes are reachable from several handles, and a
/// device or a peer may write them at any time while a request or a grant
/// names them. Shared access ([`with`](Self::with),
/// [`with_many`](Self::with_many)) is safe; writing through
/// [`with_mut`](Self::with_mut) is `unsafe`, and its contract covers every
/// alias: whoever calls it guarantees that nobody else (no request in
/// flight, no peer holding a grant, no other borrower through any span)
/// touches the range meanwhile. Likewise `Channel::post` is `unsafe` and
/// obliges its caller to leave a posted request's bytes alone until it is
/// retired. With both obligations met, a shared slice is never written
/// under it.
#[derive(Clone)]
pub struct PeerSpan {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl fmt::Debug for PeerSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerSpan({:#x}+{})", self.addr(), self.len)
    }
}

impl PeerSpan {
    /// The span of `arena` covering `[addr, addr+len)`, if it lies inside.
    pub fn new(arena: &Arena, addr: u64, len: usize) -> Option<PeerSpan> {
        let off = addr.checked_sub(arena.addr())? as usize;
        if off.checked_add(len)? > arena.len() {
            return None;
        }
        Some(PeerSpan {
            region: arena.region.clone(),
            offset: off,
            len,
        })
    }

    pub fn addr(&self) -> u64 {
        self.region.ptr as u64 + self.offset as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, at: usize, n: usize) -> Option<usize> {
        let end = at.checked_add(n)?;
        (end <= self.len).then_some(self.offset + at)
    }

    /// Run `f` over `[at, at+n)` of the span as a mutable slice (e.g. to
    /// `read_exact` a socket straight into registered memory). `None` when
    /// the range is out of bounds.
    ///
    /// # Safety
    ///
    /// While `f` runs, nothing else reads or writes `[at, at+n)`: no work
    /// request in flight names it (neither as a local segment nor, through
    /// a grant, as a remote one), and no other borrower reaches it through
    /// this span, a clone of it, or any other span or block of the arena.
    /// The arena cannot see DMA or the peers' grants, so the caller (who
    /// owns the protocol) vouches for it.
    pub unsafe fn with_mut<R>(
        &self,
        at: usize,
        n: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Option<R> {
        let o = self.check(at, n)?;
        // SAFETY: bounds checked against the live region (Arc held); the
        // caller guarantees (this function's contract) that no other
        // reference to, and no device access of, these bytes exists while
        // `f` runs.
        let s = unsafe { std::slice::from_raw_parts_mut(self.region.ptr.add(o), n) };
        Some(f(s))
    }

    /// Run `f` over `[at, at+n)` as a shared slice.
    pub fn with<R>(&self, at: usize, n: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let o = self.check(at, n)?;
        // SAFETY: bounds checked against the live region (Arc held); shared
        // access only, and any writer of these bytes (with_mut, a posted
        // READ, a peer's granted WRITE) is bound by an unsafe contract to
        // exclude this read.
        let s = unsafe { std::slice::from_raw_parts(self.region.ptr.add(o), n) };
        Some(f(s))
    }

    /// `[at, at+n)` of the span as a shared slice borrowed from it (to
    /// gather several ranges into one `writev`); `None` when out of bounds.
    pub fn slice(&self, at: usize, n: usize) -> Option<&[u8]> {
        let o = self.check(at, n)?;
        // SAFETY: as in `with`: bounds checked against the live region,
        // which the borrowed `self` keeps alive (Arc) as long as the slice;
        // shared access only, and any writer of these bytes is bound by an
        // unsafe contract to exclude this read.
        Some(unsafe { std::slice::from_raw_parts(self.region.ptr.add(o), n) })
    }

    /// Run `f` over several ranges `(at, n)` of the span at once, as shared
    /// slices in the order given (e.g. to hash a chain's blocks on several
    /// threads). `None` when any range is out of bounds.
    pub fn with_many<R>(
        &self,
        ranges: &[(usize, usize)],
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        let offs = ranges
            .iter()
            .map(|&(at, n)| self.check(at, n).map(|o| (o, n)))
            .collect::<Option<Vec<_>>>()?;
        let slices: Vec<&[u8]> = offs
            .iter()
            // SAFETY: as in `with`: every range is bounds-checked against the
            // live region (Arc held for the call); shared access only, and
            // the slices do not outlive `f`.
            .map(|&(o, n)| unsafe { std::slice::from_raw_parts(self.region.ptr.add(o), n) })
            .collect();
        Some(f(&slices))
    }

    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl Region {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Check that `a` has its guard: [`guard_len`] bytes right after its last
/// page, mapped read-only (`/proc/self/maps`), readable (all zero), and
/// outside everything that hands the arena out (what
/// `ProtectionDomain::register_arena` registers, spans, blocks).
#[cfg(test)]
pub(crate) fn assert_guarded(a: &Arena) {
    let start = a.addr() as usize + guard_start(a.len());
    let end = start + guard_len();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let perms = maps.lines().find_map(|l| {
        let (range, rest) = l.split_once(' ')?;
        let (lo, hi) = range.split_once('-')?;
        let lo = usize::from_str_radix(lo, 16).ok()?;
        let hi = usize::from_str_radix(hi, 16).ok()?;
        (lo <= start && end <= hi).then(|| rest.split(' ').next().unwrap_or("").to_owned())
    });
    assert_eq!(
        perms.as_deref(),
        Some("r--p"),
        "guard [{start:#x}, {end:#x}) of {a:?} in /proc/self/maps:\n{maps}"
    );
    // SAFETY: [start, end) is mapped readable (checked just above) and is
    // this arena's guard, which the arena keeps mapped and nothing writes;
    // bytes are read through a raw pointer, no reference is made.
    let nonzero = (start..end)
        .filter(|&p| unsafe { std::ptr::read_volatile(p as *const u8) } != 0)
        .count();
    assert_eq!(nonzero, 0, "the guard reads as zeros");
    assert_eq!(a.region().len(), a.len(), "registrations cover len only");
    let past = a.addr() + a.len() as u64;
    assert!(PeerSpan::new(a, past, 1).is_none());
    assert!(PeerSpan::new(a, a.addr(), a.len() + 1).is_none());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Arena {
        Arena::new(&ArenaConfig::new(4 << 20)).unwrap()
    }

    #[test]
    fn rounds_to_huge_pages_and_falls_back() {
        let a = Arena::new(&ArenaConfig::new(1)).unwrap();
        assert_eq!(a.len(), HUGE_PAGE);
        // Either real huge pages or the documented fallback; never an error.
        assert!(matches!(
            a.backing(),
            Backing::HugeTlb | Backing::Transparent
        ));
        assert_eq!(a.addr() % 4096, 0);
    }

    #[test]
    fn require_huge_fails_loudly_without_them() {
        let mut c = ArenaConfig::new(2 << 20);
        c.require_huge = true;
        match Arena::new(&c) {
            Ok(a) => assert_eq!(a.backing(), &Backing::HugeTlb),
            Err(e) => assert!(e.to_string().contains("nr_hugepages"), "{e}"),
        }
    }

    #[test]
    fn pool_hands_out_disjoint_blocks_and_takes_them_back() {
        let pool = small().into_pool(1 << 20).unwrap();
        assert_eq!(pool.capacity(), 4);
        let mut bs: Vec<Block> = (0..4).map(|_| pool.take().unwrap()).collect();
        assert!(pool.take().is_none());
        for (i, b) in bs.iter_mut().enumerate() {
            b.as_mut_slice().fill(i as u8 + 1);
        }
        let mut offs: Vec<usize> = bs.iter().map(|b| b.offset()).collect();
        offs.sort();
        assert_eq!(offs, vec![0, 1 << 20, 2 << 20, 3 << 20]);
        for (i, b) in bs.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as u8 + 1));
        }
        drop(bs.pop());
        assert_eq!(pool.available(), 1);
        assert!(pool.take().is_some());
    }

    #[test]
    fn every_arena_has_a_readable_guard_that_no_block_covers() {
        let a = small();
        assert_eq!(a.addr() % HUGE_PAGE as u64, 0, "aligned for MAP_HUGETLB");
        assert_guarded(&a);
        let pool = a.clone().into_pool(1 << 20).unwrap();
        let mut bs: Vec<Block> = (0..pool.capacity()).map(|_| pool.take().unwrap()).collect();
        let ends = bs.iter().map(|b| b.offset() + b.len()).max();
        assert_eq!(
            ends,
            Some(a.len()),
            "the last block ends where the guard starts"
        );
        // Every block written in full: none of it lands in the guard.
        for b in &mut bs {
            b.as_mut_slice().fill(0xff);
        }
        assert_guarded(&a);
        // Without pre-faulting, and on the fallback (normal pages) too.
        let mut c = ArenaConfig::new(2 << 20);
        c.prefault = false;
        assert_guarded(&Arena::new(&c).unwrap());
        assert_guarded(&Arena::new(&ArenaConfig::new(1)).unwrap());
    }

    #[test]
    fn bad_block_sizes_are_named() {
        for b in [0, 1000, 3 << 12, 8 << 20] {
            let e = small().into_pool(b).err().expect("must fail");
            assert!(e.to_string().contains(&b.to_string()), "{e}");
        }
    }

    #[test]
    fn peer_span_is_bounds_checked() {
        let a = small();
        assert!(PeerSpan::new(&a, a.addr() - 1, 10).is_none());
        assert!(PeerSpan::new(&a, a.addr() + a.len() as u64 - 4, 8).is_none());
        let s = PeerSpan::new(&a, a.addr() + 4096, 8192).unwrap();
        // SAFETY (this block and the next): the test owns the arena and
        // posts nothing; no other borrower exists.
        unsafe {
            assert!(s.with_mut(8190, 4, |_| ()).is_none());
            s.with_mut(0, 4, |b| b.copy_from_slice(b"abcd")).unwrap();
        }
        assert_eq!(s.with(0, 4, |b| b.to_vec()).unwrap(), b"abcd");
        // Several ranges at once, in the order asked; one out of bounds
        // refuses them all.
        unsafe { s.with_mut(4096, 4, |b| b.copy_from_slice(b"wxyz")) }.unwrap();
        let got = s
            .with_many(&[(4096, 4), (0, 2), (1, 3)], |bs| {
                bs.iter().map(|b| b.to_vec()).collect::<Vec<_>>()
            })
            .unwrap();
        assert_eq!(got, [b"wxyz".to_vec(), b"ab".to_vec(), b"bcd".to_vec()]);
        assert!(s.with_many(&[(0, 4), (8190, 4)], |_| ()).is_none());
    }

    #[test]
    fn hugetlbfs_dir_errors_name_the_dir() {
        let mut c = ArenaConfig::new(2 << 20);
        c.hugepage_dir = Some("/nonexistent-hugetlbfs".into());
        let e = Arena::new(&c).unwrap_err();
        assert!(e.to_string().contains("/nonexistent-hugetlbfs"), "{e}");
    }

    /// Arenas mapped (huge pages tried first: where there are none, the
    /// try fails) while another thread keeps starting threads. A clean-up
    /// that unmapped a range it no longer held took a starting thread's
    /// stack, and the test binary died of SIGSEGV about once in 40 runs of
    /// the tcp provider's tests; this test, on that code, about once in
    /// five runs (a race: it cannot be made certain). Each thread checks its
    /// stack is intact.
    #[test]
    fn mapping_arenas_leaves_other_threads_stacks_alone() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let spawner = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut started = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::spawn(|| {
                        let canary = std::hint::black_box([0xa5u8; 16 << 10]);
                        std::thread::yield_now();
                        std::hint::black_box(&canary).iter().all(|&b| b == 0xa5)
                    })
                    .join()
                    .map(|intact| assert!(intact, "a thread's stack changed under it"))
                    .expect("a thread died");
                    started += 1;
                }
                started
            })
        };
        for _ in 0..30_000 {
            for huge in [true, false] {
                if let Ok(p) = map_anon(4 << 20, huge) {
                    // SAFETY: `p` is what map_guarded returned just above
                    // for 4 MiB, nothing refers to it.
                    unsafe {
                        libc::munmap(p.cast(), mapped_len(4 << 20));
                    }
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        let started = spawner.join().expect("the spawning thread died");
        assert!(started > 0, "no thread was started meanwhile");
    }
}
