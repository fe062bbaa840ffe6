//! `rcp push` / `rcp pull` as jobs: what the user typed (sources and a
//! destination, scp-style) becomes the list of files one session moves,
//! with the tree's directories made first; totals and the summary line;
//! `rcp doctor`'s remote check.
//!
//! - [`parse_remote`]: `HOST:PATH` / `[V6]:PATH`, the one parser of it;
//! - [`Paths`]: a push's or pull's arguments checked against scp's rules
//!   (which side is remote, one host);
//! - [`plan_push`] / [`plan_pull`]: walk, resolve names into a [`Plan`]
//!   without creating anything (what `--dry-run` lists);
//! - [`run`]: make the plan's directories, move its files over a session,
//!   and over tcp when verbs fails with `--transport auto` (the tcp
//!   fallback, one policy for the binary, the library and the Copy API);
//! - [`push`] / [`pull`]: both;
//! - [`Pool`]: warm sessions for rcpd's Copy API;
//! - [`filter`]: `--exclude`/`--include`, rsync's pattern rules, pure;
//! - [`tree`]: symlinks (`-a`), what is skipped, `--delete`: planned with
//!   the files, done after them ([`tree::finish`]);
//! - [`Totals`]: what the summary line says;
//! - [`doctor`]: the local checks plus whether an rcpd answers.

mod contents;
mod delta;
pub mod filter;
mod paths;
mod policy;
mod pool;
pub mod skip;
pub mod tree;

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use super::client::{Client, FileJob, FileResult};
use super::error::{ControlError, Result};
use crate::proto::{Direction, FileType};

pub use paths::Paths;
pub use policy::{open_first, run, run_over, Outcome, Sessions, Watcher};
pub use pool::{Kept, Key, Pool, PoolConfig, WarmLease, DEFAULT_POOL_IDLE, DEFAULT_POOL_MAX};

/// `HOST:PATH` (or `[v6]:PATH`) split into the rcpd address and the path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    /// `host:port` / `[v6]:port` to connect to.
    pub addr: String,
    pub host: String,
    pub path: String,
}

/// Parse `HOST:PATH`; `None` for a local path (no colon before the first
/// slash, as scp decides).
pub fn parse_remote(s: &str, port: u16) -> Option<Remote> {
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let path = after.strip_prefix(':')?;
        return Some(Remote {
            addr: format!("[{h}]:{port}"),
            host: h.to_string(),
            path: path.to_string(),
        });
    }
    let colon = s.find(':')?;
    if let Some(slash) = s.find('/') {
        if slash < colon {
            return None;
        }
    }
    let (h, path) = (&s[..colon], &s[colon + 1..]);
    if h.is_empty() {
        return None;
    }
    Some(Remote {
        addr: format!("{h}:{port}"),
        host: h.to_string(),
        path: path.to_string(),
    })
}

/// What the user asked for, besides the paths.
#[derive(Clone, Debug, Default)]
pub struct Job {
    pub recursive: bool,
    pub preserve: bool,
    pub resume: bool,
    /// Also compute the flat SHA-256 of every file (on the receiving side)
    /// and show it.
    pub sha256: bool,
    /// `-a`: symlinks recreated as symlinks (those staying inside the
    /// tree); without, each is skipped with a warning.
    pub links: bool,
    /// `--delete`: remove what the destination tree holds and the source
    /// does not, after the copy.
    pub delete: bool,
    /// `--exclude`/`--include`, in order.
    pub filter: filter::Filter,
    /// Which files already at the destination stay as they are
    /// ([`skip`]; the default moves every file).
    pub skip: skip::Rules,
    /// The fan-out the files belong to (`OpenFile.fanout`); empty: none.
    pub fanout: String,
}

/// Totals of a run.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub files: u64,
    /// Bytes of the files copied.
    pub bytes: u64,
    /// Bytes moved over the data path (less after a resume).
    pub moved: u64,
    pub seconds: f64,
    /// The digest of the last file (reported when exactly one was copied).
    pub digest: Option<Vec<u8>>,
    /// Its flat SHA-256, when asked for.
    pub sha256: Option<Vec<u8>>,
    /// Files left as they were at the destination ([`skip`]).
    pub skipped: u64,
}

impl Totals {
    fn add(&mut self, r: &FileResult) {
        self.files += 1;
        self.bytes += r.length;
        self.moved += r.moved;
        self.digest = Some(r.digest.clone());
        self.sha256 = r.flat_sha256.clone();
    }

    /// Moved bits per second / 1e9.
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.moved as f64 * 8.0 / self.seconds / 1e9
        } else {
            0.0
        }
    }

    /// The final summary line, for blocks checked with `check`: a single
    /// file's digest carries the check's name (`blake3-tree:...`, derived
    /// from the block digests, so not what `b3sum` or `sha256sum` print);
    /// a check other than the default, BLAKE3, is named for a tree too
    /// (`none` loudly).
    pub fn summary_checked(&self, transport: &str, check: crate::files::Check) -> String {
        let mut s = self.summary_line(transport, check);
        match check {
            crate::files::Check::Blake3 => {}
            crate::files::Check::None => {
                s.push_str(", NOT VERIFIED end to end (--verify none: only the link's CRCs)")
            }
            c => s.push_str(&format!(", checked with {c}")),
        }
        s
    }

    /// The summary line of a job that left every file as it was (no
    /// session was opened).
    pub fn summary_unchanged(&self) -> String {
        format!(
            "0 files, 0 B (0 moved) in {:.3} s, {} unchanged: nothing to move",
            self.seconds, self.skipped
        )
    }

    /// `N files, 3.00 MiB (3145728 bytes, 3145728 moved) in 0.123 s,
    /// 24.39 MiB/s over tcp[, digest blake3-tree:HEX | , sha256 HEX]`: IEC
    /// units as the progress bar's, the exact counts beside them.
    fn summary_line(&self, transport: &str, check: crate::files::Check) -> String {
        let rate = if self.seconds > 0.0 {
            self.moved as f64 / self.seconds
        } else {
            0.0
        };
        let mut s = format!(
            "{} file{}, {} ({} bytes, {} moved) in {:.3} s, {} over {transport}",
            self.files,
            if self.files == 1 { "" } else { "s" },
            crate::units::bytes(self.bytes),
            self.bytes,
            self.moved,
            self.seconds,
            crate::units::rate(rate),
        );
        if self.skipped > 0 {
            s.push_str(&format!(", {} unchanged", self.skipped));
        }
        if self.files == 1 {
            match (&self.sha256, &self.digest, check) {
                // The flat SHA-256: what sha256sum prints for the file.
                (Some(f), _, _) => s.push_str(&format!(", sha256 {}", hex::encode(f))),
                (None, _, crate::files::Check::None) => {}
                (None, Some(d), c) => {
                    s.push_str(&format!(", digest {}:{}", digest_label(c), hex::encode(d)))
                }
                _ => {}
            }
        }
        s
    }
}

/// What a file digest of `check` is called next to its value: a hash over
/// the block digests (a tree of one level), named so that nobody takes it
/// for `sha256sum`'s or `b3sum`'s value.
pub fn digest_label(check: crate::files::Check) -> String {
    format!("{}-tree", check.name())
}

/// `rcp -v`'s line per rail of the session's data path, from its report
/// (the engine's counts): what the rail carried and what happened to it.
pub fn rail_lines(r: &crate::datapath::Report, names: &[String]) -> Vec<String> {
    r.rails
        .iter()
        .enumerate()
        .map(|(k, x)| {
            let c = &x.counters;
            let name = names.get(k).map(|n| format!(" ({n})")).unwrap_or_default();
            let mut s = format!(
                "rail {k}{name}: {} blocks, {} bytes, {} error CQEs, {} failures, {} blocks \
                 requeued, {} reconnects, {} pauses",
                c.extents_confirmed,
                c.bytes_confirmed,
                c.errors.total(),
                c.failures,
                c.requeued,
                c.reconnects,
                c.pauses
            );
            if !x.failover_seconds.is_empty() {
                let f: Vec<String> = x
                    .failover_seconds
                    .iter()
                    .map(|s| format!("{s:.3}"))
                    .collect();
                s.push_str(&format!(", failover {} s", f.join(" ")));
            }
            s
        })
        .collect()
}

fn join_remote(base: &str, rel: &Path) -> String {
    let rel = rel.to_string_lossy();
    let b = base.trim_end_matches('/');
    if b.is_empty() {
        rel.into_owned()
    } else {
        format!("{b}/{rel}")
    }
}

fn basename(p: &str) -> String {
    Path::new(p.trim_end_matches('/'))
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A relative path from a server is only ever plain names.
fn safe_rel(p: &str) -> Result<PathBuf> {
    let pb = PathBuf::from(p);
    if p.is_empty() || !pb.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(ControlError::Invalid(format!(
            "the server listed an unsafe path {p:?}"
        )));
    }
    Ok(pb)
}

fn with_job(mut f: FileJob, job: &Job, create_parents: bool) -> FileJob {
    f.spec.preserve = job.preserve;
    f.spec.resume = job.resume;
    f.spec.flat_sha256 = job.sha256;
    f.spec.create_parents = create_parents;
    f.spec.fanout = job.fanout.clone();
    f
}

/// One file a job would move.
#[derive(Clone, Debug)]
pub struct Planned {
    pub job: FileJob,
    /// Where it comes from: push, the local path; pull, the remote path.
    pub source: String,
    /// Where it goes: push, the remote path (beneath rcpd's root; for a
    /// single file pushed to a path that does not exist yet, as given);
    /// pull, the local path.
    pub dest: String,
    /// Its length when the plan was made.
    pub bytes: u64,
    /// The source's modification time when the plan saw it (what the
    /// quick check compares, [`skip`]).
    pub mtime_ns: Option<i64>,
    /// The source's permission bits when the plan saw them (`-p`: a
    /// destination with others is not unchanged, [`skip`]).
    pub mode: Option<u32>,
}

/// What a push or pull will do, resolved before anything is created on
/// either side: only remote Stat/List and local stat/walk went into it
/// (what `--dry-run` lists).
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub push: bool,
    /// Push `-r`: the remote directories to make first (empty ones
    /// included), parents before children.
    pub remote_dirs: Vec<tree::PlannedDir>,
    /// Pull `-r`: the local directories to make first, parents before
    /// children.
    pub local_dirs: Vec<tree::PlannedDir<PathBuf>>,
    pub files: Vec<Planned>,
    /// `-r`: links, skipped entries, deletions ([`tree::finish`] after the
    /// files).
    pub tree: tree::TreePlan,
    /// Files the job's [`skip::Rules`] leave as they are at the
    /// destination.
    pub skipped: Vec<Planned>,
    /// Push `-r`: the recursive List of a tree's destination, made while
    /// the tree was walked, for the quick check ([`skip::prune`]); `None`:
    /// no such directory.
    pub listed: std::collections::HashMap<String, Option<Vec<crate::proto::Entry>>>,
}

impl Plan {
    /// Bytes of every file.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    /// Bytes of windows its files take: each file's length rounded up to
    /// [`EXTENT_ALIGN`](crate::control::protocol::EXTENT_ALIGN), where its
    /// blocks start ([`Client::sized_for`]).
    pub fn window_bytes(&self) -> u64 {
        let a = crate::control::protocol::EXTENT_ALIGN;
        self.files.iter().map(|f| f.bytes.div_ceil(a) * a).sum()
    }

    /// Directories it would make.
    pub fn dirs(&self) -> usize {
        self.remote_dirs.len() + self.local_dirs.len()
    }

    /// Push or pull.
    pub fn direction(&self) -> Direction {
        if self.push {
            Direction::Push
        } else {
            Direction::Pull
        }
    }
}

/// Resolve `rcp push [-r] LOCAL... HOST:REMOTE` into a [`Plan`]: stats the
/// remote destination, walks the local trees; creates nothing.
///
/// rsync's rules for a source: `DIR/` (a trailing slash) names the
/// directory's contents, which land in the destination itself whether or
/// not it exists; `DIR` lands inside an existing destination directory
/// (`REMOTE/DIR`), or becomes it. With `-a` a source that is a symlink is
/// copied as one (`LINK/` follows it); without, it is followed (scp's and
/// cp's habit; rsync would skip it).
pub async fn plan_push(
    client: &Client,
    locals: &[PathBuf],
    remote: &str,
    job: &Job,
) -> Result<Plan> {
    let (exists, exists_as_dir) = remote_dir(client, remote).await?;
    let made = dir_to_make(remote, exists_as_dir, exists)?;
    let remote_is_dir = exists_as_dir || made.is_some();
    if locals.len() > 1 && !remote_is_dir {
        return Err(ControlError::DirNotFound(format!(
            "{remote} (several sources need an existing remote directory)"
        )));
    }
    let mut plan = Plan {
        push: true,
        ..Plan::default()
    };
    for local in locals {
        let contents = names_contents(&local.to_string_lossy());
        let inside = remote_is_dir && !contents;
        let name = basename(&local.to_string_lossy());
        let dest = if inside {
            join_remote(remote, Path::new(&name))
        } else {
            remote.to_string()
        };
        let meta = match local_source(local, job.links && !contents)? {
            LocalSource::Link(target) => {
                admit_top_link(&mut plan.tree, job, &name, local, dest, target);
                continue;
            }
            LocalSource::Other(meta) => meta,
        };
        if !meta.is_dir() {
            let f = FileJob::push_len(local.clone(), remote, meta.len());
            plan.files.push(Planned {
                job: with_job(f, job, false),
                source: local.display().to_string(),
                dest,
                bytes: meta.len(),
                mtime_ns: Some(mtime_ns(&meta)),
                mode: Some(std::os::unix::fs::MetadataExt::mode(&meta)),
            });
            continue;
        }
        if !job.recursive {
            return Err(ControlError::Usage(format!(
                "{} is a directory (use -r)",
                local.display()
            )));
        }
        let top = Top {
            base: dest,
            in_tree: inside,
            mode: std::os::unix::fs::MetadataExt::mode(&meta),
            mtime_ns: mtime_ns(&meta),
        };
        plan_push_tree(client, &mut plan, job, local, top).await?;
    }
    if job.preserve {
        plan.tree.preserved_dirs = deepest_first(plan.remote_dirs.clone());
    }
    // Made as `mkdir` would (no source to take a mode or mtime from).
    plan.remote_dirs.extend(made.map(|path| tree::PlannedDir {
        path,
        mode: 0o777,
        mtime_ns: 0,
        in_tree: false,
    }));
    skip::prune(client, &mut plan, &job.skip).await?;
    Ok(plan)
}

/// rsync's rule for a destination that ends in `/`: it names a directory,
/// and what is copied goes inside it; when it does not exist it is made
/// (the directory to make, without its `/`). A file at that name is an
/// error, not replaced. scp and cp refuse a missing `DIR/` instead; rcp
/// before this wrote a file named `DIR`.
fn dir_to_make(dest: &str, is_dir: bool, exists: bool) -> Result<Option<String>> {
    if !dest.ends_with('/') || is_dir {
        return Ok(None);
    }
    if exists {
        return Err(ControlError::DirNotFound(format!(
            "{dest} (not a directory)"
        )));
    }
    Ok(Some(dest.trim_end_matches('/').to_string()))
}

/// Whether a source names a directory's contents (rsync's `SRC/`).
fn names_contents(source: &str) -> bool {
    source.ends_with('/')
}

/// Whether the destination named on the command line exists, and whether
/// it is a directory, following a symlink there as scp and rsync follow
/// the destination they are given (rcpd's Stat reports a final link
/// unless the path ends in `/`; an rcpd older than 2.9 reports it either
/// way: not a directory).
async fn remote_dir(client: &Client, remote: &str) -> Result<(bool, bool)> {
    let is = |e: &Option<crate::proto::Entry>, t: FileType| {
        e.as_ref().is_some_and(|e| e.r#type == t as i32)
    };
    let st = client.stat(remote).await?;
    if is(&st, FileType::Symlink) && !names_contents(remote) {
        let followed = client.stat(&format!("{remote}/")).await?;
        return Ok((true, is(&followed, FileType::Dir)));
    }
    Ok((st.is_some(), is(&st, FileType::Dir)))
}

/// What a push's local source is.
enum LocalSource {
    /// A symlink copied as one (`-a`), with its target text.
    Link(PathBuf),
    /// A file or directory (a symlink followed).
    Other(std::fs::Metadata),
}

/// Look at a push's local source: a symlink is kept as one when `links`,
/// else followed.
fn local_source(local: &Path, links: bool) -> Result<LocalSource> {
    let not_found = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => ControlError::FileNotFound(local.display().to_string()),
        _ => ControlError::Io {
            context: format!("stat {}", local.display()),
            source: e,
        },
    };
    if links
        && std::fs::symlink_metadata(local)
            .map_err(not_found)?
            .is_symlink()
    {
        let target = std::fs::read_link(local).map_err(not_found)?;
        return Ok(LocalSource::Link(target));
    }
    std::fs::metadata(local)
        .map(LocalSource::Other)
        .map_err(not_found)
}

/// A top-level symlink source under `-a`: a link to make at `dest` (push,
/// remote; pull, local) when its target stays beside it (`--safe-links`,
/// as for a tree's links), else left out, said.
fn admit_top_link(
    t: &mut tree::TreePlan,
    job: &Job,
    name: &str,
    shown: &Path,
    dest: String,
    target: PathBuf,
) {
    let kind = match target.to_str() {
        Some(s) => tree::Kind::Link(Some(s)),
        None => tree::Kind::Skipped {
            link: false,
            why: "symlink target is not valid UTF-8 (rcp carries names as UTF-8)",
        },
    };
    let shown = || crate::files::shown_bytes(shown);
    t.admit(
        job,
        Path::new(name),
        kind,
        shown,
        || dest,
        &mut HashSet::new(),
    );
}

/// Where a tree lands and what its top directory is.
struct Top<P> {
    base: P,
    /// [`tree::PlannedDir::in_tree`] of the top.
    in_tree: bool,
    mode: u32,
    mtime_ns: i64,
}

/// The tree `local` pushed to `top.base`: its directories, files,
/// links, what is left out and (`--delete`) what goes.
async fn plan_push_tree(
    client: &Client,
    plan: &mut Plan,
    job: &Job,
    local: &Path,
    top: Top<String>,
) -> Result<()> {
    let base = top.base;
    let (tree, listed) = walk_and_list(client, local, &base, job.skip.active(), top.in_tree).await;
    if let Some(l) = listed {
        plan.listed
            .insert(base.trim_end_matches('/').to_string(), l);
    }
    let tree = tree?;
    let (entries, names) = admit_local(&mut plan.tree, job, local, &base, tree);
    // The tree's directories first, empty ones included (scp -r,
    // rsync -r), each with its source's mode.
    plan.remote_dirs.push(tree::PlannedDir {
        path: base.clone(),
        mode: top.mode,
        mtime_ns: top.mtime_ns,
        in_tree: top.in_tree,
    });
    for d in entries
        .iter()
        .filter(|e| e.kind == crate::files::EntryKind::Dir)
    {
        plan.remote_dirs.push(tree::PlannedDir {
            path: join_remote(&base, &d.rel_path),
            mode: d.mode,
            mtime_ns: super::fsutil::ns_from_ts(d.mtime),
            in_tree: true,
        });
    }
    if job.delete {
        let dest = tree::remote_entries(client, &base).await?;
        plan.tree
            .delete_extras(&job.filter, &dest, &names, |r| join_remote(&base, r));
    }
    for e in entries
        .into_iter()
        .filter(|e| e.kind == crate::files::EntryKind::File)
    {
        let src = local.join(&e.rel_path);
        let source = src.display().to_string();
        let dest = join_remote(&base, &e.rel_path);
        let f = FileJob::push_len(src, &dest, e.len);
        plan.files.push(Planned {
            job: with_job(f, job, true),
            source,
            dest,
            bytes: e.len,
            mtime_ns: Some(super::fsutil::ns_from_ts(e.mtime)),
            mode: Some(e.mode),
        });
    }
    Ok(())
}

/// `-p`: directories in the order they get their modes and mtimes.
fn deepest_first(mut dirs: Vec<tree::PlannedDir>) -> Vec<tree::PlannedDir> {
    dirs.sort_by_key(|d| std::cmp::Reverse(tree::depth(&d.path)));
    dirs
}

/// Walk `local` (on a blocking thread) while rcpd lists `base`, the tree's
/// destination, when the quick check will compare with it (`list`): on a
/// rerun the two cost about the same, so they overlap. The listing is
/// `None` when not asked for or not usable (the check lists again its own
/// way: a tree too large for one answer), `Some(None)` when `base` does
/// not exist (or is a symlink `in_tree`, to be replaced: the plan then
/// copies every file).
async fn walk_and_list(
    client: &Client,
    local: &Path,
    base: &str,
    list: bool,
    in_tree: bool,
) -> (
    Result<crate::files::Tree>,
    Option<Option<Vec<crate::proto::Entry>>>,
) {
    let path = local.to_path_buf();
    let walk = tokio::task::spawn_blocking(move || crate::files::walk(path));
    let listing = async {
        // A symlink where the tree's top goes is replaced by a directory
        // (not listed through): as if nothing were there.
        if in_tree {
            if let Ok(Some(e)) = client.stat(base).await {
                if e.r#type == FileType::Symlink as i32 {
                    return Some(None);
                }
            }
        }
        if !list {
            return None;
        }
        match client.list(base, true).await {
            Ok(e) => Some(Some(e)),
            Err(e) if e.reason() == super::error::Reason::DirNotFound => Some(None),
            Err(_) => None,
        }
    };
    let (tree, listing) = tokio::join!(walk, listing);
    let tree = tree
        .map_err(|e| ControlError::Other(format!("walking {}: {e}", local.display())))
        .and_then(|t| t.map_err(ControlError::from));
    (tree, listing)
}

/// The walked local tree judged for a push to `base`: the files and
/// directories to copy, and the names the source holds (for `--delete`).
fn admit_local(
    t: &mut tree::TreePlan,
    job: &Job,
    local: &Path,
    base: &str,
    walked: crate::files::Tree,
) -> (Vec<crate::files::Entry>, HashSet<PathBuf>) {
    use crate::files::EntryKind;
    let mut names = HashSet::new();
    let mut keep = Vec::new();
    for s in &walked.skipped {
        // A link the walk refused (absolute, escaping) or a FIFO, socket,
        // device: its reason.
        // A name that is not UTF-8: named exactly (escaped), whatever it is.
        let bad = s.rel_path.to_str().is_none();
        let kind = tree::Kind::Skipped {
            link: s.kind == crate::files::FileKind::Symlink && !bad,
            why: s.reason,
        };
        let shown = || crate::files::shown_bytes(&local.join(&s.rel_path));
        let dest = || join_remote(base, &s.rel_path);
        t.admit(job, &s.rel_path, kind, shown, dest, &mut names);
    }
    for e in walked.entries {
        let target = e.symlink_target.as_ref().map(|t| t.to_string_lossy());
        let kind = match e.kind {
            EntryKind::File => tree::Kind::File,
            EntryKind::Dir => tree::Kind::Dir,
            EntryKind::Symlink => tree::Kind::Link(target.as_deref()),
        };
        let shown = || local.join(&e.rel_path).display().to_string();
        let dest = || join_remote(base, &e.rel_path);
        if t.admit(job, &e.rel_path, kind, shown, dest, &mut names) {
            keep.push(e);
        }
    }
    (keep, names)
}

/// A local file's modification time in nanoseconds.
fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

/// Make the plan's remote and local directories, each new one with its
/// source's mode (plus the owner's rwx, masked by the umask: never wider
/// than the source for group and others, rsync's rule), parents first: a
/// push's in as few `MakeDirs` calls as [`MAKE_DIRS_CALL`] and
/// [`MAKE_DIRS_BYTES`] allow.
async fn make_dirs(client: &Client, plan: &Plan) -> Result<()> {
    let mut remote: Vec<&tree::PlannedDir> = plan.remote_dirs.iter().collect();
    remote.sort_by_key(|d| tree::depth(&d.path));
    // A call for as many as fit (parents first; rcpd keeps those it made
    // open for the ones beneath them within a call); an rcpd older than
    // MakeDirs one call each, a depth at a time.
    let mut left = remote.as_slice();
    while !left.is_empty() {
        let mut bytes = 0;
        let n = left
            .iter()
            .take(MAKE_DIRS_CALL)
            .take_while(|d| {
                bytes += d.path.len();
                bytes <= MAKE_DIRS_BYTES
            })
            .count()
            .max(1);
        let (now, rest) = left.split_at(n);
        let dirs: Vec<_> = now
            .iter()
            .map(|d| (d.path.as_str(), d.mode, d.in_tree))
            .collect();
        if !client.make_dirs(&dirs).await? {
            make_dirs_one_by_one(client, left).await?;
            break;
        }
        left = rest;
    }
    make_local_dirs(plan.local_dirs.clone()).await
}

/// A pull's local directories, parents first, on a blocking thread. Made
/// on the runtime's thread, they held up the session set up beside them
/// ([`run_over`]) until the last was made: 2 ms for a tree of 140.
async fn make_local_dirs(dirs: Vec<tree::PlannedDir<PathBuf>>) -> Result<()> {
    if dirs.is_empty() {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || {
        dirs.iter()
            .try_for_each(|d| make_local_dir(&d.path, d.mode, d.in_tree))
    })
    .await
    .map_err(|e| ControlError::Other(format!("making local directories: {e}")))?
}

/// Directories a `MakeDirs` call makes at most (rcpd's bound,
/// `control::server::MAKE_DIRS_MAX`), and the bytes of their paths: a
/// request stays far below gRPC's 4 MiB message limit.
const MAKE_DIRS_CALL: usize = 4096;
const MAKE_DIRS_BYTES: usize = 1 << 20;

/// `remote` (parents first) made one `MakeDir` each: one depth at a time,
/// [`tree::IN_FLIGHT`] calls at once.
async fn make_dirs_one_by_one(client: &Client, remote: &[&tree::PlannedDir]) -> Result<()> {
    use futures::TryStreamExt as _;
    for level in remote.chunk_by(|a, b| tree::depth(&a.path) == tree::depth(&b.path)) {
        let mut made = futures::stream::FuturesUnordered::new();
        for d in level {
            if made.len() >= tree::IN_FLIGHT {
                made.try_next().await?;
            }
            made.push(client.make_dir(&d.path, d.mode, d.in_tree));
        }
        while made.try_next().await?.is_some() {}
    }
    Ok(())
}

/// `mkdir -p path`, the last directory, when made, with `mode`'s
/// permission bits plus the owner's rwx (masked by the umask). `in_tree`
/// ([`tree::PlannedDir::in_tree`]): a symlink at `path` is removed (the
/// link, never what it points to) and a directory made in its place.
fn make_local_dir(path: &Path, mode: u32, in_tree: bool) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let io = |e| ControlError::io(format!("creating {}", path.display()))(e);
    if in_tree && std::fs::symlink_metadata(path).is_ok_and(|m| m.is_symlink()) {
        std::fs::remove_file(path).map_err(io)?;
    } else if path.is_dir() {
        return Ok(());
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let made = std::fs::DirBuilder::new()
        .mode(crate::files::mode::made_dir_mode(mode))
        .create(path);
    match made {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match is_dir_here(path, in_tree)
        {
            true => Ok(()),
            false => Err(crate::files::FileError::NotADirectory { path: path.into() }.into()),
        },
        r => r.map_err(io),
    }
}

/// Whether `path` is a directory: itself when `in_tree` (a symlink to one
/// is not), else following a symlink.
fn is_dir_here(path: &Path, in_tree: bool) -> bool {
    match in_tree {
        true => std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()),
        false => path.is_dir(),
    }
}

/// `rcp push [-r] LOCAL... HOST:REMOTE`: planned, then [`run`].
pub async fn push(
    client: &Client,
    locals: &[PathBuf],
    remote: &str,
    job: &Job,
    w: &dyn Watcher,
) -> Result<Outcome> {
    let plan = plan_push(client, locals, remote, job).await?;
    run(client, plan, w).await
}

/// Resolve `rcp pull [-r] HOST:REMOTE... LOCAL` into a [`Plan`]: stats and
/// lists the remote sources; creates nothing. A source's trailing `/` and
/// a symlink source follow [`plan_push`]'s rules.
pub async fn plan_pull(
    client: &Client,
    remotes: &[String],
    local: &Path,
    job: &Job,
) -> Result<Plan> {
    let typed = local.to_string_lossy();
    let made = dir_to_make(
        &typed,
        local.is_dir(),
        Path::new(typed.trim_end_matches('/'))
            .symlink_metadata()
            .is_ok(),
    )?;
    let local_is_dir = local.is_dir() || made.is_some();
    if remotes.len() > 1 && !local_is_dir {
        return Err(ControlError::DirNotFound(format!(
            "{} (several sources need an existing local directory)",
            local.display()
        )));
    }
    let mut plan = Plan::default();
    for r in remotes {
        let contents = names_contents(r);
        let inside = local_is_dir && !contents;
        let dst = match inside {
            true => local.join(basename(r)),
            false => local.to_path_buf(),
        };
        let st = remote_source(client, r, job.links && !contents).await?;
        if st.r#type == FileType::Symlink as i32 {
            let target = PathBuf::from(&st.link_target);
            let dest = dst.display().to_string();
            admit_top_link(
                &mut plan.tree,
                job,
                &basename(r),
                Path::new(r),
                dest,
                target,
            );
            continue;
        }
        if st.r#type != FileType::Dir as i32 {
            let mut f = with_job(FileJob::pull(r, dst.clone()), job, false);
            f.len_hint = st.length;
            plan.files.push(Planned {
                job: f,
                source: r.clone(),
                dest: dst.display().to_string(),
                bytes: st.length,
                mtime_ns: Some(st.mtime_ns),
                mode: Some(st.mode),
            });
            continue;
        }
        if !job.recursive {
            return Err(ControlError::Usage(format!("{r} is a directory (use -r)")));
        }
        let top = Top {
            base: dst,
            in_tree: inside,
            mode: st.mode,
            mtime_ns: st.mtime_ns,
        };
        plan_pull_tree(client, &mut plan, job, r, top).await?;
    }
    if job.preserve {
        let dirs = plan.local_dirs.iter().map(|d| tree::PlannedDir {
            path: d.path.display().to_string(),
            mode: d.mode,
            mtime_ns: d.mtime_ns,
            in_tree: d.in_tree,
        });
        plan.tree.preserved_dirs = deepest_first(dirs.collect());
    }
    // Made first (parents before children), as `mkdir` would.
    if let Some(path) = made {
        plan.local_dirs.insert(
            0,
            tree::PlannedDir {
                path: PathBuf::from(path),
                mode: 0o777,
                mtime_ns: 0,
                in_tree: false,
            },
        );
    }
    skip::prune(client, &mut plan, &job.skip).await?;
    Ok(plan)
}

/// What a pull's remote source `r` is: a symlink reported as one when
/// `links` (with its target, from an rcpd of 2.9 or later), else followed
/// (rcpd's Stat of `r/`).
async fn remote_source(client: &Client, r: &str, links: bool) -> Result<crate::proto::Entry> {
    let missing = || ControlError::RemoteNotFound {
        host: client.host().to_string(),
        path: r.to_string(),
        dir: r.ends_with('/'),
    };
    let st = client.stat(r).await?.ok_or_else(missing)?;
    if st.r#type == FileType::Symlink as i32 && !links && !names_contents(r) {
        // A dangling link names nothing there.
        return client.stat(&format!("{r}/")).await?.ok_or_else(missing);
    }
    Ok(st)
}

/// The remote tree `r` pulled to `top.base`: its directories, files,
/// links, what is left out and (`--delete`) what goes.
async fn plan_pull_tree(
    client: &Client,
    plan: &mut Plan,
    job: &Job,
    r: &str,
    top: Top<PathBuf>,
) -> Result<()> {
    let base = top.base;
    plan.local_dirs.push(tree::PlannedDir {
        path: base.clone(),
        mode: top.mode,
        mtime_ns: top.mtime_ns,
        in_tree: top.in_tree,
    });
    let mut names = HashSet::new();
    let listed = client.list(r, true).await?;
    shaped_as_a_tree(&listed)?;
    for e in listed {
        let rel = safe_rel(&e.path)?;
        let dst = base.join(&rel);
        let kind = listed_kind(&e);
        let shown = || join_remote(r, &rel);
        let dest = || dst.display().to_string();
        if !plan.tree.admit(job, &rel, kind, shown, dest, &mut names) {
            continue;
        }
        if e.r#type == FileType::Dir as i32 {
            plan.local_dirs.push(tree::PlannedDir {
                path: dst,
                mode: e.mode,
                mtime_ns: e.mtime_ns,
                in_tree: true,
            });
        } else if e.r#type == FileType::File as i32 {
            let src = join_remote(r, &rel);
            let mut f = with_job(FileJob::pull(&src, dst.clone()), job, true);
            f.len_hint = e.length;
            plan.files.push(Planned {
                job: f,
                source: src,
                dest: dst.display().to_string(),
                bytes: e.length,
                mtime_ns: Some(e.mtime_ns),
                mode: Some(e.mode),
            });
        }
    }
    if job.delete {
        let dest = tree::local_entries(&base, top.in_tree)?;
        plan.tree.delete_extras(&job.filter, &dest, &names, |r| {
            base.join(r).display().to_string()
        });
    }
    Ok(())
}

/// A pulled tree's listing must be a tree: every entry's parent is the
/// top or an entry listed as a directory. A listing that names `q/x`
/// where `q` is a symlink (or not listed) would have the pull open `q`
/// locally, through whatever stands there: refused, naming both.
fn shaped_as_a_tree(listed: &[crate::proto::Entry]) -> Result<()> {
    let dirs: HashSet<&Path> = listed
        .iter()
        .filter(|e| e.r#type == FileType::Dir as i32)
        .map(|e| Path::new(&e.path))
        .collect();
    for e in listed {
        let Some(parent) = Path::new(&e.path).parent() else {
            continue;
        };
        if !parent.as_os_str().is_empty() && !dirs.contains(parent) {
            return Err(ControlError::Invalid(format!(
                "the server listed {:?} beneath {:?}, which it did not list as a directory",
                e.path,
                parent.display().to_string()
            )));
        }
    }
    Ok(())
}

/// What a remote listing says an entry is.
fn listed_kind(e: &crate::proto::Entry) -> tree::Kind<'_> {
    if !e.left_out.is_empty() {
        return tree::Kind::Skipped {
            link: e.r#type == FileType::Symlink as i32,
            why: &e.left_out,
        };
    }
    match FileType::try_from(e.r#type) {
        Ok(FileType::Dir) => tree::Kind::Dir,
        Ok(FileType::File) => tree::Kind::File,
        Ok(FileType::Symlink) => {
            tree::Kind::Link(Some(e.link_target.as_str()).filter(|t| !t.is_empty()))
        }
        _ => tree::Kind::Skipped {
            link: false,
            why: "not a regular file, directory or symlink",
        },
    }
}

/// `rcp pull [-r] HOST:REMOTE... LOCAL`: planned, then [`run`].
pub async fn pull(
    client: &Client,
    remotes: &[String],
    local: &Path,
    job: &Job,
    w: &dyn Watcher,
) -> Result<Outcome> {
    let plan = plan_pull(client, remotes, local, job).await?;
    run(client, plan, w).await
}

/// `rcp doctor [HOST]`: the local checks of [`crate::doctor`], plus whether
/// the rcpd at `remote` answers and accepts the token; with the error of
/// that check when it failed (its exit code is doctor's).
pub async fn doctor(
    remote: Option<String>,
    opts: super::client::ClientOptions,
) -> (crate::doctor::Diagnosis, Option<ControlError>) {
    use crate::doctor::{diagnose, DoctorOptions, Finding, Level};
    let d_opts = DoctorOptions {
        device: opts.rails.first().map(|r| r.device.clone()),
        gid_index: opts.gid_index,
        arena_bytes: 32 << 20,
        rdma_required: opts.transport == super::link::Transport::Verbs,
    };
    let mut d = tokio::task::spawn_blocking(move || diagnose(&d_opts))
        .await
        .unwrap_or_default();
    let Some(addr) = remote else { return (d, None) };
    let r = match Client::connect(&addr, opts).await {
        Ok(c) => c.stat("").await.map(|_| ()),
        Err(e) => Err(e),
    };
    let failed = r.err();
    d.add(match &failed {
        None => Finding {
            name: "rcpd",
            level: Level::Ok,
            detail: format!("{addr} answers and accepts the token"),
            fix: String::new(),
        },
        Some(e) => {
            let msg = e.to_string();
            Finding {
                name: "rcpd",
                level: Level::Fail,
                detail: if msg.contains(&addr) {
                    msg
                } else {
                    format!("{addr}: {msg}")
                },
                fix: doctor_fix(e).into(),
            }
        }
    });
    (d, failed)
}

/// What to do about a failed rcpd check, by the error's type.
fn doctor_fix(e: &ControlError) -> &'static str {
    use crate::proto::Reason;
    match e {
        ControlError::NotRcpd { .. } => {
            "give rcpd's gRPC port (-P; its --listen), not its health or metrics port"
        }
        ControlError::UnknownHost { .. } => "check the host name (it does not resolve)",
        ControlError::NoAnswer { .. } => {
            "is rcpd there stalled, or is the port (-P; rcpd's --listen) another program's?"
        }
        e if e.reason() == Reason::Unauthenticated => {
            "give the token rcpd was started with (RCP_TOKEN or --token-file)"
        }
        e if e.reason() == Reason::Retryable => {
            "is rcpd running there, on this port (-P), reachable through the firewall?"
        }
        _ => "see the message above",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pulled_listing_must_be_shaped_as_a_tree() {
        use crate::proto::Entry;
        let e = |path: &str, t: FileType| Entry {
            path: path.into(),
            r#type: t as i32,
            ..Entry::default()
        };
        let good = [
            e("d", FileType::Dir),
            e("d/x", FileType::File),
            e("d/l", FileType::Symlink),
            e("y", FileType::File),
        ];
        assert!(shaped_as_a_tree(&good).is_ok());
        // Beneath a symlink, and beneath a name never listed.
        for bad in [
            vec![e("q", FileType::Symlink), e("q/x", FileType::File)],
            vec![e("d", FileType::Dir), e("d/e/x", FileType::File)],
        ] {
            let err = shaped_as_a_tree(&bad).unwrap_err();
            assert_eq!(err.reason(), super::super::error::Reason::Invalid, "{err}");
            assert!(
                err.to_string().contains("did not list as a directory"),
                "{err}"
            );
        }
    }

    #[test]
    fn remotes() {
        let r = parse_remote("node:/data/x", 7471).unwrap();
        assert_eq!(r.addr, "node:7471");
        assert_eq!(r.path, "/data/x");
        let r = parse_remote("[fe80::1]:a/b", 9).unwrap();
        assert_eq!(r.addr, "[fe80::1]:9");
        assert_eq!(r.path, "a/b");
        assert!(parse_remote("./a:b", 1).is_none());
        assert!(parse_remote("plain", 1).is_none());
        assert!(parse_remote(":x", 1).is_none());
        assert!(safe_rel("../x").is_err());
        assert!(safe_rel("a/b").is_ok());
    }

    #[test]
    fn a_line_per_rail() {
        use crate::datapath::{RailReport, Report};
        use crate::engine::stream::Counters;
        use crate::engine::WcStatus;
        let mut r = Report::default();
        assert!(rail_lines(&r, &[]).is_empty());
        let mut c1 = Counters {
            extents_confirmed: 1,
            bytes_confirmed: 1 << 20,
            failures: 1,
            requeued: 7,
            reconnects: 1,
            ..Counters::default()
        };
        for _ in 0..5 {
            c1.errors.count(WcStatus::Flushed);
        }
        r.rails = vec![
            RailReport {
                counters: Counters {
                    extents_confirmed: 3,
                    bytes_confirmed: 3 << 20,
                    ..Counters::default()
                },
                ..RailReport::default()
            },
            RailReport {
                counters: c1,
                failover_seconds: vec![0.0126],
                ..RailReport::default()
            },
        ];
        assert_eq!(
            rail_lines(&r, &["rxea0:1".to_string()]),
            vec![
                "rail 0 (rxea0:1): 3 blocks, 3145728 bytes, 0 error CQEs, 0 failures, 0 blocks requeued, \
                 0 reconnects, 0 pauses",
                "rail 1: 1 blocks, 1048576 bytes, 5 error CQEs, 1 failures, 7 blocks requeued, \
                 1 reconnects, 0 pauses, failover 0.013 s",
            ]
        );
    }
}
