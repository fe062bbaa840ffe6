//! The file layer (placeholder doc, rewritten below).

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

pub mod commit;
pub mod digest;
pub mod error;
pub mod manifest;
pub mod path;
pub mod reader;
pub mod root;
pub mod tree;

pub use commit::{Destination, DestinationOptions, Preserve, DEFAULT_BLOCK_SIZE};
pub use digest::{
    block_digest, digest_blocks_parallel, DigestPool, Sha256Digest, StreamingFileDigest,
};
pub use error::{DigestError, FileError, ManifestError, PathError, Result};
pub use manifest::{Manifest, SourceId};
pub use path::{normalize, RelPath};
pub use reader::{IoMode, ReadStats, SourceFile, DIRECT_ALIGN};
pub use root::{DirHandle, FileKind, FileMeta, ListEntry, Resolver, Root, Timestamp};
pub use tree::{resolve_destination, walk, Entry, EntryKind, Skipped, Tree};

/// The prefix of every temporary object next to `name`: `.rcp-<name, at most 200 bytes>.`
pub(crate) fn temp_prefix(name: &OsStr) -> Vec<u8> {
    let b = name.as_bytes();
    let mut out = b".rcp-".to_vec();
    out.extend_from_slice(&b[..b.len().min(200)]);
    out.push(b'.');
    out
}

/// `.rcp-<name>.<16 hex>.<suffix>`, the name of a temporary object next to `name`,
/// kept within NAME_MAX by shortening `name`.
pub(crate) fn temp_name(name: &OsStr, suffix: &str) -> OsString {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    let mut out = temp_prefix(name);
    out.extend_from_slice(hex::encode(b).as_bytes());
    out.push(b'.');
    out.extend_from_slice(suffix.as_bytes());
    OsString::from_vec(out)
}
