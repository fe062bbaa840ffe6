//! The `Digests` RPC: what files beneath the root hold, as the digests of
//! [`crate::files::content`], for `rcp -c` and `--delta`
//! ([`crate::control::jobs::skip`]). A batch of files per call, hashed on
//! the process-wide hashing pool (a file per pool thread).

use crate::control::error::{ControlError, Result};
use crate::control::fsutil;
use crate::control::protocol::{check_block_size, check_from_wire};
use crate::files::content::contents;
use crate::files::{FileError, PathError, Root, SourceFile};
use crate::proto;

/// Paths one call may name.
pub const MAX_PATHS: usize = 4096;

/// Answer `req` from the files beneath `root` (blocking: call it off the
/// runtime's worker or in place).
pub fn answer(root: &Root, req: &proto::DigestsRequest) -> Result<proto::DigestsResponse> {
    if req.paths.len() > MAX_PATHS {
        return Err(ControlError::Invalid(format!(
            "Digests of {} paths: at most {MAX_PATHS} per call",
            req.paths.len()
        )));
    }
    let check = check_from_wire(req.check)
        .filter(|c| !c.is_none())
        .ok_or_else(|| ControlError::Invalid(format!("Digests with check {}", req.check)))?;
    let block_size = check_block_size(req.block_size, crate::control::WINDOW_SIZE as u64)
        .map_err(ControlError::Invalid)?;
    let found = contents(
        &req.paths,
        |p| match SourceFile::open_in(root, &fsutil::root_rel(p)) {
            Ok(s) => Ok(Some(s)),
            // Not there, or not a regular file: the client copies it.
            Err(FileError::Path(PathError::NotFound { .. } | PathError::NotRegularFile { .. })) => {
                Ok(None)
            }
            Err(e) => Err(e),
        },
        check,
        block_size,
        req.blocks,
    );
    let mut files = Vec::with_capacity(found.len());
    for c in found {
        files.push(match c? {
            None => proto::FileDigests::default(),
            Some(c) => proto::FileDigests {
                exists: true,
                length: c.len,
                digest: check.wire(&c.digest),
                blocks: c.blocks.iter().map(|b| check.wire(b)).collect(),
            },
        });
    }
    Ok(proto::DigestsResponse { files })
}
