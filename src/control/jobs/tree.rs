//! What `-r` does with a tree beyond its files: symlinks (`-a`: recreated
//! with their target text, never followed; without `-a`: skipped, said),
//! entries skipped and why, `--exclude`/`--include`, and `--delete`.
//!
//! Planned with the files ([`TreePlan`], what `--dry-run` lists) and done
//! after them by [`finish`]: links, then deletions, deepest first. Nothing
//! is ever dropped silently: every entry left out is a [`Note`] the binary
//! prints and counts ([`TreeCounts`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::filter::Filter;
use super::Job;
use futures::{StreamExt as _, TryStreamExt as _};

use crate::control::client::Client;
use crate::control::error::{ControlError, Reason, Result};
use crate::files::symlink_target_within;
use crate::proto::{self, FileType};

/// What an entry of a source tree is.
#[derive(Clone, Copy, Debug)]
pub enum Kind<'a> {
    File,
    Dir,
    /// A symlink and its target text (`None`: the side that listed it did
    /// not say).
    Link(Option<&'a str>),
    /// Left out by the walk, why: a symlink pointing outside (`link`), a
    /// FIFO, socket or device.
    Skipped {
        link: bool,
        why: &'a str,
    },
}

/// A symlink to make: push, a remote path; pull, a local one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkPlan {
    pub dest: String,
    pub target: String,
}

/// A source entry not copied, and why (printed, counted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub path: String,
    pub reason: String,
}

/// A destination entry `--delete` removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub path: String,
    pub dir: bool,
}

/// The tree part of a plan.
#[derive(Clone, Debug, Default)]
pub struct TreePlan {
    pub links: Vec<LinkPlan>,
    /// `-p`: every directory of the tree, deepest first, to get its
    /// source's mode and mtime once the files are in (rsync -a).
    pub preserved_dirs: Vec<PlannedDir>,
    pub left_out: Vec<Note>,
    /// Source entries `--exclude` left out (a directory counts once, its
    /// contents not at all).
    pub excluded: u64,
    /// Deepest first.
    pub deletes: Vec<Deletion>,
    /// `-p` with `-c` or `--size-only`: files left as they were whose
    /// mtime was not the source's ([`super::skip::retimed`]); they get the
    /// source's mode and mtime after the copy, as rsync updates a file's
    /// attributes without moving it.
    pub retimed: Vec<Retimed>,
}

/// A destination file (remote path for a push, local for a pull) left as
/// it was, to get its source's permission bits and mtime ([`finish`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retimed {
    pub path: String,
    pub mode: u32,
    pub mtime_ns: i64,
}

/// A directory of a copied tree at its destination (remote path for a
/// push, local for a pull), with its source's permission bits and mtime:
/// the mode it is made with (never wider than the source's for group and
/// others), and under `-p` what it gets after the copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedDir<P = String> {
    pub path: P,
    pub mode: u32,
    pub mtime_ns: i64,
    /// A directory of the copied tree, its top included unless it is the
    /// destination named on the command line: a symlink standing there is
    /// replaced by a directory, never followed (rsync without
    /// `--keep-dirlinks`). The named destination is followed, as scp and
    /// rsync follow it.
    pub in_tree: bool,
}

/// What the summary and `--json` count of a tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TreeCounts {
    /// Symlinks recreated (`-a`).
    pub links: u64,
    /// Entries left out, each with a warning (symlinks without `-a`, links
    /// pointing outside the tree, FIFOs, sockets, devices). Not the quick
    /// check's `skipped` (unchanged files).
    pub left_out: u64,
    /// Source entries left out by `--exclude`.
    pub excluded: u64,
    /// Destination entries removed by `--delete` (a dry run: would be).
    pub deleted: u64,
}

impl TreePlan {
    pub fn counts(&self) -> TreeCounts {
        TreeCounts {
            links: self.links.len() as u64,
            left_out: self.left_out.len() as u64,
            excluded: self.excluded,
            deleted: self.deletes.len() as u64,
        }
    }

    /// Judge one entry of a source tree at `rel` (shown as `shown()`,
    /// going to `dest()`): whether it is copied as a file or directory.
    /// Links and skips are recorded; with `--delete`, every name the
    /// source holds (excluded ones aside) goes into `names`, which it
    /// keeps. `shown` and `dest` are asked for only when recorded: a plain
    /// file or directory costs no path strings here.
    pub fn admit(
        &mut self,
        job: &Job,
        rel: &Path,
        kind: Kind<'_>,
        shown: impl FnOnce() -> String,
        dest: impl FnOnce() -> String,
        names: &mut HashSet<PathBuf>,
    ) -> bool {
        let is_dir = matches!(kind, Kind::Dir);
        if !job.filter.is_empty() && job.filter.excludes(&rel.to_string_lossy(), is_dir) {
            if !ancestor_excluded(&job.filter, rel) {
                self.excluded += 1;
            }
            return false;
        }
        if job.delete {
            names.insert(rel.to_path_buf());
        }
        let reason = match kind {
            Kind::File | Kind::Dir => return true,
            Kind::Link(_) | Kind::Skipped { link: true, .. } if !job.links => {
                "non-regular file (a symlink; -a copies symlinks)".into()
            }
            Kind::Skipped { link: true, why } => {
                format!("{why}: not copied (as rsync --safe-links)")
            }
            Kind::Skipped { why, .. } => why.to_string(),
            Kind::Link(None) => "symlink whose target rcpd did not send".into(),
            Kind::Link(Some(t)) => {
                if symlink_target_within(rel, Path::new(t)).is_some() {
                    self.links.push(LinkPlan {
                        dest: dest(),
                        target: t.to_string(),
                    });
                    return false;
                }
                format!("symlink to {t:?} points outside the copied tree (as rsync --safe-links)")
            }
        };
        self.left_out.push(Note {
            path: shown(),
            reason,
        });
        false
    }

    /// `--delete`: of `dest` (the destination tree's entries, relative,
    /// directories before their contents), those to remove: not among the
    /// source's `names`, not excluded, not holding an excluded entry
    /// (rsync protects excluded names from deletion). Added deepest
    /// first, each joined to `base` with `join`.
    pub fn delete_extras(
        &mut self,
        filter: &Filter,
        dest: &[(PathBuf, bool)],
        names: &HashSet<PathBuf>,
        join: impl Fn(&Path) -> String,
    ) {
        let (extras, kept) = extras(filter, dest, names);
        for rel in kept {
            tracing::warn!(
                "--delete: keeping {} in {}: its name is not valid UTF-8 (or stands \
                 for one that is not), so no source entry can be told to match it",
                crate::files::shown_bytes(&rel),
                join(Path::new(""))
            );
        }
        self.deletes
            .extend(extras.into_iter().map(|(rel, dir)| Deletion {
                path: join(&rel),
                dir,
            }));
    }
}

fn ancestor_excluded(filter: &Filter, rel: &Path) -> bool {
    rel.ancestors()
        .skip(1)
        .filter(|a| !a.as_os_str().is_empty())
        .any(|a| filter.excludes(&a.to_string_lossy(), true))
}

/// Whether a destination entry's name is not valid UTF-8, or (a remote
/// listing's lossy form of one) holds U+FFFD: no source name can be told
/// to match it, so `--delete` keeps it.
fn bad_name(rel: &Path) -> bool {
    rel.to_str().is_none_or(|s| s.contains('\u{FFFD}'))
}

/// The pure part of [`TreePlan::delete_extras`]: the extras, deepest
/// first, and the entries kept because of their names ([`bad_name`]).
fn extras(
    filter: &Filter,
    dest: &[(PathBuf, bool)],
    names: &HashSet<PathBuf>,
) -> (Vec<(PathBuf, bool)>, Vec<PathBuf>) {
    let mut protected: HashSet<&Path> = HashSet::new();
    let mut kept = Vec::new();
    for (rel, dir) in dest {
        if filter.excludes(&rel.to_string_lossy(), *dir) {
            protected.extend(rel.ancestors());
        } else if bad_name(rel) {
            // Itself and the directories holding it.
            protected.extend(rel.ancestors());
            kept.push(rel.clone());
        }
    }
    let mut out: Vec<(PathBuf, bool)> = dest
        .iter()
        .filter(|(rel, _)| {
            !names.contains(rel)
                && !protected.contains(rel.as_path())
                && !rel.ancestors().any(bad_name)
        })
        .cloned()
        .collect();
    // Contents before their directory.
    out.sort_by(|a, b| {
        b.0.components()
            .count()
            .cmp(&a.0.components().count())
            .then_with(|| a.0.cmp(&b.0))
    });
    (out, kept)
}

/// A remote destination tree's entries (`--delete`): relative paths and
/// whether each is a directory; empty when it is not a directory. One
/// recursive List, or (a tree too large for one answer) a List per
/// directory, 16 at a time.
pub(super) async fn remote_entries(client: &Client, base: &str) -> Result<Vec<(PathBuf, bool)>> {
    let is_dir = |e: &proto::Entry| e.r#type == FileType::Dir as i32;
    if !client.stat(base).await?.is_some_and(|e| is_dir(&e)) {
        return Ok(Vec::new());
    }
    match client.list(base, true).await {
        Ok(all) => {
            return all
                .iter()
                .map(|e| Ok((super::safe_rel(&e.path)?, is_dir(e))))
                .collect()
        }
        Err(e) => tracing::debug!(error = %e, base, "listing the destination per directory"),
    }
    let mut out = Vec::new();
    let mut level = vec![PathBuf::new()];
    while !level.is_empty() {
        let listed: Vec<(PathBuf, Vec<proto::Entry>)> = futures::stream::iter(level)
            .map(|rel| async move {
                let entries = client.list(&super::join_remote(base, &rel), false).await?;
                Ok::<_, ControlError>((rel, entries))
            })
            .buffered(16)
            .try_collect()
            .await?;
        level = Vec::new();
        for (dir, entries) in listed {
            for e in entries {
                let rel = dir.join(super::safe_rel(&e.path)?);
                // A lossy name names nothing there to list.
                if is_dir(&e) && !bad_name(&rel) {
                    level.push(rel.clone());
                }
                out.push((rel, is_dir(&e)));
            }
        }
    }
    Ok(out)
}

/// A local destination tree's entries (`--delete` on pull); none when
/// `base` is not a directory, or (`in_tree`) is a symlink, which the copy
/// replaces by a directory.
pub(super) fn local_entries(base: &Path, in_tree: bool) -> Result<Vec<(PathBuf, bool)>> {
    let link = || std::fs::symlink_metadata(base).is_ok_and(|m| m.is_symlink());
    if !base.is_dir() || (in_tree && link()) {
        return Ok(Vec::new());
    }
    let t = crate::files::walk(base)?;
    let all = t.entries.into_iter().map(|e| {
        let dir = e.kind == crate::files::EntryKind::Dir;
        (e.rel_path, dir)
    });
    Ok(all
        .chain(t.skipped.into_iter().map(|s| (s.rel_path, false)))
        .collect())
}

/// Make a local symlink `dest` -> `target` atomically: made under a
/// temporary name in the same directory, then renamed over what is there
/// (a directory is not replaced).
fn local_link(dest: &Path, target: &str) -> Result<()> {
    let name = dest.file_name().unwrap_or_default();
    let tmp = dest.with_file_name(crate::files::temp_name(name, "link"));
    std::os::unix::fs::symlink(target, &tmp)
        .map_err(ControlError::io(format!("symlink {}", dest.display())))?;
    std::fs::rename(&tmp, dest).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ControlError::Io {
            context: format!("replacing {} with a symlink", dest.display()),
            source: e,
        }
    })
}

/// Remove one local entry, never following a symlink (`remove_file` of a
/// link removes the link).
fn local_remove(d: &Deletion) -> Result<()> {
    let r = if d.dir {
        std::fs::remove_dir(&d.path)
    } else {
        std::fs::remove_file(&d.path)
    };
    r.map_err(ControlError::io(format!("deleting {}", d.path)))
}

/// Remote calls of [`finish`] in flight at once.
pub(super) const IN_FLIGHT: usize = 16;

/// After the files were copied: make the plan's links, then (`--delete`)
/// remove what the destination holds and the source does not, then (`-p`)
/// give every directory its source's mode and mtime, deepest first; calling
/// `deleted` for each (`linked` for each link made). A push's calls go `IN_FLIGHT` at a time; its
/// removals one depth at a time, so a directory goes only after what it
/// held.
pub async fn finish(
    client: &Client,
    push: bool,
    tree: &TreePlan,
    linked: &dyn Fn(&LinkPlan),
    deleted: &dyn Fn(&Deletion),
) -> Result<TreeCounts> {
    if push {
        let mut made = futures::stream::iter(&tree.links)
            .map(|l| async move { client.make_link(&l.dest, &l.target).await.map(|()| l) })
            .buffer_unordered(IN_FLIGHT);
        while let Some(l) = made.try_next().await? {
            linked(l);
        }
        for level in tree
            .deletes
            .chunk_by(|a, b| depth(&a.path) == depth(&b.path))
        {
            let mut done = futures::stream::iter(level)
                .map(|d| async move { client.remove(&d.path).await.map(|()| d) })
                .buffer_unordered(IN_FLIGHT);
            while let Some(d) = done.try_next().await? {
                deleted(d);
            }
        }
        let mut set = futures::stream::iter(&tree.retimed)
            .map(|f| async move { (f, client.set_file(&f.path, f.mode, f.mtime_ns).await) })
            .buffer_unordered(IN_FLIGHT);
        while let Some((f, r)) = set.next().await {
            match r {
                Ok(()) => {}
                // Not a regular file any more, or an rcpd before 2.10
                // (which takes it for a directory): said, the copy goes on.
                Err(e) if e.reason() == Reason::Invalid => {
                    tracing::warn!(path = %crate::escape::esc(&f.path), error = %e, "the file is unchanged but its mode and mtime could not be set");
                }
                Err(e) => return Err(e),
            }
        }
        for level in tree
            .preserved_dirs
            .chunk_by(|a, b| depth(&a.path) == depth(&b.path))
        {
            futures::stream::iter(level)
                .map(|d| client.set_dir(&d.path, d.mode, d.mtime_ns))
                .buffer_unordered(IN_FLIGHT)
                .try_collect::<()>()
                .await?;
        }
    } else {
        for l in &tree.links {
            local_link(Path::new(&l.dest), &l.target)?;
            linked(l);
        }
        for d in &tree.deletes {
            local_remove(d)?;
            deleted(d);
        }
        for f in &tree.retimed {
            set_local_attrs(f)?;
        }
        for d in &tree.preserved_dirs {
            crate::files::DirHandle::open(&d.path)
                .and_then(|h| h.set_attrs(d.mode, crate::control::fsutil::ts_from_ns(d.mtime_ns)))
                .map_err(ControlError::from)?;
        }
    }
    Ok(tree.counts())
}

/// A pulled file left as it was gets its source's mode and mtime; a
/// symlink standing there now is not followed.
fn set_local_attrs(f: &Retimed) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&f.path)
        .map_err(|e| ControlError::from(crate::files::error::io_err("open", &f.path, e)))?;
    crate::files::root::set_file_attrs_fd(
        std::os::fd::AsFd::as_fd(&file),
        &f.path,
        f.mode,
        crate::control::fsutil::ts_from_ns(f.mtime_ns),
    )
    .map_err(ControlError::from)
}

/// How deep a destination path is (its separators).
pub(super) fn depth(path: &str) -> usize {
    path.trim_end_matches('/').matches('/').count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn extras_deepest_first_and_excluded_names_protected() {
        let mut f = Filter::default();
        f.push(false, "*.keep").unwrap();
        let dest = vec![
            (p("a"), true),
            (p("a/old"), false),
            (p("gone"), true),
            (p("gone/x"), false),
            (p("held"), true),
            (p("held/n.keep"), false),
            (p("same"), false),
        ];
        let names: HashSet<PathBuf> = [p("a"), p("same")].into_iter().collect();
        assert_eq!(
            extras(&f, &dest, &names).0,
            vec![(p("a/old"), false), (p("gone/x"), false), (p("gone"), true)]
        );
    }

    #[test]
    fn delete_keeps_names_that_are_not_utf8_and_their_directories() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        let raw = PathBuf::from(OsStr::from_bytes(b"d/bad\xff\xfeutf"));
        let dest = vec![
            (p("d"), true),
            (raw.clone(), false),
            // A remote listing's lossy form of such a name, and what an
            // older rcp made of one: no source name can match either.
            (p("bad\u{FFFD}\u{FFFD}utf"), false),
            (p("lossy\u{FFFD}"), true),
            (p("lossy\u{FFFD}/in"), false),
            (p("extra"), false),
        ];
        let (out, kept) = extras(&Filter::default(), &dest, &HashSet::new());
        assert_eq!(out, vec![(p("extra"), false)]);
        assert_eq!(
            kept,
            vec![
                raw,
                p("bad\u{FFFD}\u{FFFD}utf"),
                p("lossy\u{FFFD}"),
                p("lossy\u{FFFD}/in")
            ]
        );
    }

    #[test]
    fn links_need_a_and_stay_inside() {
        let mut job = Job {
            links: true,
            ..Job::default()
        };
        let mut t = TreePlan::default();
        let mut names = HashSet::new();
        let mut admit = |t: &mut TreePlan, job: &Job, rel: &str, target: &str| {
            t.admit(
                job,
                Path::new(rel),
                Kind::Link(Some(target)),
                || rel.into(),
                || format!("d/{rel}"),
                &mut names,
            )
        };
        admit(&mut t, &job, "sub/l", "../f");
        admit(&mut t, &job, "l2", "../escape");
        admit(&mut t, &job, "l3", "/etc/passwd");
        assert_eq!(
            t.links,
            vec![LinkPlan {
                dest: "d/sub/l".into(),
                target: "../f".into()
            }]
        );
        assert_eq!(t.left_out.len(), 2);
        job.links = false;
        admit(&mut t, &job, "l4", "f");
        assert_eq!(t.links.len(), 1);
        assert_eq!(t.left_out.len(), 3);
        assert!(t.left_out[2].reason.contains("non-regular file"));
    }
}
