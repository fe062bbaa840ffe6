//! Partial files (`.rcp-<name>.<tag>.part`, their `.manifest` and the
//! manifest's `.manifest.tmp`, which a process that ends in the middle of
//! saving the manifest leaves) nobody will resume:
//! - [`sweep_name`]: before a fresh copy of a name starts, the partials an
//!   earlier, interrupted copy of the same name left (a run without
//!   `--resume` replaces them rather than leaving another beside them);
//! - [`sweep_older`]: rcpd's `--partial-ttl`, every partial beneath its root
//!   untouched (neither it nor its manifest written) for longer than the ttl.
//!
//! Never one a live transfer holds: every [`super::Destination`] keeps an
//! exclusive `flock` on its temp file, and a partial is removed only while
//! its sweeper holds that lock.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{self as rfs, AtFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::manifest::Manifest;
use super::root::DirHandle;
use super::temp_prefix;
use crate::escape::esc;

const PART: &[u8] = b".part";
const MANIFEST: &[u8] = b".part.manifest";
/// [`Manifest::save`]'s temp name: the manifest's name and this.
const SAVING: &[u8] = b".tmp";

/// The temp file a partial's name belongs to: itself, or the temp whose
/// manifest (or manifest being saved) it is.
fn temp_of(name: &OsStr) -> &OsStr {
    let mut n = name.as_bytes();
    if n.ends_with(SAVING) && n[..n.len() - SAVING.len()].ends_with(MANIFEST) {
        n = &n[..n.len() - SAVING.len()];
    }
    if n.ends_with(MANIFEST) {
        n = &n[..n.len() - ".manifest".len()];
    }
    OsStr::from_bytes(n)
}

/// The name [`Manifest::save`] writes `manifest` under before its rename.
fn saving_name_for(manifest: &OsStr) -> OsString {
    let mut m = manifest.to_owned();
    m.push(OsStr::from_bytes(SAVING));
    m
}

/// The manifest's name beside temp file `temp`.
pub(super) fn manifest_name_for(temp: &OsStr) -> OsString {
    let mut m = temp.to_owned();
    m.push(".manifest");
    m
}

/// How long [`super::Destination::resume`] waits for the temp file of an
/// interrupted transfer to be released by its old owner.
pub(super) const RESUME_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Take `fd`'s exclusive flock, retrying for up to `wait`. `Ok(true)` when
/// it was held by someone else at first.
pub(super) fn lock_within(fd: &impl rustix::fd::AsFd, wait: Duration) -> rustix::io::Result<bool> {
    let until = Instant::now() + wait;
    let mut waited = false;
    loop {
        match rfs::flock(fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(waited),
            Err(Errno::WOULDBLOCK) if Instant::now() < until => {
                waited = true;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Remove an unusable temp/manifest pair (and a manifest left half saved)
/// unless a live transfer holds the temp file.
pub(super) fn discard(dir: &DirHandle, temp: &OsStr, manifest: &OsStr) {
    match rfs::openat(
        dir.fd(),
        temp,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            // A transfer that was just interrupted may still hold it for a
            // moment (as in resume); one that is really live keeps it.
            if lock_within(&fd, RESUME_LOCK_WAIT).is_err() {
                return; // in use
            }
            // Unlink while holding the lock.
            let _ = rfs::unlinkat(dir.fd(), temp, AtFlags::empty());
            drop(fd);
        }
        Err(Errno::NOENT) => {}
        Err(_) => return,
    }
    let _ = rfs::unlinkat(dir.fd(), manifest, AtFlags::empty());
    let _ = rfs::unlinkat(dir.fd(), saving_name_for(manifest), AtFlags::empty());
}

/// Names in the directory `fd` (no `stat`: a directory of many files costs
/// one pass of `getdents`), with their `d_type`.
fn names(fd: impl AsFd) -> rustix::io::Result<Vec<(OsString, FileType)>> {
    let dup = rfs::openat(
        fd,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut d = rfs::Dir::new(dup)?;
    let mut out = Vec::new();
    while let Some(e) = d.read() {
        let e = e?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push((OsString::from_vec(n.to_vec()), e.file_type()));
        }
    }
    Ok(out)
}

/// The partials in `dir` (temp files and manifests), sorted, listed once
/// per opened directory: what a destination created later adds is its own.
fn partials_in(dir: &DirHandle) -> &[OsString] {
    dir.partials_once(|| match names(dir.fd()) {
        Ok(e) => {
            let mut v: Vec<OsString> = e
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| is_partial(n))
                .collect();
            v.sort();
            v
        }
        Err(e) => {
            tracing::debug!(dir = %esc(dir.display().display()), error = %e, "cannot list for stale partials");
            Vec::new()
        }
    })
}

/// Remove the partials of `final_name` in `dir` (but `keep`, the caller's
/// own temp) that no live transfer holds: a partial whose manifest names
/// another final name (a long name sharing the truncated prefix) stays.
/// The directory is listed once per [`DirHandle`] (its first file), not
/// once per file: a tree of many files in one directory stays linear.
pub fn sweep_name(dir: &DirHandle, final_name: &OsStr, keep: &OsStr) {
    let prefix = temp_prefix(final_name);
    let entries = partials_in(dir);
    // Sorted: this name's partials are one run.
    let from = entries.partition_point(|n| n.as_bytes() < &prefix[..]);
    // Where the prefix is all of the name (up to 200 bytes), every match is
    // this name's; beyond, only a manifest can tell.
    let exact = final_name.len() <= 200;
    for name in &entries[from..] {
        let n = name.as_bytes();
        if !n.starts_with(&prefix) {
            break;
        }
        if name == keep {
            continue;
        }
        let temp = temp_of(name);
        let mname = manifest_name_for(temp);
        // A pair is handled once: with its manifest when there is one, else
        // with its temp file, else (only a manifest half saved) with that.
        let listed = |n: &OsStr| entries.binary_search_by(|e| e.as_os_str().cmp(n)).is_ok();
        let by: &OsStr = if listed(&mname) {
            &mname
        } else if listed(temp) {
            temp
        } else {
            name
        };
        if name.as_os_str() != by {
            continue;
        }
        if temp == keep {
            continue;
        }
        let ours = match Manifest::load(dir, &mname) {
            Ok(m) => m.final_name == final_name,
            Err(_) => exact,
        };
        if ours {
            tracing::info!(temp = %esc(dir.display().join(temp).display()),
                "removing the partial of an earlier copy (a new copy of the name starts)");
            discard(dir, temp, &mname);
        }
    }
}

/// What [`sweep_older`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Partials removed (with their manifests).
    pub removed: u64,
    /// Partials old enough but held by a live transfer.
    pub in_use: u64,
}

/// Remove every partial beneath `root` (symlinks never followed) whose
/// temp file and manifest were both last written more than `ttl` before
/// `now`, unless a live transfer holds it; a manifest without its temp
/// file goes too.
pub fn sweep_older(root: &Path, ttl: Duration, now: SystemTime) -> std::io::Result<Swept> {
    let fd = rfs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut swept = Swept::default();
    let mut stack: Vec<(OwnedFd, PathBuf)> = vec![(fd, root.to_path_buf())];
    while let Some((dir, path)) = stack.pop() {
        let Ok(entries) = names(&dir) else { continue };
        for (name, ft) in &entries {
            let ft = match ft {
                FileType::Unknown => match rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => FileType::from_raw_mode(st.st_mode),
                    Err(_) => continue,
                },
                t => *t,
            };
            if ft == FileType::Directory {
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                if let Ok(sub) = rfs::openat(&dir, name, flags, Mode::empty()) {
                    stack.push((sub, path.join(name)));
                }
            } else if ft == FileType::RegularFile && is_partial(name) {
                sweep_one(&dir, &path, name, &entries, ttl, now, &mut swept);
            }
        }
    }
    Ok(swept)
}

fn is_partial(name: &OsStr) -> bool {
    let n = name.as_bytes();
    n.starts_with(b".rcp-")
        && (n.ends_with(PART) || n.ends_with(MANIFEST) || temp_of(name).len() < name.len())
}

/// When `name` in `dir` was last written, if it is there.
fn written(dir: &OwnedFd, name: &OsStr) -> Option<SystemTime> {
    let st = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).ok()?;
    let d = Duration::new(
        st.st_mtime.max(0) as u64,
        st.st_mtime_nsec.clamp(0, 999_999_999) as u32,
    );
    Some(SystemTime::UNIX_EPOCH + d)
}

fn sweep_one(
    dir: &OwnedFd,
    path: &Path,
    name: &OsStr,
    entries: &[(OsString, FileType)],
    ttl: Duration,
    now: SystemTime,
    swept: &mut Swept,
) {
    let old =
        |t: Option<SystemTime>| t.is_none_or(|t| now.duration_since(t).is_ok_and(|a| a > ttl));
    let temp = temp_of(name);
    if temp != name {
        // A manifest (or one half saved): with its temp file, handled
        // there; alone, an orphan.
        if !entries.iter().any(|(e, _)| e == temp) && old(written(dir, name)) {
            let _ = rfs::unlinkat(dir, name, AtFlags::empty());
        }
        return;
    }
    let mname = manifest_name_for(name);
    if !old(written(dir, name)) || !old(written(dir, &mname)) {
        return;
    }
    let Ok(fd) = rfs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    match rfs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {
            // Unlinked while the lock is held: no transfer takes it meanwhile.
            let _ = rfs::unlinkat(dir, name, AtFlags::empty());
            for m in [saving_name_for(&mname), mname] {
                match rfs::unlinkat(dir, &m, AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    Err(e) => {
                        tracing::warn!(manifest = %esc(path.join(&m).display()), error = %e, "cannot remove")
                    }
                }
            }
            tracing::info!(temp = %esc(path.join(name).display()), ttl_s = ttl.as_secs(),
                "removed a partial file unused for longer than --partial-ttl");
            swept.removed += 1;
        }
        Err(_) => swept.in_use += 1,
    }
}

/// rcpd's `--partial-ttl`: a thread that sweeps `root` ([`sweep_older`])
/// now and then every `ttl / 4` (at least a second, at most an hour).
pub fn spawn_sweeper(root: PathBuf, ttl: Duration) -> std::io::Result<std::thread::JoinHandle<()>> {
    let every = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    std::thread::Builder::new()
        .name("partial-sweep".into())
        .spawn(move || loop {
            match sweep_older(&root, ttl, SystemTime::now()) {
                Ok(s) if s.removed > 0 || s.in_use > 0 => {
                    tracing::info!(removed = s.removed, in_use = s.in_use, "partial files swept")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(root = %esc(root.display()), error = %e, "cannot sweep partial files"),
            }
            std::thread::sleep(every);
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch_at(p: &Path, age: Duration) {
        std::fs::write(p, b"x").unwrap();
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
    }

    #[test]
    fn old_partials_go_fresh_and_held_ones_stay() {
        let tmp = tempfile::tempdir().unwrap();
        let sub = tmp.path().join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        let day = Duration::from_secs(86_400);
        let old = sub.join(".rcp-f.0011223344556677.part");
        touch_at(&old, 2 * day);
        touch_at(&sub.join(".rcp-f.0011223344556677.part.manifest"), 2 * day);
        let fresh = sub.join(".rcp-g.0011223344556677.part");
        touch_at(&fresh, Duration::ZERO);
        let held = tmp.path().join(".rcp-h.0011223344556677.part");
        touch_at(&held, 2 * day);
        let lock = std::fs::File::open(&held).unwrap();
        rfs::flock(&lock, FlockOperation::NonBlockingLockExclusive).unwrap();
        let orphan = tmp.path().join(".rcp-i.0011223344556677.part.manifest");
        touch_at(&orphan, 2 * day);
        // Manifests left half saved: alone, and beside their temp file.
        let half = tmp.path().join(".rcp-j.0011223344556677.part.manifest.tmp");
        touch_at(&half, 2 * day);
        touch_at(
            &sub.join(".rcp-f.0011223344556677.part.manifest.tmp"),
            2 * day,
        );
        let plain = tmp.path().join("plain");
        touch_at(&plain, 2 * day);
        let s = sweep_older(tmp.path(), day, SystemTime::now()).unwrap();
        assert_eq!(
            s,
            Swept {
                removed: 1,
                in_use: 1
            }
        );
        assert!(!old.exists() && !orphan.exists() && !half.exists());
        assert!(fresh.exists() && held.exists() && plain.exists());
        assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 1);
    }

    #[test]
    fn a_fresh_copy_sweeps_its_names_partials_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(tmp.path()).unwrap();
        let p = |n: &str| tmp.path().join(n);
        for n in [
            ".rcp-f.0011223344556677.part",
            ".rcp-f.0011223344556677.part.manifest",
            ".rcp-f.8899aabbccddeeff.part",
            ".rcp-f.8899aabbccddeeff.part.manifest.tmp",
            ".rcp-f.4444444444444444.part.manifest.tmp",
            ".rcp-f.5555555555555555.part",
            ".rcp-f.5555555555555555.part.manifest",
            ".rcp-f.5555555555555555.part.manifest.tmp",
            ".rcp-fo.0011223344556677.part",
            ".rcp-fo.0011223344556677.part.manifest.tmp",
            "f",
        ] {
            touch_at(&p(n), Duration::ZERO);
        }
        let own = OsStr::new(".rcp-f.1111111111111111.part");
        touch_at(&p(".rcp-f.1111111111111111.part"), Duration::ZERO);
        sweep_name(&dir, OsStr::new("f"), own);
        let mut left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".rcp-f.1111111111111111.part",
                ".rcp-fo.0011223344556677.part",
                ".rcp-fo.0011223344556677.part.manifest.tmp",
                "f"
            ]
        );
        // Listed once: a partial of the name made since is a live copy's.
        touch_at(&p(".rcp-f.2222222222222222.part"), Duration::ZERO);
        sweep_name(
            &dir,
            OsStr::new("f"),
            OsStr::new(".rcp-f.3333333333333333.part"),
        );
        assert!(p(".rcp-f.2222222222222222.part").exists());
    }
}
