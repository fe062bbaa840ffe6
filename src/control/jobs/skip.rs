//! What a job leaves alone at the destination, by rsync's rules:
//!
//! - the quick check ([`Compare::Quick`], rcp's default like rsync's): a
//!   destination file of the source's size and modification time is
//!   unchanged. Without `-p` a copy's mtime is the time it was written, so
//!   a rerun skips mostly with `-p` (rsync without `-t` alike);
//! - `-c` ([`Compare::Content`]): a destination file of the source's size
//!   is compared by content, the derived file digest of the session's
//!   check (BLAKE3 by default) computed on both ends at once, rcpd's in
//!   batches of files on its hashing pool ([`Client::digests`]);
//! - `-I` ([`Compare::Always`], also what library callers and the Copy API
//!   get unless they ask): every file moves;
//! - `--size-only` ([`Compare::Size`]): a destination file of the
//!   source's size is unchanged, whatever its mtime;
//! - `-u` ([`Rules::update`]): a destination newer than the source stays;
//! - `--ignore-existing`: whatever exists at the destination stays.
//!
//! [`prune`] applies them to a [`Plan`] before anything is created: the
//! destination's sizes and mtimes come from one recursive `List` per tree
//! pushed (a `Stat` per single file) or from local `lstat`s on a pull. What
//! stays moves to [`Plan::skipped`]; a plan left with no file opens no
//! session at all ([`super::run`]).

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt};

use super::contents::{content_check, local_contents, remote_contents};
use super::{join_remote, Plan};
use crate::control::client::Client;
use crate::control::error::{ControlError, Reason, Result};
use crate::proto::{self, FileType};

/// How a file that exists at the destination is told unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compare {
    /// Never: every file moves (`-I`).
    #[default]
    Always,
    /// Same size and modification time (rsync's quick check).
    Quick,
    /// Same size and content digest (`-c`).
    Content,
    /// Same size, whatever the mtime (`--size-only`).
    Size,
}

/// Which files a job leaves alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    pub compare: Compare,
    /// `-u`: a destination file newer than the source stays.
    pub update: bool,
    /// `--ignore-existing`: anything at the destination's name stays.
    pub ignore_existing: bool,
    /// `--delta` (and `--resume`): of a file that moves and exists at the
    /// destination, only the blocks that differ move (`super::delta`).
    pub delta: bool,
    /// `-p`: a destination file whose permission bits are not the
    /// source's is not unchanged (it moves, and gets them): rsync -p
    /// brings a changed mode to a file the quick check would skip.
    pub modes: bool,
}

impl Rules {
    /// Whether the rules may leave any file alone (else nothing is looked
    /// up at the destination).
    pub fn active(&self) -> bool {
        // `modes` alone leaves nothing alone.
        Rules {
            modes: false,
            ..*self
        } != Rules::default()
    }
}

/// A regular file's size, modification time and (when known) permission
/// bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    pub len: u64,
    pub mtime_ns: i64,
    pub mode: Option<u32>,
}

impl Meta {
    /// Both permission bits known and different.
    fn mode_differs(&self, other: &Meta) -> bool {
        matches!((self.mode, other.mode), (Some(a), Some(b)) if a & 0o7777 != b & 0o7777)
    }
}

/// What stands at a destination name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    Missing,
    File(Meta),
    /// A directory, a symlink, ...
    Other,
}

/// What [`decide`] says of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Copy,
    Skip,
    /// Same size under `-c`: the contents decide.
    CompareContent,
}

/// rsync's decision for a source of `src` whose destination is `dst`.
pub fn decide(r: &Rules, src: Meta, dst: Dest) -> Verdict {
    let d = match dst {
        Dest::Missing => return Verdict::Copy,
        _ if r.ignore_existing => return Verdict::Skip,
        Dest::Other => return Verdict::Copy,
        Dest::File(d) => d,
    };
    if r.update && d.mtime_ns > src.mtime_ns {
        return Verdict::Skip;
    }
    if r.modes && d.mode_differs(&src) {
        return Verdict::Copy;
    }
    match r.compare {
        Compare::Always => Verdict::Copy,
        Compare::Quick if (d.len, d.mtime_ns) == (src.len, src.mtime_ns) => Verdict::Skip,
        Compare::Quick => Verdict::Copy,
        Compare::Content if d.len == src.len => Verdict::CompareContent,
        Compare::Content => Verdict::Copy,
        Compare::Size if d.len == src.len => Verdict::Skip,
        Compare::Size => Verdict::Copy,
    }
}

/// Whether a file [`decide`] left alone gets its source's mode and mtime
/// after the copy (rsync's attribute update of a file it does not send):
/// under `-p`, when the comparison (not `-u` or `--ignore-existing`, which
/// leave a file as it is) found it unchanged with another mtime: `-c`'s
/// same content, `--size-only`'s same size. The quick check's unchanged
/// files have the source's mtime already; a mode that differs makes the
/// file move under `-p`.
pub fn retimed(r: &Rules, src: Meta, dst: Dest) -> bool {
    match dst {
        // A source whose mtime is not known (`source_meta`) sets none.
        Dest::File(d) if src.mtime_ns != i64::MIN => {
            r.modes
                && !r.ignore_existing
                && !(r.update && d.mtime_ns > src.mtime_ns)
                && d.mtime_ns != src.mtime_ns
        }
        _ => false,
    }
}

/// A local path's [`Dest`].
pub fn local_dest(p: &Path) -> Result<Dest> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_file() => Ok(Dest::File(Meta {
            len: m.len(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            mode: Some(m.mode()),
        })),
        Ok(_) => Ok(Dest::Other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Dest::Missing),
        Err(e) => Err(ControlError::Io {
            context: format!("stat {}", p.display()),
            source: e,
        }),
    }
}

fn remote_dest(e: &proto::Entry) -> Dest {
    if e.r#type == FileType::File as i32 {
        Dest::File(Meta {
            len: e.length,
            mtime_ns: e.mtime_ns,
            mode: Some(e.mode),
        })
    } else {
        Dest::Other
    }
}

/// Push: what stands at each planned file's remote destination, and the
/// remote directories that exist already. One recursive `List` per tree
/// (the remote directories no other one is beneath), a `Stat` per file
/// pushed on its own.
async fn remote_dests(
    client: &Client,
    plan: &Plan,
    mut listed: HashMap<String, Option<Vec<proto::Entry>>>,
) -> Result<(Vec<Dest>, HashSet<String>)> {
    let dirs: HashSet<&str> = plan
        .remote_dirs
        .iter()
        .map(|d| d.path.trim_end_matches('/'))
        .collect();
    let tops = dirs
        .iter()
        .filter(|d| !d.rsplit_once('/').is_some_and(|(p, _)| dirs.contains(p)));
    let mut found: HashMap<String, Dest> = HashMap::new();
    let mut existing = HashSet::new();
    for top in tops {
        // Listed while the tree was walked, or now.
        let answer = match listed.remove(*top) {
            Some(Some(e)) => Ok(e),
            Some(None) => continue,
            None => client.list(top, true).await,
        };
        let listed = match answer {
            Ok(e) => vec![(top.to_string(), e)],
            // Not there yet (or not a directory: the copy says so).
            Err(e) if e.reason() == Reason::DirNotFound => continue,
            // A tree too large for one answer: a List per directory.
            Err(e) => {
                tracing::debug!(error = %e, top, "listing the destination per directory");
                let beneath = dirs.iter().filter(|d| {
                    *d == top || d.strip_prefix(top).is_some_and(|r| r.starts_with('/'))
                });
                list_each(client, beneath.map(|d| d.to_string()).collect()).await?
            }
        };
        for (dir, entries) in listed {
            existing.insert(dir.clone());
            for e in &entries {
                let p = join_remote(&dir, Path::new(&e.path));
                if e.r#type == FileType::Dir as i32 {
                    existing.insert(p.clone());
                }
                found.insert(p, remote_dest(e));
            }
        }
    }
    let singles: Vec<usize> = (0..plan.files.len())
        .filter(|&i| {
            !found.contains_key(&plan.files[i].dest) && !plan.files[i].job.spec.create_parents
        })
        .collect();
    let stats: Vec<(usize, Dest)> = futures::stream::iter(singles)
        .map(|i| async move {
            let e = client.stat(&plan.files[i].dest).await?;
            Ok::<_, ControlError>((i, e.as_ref().map_or(Dest::Missing, remote_dest)))
        })
        .buffered(16)
        .try_collect()
        .await?;
    let mut out: Vec<Dest> = plan
        .files
        .iter()
        .map(|f| found.get(&f.dest).copied().unwrap_or(Dest::Missing))
        .collect();
    for (i, d) in stats {
        out[i] = d;
    }
    Ok((out, existing))
}

/// A List (not recursive) of each of `dirs` that exists, 16 at a time.
async fn list_each(client: &Client, dirs: Vec<String>) -> Result<Vec<(String, Vec<proto::Entry>)>> {
    let listed: Vec<Option<(String, Vec<proto::Entry>)>> = futures::stream::iter(dirs)
        .map(|d| async move {
            match client.list(&d, false).await {
                Ok(e) => Ok(Some((d, e))),
                Err(e) if e.reason() == Reason::DirNotFound => Ok(None),
                Err(e) => Err(e),
            }
        })
        .buffered(16)
        .try_collect()
        .await?;
    Ok(listed.into_iter().flatten().collect())
}

/// The source's [`Meta`] of a planned file (a push's local source stated
/// when the plan did not keep it).
fn source_meta(plan: &Plan, i: usize) -> Result<Meta> {
    let f = &plan.files[i];
    match f.mtime_ns {
        Some(mtime_ns) => Ok(Meta {
            len: f.bytes,
            mtime_ns,
            mode: f.mode,
        }),
        None => match local_dest(&f.job.local)? {
            Dest::File(m) => Ok(m),
            // The copy reports it.
            _ => Ok(Meta {
                len: f.bytes,
                mtime_ns: i64::MIN,
                mode: None,
            }),
        },
    }
}

/// `-c`: which of the files at `idx` hold the same content on both ends,
/// both ends hashing at once.
async fn same_content(client: &Client, plan: &Plan, idx: &[usize]) -> Result<Vec<bool>> {
    let check = content_check(client);
    let bs = client.options().block_size;
    let (remote, local): (Vec<String>, Vec<PathBuf>) = idx
        .iter()
        .map(|&i| {
            let f = &plan.files[i];
            // Push: the local source against its remote destination; pull:
            // the remote source against its local destination.
            let remote = if plan.push { &f.dest } else { &f.source };
            (remote.clone(), f.job.local.clone())
        })
        .unzip();
    let (r, l) = tokio::join!(
        remote_contents(client, remote, check, bs, false),
        local_contents(local, check, bs, false)
    );
    Ok(r?
        .iter()
        .zip(l?.iter())
        .map(
            |(r, l)| matches!((r, l), (Some(r), Some(l)) if r.len == l.len && r.digest == l.digest),
        )
        .collect())
}

/// Move the files `rules` leave alone from `plan.files` to
/// `plan.skipped`, and drop the remote directories that exist already.
pub async fn prune(client: &Client, plan: &mut Plan, rules: &Rules) -> Result<()> {
    if !rules.active() || plan.files.is_empty() {
        return Ok(());
    }
    let dests = if plan.push {
        let listed = std::mem::take(&mut plan.listed);
        let (d, existing) = remote_dests(client, plan, listed).await?;
        plan.remote_dirs
            .retain(|d| !existing.contains(d.path.trim_end_matches('/')));
        d
    } else {
        // Directories to make, and those beneath one (parents come
        // first): a symlink replaced, or a file in the way, has nothing
        // beneath it to compare with, whatever resolving through it finds.
        let mut made: HashSet<PathBuf> = HashSet::new();
        plan.local_dirs.retain(|d| {
            let under = d.path.parent().is_some_and(|p| made.contains(p));
            let make = under || !super::is_dir_here(&d.path, d.in_tree);
            if make {
                made.insert(d.path.clone());
            }
            make
        });
        plan.files
            .iter()
            .map(
                |f| match f.job.local.parent().is_some_and(|p| made.contains(p)) {
                    true => Ok(Dest::Missing),
                    false => local_dest(&f.job.local),
                },
            )
            .collect::<Result<Vec<_>>>()?
    };
    let metas = (0..dests.len())
        .map(|i| source_meta(plan, i))
        .collect::<Result<Vec<_>>>()?;
    let mut verdicts: Vec<Verdict> = metas
        .iter()
        .zip(&dests)
        .map(|(&m, &d)| decide(rules, m, d))
        .collect();
    let idx: Vec<usize> = (0..verdicts.len())
        .filter(|&i| verdicts[i] == Verdict::CompareContent)
        .collect();
    if !idx.is_empty() {
        for (&i, same) in idx.iter().zip(same_content(client, plan, &idx).await?) {
            verdicts[i] = if same { Verdict::Skip } else { Verdict::Copy };
        }
    }
    for (i, (&src, &d)) in metas.iter().zip(&dests).enumerate() {
        if let (Verdict::Skip, true, Dest::File(dm)) = (verdicts[i], retimed(rules, src, d), d) {
            plan.tree.retimed.push(super::tree::Retimed {
                path: plan.files[i].dest.clone(),
                // Not known on the source's side: the destination's stays.
                mode: src.mode.or(dm.mode).unwrap_or(0o644) & 0o7777,
                mtime_ns: src.mtime_ns,
            });
        }
    }
    if rules.delta {
        // Files that move over a copy of more than one block.
        let bs = client.options().block_size;
        let idx: Vec<usize> = (0..verdicts.len())
            .filter(|&i| verdicts[i] == Verdict::Copy && plan.files[i].bytes > bs)
            .filter(|&i| matches!(dests[i], Dest::File(m) if m.len > 0))
            .collect();
        super::delta::prepare(client, plan, &idx).await?;
    }
    let files = std::mem::take(&mut plan.files);
    for ((mut f, v), d) in files.into_iter().zip(verdicts).zip(dests) {
        if v == Verdict::Skip {
            plan.skipped.push(f);
        } else {
            // A tree's file looked at just now and found free: the
            // receiving side need not look again (`FileSpec::absent`).
            f.job.spec.absent = d == Dest::Missing && f.job.spec.create_parents;
            plan.files.push(f);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Meta = Meta {
        len: 10,
        mtime_ns: 1_000,
        mode: Some(0o100644),
    };

    fn with(len: u64, mtime_ns: i64) -> Dest {
        Dest::File(Meta {
            len,
            mtime_ns,
            mode: Some(0o100644),
        })
    }

    #[test]
    fn under_p_a_changed_mode_moves_an_otherwise_unchanged_file() {
        let dst = Dest::File(Meta {
            mode: Some(0o100600),
            ..SRC
        });
        let q = Rules {
            compare: Compare::Quick,
            ..Rules::default()
        };
        assert_eq!(decide(&q, SRC, dst), Verdict::Skip, "without -p");
        let p = Rules { modes: true, ..q };
        assert_eq!(decide(&p, SRC, dst), Verdict::Copy);
        assert_eq!(decide(&p, SRC, with(10, 1_000)), Verdict::Skip);
        // A mode not known on one side decides nothing.
        let unknown = Meta { mode: None, ..SRC };
        assert_eq!(decide(&p, unknown, dst), Verdict::Skip);
        // --ignore-existing and -u keep what is there, mode and all.
        let e = Rules {
            ignore_existing: true,
            ..p
        };
        assert_eq!(decide(&e, SRC, dst), Verdict::Skip);
        // -p alone looks nothing up.
        assert!(!Rules {
            modes: true,
            ..Rules::default()
        }
        .active());
    }

    #[test]
    fn the_quick_check_skips_same_size_and_mtime_only() {
        let q = Rules {
            compare: Compare::Quick,
            ..Rules::default()
        };
        assert_eq!(decide(&q, SRC, with(10, 1_000)), Verdict::Skip);
        assert_eq!(decide(&q, SRC, with(11, 1_000)), Verdict::Copy);
        assert_eq!(decide(&q, SRC, with(10, 1_001)), Verdict::Copy);
        assert_eq!(decide(&q, SRC, Dest::Missing), Verdict::Copy);
        assert_eq!(decide(&q, SRC, Dest::Other), Verdict::Copy);
    }

    /// --size-only skips the source's size whatever the mtime; under -p
    /// what the comparison left alone with another mtime gets the
    /// source's, what -u and --ignore-existing left alone does not.
    #[test]
    fn size_only_skips_the_same_size_and_minds_no_time() {
        let s = Rules {
            compare: Compare::Size,
            ..Rules::default()
        };
        assert_eq!(decide(&s, SRC, with(10, 5)), Verdict::Skip);
        assert_eq!(decide(&s, SRC, with(11, 1_000)), Verdict::Copy);
        assert_eq!(decide(&s, SRC, Dest::Missing), Verdict::Copy);
        assert!(!retimed(&s, SRC, with(10, 5)), "without -p");
        let p = Rules { modes: true, ..s };
        assert!(retimed(&p, SRC, with(10, 5)));
        assert!(!retimed(&p, SRC, with(10, 1_000)), "the same mtime");
        let e = Rules {
            ignore_existing: true,
            ..p
        };
        assert!(!retimed(&e, SRC, with(10, 5)));
        let u = Rules { update: true, ..p };
        assert!(!retimed(&u, SRC, with(10, 2_000)), "newer: -u keeps it");
        assert!(retimed(&u, SRC, with(10, 5)), "older, same size");
        let unknown = Meta {
            mtime_ns: i64::MIN,
            ..SRC
        };
        assert!(!retimed(&p, unknown, with(10, 5)));
    }

    #[test]
    fn ignore_times_moves_everything() {
        let i = Rules::default();
        assert!(!i.active());
        assert_eq!(decide(&i, SRC, with(10, 1_000)), Verdict::Copy);
    }

    #[test]
    fn update_keeps_a_newer_destination() {
        let u = Rules {
            compare: Compare::Quick,
            update: true,
            ..Rules::default()
        };
        assert_eq!(decide(&u, SRC, with(3, 2_000)), Verdict::Skip);
        // Same time, other size: rsync -u updates it.
        assert_eq!(decide(&u, SRC, with(3, 1_000)), Verdict::Copy);
        assert_eq!(decide(&u, SRC, with(10, 999)), Verdict::Copy);
        // With -I too.
        let ui = Rules {
            update: true,
            ..Rules::default()
        };
        assert_eq!(decide(&ui, SRC, with(10, 2_000)), Verdict::Skip);
    }

    #[test]
    fn ignore_existing_keeps_whatever_is_there() {
        let e = Rules {
            ignore_existing: true,
            ..Rules::default()
        };
        assert_eq!(decide(&e, SRC, with(3, 1)), Verdict::Skip);
        assert_eq!(decide(&e, SRC, Dest::Other), Verdict::Skip);
        assert_eq!(decide(&e, SRC, Dest::Missing), Verdict::Copy);
    }

    #[test]
    fn checksum_compares_contents_of_same_size_files() {
        let c = Rules {
            compare: Compare::Content,
            ..Rules::default()
        };
        assert_eq!(
            decide(&c, SRC, with(10, 5)),
            Verdict::CompareContent,
            "mtime does not matter"
        );
        assert_eq!(decide(&c, SRC, with(9, 1_000)), Verdict::Copy);
    }
}
