//! Receiving side: `O_DIRECT` writes of a [`Destination`](super::Destination)'s
//! temp file, where the file system allows them.
//!
//! A verified block sits in registered memory (the pull staging slot, rcpd's
//! window); a buffered `pwrite` copies it into the page cache and leaves the
//! kernel to write it back, an `O_DIRECT` one hands the same bytes to the device.
//! `DirectWrites` keeps a second fd of the temp file, opened with `O_DIRECT`,
//! and uses it for a write whose buffer address is a multiple of the file's
//! direct-I/O memory alignment and whose file offset and length are multiples of
//! its offset alignment. Everything else (the short last block of a file, an
//! unaligned buffer) goes through the buffered fd.
//!
//! The rule, decided once per file at its first aligned write (a file of one
//! block never asks: its one `pwrite` stays buffered, with no second fd):
//! - `statx(STATX_DIOALIGN)` (Linux 6.1+) reports the alignments: used as given;
//!   reported as 0 (no direct I/O for this file): buffered.
//! - not reported (an older kernel, or a file system that does not say):
//!   memory-backed file systems (tmpfs, ramfs) stay buffered, as there is no
//!   device to bypass (tmpfs accepts `O_DIRECT` since Linux 6.6 and copies all
//!   the same); others are tried with 4096.
//! - an `O_DIRECT` open or write refused with `EINVAL`: buffered from then on,
//!   the write retried buffered, and the file system remembered for the rest of
//!   the process (no later file there tries again).
//!
//! Coherence: the kernel writes back and invalidates cached pages of a range
//! written with `O_DIRECT` (before and after the write), so the buffered reads
//! of the same file (resume's re-check, the flat SHA-256's deferred pieces) see
//! the data. Durability is unchanged: data written direct may still sit in the
//! device's cache, and its extents may still be unwritten in the journal, until
//! the `fdatasync`/`syncfs` that comes before every manifest save and every
//! rename (either fd syncs the one inode).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use super::reader::IoMode;
use super::root::DirHandle;

/// Alignment assumed when the kernel does not report one.
const FALLBACK_ALIGN: u64 = 4096;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// Whether `fd`'s file system keeps files in memory (tmpfs, ramfs): no
/// device to write to directly, and nothing to gain from `fallocate`, which
/// there allocates and zeroes every page that the writes then copy over.
pub(super) fn memory_backed(fd: impl rustix::fd::AsFd) -> bool {
    // `f_type` is not an i64 on every target.
    #[allow(clippy::unnecessary_cast)]
    rfs::fstatfs(fd).is_ok_and(|fs| matches!(fs.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC))
}

/// File systems (by `st_dev`) that refused `O_DIRECT` with `EINVAL`.
static REFUSED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

fn refused(dev: u64) -> bool {
    REFUSED.lock().unwrap().contains(&dev)
}

fn remember_refusal(dev: u64) {
    let mut r = REFUSED.lock().unwrap();
    if !r.contains(&dev) {
        r.push(dev);
    }
}

/// Write counters of a [`Destination`](super::Destination), by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteStats {
    pub direct_writes: u64,
    pub buffered_writes: u64,
}

#[derive(Debug)]
enum State {
    /// Not decided yet: the first aligned write decides.
    Untried,
    On {
        fd: File,
        dev: u64,
        mem_align: u64,
        offset_align: u64,
    },
    Off(String),
}

/// The direct fd of one temp file, if any, and what was written how.
#[derive(Debug)]
pub(crate) struct DirectWrites {
    state: State,
    stats: WriteStats,
}

impl DirectWrites {
    /// `enabled`: try direct writes at all (off: every write is buffered).
    pub(crate) fn new(enabled: bool) -> DirectWrites {
        DirectWrites {
            state: if enabled {
                State::Untried
            } else {
                State::Off("direct writes are off (DestinationOptions::direct_io)".into())
            },
            stats: WriteStats::default(),
        }
    }

    pub(crate) fn stats(&self) -> WriteStats {
        self.stats
    }

    /// Why writes are not going direct, once decided.
    pub(crate) fn unavailable(&self) -> Option<&str> {
        match &self.state {
            State::Off(why) => Some(why),
            _ => None,
        }
    }

    /// The mode an aligned write would use now (`Buffered` until decided).
    pub(crate) fn mode(&self) -> IoMode {
        match self.state {
            State::On { .. } => IoMode::Direct,
            _ => IoMode::Buffered,
        }
    }

    /// Write all of `data` at `offset` of `file`, buffered, without deciding
    /// on direct writes (a file of one block).
    pub(crate) fn write_buffered(
        &mut self,
        file: &File,
        data: &[u8],
        offset: u64,
    ) -> io::Result<IoMode> {
        file.write_all_at(data, offset)?;
        self.stats.buffered_writes += 1;
        Ok(IoMode::Buffered)
    }

    /// Write all of `data` at `offset` of `file` (the buffered fd of the temp
    /// file `temp` in `dir`), direct where aligned and allowed.
    pub(crate) fn write_all_at(
        &mut self,
        dir: &DirHandle,
        temp: &std::ffi::OsStr,
        file: &File,
        data: &[u8],
        offset: u64,
    ) -> io::Result<IoMode> {
        if matches!(self.state, State::Untried) && plausibly_aligned(data, offset) {
            self.state = decide(dir, temp, file);
        }
        let mut done = 0usize;
        let mut mode = IoMode::Buffered;
        while let State::On {
            fd,
            dev,
            mem_align,
            offset_align,
        } = &self.state
        {
            let rest = &data[done..];
            let at = offset + done as u64;
            if rest.is_empty()
                || (rest.as_ptr() as u64) % mem_align != 0
                || at % offset_align != 0
                || rest.len() as u64 % offset_align != 0
            {
                break;
            }
            let e = match fd.write_at(rest, at) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    done += n;
                    mode = IoMode::Direct;
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() != Some(libc::EINVAL) => return Err(e),
                Err(e) => e,
            };
            tracing::warn!(error = %e, dev,
                "O_DIRECT write refused; writing buffered on this file system from now on");
            remember_refusal(*dev);
            self.state = State::Off(format!("O_DIRECT write refused: {e}"));
        }
        if done < data.len() {
            // The unaligned rest (a short last block), or all of it.
            file.write_all_at(&data[done..], offset + done as u64)?;
        }
        match mode {
            IoMode::Direct => self.stats.direct_writes += 1,
            IoMode::Buffered => self.stats.buffered_writes += 1,
        }
        Ok(mode)
    }
}

/// Worth deciding on: page-aligned as every full block in registered memory
/// is (the real alignments are checked per write once known).
fn plausibly_aligned(data: &[u8], offset: u64) -> bool {
    let a = 512;
    (data.as_ptr() as u64) % a == 0 && offset % a == 0 && data.len() as u64 % a == 0
}

/// Whether and how this temp file can be written direct; opens the direct fd.
fn decide(dir: &DirHandle, temp: &std::ffi::OsStr, file: &File) -> State {
    let st = match rfs::statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        Ok(st) => st,
        Err(e) => return State::Off(format!("statx: {e}")),
    };
    let dev = rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor);
    if refused(dev) {
        return State::Off("O_DIRECT was refused earlier on this file system".into());
    }
    let (mem_align, offset_align) = if st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 {
        if st.stx_dio_mem_align == 0 || st.stx_dio_offset_align == 0 {
            return State::Off("the file system offers no direct I/O for this file".into());
        }
        (
            u64::from(st.stx_dio_mem_align),
            u64::from(st.stx_dio_offset_align),
        )
    } else {
        if memory_backed(file) {
            return State::Off(
                "memory-backed file system (tmpfs): no device to write to directly".into(),
            );
        }
        (FALLBACK_ALIGN, FALLBACK_ALIGN)
    };
    let fd = match rfs::openat(
        dir.fd(),
        temp,
        OFlags::WRONLY | OFlags::DIRECT | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => {
            if e == Errno::INVAL {
                tracing::info!(dir = %crate::escape::esc(dir.display().display()), "O_DIRECT refused (EINVAL); buffered writes on this file system");
                remember_refusal(dev);
            }
            return State::Off(format!("O_DIRECT open: {e}"));
        }
    };
    // The same inode as the buffered fd, not something put under its name.
    #[allow(clippy::unnecessary_cast)]
    match rfs::fstat(&fd) {
        Ok(a) if (a.st_dev as u64, a.st_ino as u64) == (dev, st.stx_ino) => {}
        _ => return State::Off("the temp file's name no longer names it".into()),
    }
    State::On {
        fd: File::from(fd),
        dev,
        mem_align,
        offset_align,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct write the kernel refuses with EINVAL (here: a buffer whose
    /// misalignment the recorded alignment let through) is done buffered, and
    /// the file system is remembered: the next file there does not try.
    #[test]
    fn einval_falls_back_once_and_is_remembered() {
        let t = tempfile::tempdir_in("/var/tmp").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let temp = std::ffi::OsStr::new("x.part");
        let file = File::create(t.path().join(temp)).unwrap();
        let mut w = DirectWrites::new(true);
        let st = decide(&dir, temp, &file);
        let State::On { fd, dev, .. } = st else {
            eprintln!("no O_DIRECT on /var/tmp ({st:?}): skipped");
            return;
        };
        w.state = State::On {
            fd,
            dev,
            mem_align: 1,
            offset_align: 1,
        };
        let mut storage = vec![7u8; 8192 + 1];
        let off = storage.as_ptr().align_offset(4096) + 1;
        let data = &mut storage[off..off + 4096];
        assert_eq!(
            w.write_all_at(&dir, temp, &file, data, 0).unwrap(),
            IoMode::Buffered
        );
        assert!(w.unavailable().unwrap().contains("refused"), "{w:?}");
        assert_eq!(w.stats().buffered_writes, 1);
        assert_eq!(std::fs::read(t.path().join(temp)).unwrap(), &data[..]);
        assert!(refused(dev));
        let again = decide(&dir, temp, &file);
        assert!(
            matches!(&again, State::Off(why) if why.contains("earlier")),
            "{again:?}"
        );
        // Other tests of this process may write there.
        REFUSED.lock().unwrap().retain(|&d| d != dev);
    }
}
