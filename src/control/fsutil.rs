//! Glue between the control plane and [`crate::files`]: remote path
//! strings, error mapping, timestamps, bitmaps, whole-file digests.

use crate::files::{
    self, DigestError, FileError, PathError, SourceFile, SourceId, StreamingFileDigest, Timestamp,
};

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
            PathError::Io { source, .. } => ControlError::Io {
                context: msg,
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
            FileError::Io { source, .. } => ControlError::Io {
                context: msg,
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

/// Bitmap of blocks (bit i of byte i/8, LSB first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    pub bits: Vec<u8>,
    pub len: u64,
}

impl Bitmap {
    pub fn new(len: u64) -> Self {
        Bitmap {
            bits: vec![0; len.div_ceil(8) as usize],
            len,
        }
    }
    pub fn from_bytes(bits: Vec<u8>, len: u64) -> Option<Self> {
        (bits.len() as u64 == len.div_ceil(8)).then_some(Bitmap { bits, len })
    }
    /// Every block of `len` set except `missing`.
    pub fn all_but(len: u64, missing: &[u64]) -> Self {
        let mut b = Bitmap::new(len);
        b.bits.iter_mut().for_each(|x| *x = 0xff);
        for &m in missing {
            if m < len {
                b.bits[(m / 8) as usize] &= !(1 << (m % 8));
            }
        }
        if len % 8 != 0 {
            if let Some(last) = b.bits.last_mut() {
                *last &= (1u8 << (len % 8)) - 1;
            }
        }
        b
    }
    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.bits[(i / 8) as usize] & (1 << (i % 8)) != 0
    }
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }
}

/// Feed the whole-file digest, ignoring data it has already hashed (a block
/// posted again after a reconnect).
pub fn feed(d: &mut StreamingFileDigest, offset: u64, data: &[u8]) {
    if offset + data.len() as u64 <= d.next_offset() {
        return;
    }
    match d.update(offset, data) {
        Ok(()) | Err(DigestError::Overlap { .. }) => {}
        Err(e) => tracing::debug!(error = %e, offset, "whole-file digest refused a piece"),
    }
}

/// Whole-file SHA-256 of a source read end to end (after a resume, when not
/// every byte passed through this process).
pub fn whole_file_digest(src: &SourceFile) -> Result<[u8; 32], ControlError> {
    let mut d = StreamingFileDigest::new(Some(src.len()), 0);
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < src.len() {
        let n = src.read_at(off, &mut buf)?;
        if n == 0 {
            return Err(ControlError::Retryable(format!(
                "{} shrank while being read",
                src.path().display()
            )));
        }
        d.update(off, &buf[..n]).map_err(FileError::from)?;
        off += n as u64;
    }
    Ok(d.finish().map_err(FileError::from)?)
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
