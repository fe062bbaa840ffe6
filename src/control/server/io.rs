//! The I/O the server's ledger asks for, on blocking threads: destinations
//! and sources beneath the root, window slots filled, made reachable
//! (a memory window bound to the session's QP, or a registration), revoked
//! and verified, batched commits.
//!
//! Revoking is dropping the slot's registration: a memory window is
//! invalidated on the session's QP (its rkey fails from the next request
//! on), a registration deregistered. Both happen before the server touches
//! the slot's bytes again (grant: before filling it; verify: before reading
//! what landed). These run on blocking threads: an invalidate is a post and
//! a poll of the QP's CQ.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedSemaphorePermit;

use super::feeds::Feed;
use super::{Service, SessionState};
use crate::control::error::ControlError;
use crate::control::fsutil;
use crate::control::protocol::{
    Bitmap, CommittedFile, Digest, Failure, FileId, Granted, OpenedFile, Reason,
};
use crate::escape::esc;
use crate::files::{
    self, Destination, DestinationOptions, DirCache, DirHandle, FileError, FileKind, PathError,
    Preserve, SourceFile,
};
use crate::files::{FileMeta, Growing};
use crate::mem::Block;
use crate::proto::{self, Direction};
use crate::provider::exposed::Exposed;
use crate::provider::{Access, Domain, ProviderError, Registration};

/// Files below this length are not checked against the free space up
/// front (one statvfs each); a full disk still fails them at fallocate.
const SPACE_CHECK_FROM: u64 = 64 << 20;

/// A pushed file of a fan-out, as its feed shows it.
#[derive(Clone)]
pub(super) struct Fed {
    feed: Arc<Feed>,
    growing: Arc<Growing>,
    _detach: Arc<DetachOnDrop>,
}

/// When the last handle of a fan-out's file goes uncommitted, its
/// [`Growing`] lets the temp file go (a hostile or failed sender leaves
/// no descriptor behind in the feed).
struct DetachOnDrop(Arc<Growing>);

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        self.0.detach();
    }
}

/// What the server holds of an open file.
#[derive(Clone)]
pub(super) enum FileHandle {
    Push {
        dest: Arc<Mutex<Option<Destination>>>,
        /// Where it goes, relative to the root.
        path: String,
        /// A fan-out's file: its blocks told to the feed as they are
        /// verified.
        fed: Option<Fed>,
    },
    Pull {
        src: Arc<SourceFile>,
    },
}

impl FileHandle {
    pub(super) fn direction(&self) -> Direction {
        match self {
            FileHandle::Push { .. } => Direction::Push,
            FileHandle::Pull { .. } => Direction::Pull,
        }
    }

    /// Whether dropping the last handle may block: an uncommitted
    /// destination is suspended for --resume (a sync and a manifest) or
    /// removed; a source, or a destination committed (taken), only closes
    /// its fds.
    pub(super) fn drop_may_block(&self) -> bool {
        match self {
            FileHandle::Push { dest, .. } => dest.lock().unwrap().is_some(),
            FileHandle::Pull { .. } => false,
        }
    }
}

/// A window's arena slot and, while granted, its registrations (one per
/// rail of the session): an [`Exposed`] block (its bytes reachable only
/// through [`revoke`](Self::revoke), which drops every registration
/// first) and the window's permit.
pub(super) struct WindowSlot {
    block: Exposed<Block>,
    _permit: OwnedSemaphorePermit,
}

impl WindowSlot {
    pub fn new(block: Block, permit: OwnedSemaphorePermit) -> Self {
        WindowSlot {
            block: Exposed::new(block),
            _permit: permit,
        }
    }

    /// Revoke every grant of the slot (its rkeys fail from the peer's next
    /// request on) and hand out its bytes.
    pub fn revoke(&mut self) -> &mut Block {
        self.block.revoke()
    }

    /// Revoke what was granted before, then lend the first `len` bytes of
    /// the slot to the peer with `access` through each of `domains` (a
    /// memory window bound to the session's QP, or a registration in its
    /// PD, per rail); the registrations, in the order of `domains`. On an
    /// error nothing stays granted.
    pub fn grant<'d>(
        &mut self,
        domains: impl IntoIterator<Item = &'d dyn Domain>,
        len: usize,
        access: Access,
    ) -> Result<&[Arc<dyn Registration>], ProviderError> {
        self.block.grant(domains, len, access, None)
    }
}

/// [`StreamIo::push_target`]'s answer: the directory, the final name, the
/// path shown, and what was at the final name if it was looked at.
type PushTarget = (DirHandle, String, String, Option<Option<FileMeta>>);

fn fail(e: impl Into<ControlError>) -> Failure {
    e.into().failure()
}

/// One Move stream's view of the service.
pub(super) struct StreamIo {
    pub svc: Arc<Service>,
    pub session: Arc<SessionState>,
    pub bs: u64,
    /// Directories opened last for this stream's pushes, by path.
    dirs: DirCache<String>,
}

impl StreamIo {
    pub fn new(svc: Arc<Service>, session: Arc<SessionState>) -> Self {
        let bs = session.params.block_size;
        StreamIo {
            svc,
            session,
            bs,
            dirs: DirCache::default(),
        }
    }

    /// Whether every rail of the session is the tcp provider's, where a
    /// grant registers the slot in a map and a revoke removes it: cheap
    /// enough for the stream's driver (on verbs a grant binds a memory
    /// window or registers memory, and a revoke posts an invalidate and
    /// polls for it: blocking threads' work).
    pub fn cheap_grants(&self) -> bool {
        std::iter::once(&self.session.domain)
            .chain(self.session.rail_domains())
            .all(|d| d.kind() == crate::provider::ProviderKind::Tcp)
    }

    /// [`ServerAction::Open`](crate::control::protocol::ServerAction::Open).
    pub fn open(&self, o: &proto::OpenFile) -> Result<(FileHandle, OpenedFile), Failure> {
        match Direction::try_from(o.direction) {
            Ok(Direction::Push) => self.open_push(o).map_err(fail),
            _ => self.open_pull(o).map_err(fail),
        }
    }

    /// Directory `rel` (normal form): the one this stream opened already,
    /// or opened (made with its parents when `create`) and kept.
    fn dir(&self, rel: &str, create: bool) -> Result<DirHandle, ControlError> {
        if let Some(d) = self.dirs.get(rel) {
            return Ok(d);
        }
        let root = self.svc.root();
        let d = if create {
            root.create_dir_all(rel)?
        } else {
            root.open_dir(rel)?
        };
        self.dirs.insert(rel.to_string(), d.clone());
        Ok(d)
    }

    /// Where a push lands: the directory and the final name, scp-style (an
    /// existing directory means "inside it", except for a file of a tree,
    /// `create_parents`, which is refused there), and what is at the final name
    /// when it was looked at here (`Some(None)`: nothing), so that the
    /// destination does not look again.
    fn push_target(&self, open: &proto::OpenFile) -> Result<PushTarget, ControlError> {
        let absent = open.absent && open.create_parents;
        // A path already in normal form (plain names: a client's usual)
        // is looked up as written, without building its normal form.
        // Any other form is normalized first; either is looked at in its
        // open directory once.
        let written = open.path.trim_start_matches('/');
        let plain = files::plain_parent_and_name(written);
        if let Some((parent, name)) = plain {
            if let Some(t) = self.in_open_dir(parent, name, written, absent)? {
                return Ok(t);
            }
        }
        let root = self.svc.root();
        let rel = fsutil::root_rel(&open.path);
        let rp = files::normalize(&rel)?;
        if let (None, Some(name)) = (plain, rp.file_name()) {
            let (parent, shown) = (fsutil::rel_str(&rp.parent()), fsutil::rel_str(&rp));
            if let Some(t) = self.in_open_dir(&parent, name, &shown, absent)? {
                return Ok(t);
            }
        }
        if absent {
            let (dir, name) = self.parent_of(&rp, open)?;
            return Ok((dir, name, fsutil::rel_str(&rp), Some(None)));
        }
        // A file of a tree (its parents made as needed) names its own
        // destination: "an existing directory means inside it" is the
        // top-level destination's rule only, never an entry's; and a
        // symlink standing at its name is replaced, never followed (rsync).
        let seen = match open.create_parents {
            true => root.lstat(&rel),
            false => root.stat(&rel),
        };
        match seen {
            Ok(m) if m.kind == FileKind::Dir && open.create_parents => {
                Err(FileError::IsADirectory { path: rel.into() }.into())
            }
            Ok(m) if m.kind == FileKind::Symlink && open.create_parents => {
                let (dir, name) = self.parent_of(&rp, open)?;
                Ok((dir, name, fsutil::rel_str(&rp), None))
            }
            Ok(m) if m.kind == FileKind::Dir => {
                let d = self.dir(&rel, false)?;
                let name = open.name.clone();
                let shown = if rel == "." {
                    name.clone()
                } else {
                    format!("{rel}/{name}")
                };
                Ok((d, name, shown, None))
            }
            Ok(m) if m.kind != FileKind::File => Err(ControlError::Invalid(format!(
                "{} exists and is not a regular file",
                open.path
            ))),
            Ok(_) | Err(FileError::Path(PathError::NotFound { .. })) => {
                let (dir, name) = self.parent_of(&rp, open)?;
                Ok((dir, name, fsutil::rel_str(&rp), None))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A pushed file `name` in directory `parent` (normal form), shown as
    /// `shown`, when this stream has that directory open already (every
    /// file of a tree after the first of its directory): one fstatat of
    /// the name there, not a resolution of the whole path beneath the
    /// root. Only "nothing there" and a regular file are settled here
    /// (`None`: a directory, a symlink or anything else, or the directory
    /// not open, take the full path). A tree's file the client found
    /// absent (`OpenFile.absent`) is not looked at: whatever came there
    /// since is replaced when it is committed, a directory refused then.
    fn in_open_dir(
        &self,
        parent: &str,
        name: &str,
        shown: &str,
        absent: bool,
    ) -> Result<Option<PushTarget>, ControlError> {
        let Some(d) = self.dirs.get(parent) else {
            return Ok(None);
        };
        let seen = match absent {
            true => None,
            false => d.entry(name)?,
        };
        Ok(seen
            .as_ref()
            .is_none_or(|m| m.kind == FileKind::File)
            .then(|| (d, name.to_string(), shown.to_string(), Some(seen))))
    }

    /// The directory a pushed file `rp` goes in (made with its parents
    /// when the file asks), and its name there.
    fn parent_of(
        &self,
        rp: &files::RelPath,
        open: &proto::OpenFile,
    ) -> Result<(DirHandle, String), ControlError> {
        let name = rp
            .file_name()
            .ok_or_else(|| ControlError::Invalid("cannot write over the root".into()))?
            .to_string();
        let parent = fsutil::rel_str(&rp.parent());
        let dir = self
            .dir(&parent, open.create_parents)
            .map_err(|e| match e {
                ControlError::FileNotFound(_) | ControlError::DirNotFound(_) => {
                    ControlError::DirNotFound(format!("{parent} (parent of {})", open.path))
                }
                e => e,
            })?;
        Ok((dir, name))
    }

    fn open_push(&self, open: &proto::OpenFile) -> Result<(FileHandle, OpenedFile), ControlError> {
        let (dir, name, path, seen) = self.push_target(open)?;
        if open.length >= SPACE_CHECK_FROM {
            check_space(&dir, open.length)?;
        }
        let source = fsutil::source_id(open.length, open.mtime_ns, &open.source_fingerprint);
        let opts = DestinationOptions {
            block_size: self.bs,
            preserve: open.preserve.then(|| Preserve {
                mode: open.mode & 0o7777,
                mtime: fsutil::ts_from_ns(open.mtime_ns),
            }),
            source_mode: Some(open.mode),
            // Always resumable: an interrupted push can be continued with
            // --resume (the temp file and manifest stay hidden until then).
            resume: Some(source),
            check: self.session.params.check,
            flat_sha256: open.flat_sha256,
            ..DestinationOptions::default()
        };
        let dest = match open.resume {
            true => Destination::resume(&dir, &name, &source, opts.clone())?,
            false => None,
        };
        let dest = match dest {
            Some(d) => d,
            None => {
                let mut d = match &seen {
                    Some(seen) => {
                        Destination::create_over(&dir, &name, seen.as_ref(), open.length, opts)?
                    }
                    None => Destination::create(&dir, &name, open.length, opts)?,
                };
                if !open.keep_blocks.is_empty() {
                    let root = self.svc.root();
                    let check = self.session.params.check;
                    let kept = super::delta::seed(root, &path, open, &mut d, check)?;
                    tracing::debug!(path = %esc(&path), kept, "push --delta");
                }
                d
            }
        };
        let total = open.length.div_ceil(self.bs);
        let missing = dest.missing_blocks();
        let fed = match open.fanout.is_empty() {
            true => None,
            false => {
                let file = dest.temp_reader()?;
                let gone: std::collections::HashSet<u64> = missing.iter().copied().collect();
                let held = (0..total).filter(|b| !gone.contains(b)).collect();
                let feed = self.svc.fanouts.feed(&open.fanout);
                let growing = feed.receiving(open, &path, self.bs, file, held);
                let _detach = Arc::new(DetachOnDrop(growing.clone()));
                Some(Fed {
                    feed,
                    growing,
                    _detach,
                })
            }
        };
        let skip = ((missing.len() as u64) < total).then(|| Bitmap::all_but(total, &missing));
        tracing::debug!(path = %esc(&path), length = open.length, resumed = skip.is_some(), "push");
        Ok((
            FileHandle::Push {
                dest: Arc::new(Mutex::new(Some(dest))),
                path: path.clone(),
                fed,
            },
            OpenedFile {
                length: open.length,
                mode: open.mode,
                mtime_ns: open.mtime_ns,
                path,
                skip,
                fingerprint: Vec::new(),
            },
        ))
    }

    fn open_pull(&self, open: &proto::OpenFile) -> Result<(FileHandle, OpenedFile), ControlError> {
        let rel = fsutil::root_rel(&open.path);
        let src = SourceFile::open_in(self.svc.root(), &rel)?;
        let length = src.len();
        let mtime = fsutil::ns_from_ts(src.mtime());
        // The fingerprint only where the client keeps a resume manifest
        // (more than one block): for a small file it would hash every byte
        // a second time.
        let fingerprint = if length > self.bs {
            src.source_id()?.fingerprint.to_vec()
        } else {
            Vec::new()
        };
        let mut skip = None;
        if open.resume
            && open.have_length == length
            && open.have_mtime_ns == mtime
            && open.source_fingerprint == fingerprint
        {
            skip = Bitmap::from_bytes(open.have_blocks.clone(), length.div_ceil(self.bs))
                .filter(|b| b.count() > 0);
        }
        tracing::debug!(path = %esc(&rel), length, resumed = skip.is_some(), "pull");
        let opened = OpenedFile {
            length,
            mode: src.mode(),
            mtime_ns: mtime,
            path: rel,
            skip,
            fingerprint,
        };
        Ok((FileHandle::Pull { src: Arc::new(src) }, opened))
    }

    /// The used length of a window of `extents`.
    pub(super) fn used(extents: &[proto::Extent]) -> usize {
        extents
            .iter()
            .map(|e| (e.offset + u64::from(e.len)) as usize)
            .max()
            .unwrap_or(0)
    }

    /// [`ServerAction::Grant`](crate::control::protocol::ServerAction::Grant):
    /// revoke what was granted before, fill (pull), make the used part of
    /// the slot reachable by the session (bind a memory window to its QP,
    /// or register it in its PD). Returns address, rkey and (pull) the
    /// digests.
    pub fn grant(
        &self,
        slot: &mut WindowSlot,
        extents: &[proto::Extent],
        fill: Option<&HashMap<FileId, FileHandle>>,
        len: usize,
    ) -> Result<Granted, Failure> {
        let mut digests = Vec::new();
        if let Some(files) = fill {
            // Revoke the old rkeys before touching the memory.
            let block = slot.revoke();
            let mem = block.as_mut_slice();
            for e in extents {
                let Some(FileHandle::Pull { src }) = files.get(&e.file) else {
                    return Err(Failure::new(
                        Reason::Other,
                        format!("file {} is not open", e.file),
                    ));
                };
                let at = e.offset as usize;
                fsutil::read_exact(src, e.block * self.bs, &mut mem[at..at + e.len as usize])
                    .map_err(|e| fail(ControlError::io("reading the source file")(e)))?;
            }
            let mem = block.as_slice();
            let slices: Vec<&[u8]> = extents
                .iter()
                .map(|e| &mem[e.offset as usize..(e.offset + u64::from(e.len)) as usize])
                .collect();
            let check = self.session.params.check;
            digests = check
                .blocks(&slices)
                .iter()
                .map(|d| check.wire(d))
                .collect();
            if !self.session.domain.exact_bounds() {
                // The window's rkey may reach the rest of its slot (memory
                // windows on a device that checks only the slot region's
                // bounds): leave nothing there of an earlier grant.
                let end = len.max(Self::used(extents));
                block.as_mut_slice()[end..].fill(0);
            }
        }
        let access = if fill.is_some() {
            Access::REMOTE_READ
        } else {
            Access::REMOTE_WRITE
        };
        // The session's domain, then its other rails': the same bytes,
        // registered in each rail's own domain.
        let domains =
            std::iter::once(&*self.session.domain).chain(self.session.rail_domains().map(|d| &**d));
        let regs = slot
            .grant(domains, len.max(Self::used(extents)), access)
            .map_err(|e| fail(self.registration_error(e)))?;
        let (addr, rkey) = (regs[0].addr(), regs[0].rkey());
        let rail_rkeys = if regs.len() > 1 {
            regs.iter().map(|r| r.rkey()).collect()
        } else {
            Vec::new()
        };
        Ok(Granted {
            addr,
            rkey,
            rail_rkeys,
            digests,
        })
    }

    /// A grant's registration failed: a refusal for lack of lockable
    /// memory is counted in rcp_memlock_failures_total.
    fn registration_error(&self, e: ProviderError) -> ControlError {
        if let ProviderError::Verbs(v) = &e {
            if v.hint == crate::verbs::Hint::Memlock {
                self.svc.metrics.memlock_failure();
            }
        }
        e.into()
    }

    /// [`ServerAction::Verify`](crate::control::protocol::ServerAction::Verify):
    /// revoke, digest what landed, write the blocks that match; the indices
    /// of those that do not.
    pub fn verify(
        &self,
        slot: &mut WindowSlot,
        extents: &[proto::Extent],
        expected: &[Digest],
        files: &HashMap<FileId, FileHandle>,
    ) -> Result<Vec<u32>, Failure> {
        // Revoke remote access before reading what landed.
        let mem = slot.revoke().as_slice();
        let slices: Vec<&[u8]> = extents
            .iter()
            .map(|e| &mem[e.offset as usize..(e.offset + u64::from(e.len)) as usize])
            .collect();
        let landed = self.session.params.check.landed(&slices, expected);
        for (((e, data), g), ok) in extents
            .iter()
            .zip(&slices)
            .zip(&landed.digests)
            .zip(&landed.ok)
        {
            if !ok {
                continue;
            }
            let Some(FileHandle::Push { dest, fed, .. }) = files.get(&e.file) else {
                return Err(Failure::new(
                    Reason::Other,
                    format!("file {} is not open", e.file),
                ));
            };
            let mut d = dest.lock().unwrap();
            let d = d
                .as_mut()
                .ok_or_else(|| Failure::new(Reason::Other, "destination already committed"))?;
            d.write_block(e.block, data, *g).map_err(fail)?;
            if let Some(f) = fed {
                f.growing.mark(e.block);
            }
        }
        let bad = landed.bad();
        tracing::debug!(
            first = extents.first().map(|e| e.block),
            blocks = extents.len(),
            bad = bad.len(),
            "window verified"
        );
        if !bad.is_empty() {
            self.svc.metrics.integrity_failures(bad.len() as u64);
            tracing::warn!(
                blocks = bad.len(),
                "block digest mismatch: asking the client to resend"
            );
        }
        Ok(bad)
    }

    /// [`ServerAction::Hash`](crate::control::protocol::ServerAction::Hash).
    pub fn hash(
        &self,
        held: &FileHandle,
        blocks: &[u64],
        length: u64,
    ) -> Result<Vec<(u64, Digest)>, Failure> {
        let FileHandle::Pull { src } = held else {
            return Err(Failure::new(Reason::Other, "hash of a pushed file"));
        };
        let mut buf = vec![0u8; self.bs as usize];
        let mut out = Vec::with_capacity(blocks.len());
        for &b in blocks {
            let n = (length - b * self.bs).min(self.bs) as usize;
            fsutil::read_exact(src, b * self.bs, &mut buf[..n])
                .map_err(|e| fail(ControlError::io("reading the source file")(e)))?;
            let check = self.session.params.check;
            out.push((b, check.wire(&check.block(&buf[..n]))));
        }
        Ok(out)
    }

    /// [`ServerAction::CheckSource`](crate::control::protocol::ServerAction::CheckSource).
    pub fn check_source(&self, held: &FileHandle) -> Result<(), Failure> {
        match held {
            FileHandle::Pull { src } => src.check_unchanged().map_err(fail),
            FileHandle::Push { .. } => Ok(()),
        }
    }

    /// [`ServerAction::Commit`](crate::control::protocol::ServerAction::Commit):
    /// seal every file, then publish them as one batch.
    pub fn commit(
        &self,
        files: Vec<(FileId, FileHandle, Digest)>,
    ) -> Vec<(FileId, Result<CommittedFile, Failure>)> {
        let mut out = Vec::with_capacity(files.len());
        let mut sealed = Vec::new();
        let mut meta = Vec::new();
        for (file, held, digest) in files {
            let FileHandle::Push { dest, path, fed } = held else {
                out.push((
                    file,
                    Err(Failure::new(Reason::Other, "commit of a pulled file")),
                ));
                continue;
            };
            let Some(d) = dest.lock().unwrap().take() else {
                out.push((file, Err(Failure::new(Reason::Other, "committed twice"))));
                continue;
            };
            let Some(expected) = self.session.params.check.from_wire(&digest) else {
                out.push((
                    file,
                    Err(Failure::invalid("a file digest of the wrong length")),
                ));
                continue;
            };
            match d.seal(expected) {
                Ok(s) => {
                    sealed.push(s);
                    meta.push((file, path, fed));
                }
                Err(e) => {
                    if matches!(e, FileError::DigestMismatch { .. }) {
                        self.svc.metrics.integrity_failures(1);
                    }
                    out.push((file, Err(fail(e))));
                }
            }
        }
        for ((file, path, fed), r) in meta.into_iter().zip(files::publish(sealed)) {
            out.push((
                file,
                r.map(|p| {
                    tracing::debug!(path = %esc(&path), "push committed");
                    if let Some(f) = fed {
                        f.feed.committed(&path, &f.growing);
                    }
                    CommittedFile {
                        path,
                        length: p.len,
                        digest: self.session.params.check.wire(&p.derived_digest),
                        flat_sha256: p.flat_sha256.map(|d| d.to_vec()).unwrap_or_default(),
                    }
                })
                .map_err(fail),
            ));
        }
        out
    }
}

fn check_space(dir: &DirHandle, need: u64) -> Result<(), ControlError> {
    // By its descriptor: a handle's path is for messages (beneath the root).
    if let Ok(s) = nix::sys::statvfs::fstatvfs(dir.fd()) {
        let avail = s.blocks_available() * s.fragment_size();
        if need > avail {
            return Err(ControlError::Exceeded(format!(
                "{need} bytes do not fit: {avail} bytes free at the destination"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Arena, ArenaConfig};
    use crate::provider::tcp::TcpDomain;

    fn slot(pool: &crate::mem::BlockPool) -> WindowSlot {
        let permit = Arc::new(tokio::sync::Semaphore::new(1))
            .try_acquire_owned()
            .unwrap();
        WindowSlot::new(pool.take().unwrap(), permit)
    }

    /// A slot's bytes are handed out only after every grant of it is
    /// revoked, and a new grant revokes the one before.
    #[test]
    fn a_slot_is_revoked_before_its_bytes_are_reached() {
        let pool = Arena::new(&ArenaConfig::new(2 << 20))
            .unwrap()
            .into_pool(1 << 20)
            .unwrap();
        let (a, b) = (TcpDomain::new(), TcpDomain::new());
        let mut s = slot(&pool);
        let domains: [&dyn Domain; 2] = [&*a, &*b];
        let regs = s.grant(domains, 4096, Access::REMOTE_WRITE).unwrap();
        assert_eq!(regs.len(), 2, "one registration per rail");
        let rkey = regs[0].rkey();
        assert!(a.by_rkey(rkey).is_some());
        assert_eq!((a.registrations(), b.registrations()), (1, 1));
        s.grant([&*a as &dyn Domain], 8192, Access::REMOTE_READ)
            .unwrap();
        assert!(a.by_rkey(rkey).is_none(), "the earlier grant is revoked");
        assert_eq!((a.registrations(), b.registrations()), (1, 0));
        s.revoke().as_mut_slice()[0] = 1;
        assert_eq!((a.registrations(), b.registrations()), (0, 0));
        // Too long for the slot: refused, nothing granted.
        assert!(s
            .grant([&*a as &dyn Domain], (1 << 20) + 1, Access::REMOTE_WRITE)
            .is_err());
        assert_eq!(a.registrations(), 0);
        // Dropping a granted slot revokes its grants.
        s.grant([&*a as &dyn Domain], 4096, Access::REMOTE_WRITE)
            .unwrap();
        drop(s);
        assert_eq!(a.registrations(), 0);
    }
}
