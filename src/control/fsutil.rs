//! File-system helpers of the control plane: confinement beneath the root,
//! the destination temp file and its resume manifest, digests.
//!
//! Interim: `crate::files` (openat2 confinement, verified commit, parallel
//! hashing) replaces these once it lands; the call sites go through this
//! module only.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::{ControlError, Result};

/// Longest path accepted in a request.
pub const MAX_PATH: usize = 4096;

/// `rel` (a request path; a leading `/` means the root) resolved beneath
/// `root`. Refuses `..`, NUL bytes, over-long paths, and any existing
/// component that is a symlink (nothing is followed out of the root).
pub fn confine(root: &Path, rel: &str) -> Result<PathBuf> {
    if rel.len() > MAX_PATH {
        return Err(ControlError::PathRefused(format!(
            "path of {} bytes is longer than {MAX_PATH}",
            rel.len()
        )));
    }
    if rel.contains('\0') {
        return Err(ControlError::PathRefused("path contains a NUL byte".into()));
    }
    let mut out = root.to_path_buf();
    for c in Path::new(rel).components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => {
                out.push(n);
                if let Ok(m) = std::fs::symlink_metadata(&out) {
                    if m.file_type().is_symlink() {
                        return Err(ControlError::PathRefused(format!(
                            "{rel:?}: component {:?} is a symlink",
                            n
                        )));
                    }
                }
            }
            Component::ParentDir => {
                return Err(ControlError::PathRefused(format!(
                    "{rel:?} escapes the root (contains ..)"
                )))
            }
            Component::Prefix(_) => {
                return Err(ControlError::PathRefused(format!("{rel:?}: bad prefix")))
            }
        }
    }
    Ok(out)
}

/// A single file name (no separators, not `.`/`..`, not empty).
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\0')
        || name.len() > 255
    {
        return Err(ControlError::PathRefused(format!(
            "{name:?} is not a valid file name"
        )));
    }
    Ok(())
}

/// Temp file and manifest beside `dest`.
pub fn temp_paths(dest: &Path) -> (PathBuf, PathBuf) {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = dest.parent().unwrap_or(Path::new("."));
    (
        dir.join(format!(".{name}.rcp-part")),
        dir.join(format!(".{name}.rcp-manifest")),
    )
}

/// Bitmap of blocks (bit i of byte i/8, LSB first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    pub bits: Vec<u8>,
    pub len: u64,
}

impl Bitmap {
    pub fn new(len: u64) -> Self {
        Bitmap {
            bits: vec![0; len.div_ceil(8) as usize],
            len,
        }
    }
    pub fn from_bytes(bits: Vec<u8>, len: u64) -> Option<Self> {
        (bits.len() as u64 == len.div_ceil(8)).then_some(Bitmap { bits, len })
    }
    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.bits[(i / 8) as usize] & (1 << (i % 8)) != 0
    }
    pub fn set(&mut self, i: u64) {
        if i < self.len {
            self.bits[(i / 8) as usize] |= 1 << (i % 8);
        }
    }
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }
    pub fn is_empty_set(&self) -> bool {
        self.count() == 0
    }
}

/// The resume manifest: which blocks of the temp file are verified, for
/// which source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub length: u64,
    pub block_size: u64,
    pub mtime_ns: i64,
    pub done: Bitmap,
}

impl Manifest {
    pub fn load(path: &Path) -> Option<Manifest> {
        let text = std::fs::read_to_string(path).ok()?;
        let mut length = None;
        let mut block_size = None;
        let mut mtime = None;
        let mut bits = None;
        let mut lines = text.lines();
        if lines.next()? != "rcp-manifest 1" {
            return None;
        }
        for l in lines {
            let (k, v) = l.split_once(' ')?;
            match k {
                "length" => length = v.parse().ok(),
                "block_size" => block_size = v.parse().ok(),
                "mtime_ns" => mtime = v.parse().ok(),
                "done" => bits = hex::decode(v).ok(),
                _ => {}
            }
        }
        let (length, block_size): (u64, u64) = (length?, block_size?);
        if block_size == 0 {
            return None;
        }
        let blocks = length.div_ceil(block_size);
        Some(Manifest {
            length,
            block_size,
            mtime_ns: mtime?,
            done: Bitmap::from_bytes(bits?, blocks)?,
        })
    }

    /// Write atomically (temp + rename) and durably.
    pub fn store(&self, path: &Path) -> Result<()> {
        let text = format!(
            "rcp-manifest 1\nlength {}\nblock_size {}\nmtime_ns {}\ndone {}\n",
            self.length,
            self.block_size,
            self.mtime_ns,
            hex::encode(&self.done.bits)
        );
        let tmp = path.with_extension("rcp-manifest-new");
        let f = File::create(&tmp).map_err(ControlError::io("writing the resume manifest"))?;
        f.write_all_at(text.as_bytes(), 0)
            .and_then(|_| f.sync_data())
            .map_err(ControlError::io("writing the resume manifest"))?;
        std::fs::rename(&tmp, path).map_err(ControlError::io("renaming the resume manifest"))
    }
}

/// Whole-file SHA-256 fed with blocks in any order: blocks ahead of the
/// next expected offset are held until the gap fills; data before it (a
/// block sent again) is ignored.
#[derive(Default)]
pub struct OrderedHasher {
    h: Sha256,
    next: u64,
    held: BTreeMap<u64, Vec<u8>>,
}

impl OrderedHasher {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, offset: u64, data: &[u8]) {
        if offset + data.len() as u64 <= self.next {
            return;
        }
        if offset == self.next {
            self.h.update(data);
            self.next += data.len() as u64;
            while let Some(e) = self.held.first_entry() {
                if *e.key() > self.next {
                    break;
                }
                let (o, d) = e.remove_entry();
                if o == self.next {
                    self.h.update(&d);
                    self.next += d.len() as u64;
                }
            }
        } else if offset > self.next {
            self.held.entry(offset).or_insert_with(|| data.to_vec());
        }
    }
    /// Bytes hashed so far (contiguous from 0).
    pub fn position(&self) -> u64 {
        self.next
    }
    pub fn finish(self) -> [u8; 32] {
        self.h.finalize().into()
    }
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// SHA-256 of a whole file (used after a resume, when not every byte passed
/// through this process).
pub fn sha256_file(path: &Path) -> Result<[u8; 32]> {
    let mut f = File::open(path).map_err(ControlError::io(format!("opening {path:?}")))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(ControlError::io(format!("reading {path:?}")))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// A destination being written: `.NAME.rcp-part` beside the final name,
/// locked against a concurrent transfer to the same path.
pub struct Destination {
    pub final_path: PathBuf,
    pub temp_path: PathBuf,
    pub manifest_path: PathBuf,
    pub file: File,
    _lock: nix::fcntl::Flock<File>,
}

impl Destination {
    /// Open (create) the temp file. With `keep`, existing content is kept
    /// (resume); otherwise truncated.
    pub fn open(final_path: &Path, length: u64, keep: bool) -> Result<Destination> {
        let (temp_path, manifest_path) = temp_paths(final_path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&temp_path)
            .map_err(ControlError::io(format!("creating {temp_path:?}")))?;
        // The lock lives as long as the Destination: a transfer that dies
        // releases it with its file handle. Wait a little for one that is
        // still being torn down (a killed client's stream).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let lock = loop {
            let f = file
                .try_clone()
                .map_err(ControlError::io("cloning a file handle"))?;
            match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(l) => break l,
                Err((_, e)) if std::time::Instant::now() >= deadline => {
                    return Err(ControlError::Retryable(format!(
                        "{final_path:?} is being written by another transfer ({e})"
                    )))
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        };
        if !keep {
            file.set_len(0)
                .map_err(ControlError::io("truncating the temp file"))?;
        }
        file.set_len(length)
            .map_err(ControlError::io("sizing the temp file"))?;
        Ok(Destination {
            final_path: final_path.to_path_buf(),
            temp_path,
            manifest_path,
            file,
            _lock: lock,
        })
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(ControlError::io(format!("writing {:?}", self.temp_path)))
    }

    /// fsync, set mode/mtime, rename over the final name, fsync the
    /// directory, remove the manifest.
    pub fn commit(self, mode: Option<u32>, mtime_ns: Option<i64>) -> Result<()> {
        let ctx = |what: &str| ControlError::io(format!("{what} {:?}", self.temp_path));
        if let Some(m) = mode {
            self.file
                .set_permissions(std::fs::Permissions::from_mode(m & 0o7777))
                .map_err(ctx("setting the mode of"))?;
        } else {
            self.file
                .set_permissions(std::fs::Permissions::from_mode(0o644))
                .map_err(ctx("setting the mode of"))?;
        }
        if let Some(t) = mtime_ns {
            let ts = std::time::UNIX_EPOCH
                + std::time::Duration::from_nanos(u64::try_from(t).unwrap_or(0));
            self.file
                .set_modified(ts)
                .map_err(ctx("setting the mtime of"))?;
        }
        self.file.sync_all().map_err(ctx("fsync of"))?;
        std::fs::rename(&self.temp_path, &self.final_path).map_err(ctx("renaming"))?;
        if let Some(dir) = self.final_path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        let _ = std::fs::remove_file(&self.manifest_path);
        Ok(())
    }

    /// Give up: remove the temp file and manifest (not after a resumable
    /// interruption, where they are kept on purpose).
    pub fn discard(self) {
        let _ = std::fs::remove_file(&self.temp_path);
        let _ = std::fs::remove_file(&self.manifest_path);
    }
}

/// mtime of a file in nanoseconds since the epoch.
pub fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

/// Walk `dir` (not following symlinks), returning files relative to it and
/// directories (relative) in creation order.
pub fn walk(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        let mut entries: Vec<_> = std::fs::read_dir(&abs)
            .map_err(ControlError::io(format!("listing {abs:?}")))?
            .collect::<std::io::Result<_>>()
            .map_err(ControlError::io(format!("listing {abs:?}")))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let ft = e
                .file_type()
                .map_err(ControlError::io(format!("stat {:?}", e.path())))?;
            let r = rel.join(e.file_name());
            if ft.is_dir() {
                dirs.push(r.clone());
                stack.push(r);
            } else if ft.is_file() {
                files.push(r);
            }
            // Symlinks and special files are skipped: never followed.
        }
    }
    Ok((files, dirs))
}
