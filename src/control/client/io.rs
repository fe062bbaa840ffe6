//! What the client's core asks for, on blocking threads: sources opened and
//! their blocks read and hashed into staging, pulled blocks checked and
//! written, local destinations (resumed or new), batched commits.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::control::error::ControlError;
use crate::control::fsutil;
use crate::control::protocol::{
    Digest, Failure, FileId, FileSpec, Held, LocalCommit, Reason, SourceMeta,
};
use crate::files::{
    self, Check, Destination, DestinationOptions, DirCache, DirHandle, KnownBlocks, Preserve,
    SourceFile,
};
use crate::mem::Block;
use crate::proto::{self, Direction};

/// Push: where a file's bytes come from when they are not a local path's
/// (a fan-out node forwards a file it is still receiving).
pub trait Source: Send + Sync {
    /// Open it (on a blocking thread): the file and what the receiver is
    /// told of its source.
    fn open(&self, bs: u64) -> Result<(Arc<SourceFile>, SourceMeta), Failure>;
}

/// A [`Source`] a [`FileJob`] reads from.
#[derive(Clone)]
pub struct OpenWith(pub Arc<dyn Source>);

impl std::fmt::Debug for OpenWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpenWith(..)")
    }
}

/// One file of a job: what to move and its local path.
#[derive(Clone, Debug)]
pub struct FileJob {
    pub spec: FileSpec,
    /// Push: the source; pull: the final local path.
    pub local: PathBuf,
    /// Its length as far as the caller knows (progress totals).
    pub len_hint: u64,
    /// Push: read from this instead of opening `local` (shown as it).
    pub source: Option<OpenWith>,
}

impl FileJob {
    /// Push `local` to `remote` (an existing remote directory means "inside
    /// it").
    pub fn push(local: PathBuf, remote: &str) -> FileJob {
        let len = std::fs::metadata(&local).map_or(0, |m| m.len());
        Self::push_len(local, remote, len)
    }

    /// [`push`](Self::push) of a file whose length the caller knows (a
    /// tree walk's): no stat.
    pub fn push_len(local: PathBuf, remote: &str, len_hint: u64) -> FileJob {
        let name = local
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        FileJob {
            spec: FileSpec {
                direction: Direction::Push,
                remote: remote.to_string(),
                name,
                ..FileSpec::default()
            },
            len_hint,
            local,
            source: None,
        }
    }

    /// Pull `remote` to the final local path `local`.
    pub fn pull(remote: &str, local: PathBuf) -> FileJob {
        FileJob {
            spec: FileSpec {
                direction: Direction::Pull,
                remote: remote.to_string(),
                ..FileSpec::default()
            },
            local,
            len_hint: 0,
            source: None,
        }
    }

    /// Where it comes from, as its [`FileResult`](super::FileResult)'s
    /// `source` says: push, the local path; pull, the remote path.
    pub fn source(&self) -> String {
        match self.spec.direction {
            Direction::Push => self.local.display().to_string(),
            _ => self.spec.remote.clone(),
        }
    }
}

fn fail(e: impl Into<ControlError>) -> Failure {
    e.into().failure()
}

/// A pulled file's destination, shared by the window jobs that write it
/// and taken by the commit.
pub(super) type SharedDest = Arc<Mutex<Option<Destination>>>;

/// A file the client has open.
pub(super) enum Local {
    Push {
        src: Arc<SourceFile>,
    },
    Pull {
        dir: DirHandle,
        name: OsString,
        /// An interrupted copy found by FindResume, until CreateDest.
        resumed: Option<Box<Destination>>,
        dest: SharedDest,
    },
}

/// Whether dropping `l` may block: an uncommitted destination is suspended
/// for --resume (a sync and a manifest) or removed; a source, or a
/// destination committed (taken), only closes its fds.
pub(super) fn drop_may_block(l: &Local) -> bool {
    match l {
        Local::Push { .. } => false,
        Local::Pull { resumed, dest, .. } => resumed.is_some() || dest.lock().unwrap().is_some(),
    }
}

/// Push: open the local source. Its fingerprint (for a resume manifest) is
/// read only for a file of more than one `bs` block: a smaller copy keeps no
/// manifest, and the fingerprint would hash its bytes a second time.
pub(super) fn open_source(path: &Path, bs: u64) -> Result<(Arc<SourceFile>, SourceMeta), Failure> {
    open_source_known(path, bs, None)
}

/// [`open_source`], taking `known` as the file's block digests when they
/// were computed from it as it is now ([`SourceFile::know`]).
fn open_source_known(
    path: &Path,
    bs: u64,
    known: Option<Arc<KnownBlocks>>,
) -> Result<(Arc<SourceFile>, SourceMeta), Failure> {
    let mut src = SourceFile::open(path).map_err(|e| {
        // Only when it failed: a stat per file costs on trees of small files.
        if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return Failure::new(
                Reason::Usage,
                format!("{} is a directory (use -r)", path.display()),
            );
        }
        fail(e)
    })?;
    if let Some(k) = known {
        src.know(k);
    }
    let meta = SourceMeta {
        length: src.len(),
        mode: src.mode(),
        mtime_ns: fsutil::ns_from_ts(src.mtime()),
        fingerprint: if src.len() > bs {
            src.source_id().map_err(fail)?.fingerprint.to_vec()
        } else {
            Vec::new()
        },
    };
    Ok((Arc::new(src), meta))
}

/// A local file whose block digests the plan computed (`--delta`): opened
/// as any local source, its digests taken when the file is unchanged since,
/// so that the blocks that do not move are not read and hashed again
/// (`hash`).
pub struct KnownSource {
    pub path: PathBuf,
    pub known: Arc<KnownBlocks>,
}

impl Source for KnownSource {
    fn open(&self, bs: u64) -> Result<(Arc<SourceFile>, SourceMeta), Failure> {
        open_source_known(&self.path, bs, Some(self.known.clone()))
    }
}

/// Pull: the directory and name of the final local path, creating parents
/// when asked; a directory in `dirs` is taken from there (and one opened
/// here is put there).
pub(super) fn local_dir(
    dirs: &DirCache<PathBuf>,
    local: &Path,
    create_parents: bool,
) -> Result<(DirHandle, OsString), Failure> {
    let parent = fsutil::parent_dir(local).unwrap_or(Path::new("."));
    let name = || {
        local.file_name().map(OsStr::to_os_string).ok_or_else(|| {
            Failure::new(
                Reason::Usage,
                format!("{} has no file name", local.display()),
            )
        })
    };
    if let Some(d) = dirs.get(parent) {
        return Ok((d, name()?));
    }
    if !parent.is_dir() {
        if create_parents {
            std::fs::create_dir_all(parent).map_err(|e| {
                fail(ControlError::io(format!("creating {}", parent.display()))(
                    e,
                ))
            })?;
        } else {
            return Err(fail(ControlError::DirNotFound(
                parent.display().to_string(),
            )));
        }
    }
    let name = name()?;
    let d = DirHandle::open(parent).map_err(fail)?;
    dirs.insert(parent.to_owned(), d.clone());
    Ok((d, name))
}

fn dest_options(
    check: Check,
    bs: u64,
    spec: &FileSpec,
    mode: u32,
    mtime_ns: i64,
) -> DestinationOptions {
    DestinationOptions {
        block_size: bs,
        check,
        preserve: spec.preserve.then(|| Preserve {
            mode: mode & 0o7777,
            mtime: fsutil::ts_from_ns(mtime_ns),
        }),
        source_mode: Some(mode),
        flat_sha256: spec.flat_sha256,
        ..DestinationOptions::default()
    }
}

/// Pull with resume: an interrupted copy of `entry` (the remote file as
/// stat'ed, with its fingerprint) at `dir/name`, and what it holds.
pub(super) fn find_resume(
    check: Check,
    dir: &DirHandle,
    name: &OsString,
    entry: &proto::Entry,
    bs: u64,
    spec: &FileSpec,
) -> Result<Option<(Destination, Held)>, Failure> {
    let sid = fsutil::source_id(entry.length, entry.mtime_ns, &entry.fingerprint);
    let opts = dest_options(check, bs, spec, entry.mode, entry.mtime_ns);
    let Some(d) = Destination::resume(dir, name, &sid, opts).map_err(fail)? else {
        return Ok(None);
    };
    let blocks = crate::control::protocol::Bitmap::all_but(d.block_count(), &d.missing_blocks());
    let held = Held {
        blocks,
        length: entry.length,
        mtime_ns: entry.mtime_ns,
        fingerprint: entry.fingerprint.clone(),
    };
    Ok(Some((d, held)))
}

/// Pull: the destination for a file the server opened (the resumed one when
/// the server resumed it).
pub(super) fn create_dest(
    check: Check,
    dir: &DirHandle,
    name: &OsString,
    resumed: Option<Box<Destination>>,
    opened: &proto::Opened,
    bs: u64,
    spec: &FileSpec,
) -> Result<Destination, Failure> {
    if let (Some(d), true) = (resumed, opened.resumed) {
        return Ok(*d);
    }
    let sid = fsutil::source_id(opened.length, opened.mtime_ns, &opened.source_fingerprint);
    let opts = DestinationOptions {
        resume: Some(sid),
        ..dest_options(check, bs, spec, opened.mode, opened.mtime_ns)
    };
    // A tree's file whose name the plan found free is made without a
    // look: what came there since is replaced when it is committed.
    match spec.absent {
        true => Destination::create_over(dir, name, None, opened.length, opts),
        false => Destination::create(dir, name, opened.length, opts),
    }
    .map_err(fail)
}

/// Push: read each extent's block from its source into `slot` at its
/// offset; their digests, in order.
pub(super) fn fill(
    check: Check,
    slot: &mut Block,
    extents: &[proto::Extent],
    srcs: &HashMap<FileId, Arc<SourceFile>>,
    bs: u64,
) -> Result<Vec<Digest>, Failure> {
    let mem = slot.as_mut_slice();
    for e in extents {
        let src = srcs
            .get(&e.file)
            .ok_or_else(|| Failure::new(Reason::Other, format!("file {} is not open", e.file)))?;
        let at = e.offset as usize;
        fsutil::read_exact(src, e.block * bs, &mut mem[at..at + e.len as usize]).map_err(|x| {
            fail(ControlError::io(format!(
                "reading {}",
                src.path().display()
            ))(x))
        })?;
    }
    let mem = slot.as_slice();
    let slices: Vec<&[u8]> = extents
        .iter()
        .map(|e| &mem[e.offset as usize..(e.offset + u64::from(e.len)) as usize])
        .collect();
    Ok(check
        .blocks(&slices)
        .iter()
        .map(|d| check.wire(d))
        .collect())
}

/// Test-only fault injection, compiled in only with the `fault-injection`
/// feature (the test scripts'; off in normal builds, debug or release):
/// with `RCP_TEST_CORRUPT_PULLED_BLOCKS=N`, the first N pulled blocks
/// checked get one byte flipped in local memory before their digest is
/// checked, as if damaged on the way.
#[cfg(feature = "fault-injection")]
pub(super) fn inject_faults(slot: &mut Block, extents: &[proto::Extent]) {
    let mem = slot.as_mut_slice();
    for e in extents {
        if e.len > 0 && crate::faults::fire(crate::faults::PULLED_BLOCKS) {
            mem[e.offset as usize] ^= 0x5a;
            tracing::warn!(
                file = e.file,
                block = e.block,
                "test fault: damaged a pulled block"
            );
        }
    }
}

/// Pull: check each extent READ into `slot` against its digest and write
/// the matching blocks to their files; the indices of the others.
pub(super) fn check_and_write(
    check: Check,
    slot: &Block,
    extents: &[proto::Extent],
    digests: &[Digest],
    dests: &HashMap<FileId, SharedDest>,
) -> Result<Vec<u32>, Failure> {
    let mem = slot.as_slice();
    let slices: Vec<&[u8]> = extents
        .iter()
        .map(|e| &mem[e.offset as usize..(e.offset + u64::from(e.len)) as usize])
        .collect();
    let landed = check.landed(&slices, digests);
    for (((e, data), g), &ok) in extents
        .iter()
        .zip(&slices)
        .zip(&landed.digests)
        .zip(&landed.ok)
    {
        if !ok {
            tracing::warn!(
                file = e.file,
                block = e.block,
                "pulled block does not match the server's digest: reading it again"
            );
            continue;
        }
        let dest = dests.get(&e.file).ok_or_else(|| {
            Failure::new(Reason::Other, format!("file {} has no destination", e.file))
        })?;
        let mut d = dest.lock().unwrap();
        let d = d
            .as_mut()
            .ok_or_else(|| Failure::new(Reason::Other, "destination already committed"))?;
        d.write_block(e.block, data, *g).map_err(fail)?;
    }
    Ok(landed.bad())
}

/// Push, resume: digests of blocks that do not move.
pub(super) fn hash(
    check: Check,
    src: &SourceFile,
    blocks: &[u64],
    bs: u64,
) -> Result<Vec<(u64, Digest)>, Failure> {
    // Known from the plan and the file unchanged since: no read. (Were it
    // changed, the check of the source at the end fails the copy.)
    if let Some(known) = src.known_blocks(check, bs) {
        if src.check_unchanged().is_ok() && blocks.iter().all(|&b| b < known.len() as u64) {
            return Ok(blocks
                .iter()
                .map(|&b| (b, check.wire(&known[b as usize])))
                .collect());
        }
    }
    let digests = crate::files::content::digests_of(src, check, bs, blocks).map_err(fail)?;
    Ok(blocks
        .iter()
        .zip(digests)
        .map(|(&b, d)| (b, check.wire(&d)))
        .collect())
}

/// Pull: seal every file, then publish them as one batch.
pub(super) fn commit(
    check: Check,
    files: Vec<(FileId, SharedDest, Digest)>,
) -> Vec<(FileId, Result<LocalCommit, Failure>)> {
    let mut out = Vec::with_capacity(files.len());
    let mut sealed = Vec::new();
    let mut ids = Vec::new();
    for (file, dest, digest) in files {
        let Some(d) = dest.lock().unwrap().take() else {
            out.push((file, Err(Failure::new(Reason::Other, "committed twice"))));
            continue;
        };
        let Some(expected) = check.from_wire(&digest) else {
            out.push((
                file,
                Err(Failure::invalid("a file digest of the wrong length")),
            ));
            continue;
        };
        match d.seal(expected) {
            Ok(s) => {
                sealed.push(s);
                ids.push(file);
            }
            Err(e) => out.push((file, Err(fail(e)))),
        }
    }
    for (file, r) in ids.into_iter().zip(files::publish(sealed)) {
        out.push((
            file,
            r.map(|p| LocalCommit {
                flat_sha256: p.flat_sha256.map(|d| d.to_vec()).unwrap_or_default(),
            })
            .map_err(fail),
        ));
    }
    out
}
