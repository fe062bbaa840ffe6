//! What files hold on each end, as digests of the session's check: rcpd's
//! in batches of `Digests` calls ([`remote_contents`]), the local ones on
//! the hashing pool ([`local_contents`]). `-c` compares file digests
//! ([`super::skip`]), `--delta` block digests ([`super::delta`]).

use std::path::PathBuf;

use futures::{StreamExt, TryStreamExt};

use crate::control::client::Client;
use crate::control::error::{ControlError, Result};
use crate::files::content::{block_digests, contents, Content};
use crate::files::digest::on_pool;
use crate::files::{Check, KnownBlocks, SourceFile};
use crate::proto;

/// The check whose digests `-c` compares: the first of the client's
/// `--verify` that hashes (BLAKE3 unless told).
pub(super) fn content_check(client: &Client) -> Check {
    client
        .options()
        .verify
        .iter()
        .copied()
        .find(|c| !c.is_none())
        .unwrap_or(Check::Blake3)
}

/// Files per `Digests` call, and calls in flight.
const DIGEST_BATCH: usize = 256;
const DIGESTS_IN_FLIGHT: usize = 4;

/// rcpd's [`Content`] of each of `paths` (beneath its root), in batches,
/// `None` where it holds no regular file.
pub async fn remote_contents(
    client: &Client,
    paths: Vec<String>,
    check: Check,
    block_size: u64,
    blocks: bool,
) -> Result<Vec<Option<Content>>> {
    let batches: Vec<Vec<String>> = paths.chunks(DIGEST_BATCH).map(|c| c.to_vec()).collect();
    let answers: Vec<Vec<proto::FileDigests>> = futures::stream::iter(batches)
        .map(|b| client.digests(b, check, block_size, blocks))
        .buffered(DIGESTS_IN_FLIGHT)
        .try_collect()
        .await?;
    let bad = || ControlError::Invalid("rcpd answered Digests with malformed digests".into());
    let mut out = Vec::with_capacity(paths.len());
    for d in answers.into_iter().flatten() {
        if !d.exists {
            out.push(None);
            continue;
        }
        let digest = check.from_wire(&d.digest).ok_or_else(bad)?;
        let blocks = d
            .blocks
            .iter()
            .map(|b| check.from_wire(b).ok_or_else(bad))
            .collect::<Result<Vec<_>>>()?;
        out.push(Some(Content {
            len: d.length,
            digest,
            blocks,
        }));
    }
    if out.len() != paths.len() {
        return Err(ControlError::Invalid(format!(
            "rcpd answered Digests for {} files of {}",
            out.len(),
            paths.len()
        )));
    }
    Ok(out)
}

/// The local [`Content`] of each of `paths`, on the hashing pool.
pub async fn local_contents(
    paths: Vec<PathBuf>,
    check: Check,
    block_size: u64,
    blocks: bool,
) -> Result<Vec<Option<Content>>> {
    let r = tokio::task::spawn_blocking(move || {
        contents(
            &paths,
            |p| match SourceFile::open(p) {
                Ok(s) if s.meta().kind == crate::files::FileKind::File => Ok(Some(s)),
                Ok(_) => Ok(None),
                Err(crate::files::FileError::Path(crate::files::PathError::NotFound {
                    ..
                })) => Ok(None),
                Err(e) => Err(e),
            },
            check,
            block_size,
            blocks,
        )
    })
    .await
    .map_err(|e| ControlError::Other(format!("hashing local files: {e}")))?;
    r.into_iter()
        .map(|c| c.map_err(ControlError::from))
        .collect()
}

/// The block digests of each local file of `paths` with its identity then
/// ([`KnownBlocks`]: what the copy's own open of the unchanged file takes
/// instead of hashing it again), a file per pool thread; `None` where there
/// is no regular file.
pub async fn local_known(
    paths: Vec<PathBuf>,
    check: Check,
    block_size: u64,
) -> Result<Vec<Option<KnownBlocks>>> {
    let r = tokio::task::spawn_blocking(move || {
        on_pool(&paths, |p| -> crate::files::Result<Option<KnownBlocks>> {
            let src = match SourceFile::open(p) {
                Ok(s) if s.meta().kind == crate::files::FileKind::File => s,
                Ok(_) => return Ok(None),
                Err(crate::files::FileError::Path(crate::files::PathError::NotFound {
                    ..
                })) => return Ok(None),
                Err(e) => return Err(e),
            };
            let blocks = block_digests(&src, check, block_size)?;
            Ok(Some(KnownBlocks::of(&src, check, block_size, blocks)))
        })
    })
    .await
    .map_err(|e| ControlError::Other(format!("hashing local files: {e}")))?;
    r.into_iter()
        .map(|c| c.map_err(ControlError::from))
        .collect()
}
