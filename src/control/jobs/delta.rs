//! `--delta`: a file that exists at the destination and differs moves only
//! its blocks whose digests differ; the others are taken from the
//! destination's current copy. Block-aligned with the copy's block size:
//! what is kept or moved is whole blocks, as one-sided RDMA moves them.
//!
//! [`prepare`] runs in the plan, after [`super::skip`]: the end that holds
//! the source hashes it per block (the client its local file on a push,
//! rcpd through `Digests`, in batches of files, on a pull), and the end
//! that holds the old copy compares each of its blocks with those digests
//! as it starts the new file from it, reading and hashing the old copy
//! once:
//! - push: the file's [`FileSpec`](crate::control::protocol::FileSpec)
//!   names every block and its digest (`keep_blocks`, `keep_digests`);
//!   rcpd starts the new file from the blocks of its copy that hash to
//!   them and asks for the rest (`server::delta`);
//! - pull: a resumable partial of the file is made beside the local
//!   destination from the local blocks that hash to the remote source's,
//!   with the manifest of the remote source's identity, and the file is
//!   pulled with resume: the existing resume path moves the rest.
//!
//! Either way the new file is verified whole against the source's digest
//! and replaces the old one atomically, as every copy does.

use std::path::Path;
use std::sync::Arc;

use super::contents::{content_check, local_known, remote_contents};
use super::Plan;
use crate::control::client::{Client, KnownSource, OpenWith};
use crate::control::error::{ControlError, Result};
use crate::control::fsutil;
use crate::control::protocol::{Bitmap, OPEN_DIGEST_BYTES};
use crate::files::content;
use crate::files::{Check, Destination, DestinationOptions, DirHandle, Sha256Digest, SourceFile};

/// Make the planned files at `idx` (each with a regular file at its
/// destination) move only the blocks that differ, as the module says.
pub async fn prepare(client: &Client, plan: &mut Plan, idx: &[usize]) -> Result<()> {
    if idx.is_empty() {
        return Ok(());
    }
    let check = content_check(client);
    let bs = client.options().block_size;
    // A file's block digests go in one message (OpenFile, or rcpd's
    // Digests answer): a file with more moves whole.
    let idx: Vec<usize> = idx
        .iter()
        .copied()
        .filter(|&i| {
            let f = &plan.files[i];
            let n = f.bytes.div_ceil(bs);
            let fits = digest_bytes(n) <= OPEN_DIGEST_BYTES;
            if !fits {
                let name = if plan.push {
                    f.job.local.display().to_string()
                } else {
                    f.source.clone()
                };
                tracing::warn!(
                    "--delta: {name} has {n} blocks, more digests than one message carries; \
                     it moves whole (a larger --block-size would keep its unchanged blocks)"
                );
            }
            fits
        })
        .collect();
    let idx = &idx[..];
    if plan.push {
        // The local sources' block digests, kept for the copy's own open of
        // each (the blocks that do not move are not read again).
        let local = idx
            .iter()
            .map(|&i| plan.files[i].job.local.clone())
            .collect();
        for (&i, known) in idx.iter().zip(local_known(local, check, bs).await?) {
            let Some(known) = known else { continue };
            let f = &mut plan.files[i];
            let n = known.blocks().len() as u64;
            f.job.spec.keep_blocks = Bitmap::all_but(n, &[]).bits;
            f.job.spec.keep_digests = known.blocks().iter().map(|d| check.wire(d)).collect();
            // A fan-out's source reads through its own Source: keep it.
            if f.job.source.is_none() {
                f.job.source = Some(OpenWith(Arc::new(KnownSource {
                    path: f.job.local.clone(),
                    known: Arc::new(known),
                })));
            }
        }
        return Ok(());
    }
    // Pull: rcpd's digests of its source; the local copy is hashed once,
    // by the seed that compares it with them.
    // Files per Digests call by the bytes of their digests, so that each
    // answer fits a message.
    let mut sources = Vec::with_capacity(idx.len());
    for group in by_digest_bytes(idx.iter().map(|&i| plan.files[i].bytes.div_ceil(bs))) {
        let remote = group.map(|k| plan.files[idx[k]].source.clone()).collect();
        sources.extend(remote_contents(client, remote, check, bs, true).await?);
    }
    for (&i, src) in idx.iter().zip(sources) {
        let Some(src) = src else { continue };
        let keep: Vec<(u64, Sha256Digest)> = src
            .blocks
            .into_iter()
            .zip(0u64..)
            .map(|(d, b)| (b, d))
            .collect();
        let f = &mut plan.files[i];
        if seed_pull(client, &f.source, &f.job.local, keep, check, bs).await? {
            f.job.spec.resume = true;
        }
    }
    Ok(())
}

/// Bytes of `n` block digests in a message, at most (32-byte digests).
fn digest_bytes(n: u64) -> usize {
    (n as usize).div_ceil(8) + n as usize * (32 + 2)
}

/// Consecutive ranges of indices into `blocks` (each file's block count)
/// whose digests together fit [`OPEN_DIGEST_BYTES`] (a file alone always
/// forms a range).
fn by_digest_bytes(blocks: impl Iterator<Item = u64>) -> Vec<std::ops::Range<usize>> {
    let sizes: Vec<usize> = blocks.map(digest_bytes).collect();
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (k, &d) in sizes.iter().enumerate() {
        if k > start && bytes + d > OPEN_DIGEST_BYTES {
            out.push(start..k);
            (start, bytes) = (k, 0);
        }
        bytes += d;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Pull: a resumable partial of the remote `source` beside `local` (its
/// destination, which holds the blocks of `keep`); whether one was made.
async fn seed_pull(
    client: &Client,
    source: &str,
    local: &Path,
    keep: Vec<(u64, Sha256Digest)>,
    check: Check,
    bs: u64,
) -> Result<bool> {
    // The source's identity, as a pull resume checks it.
    let Some(entry) = client.stat_with(source, true).await? else {
        return Ok(false);
    };
    let local = local.to_path_buf();
    tokio::task::spawn_blocking(move || -> Result<bool> {
        let (Some(parent), Some(name)) = (fsutil::parent_dir(&local), local.file_name()) else {
            return Ok(false);
        };
        let dir = DirHandle::open(parent)?;
        let sid = fsutil::source_id(entry.length, entry.mtime_ns, &entry.fingerprint);
        let opts = DestinationOptions {
            block_size: bs,
            check,
            resume: Some(sid),
            ..DestinationOptions::default()
        };
        // An interrupted copy of this source: resume it as it is.
        if let Some(d) = Destination::resume(&dir, name, &sid, opts.clone())? {
            d.suspend()?;
            return Ok(true);
        }
        let mut d = Destination::create(&dir, name, entry.length, opts)?;
        let kept = content::seed(&SourceFile::open(&local)?, &mut d, &keep, check)?;
        if kept == 0 {
            d.abort();
            return Ok(false);
        }
        d.suspend()?;
        Ok(true)
    })
    .await
    .map_err(|e| ControlError::Other(format!("seeding {}: {e}", source)))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_calls_are_grouped_to_fit_a_message() {
        // ~25 000 blocks' digests are 850 kB: two fit half a message.
        let g = by_digest_bytes([25_000u64, 25_000, 25_000, 10, 10].into_iter());
        assert_eq!(g, vec![0..2, 2..5]);
        // Small files all go together; none, no call.
        assert_eq!(by_digest_bytes([4u64; 300].into_iter()), vec![0..300]);
        assert!(by_digest_bytes(std::iter::empty()).is_empty());
        // Each file within the bound on its own range at worst.
        let g = by_digest_bytes([60_000u64, 60_000].into_iter());
        assert_eq!(g, vec![0..1, 1..2]);
    }
}
