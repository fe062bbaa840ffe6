//! Errors of the file layer. Every variant names the path and what is wrong with it,
//! so the message can go to the user unchanged.

use std::io;
use std::path::PathBuf;

/// A remote path was refused, or could not be resolved beneath the root.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("remote path is empty")]
    Empty,
    #[error("path {path:?} contains a NUL byte")]
    Nul { path: String },
    #[error("path {path:?} is {len} bytes long; the limit is {max}")]
    TooLong {
        path: String,
        len: usize,
        max: usize,
    },
    #[error("path {path:?} has a component longer than 255 bytes")]
    ComponentTooLong { path: String },
    #[error("path {path:?} is absolute; remote paths are relative to the served root")]
    Absolute { path: String },
    #[error("path {path:?} escapes the root (\"..\" above the top)")]
    Escapes { path: String },
    #[error("path {path:?} goes through a symlink pointing outside the root")]
    SymlinkOutside { path: String },
    #[error("path {path:?}: too many levels of symbolic links (or a /proc magic link)")]
    SymlinkLoop { path: String },
    #[error("path {path:?}: no such file or directory")]
    NotFound { path: String },
    #[error("path {path:?}: a component is not a directory")]
    NotADirectory { path: String },
    #[error("path {path:?} is not a regular file")]
    NotRegularFile { path: String },
    #[error("{name:?} is not a valid file name: {why}")]
    BadName { name: String, why: &'static str },
    #[error("{op} {path:?}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

/// Why a manifest file could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("not an rcp manifest (bad magic)")]
    BadMagic,
    #[error("unsupported manifest version {0}")]
    UnsupportedVersion(u32),
    #[error("manifest is truncated")]
    Truncated,
    #[error("manifest checksum does not match its contents (torn or corrupted write)")]
    Checksum,
    #[error("manifest is inconsistent: {0}")]
    Invalid(&'static str),
}

/// Errors of the streaming whole-file digest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("{bytes} bytes at offset {offset} overlap data already hashed or pending")]
    Overlap { offset: u64, bytes: u64 },
    #[error("{bytes} bytes at offset {offset} go beyond the file length {len}")]
    BeyondEnd { offset: u64, bytes: u64, len: u64 },
    #[error(
        "back-pressure: holding {pending} out-of-order bytes, limit {limit}; nothing was consumed"
    )]
    Backpressure { pending: usize, limit: usize },
    #[error(
        "whole-file digest has a gap: data from offset {at} never arrived (expected length {len})"
    )]
    Gap { at: u64, len: u64 },
    #[error("not a SHA-256 hex digest: {0:?}")]
    BadHex(String),
    #[error("the hashing pool already runs with {threads} threads; size it before first use")]
    PoolStarted { threads: usize },
}

/// Everything the file layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error(transparent)]
    Digest(#[from] DigestError),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("manifest {path}: {source}")]
    Manifest {
        path: PathBuf,
        #[source]
        source: ManifestError,
    },
    #[error("{path}: {what} mismatch: expected {expected}, received data hashes to {actual}; temp file removed")]
    DigestMismatch {
        path: PathBuf,
        /// Which digest: "derived file digest" or "whole-file SHA-256".
        what: &'static str,
        expected: String,
        actual: String,
    },
    #[error(
        "{path}: write of {len} bytes at offset {offset} is outside the file length {file_len}"
    )]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        len: u64,
        file_len: u64,
    },
    #[error("{path}: block {index} has {got} bytes, expected {expected}")]
    BadBlock {
        path: PathBuf,
        index: u64,
        got: u64,
        expected: u64,
    },
    #[error("{path}: cannot commit, data from offset {missing_from} of {len} never arrived")]
    Incomplete {
        path: PathBuf,
        missing_from: u64,
        len: u64,
    },
    #[error("{path}: source changed while being read ({what})")]
    SourceChanged { path: PathBuf, what: &'static str },
    #[error("{path}: is a directory, refusing to replace it with a file")]
    IsADirectory { path: PathBuf },
    /// A directory to make (one of a copied tree, or the destination
    /// itself) where a file (or anything but a directory) stands.
    #[error("{path}: is not a directory, refusing to replace it with one")]
    NotADirectory { path: PathBuf },
    #[error("destination {path}: {why}")]
    Destination { path: PathBuf, why: &'static str },
    /// A reader of a [`Growing`](super::growing::Growing) file was
    /// cancelled while it waited.
    #[error("cancelled while waiting for the file's blocks")]
    Cancelled,
    #[error("{path}: directory tree deeper than {max} levels")]
    TooDeep { path: PathBuf, max: usize },
}

pub type Result<T, E = FileError> = std::result::Result<T, E>;

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
    e: impl Into<io::Error>,
) -> FileError {
    FileError::Io {
        op,
        path: path.into(),
        source: e.into(),
    }
}
