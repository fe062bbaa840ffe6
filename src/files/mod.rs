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
//! - [`DirCache`]: the few directories a stream opened last, so that a tree's
//!   files are created beside a handle already open.
//! - [`Destination`] (receiving side): a temp file `.rcp-<final>.<random>.part` in
//!   that directory (unnamed, `O_TMPFILE`, for a file of one block where nothing
//!   stands); `write_block` writes verified blocks (`O_DIRECT` when aligned and
//!   the file system allows it, buffered otherwise: [`direct`]) and records their digests;
//!   `seal(expected)` checks that every block is there and that the file digest
//!   derived from the block digests ([`file_digest`]) matches, and applies `-p`,
//!   giving a [`Sealed`] file; [`publish`](fn@publish) takes a batch of them: data durable (one
//!   `syncfs` per file system, `fdatasync` for a lone file), then `renameat` each into
//!   place, then one fsync per directory. `commit(expected)` is seal + publish of one.
//!   With [`DestinationOptions::flat_sha256`] the flat `sha256sum` value is computed
//!   too ([`Destination::seal_flat`] checks that one instead). With
//!   [`DestinationOptions::resume`] set, a file of more than one block keeps a
//!   manifest ([`Manifest`]) next to it recording verified blocks, and
//!   [`Destination::resume`] picks an interrupted copy back up.
//! - [`SourceFile`] (sending side): length/mode/mtime, a [`SourceId`], and
//!   `read_at` straight into the caller's (registered) buffer, `O_DIRECT` when
//!   aligned, buffered otherwise ([`IoMode`]).
//! - [`digest`]: [`block_digest`], [`digest_blocks_parallel`] (on a process-wide pool,
//!   [`set_pool_threads`]), the derived file digest [`file_digest`] / [`FileDigest`]
//!   (`rcp-file-digest-v1`, `rcp-file-digest-blake3-v1`: encodings in [`digest`]'s doc), and
//!   [`StreamingFileDigest`], the flat `sha256sum` of a file fed from out-of-order
//!   blocks.
//! - [`WriteBehind`]: a [`Destination`] handed to a writer thread, so the
//!   receiver checks window N+1 while window N is written.
//! - [`tree`]: [`walk`] for `-r` (never follows symlinks) and
//!   [`resolve_destination`] (scp naming rules).
//!
//! # Invariants
//! - **No file under its final name before its bytes are verified and on stable
//!   storage.** Data is only ever written to the `.rcp-…part` temp file (or an
//!   unnamed one, for a file of one block where nothing stands); the final
//!   name appears (or an existing file there is replaced) in one `renameat` (or
//!   `linkat`), only
//!   after [`Destination::seal`] found every block recorded and the derived file
//!   digest (or, with `seal_flat`, the flat SHA-256) equal to the expected one, AND
//!   [`publish`](fn@publish) made the data durable (`syncfs`/`fdatasync` returned success).
//!   Failure, abort, drop or SIGKILL leave the final name as it was.
//! - **Every block is verified, and the file digest covers every block.** A block is
//!   recorded only with its SHA-256 (checked against the sender's by the caller);
//!   the derived digest is computed from the recorded digests of all blocks, in
//!   order, so a resumed file's digest covers the blocks re-read from the temp file
//!   (their digests re-checked on resume) and the new ones alike.
//! - **A batch fails file by file.** In [`publish`](fn@publish), a file whose sync or rename
//!   fails is not published and does not keep the others from being published; like
//!   any unpublished [`Destination`] it keeps its temp file and manifest for resume
//!   if it keeps a manifest, else both are removed. A file whose seal fails (missing
//!   block, digest mismatch) never reaches the batch.
//! - **A manifest only where there is something to resume**: resume on and more
//!   than one block. A file of at most one block costs no manifest write (and is
//!   removed, not suspended, when interrupted; resending it costs what resuming it
//!   would).
//! - **Paths confined beneath the root.** No remote path, `..`, or symlink (however
//!   chained) resolves outside [`Root`]; every step is relative to an fd already
//!   beneath it. Names given for new objects are single plain components.
//! - **Direct writes change neither of the above.** A block written with `O_DIRECT`
//!   is covered by the same `fdatasync`/`syncfs` before the rename (and before each
//!   manifest save) as a buffered one, and the kernel drops cached pages of the
//!   range it wrote, so buffered reads of the temp file (resume, flat SHA-256) see it.
//! - No `unsafe` here: fds are owned (`OwnedFd`/`File`) via `rustix`.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

pub mod blake3_lanes;
pub mod commit;
pub mod content;
pub mod digest;
pub mod dircache;
pub mod direct;
pub mod error;
pub mod growing;
pub mod manifest;
pub mod mode;
pub mod partials;
pub mod path;
pub mod publish;
pub mod reader;
pub mod root;
pub mod tree;
mod unnamed;
pub mod write_behind;

pub use commit::{
    Destination, DestinationOptions, Preserve, Published, Sealed, DEFAULT_BLOCK_SIZE,
};
pub use digest::{
    block_digest, digest_blocks_parallel, digests_alongside, file_digest, file_digest_with,
    set_pool_threads, Check, FileDigest, Sha256Digest, StreamingFileDigest, DEFAULT_CHECKS,
};
pub use dircache::DirCache;
pub use direct::WriteStats;
pub use error::{DigestError, FileError, ManifestError, PathError, Result};
pub use growing::{Cancel, Growing};
pub use manifest::{Manifest, SourceId};
pub use path::{normalize, plain_parent_and_name, symlink_target_within, RelPath};
pub use publish::publish;
pub use reader::{IoMode, KnownBlocks, ReadStats, SourceFile, DIRECT_ALIGN, DIRECT_READ_FROM};
pub use root::{DirHandle, FileKind, FileMeta, ListEntry, Resolver, Root, Timestamp, TreeDirs};
pub use tree::{resolve_destination, shown_bytes, walk, Entry, EntryKind, Skipped, Tree, NOT_UTF8};
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
