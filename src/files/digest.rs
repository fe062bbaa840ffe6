//! Integrity: per-block SHA-256 (parallel) and the whole-file SHA-256 computed from
//! blocks arriving in any order, without reading the file a second time.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use sha2::{Digest, Sha256};

use super::error::DigestError;

/// A SHA-256 digest.
pub type Sha256Digest = [u8; 32];

/// SHA-256 of one block.
pub fn block_digest(data: &[u8]) -> Sha256Digest {
    Sha256::digest(data).into()
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

/// SHA-256 of each block, spread over `available_parallelism` scoped threads.
/// Output order matches input order.
pub fn digest_blocks_parallel(blocks: &[&[u8]]) -> Vec<Sha256Digest> {
    let n = parallelism().min(blocks.len()).max(1);
    if n == 1 {
        return blocks.iter().map(|b| block_digest(b)).collect();
    }
    let mut out = vec![[0u8; 32]; blocks.len()];
    let per = blocks.len().div_ceil(n);
    std::thread::scope(|s| {
        for (ins, outs) in blocks.chunks(per).zip(out.chunks_mut(per)) {
            s.spawn(move || {
                for (b, o) in ins.iter().zip(outs.iter_mut()) {
                    *o = block_digest(b);
                }
            });
        }
    });
    out
}

/// [`digest_blocks_parallel`] while `alongside` (typically feeding the
/// whole-file digest, which must see the bytes in order) runs on a thread
/// of its own; the calling thread takes blocks too. Blocks are handed out
/// one at a time, so a thread that finishes early takes the next one.
pub fn digests_alongside<R: Send>(
    blocks: &[&[u8]],
    alongside: impl FnOnce() -> R + Send,
) -> (Vec<Sha256Digest>, R) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let take = || {
        let mut mine = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(b) = blocks.get(i) else { break mine };
            mine.push((i, block_digest(b)));
        }
    };
    // One thread is `alongside`'s; the others, this one included, hash.
    let helpers = parallelism()
        .saturating_sub(2)
        .min(blocks.len().saturating_sub(1));
    let mut out = vec![[0u8; 32]; blocks.len()];
    let r = std::thread::scope(|s| {
        let side = s.spawn(alongside);
        let workers: Vec<_> = (0..helpers).map(|_| s.spawn(take)).collect();
        let mut mine = take();
        for w in workers {
            mine.extend(w.join().expect("a digest thread panicked"));
        }
        for (i, d) in mine {
            out[i] = d;
        }
        side.join().expect("the alongside thread panicked")
    });
    (out, r)
}

/// A long-lived pool of hashing threads for the data path: `submit(index, buffer)`,
/// later `recv()` gets `(index, digest, buffer)` back (buffer returned so it can be
/// recycled). Results come back in completion order, not submission order.
pub struct DigestPool<T: AsRef<[u8]> + Send + 'static> {
    tx: Option<mpsc::Sender<(u64, T)>>,
    rx: mpsc::Receiver<(u64, Sha256Digest, T)>,
    workers: Vec<JoinHandle<()>>,
    outstanding: usize,
}

impl<T: AsRef<[u8]> + Send + 'static> DigestPool<T> {
    /// `threads == 0` means `available_parallelism`.
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 { parallelism() } else { threads };
        let (tx, work_rx) = mpsc::channel::<(u64, T)>();
        let (done_tx, rx) = mpsc::channel();
        let work_rx = Arc::new(Mutex::new(work_rx));
        let workers = (0..threads)
            .map(|i| {
                let work_rx = Arc::clone(&work_rx);
                let done_tx = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("rcp-digest-{i}"))
                    .spawn(move || loop {
                        let job = match work_rx.lock() {
                            Ok(g) => g.recv(),
                            Err(_) => return,
                        };
                        let Ok((idx, buf)) = job else { return };
                        let d = block_digest(buf.as_ref());
                        if done_tx.send((idx, d, buf)).is_err() {
                            return;
                        }
                    })
                    .expect("spawn digest thread")
            })
            .collect();
        DigestPool {
            tx: Some(tx),
            rx,
            workers,
            outstanding: 0,
        }
    }

    /// Queue a block for hashing.
    pub fn submit(&mut self, index: u64, data: T) {
        self.outstanding += 1;
        self.tx
            .as_ref()
            .expect("pool alive")
            .send((index, data))
            .expect("digest workers alive");
    }

    /// Number of submitted blocks whose result was not yet collected.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Wait for the next finished block; `None` if nothing is outstanding.
    pub fn recv(&mut self) -> Option<(u64, Sha256Digest, T)> {
        if self.outstanding == 0 {
            return None;
        }
        let r = self.rx.recv().ok()?;
        self.outstanding -= 1;
        Some(r)
    }

    /// A finished block if one is ready, without waiting.
    pub fn try_recv(&mut self) -> Option<(u64, Sha256Digest, T)> {
        let r = self.rx.try_recv().ok()?;
        self.outstanding -= 1;
        Some(r)
    }
}

impl<T: AsRef<[u8]> + Send + 'static> Drop for DigestPool<T> {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
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
    fn pool_returns_every_block() {
        let mut pool = DigestPool::new(3);
        for i in 0..20u64 {
            pool.submit(i, vec![i as u8; 4096]);
        }
        let mut got = Vec::new();
        while let Some((i, d, buf)) = pool.recv() {
            assert_eq!(d, block_digest(&buf));
            assert_eq!(buf[0], i as u8);
            got.push(i);
        }
        got.sort();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
        assert_eq!(pool.outstanding(), 0);
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
