//! Push `--delta` on rcpd: a new file starts from the blocks the file now
//! at its final name holds already. The client names the blocks it may
//! hold (every block of the source) with the source's digests of them
//! (`OpenFile.keep_blocks`, `keep_digests`); each is read from the existing
//! file, hashed under the session's check (on the hashing pool, a batch of
//! blocks at a time) and, when it matches, written into the new file as if
//! it had arrived ([`Destination::write_block`]): the old copy is read and
//! hashed once.
//! Those blocks are then not missing: `Opened.skip_blocks` lists them, the
//! rest moves, and the file is verified and committed whole, as always.

use crate::control::fsutil;
use crate::control::protocol::Bitmap;
use crate::files::content;
use crate::files::{Check, Destination, FileError, PathError, Root, SourceFile};
use crate::proto;

/// Seed `dest` (fresh, nothing written yet) from the file at `rel` beneath
/// `root` with the blocks `open` asks to keep; the number kept. A file
/// that is gone or changed keeps fewer blocks (they move instead).
pub fn seed(
    root: &Root,
    rel: &str,
    open: &proto::OpenFile,
    dest: &mut Destination,
    check: Check,
) -> Result<u64, FileError> {
    let n = dest.block_count();
    let Some(bits) = Bitmap::from_bytes(open.keep_blocks.clone(), n) else {
        return Ok(0);
    };
    let blocks: Vec<u64> = (0..n).filter(|&b| bits.get(b)).collect();
    if blocks.len() != open.keep_digests.len() {
        return Ok(0);
    }
    let mut keep = Vec::with_capacity(blocks.len());
    for (b, d) in blocks.into_iter().zip(&open.keep_digests) {
        match check.from_wire(d) {
            Some(d) => keep.push((b, d)),
            // Another check than the session's: nothing to compare.
            None => return Ok(0),
        }
    }
    let src = match SourceFile::open_in(root, &fsutil::root_rel(rel)) {
        Ok(s) => s,
        Err(FileError::Path(PathError::NotFound { .. } | PathError::NotRegularFile { .. })) => {
            return Ok(0)
        }
        Err(e) => return Err(e),
    };
    content::seed(&src, dest, &keep, check)
}
