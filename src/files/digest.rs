//! Integrity: per-block SHA-256 (hashed on a process-wide pool), the derived file
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

/// The derived file digest, built incrementally: [`push`](Self::push) the digest of
/// every block, in index order, then [`finish`](Self::finish). See the module doc for
/// the encoding.
#[derive(Clone)]
pub struct FileDigest {
    hasher: Sha256,
    blocks: u64,
}

impl FileDigest {
    /// For a file of `len` bytes in blocks of `block_size` bytes.
    pub fn new(len: u64, block_size: u64) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(FILE_DIGEST_TAG);
        hasher.update(len.to_le_bytes());
        hasher.update(block_size.to_le_bytes());
        FileDigest { hasher, blocks: 0 }
    }

    /// The next block's SHA-256.
    pub fn push(&mut self, block_digest: &Sha256Digest) {
        self.hasher.update(block_digest);
        self.blocks += 1;
    }

    /// Block digests pushed so far.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The digest. The caller has pushed every block (`len.div_ceil(block_size)`
    /// of them); with any other number the result is simply another digest.
    pub fn finish(self) -> Sha256Digest {
        self.hasher.finalize().into()
    }
}

/// The derived file digest of a `len`-byte file in `block_size` blocks from the
/// digests of all its blocks, in index order (see the module doc).
pub fn file_digest<'a>(
    len: u64,
    block_size: u64,
    block_digests: impl IntoIterator<Item = &'a Sha256Digest>,
) -> Sha256Digest {
    let mut d = FileDigest::new(len, block_size);
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

fn parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The process-wide hashing pool, created by [`set_pool_threads`] or on first use.
static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

fn build_pool(threads: usize) -> rayon::ThreadPool {
    let threads = if threads == 0 { parallelism() } else { threads };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("rcp-digest-{i}"))
        .build()
        .expect("spawn the digest threads")
}

fn pool() -> &'static rayon::ThreadPool {
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

/// SHA-256 of each block, spread over the process-wide hashing pool
/// ([`set_pool_threads`]). Output order matches input order. A single block is
/// hashed on the calling thread.
pub fn digest_blocks_parallel(blocks: &[&[u8]]) -> Vec<Sha256Digest> {
    if blocks.len() <= 1 {
        return blocks.iter().map(|b| block_digest(b)).collect();
    }
    pool().install(|| blocks.par_iter().map(|b| block_digest(b)).collect())
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
    use super::*;

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
        let data: Vec<Vec<u8>> = (0..37u8).map(|i| vec![i; 1000 + i as usize]).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let par = digest_blocks_parallel(&refs);
        let ser: Vec<_> = refs.iter().map(|b| block_digest(b)).collect();
        assert_eq!(par, ser);
        assert!(digest_blocks_parallel(&[]).is_empty());
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
