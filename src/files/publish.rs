//! Publishing verified files in batches: [`publish`] makes [`Sealed`]
//! files durable (one `syncfs` per file system), renames them over their
//! final names and fsyncs each directory once.

use rustix::fs::{self as rfs, AtFlags};
use rustix::io::Errno;

use std::os::fd::AsFd;

use super::commit::{Destination, Published, Sealed};
use super::error::{io_err, FileError, Result};
use super::root::DirHandle;
use super::unnamed;
use crate::escape::esc;

impl Sealed {
    /// [`publish`] this one file.
    pub fn publish(self) -> Result<Published> {
        publish(vec![self]).pop().expect("one result per file")
    }
}

/// Publish sealed files: results in the order given.
///
/// 1. Their data is made durable: one `syncfs(2)` per file system that holds
///    several of them (file systems told apart by the `st_dev` of the files'
///    directories), `fdatasync` (`fsync` with `-p`) for a file alone on its file
///    system. If a `syncfs` fails, each of its files is synced on its own, so only
///    the ones whose data did not reach the disk fail.
/// 2. THEN each file that is durable is renamed over its final name (an existing
///    file there is replaced atomically; a directory there fails that file with
///    [`FileError::IsADirectory`]).
/// 3. THEN each distinct parent directory of a renamed file is fsynced once (if that
///    fails, its files are already under their final names, durable in content, and
///    get the error).
/// 4. Then their manifests are removed.
///
/// A file that fails any step is not published (never visible under its final name
/// unless step 3 failed) and does not stop the others; it is dropped like a
/// [`Destination`]: kept with its manifest for resume if it keeps one, else removed.
pub fn publish(sealed: Vec<Sealed>) -> Vec<Result<Published>> {
    let mut results: Vec<Option<Result<Published>>> = (0..sealed.len()).map(|_| None).collect();
    let mut slots: Vec<Option<Sealed>> = sealed.into_iter().map(Some).collect();

    // Each file's directory, one entry per distinct directory.
    let mut dirs: Vec<DirInfo> = Vec::new();
    let mut dir_of = Vec::with_capacity(slots.len());
    let stat_dirs = slots.len() > 1;
    for s in slots.iter().flatten() {
        dir_of.push(DirInfo::index(&mut dirs, &s.dest.dir, stat_dirs));
    }

    // 1. Durable data.
    let mut groups: Vec<(Option<u64>, Vec<usize>)> = Vec::new();
    for (i, &d) in dir_of.iter().enumerate() {
        let dev = dirs[d].id.map(|(dev, _)| dev);
        match groups.iter_mut().find(|(g, _)| g.is_some() && *g == dev) {
            Some((_, members)) => members.push(i),
            None => groups.push((dev, vec![i])),
        }
    }
    for (_, members) in &groups {
        let synced_together = members.len() > 1 && {
            let any = slots[members[0]].as_ref().expect("not yet taken");
            match rfs::syncfs(any.dest.dir.fd()) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(dir = %esc(any.dest.dir.display().display()), error = %e,
                        "syncfs failed; syncing the files of the batch one by one");
                    false
                }
            }
        };
        if synced_together {
            continue;
        }
        for &i in members {
            let s = slots[i].as_ref().expect("not yet taken");
            if let Err(e) = s.dest.sync_file() {
                results[i] = Some(Err(e));
                slots[i] = None; // dropped: suspended or removed
            }
        }
    }

    // 2. Rename into place.
    let mut renamed_in = vec![false; dirs.len()];
    for (i, slot) in slots.iter_mut().enumerate() {
        let Some(s) = slot.as_mut() else { continue };
        let d = &mut s.dest;
        match into_place(d) {
            Ok(()) => {
                d.finished = true;
                renamed_in[dir_of[i]] = true;
            }
            Err(e) => {
                let path = d.final_path();
                results[i] = Some(Err(match e {
                    Errno::ISDIR | Errno::NOTEMPTY | Errno::EXIST => {
                        tracing::debug!(error = %e, "rename over a directory");
                        FileError::IsADirectory { path }
                    }
                    e => io_err("rename into place", path, e),
                }));
                *slot = None;
            }
        }
    }

    // 3. The new names, durable.
    let mut dir_err: Vec<Option<rustix::io::Errno>> = vec![None; dirs.len()];
    for (d, info) in dirs.iter().enumerate() {
        if renamed_in[d] {
            dir_err[d] = rfs::fsync(info.handle.fd()).err();
        }
    }

    // 4. Manifests go; results.
    for (i, slot) in slots.iter_mut().enumerate() {
        let Some(s) = slot.take() else { continue };
        if s.dest.keeps_manifest() {
            let _ = rfs::unlinkat(s.dest.dir.fd(), &s.dest.manifest_name, AtFlags::empty());
        }
        let info = &dirs[dir_of[i]];
        results[i] = Some(match dir_err[dir_of[i]] {
            None => Ok(s.published()),
            Some(e) => Err(io_err(
                "fsync directory (file renamed into place)",
                info.handle.display(),
                e,
            )),
        });
    }
    results
        .into_iter()
        .map(|r| r.expect("every file has a result"))
        .collect()
}

/// Put `d`'s temp file under its final name: `renameat` of a named one
/// (replacing what is there), `linkat` of an unnamed one. A name that came
/// into an unnamed one's way since it was made is replaced all the same:
/// the file is linked under its temp name, then renamed.
fn into_place(d: &mut Destination) -> Result<(), Errno> {
    let dir = d.dir.fd();
    if d.unnamed {
        match unnamed::link(d.file.as_fd(), dir, &d.manifest.final_name) {
            Err(Errno::EXIST) => {}
            r => return r,
        }
        unnamed::link(d.file.as_fd(), dir, &d.manifest.temp_name)?;
        // Named from here on: dropped unpublished, it is unlinked.
        d.unnamed = false;
    }
    rfs::renameat(dir, &d.manifest.temp_name, dir, &d.manifest.final_name)
}

/// A directory of files being published.
struct DirInfo {
    handle: DirHandle,
    /// `(st_dev, st_ino)`, when looked at.
    id: Option<(u64, u64)>,
}

impl DirInfo {
    /// The index in `dirs` of `dir` (same handle, or the same directory by
    /// device and inode when `stat`), added if new.
    fn index(dirs: &mut Vec<DirInfo>, dir: &DirHandle, stat: bool) -> usize {
        if let Some(i) = dirs.iter().position(|d| d.handle.same_handle(dir)) {
            return i;
        }
        #[allow(clippy::unnecessary_cast)]
        let id = stat
            .then(|| rfs::fstat(dir.fd()).ok())
            .flatten()
            .map(|st| (st.st_dev as u64, st.st_ino as u64));
        if let Some(i) = dirs.iter().position(|d| id.is_some() && d.id == id) {
            return i;
        }
        dirs.push(DirInfo {
            handle: dir.clone(),
            id,
        });
        dirs.len() - 1
    }
}
