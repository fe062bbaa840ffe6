//! Integrity: per-block SHA-256 (large blocks hashed on a process-wide pool), the derived file
//! digest built from the block digests, and (on request) the flat whole-file SHA-256
//! computed from blocks arriving in any order, without reading the file a second time.
//!
//! # The derived file digest (`rcp-file-digest-v1`)
//! What identifies a file's contents in rcp is not the flat `sha256sum` value but a
//! digest *derived from the block digests*, so neither end makes a second, serial pass
//! over the bytes: each block is hashed once (in parallel) anyway. For a file of
//! `len` bytes cut into blocks of `block_size` bytes (the last one may be short; a
//! 0-byte file has no block), with `d_i` the SHA-256 of block `i`:
//!
//! ```text
//! file_digest = SHA-256( "rcp-file-digest-v1" 0x00
//!                        || len        as u64 little endian
//!                        || block_size as u64 little endian
//!                        || d_0 || d_1 || ... || d_(n-1) )      n = ceil(len / block_size)
//! ```
//!
//! Every block of the file appears, in index order. All fields have fixed lengths,
//! so the encoding is unambiguous; the length and block size are part of it, so the
//! same bytes cut differently (or a file truncated at a block boundary) give another
//! digest. Both ends must use the same block size. See [`file_digest`] and
//! [`FileDigest`].
//!
//! Blocks checked with xxh3 give the same encoding hashed with xxh3-128 (16 bytes per
//! block digest), still named `rcp-file-digest-v1` (the check tells the function).
//!
//! # The derived file digest of BLAKE3 (`rcp-file-digest-blake3-v1`)
//! Blocks checked with BLAKE3 ([`Check::Blake3`]; `d_i` the 32-byte BLAKE3 hash of
//! block `i`) give the same layout under its own tag, hashed with BLAKE3:
//!
//! ```text
//! file_digest = BLAKE3( "rcp-file-digest-blake3-v1" 0x00
//!                       || len        as u64 little endian
//!                       || block_size as u64 little endian
//!                       || d_0 || d_1 || ... || d_(n-1) )      n = ceil(len / block_size)
//! ```
//!
//! BLAKE3 is its default 32-byte output (hash mode, no key). [`Check::digest_format`]
//! names the encoding of each check.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::error::DigestError;

/// A SHA-256 digest.
pub type Sha256Digest = [u8; 32];

/// SHA-256 of one block.
pub fn block_digest(data: &[u8]) -> Sha256Digest {
    Sha256::digest(data).into()
}

/// The domain-separation prefix of the derived file digest (see the module doc).
pub const FILE_DIGEST_TAG: &[u8; 19] = b"rcp-file-digest-v1\0";

/// The domain-separation prefix of the derived file digest of BLAKE3
/// (`rcp-file-digest-blake3-v1`, see the module doc).
pub const FILE_DIGEST_BLAKE3_TAG: &[u8; 26] = b"rcp-file-digest-blake3-v1\0";

/// The checks a client offers when it is not told which (`rcp --verify`,
/// the Copy API, [`crate::control::ClientOptions`]), preferred first:
/// BLAKE3, or SHA-256 from an rcpd that does not know BLAKE3 (protocol
/// 2.1 and older) or does not allow it (`RCPD_VERIFY`). Both are
/// cryptographic: falling back is no downgrade.
pub const DEFAULT_CHECKS: [Check; 2] = [Check::Blake3, Check::Sha256];

/// How every block is checked end to end, chosen per session (`--verify`)
/// and recorded in resume manifests.
///
/// - [`Check::Blake3`] (the default): BLAKE3 (the `blake3` crate, its SIMD
///   back end chosen at run time: AVX-512, AVX2, SSE4.1, NEON),
///   cryptographic like SHA-256 and several times faster per core. With
///   mTLS on the control plane it also detects tampering on the unencrypted
///   data plane.
/// - [`Check::Sha256`]: SHA-256, cryptographic, for those who need SHA-2
///   (and what an rcpd of protocol 2.1 and older offers and accepts).
/// - [`Check::Xxh3`]: xxh3-128 (xxhash-rust, SIMD), ~10x faster than SHA-256
///   on one core: catches damage, not an attacker. Chosen over CRC32C, as
///   fast here (`examples/check_speed.rs`), for its 128 bits against 32.
/// - [`Check::None`]: no check: only the link's own CRCs stand between a
///   flipped bit and the file.
///
/// Digests are kept as 32-byte arrays whatever the check; the first
/// [`digest_len`](Check::digest_len) bytes are the digest, the rest zero. The derived file
/// digest of a check is the same encoding hashed with the same function
/// (xxh3-128 for xxh3; BLAKE3 under its own tag, see the module doc;
/// nothing for none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Check {
    #[default]
    Blake3,
    Sha256,
    Xxh3,
    None,
}

impl Check {
    /// Every check, the cryptographic ones first (what rcpd allows by
    /// default, `RCPD_VERIFY`).
    pub const ALL: [Check; 4] = [Check::Blake3, Check::Sha256, Check::Xxh3, Check::None];

    /// Bytes of a digest.
    pub fn digest_len(self) -> usize {
        match self {
            Check::Blake3 | Check::Sha256 => 32,
            Check::Xxh3 => 16,
            Check::None => 0,
        }
    }

    /// Whether it checks nothing.
    pub fn is_none(self) -> bool {
        self == Check::None
    }

    /// The name users type (`--verify`) and logs show.
    pub fn name(self) -> &'static str {
        match self {
            Check::Blake3 => "blake3",
            Check::Sha256 => "sha256",
            Check::Xxh3 => "xxh3",
            Check::None => "none",
        }
    }

    /// The name of its derived file digest's encoding (module doc):
    /// `rcp-file-digest-blake3-v1` for BLAKE3, `rcp-file-digest-v1` for the
    /// others.
    pub fn digest_format(self) -> &'static str {
        match self {
            Check::Blake3 => "rcp-file-digest-blake3-v1",
            _ => "rcp-file-digest-v1",
        }
    }

    /// The check named `s` (`blake3`, `sha256`, `xxh3`, `none`), exactly:
    /// `BLAKE3` or ` sha256` name none, as everywhere else a check is named.
    pub fn from_name(s: &str) -> Option<Check> {
        Check::ALL.into_iter().find(|c| c.name() == s)
    }

    /// Why `s` names no check: the names that do.
    pub fn unknown(s: &str) -> String {
        format!("unknown check {s:?}: blake3, sha256, xxh3 or none")
    }

    /// Its byte in resume manifests.
    pub(crate) fn id(self) -> u8 {
        match self {
            Check::Sha256 => 1,
            Check::Xxh3 => 2,
            Check::None => 3,
            Check::Blake3 => 4,
        }
    }

    pub(crate) fn from_id(id: u8) -> Option<Check> {
        Check::ALL.into_iter().find(|c| c.id() == id)
    }

    /// The digest of one block.
    pub fn block(self, data: &[u8]) -> Sha256Digest {
        let mut out = [0u8; 32];
        match self {
            Check::Blake3 => out = *blake3::hash(data).as_bytes(),
            Check::Sha256 => out = Sha256::digest(data).into(),
            Check::Xxh3 => {
                out[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(data).to_le_bytes())
            }
            Check::None => {}
        }
        out
    }

    /// The digest of each block; output order matches input order. Blocks
    /// are hashed on the process-wide pool ([`set_pool_threads`]) when one
    /// of them is larger than [`POOL_MIN_BLOCK`], else on the calling thread
    /// ([`blocks_on_pool`]).
    pub fn blocks(self, blocks: &[&[u8]]) -> Vec<Sha256Digest> {
        if self.is_none() {
            return vec![[0; 32]; blocks.len()];
        }
        if !blocks_on_pool(blocks) {
            return self.blocks_here(blocks);
        }
        pool().install(|| blocks.par_iter().map(|b| self.block(b)).collect())
    }

    /// The digest of each block, on the calling thread; BLAKE3 hashes
    /// small blocks of one length side by side
    /// ([`blake3_lanes`](super::blake3_lanes)).
    pub fn blocks_here(self, blocks: &[&[u8]]) -> Vec<Sha256Digest> {
        match self {
            Check::Blake3 => super::blake3_lanes::hash_each(blocks),
            _ => blocks.iter().map(|b| self.block(b)).collect(),
        }
    }

    /// Its first [`digest_len`](Check::digest_len) bytes: the digest as on the wire.
    pub fn wire(self, d: &Sha256Digest) -> Vec<u8> {
        d[..self.digest_len()].to_vec()
    }

    /// A digest from the wire, padded; `None` if its length is not the
    /// check's.
    pub fn from_wire(self, b: &[u8]) -> Option<Sha256Digest> {
        if b.len() != self.digest_len() {
            return None;
        }
        let mut out = [0u8; 32];
        out[..b.len()].copy_from_slice(b);
        Some(out)
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Check {
    type Err = String;
    /// For the command lines (`--verify`, `RCP_VERIFY`, `RCPD_VERIFY`):
    /// any case, spaces around a name of a list ignored, as they always
    /// were.
    fn from_str(s: &str) -> Result<Self, String> {
        Check::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Check::unknown(s))
    }
}

#[derive(Clone)]
enum FileHasher {
    Blake3(Box<blake3::Hasher>),
    Sha256(Sha256),
    Xxh3(Box<xxhash_rust::xxh3::Xxh3>),
    None,
}

/// The derived file digest, built incrementally: [`push`](Self::push) the digest of
/// every block, in index order, then [`finish`](Self::finish). See the module doc for
/// the encoding; it is hashed with the blocks' [`Check`].
#[derive(Clone)]
pub struct FileDigest {
    check: Check,
    hasher: FileHasher,
    blocks: u64,
}

impl FileDigest {
    /// For a file of `len` bytes in blocks of `block_size` bytes, checked
    /// with SHA-256.
    pub fn new(len: u64, block_size: u64) -> Self {
        FileDigest::with_check(Check::Sha256, len, block_size)
    }

    /// For a file of `len` bytes in blocks of `block_size` bytes, whose
    /// blocks are checked with `check`.
    pub fn with_check(check: Check, len: u64, block_size: u64) -> Self {
        let (mut hasher, tag) = match check {
            Check::Blake3 => (
                FileHasher::Blake3(Box::default()),
                &FILE_DIGEST_BLAKE3_TAG[..],
            ),
            Check::Sha256 => (FileHasher::Sha256(Sha256::new()), &FILE_DIGEST_TAG[..]),
            Check::Xxh3 => (FileHasher::Xxh3(Box::default()), &FILE_DIGEST_TAG[..]),
            Check::None => (FileHasher::None, &FILE_DIGEST_TAG[..]),
        };
        for part in [tag, &len.to_le_bytes(), &block_size.to_le_bytes()] {
            match &mut hasher {
                FileHasher::Blake3(h) => {
                    h.update(part);
                }
                FileHasher::Sha256(h) => h.update(part),
                FileHasher::Xxh3(h) => h.update(part),
                FileHasher::None => {}
            }
        }
        FileDigest {
            check,
            hasher,
            blocks: 0,
        }
    }

    /// The next block's digest.
    pub fn push(&mut self, block_digest: &Sha256Digest) {
        let d = &block_digest[..self.check.digest_len()];
        match &mut self.hasher {
            FileHasher::Blake3(h) => {
                h.update(d);
            }
            FileHasher::Sha256(h) => h.update(d),
            FileHasher::Xxh3(h) => h.update(d),
            FileHasher::None => {}
        }
        self.blocks += 1;
    }

    /// Block digests pushed so far.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The digest (padded to 32 bytes like block digests). The caller has
    /// pushed every block (`len.div_ceil(block_size)` of them); with any
    /// other number the result is simply another digest.
    pub fn finish(self) -> Sha256Digest {
        match self.hasher {
            FileHasher::Blake3(h) => *h.finalize().as_bytes(),
            FileHasher::Sha256(h) => h.finalize().into(),
            FileHasher::Xxh3(h) => {
                let mut out = [0u8; 32];
                out[..16].copy_from_slice(&h.digest128().to_le_bytes());
                out
            }
            FileHasher::None => [0; 32],
        }
    }
}

/// The derived file digest of a `len`-byte file in `block_size` blocks from the
/// digests of all its blocks, in index order (see the module doc).
pub fn file_digest<'a>(
    len: u64,
    block_size: u64,
    block_digests: impl IntoIterator<Item = &'a Sha256Digest>,
) -> Sha256Digest {
    file_digest_with(Check::Sha256, len, block_size, block_digests)
}

/// [`file_digest`] for blocks checked with `check`.
pub fn file_digest_with<'a>(
    check: Check,
    len: u64,
    block_size: u64,
    block_digests: impl IntoIterator<Item = &'a Sha256Digest>,
) -> Sha256Digest {
    let mut d = FileDigest::with_check(check, len, block_size);
    for b in block_digests {
        d.push(b);
    }
    d.finish()
}

/// Lower-case hex, as `sha256sum` prints it.
pub fn to_hex(d: &Sha256Digest) -> String {
    hex::encode(d)
}

/// Parse 64 hex digits (either case).
pub fn from_hex(s: &str) -> Result<Sha256Digest, DigestError> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s.trim(), &mut out).map_err(|_| DigestError::BadHex(s.to_owned()))?;
    Ok(out)
}

/// Blocks of at most this many bytes (a window of small files' blocks) are
/// hashed by [`Check::blocks`] on the thread that read them or had them
/// land, not on the pool: a 16 KiB block hashes in a few microseconds, about
/// what handing it to a pool thread and waking it costs, and the pool's
/// threads then spin (`sched_yield`) for the next window on cores the
/// protocol driver and the data path need. Windows are filled and checked
/// on several blocking threads at once, so small blocks are still hashed in
/// parallel, a window per thread. Larger blocks (a big file's) go to the
/// pool, which splits one window over its threads.
pub const POOL_MIN_BLOCK: usize = 64 << 10;

/// Whether [`Check::blocks`] hashes `blocks` on the pool: more than one
/// block, and one of them larger than [`POOL_MIN_BLOCK`].
pub fn blocks_on_pool(blocks: &[&[u8]]) -> bool {
    blocks.len() > 1 && blocks.iter().any(|b| b.len() > POOL_MIN_BLOCK)
}

fn parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The process-wide hashing pool, created by [`set_pool_threads`] or on first use.
/// A tree's walk ([`super::walk`]) runs its sibling directories on it too.
static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

fn build_pool(threads: usize) -> rayon::ThreadPool {
    let threads = if threads == 0 { parallelism() } else { threads };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("rcp-digest-{i}"))
        .build()
        .expect("spawn the digest threads")
}

pub(crate) fn pool() -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| build_pool(0))
}

/// Create the process-wide hashing pool now with `threads` threads (`0`:
/// `available_parallelism`), e.g. as many as the CPUs of the NIC's NUMA node.
/// Without this call the pool is created on first use with the default size.
/// The pool lives as long as the process; its size cannot change once it
/// exists ([`DigestError::PoolStarted`]), so call this at startup.
pub fn set_pool_threads(threads: usize) -> Result<(), DigestError> {
    if let Some(p) = POOL.get() {
        return Err(DigestError::PoolStarted {
            threads: p.current_num_threads(),
        });
    }
    POOL.set(build_pool(threads))
        .map_err(|_| DigestError::PoolStarted {
            threads: pool().current_num_threads(),
        })
}

/// Threads of the hashing pool (creating it if it does not exist yet).
pub fn pool_threads() -> usize {
    pool().current_num_threads()
}

/// What landed, checked against the sender's digests: each block's digest
/// (padded, as [`Check::block`]) and whether it matched. The one check of
/// what landed, for files' windows (both directions) and buffers' ranges
/// (both sides).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Landed {
    pub digests: Vec<Sha256Digest>,
    pub ok: Vec<bool>,
}

impl Landed {
    /// The indices of the blocks that did not match.
    pub fn bad(&self) -> Vec<u32> {
        (0..self.ok.len() as u32)
            .filter(|&i| !self.ok[i as usize])
            .collect()
    }
}

impl Check {
    /// Check what landed in `blocks` against `wants` (the sender's wire
    /// digests, in order; one missing counts as a mismatch), hashing on
    /// the pool when the blocks are large ([`Check::blocks`]).
    pub fn landed<W: AsRef<[u8]>>(self, blocks: &[&[u8]], wants: &[W]) -> Landed {
        self.compare(self.blocks(blocks), |i| wants.get(i).map(AsRef::as_ref))
    }

    /// [`Check::landed`] for bytes reached through a guard (a buffer's
    /// leased ranges): `hash` gives each item's digest (the check's
    /// [`Check::block`] of its bytes), run on the pool ([`on_pool`]);
    /// `want(i)` the sender's wire digest of item `i`.
    pub fn landed_with<'w, T: Sync>(
        self,
        items: &[T],
        hash: impl Fn(&T) -> Sha256Digest + Sync + Send,
        want: impl Fn(usize) -> Option<&'w [u8]>,
    ) -> Landed {
        let digests = if self.is_none() {
            vec![[0; 32]; items.len()]
        } else {
            on_pool(items, hash)
        };
        self.compare(digests, want)
    }

    fn compare<'w>(
        self,
        digests: Vec<Sha256Digest>,
        want: impl Fn(usize) -> Option<&'w [u8]>,
    ) -> Landed {
        let n = self.digest_len();
        let ok = digests
            .iter()
            .enumerate()
            .map(|(i, d)| want(i) == Some(&d[..n]))
            .collect();
        Landed { digests, ok }
    }
}

/// `digest(item)` of each of `items` (`Check::wire` of its bytes' digest,
/// say) on the process-wide hashing pool, in their order: for callers
/// whose bytes are reached through a guard rather than held as slices
/// (a buffer operation's leased ranges).
pub fn on_pool<T: Sync, D: Send>(items: &[T], digest: impl Fn(&T) -> D + Sync + Send) -> Vec<D> {
    if items.len() <= 1 {
        return items.iter().map(digest).collect();
    }
    pool().install(|| items.par_iter().map(&digest).collect())
}

/// SHA-256 of each block, spread over the process-wide hashing pool
/// ([`set_pool_threads`]) unless all are small ([`blocks_on_pool`]):
/// [`Check::blocks`] of [`Check::Sha256`].
pub fn digest_blocks_parallel(blocks: &[&[u8]]) -> Vec<Sha256Digest> {
    Check::Sha256.blocks(blocks)
}

/// [`digest_blocks_parallel`] while `alongside` (typically feeding the
/// whole-file digest, which must see the bytes in order) runs on one thread
/// of the pool; the others hash the blocks (with a one-thread pool, one after
/// the other).
pub fn digests_alongside<R: Send>(
    blocks: &[&[u8]],
    alongside: impl FnOnce() -> R + Send,
) -> (Vec<Sha256Digest>, R) {
    let (r, out) = pool().join(alongside, || {
        blocks.par_iter().map(|b| block_digest(b)).collect()
    });
    (out, r)
}

/// Default bound on out-of-order bytes a [`StreamingFileDigest`] holds.
pub const DEFAULT_MAX_PENDING: usize = 256 << 20;

/// The whole-file SHA-256 (the `sha256sum` value) fed from `(offset, bytes)` pieces in
/// any order. Pieces at the current hashing position are hashed at once (no copy);
/// pieces ahead of it are copied and held until the gap before them fills, up to
/// `max_pending` bytes. Beyond that, [`update`](Self::update) refuses with
/// [`DigestError::Backpressure`] and consumes nothing: the caller either waits for the
/// gap to fill or, like [`super::commit::Destination`], keeps the piece on disk and
/// feeds it again once [`next_offset`](Self::next_offset) reaches it.
///
/// Pieces must not overlap ([`DigestError::Overlap`]).
#[derive(Clone)]
pub struct StreamingFileDigest {
    hasher: Sha256,
    next: u64,
    len: Option<u64>,
    pending: BTreeMap<u64, Vec<u8>>,
    pending_bytes: usize,
    max_pending: usize,
}

impl StreamingFileDigest {
    /// `len`: the file length if known (pieces beyond it are refused, and
    /// [`finish`](Self::finish) requires exactly that much).
    pub fn new(len: Option<u64>, max_pending: usize) -> Self {
        StreamingFileDigest {
            hasher: Sha256::new(),
            next: 0,
            len,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            max_pending,
        }
    }

    /// Offset up to which everything has been hashed.
    pub fn next_offset(&self) -> u64 {
        self.next
    }

    /// Out-of-order bytes currently held.
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Feed `data` found at `offset`.
    pub fn update(&mut self, offset: u64, data: &[u8]) -> Result<(), DigestError> {
        let n = data.len() as u64;
        if n == 0 {
            return Ok(());
        }
        if let Some(len) = self.len {
            if offset.checked_add(n).is_none_or(|end| end > len) {
                return Err(DigestError::BeyondEnd {
                    offset,
                    bytes: n,
                    len,
                });
            }
        }
        let overlap = DigestError::Overlap { offset, bytes: n };
        if offset < self.next {
            return Err(overlap);
        }
        if let Some((&o, v)) = self.pending.range(..=offset).next_back() {
            if o + v.len() as u64 > offset {
                return Err(overlap);
            }
        }
        if let Some((&o, _)) = self.pending.range(offset..).next() {
            if o < offset + n {
                return Err(overlap);
            }
        }
        if offset == self.next {
            self.hasher.update(data);
            self.next += n;
            while let Some(v) = self.pending.remove(&self.next) {
                self.hasher.update(&v);
                self.next += v.len() as u64;
                self.pending_bytes -= v.len();
            }
            return Ok(());
        }
        if self.pending_bytes + data.len() > self.max_pending {
            return Err(DigestError::Backpressure {
                pending: self.pending_bytes,
                limit: self.max_pending,
            });
        }
        self.pending_bytes += data.len();
        self.pending.insert(offset, data.to_vec());
        Ok(())
    }

    /// The digest, if every byte from 0 to the end arrived; otherwise
    /// [`DigestError::Gap`] naming the first missing offset.
    pub fn finish(self) -> Result<Sha256Digest, DigestError> {
        let len = self.len.unwrap_or(self.next);
        if self.next != len || !self.pending.is_empty() {
            return Err(DigestError::Gap { at: self.next, len });
        }
        Ok(self.hasher.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn checks_digest_their_way_and_round_trip_on_the_wire() {
        let data = b"rcp checks this block";
        // SHA-256 is sha2's; xxh3-128 is xxhash-rust's, little endian in
        // the first 16 bytes; none is nothing.
        assert_eq!(
            Check::Sha256.block(data),
            <[u8; 32]>::from(Sha256::digest(data))
        );
        let x = Check::Xxh3.block(data);
        assert_eq!(x[..16], xxhash_rust::xxh3::xxh3_128(data).to_le_bytes());
        assert_eq!(x[16..], [0; 16]);
        assert_eq!(Check::None.block(data), [0; 32]);
        assert_eq!(Check::Blake3.block(data), *blake3::hash(data).as_bytes());
        for c in Check::ALL {
            let d = c.block(data);
            assert_eq!(c.wire(&d).len(), c.digest_len());
            assert_eq!(c.from_wire(&c.wire(&d)), Some(d));
            assert_eq!(c.from_wire(&[0; 31]), None);
            assert_eq!(Check::from_name(c.name()), Some(c));
            assert_eq!(Check::from_id(c.id()), Some(c));
            // Parallel digests are the same as one by one.
            let blocks: Vec<&[u8]> = vec![b"a", b"bb", data];
            let one: Vec<_> = blocks.iter().map(|b| c.block(b)).collect();
            assert_eq!(c.blocks(&blocks), one);
        }
        assert!("crc32".parse::<Check>().is_err());
        // The derived file digest is hashed with the blocks' check.
        let ds = [Check::Xxh3.block(b"x"), Check::Xxh3.block(b"y")];
        let fx = file_digest_with(Check::Xxh3, 2, 1, &ds);
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(FILE_DIGEST_TAG);
        h.update(&2u64.to_le_bytes());
        h.update(&1u64.to_le_bytes());
        h.update(&ds[0][..16]);
        h.update(&ds[1][..16]);
        assert_eq!(fx[..16], h.digest128().to_le_bytes());
        assert_ne!(file_digest_with(Check::Sha256, 2, 1, &ds), fx);
        assert_eq!(file_digest_with(Check::None, 2, 1, &ds), [0; 32]);
    }

    use super::*;

    /// What landed is checked one way everywhere: a damaged block, and a
    /// block whose digest the sender never gave, do not match; under
    /// `none` (no digests) everything does.
    #[test]
    fn landed_names_what_does_not_match() {
        let (a, b, c) = (vec![1u8; 4096], vec![2u8; 4096], vec![3u8; 100]);
        let blocks: Vec<&[u8]> = vec![&a, &b, &c];
        for check in [Check::Blake3, Check::Sha256, Check::Xxh3] {
            let mut wants: Vec<Vec<u8>> =
                blocks.iter().map(|x| check.wire(&check.block(x))).collect();
            assert_eq!(check.landed(&blocks, &wants).bad(), Vec::<u32>::new());
            wants[1][0] ^= 1;
            let l = check.landed(&blocks, &wants[..2]);
            assert_eq!(l.bad(), vec![1, 2], "{check:?}");
            assert_eq!(l.digests[0], check.block(&a));
            let g = check.landed_with(
                &blocks,
                |x| check.block(x),
                |i| wants.get(i).map(Vec::as_slice),
            );
            assert_eq!(g.bad(), vec![1], "{check:?}");
        }
        let none: Vec<Vec<u8>> = vec![Vec::new(); 3];
        assert!(Check::None.landed(&blocks, &none).bad().is_empty());
    }

    /// The official BLAKE3 test vectors (test_vectors.json of the BLAKE3
    /// reference: input `i % 251` for `i` in `0..len`, the default 32-byte
    /// hash), through whichever SIMD back end this machine picks.
    const BLAKE3_VECTORS: [(usize, &str); 12] = [
        (
            0,
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
        ),
        (
            1,
            "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
        ),
        (
            1023,
            "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11",
        ),
        (
            1024,
            "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
        ),
        (
            1025,
            "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
        ),
        (
            2049,
            "5f4d72f40d7a5f82b15ca2b2e44b1de3c2ef86c426c95c1af0b6879522563030",
        ),
        (
            3073,
            "7124b49501012f81cc7f11ca069ec9226cecb8a2c850cfe644e327d22d3e1cd3",
        ),
        (
            4096,
            "015094013f57a5277b59d8475c0501042c0b642e531b0a1c8f58d2163229e969",
        ),
        (
            8193,
            "bab6c09cb8ce8cf459261398d2e7aef35700bf488116ceb94a36d0f5f1b7bc3b",
        ),
        (
            16384,
            "f875d6646de28985646f34ee13be9a576fd515f76b5b0a26bb324735041ddde4",
        ),
        (
            31744,
            "62b6960e1a44bcc1eb1a611a8d6235b6b4b78f32e7abc4fb4c6cdcce94895c47",
        ),
        (
            102400,
            "bc3e3d41a1146b069abffad3c0d44860cf664390afce4d9661f7902e7943e085",
        ),
    ];

    fn vector_input(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn blake3_official_vectors() {
        for (len, want) in BLAKE3_VECTORS {
            let d = Check::Blake3.block(&vector_input(len));
            assert_eq!(to_hex(&d), want, "BLAKE3 of {len} bytes");
        }
        // The pool gives the same digests as one by one.
        let inputs: Vec<Vec<u8>> = BLAKE3_VECTORS
            .iter()
            .map(|&(l, _)| vector_input(l))
            .collect();
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let got: Vec<String> = Check::Blake3.blocks(&refs).iter().map(to_hex).collect();
        let want: Vec<&str> = BLAKE3_VECTORS.iter().map(|&(_, h)| h).collect();
        assert_eq!(got, want);
    }

    /// `rcp-file-digest-blake3-v1`, fixed: a change of the encoding (tag,
    /// field order or width) changes these, and peers would disagree.
    #[test]
    fn blake3_file_digest_fixed_vectors() {
        let by_hand = |len: u64, bs: u64, blocks: &[Sha256Digest]| {
            let mut m = b"rcp-file-digest-blake3-v1\0".to_vec();
            m.extend_from_slice(&len.to_le_bytes());
            m.extend_from_slice(&bs.to_le_bytes());
            for b in blocks {
                m.extend_from_slice(b);
            }
            *blake3::hash(&m).as_bytes()
        };
        let data = vector_input(10240);
        let blocks: Vec<Sha256Digest> = data.chunks(4096).map(|c| Check::Blake3.block(c)).collect();
        let cases: [(u64, u64, &[Sha256Digest], &str); 3] = [
            (
                0,
                4096,
                &[],
                "3424ae8dacb7952aca1cad2f6123995a5b90ddcf63e8ea4b10aae7d5c311efd4",
            ),
            (
                3,
                4096,
                &[Check::Blake3.block(b"abc")],
                "2b655b63485d166573727e72f093365201a61e9a84f0ee6b048e16d2ce1b97c8",
            ),
            (
                10240,
                4096,
                &blocks,
                "102ca26c3caca075dd809701e7991055d5cf1137c2ba81882548c914c738084d",
            ),
        ];
        for (len, bs, ds, want) in cases {
            let got = file_digest_with(Check::Blake3, len, bs, ds);
            assert_eq!(got, by_hand(len, bs, ds));
            assert_eq!(
                to_hex(&got),
                want,
                "rcp-file-digest-blake3-v1 of {len} bytes"
            );
            // Not the SHA-256 one, not the BLAKE3 of the SHA-256 encoding.
            assert_ne!(got, file_digest_with(Check::Sha256, len, bs, ds));
        }
        assert_eq!(Check::Blake3.digest_format(), "rcp-file-digest-blake3-v1");
        assert_eq!(Check::Sha256.digest_format(), "rcp-file-digest-v1");
        assert_eq!(DEFAULT_CHECKS[0], Check::default());
    }

    const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    const EMPTY: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn known_vectors() {
        assert_eq!(to_hex(&block_digest(b"abc")), ABC);
        assert_eq!(to_hex(&block_digest(b"")), EMPTY);
        assert_eq!(from_hex(ABC).unwrap(), block_digest(b"abc"));
        assert_eq!(from_hex(&ABC.to_uppercase()).unwrap(), block_digest(b"abc"));
        assert!(from_hex("abc").is_err());
        let s = StreamingFileDigest::new(Some(0), 0);
        assert_eq!(to_hex(&s.finish().unwrap()), EMPTY);
    }

    /// The encoding built by hand, hashed in one go.
    fn by_hand(len: u64, bs: u64, blocks: &[Sha256Digest]) -> Sha256Digest {
        let mut m = b"rcp-file-digest-v1\0".to_vec();
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(&bs.to_le_bytes());
        for b in blocks {
            m.extend_from_slice(b);
        }
        Sha256::digest(&m).into()
    }

    #[test]
    fn file_digest_encoding() {
        let (a, b) = (block_digest(b"a"), block_digest(b"b"));
        assert_eq!(file_digest(0, 4096, []), by_hand(0, 4096, &[]));
        assert_eq!(file_digest(2, 1, [&a, &b]), by_hand(2, 1, &[a, b]));
        let mut inc = FileDigest::new(2, 1);
        inc.push(&a);
        inc.push(&b);
        assert_eq!(inc.blocks(), 2);
        assert_eq!(inc.finish(), file_digest(2, 1, &[a, b]));
        // Order, length, block size and the block set all count.
        let base = file_digest(2, 1, [&a, &b]);
        for other in [
            file_digest(2, 1, [&b, &a]),
            file_digest(3, 1, [&a, &b]),
            file_digest(2, 2, [&a, &b]),
            file_digest(2, 1, [&a]),
        ] {
            assert_ne!(other, base);
        }
    }

    #[test]
    fn parallel_matches_serial() {
        // Small blocks (hashed on the calling thread), then blocks one of
        // which is larger than POOL_MIN_BLOCK (hashed on the pool).
        for base in [1000, POOL_MIN_BLOCK - 20] {
            let data: Vec<Vec<u8>> = (0..37u8).map(|i| vec![i; base + i as usize]).collect();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            assert_eq!(blocks_on_pool(&refs), base > 1000);
            let par = digest_blocks_parallel(&refs);
            let ser: Vec<_> = refs.iter().map(|b| block_digest(b)).collect();
            assert_eq!(par, ser);
            for c in Check::ALL {
                let one: Vec<_> = refs.iter().map(|b| c.block(b)).collect();
                assert_eq!(c.blocks(&refs), one, "{c}");
            }
        }
        assert!(digest_blocks_parallel(&[]).is_empty());
    }

    #[test]
    fn only_windows_with_a_large_block_go_to_the_pool() {
        let small = vec![0u8; POOL_MIN_BLOCK];
        let large = vec![0u8; POOL_MIN_BLOCK + 1];
        assert!(!blocks_on_pool(&[&small[..]; 256]));
        assert!(
            !blocks_on_pool(&[&large[..]]),
            "one block: nothing to split"
        );
        assert!(blocks_on_pool(&[&large[..], &large[..]]));
        assert!(blocks_on_pool(&[&small[..], &large[..], &small[..]]));
        assert!(!blocks_on_pool(&[]));
    }

    #[test]
    fn digests_alongside_match_serial_and_run_the_side_job() {
        let data: Vec<Vec<u8>> = (0..9u8).map(|i| vec![i; 5000 + i as usize]).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        // The side job sees every block too, in order (as the whole-file
        // digest does).
        let (par, whole) = digests_alongside(&refs, || {
            let mut h = Sha256::new();
            for b in &refs {
                h.update(b);
            }
            <[u8; 32]>::from(h.finalize())
        });
        let ser: Vec<_> = refs.iter().map(|b| block_digest(b)).collect();
        assert_eq!(par, ser);
        assert_eq!(whole, block_digest(&data.concat()));
        let (none, r) = digests_alongside(&[], || 7);
        assert!(none.is_empty());
        assert_eq!(r, 7);
    }

    #[test]
    fn out_of_order_abc() {
        let mut s = StreamingFileDigest::new(Some(3), 1024);
        s.update(2, b"c").unwrap();
        s.update(0, b"a").unwrap();
        assert_eq!(s.next_offset(), 1);
        assert_eq!(s.pending_bytes(), 1);
        s.update(1, b"b").unwrap();
        assert_eq!(s.pending_bytes(), 0);
        assert_eq!(to_hex(&s.finish().unwrap()), ABC);
    }

    #[test]
    fn gaps_overlaps_bounds_backpressure() {
        let mut s = StreamingFileDigest::new(Some(10), 4);
        s.update(0, b"ab").unwrap();
        assert_eq!(
            s.update(1, b"x"),
            Err(DigestError::Overlap {
                offset: 1,
                bytes: 1
            })
        );
        s.update(4, b"ef").unwrap();
        assert!(matches!(
            s.update(5, b"x"),
            Err(DigestError::Overlap { .. })
        ));
        assert!(matches!(
            s.update(3, b"de"),
            Err(DigestError::Overlap { .. })
        ));
        assert!(matches!(
            s.update(9, b"jk"),
            Err(DigestError::BeyondEnd { .. })
        ));
        assert_eq!(
            s.update(7, b"hij"),
            Err(DigestError::Backpressure {
                pending: 2,
                limit: 4
            })
        );
        // In-order data is never refused for back-pressure.
        s.update(2, b"cd").unwrap();
        assert_eq!(s.next_offset(), 6);
        assert_eq!(s.clone().finish(), Err(DigestError::Gap { at: 6, len: 10 }));
        s.update(6, b"ghij").unwrap();
        assert_eq!(s.finish().unwrap(), block_digest(b"abcdefghij"));
    }
}
