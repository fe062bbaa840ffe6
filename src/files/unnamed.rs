//! Unnamed temp files (`O_TMPFILE`) for files of one block created where
//! nothing stands: the data goes into an inode with no name, and the file
//! appears under its final name by one `linkat` once verified and durable.
//!
//! Against a named `.rcp-…part` this spares each small file the temp name's
//! entry (made by `openat`, moved by `renameat`), the `flock` that keeps a
//! live partial from being swept, and the `fchmod` (nobody can open an
//! unnamed file by name, so it is created with its final mode): 5 system
//! calls a file on the receiver instead of 7. An interrupted copy leaves
//! nothing behind: the kernel frees an unnamed inode with its last fd.
//!
//! Where this cannot work the caller makes a named temp as before: a file
//! system without `O_TMPFILE` (then no later file tries again), or no
//! `/proc/self/fd` (without `CAP_DAC_READ_SEARCH` the link goes through
//! it; `process_umask` reads `/proc` too).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, CWD};
use rustix::io::Errno;

/// Cleared for good by a file system without `O_TMPFILE`, or a link that
/// failed for another reason than a name in the way.
static WORKS: AtomicBool = AtomicBool::new(true);

/// How an unnamed file is linked: not known yet, `AT_EMPTY_PATH` on the fd
/// (needs `CAP_DAC_READ_SEARCH`), or through `/proc/self/fd/N`.
static HOW: AtomicU8 = AtomicU8::new(UNKNOWN);
const UNKNOWN: u8 = 0;
const EMPTY_PATH: u8 = 1;
const PROC_FD: u8 = 2;

fn proc_fd_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| Path::new("/proc/self/fd").is_dir())
}

/// An unnamed file in `dir`, open read-write with permission bits `mode`
/// (masked by the umask), or `None`: make a named temp instead.
pub(crate) fn create(dir: BorrowedFd<'_>, mode: u32) -> Option<OwnedFd> {
    if !WORKS.load(Ordering::Relaxed) || !proc_fd_present() {
        return None;
    }
    match rfs::openat(
        dir,
        ".",
        OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    ) {
        Ok(fd) => Some(fd),
        Err(e @ (Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL)) => {
            // ISDIR and INVAL: a kernel or file system that does not know
            // the flag. The named path works there as before.
            tracing::debug!(error = %e, "no O_TMPFILE here; named temp files from now on");
            WORKS.store(false, Ordering::Relaxed);
            None
        }
        // Anything else (no permission, no space, ...) the named create
        // meets too, and reports with the temp file's path.
        Err(_) => None,
    }
}

/// Give the unnamed file `fd` the name `name` in `dir`. `EEXIST` when a
/// name is in the way (nothing is replaced); other errors also stop later
/// files from being made unnamed.
pub(crate) fn link(
    fd: BorrowedFd<'_>,
    dir: BorrowedFd<'_>,
    name: &std::ffi::OsStr,
) -> Result<(), Errno> {
    let r = link_once(fd, dir, name);
    if let Err(e) = r {
        if e != Errno::EXIST {
            WORKS.store(false, Ordering::Relaxed);
        }
    }
    r
}

fn link_once(fd: BorrowedFd<'_>, dir: BorrowedFd<'_>, name: &std::ffi::OsStr) -> Result<(), Errno> {
    if HOW.load(Ordering::Relaxed) != PROC_FD {
        match rfs::linkat(fd, "", dir, name, AtFlags::EMPTY_PATH) {
            Ok(()) => {
                HOW.store(EMPTY_PATH, Ordering::Relaxed);
                return Ok(());
            }
            // Without CAP_DAC_READ_SEARCH: ENOENT (linkat(2)).
            Err(Errno::NOENT | Errno::PERM) if HOW.load(Ordering::Relaxed) == UNKNOWN => {
                HOW.store(PROC_FD, Ordering::Relaxed);
            }
            Err(e) => return Err(e),
        }
    }
    let magic = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    rfs::linkat(CWD, magic.as_str(), dir, name, AtFlags::SYMLINK_FOLLOW)
}
