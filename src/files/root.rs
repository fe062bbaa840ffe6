//! Confinement: every remote path is resolved beneath the served root.
//!
//! [`Root`] holds an `O_PATH|O_DIRECTORY` fd of the root. A remote path string is first
//! [normalized](super::path::normalize) (absolute paths and `..` above the top are
//! refused there), then resolved relative to the root fd with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` so that a symlink anywhere on
//! the way that points outside the root (absolute, or climbing with `..`) fails with
//! [`PathError::SymlinkOutside`]. Symlinks that stay inside the root are followed.
//!
//! Kernels without `openat2` (before 5.6, or seccomp filters answering ENOSYS/EPERM)
//! get [`Resolver::Walk`]: a component-wise `openat(O_NOFOLLOW)` walk that reads each
//! symlink itself and applies the same rules (absolute target: refused; `..` above the
//! root: refused; at most 40 links). Both resolvers are tested against the same cases.
//!
//! Nothing here follows a path string from the root again after a check: every step
//! is relative to an fd already known to be beneath the root, so renaming directories
//! concurrently cannot make a resolution escape.

use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::error::{io_err, FileError, PathError, Result};
use super::path::{check_name, normalize, symlink_target_within, RelPath};

/// How paths are resolved beneath the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolver {
    /// `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS` (Linux >= 5.6).
    Openat2,
    /// Component-wise `openat(O_NOFOLLOW)` walk, symlinks interpreted in user space.
    Walk,
}

/// Seconds and nanoseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

/// What kind of object a path names (symlinks not followed where documented).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    /// FIFO, socket, device: never transferred.
    Other,
}

/// The metadata the control plane needs about one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMeta {
    pub kind: FileKind,
    pub len: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub mtime: Timestamp,
    pub dev: u64,
    pub ino: u64,
}

impl FileMeta {
    #[allow(clippy::unnecessary_cast)]
    pub(crate) fn from_stat(st: &rfs::Stat) -> FileMeta {
        let ft = FileType::from_raw_mode(st.st_mode as _);
        let kind = match ft {
            FileType::RegularFile => FileKind::File,
            FileType::Directory => FileKind::Dir,
            FileType::Symlink => FileKind::Symlink,
            _ => FileKind::Other,
        };
        FileMeta {
            kind,
            len: st.st_size.max(0) as u64,
            mode: (st.st_mode as u32) & 0o7777,
            mtime: Timestamp {
                sec: st.st_mtime as i64,
                nsec: st.st_mtime_nsec as u32,
            },
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
        }
    }
}

/// One entry of [`Root::list`]: name within the directory and `lstat` metadata
/// (a symlink is reported as [`FileKind::Symlink`], not followed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub name: OsString,
    pub meta: FileMeta,
}

/// An open directory (`O_RDONLY|O_DIRECTORY`, so it can be fsynced) plus the path to
/// show in error messages. Where a [`super::commit::Destination`] is created.
///
/// Clones share the one fd (no `dup`: every destination keeps a handle of its
/// directory, and with many small files in flight a descriptor and a syscall per
/// file add up).
#[derive(Debug, Clone)]
pub struct DirHandle {
    fd: Arc<OwnedFd>,
    /// Shared by clones: a handle is cloned per file that goes in it.
    display: Arc<Path>,
    /// The partials (`.rcp-*.part*`) in the directory when first asked
    /// ([`super::partials`]): one listing per directory opened, not one
    /// per file created in it.
    partials: Arc<OnceLock<Vec<OsString>>>,
}

impl DirHandle {
    /// Open a local directory by path (client side: no confinement, the user's own
    /// file system; symlinks in `path` are followed like any local tool would).
    pub fn open(path: impl AsRef<Path>) -> Result<DirHandle> {
        let path = path.as_ref();
        let fd = rfs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("open directory", path, e))?;
        Ok(DirHandle {
            fd: Arc::new(fd),
            display: path.into(),
            partials: Arc::default(),
        })
    }
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    /// Set this directory's mode to exactly `mode` (permission bits) and
    /// its mtime to `mtime` (`-p`, once nothing more is written into it).
    pub fn set_attrs(&self, mode: u32, mtime: Timestamp) -> Result<()> {
        set_attrs_fd(self.fd(), &self.display, mode, mtime)
    }
    /// The partials in the directory when this handle (or a clone) first
    /// asked, by `list`; later asks get the same list.
    pub(crate) fn partials_once(&self, list: impl FnOnce() -> Vec<OsString>) -> &[OsString] {
        self.partials.get_or_init(list)
    }
    pub(crate) fn fd_owned(&self) -> &OwnedFd {
        &self.fd
    }
    /// Whether `self` and `other` are clones of one handle (one open directory).
    pub(crate) fn same_handle(&self, other: &DirHandle) -> bool {
        Arc::ptr_eq(&self.fd, &other.fd)
    }
    /// The path used in messages (root path + relative path on the server).
    pub fn display(&self) -> &Path {
        &self.display
    }
    /// A handle sharing this one's fd (never fails; kept for callers that
    /// expect a `Result`).
    pub fn try_clone(&self) -> Result<DirHandle> {
        Ok(self.clone())
    }
    /// What `name` in this directory is, symlinks not followed (`None`:
    /// nothing there). One `fstatat` beside the directory's fd, where
    /// [`Root::stat`] resolves a whole path beneath the root.
    pub fn entry(&self, name: impl AsRef<OsStr>) -> Result<Option<FileMeta>> {
        let name = name.as_ref();
        match rfs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(FileMeta::from_stat(&st))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(io_err("stat", self.display.join(name), e)),
        }
    }
    /// `fstat` of the directory itself.
    pub fn meta(&self) -> Result<FileMeta> {
        let st = rfs::fstat(&self.fd).map_err(|e| io_err("stat", &*self.display, e))?;
        Ok(FileMeta::from_stat(&st))
    }
}

/// The served root directory; all remote paths are confined beneath it.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    path: PathBuf,
    resolver: Resolver,
}

const MAX_SYMLINKS: usize = 40;

/// An fd opened `O_NONBLOCK` (so that opening a FIFO cannot block) with
/// `keep` of the flags `F_SETFL` sets (`O_DIRECT`, `O_NOATIME`, ...), made
/// a blocking reader of a regular file: its `fstat`, anything but a
/// regular file refused ([`PathError::NotRegularFile`], `shown`), and one
/// `F_SETFL` to `keep`, which drops `O_NONBLOCK` without reading the flags
/// first (each file a copy opens pays these calls).
pub(crate) fn regular_fd(
    fd: OwnedFd,
    keep: OFlags,
    shown: &str,
) -> Result<(OwnedFd, rfs::Stat), PathError> {
    let st = rfs::fstat(&fd).map_err(|e| map_errno(e, shown, "stat"))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(PathError::NotRegularFile {
            path: shown.to_owned(),
        });
    }
    rfs::fcntl_setfl(&fd, keep).map_err(|e| map_errno(e, shown, "fcntl"))?;
    Ok((fd, st))
}

fn map_errno(e: Errno, path: &str, op: &'static str) -> PathError {
    let path = path.to_owned();
    match e {
        Errno::NOENT => PathError::NotFound { path },
        Errno::NOTDIR => PathError::NotADirectory { path },
        Errno::XDEV => PathError::SymlinkOutside { path },
        Errno::LOOP => PathError::SymlinkLoop { path },
        e => PathError::Io {
            op,
            path,
            source: e.into(),
        },
    }
}

impl Root {
    /// Open `dir` as the root, choosing `openat2` when the kernel has it.
    pub fn open(dir: impl AsRef<Path>) -> Result<Root> {
        let mut root = Self::open_with(dir, Resolver::Openat2)?;
        let probe = rfs::openat2(
            &root.fd,
            ".",
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        );
        if let Err(e @ (Errno::NOSYS | Errno::PERM)) = probe {
            tracing::info!(root = %root.path.display(), error = %e,
                "openat2 unavailable; resolving paths with an O_NOFOLLOW walk");
            root.resolver = Resolver::Walk;
        }
        Ok(root)
    }

    /// Open `dir` as the root with a given resolver (tests; forcing the fallback).
    pub fn open_with(dir: impl AsRef<Path>, resolver: Resolver) -> Result<Root> {
        let path = dir.as_ref();
        let fd = rfs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("open root", path, e))?;
        Ok(Root {
            fd,
            path: path.to_owned(),
            resolver,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn resolver(&self) -> Resolver {
        self.resolver
    }

    /// Resolve a normalized path beneath the root and open it with `flags`
    /// (`O_CLOEXEC` is added; `O_NOFOLLOW` too unless `follow_final`).
    pub(crate) fn resolve(
        &self,
        rel: &RelPath,
        flags: OFlags,
        follow_final: bool,
    ) -> Result<OwnedFd, PathError> {
        match self.resolver {
            Resolver::Openat2 => self.resolve_openat2(rel, flags, follow_final),
            Resolver::Walk => self.resolve_walk(rel, flags, follow_final),
        }
    }

    fn resolve_openat2(
        &self,
        rel: &RelPath,
        flags: OFlags,
        follow_final: bool,
    ) -> Result<OwnedFd, PathError> {
        let mut f = flags | OFlags::CLOEXEC;
        if !follow_final {
            f |= OFlags::NOFOLLOW;
        }
        let path = rel.to_path();
        let mut tries = 0;
        loop {
            match rfs::openat2(
                &self.fd,
                &path,
                f,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            ) {
                // A concurrent rename/mount made the kernel give up; try again.
                Err(Errno::AGAIN) if tries < 16 => tries += 1,
                r => return r.map_err(|e| map_errno(e, &rel.to_string(), "open")),
            }
        }
    }

    fn resolve_walk(
        &self,
        rel: &RelPath,
        flags: OFlags,
        follow_final: bool,
    ) -> Result<OwnedFd, PathError> {
        let disp = rel.to_string();
        let err = |e: Errno| map_errno(e, &disp, "open");
        let outside = || PathError::SymlinkOutside { path: disp.clone() };
        let flags = flags | OFlags::CLOEXEC;
        let mut stack: Vec<OwnedFd> = Vec::new();
        let mut queue: VecDeque<Vec<u8>> = rel
            .components()
            .iter()
            .map(|c| c.as_bytes().to_vec())
            .collect();
        let mut links = 0;
        while let Some(name) = queue.pop_front() {
            if name == b".." {
                if stack.pop().is_none() {
                    return Err(outside());
                }
                continue;
            }
            if name.is_empty() || name == b"." {
                continue;
            }
            let cur: BorrowedFd<'_> = stack.last().map_or(self.fd.as_fd(), |f| f.as_fd());
            let last = queue.is_empty();
            let name = OsStr::from_bytes(&name);
            let st = rfs::statat(cur, name, AtFlags::SYMLINK_NOFOLLOW).map_err(err)?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Symlink && (!last || follow_final) {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(PathError::SymlinkLoop { path: disp });
                }
                let target = rfs::readlinkat(cur, name, Vec::new()).map_err(err)?;
                let target = target.as_bytes();
                if target.first() == Some(&b'/') {
                    return Err(outside());
                }
                for c in target.split(|&b| b == b'/').rev() {
                    queue.push_front(c.to_vec());
                }
                continue;
            }
            if last {
                return rfs::openat(cur, name, flags | OFlags::NOFOLLOW, Mode::empty())
                    .map_err(err);
            }
            let fd = rfs::openat(
                cur,
                name,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(err)?;
            stack.push(fd);
        }
        // The root itself, or a path whose last step was "." / ".." from a link target.
        let cur = stack.last().map_or(self.fd.as_fd(), |f| f.as_fd());
        rfs::openat(cur, ".", flags, Mode::empty()).map_err(err)
    }

    /// A path as messages show it: beneath the root, as the client named
    /// it; rcpd's own root path never reaches a client (it logs it once
    /// at start).
    fn display(&self, rel: &RelPath) -> PathBuf {
        // The root itself is "" so that a name in it reads `name`.
        match rel.file_name() {
            None => PathBuf::new(),
            Some(_) => rel.to_path(),
        }
    }

    /// Open a regular file for reading. Symlinks inside the root are followed; FIFOs,
    /// devices and directories are refused with [`PathError::NotRegularFile`].
    pub fn open_read(&self, rel: &str) -> Result<File> {
        let r = normalize(rel)?;
        Ok(File::from(self.open_regular(&r, OFlags::empty(), rel)?.0))
    }

    /// Open a regular file beneath the root with extra flags (e.g. `O_DIRECT`):
    /// the fd and its `fstat`. `O_NONBLOCK` keeps a FIFO from blocking the open;
    /// it is refused right after ([`regular_fd`]).
    pub(crate) fn open_regular(
        &self,
        r: &RelPath,
        extra: OFlags,
        shown: &str,
    ) -> Result<(OwnedFd, rfs::Stat), PathError> {
        let fd = self.resolve(
            r,
            OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | extra,
            true,
        )?;
        regular_fd(fd, extra, shown)
    }

    /// Metadata of `rel`, following symlinks that stay inside the root.
    pub fn stat(&self, rel: &str) -> Result<FileMeta> {
        let r = normalize(rel)?;
        let fd = self.resolve(&r, OFlags::PATH, true)?;
        let st = rfs::fstat(&fd).map_err(|e| map_errno(e, rel, "stat"))?;
        Ok(FileMeta::from_stat(&st))
    }

    /// Metadata of `rel` itself: a final symlink is reported, not followed,
    /// unless `rel` ends in `/` (`link/` names what the link points to, as
    /// in POSIX path resolution and rsync's `SRC/`).
    pub fn lstat(&self, rel: &str) -> Result<FileMeta> {
        let r = normalize(rel)?;
        let fd = self.resolve(&r, OFlags::PATH, r.trailing_slash())?;
        let st = rfs::fstat(&fd).map_err(|e| map_errno(e, rel, "stat"))?;
        Ok(FileMeta::from_stat(&st))
    }

    /// The target text of symlink `rel`, as stored in the link (never
    /// followed; the target is not checked here).
    pub fn read_link(&self, rel: &str) -> Result<PathBuf> {
        let r = normalize(rel)?;
        let name = r.file_name().ok_or_else(|| PathError::BadName {
            name: rel.to_owned(),
            why: "the root itself is not a symlink",
        })?;
        let dir = self.open_dir_rel(&r.parent())?;
        let t = rfs::readlinkat(dir.fd(), name, Vec::new())
            .map_err(|e| io_err("readlink", self.display(&r), e))?;
        Ok(PathBuf::from(OsString::from_vec(t.into_bytes())))
    }

    /// The entries of directory `rel`, sorted by name, with `lstat` metadata.
    pub fn list(&self, rel: &str) -> Result<Vec<ListEntry>> {
        let r = normalize(rel)?;
        let dir = self.resolve(&r, OFlags::RDONLY | OFlags::DIRECTORY, true)?;
        list_fd(&dir, &self.display(&r))
    }

    /// Open directory `rel` (following in-root symlinks) for creating files in it.
    pub fn open_dir(&self, rel: &str) -> Result<DirHandle> {
        let r = normalize(rel)?;
        self.open_dir_rel(&r)
    }

    pub(crate) fn open_dir_rel(&self, r: &RelPath) -> Result<DirHandle> {
        let fd = self.resolve(r, OFlags::RDONLY | OFlags::DIRECTORY, true)?;
        Ok(DirHandle {
            fd: Arc::new(fd),
            display: self.display(r).into(),
            partials: Arc::default(),
        })
    }

    /// `mkdir -p rel` beneath the root; returns the (last) directory, opened.
    /// New directories get mode `0o777 & !umask`. An existing non-directory on the
    /// way fails with [`PathError::NotADirectory`].
    pub fn create_dir_all(&self, rel: &str) -> Result<DirHandle> {
        self.create_dir_all_mode(rel, 0)
    }

    /// [`create_dir_all`](Self::create_dir_all), the last directory, when
    /// it makes it, with a copied directory's permission bits `mode` plus
    /// the owner's rwx (the copy writes into it), masked by the umask:
    /// never wider than the source for group and others (rsync's rule
    /// without `-p`). `mode` 0: `0o777` masked, as the parents it makes.
    pub fn create_dir_all_mode(&self, rel: &str, mode: u32) -> Result<DirHandle> {
        self.make_dirs(rel, mode, false)
    }

    /// [`create_dir_all_mode`](Self::create_dir_all_mode) of a directory
    /// of a copied tree: a symlink standing at `rel` itself is not followed
    /// but replaced by a new directory (rsync without `--keep-dirlinks`);
    /// the link is removed, never what it points to. Parents are followed
    /// (beneath the root) as ever.
    pub fn create_tree_dir(&self, rel: &str, mode: u32) -> Result<DirHandle> {
        self.make_dirs(rel, mode, true)
    }

    fn make_dirs(&self, rel: &str, mode: u32, replace_link: bool) -> Result<DirHandle> {
        let r = normalize(rel)?;
        let last = r.components().len();
        let mut cur = self.open_dir_rel(&RelPath::root())?;
        let mut prefix = RelPath::root();
        for (i, name) in r.components().iter().enumerate() {
            let next = prefix.join(name)?;
            let mode = match i + 1 == last {
                true => super::mode::asked_dir_mode(mode),
                false => 0o777,
            };
            if i + 1 == last && replace_link {
                return self.tree_dir_in(&cur, name, &next, mode);
            }
            match self.open_dir_rel(&next) {
                Ok(d) => cur = d,
                Err(FileError::Path(PathError::NotFound { .. })) => {
                    match rfs::mkdirat(cur.fd(), name.as_str(), Mode::from_raw_mode(mode)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io_err("mkdir", self.display(&next), e)),
                    }
                    cur = self.open_dir_rel(&next)?;
                }
                // The directory asked for is a file: named, not "a
                // component" (the parents before it were opened).
                Err(FileError::Path(PathError::NotADirectory { .. })) if i + 1 == last => {
                    return Err(FileError::NotADirectory {
                        path: self.display(&next),
                    })
                }
                Err(e) => return Err(e),
            }
            prefix = next;
        }
        Ok(cur)
    }

    /// Directory `name` in `parent` (`rel` beneath the root), made with
    /// `mode` when missing; a symlink there is removed first, and the
    /// directory is opened without following one (a link put back in
    /// between is refused, not followed).
    fn tree_dir_in(
        &self,
        parent: &DirHandle,
        name: &str,
        rel: &RelPath,
        mode: u32,
    ) -> Result<DirHandle> {
        let shown = self.display(rel);
        if parent
            .entry(name)?
            .is_some_and(|m| m.kind == FileKind::Symlink)
        {
            match rfs::unlinkat(parent.fd(), name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io_err("remove symlink", &shown, e)),
            }
            tracing::debug!(path = %crate::escape::esc(shown.display()),
                "a symlink stood where the tree has a directory: replaced");
        }
        match rfs::mkdirat(parent.fd(), name, Mode::from_raw_mode(mode)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io_err("mkdir", &shown, e)),
        }
        let fd = rfs::openat(
            parent.fd(),
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            // Not a directory (a file), or a symlink again.
            Errno::NOTDIR | Errno::LOOP => FileError::NotADirectory {
                path: shown.clone(),
            },
            e => io_err("open directory", &shown, e),
        })?;
        Ok(DirHandle {
            fd: Arc::new(fd),
            display: shown.into(),
            partials: Arc::default(),
        })
    }

    /// A maker of a copied tree's directories, one after the other
    /// ([`TreeDirs`]).
    pub fn tree_dirs(&self) -> TreeDirs<'_> {
        TreeDirs {
            root: self,
            open: HashMap::new(),
        }
    }

    /// `-p` after a copy: set directory `rel`'s mode to exactly `mode`
    /// (permission bits) and its mtime to `mtime`. It must exist and be a
    /// directory (not a symlink to one).
    pub fn set_dir_attrs(&self, rel: &str, mode: u32, mtime: Timestamp) -> Result<()> {
        let r = normalize(rel)?;
        self.open_dir_rel(&r)?.set_attrs(mode, mtime)
    }

    /// `-p` with `-c` or `--size-only`, of a file left as it was: set regular file `rel`'s
    /// mode to exactly `mode` (permission bits) and its mtime to `mtime`.
    /// A symlink at `rel` is not followed; anything but a regular file is
    /// [`PathError::NotRegularFile`].
    pub fn set_file_attrs(&self, rel: &str, mode: u32, mtime: Timestamp) -> Result<()> {
        let r = normalize(rel)?;
        let fd = self.resolve(&r, OFlags::RDONLY | OFlags::NONBLOCK, false)?;
        set_file_attrs_fd(fd.as_fd(), rel, mode, mtime)
    }

    /// Create (or atomically replace) symlink `rel` -> `target`. The target must be
    /// relative and, read lexically from the link's directory, stay inside the root;
    /// otherwise [`PathError::SymlinkOutside`]. A directory at `rel` is not replaced.
    pub fn symlink(&self, rel: &str, target: &str) -> Result<()> {
        let r = normalize(rel)?;
        let name = r.file_name().ok_or_else(|| PathError::BadName {
            name: rel.to_owned(),
            why: "the root itself cannot be a symlink",
        })?;
        check_name(name)?;
        if target.is_empty()
            || target.as_bytes().contains(&0)
            || symlink_target_within(&r.to_path(), Path::new(target)).is_none()
        {
            return Err(PathError::SymlinkOutside {
                path: format!("{rel} -> {target}"),
            }
            .into());
        }
        let dir = self.open_dir_rel(&r.parent())?;
        let tmp = super::temp_name(OsStr::new(name), "link");
        rfs::symlinkat(target, dir.fd(), &tmp)
            .map_err(|e| io_err("symlink", self.display(&r), e))?;
        if let Err(e) = rfs::renameat(dir.fd(), &tmp, dir.fd(), name) {
            let _ = rfs::unlinkat(dir.fd(), &tmp, AtFlags::empty());
            return Err(match e {
                Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => FileError::IsADirectory {
                    path: self.display(&r),
                },
                e => io_err("rename", self.display(&r), e),
            });
        }
        Ok(())
    }
}

impl Root {
    /// Remove `rel` (a file, a symlink or an empty directory) beneath the
    /// root, following no symlink on the way nor at the end (each step an
    /// `openat(O_NOFOLLOW)`, then `unlinkat` of the name itself). The root
    /// itself is never removed; a directory that is not empty is refused.
    pub fn remove(&self, rel: &str) -> Result<()> {
        let r = normalize(rel)?;
        let name = r.file_name().ok_or_else(|| PathError::BadName {
            name: rel.to_owned(),
            why: "the root itself is never removed",
        })?;
        check_name(name)?;
        let top = self.open_dir_rel(&RelPath::root())?;
        let mut dir = top
            .fd()
            .try_clone_to_owned()
            .map_err(|e| io_err("dup", self.display(&r), e))?;
        for c in r.parent().components() {
            dir = rfs::openat(
                &dir,
                c.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| map_errno(e, rel, "open directory"))?;
        }
        let st = rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| map_errno(e, rel, "stat"))?;
        let flags = if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        rfs::unlinkat(&dir, name, flags).map_err(|e| map_errno(e, rel, "remove"))?;
        Ok(())
    }
}

/// List a directory fd: sorted entries with `lstat` metadata. Entries that vanish
/// between readdir and stat are skipped.
pub(crate) fn list_fd(dir: &OwnedFd, display: &Path) -> Result<Vec<ListEntry>> {
    let dup = dir.try_clone().map_err(|e| io_err("dup", display, e))?;
    let mut d = rfs::Dir::new(dup).map_err(|e| io_err("opendir", display, e))?;
    // `Dir` continues from the fd's offset; start from the top.
    d.rewind();
    let mut out = Vec::new();
    while let Some(ent) = d.read() {
        let ent = ent.map_err(|e| io_err("readdir", display, e))?;
        let name = ent.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let name = OsString::from_vec(name.to_vec());
        match rfs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => out.push(ListEntry {
                name,
                meta: FileMeta::from_stat(&st),
            }),
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(io_err("stat", display.join(&name), e)),
        }
    }
    out.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    Ok(out)
}

/// Set the regular file open at `fd` (named `display` in errors) to
/// exactly `mode` (permission bits) and mtime `mtime`; anything but a
/// regular file is [`PathError::NotRegularFile`] and is left untouched.
pub fn set_file_attrs_fd(
    fd: BorrowedFd<'_>,
    display: &str,
    mode: u32,
    mtime: Timestamp,
) -> Result<()> {
    let st = rfs::fstat(fd).map_err(|e| map_errno(e, display, "stat"))?;
    if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
        return Err(PathError::NotRegularFile {
            path: display.to_owned(),
        }
        .into());
    }
    set_attrs_fd(fd, Path::new(display), mode, mtime)
}

/// `-p`: what is open at `fd` (named `display` in errors) gets exactly
/// `mode` (permission bits) and mtime `mtime` (its atime too).
fn set_attrs_fd(fd: BorrowedFd<'_>, display: &Path, mode: u32, mtime: Timestamp) -> Result<()> {
    rfs::fchmod(fd, Mode::from_raw_mode(mode & 0o7777)).map_err(|e| io_err("chmod", display, e))?;
    let ts = rustix::fs::Timespec {
        tv_sec: mtime.sec,
        tv_nsec: mtime.nsec.into(),
    };
    let times = rfs::Timestamps {
        last_access: ts,
        last_modification: ts,
    };
    rfs::futimens(fd, &times).map_err(|e| io_err("utimens", display, e))?;
    Ok(())
}

/// A copied tree's directories made one after the other (`MakeDirs`),
/// each as [`Root::create_tree_dir`] makes it, but a parent this maker
/// made or opened before is used again instead of being resolved from the
/// root once more: a directory beneath one just made costs its `mkdirat`
/// and its open. At most [`TreeDirs::KEEP`] are kept open.
pub struct TreeDirs<'a> {
    root: &'a Root,
    open: HashMap<Vec<String>, DirHandle>,
}

impl TreeDirs<'_> {
    /// Directories kept open for those beneath them.
    pub const KEEP: usize = 256;

    /// [`Root::create_tree_dir`] of `rel`.
    pub fn make(&mut self, rel: &str, mode: u32) -> Result<()> {
        let r = normalize(rel)?;
        let c = r.components();
        let parent = c.split_last().and_then(|(_, p)| self.open.get(p));
        let made = match (r.file_name(), parent) {
            (Some(name), Some(parent)) => {
                let mode = super::mode::asked_dir_mode(mode);
                self.root.tree_dir_in(parent, name, &r, mode)?
            }
            _ => self.root.create_tree_dir(rel, mode)?,
        };
        if self.open.len() < Self::KEEP {
            self.open.insert(r.into_components(), made);
        }
        Ok(())
    }
}
