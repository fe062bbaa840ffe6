//! Recursion (`-r`) and scp-style destination naming.
//!
//! [`walk`] lists a directory tree without ever following a symlink (each step is
//! `openat(O_NOFOLLOW)` / `fstatat(AT_SYMLINK_NOFOLLOW)` relative to the parent fd),
//! in a deterministic order: depth-first, a directory right before its contents,
//! siblings sorted by name bytes.
//!
//! Symlink policy: a symlink is kept as an [`EntryKind::Symlink`] entry (to be
//! recreated as a symlink with the same target text, see [`Root::symlink`]) when its
//! target is relative and, read lexically from the link's directory, stays inside the
//! walked tree; a dangling link that satisfies this is kept too (as `cp -a`/rsync do).
//! Absolute targets and targets climbing out of the tree are skipped, with a warning
//! and a [`Skipped`] record, so a copy never carries a pointer outside what was asked
//! for. FIFOs, sockets and devices are skipped the same way.

use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, Mode, OFlags};

use super::error::{io_err, FileError, Result};
use super::path::{check_name_os, symlink_target_within};
use super::root::{list_fd, FileKind, Root, Timestamp};

/// Deepest directory nesting [`walk`] descends into.
pub const MAX_DEPTH: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
}

/// One object of a walked tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Relative to the walked directory (which itself is not listed).
    pub rel_path: PathBuf,
    pub kind: EntryKind,
    /// File length; 0 for directories, target length for symlinks.
    pub len: u64,
    pub mode: u32,
    pub mtime: Timestamp,
    /// For symlinks: the target, as stored in the link.
    pub symlink_target: Option<PathBuf>,
}

/// Something [`walk`] left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub rel_path: PathBuf,
    /// What it is (a symlink, or something else that is not a regular file
    /// or a directory).
    pub kind: FileKind,
    pub reason: &'static str,
}

/// Why [`walk`] leaves out an entry whose name is not valid UTF-8 (and
/// does not descend into it).
pub const NOT_UTF8: &str = "name is not valid UTF-8 (rcp carries names as UTF-8)";

/// `p` for a message: valid UTF-8 as it is, each byte of an invalid
/// sequence as `\xNN` (so a name that is not UTF-8 is named exactly).
pub fn shown_bytes(p: &Path) -> String {
    let mut out = String::new();
    for c in p.as_os_str().as_bytes().utf8_chunks() {
        out.push_str(c.valid());
        for b in c.invalid() {
            out.push_str(&format!("\\x{b:02X}"));
        }
    }
    out
}

/// Result of a walk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    pub entries: Vec<Entry>,
    pub skipped: Vec<Skipped>,
}

/// Walk a local directory (client side; `path` itself may be a symlink to a
/// directory, as on the command line; nothing below it is followed).
pub fn walk(path: impl AsRef<Path>) -> Result<Tree> {
    let path = path.as_ref();
    let fd = rfs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open directory", path, e))?;
    walk_fd(fd, path)
}

impl Root {
    /// Walk directory `rel` beneath the root (server side, for `pull -r`).
    pub fn walk(&self, rel: &str) -> Result<Tree> {
        let d = self.open_dir(rel)?;
        let display = d.display().to_owned();
        let fd = d
            .fd()
            .try_clone_to_owned()
            .map_err(|e| io_err("dup", &display, e))?;
        walk_fd(fd, &display)
    }
}

fn walk_fd(fd: OwnedFd, display: &Path) -> Result<Tree> {
    let mut tree = Tree::default();
    // Sibling directories are walked side by side on the hashing pool
    // (before a copy starts it has nothing else to do): a tree's walk is a
    // `getdents` and an `fstatat` per entry, one core's work for ~2.5 µs a
    // file. Their entries are put back in the serial walk's order.
    super::digest::pool().install(|| walk_dir(&fd, display, Path::new(""), 0, &mut tree))?;
    Ok(tree)
}

/// Below this depth sibling directories are walked in parallel; deeper ones
/// one after the other, on the thread that reached them (a bound on how
/// many walks one pool thread's stack holds while it waits for others, and
/// on the directories open at once: one per level and thread).
const PARALLEL_DEPTH: usize = 8;

/// A directory met by [`walk_dir`], walked once its parent is listed:
/// its name, and where its contents go among its parent's (after
/// `entries` entries and `skipped` skips of the parent's own listing).
struct SubDir {
    name: OsString,
    rel: PathBuf,
    entries: usize,
    skipped: usize,
}

fn walk_dir(
    dir: &OwnedFd,
    display: &Path,
    prefix: &Path,
    depth: usize,
    out: &mut Tree,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(FileError::TooDeep {
            path: display.join(prefix),
            max: MAX_DEPTH,
        });
    }
    let (e0, s0) = (out.entries.len(), out.skipped.len());
    let mut subs = Vec::new();
    for e in list_fd(dir, &display.join(prefix))? {
        let rel = prefix.join(&e.name);
        let m = e.meta;
        let mut entry = Entry {
            rel_path: rel.clone(),
            kind: EntryKind::File,
            len: m.len,
            mode: m.mode,
            mtime: m.mtime,
            symlink_target: None,
        };
        let skip = |out: &mut Tree, reason| {
            let p = display.join(&rel).display().to_string();
            // Debug only: the caller says it (rcp's warning and count, a
            // List entry's `left_out` for a pull).
            tracing::debug!(path = %crate::escape::esc(&p), reason, "skipped");
            out.skipped.push(Skipped {
                rel_path: rel.clone(),
                kind: m.kind,
                reason,
            });
        };
        // rcp carries names as UTF-8: one that is not cannot be copied as
        // itself (nor what is beneath it), and is never renamed.
        if e.name.to_str().is_none() {
            skip(out, NOT_UTF8);
            continue;
        }
        match m.kind {
            FileKind::File => out.entries.push(entry),
            FileKind::Other => skip(out, "not a regular file, directory or symlink"),
            FileKind::Symlink => {
                let t = match rfs::readlinkat(dir, e.name.as_os_str(), Vec::new()) {
                    Ok(t) => PathBuf::from(OsString::from_vec(t.into_bytes())),
                    Err(err) => return Err(io_err("readlink", display.join(&rel), err)),
                };
                if t.as_os_str().as_bytes().starts_with(b"/") {
                    skip(out, "absolute symlink");
                } else if symlink_target_within(&rel, &t).is_none() {
                    skip(out, "symlink pointing outside the tree");
                } else {
                    entry.kind = EntryKind::Symlink;
                    entry.symlink_target = Some(t);
                    out.entries.push(entry);
                }
            }
            FileKind::Dir => {
                entry.kind = EntryKind::Dir;
                entry.len = 0;
                out.entries.push(entry);
                subs.push(SubDir {
                    name: e.name,
                    rel,
                    entries: out.entries.len() - e0,
                    skipped: out.skipped.len() - s0,
                });
            }
        }
    }
    if subs.is_empty() {
        return Ok(());
    }
    let walk_sub = |d: &SubDir, out: &mut Tree| {
        let sub = rfs::openat(
            dir,
            d.name.as_os_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|err| io_err("open directory", display.join(&d.rel), err))?;
        walk_dir(&sub, display, &d.rel, depth + 1, out)
    };
    let mut walked: Vec<Option<Tree>> = if subs.len() > 1 && depth < PARALLEL_DEPTH {
        use rayon::prelude::*;
        subs.par_iter()
            .map(|d| {
                let mut t = Tree::default();
                walk_sub(d, &mut t).map(|()| Some(t))
            })
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    // Each subdirectory's contents right after its own entry, as a
    // serial walk puts them (one not walked yet is walked here, into place).
    let mine = out.entries.split_off(e0);
    let my_skips = out.skipped.split_off(s0);
    let (mut e, mut k) = (mine.into_iter(), my_skips.into_iter());
    let (mut e_at, mut k_at) = (0, 0);
    for (i, d) in subs.iter().enumerate() {
        out.entries.extend(e.by_ref().take(d.entries - e_at));
        out.skipped.extend(k.by_ref().take(d.skipped - k_at));
        (e_at, k_at) = (d.entries, d.skipped);
        match walked.get_mut(i).and_then(Option::take) {
            Some(t) => {
                out.entries.extend(t.entries);
                out.skipped.extend(t.skipped);
            }
            None => walk_sub(d, out)?,
        }
    }
    out.entries.extend(e);
    out.skipped.extend(k);
    Ok(())
}

/// Where a source named `source_name` lands, scp-style:
/// - `dest_exists_as_dir`: inside it, `dest/source_name` (for a file and for `-r`);
/// - otherwise `dest` itself is the new name, unless `multiple_sources` (then the
///   destination must be an existing directory) or `dest` ends in `/` (then it
///   must be an existing directory: scp refuses too);
/// - an empty `dest` means `.` (as in `host:`).
///
/// `source_name` is the last component of the source path (trailing slashes
/// stripped by the caller); it must be a plain name.
pub fn resolve_destination(
    dest: &Path,
    dest_exists_as_dir: bool,
    source_name: &OsStr,
    multiple_sources: bool,
) -> Result<PathBuf> {
    check_name_os(source_name)?;
    let dest = if dest.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dest
    };
    if dest_exists_as_dir {
        return Ok(dest.join(source_name));
    }
    if multiple_sources {
        return Err(FileError::Destination {
            path: dest.to_owned(),
            why: "is not an existing directory; multiple sources need one",
        });
    }
    if dest.as_os_str().as_bytes().ends_with(b"/") {
        return Err(FileError::Destination {
            path: dest.to_owned(),
            why: "ends with '/' but is not an existing directory",
        });
    }
    Ok(dest.to_owned())
}
