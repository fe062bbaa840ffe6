//! Source side: reading a file straight into a caller's (registered) buffer.
//!
//! [`SourceFile`] opens the file twice: once buffered, once with `O_DIRECT` when the
//! file system accepts it and the file is longer than [`DIRECT_READ_FROM`] (a
//! smaller one is read buffered through one fd: the second open and its checks
//! would cost more than bypassing the page cache saves) (an `O_DIRECT` open that fails, typically with EINVAL, just
//! leaves the direct fd out and says why in [`SourceFile::direct_unavailable`]). Both
//! fds are checked to be the same inode. [`read_at`](SourceFile::read_at) uses the
//! direct fd when offset, buffer address and buffer length are all multiples of
//! [`DIRECT_ALIGN`]; the last, short block of a file is read the same way (an aligned
//! over-read that the kernel truncates at EOF) as long as the caller's buffer is a
//! whole aligned block. Anything else (unaligned, or a direct read failing with
//! EINVAL at run time, which disables direct reads for the file) goes through the
//! buffered fd. [`read_at_mode`](SourceFile::read_at_mode) reports which path served
//! a read; counters in [`stats`](SourceFile::stats).
//!
//! `&SourceFile` is `Sync`: several threads may read different blocks concurrently.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use rustix::fs::{self as rfs, Mode, OFlags};
use sha2::{Digest, Sha256};

use super::digest::{Check, Sha256Digest};
use super::error::{io_err, FileError, PathError, Result};
use super::growing::{Cancel, Growing};
use super::manifest::SourceId;
use super::path::normalize;
use super::root::{regular_fd, FileKind, FileMeta, Root};
use crate::escape::esc;

/// Alignment required for `O_DIRECT` reads (offset, buffer address, length).
pub const DIRECT_ALIGN: usize = 4096;
/// How much of the start of the file goes into the [`SourceId`] fingerprint.
pub const FINGERPRINT_BYTES: usize = 64 << 10;
/// Files of at most this many bytes are read buffered, with no `O_DIRECT` fd.
pub const DIRECT_READ_FROM: u64 = 64 << 10;
const SMALL_READ_BUFFERED: &str = "a file of at most 64 KiB is read buffered";

/// Which path served a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    Direct,
    Buffered,
}

/// Read counters by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadStats {
    pub direct_reads: u64,
    pub buffered_reads: u64,
}

/// An open source file; see the module doc.
#[derive(Debug)]
pub struct SourceFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    direct_why_not: Option<String>,
    direct_ok: AtomicBool,
    direct_reads: AtomicU64,
    buffered_reads: AtomicU64,
    meta: FileMeta,
    /// The SHA-256 of the first [`FINGERPRINT_BYTES`], read and hashed on
    /// the first [`SourceFile::source_id`]: only a file whose copy keeps a
    /// resume manifest needs it, and for a small file it would hash every
    /// byte a second time.
    fingerprint: OnceLock<[u8; 32]>,
    /// A file still being received ([`SourceFile::growing`]): reads wait
    /// for their blocks and go to the file it names.
    growing: Option<(Arc<Growing>, Cancel)>,
    /// Its block digests, computed from an earlier open of the same file
    /// as it is now ([`SourceFile::know`]).
    known: Option<Arc<KnownBlocks>>,
}

/// The block digests of a file under one check and block size, with the
/// file's identity when they were computed (its device, inode, length and
/// mtime, as [`SourceFile::check_unchanged`] compares them): what a later
/// open of the same, unchanged file need not read again
/// ([`SourceFile::know`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownBlocks {
    meta: FileMeta,
    check: Check,
    block_size: u64,
    blocks: Vec<Sha256Digest>,
}

impl KnownBlocks {
    /// The digests `blocks` of `src` (every block, cut at `block_size`,
    /// under `check`), computed from it as it was opened.
    pub fn of(src: &SourceFile, check: Check, block_size: u64, blocks: Vec<Sha256Digest>) -> Self {
        KnownBlocks {
            meta: src.meta,
            check,
            block_size,
            blocks,
        }
    }
    pub fn blocks(&self) -> &[Sha256Digest] {
        &self.blocks
    }
}

impl SourceFile {
    /// Open a local file (client side: the user's own path, symlinks followed).
    pub fn open(path: impl AsRef<Path>) -> Result<SourceFile> {
        let path = path.as_ref();
        let open = |direct: bool| {
            let mut f = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
            if direct {
                f |= OFlags::DIRECT;
            }
            rfs::open(path, f, Mode::empty()).map_err(io::Error::from)
        };
        let fd = open(false).map_err(|e| io_err("open", path, e))?;
        let (fd, st) = regular_fd(fd, OFlags::empty(), &path.to_string_lossy())?;
        Self::opened(path, fd, &st, || open(true))
    }

    /// Open `rel` beneath the served root (server side, confined; see [`Root`]).
    pub fn open_in(root: &Root, rel: &str) -> Result<SourceFile> {
        let r = normalize(rel)?;
        let display = root.path().join(r.to_path());
        // Refusals (escape, not a regular file, ...) are reported as such, from the
        // buffered open; a failing O_DIRECT open only means "no direct reads".
        let (fd, st) = root.open_regular(&r, OFlags::empty(), rel)?;
        Self::opened(&display, fd, &st, || {
            root.open_regular(&r, OFlags::DIRECT, rel)
                .map(|(fd, _)| fd)
                .map_err(|e| match e {
                    PathError::Io { source, .. } => source,
                    other => io::Error::other(other.to_string()),
                })
        })
    }

    /// Build from an opener called with `direct = false` (must succeed) and then
    /// `direct = true` (may fail: buffered reads only). Public so that callers with
    /// their own way of opening, and tests of the fallback, can use it.
    pub fn from_opener(
        display: &Path,
        mut open: impl FnMut(bool) -> io::Result<OwnedFd>,
    ) -> Result<SourceFile> {
        let fd = open(false).map_err(|e| io_err("open", display, e))?;
        let st = rfs::fstat(&fd).map_err(|e| io_err("stat", display, e))?;
        if FileMeta::from_stat(&st).kind != FileKind::File {
            return Err(PathError::NotRegularFile {
                path: display.to_string_lossy().into_owned(),
            }
            .into());
        }
        let fl = rfs::fcntl_getfl(&fd).map_err(|e| io_err("fcntl", display, e))?;
        if fl.contains(OFlags::NONBLOCK) {
            rfs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK)
                .map_err(|e| io_err("fcntl", display, e))?;
        }
        Self::opened(display, fd, &st, || open(true))
    }

    /// Build from the buffered fd `fd` (a blocking reader of a regular
    /// file, `st` its `fstat`) and `open_direct`, asked for an `O_DIRECT`
    /// fd of the same file when it is large enough to be worth one.
    fn opened(
        display: &Path,
        fd: OwnedFd,
        st: &rfs::Stat,
        open_direct: impl FnOnce() -> io::Result<OwnedFd>,
    ) -> Result<SourceFile> {
        let meta = FileMeta::from_stat(st);
        let buffered = File::from(fd);
        let small = meta.len <= DIRECT_READ_FROM;
        let (direct, why_not) = match (!small).then(open_direct) {
            None => (None, None),
            Some(Ok(dfd)) => {
                let dst = rfs::fstat(&dfd).map_err(|e| io_err("stat", display, e))?;
                let dmeta = FileMeta::from_stat(&dst);
                if (dmeta.dev, dmeta.ino) != (meta.dev, meta.ino) {
                    return Err(FileError::SourceChanged {
                        path: display.to_owned(),
                        what: "replaced between opens",
                    });
                }
                (Some(File::from(dfd)), None)
            }
            Some(Err(e)) => {
                let p = display.display().to_string();
                tracing::debug!(path = %esc(&p), error = %esc(&e),
                    "O_DIRECT not available; buffered reads");
                (None, Some(e.to_string()))
            }
        };
        Ok(SourceFile {
            path: display.to_owned(),
            direct_ok: AtomicBool::new(direct.is_some()),
            buffered,
            direct,
            direct_why_not: why_not,
            direct_reads: AtomicU64::new(0),
            buffered_reads: AtomicU64::new(0),
            meta,
            fingerprint: OnceLock::new(),
            growing: None,
            known: None,
        })
    }

    /// A file still being received, read as its blocks arrive
    /// ([`Growing`]): `meta` is its source's (length, mode, mtime), whose
    /// `fingerprint` it carries; it is unchanged once the file is
    /// committed. `cancel` ends every wait.
    pub fn growing(
        display: &Path,
        g: Arc<Growing>,
        meta: FileMeta,
        fingerprint: Option<[u8; 32]>,
        cancel: Cancel,
    ) -> Result<SourceFile> {
        let file = g.wait_range(0, 0, &cancel)?;
        let buffered = file.try_clone().map_err(|e| io_err("dup", display, e))?;
        let fp = OnceLock::new();
        if let Some(f) = fingerprint {
            let _ = fp.set(f);
        }
        Ok(SourceFile {
            path: display.to_owned(),
            buffered,
            direct: None,
            direct_why_not: Some("a file still being received is read buffered".into()),
            direct_ok: AtomicBool::new(false),
            direct_reads: AtomicU64::new(0),
            buffered_reads: AtomicU64::new(0),
            meta,
            fingerprint: fp,
            growing: Some((g, cancel)),
            known: None,
        })
    }

    /// Take `k` as this file's block digests when it was computed from
    /// this file as it was opened now (same device, inode, length and
    /// mtime, and every block); whether it was taken.
    pub fn know(&mut self, k: Arc<KnownBlocks>) -> bool {
        let fits = k.meta.dev == self.meta.dev
            && k.meta.ino == self.meta.ino
            && k.meta.len == self.meta.len
            && k.meta.mtime == self.meta.mtime
            && k.block_size > 0
            && k.blocks.len() as u64 == self.meta.len.div_ceil(k.block_size)
            && self.growing.is_none();
        if fits {
            self.known = Some(k);
        }
        fits
    }

    /// The block digests [`know`](Self::know) took, when under `check`
    /// cut at `block_size`.
    pub fn known_blocks(&self, check: Check, block_size: u64) -> Option<&[Sha256Digest]> {
        self.known
            .as_deref()
            .filter(|k| k.check == check && k.block_size == block_size)
            .map(KnownBlocks::blocks)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn len(&self) -> u64 {
        self.meta.len
    }
    pub fn is_empty(&self) -> bool {
        self.meta.len == 0
    }
    /// Permission bits.
    pub fn mode(&self) -> u32 {
        self.meta.mode
    }
    pub fn mtime(&self) -> super::root::Timestamp {
        self.meta.mtime
    }
    pub fn meta(&self) -> &FileMeta {
        &self.meta
    }
    /// Size + mtime + SHA-256 of the first 64 KiB, fixed at open.
    /// What identifies this source to a resume: length, mtime and the
    /// fingerprint of its start (read and hashed on the first call).
    pub fn source_id(&self) -> Result<SourceId> {
        let fingerprint = match self.fingerprint.get() {
            Some(f) => *f,
            None => {
                let mut head = vec![0u8; FINGERPRINT_BYTES.min(self.meta.len as usize)];
                let grown = match &self.growing {
                    Some((g, cancel)) => Some(g.wait_range(0, head.len() as u64, cancel)?),
                    None => None,
                };
                read_full(
                    grown.as_deref().unwrap_or(&self.buffered),
                    &mut head,
                    0,
                    false,
                )
                .map_err(|e| io_err("read", &self.path, e))?;
                *self
                    .fingerprint
                    .get_or_init(|| Sha256::digest(&head).into())
            }
        };
        Ok(SourceId {
            len: self.meta.len,
            mtime: self.meta.mtime,
            fingerprint,
        })
    }
    /// The mode aligned reads will use.
    pub fn io_mode(&self) -> IoMode {
        if self.direct.is_some() && self.direct_ok.load(Ordering::Relaxed) {
            IoMode::Direct
        } else {
            IoMode::Buffered
        }
    }
    /// Why there is no `O_DIRECT` fd, if there isn't.
    pub fn direct_unavailable(&self) -> Option<&str> {
        match (&self.direct, &self.direct_why_not) {
            (None, None) => Some(SMALL_READ_BUFFERED),
            (_, why) => why.as_deref(),
        }
    }
    pub fn stats(&self) -> ReadStats {
        ReadStats {
            direct_reads: self.direct_reads.load(Ordering::Relaxed),
            buffered_reads: self.buffered_reads.load(Ordering::Relaxed),
        }
    }

    /// Read into `buf` from `offset`; returns the bytes read, fewer than `buf.len()`
    /// only at end of file.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.read_at_mode(offset, buf).map(|(n, _)| n)
    }

    /// [`read_at`](Self::read_at), also saying which path served it.
    pub fn read_at_mode(&self, offset: u64, buf: &mut [u8]) -> Result<(usize, IoMode)> {
        if let Some((g, cancel)) = &self.growing {
            let f = g.wait_range(offset, buf.len() as u64, cancel)?;
            let want = (self.meta.len.saturating_sub(offset) as usize).min(buf.len());
            let n = read_full(&f, &mut buf[..want], offset, false)
                .map_err(|e| io_err("read", &self.path, e))?;
            self.buffered_reads.fetch_add(1, Ordering::Relaxed);
            return Ok((n, IoMode::Buffered));
        }
        let aligned = offset % DIRECT_ALIGN as u64 == 0
            && (buf.as_ptr() as usize) % DIRECT_ALIGN == 0
            && buf.len() % DIRECT_ALIGN == 0;
        if let (Some(d), true) = (
            &self.direct,
            aligned && self.direct_ok.load(Ordering::Relaxed),
        ) {
            match read_full(d, buf, offset, true) {
                Ok(n) => {
                    self.direct_reads.fetch_add(1, Ordering::Relaxed);
                    return Ok((n, IoMode::Direct));
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(path = %esc(self.path.display()), error = %e,
                        "O_DIRECT read refused; using buffered reads for this file");
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(io_err("read", &self.path, e)),
            }
        }
        let n = read_full(&self.buffered, buf, offset, false)
            .map_err(|e| io_err("read", &self.path, e))?;
        self.buffered_reads.fetch_add(1, Ordering::Relaxed);
        Ok((n, IoMode::Buffered))
    }

    /// Fail with [`FileError::SourceChanged`] if length or mtime differ from open
    /// time (call after the last block was read, before the digest is trusted).
    pub fn check_unchanged(&self) -> Result<()> {
        if let Some((g, cancel)) = &self.growing {
            // What it holds is what the receiver verified: once every
            // block is, it is the whole source (the receiver's commit, a
            // sync and a rename, need not hold up the next hop).
            return g.wait_range(0, self.meta.len, cancel).map(|_| ());
        }
        let st = rfs::fstat(&self.buffered).map_err(|e| io_err("stat", &self.path, e))?;
        let now = FileMeta::from_stat(&st);
        let what = if now.len != self.meta.len {
            "length changed"
        } else if now.mtime != self.meta.mtime {
            "modification time changed"
        } else {
            return Ok(());
        };
        Err(FileError::SourceChanged {
            path: self.path.clone(),
            what,
        })
    }
}

/// pread until `buf` is full or EOF. For O_DIRECT a short read means EOF (the next
/// offset would be unaligned), so stop there.
fn read_full(f: &File, buf: &mut [u8], offset: u64, direct: bool) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                if direct && n % DIRECT_ALIGN != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both opens (the client's own path, and beneath rcpd's root) refuse
    /// a FIFO without blocking on it, and hand back a blocking fd of a
    /// regular file (`O_NONBLOCK` only guarded the open).
    #[test]
    fn a_regular_file_is_read_blocking_and_a_fifo_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 100]).unwrap();
        nix::unistd::mkfifo(&dir.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let root = Root::open(dir.path()).unwrap();
        for f in [
            SourceFile::open(&p).unwrap(),
            SourceFile::open_in(&root, "f").unwrap(),
        ] {
            let fl = rfs::fcntl_getfl(&f.buffered).unwrap();
            assert!(!fl.contains(OFlags::NONBLOCK), "{fl:?}");
            assert_eq!(f.meta.len, 100);
        }
        let fifo = dir.path().join("fifo");
        let refused = [
            SourceFile::open(&fifo).map(|_| ()),
            SourceFile::open_in(&root, "fifo").map(|_| ()),
            SourceFile::from_opener(&fifo, |_| {
                rfs::open(&fifo, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty())
                    .map_err(io::Error::from)
            })
            .map(|_| ()),
        ];
        for r in refused {
            assert!(
                matches!(r, Err(FileError::Path(PathError::NotRegularFile { .. }))),
                "{r:?}"
            );
        }
    }

    #[test]
    fn known_blocks_are_taken_only_by_the_same_unchanged_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 10_000]).unwrap();
        let first = SourceFile::open(&p).unwrap();
        // Digests that are not the file's: what is taken is what was given.
        let k = Arc::new(KnownBlocks::of(
            &first,
            Check::Blake3,
            4096,
            vec![[1; 32]; 3],
        ));
        let mut again = SourceFile::open(&p).unwrap();
        assert!(again.know(k.clone()));
        assert_eq!(
            again.known_blocks(Check::Blake3, 4096),
            Some(&[[1u8; 32]; 3][..])
        );
        // Another check or block size: not these digests.
        assert_eq!(again.known_blocks(Check::Sha256, 4096), None);
        assert_eq!(again.known_blocks(Check::Blake3, 8192), None);
        // Not every block: refused.
        let short = Arc::new(KnownBlocks::of(
            &first,
            Check::Blake3,
            4096,
            vec![[1; 32]; 2],
        ));
        assert!(!SourceFile::open(&p).unwrap().know(short));
        // Rewritten since (another length, then another file at the path).
        std::fs::write(&p, vec![7u8; 10_001]).unwrap();
        let mut changed = SourceFile::open(&p).unwrap();
        assert!(!changed.know(k.clone()));
        assert_eq!(changed.known_blocks(Check::Blake3, 4096), None);
        // Another file put at the path, of the same length and mtime (made
        // while the first still exists: another inode).
        let q = dir.path().join("g");
        std::fs::write(&q, vec![7u8; 10_000]).unwrap();
        let first_mtime = std::time::UNIX_EPOCH
            + std::time::Duration::new(first.mtime().sec as u64, first.mtime().nsec);
        std::fs::File::options()
            .write(true)
            .open(&q)
            .unwrap()
            .set_modified(first_mtime)
            .unwrap();
        std::fs::rename(&q, &p).unwrap();
        let mut r = SourceFile::open(&p).unwrap();
        assert_eq!(
            (r.meta().len, r.meta().mtime),
            (first.meta().len, first.meta().mtime)
        );
        assert!(!r.know(k), "another inode is another file");
    }
}
