//! `--delta`: a file that exists at the destination and differs moves only
//! its blocks whose digests differ; the others are taken from the
//! destination's current copy. Block-aligned with the copy's block size:
//! what is kept or moved is whole blocks, as one-sided RDMA moves them.
//!
//! [`prepare`] runs in the plan, after [`super::skip`]: both ends hash
//! their copy per block at once (rcpd through `Digests`, in batches of
//! files, on its hashing pool), then
//! - push: the file's [`FileSpec`](crate::control::protocol::FileSpec)
//!   names the blocks that match and their digests (`keep_blocks`); rcpd
//!   starts the new file from them and asks for the rest
//!   (`server::delta`);
//! - pull: a resumable partial of the file is made beside the local
//!   destination from the blocks that match, with the manifest of the
//!   remote source's identity, and the file is pulled with resume: the
//!   existing resume path moves the rest.
//!
//! Either way the new file is verified whole against the source's digest
//! and replaces the old one atomically, as every copy does.

use std::path::{Path, PathBuf};

use super::contents::{content_check, local_contents, remote_contents};
use super::Plan;
use crate::control::client::Client;
use crate::control::error::{ControlError, Result};
use crate::control::fsutil;
use crate::control::protocol::Bitmap;
use crate::files::content::{self, Content};
use crate::files::{Check, Destination, DestinationOptions, DirHandle, Sha256Digest, SourceFile};

/// Bytes of block `b` of a `len`-byte file.
fn block_len(len: u64, bs: u64, b: u64) -> u64 {
    len.saturating_sub(b * bs).min(bs)
}

/// The blocks of the new file (`src`'s content) the destination's copy
/// (`dst`) holds already: same index, same length, same digest.
pub fn matching(src: &Content, dst: &Content, bs: u64) -> Vec<(u64, Sha256Digest)> {
    src.blocks
        .iter()
        .zip(&dst.blocks)
        .enumerate()
        .map(|(b, (s, d))| (b as u64, s, d))
        .filter(|&(b, s, d)| s == d && block_len(src.len, bs, b) == block_len(dst.len, bs, b))
        .map(|(b, s, _)| (b, *s))
        .collect()
}

/// Make the planned files at `idx` (each with a regular file at its
/// destination) move only the blocks that differ, as the module says.
pub async fn prepare(client: &Client, plan: &mut Plan, idx: &[usize]) -> Result<()> {
    if idx.is_empty() {
        return Ok(());
    }
    let check = content_check(client);
    let bs = client.options().block_size;
    let (remote, local): (Vec<String>, Vec<PathBuf>) = idx
        .iter()
        .map(|&i| {
            let f = &plan.files[i];
            let remote = if plan.push { &f.dest } else { &f.source };
            (remote.clone(), f.job.local.clone())
        })
        .unzip();
    let (r, l) = tokio::join!(
        remote_contents(client, remote, check, bs, true),
        local_contents(local, check, bs, true)
    );
    for ((&i, r), l) in idx.iter().zip(r?).zip(l?) {
        let (Some(r), Some(l)) = (r, l) else { continue };
        let (src, dst) = if plan.push { (&l, &r) } else { (&r, &l) };
        let keep = matching(src, dst, bs);
        if keep.is_empty() {
            continue;
        }
        let f = &mut plan.files[i];
        if plan.push {
            let mut bits = Bitmap::new(src.len.div_ceil(bs));
            for &(b, _) in &keep {
                bits.set(b);
            }
            f.job.spec.keep_blocks = bits.bits;
            f.job.spec.keep_digests = keep.iter().map(|(_, d)| check.wire(d)).collect();
        } else if seed_pull(client, &f.source, &f.job.local, keep, check, bs).await? {
            f.job.spec.resume = true;
        }
    }
    Ok(())
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
        let (Some(parent), Some(name)) = (local.parent(), local.file_name()) else {
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
    fn only_same_blocks_of_the_same_length_are_kept() {
        let d = |x: u8| [x; 32];
        let src = Content {
            len: 10,
            digest: d(0),
            blocks: vec![d(1), d(2), d(3)],
        };
        // Block 1 differs; block 2 has another length (the file grew).
        let dst = Content {
            len: 12,
            digest: d(9),
            blocks: vec![d(1), d(7), d(3)],
        };
        assert_eq!(matching(&src, &dst, 4), vec![(0, d(1))]);
        let same_len = Content { len: 10, ..dst };
        assert_eq!(matching(&src, &same_len, 4), vec![(0, d(1)), (2, d(3))]);
    }
}
