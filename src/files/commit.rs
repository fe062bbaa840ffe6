//! Atomic destination: data goes to a temp file beside the final name and appears
//! under the final name only by `renameat` (or `linkat` of an unnamed one), after
//! the file digest matched and the bytes are on stable storage.
//!
//! Life of a [`Destination`]:
//! 1. [`Destination::create`] (or [`Destination::resume`]) makes
//!    `.rcp-<final>.<random>.part` in the target directory with `O_CREAT|O_EXCL` and
//!    takes an exclusive `flock` on it (so no one else resumes or sweeps it). A file
//!    of at most one block where nothing stands gets an unnamed temp file instead
//!    (`files::unnamed`: `O_TMPFILE`, made with its final mode, no lock). A file of
//!    more than one block is pre-sized (`fallocate`, or `ftruncate` where unsupported;
//!    a full disk fails here, before any byte moves); a file of at most one block is
//!    not (its one `pwrite` sizes it, and fails as early).
//! 2. [`write_block`](Destination::write_block) `pwrite`s a verified block and records
//!    its digest: straight from the caller's buffer, with `O_DIRECT` when the buffer,
//!    offset and length are aligned and the file system allows it, buffered otherwise
//!    (the short last block, a file of one block, tmpfs; [`super::direct`]). With [`DestinationOptions::flat_sha256`] it also feeds the streaming
//!    flat SHA-256 (the `sha256sum` value): out-of-order pieces are held in memory up
//!    to `max_pending_digest_bytes`, beyond that re-read from the temp file (page cache)
//!    when their turn comes. Without it nothing but the block digests is hashed.
//! 3. [`seal`](Destination::seal): every block must be recorded; the file digest
//!    derived from the recorded block digests ([`super::digest::file_digest`]) must
//!    equal the expected one (else the temp file and manifest are removed and
//!    [`FileError::DigestMismatch`] returned); its mode set ([`super::mode`]: with
//!    `-p` the source's, else the replaced file's or the source's masked by the
//!    umask) and, with `-p`, its mtime. No fsync, no rename: the result is a
//!    [`Sealed`] file.
//! 4. [`publish`](super::publish::publish) a batch of sealed files: their data is made durable in as few calls
//!    as possible (one `syncfs` per file system holding several of them, `fdatasync`
//!    for a file alone on its file system), THEN each is renamed over its final name
//!    (an existing file there is replaced only now, atomically; an unnamed one is
//!    linked there, or, when a name came in its way, linked under its temp name and
//!    renamed), THEN each distinct
//!    parent directory is fsynced once, then the manifests are removed.
//!    [`commit`](Destination::commit) is `seal` + `publish` of one.
//! 5. Otherwise [`abort`](Destination::abort) removes temp + manifest;
//!    [`suspend`](Destination::suspend) keeps both for a later resume. Dropping an
//!    unpublished destination (or [`Sealed`]) suspends it if it keeps a manifest,
//!    else aborts it.
//!
//! A manifest is kept only for a resumable file ([`DestinationOptions::resume`]) of
//! more than one block: with at most one block there is nothing to resume (the one
//! block is simply sent again), so such a destination never writes one, and is
//! removed rather than suspended.
//!
//! Invariant: nothing but a complete, digest-verified file whose bytes are on stable
//! storage is ever visible under the final name, and an existing file there is
//! untouched until the final rename. In a batch, a file that fails (digest, rename,
//! sync) is not published and does not keep the others from being published.
//! A process killed with SIGKILL leaves only the `.rcp-…part` (and manifest), which
//! [`Destination::resume`] for the same name either resumes or sweeps; of an
//! unnamed temp file it leaves nothing.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::fs::{self as rfs, AtFlags, FallocateFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::digest::{
    file_digest_with, to_hex, Check, Sha256Digest, StreamingFileDigest, DEFAULT_MAX_PENDING,
};
use super::direct::{DirectWrites, WriteStats};
use super::error::{io_err, DigestError, FileError, Result};
use super::manifest::{block_count, Manifest, SourceId};
use super::partials::{discard, lock_within, manifest_name_for, RESUME_LOCK_WAIT};
use super::path::check_name_os;
use super::reader::IoMode;
use super::root::{list_fd, DirHandle, FileKind, FileMeta, Timestamp};
use super::{temp_name, temp_prefix};
use crate::escape::esc;

/// Default block size when the caller has no opinion (1 MiB): a copy's
/// (`rcp --block-size`, rcpd's answer to a client asking 0) and a
/// [`Destination`]'s alike.
pub const DEFAULT_BLOCK_SIZE: u64 = 1 << 20;

/// `-p`: what to apply to the file before it is renamed into place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preserve {
    /// Permission bits (`& 0o7777`).
    pub mode: u32,
    /// Becomes both atime and mtime, as `scp -p` does.
    pub mtime: Timestamp,
}

/// How a [`Destination`] behaves.
#[derive(Debug, Clone)]
pub struct DestinationOptions {
    /// Block size for [`Destination::write_block`] indices and the manifest bitmap.
    pub block_size: u64,
    /// Mode and mtime to set before the rename (`-p`); `None`: the mode of
    /// [`super::mode::received_mode`] (an existing file's bits kept, a new
    /// file's from [`Self::source_mode`] masked by the umask), mtime = now.
    pub preserve: Option<Preserve>,
    /// Without `-p`: the source's permission bits, which a new file gets
    /// masked by the umask. `None`: `0o666` masked by the umask.
    pub source_mode: Option<u32>,
    /// Enable resume: keep a manifest, and keep the temp file when dropped without
    /// commit. The id is recorded so a later resume only continues the same source.
    /// Files of at most one block keep no manifest all the same (see the module doc).
    pub resume: Option<SourceId>,
    /// The derived file digest if the sender announced it up front (recorded in the
    /// manifest; a resume with a different announced digest is refused).
    pub expected_digest: Option<Sha256Digest>,
    /// How the blocks are checked ([`Check`]): the digests given to
    /// [`Destination::write_block`] are of this check, the derived file
    /// digest is hashed with it, and a resume continues only a copy checked
    /// the same way.
    pub check: Check,
    /// Also compute the flat whole-file SHA-256 (the `sha256sum` value) while the
    /// blocks are written, and return it from [`Destination::seal`] /
    /// [`publish`](super::publish::publish). Off by default: it is a second, serial pass over every byte.
    pub flat_sha256: bool,
    /// Write the manifest after this many newly verified blocks...
    pub manifest_every_blocks: u64,
    /// ...or when this much time has passed since the last write, whichever first.
    pub manifest_interval: Duration,
    /// Out-of-order bytes held in memory for the flat SHA-256 ([`Self::flat_sha256`]).
    pub max_pending_digest_bytes: usize,
    /// Write aligned blocks with `O_DIRECT` where the file system allows it
    /// (on by default; the rule and the fallback in [`super::direct`]).
    pub direct_io: bool,
}

impl Default for DestinationOptions {
    fn default() -> Self {
        DestinationOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            preserve: None,
            source_mode: None,
            resume: None,
            expected_digest: None,
            check: Check::Sha256,
            flat_sha256: false,
            manifest_every_blocks: 64,
            manifest_interval: Duration::from_secs(1),
            max_pending_digest_bytes: DEFAULT_MAX_PENDING,
            direct_io: true,
        }
    }
}

/// A file being received; see the module doc.
pub struct Destination {
    pub(super) dir: DirHandle,
    /// The temp file, buffered: reads, the unaligned writes, syncs.
    pub(super) file: File,
    /// Its `O_DIRECT` twin, for the aligned writes, where allowed.
    direct: DirectWrites,
    pub(super) manifest_name: OsString,
    pub(super) manifest: Manifest,
    opts: DestinationOptions,
    /// The flat SHA-256, with [`DestinationOptions::flat_sha256`] only.
    flat: Option<StreamingFileDigest>,
    /// Written to disk but not yet fed to `flat` (back-pressure or resume): offset -> len.
    deferred: BTreeMap<u64, u64>,
    unsaved: u64,
    last_save: Instant,
    pub(super) finished: bool,
    /// The permission bits of the file at the final name when this
    /// destination was made, if one was there (kept without `-p`).
    existing_mode: Option<u32>,
    /// The temp file has no name (`files::unnamed`): it is linked into
    /// place, and there is nothing to remove when it is given up.
    pub(super) unnamed: bool,
    /// It was created with its final mode: no `fchmod` at seal.
    mode_given: bool,
}

impl std::fmt::Debug for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Destination")
            .field("final", &self.final_path())
            .field("temp", &self.manifest.temp_name)
            .field("len", &self.manifest.len)
            .field("verified_blocks", &self.manifest.blocks.len())
            .finish()
    }
}

/// What [`Destination::seal`] compares.
enum Expect {
    Derived(Sha256Digest),
    Flat(Sha256Digest),
}

fn flat_digest(len: u64, opts: &DestinationOptions) -> Option<StreamingFileDigest> {
    opts.flat_sha256
        .then(|| StreamingFileDigest::new(Some(len), opts.max_pending_digest_bytes))
}

impl Destination {
    /// Start receiving `len` bytes that will become `dir/final_name`.
    pub fn create(
        dir: &DirHandle,
        final_name: impl AsRef<OsStr>,
        len: u64,
        opts: DestinationOptions,
    ) -> Result<Destination> {
        let final_name = final_name.as_ref();
        check_name_os(final_name)?;
        let existing = dir.entry(final_name).ok().flatten();
        Self::create_over(dir, final_name, existing.as_ref(), len, opts)
    }

    /// [`Destination::create`] where the caller has just looked at what
    /// `dir/final_name` is (`existing`, `None`: nothing there), so the
    /// name is not looked up again: a directory there is refused, a
    /// regular file's mode is what a copy without `-p` keeps.
    pub fn create_over(
        dir: &DirHandle,
        final_name: impl AsRef<OsStr>,
        existing: Option<&FileMeta>,
        len: u64,
        opts: DestinationOptions,
    ) -> Result<Destination> {
        let final_name = final_name.as_ref();
        check_name_os(final_name)?;
        if opts.block_size == 0 {
            return Err(FileError::Destination {
                path: dir.display().join(final_name),
                why: "block size is zero",
            });
        }
        let existing_mode = refuse_directory_in(dir, final_name, existing)?;
        let temp = temp_name(final_name, "part");
        let tpath = dir.display().join(&temp);
        let mode = final_mode(&opts, existing_mode);
        // A file of one block where nothing stands is made unnamed
        // (super::unnamed), with its final mode when the umask keeps it.
        let unnamed = (block_count(len, opts.block_size) <= 1 && existing.is_none())
            .then(|| super::unnamed::create(dir.fd(), mode))
            .flatten();
        let mode_given = unnamed.is_some() && mode & (0o7000 | super::mode::process_umask()) == 0;
        let remove = |e: FileError| {
            let _ = rfs::unlinkat(dir.fd(), &temp, AtFlags::empty());
            e
        };
        let (fd, unnamed) = match unnamed {
            Some(fd) => (fd, true),
            None => {
                let fd = rfs::openat(
                    dir.fd(),
                    &temp,
                    OFlags::RDWR
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(super::mode::TEMP_MODE),
                )
                .map_err(|e| io_err("create temp file", &tpath, e))?;
                rfs::flock(&fd, FlockOperation::NonBlockingLockExclusive)
                    .map_err(|e| remove(io_err("lock temp file", &tpath, e)))?;
                (fd, false)
            }
        };
        // One block is one pwrite, which sizes the file (and meets a full disk)
        // as early as fallocate would: spare small files the call. On tmpfs
        // fallocate would allocate and zero every page before the writes
        // copy over them (an eighth of a copy's CPU, measured): there the
        // free space is checked instead and the file sized sparse.
        if block_count(len, opts.block_size) > 1 && super::direct::memory_backed(&fd) {
            let free = rfs::fstatvfs(&fd)
                .map(|v| v.f_bavail.saturating_mul(v.f_frsize))
                .map_err(|e| remove(io_err("statvfs", &tpath, e)))?;
            if free < len {
                let e = std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!("{len} bytes needed, {free} free"),
                );
                return Err(remove(io_err("reserve space for", &tpath, e)));
            }
            rfs::ftruncate(&fd, len).map_err(|e| remove(io_err("ftruncate", &tpath, e)))?;
        } else if block_count(len, opts.block_size) > 1 {
            match rfs::fallocate(&fd, FallocateFlags::empty(), 0, len) {
                Ok(()) => {}
                Err(Errno::OPNOTSUPP | Errno::NOSYS) => {
                    rfs::ftruncate(&fd, len).map_err(|e| remove(io_err("ftruncate", &tpath, e)))?
                }
                Err(e) => return Err(remove(io_err("fallocate", &tpath, e))),
            }
        }
        let manifest = Manifest {
            final_name: final_name.to_owned(),
            temp_name: temp.clone(),
            len,
            block_size: opts.block_size,
            source: opts.resume.unwrap_or(SourceId {
                len,
                mtime: Timestamp::default(),
                fingerprint: [0; 32],
            }),
            expected_digest: opts.expected_digest,
            check: opts.check,
            blocks: BTreeMap::new(),
        };
        if block_count(len, opts.block_size) > 1 && opts.resume.is_some() {
            // A copy that could leave a partial replaces what an earlier,
            // interrupted one of the name left (rather than leave another).
            super::partials::sweep_name(dir, final_name, &temp);
        }
        let mut d = Destination {
            dir: dir.clone(),
            file: File::from(fd),
            direct: DirectWrites::new(opts.direct_io),
            manifest_name: manifest_name_for(&temp),
            manifest,
            flat: flat_digest(len, &opts),
            opts,
            deferred: BTreeMap::new(),
            unsaved: 0,
            last_save: Instant::now(),
            finished: false,
            existing_mode,
            unnamed,
            mode_given,
        };
        if d.keeps_manifest() {
            // From now on a crash leaves a manifest next to the temp file.
            if let Err(e) = d.save_manifest() {
                d.abort();
                return Err(e);
            }
        }
        Ok(d)
    }

    /// Look for an interrupted copy of the same source to `dir/final_name`.
    ///
    /// Every `.rcp-<final>.*.part.manifest` is loaded and checked: final name, temp
    /// name, source id, length, block size and announced digest must match
    /// `source`/`opts`, the temp file must exist with the right length and not be
    /// locked by a live transfer. Each verified block is re-read from the temp file and
    /// its digest checked (a block that does not match is dropped and will be sent
    /// again); the whole-file digest is rebuilt from them. Manifests that fail any
    /// check are discarded (temp and manifest removed, with a warning), as are
    /// unlocked `.part` files of this name that have no manifest.
    ///
    /// Returns the resumed destination; [`missing_blocks`](Self::missing_blocks)
    /// says what the sender still has to send. `Ok(None)`: start afresh with
    /// [`create`](Self::create). A file of at most one block is never resumed (it
    /// keeps no manifest; its bare `.part`, if any, is swept).
    pub fn resume(
        dir: &DirHandle,
        final_name: impl AsRef<OsStr>,
        source: &SourceId,
        opts: DestinationOptions,
    ) -> Result<Option<Destination>> {
        let final_name = final_name.as_ref();
        check_name_os(final_name)?;
        let opts = DestinationOptions {
            resume: Some(*source),
            ..opts
        };
        let prefix = temp_prefix(final_name);
        let entries = list_fd(dir.fd_owned(), dir.display())?;
        let mut found = None;
        let mut manifests = Vec::new();
        for e in &entries {
            let n = e.name.as_bytes();
            if n.starts_with(&prefix) && n.ends_with(b".part.manifest") {
                manifests.push(e.name.clone());
            }
        }
        for mname in &manifests {
            let temp = OsStr::from_bytes(&mname.as_bytes()[..mname.len() - ".manifest".len()]);
            found = Self::resume_from(dir, final_name, mname, temp, source, &opts)?;
            if found.is_some() {
                break;
            }
        }
        // Sweep leftovers of this name: temp files with no manifest, not in use
        // (the resumed one is locked by us, so `discard` leaves it alone anyway).
        for e in &entries {
            let n = e.name.as_bytes();
            if n.starts_with(&prefix)
                && n.ends_with(b".part")
                && !manifests.iter().any(|m| m.as_bytes().starts_with(n))
            {
                discard(dir, &e.name, &manifest_name_for(&e.name));
            }
        }
        Ok(found)
    }

    /// Resume from the manifest `mname` of temp file `temp`, if it is
    /// `final_name`'s. `Ok(None)`: not this one (another name sharing the
    /// truncated prefix, or locked by a live transfer), or discarded
    /// (unusable, stale, or its temp file missing or wrong).
    fn resume_from(
        dir: &DirHandle,
        final_name: &OsStr,
        mname: &OsStr,
        temp: &OsStr,
        source: &SourceId,
        opts: &DestinationOptions,
    ) -> Result<Option<Destination>> {
        let m = match Manifest::load(dir, mname) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %esc(&e), "discarding unusable resume manifest");
                discard(dir, temp, mname);
                return Ok(None);
            }
        };
        if m.final_name != final_name {
            return Ok(None); // a different long name sharing the truncated prefix
        }
        if let Some(why) = stale(&m, temp, source, opts) {
            tracing::warn!(manifest = %esc(dir.display().join(mname).display()), why,
                "discarding stale resume manifest");
            discard(dir, temp, mname);
            return Ok(None);
        }
        let tpath = dir.display().join(temp);
        let fd = match rfs::openat(
            dir.fd(),
            temp,
            OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(temp = %esc(tpath.display()), error = %e,
                    "resume manifest without its temp file; discarding");
                discard(dir, temp, mname);
                return Ok(None);
            }
        };
        // A transfer that was just interrupted may still be finishing
        // its last write and saving its manifest: give it a moment, then
        // take the manifest as it left it.
        let waited = match lock_within(&fd, RESUME_LOCK_WAIT) {
            Ok(waited) => waited,
            Err(e) => {
                tracing::info!(temp = %esc(tpath.display()), error = %e,
                    "temp file is locked by a live transfer; not resuming it");
                return Ok(None);
            }
        };
        // Only the transfer that created this (randomly named) temp file
        // writes its manifest, so what moved on is the set of blocks.
        let mut m = m;
        if waited {
            if let Ok(newer) = Manifest::load(dir, mname) {
                m.blocks = newer.blocks;
            }
        }
        let st = rfs::fstat(&fd).map_err(|e| io_err("stat", &tpath, e))?;
        if st.st_nlink == 0 {
            // Removed while we waited for its lock (rcpd's --partial-ttl
            // sweep, or another copy's discard): start afresh.
            tracing::info!(temp = %esc(tpath.display()), "temp file was swept meanwhile; starting afresh");
            return Ok(None);
        }
        #[allow(clippy::unnecessary_cast)]
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
            || st.st_size as u64 != m.len
        {
            tracing::warn!(temp = %esc(tpath.display()), "temp file has the wrong type or length; discarding");
            drop(fd);
            discard(dir, temp, mname);
            return Ok(None);
        }
        Self::resumed(dir, File::from(fd), mname, m, opts).map(Some)
    }

    /// The destination of a checked manifest `m` over its locked temp
    /// `file`: verified blocks re-read and checked, the manifest saved
    /// again.
    fn resumed(
        dir: &DirHandle,
        file: File,
        mname: &OsStr,
        m: Manifest,
        opts: &DestinationOptions,
    ) -> Result<Destination> {
        let mut opts = opts.clone();
        if opts.expected_digest.is_none() {
            opts.expected_digest = m.expected_digest;
        }
        let mut d = Destination {
            dir: dir.clone(),
            file,
            direct: DirectWrites::new(opts.direct_io),
            manifest_name: mname.to_os_string(),
            flat: flat_digest(m.len, &opts),
            manifest: Manifest {
                blocks: BTreeMap::new(),
                ..m.clone()
            },
            opts: opts.clone(),
            deferred: BTreeMap::new(),
            unsaved: 0,
            last_save: Instant::now(),
            finished: false,
            existing_mode: refuse_directory(dir, &m.final_name)?,
            unnamed: false,
            mode_given: false,
        };
        d.rebuild(&m.blocks)?;
        if d.keeps_manifest() {
            d.save_manifest()?;
        } else {
            // Left by an older rcp: a one-block file keeps no manifest now.
            let _ = rfs::unlinkat(dir.fd(), mname, AtFlags::empty());
        }
        Ok(d)
    }

    /// Re-read verified blocks from the temp file, check their digests (and feed the
    /// flat SHA-256, if enabled).
    fn rebuild(&mut self, blocks: &BTreeMap<u64, Sha256Digest>) -> Result<()> {
        let bs = self.manifest.block_size;
        let mut buf = vec![0u8; bs as usize];
        for (&i, &want) in blocks {
            let (off, n) = (i * bs, self.block_len(i));
            let b = &mut buf[..n as usize];
            self.file
                .read_exact_at(b, off)
                .map_err(|e| io_err("read temp file", self.temp_path(), e))?;
            if self.manifest.check.block(b) != want {
                tracing::warn!(temp = %esc(self.temp_path().display()), block = i,
                    "resumed block does not match its recorded digest; will be sent again");
                continue;
            }
            self.manifest.blocks.insert(i, want);
            if let Some(flat) = &mut self.flat {
                if off == flat.next_offset() {
                    flat.update(off, b)?;
                } else {
                    self.deferred.insert(off, n);
                }
            }
        }
        Ok(())
    }

    /// Whether this destination keeps a resume manifest: resume is enabled and the
    /// file has more than one block.
    pub fn keeps_manifest(&self) -> bool {
        self.opts.resume.is_some() && self.block_count() > 1
    }

    /// Total length of the file being received.
    pub fn len(&self) -> u64 {
        self.manifest.len
    }
    pub fn is_empty(&self) -> bool {
        self.manifest.len == 0
    }
    pub fn block_size(&self) -> u64 {
        self.manifest.block_size
    }
    pub fn block_count(&self) -> u64 {
        self.manifest.block_count()
    }
    /// Length of block `index` (the last one may be short).
    pub fn block_len(&self, index: u64) -> u64 {
        let bs = self.manifest.block_size;
        bs.min(self.manifest.len.saturating_sub(index * bs))
    }
    /// Blocks not yet recorded by [`write_block`](Self::write_block), ascending.
    pub fn missing_blocks(&self) -> Vec<u64> {
        self.manifest.missing_blocks()
    }
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    pub fn final_path(&self) -> PathBuf {
        self.dir.display().join(&self.manifest.final_name)
    }
    pub fn temp_path(&self) -> PathBuf {
        self.dir.display().join(&self.manifest.temp_name)
    }
    /// The temp file opened again, read-only (a fan-out forwards from it
    /// what is verified): an open of its own, not a dup, so that it does
    /// not hold the temp file's lock (a resume must take it once this
    /// copy ends).
    pub fn temp_reader(&self) -> Result<File> {
        let path = self.temp_path();
        if self.unnamed {
            // No name to open, and no lock to keep clear of.
            return self.file.try_clone().map_err(|e| io_err("dup", &path, e));
        }
        let fd = rfs::openat(
            self.dir.fd(),
            &self.manifest.temp_name,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        )
        .map_err(|e| io_err("open", &path, e))?;
        let (a, b) = (
            rfs::fstat(&fd).map_err(|e| io_err("stat", &path, e))?,
            rfs::fstat(&self.file).map_err(|e| io_err("stat", &path, e))?,
        );
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
            return Err(FileError::Destination {
                path,
                why: "its temp file was replaced",
            });
        }
        Ok(File::from(fd))
    }
    /// Bytes hashed so far into the flat SHA-256 (contiguous from 0); `None` without
    /// [`DestinationOptions::flat_sha256`].
    pub fn digested_up_to(&self) -> Option<u64> {
        self.flat.as_ref().map(StreamingFileDigest::next_offset)
    }
    /// The derived file digest of the recorded blocks, once every block is recorded.
    pub fn derived_digest(&self) -> Option<Sha256Digest> {
        (self.manifest.blocks.len() as u64 == self.block_count()).then(|| {
            file_digest_with(
                self.manifest.check,
                self.len(),
                self.block_size(),
                self.manifest.blocks.values(),
            )
        })
    }

    /// How the blocks written so far went to disk.
    pub fn write_stats(&self) -> WriteStats {
        self.direct.stats()
    }
    /// The path an aligned block takes now: [`IoMode::Direct`] once the
    /// first aligned block of a file of more than one block found the file
    /// system willing (see [`super::direct`]), else [`IoMode::Buffered`].
    pub fn write_mode(&self) -> IoMode {
        self.direct.mode()
    }
    /// Why aligned blocks are not written with `O_DIRECT`, once that was
    /// decided.
    pub fn direct_unavailable(&self) -> Option<&str> {
        self.direct.unavailable()
    }

    /// Write a received, verified block. `digest` is its digest under the
    /// destination's [`Check`] (already checked
    /// by the caller against the sender's). Duplicates of a recorded block are
    /// ignored. Recorded in the manifest (saved at the configured rate).
    pub fn write_block(&mut self, index: u64, data: &[u8], digest: Sha256Digest) -> Result<()> {
        self.check_block(index, data)?;
        debug_assert_eq!(
            self.manifest.check.block(data),
            digest,
            "write_block: digest is not of data"
        );
        if self.manifest.blocks.contains_key(&index) {
            tracing::debug!(block = index, "duplicate block ignored");
            return Ok(());
        }
        let n = self.block_count();
        let offset = index * self.block_size();
        // A file of one block is one buffered pwrite: no second fd for it.
        let mode = if n > 1 {
            self.direct.write_all_at(
                &self.dir,
                &self.manifest.temp_name,
                &self.file,
                data,
                offset,
            )
        } else {
            self.direct.write_buffered(&self.file, data, offset)
        }
        .map_err(|e| io_err("write", self.temp_path(), e))?;
        if n > 1 && mode == IoMode::Buffered {
            self.start_writeback(offset, data.len() as u64);
        }
        self.record(index, Some(data), digest)
    }

    /// A block of `data` fits block `index`: in range, of its length.
    fn check_block(&self, index: u64, data: &[u8]) -> Result<()> {
        if index >= self.block_count() {
            return Err(FileError::OutOfRange {
                path: self.temp_path(),
                offset: index.saturating_mul(self.block_size()),
                len: data.len() as u64,
                file_len: self.len(),
            });
        }
        let want = self.block_len(index);
        if data.len() as u64 != want {
            return Err(FileError::BadBlock {
                path: self.temp_path(),
                index,
                got: data.len() as u64,
                expected: want,
            });
        }
        Ok(())
    }

    /// Start writeback of what was just written (DONTNEED on dirty pages
    /// queues them for writing without waiting, and drops nothing dirty),
    /// so the disk works while the copy goes on and the sync at publish
    /// waits for the tail, not the whole file. Advice only: an error here
    /// changes nothing but speed. (A one-block file is all tail: the sync
    /// at publish starts it.)
    fn start_writeback(&self, offset: u64, len: u64) {
        let _ = rfs::fadvise(
            &self.file,
            offset,
            std::num::NonZeroU64::new(len),
            rfs::Advice::DontNeed,
        );
    }

    /// Write block `index` (`data`, its bytes) into the temp file without
    /// recording it, from any thread: several blocks are written at once
    /// this way (buffered), then each recorded with
    /// [`record_written`](Self::record_written). A block already recorded
    /// is left as it is.
    pub fn write_unrecorded(&self, index: u64, data: &[u8]) -> Result<()> {
        self.check_block(index, data)?;
        if self.manifest.blocks.contains_key(&index) {
            return Ok(());
        }
        let offset = index * self.block_size();
        self.file
            .write_all_at(data, offset)
            .map_err(|e| io_err("write", self.temp_path(), e))?;
        if self.block_count() > 1 {
            self.start_writeback(offset, data.len() as u64);
        }
        Ok(())
    }

    /// Record block `index`, whose bytes [`write_unrecorded`](Self::write_unrecorded)
    /// wrote and whose digest under the destination's [`Check`] is
    /// `digest`, as [`write_block`](Self::write_block) records a block.
    pub fn record_written(&mut self, index: u64, digest: Sha256Digest) -> Result<()> {
        if index >= self.block_count() {
            return Err(FileError::OutOfRange {
                path: self.temp_path(),
                offset: index.saturating_mul(self.block_size()),
                len: 0,
                file_len: self.len(),
            });
        }
        if self.manifest.blocks.contains_key(&index) {
            return Ok(());
        }
        self.record(index, None, digest)
    }

    /// Record block `index` in the manifest (saved at the configured rate)
    /// and feed the flat SHA-256 its bytes (`data`, or read back from the
    /// temp file when `None` or not yet its turn).
    fn record(&mut self, index: u64, data: Option<&[u8]>, digest: Sha256Digest) -> Result<()> {
        let offset = index * self.block_size();
        let want = self.block_len(index);
        if let Some(flat) = &mut self.flat {
            match data.map(|d| flat.update(offset, d)) {
                Some(Ok(())) => {}
                Some(Err(DigestError::Backpressure { .. })) | None => {
                    self.deferred.insert(offset, want);
                }
                Some(Err(e)) => return Err(e.into()),
            }
            self.drain_deferred()?;
        }
        self.manifest.blocks.insert(index, digest);
        self.unsaved += 1;
        if self.keeps_manifest()
            && (self.unsaved >= self.opts.manifest_every_blocks
                || self.last_save.elapsed() >= self.opts.manifest_interval)
        {
            self.save_manifest()?;
        }
        Ok(())
    }

    /// Feed the flat SHA-256 the pieces kept on disk whose turn has come.
    fn drain_deferred(&mut self) -> Result<()> {
        let Some(flat) = &mut self.flat else {
            return Ok(());
        };
        let mut buf = Vec::new();
        while let Some((&off, &n)) = self.deferred.first_key_value() {
            if off != flat.next_offset() {
                break;
            }
            self.deferred.remove(&off);
            buf.resize(n as usize, 0);
            self.file.read_exact_at(&mut buf, off).map_err(|e| {
                io_err(
                    "read temp file",
                    self.dir.display().join(&self.manifest.temp_name),
                    e,
                )
            })?;
            flat.update(off, &buf)?;
        }
        Ok(())
    }

    /// Make the recorded blocks durable, then atomically rewrite the manifest.
    fn save_manifest(&mut self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| io_err("fdatasync", self.temp_path(), e))?;
        self.manifest.save(&self.dir, &self.manifest_name)?;
        self.unsaved = 0;
        self.last_save = Instant::now();
        Ok(())
    }

    /// Verify without publishing: every block recorded, the file digest derived from
    /// the recorded block digests equal to `expected`, `-p` applied. No fsync, no
    /// rename: [`publish`](super::publish::publish) does those, for many files at once. On a digest mismatch
    /// the temp file (and manifest) is removed; on other errors the destination is
    /// dropped (kept for resume if it keeps a manifest, else removed).
    pub fn seal(self, expected: Sha256Digest) -> Result<Sealed> {
        self.seal_checked(Expect::Derived(expected))
    }

    /// [`seal`](Self::seal), for a caller that knows only the flat whole-file SHA-256
    /// (the `sha256sum` value): that is what is compared with `expected_flat` (needs
    /// [`DestinationOptions::flat_sha256`]). The blocks were each checked against the
    /// sender's digests as they arrived ([`write_block`](Self::write_block)).
    pub fn seal_flat(self, expected_flat: Sha256Digest) -> Result<Sealed> {
        self.seal_checked(Expect::Flat(expected_flat))
    }

    fn seal_checked(mut self, expect: Expect) -> Result<Sealed> {
        if let Some(first) = (0..self.block_count()).find(|i| !self.manifest.blocks.contains_key(i))
        {
            return Err(FileError::Incomplete {
                path: self.final_path(),
                missing_from: first * self.block_size(),
                len: self.len(),
            });
        }
        let derived = file_digest_with(
            self.manifest.check,
            self.len(),
            self.block_size(),
            self.manifest.blocks.values(),
        );
        self.drain_deferred()?;
        let flat = self
            .flat
            .take()
            .map(StreamingFileDigest::finish)
            .transpose()?;
        let (what, expected, actual) = match expect {
            Expect::Derived(e) => ("derived file digest", e, derived),
            Expect::Flat(e) => match flat {
                Some(f) => ("whole-file SHA-256", e, f),
                None => return Err(FileError::Destination {
                    path: self.final_path(),
                    why:
                        "the flat SHA-256 was not computed (DestinationOptions::flat_sha256 is off)",
                }),
            },
        };
        if actual != expected {
            let path = self.final_path();
            self.abort();
            return Err(FileError::DigestMismatch {
                path,
                what,
                expected: to_hex(&expected),
                actual: to_hex(&actual),
            });
        }
        self.set_mode()?;
        if let Some(p) = self.opts.preserve {
            let tpath = self.temp_path();
            let ts = rustix::fs::Timespec {
                tv_sec: p.mtime.sec,
                tv_nsec: p.mtime.nsec.into(),
            };
            rfs::futimens(
                &self.file,
                &rfs::Timestamps {
                    last_access: ts,
                    last_modification: ts,
                },
            )
            .map_err(|e| io_err("futimens", &tpath, e))?;
        }
        Ok(Sealed {
            dest: self,
            derived,
            flat,
        })
    }

    /// Give the temp file its final mode: the source's with `-p`, else
    /// [`super::mode::received_mode`]'s. (Durable with the data: a lone
    /// file's `fdatasync` may leave a mode change behind after a crash, and
    /// then the file keeps the temp's `0600`, never anything wider.)
    fn set_mode(&self) -> Result<()> {
        if self.mode_given {
            return Ok(());
        }
        let mode = final_mode(&self.opts, self.existing_mode);
        rfs::fchmod(&self.file, Mode::from_raw_mode(mode))
            .map_err(|e| io_err("chmod", self.temp_path(), e))
    }

    /// [`seal`](Self::seal) and [`publish`](super::publish::publish) this one file.
    pub fn commit(self, expected: Sha256Digest) -> Result<Published> {
        self.seal(expected)?.publish()
    }

    /// [`seal_flat`](Self::seal_flat) and [`publish`](super::publish::publish) this one file. On success the
    /// [`Published::flat_sha256`] is always `Some` (and equal to `expected_flat`).
    pub fn commit_flat(self, expected_flat: Sha256Digest) -> Result<Published> {
        self.seal_flat(expected_flat)?.publish()
    }

    /// Make this file's data durable on its own: `fdatasync`, or `fsync` when `-p`
    /// changed its mode and times.
    pub(super) fn sync_file(&self) -> Result<()> {
        let r = if self.opts.preserve.is_some() {
            self.file.sync_all()
        } else {
            self.file.sync_data()
        };
        r.map_err(|e| io_err("fdatasync", self.temp_path(), e))
    }

    /// Give up: remove the temp file and its manifest.
    pub fn abort(mut self) {
        self.remove_files();
    }

    fn remove_files(&mut self) {
        self.finished = true;
        if self.unnamed {
            return; // freed with its fd
        }
        let _ = rfs::unlinkat(self.dir.fd(), &self.manifest.temp_name, AtFlags::empty());
        if self.keeps_manifest() {
            let _ = rfs::unlinkat(self.dir.fd(), &self.manifest_name, AtFlags::empty());
        }
    }

    /// Stop for now, keeping temp file and an up-to-date manifest for
    /// [`resume`](Self::resume). For a destination that keeps no manifest (resume
    /// off, or at most one block) this is [`abort`](Self::abort).
    pub fn suspend(mut self) -> Result<()> {
        if !self.keeps_manifest() {
            self.remove_files();
            return Ok(());
        }
        let r = self.save_manifest();
        self.finished = true;
        r
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if self.keeps_manifest() {
            if let Err(e) = self.save_manifest() {
                tracing::warn!(error = %esc(&e), "could not save resume manifest on drop");
            }
        } else {
            self.remove_files();
        }
    }
}

/// A verified file waiting to be published: every block present, its digest
/// matched, `-p` applied, still under its temp name. Give it to [`publish`](super::publish::publish) (with
/// others). Dropped unpublished, it is kept for resume if it keeps a manifest
/// ([`Destination::keeps_manifest`]), else removed, as a [`Destination`] is.
#[derive(Debug)]
pub struct Sealed {
    pub(super) dest: Destination,
    pub(super) derived: Sha256Digest,
    pub(super) flat: Option<Sha256Digest>,
}

impl Sealed {
    pub fn final_path(&self) -> PathBuf {
        self.dest.final_path()
    }
    pub fn temp_path(&self) -> PathBuf {
        self.dest.temp_path()
    }
    pub fn len(&self) -> u64 {
        self.dest.len()
    }
    pub fn is_empty(&self) -> bool {
        self.dest.is_empty()
    }
    /// The derived file digest (it matched the expected one).
    pub fn derived_digest(&self) -> Sha256Digest {
        self.derived
    }
    /// The flat whole-file SHA-256, with [`DestinationOptions::flat_sha256`].
    pub fn flat_sha256(&self) -> Option<Sha256Digest> {
        self.flat
    }
    /// Give up: remove the temp file and its manifest.
    pub fn abort(self) {
        self.dest.abort()
    }
    pub(super) fn published(&self) -> Published {
        Published {
            path: self.final_path(),
            len: self.len(),
            derived_digest: self.derived,
            flat_sha256: self.flat,
        }
    }
}

/// A file now under its final name, durably.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The final path (directory as shown in messages + final name).
    pub path: PathBuf,
    pub len: u64,
    /// The derived file digest ([`super::digest::file_digest`]).
    pub derived_digest: Sha256Digest,
    /// The flat whole-file SHA-256, with [`DestinationOptions::flat_sha256`].
    pub flat_sha256: Option<Sha256Digest>,
}

/// Why manifest `m` (of temp `temp`) cannot resume `source` under `opts`,
/// if it cannot.
fn stale(
    m: &Manifest,
    temp: &OsStr,
    source: &SourceId,
    opts: &DestinationOptions,
) -> Option<&'static str> {
    if m.temp_name != temp {
        Some("it names a different temp file")
    } else if m.source != *source {
        Some("the source changed (size, mtime or fingerprint)")
    } else if m.len != source.len {
        Some("length differs from the source")
    } else if m.block_size != opts.block_size {
        Some("block size differs")
    } else if opts.expected_digest.is_some() && m.expected_digest != opts.expected_digest {
        Some("the announced whole-file digest differs")
    } else if m.check != opts.check {
        // Never mixed: blocks checked one way under a file digest of
        // another would prove nothing.
        Some("it was checked with another --verify; starting afresh")
    } else {
        None
    }
}

/// The permission bits a received file ends with: the source's with `-p`,
/// else [`super::mode::received_mode`]'s.
fn final_mode(opts: &DestinationOptions, existing_mode: Option<u32>) -> u32 {
    match opts.preserve {
        Some(p) => p.mode & 0o7777,
        None => super::mode::received_mode(
            existing_mode,
            opts.source_mode,
            super::mode::process_umask(),
        ),
    }
}

/// Refuse early when the final name is an existing directory; else the
/// permission bits of the regular file standing there, if one does.
/// Any other answer (nothing there, something else, a failed look) is left
/// to the create and the rename, which meet it themselves.
fn refuse_directory(dir: &DirHandle, name: &OsStr) -> Result<Option<u32>> {
    let existing = dir.entry(name).ok().flatten();
    refuse_directory_in(dir, name, existing.as_ref())
}

/// A directory at `dir/name` (`existing`) refused; a regular file's mode.
fn refuse_directory_in(
    dir: &DirHandle,
    name: &OsStr,
    existing: Option<&FileMeta>,
) -> Result<Option<u32>> {
    match existing {
        Some(m) if m.kind == FileKind::Dir => Err(FileError::IsADirectory {
            path: dir.display().join(name),
        }),
        Some(m) if m.kind == FileKind::File => Ok(Some(m.mode)),
        _ => Ok(None),
    }
}
