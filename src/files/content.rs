//! What a file holds, as digests, without copying it: each block's digest
//! under a [`Check`] and the derived file digest built from them (the same
//! encoding a copy's commit compares, see [`super::digest`]). `rcp -c`
//! compares the file digests of both ends; `--delta` compares the blocks'.
//!
//! Both ends compute them on the process-wide hashing pool
//! ([`super::digest::on_pool`]): a batch of small files a file per pool
//! thread, a large file a block per pool thread.

use super::digest::{file_digest_with, on_pool, Check, Sha256Digest};
use super::{Destination, Result, SourceFile};

/// The digests of one file's content cut into blocks of one size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Content {
    pub len: u64,
    /// The derived file digest (the check's encoding, see the module doc
    /// of [`super::digest`]).
    pub digest: Sha256Digest,
    /// Each block's digest, in order (empty unless asked for).
    pub blocks: Vec<Sha256Digest>,
}

/// Blocks of a file hashed together on one pool thread, so that a file of
/// small blocks does not cost a pool hand-off per block.
const BLOCKS_PER_TASK: u64 = 4;

/// Each block's digest of `src` cut at `block_size`, read with `pread`
/// (buffered) and hashed on the pool.
pub fn block_digests(src: &SourceFile, check: Check, block_size: u64) -> Result<Vec<Sha256Digest>> {
    let len = src.len();
    let n = len.div_ceil(block_size);
    let tasks: Vec<u64> = (0..n.div_ceil(BLOCKS_PER_TASK)).collect();
    let hash_task = |t: &u64| -> Result<Vec<Sha256Digest>> {
        let mut buf = vec![0u8; block_size as usize];
        let first = t * BLOCKS_PER_TASK;
        let mut out = Vec::new();
        for b in first..(first + BLOCKS_PER_TASK).min(n) {
            let off = b * block_size;
            let want = (len - off).min(block_size) as usize;
            let got = src.read_at(off, &mut buf[..want])?;
            out.push(check.block(&buf[..got]));
        }
        Ok(out)
    };
    let parts = if tasks.len() > 1 {
        on_pool(&tasks, hash_task)
    } else {
        tasks.iter().map(hash_task).collect()
    };
    let mut all = Vec::with_capacity(n as usize);
    for p in parts {
        all.extend(p?);
    }
    Ok(all)
}

/// [`Content`] of `src`: its file digest, and its block digests when
/// `keep_blocks`.
pub fn content(
    src: &SourceFile,
    check: Check,
    block_size: u64,
    keep_blocks: bool,
) -> Result<Content> {
    let blocks = block_digests(src, check, block_size)?;
    let digest = file_digest_with(check, src.len(), block_size, &blocks);
    Ok(Content {
        len: src.len(),
        digest,
        blocks: if keep_blocks { blocks } else { Vec::new() },
    })
}

/// [`content`] of each file `open` opens, a file per pool thread (its
/// blocks then hashed on that thread or spread again for a large file);
/// `None` where `open` found no regular file.
pub fn contents<T: Sync>(
    items: &[T],
    open: impl Fn(&T) -> Result<Option<SourceFile>> + Sync + Send,
    check: Check,
    block_size: u64,
    keep_blocks: bool,
) -> Vec<Result<Option<Content>>> {
    on_pool(items, |it| {
        let Some(src) = open(it)? else {
            return Ok(None);
        };
        content(&src, check, block_size, keep_blocks).map(Some)
    })
}

/// Blocks [`seed`] reads, hashes and writes together.
const SEED_BATCH: usize = 16;

/// A batch of [`seed`]'s blocks in memory: each buffer holds its block
/// when `ok` (read whole).
#[derive(Default)]
struct SeedBatch {
    bufs: Vec<Vec<u8>>,
    ok: Vec<bool>,
}

impl SeedBatch {
    /// Read the blocks of `batch` from `src` (a block past either end, or
    /// read short, is not `ok`: it moves).
    fn read(
        &mut self,
        src: &SourceFile,
        dest: &Destination,
        batch: &[(u64, Sha256Digest)],
    ) -> Result<()> {
        let bs = dest.block_size();
        self.bufs
            .resize_with(batch.len(), || Vec::with_capacity(bs as usize));
        self.ok.clear();
        for (&(b, _), buf) in batch.iter().zip(self.bufs.iter_mut()) {
            let mut ok = false;
            if b < dest.block_count() && b * bs < src.len() {
                let want = dest.block_len(b) as usize;
                buf.resize(want, 0);
                ok = src.read_at(b * bs, buf)? == want;
            }
            self.ok.push(ok);
        }
        Ok(())
    }

    fn slices(&self) -> Vec<&[u8]> {
        self.bufs
            .iter()
            .zip(&self.ok)
            .filter(|(_, &ok)| ok)
            .map(|(b, _)| b.as_slice())
            .collect()
    }

    /// Write each block of `batch` whose digest (`hashed`, one per `ok`
    /// block) is the one asked for; how many.
    fn write(
        &self,
        dest: &mut Destination,
        batch: &[(u64, Sha256Digest)],
        hashed: Vec<Sha256Digest>,
    ) -> Result<u64> {
        let mut hashed = hashed.into_iter();
        let mut kept = 0;
        for ((&(b, want), buf), &ok) in batch.iter().zip(&self.bufs).zip(&self.ok) {
            if !ok {
                continue;
            }
            let d = hashed.next().expect("a digest per block read");
            if d == want {
                dest.write_block(b, buf, d)?;
                kept += 1;
            }
        }
        Ok(kept)
    }
}

/// `--delta`: write into `dest` (fresh) each block of `keep` (index and
/// digest under `check`, the destination's) that `src`, the file now at the
/// destination's name, still holds: read, hashed again on the pool a batch
/// at a time, written as if it had arrived ([`Destination::write_block`]);
/// the written bytes are the hashed ones. A block `src` no longer holds
/// (shorter, changed) is left missing: it moves. Returns how many were
/// kept. Pipelined: while one batch is hashed, the one before it is
/// written and the one after it read (reads and writes are copies as
/// large as the hashing).
pub fn seed(
    src: &SourceFile,
    dest: &mut Destination,
    keep: &[(u64, Sha256Digest)],
    check: Check,
) -> Result<u64> {
    if check.is_none() || keep.is_empty() {
        return Ok(0);
    }
    let batches: Vec<&[(u64, Sha256Digest)]> = keep.chunks(SEED_BATCH).collect();
    let (mut reading, mut hashing, mut writing) = (
        SeedBatch::default(),
        SeedBatch::default(),
        SeedBatch::default(),
    );
    hashing.read(src, dest, batches[0])?;
    // The batch written next and its digests.
    let mut pending: Option<(usize, Vec<Sha256Digest>)> = None;
    let mut kept = 0;
    for i in 0..batches.len() {
        let (hashed, io) = std::thread::scope(|s| {
            let h = s.spawn(|| check.blocks(&hashing.slices()));
            let io = (|| -> Result<()> {
                if let Some((j, d)) = pending.take() {
                    kept += writing.write(dest, batches[j], d)?;
                }
                if let Some(next) = batches.get(i + 1) {
                    reading.read(src, dest, next)?;
                }
                Ok(())
            })();
            (h.join().expect("the hashing thread"), io)
        });
        io?;
        pending = Some((i, hashed));
        // hashing -> writing, reading -> hashing, writing -> reading.
        std::mem::swap(&mut writing, &mut hashing);
        std::mem::swap(&mut hashing, &mut reading);
    }
    if let Some((j, d)) = pending {
        kept += writing.write(dest, batches[j], d)?;
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_file_digest_match_the_copys_encoding() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data: Vec<u8> = (0..(5 * 4096 + 17)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let src = SourceFile::open(&p).unwrap();
        let c = content(&src, Check::Blake3, 4096, true).unwrap();
        let want: Vec<Sha256Digest> = data.chunks(4096).map(|b| Check::Blake3.block(b)).collect();
        assert_eq!(c.blocks, want);
        assert_eq!(c.len, data.len() as u64);
        assert_eq!(
            c.digest,
            file_digest_with(Check::Blake3, data.len() as u64, 4096, &want)
        );
        let empty = dir.path().join("e");
        std::fs::write(&empty, b"").unwrap();
        let e = content(
            &SourceFile::open(&empty).unwrap(),
            Check::Blake3,
            4096,
            true,
        )
        .unwrap();
        assert!(e.blocks.is_empty());
    }

    #[test]
    fn seed_keeps_only_the_blocks_the_old_copy_still_holds() {
        let dir = tempfile::tempdir().unwrap();
        let old: Vec<u8> = (0..(4 * 4096 + 100)).map(|i| (i % 253) as u8).collect();
        let p = dir.path().join("f");
        std::fs::write(&p, &old).unwrap();
        let mut new = old.clone();
        new[4096 + 7] ^= 0xff;
        let digests: Vec<Sha256Digest> = new.chunks(4096).map(|b| Check::Blake3.block(b)).collect();
        // Asked to keep every block but 1; block 3's digest is wrong.
        let mut keep: Vec<(u64, Sha256Digest)> = [0u64, 2, 3, 4]
            .iter()
            .map(|&b| (b, digests[b as usize]))
            .collect();
        keep[2].1 = [7; 32];
        let d = crate::files::DirHandle::open(dir.path()).unwrap();
        let opts = crate::files::DestinationOptions {
            block_size: 4096,
            check: Check::Blake3,
            ..Default::default()
        };
        let mut dest = Destination::create(&d, "f", new.len() as u64, opts).unwrap();
        let src = SourceFile::open(&p).unwrap();
        assert_eq!(seed(&src, &mut dest, &keep, Check::Blake3).unwrap(), 3);
        assert_eq!(dest.missing_blocks(), vec![1, 3]);
        dest.abort();
    }

    /// Across batches (three here: the pipeline reads one while it hashes
    /// another and writes a third), each block is kept or left missing by
    /// its own digest, and what is kept is the old copy's bytes.
    #[test]
    fn seed_across_batches_keeps_each_block_by_its_own_digest() {
        let dir = tempfile::tempdir().unwrap();
        let n = 2 * SEED_BATCH as u64 + 5;
        let old: Vec<u8> = (0..(n * 4096)).map(|i| (i * 31 % 251) as u8).collect();
        let p = dir.path().join("f");
        std::fs::write(&p, &old).unwrap();
        let digests: Vec<Sha256Digest> = old.chunks(4096).map(|b| Check::Blake3.block(b)).collect();
        let wrong = [3u64, SEED_BATCH as u64 + 1, 2 * SEED_BATCH as u64 + 4];
        let keep: Vec<(u64, Sha256Digest)> = (0..n)
            .map(|b| {
                (
                    b,
                    if wrong.contains(&b) {
                        [9; 32]
                    } else {
                        digests[b as usize]
                    },
                )
            })
            .collect();
        let d = crate::files::DirHandle::open(dir.path()).unwrap();
        let opts = crate::files::DestinationOptions {
            block_size: 4096,
            check: Check::Blake3,
            ..Default::default()
        };
        let mut dest = Destination::create(&d, "g", old.len() as u64, opts).unwrap();
        let src = SourceFile::open(&p).unwrap();
        let kept = seed(&src, &mut dest, &keep, Check::Blake3).unwrap();
        assert_eq!(kept, n - wrong.len() as u64);
        assert_eq!(dest.missing_blocks(), wrong.to_vec());
        let tmp = std::fs::read(dest.temp_path()).unwrap();
        for b in (0..n).filter(|b| !wrong.contains(b)) {
            let r = (b * 4096) as usize..((b + 1) * 4096) as usize;
            assert!(
                tmp[r.clone()] == old[r],
                "block {b} holds the old copy's bytes"
            );
        }
        dest.abort();
    }
}
