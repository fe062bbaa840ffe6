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
    let all: Vec<u64> = (0..src.len().div_ceil(block_size)).collect();
    digests_of(src, check, block_size, &all)
}

/// The digests of blocks `blocks` of `src` cut at `block_size` (in their
/// order), read with `pread` (buffered) and hashed on the pool, a few
/// blocks per task. A block read short (the file shrank) is hashed as read.
pub fn digests_of(
    src: &SourceFile,
    check: Check,
    block_size: u64,
    blocks: &[u64],
) -> Result<Vec<Sha256Digest>> {
    let len = src.len();
    let tasks: Vec<&[u64]> = blocks.chunks(BLOCKS_PER_TASK as usize).collect();
    let hash_task = |t: &&[u64]| -> Result<Vec<Sha256Digest>> {
        BLOCK_BUF.with_borrow_mut(|buf| {
            let mut out = Vec::with_capacity(t.len());
            for &b in t.iter() {
                let off = b * block_size;
                let want = len.saturating_sub(off).min(block_size) as usize;
                if buf.len() < want {
                    buf.resize(want, 0);
                }
                let got = src.read_at(off, &mut buf[..want])?;
                out.push(check.block(&buf[..got]));
            }
            Ok(out)
        })
    };
    let parts = on_pool(&tasks, hash_task);
    let mut all = Vec::with_capacity(blocks.len());
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

/// Blocks one task of [`seed`] reads, hashes and writes, on one pool
/// thread.
const SEED_BATCH: usize = 4;

thread_local! {
    /// A pool thread's buffer for the blocks it reads ([`seed`],
    /// [`digests_of`]), kept between tasks (a fresh buffer per block costs
    /// its page faults and clearing).
    static BLOCK_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `--delta`: write into `dest` (fresh) each block of `keep` (index and
/// digest under `check`, the destination's) that `src`, the file now at the
/// destination's name, holds: read, hashed, and written as if it had
/// arrived when its digest is the one asked for; the written bytes are the
/// hashed ones (read once into a buffer of this process). A block `src`
/// does not hold (shorter, changed) is left missing: it moves. Returns how
/// many were kept. The blocks are spread over the hashing pool, a few per
/// task, each thread reading, hashing and writing its own (the temp file
/// is written at their offsets from every thread at once); they are
/// recorded in `dest` afterwards, in order.
pub fn seed(
    src: &SourceFile,
    dest: &mut Destination,
    keep: &[(u64, Sha256Digest)],
    check: Check,
) -> Result<u64> {
    if check.is_none() || keep.is_empty() {
        return Ok(0);
    }
    let tasks: Vec<&[(u64, Sha256Digest)]> = keep.chunks(SEED_BATCH).collect();
    let bs = dest.block_size();
    let d: &Destination = dest;
    let task = |t: &&[(u64, Sha256Digest)]| -> Result<Vec<(u64, Sha256Digest)>> {
        BLOCK_BUF.with_borrow_mut(|buf| {
            let mut kept = Vec::with_capacity(t.len());
            for &(b, want) in t.iter() {
                if b >= d.block_count() || b * bs >= src.len() {
                    continue;
                }
                let len = d.block_len(b) as usize;
                if buf.len() < len {
                    buf.resize(len, 0);
                }
                let block = &mut buf[..len];
                if src.read_at(b * bs, block)? != len || check.block(block) != want {
                    continue;
                }
                d.write_unrecorded(b, block)?;
                kept.push((b, want));
            }
            Ok(kept)
        })
    };
    let done = on_pool(&tasks, task);
    let mut kept = 0;
    for t in done {
        for (b, digest) in t? {
            dest.record_written(b, digest)?;
            kept += 1;
        }
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

    #[test]
    fn a_seeded_file_has_the_flat_sha256_of_its_bytes() {
        // Many blocks (tasks on several pool threads), kept ones recorded
        // out of the flat digest's order, then the changed ones arriving.
        let dir = tempfile::tempdir().unwrap();
        let old: Vec<u8> = (0..(40 * 4096 + 100))
            .map(|i| (i * 13 % 251) as u8)
            .collect();
        let p = dir.path().join("f");
        std::fs::write(&p, &old).unwrap();
        let mut new = old.clone();
        for b in [0usize, 17, 40] {
            new[b * 4096] ^= 0xff;
        }
        let digests: Vec<Sha256Digest> = new.chunks(4096).map(|b| Check::Blake3.block(b)).collect();
        let keep: Vec<(u64, Sha256Digest)> = digests
            .iter()
            .copied()
            .zip(0u64..)
            .map(|(d, b)| (b, d))
            .collect();
        let d = crate::files::DirHandle::open(dir.path()).unwrap();
        let opts = crate::files::DestinationOptions {
            block_size: 4096,
            check: Check::Blake3,
            flat_sha256: true,
            ..Default::default()
        };
        let mut dest = Destination::create(&d, "f", new.len() as u64, opts).unwrap();
        let src = SourceFile::open(&p).unwrap();
        assert_eq!(seed(&src, &mut dest, &keep, Check::Blake3).unwrap(), 38);
        assert_eq!(dest.missing_blocks(), vec![0, 17, 40]);
        for b in [17u64, 40, 0] {
            let block = new.chunks(4096).nth(b as usize).unwrap();
            dest.write_block(b, block, digests[b as usize]).unwrap();
        }
        let flat = crate::files::digest::block_digest(&new);
        dest.seal_flat(flat).unwrap().publish().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), new);
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
