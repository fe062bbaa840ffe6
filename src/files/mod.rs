//! The file layer: everything rcp does with files on disk, no networking.
//!
//! # Types that matter
//! - [`Root`] (server): the served directory. Every remote path string goes through
//!   [`normalize`] and is then resolved *beneath* the root fd
//!   (`openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS)`, or an `O_NOFOLLOW` walk on
//!   old kernels). Gives [`Root::open_read`], [`Root::stat`]/[`Root::lstat`],
//!   [`Root::list`], [`Root::open_dir`], [`Root::create_dir_all`],
//!   [`Root::symlink`], [`Root::walk`]. Refusals are [`PathError`]s naming the path:
//!   `Absolute`, `Escapes`, `SymlinkOutside`, `SymlinkLoop`, `NotFound`,
//!   `NotADirectory`, `NotRegularFile`, ...
//! - [`DirHandle`]: an open directory to create files in: from [`Root::open_dir`] /
//!   [`Root::create_dir_all`] (server) or [`DirHandle::open`] (client, local path).
//! - [`Destination`] (receiving side): a temp file `.rcp-<final>.<random>.part` in
//!   that directory; `write_block`/`write_at` verified data; `commit(expected_sha256)`
//!   checks the whole-file digest, applies `-p`, fsyncs, renames into place, fsyncs
//!   the directory. With [`DestinationOptions::resume`] set, a manifest
//!   ([`Manifest`]) next to it records verified blocks, and [`Destination::resume`]
//!   picks an interrupted copy back up.
//! - [`SourceFile`] (sending side): length/mode/mtime, a [`SourceId`], and
//!   `read_at` straight into the caller's (registered) buffer, `O_DIRECT` when
//!   aligned, buffered otherwise ([`IoMode`]).
//! - [`digest`]: [`block_digest`], [`digest_blocks_parallel`] (on a process-wide pool,
//!   [`set_pool_threads`]), and [`StreamingFileDigest`], the `sha256sum` of a file fed
//!   from out-of-order blocks.
//! - [`WriteBehind`]: a [`Destination`] handed to a writer thread, so the
//!   receiver checks window N+1 while window N is written and hashed.
//! - [`tree`]: [`walk`] for `-r` (never follows symlinks) and
//!   [`resolve_destination`] (scp naming rules).
//!
//! # Invariants
//! - **No partial file under a final name.** Data is only ever written to the
//!   `.rcp-…part` temp file; the final name appears (or an existing file there is
//!   replaced) in one `renameat`, after the whole-file SHA-256 matched. Failure,
//!   abort, drop or SIGKILL leave the final name as it was.
//! - **Paths confined beneath the root.** No remote path, `..`, or symlink (however
//!   chained) resolves outside [`Root`]; every step is relative to an fd already
//!   beneath it. Names given for new objects are single plain components.
//! - No `unsafe` here: fds are owned (`OwnedFd`/`File`) via `rustix`.

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
pub mod write_behind;

pub use commit::{
    publish, Destination, DestinationOptions, Preserve, Published, Sealed, DEFAULT_BLOCK_SIZE,
};
pub use digest::{
    block_digest, digest_blocks_parallel, digests_alongside, file_digest, set_pool_threads,
    FileDigest, Sha256Digest, StreamingFileDigest,
};
pub use error::{DigestError, FileError, ManifestError, PathError, Result};
pub use manifest::{Manifest, SourceId};
pub use path::{normalize, RelPath};
pub use reader::{IoMode, ReadStats, SourceFile, DIRECT_ALIGN};
pub use root::{DirHandle, FileKind, FileMeta, ListEntry, Resolver, Root, Timestamp};
pub use tree::{resolve_destination, walk, Entry, EntryKind, Skipped, Tree};
pub use write_behind::WriteBehind;

/// The prefix of every temporary object next to `name`: `.rcp-<name, at most 200 bytes>.`
pub(crate) fn temp_prefix(name: &OsStr) -> Vec<u8> {
    let b = name.as_bytes();
    let mut out = b".rcp-".to_vec();
    out.extend_from_slice(&b[..b.len().min(200)]);
    out.push(b'.');
    out
}

/// 8 bytes no one else can predict, distinct for every call in this process:
/// SHA-256 of a per-process random key and a counter (one `getrandom` per
/// process, not one per temporary file).
fn unique_tag() -> [u8; 8] {
    use sha2::{Digest, Sha256};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let key = KEY.get_or_init(|| {
        let mut k = [0u8; 32];
        getrandom::getrandom(&mut k).expect("getrandom");
        k
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = Sha256::new()
        .chain_update(key)
        .chain_update(n.to_le_bytes())
        .finalize();
    h[..8].try_into().expect("8 bytes")
}

/// `.rcp-<name>.<16 hex>.<suffix>`, the name of a temporary object next to `name`,
/// kept within NAME_MAX by shortening `name`. The 16 hex digits are unpredictable
/// to other processes; creation uses `O_EXCL` all the same.
pub(crate) fn temp_name(name: &OsStr, suffix: &str) -> OsString {
    let mut out = temp_prefix(name);
    out.extend_from_slice(hex::encode(unique_tag()).as_bytes());
    out.push(b'.');
    out.extend_from_slice(suffix.as_bytes());
    OsString::from_vec(out)
}
