//! Glue between the control plane and [`crate::files`]: remote path
//! strings, error mapping, timestamps, source identities, exact reads.

use std::path::Path;

use crate::files::{self, FileError, PathError, SourceFile, SourceId, Timestamp};

use super::error::ControlError;

/// A request path as the files layer takes it: rcp writes `HOST:/x` and
/// `HOST:x` alike (both beneath the server root), and `HOST:` or `HOST:/`
/// for the root itself.
pub fn root_rel(p: &str) -> String {
    let t = p.trim_start_matches('/');
    if t.is_empty() {
        ".".into()
    } else {
        t.into()
    }
}

/// The directory that holds the local path `p`: its parent, and `.` for a
/// bare name (whose [`Path::parent`] is empty); `None` for `/` or an empty
/// path, which no directory holds.
pub fn parent_dir(p: &Path) -> Option<&Path> {
    match p.parent() {
        Some(d) if d.as_os_str().is_empty() => Some(Path::new(".")),
        d => d,
    }
}

/// A [`files::RelPath`] as a string the files layer accepts.
pub fn rel_str(r: &files::RelPath) -> String {
    let s = r.to_string();
    if s.is_empty() {
        ".".into()
    } else {
        s
    }
}

impl From<PathError> for ControlError {
    fn from(e: PathError) -> Self {
        let msg = e.to_string();
        match e {
            PathError::NotFound { .. } => ControlError::FileNotFound(msg),
            PathError::NotADirectory { .. } => ControlError::DirNotFound(msg),
            PathError::NotRegularFile { .. } | PathError::BadName { .. } => {
                ControlError::Invalid(msg)
            }
            // The OS error once: the context is what was done to which
            // path, the source says why.
            PathError::Io { op, path, source } => ControlError::Io {
                context: format!("{op} {path:?}"),
                source,
            },
            _ => ControlError::PathRefused(msg),
        }
    }
}

impl From<FileError> for ControlError {
    fn from(e: FileError) -> Self {
        let msg = e.to_string();
        match e {
            FileError::Path(p) => p.into(),
            FileError::DigestMismatch { .. } => ControlError::Integrity(msg),
            FileError::Digest(_) | FileError::Incomplete { .. } => ControlError::Invalid(msg),
            FileError::OutOfRange { .. } | FileError::BadBlock { .. } => ControlError::Invalid(msg),
            FileError::Io { op, path, source } => ControlError::Io {
                context: format!("{op} {}", path.display()),
                source,
            },
            FileError::SourceChanged { .. } => ControlError::Retryable(msg),
            _ => ControlError::Other(msg),
        }
    }
}

pub fn ts_from_ns(ns: i64) -> Timestamp {
    Timestamp {
        sec: ns.div_euclid(1_000_000_000),
        nsec: ns.rem_euclid(1_000_000_000) as u32,
    }
}

pub fn ns_from_ts(t: Timestamp) -> i64 {
    t.sec * 1_000_000_000 + i64::from(t.nsec)
}

/// The 32-byte fingerprint of a [`SourceId`] from the wire (zeros if absent).
pub fn fingerprint(b: &[u8]) -> [u8; 32] {
    b.try_into().unwrap_or([0; 32])
}

pub fn source_id(len: u64, mtime_ns: i64, fp: &[u8]) -> SourceId {
    SourceId {
        len,
        mtime: ts_from_ns(mtime_ns),
        fingerprint: fingerprint(fp),
    }
}

/// Read exactly `buf.len()` bytes at `offset`.
pub fn read_exact(src: &SourceFile, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
    let n = src
        .read_at(offset, buf)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    if n != buf.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "{}: short read at {offset} ({n} of {} bytes): the file changed",
                src.path().display(),
                buf.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_names_directory_is_dot() {
        assert_eq!(parent_dir(Path::new("ldr")), Some(Path::new(".")));
        assert_eq!(parent_dir(Path::new("./ldr")), Some(Path::new(".")));
        assert_eq!(parent_dir(Path::new("a/b")), Some(Path::new("a")));
        assert_eq!(parent_dir(Path::new("/x")), Some(Path::new("/")));
        assert_eq!(parent_dir(Path::new("/")), None);
        assert_eq!(parent_dir(Path::new("")), None);
    }
}
