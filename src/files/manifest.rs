//! Resume manifests: which blocks of a temp file are already written and verified.
//!
//! A manifest lives beside its temp file, named `<temp>.manifest`
//! (`.rcp-<final>.<random>.part.manifest`). It records the format version, final
//! and temp names, total length, block size, the [`SourceId`] of what is being
//! copied, the derived file digest the sender announced (if any), and a bitmap of
//! verified blocks with their SHA-256. It is always replaced atomically (write
//! `<manifest>.tmp`, fsync, rename) and ends with a SHA-256 of its own bytes, so a
//! torn or corrupted manifest is detected ([`ManifestError::Checksum`]) and never
//! trusted. [`super::commit::Destination`] writes it after `fdatasync` of the temp
//! file, so every block it lists is on disk.
//!
//! Binary layout (little endian), version 2:
//! `"RCPMANIF" u32:version u8:check u32:n final_name u32:n temp_name u64:len
//!  u64:block_size u64:src.len i64:src.mtime.sec u32:src.mtime.nsec
//!  [32]:src.fingerprint u8:has_expected [32]:expected u64:block_count
//!  [ceil(block_count/8)]:bitmap [32]*popcount:digests-in-index-order
//!  [32]:sha256(all preceding bytes)`. `check` is the [`Check`] the digests
//! are of (digests shorter than 32 bytes are zero-padded). Version 1 had no
//! `check` byte: its digests are SHA-256.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::fs::{self as rfs, Mode, OFlags};
use sha2::{Digest, Sha256};

use super::digest::{Check, Sha256Digest};
use super::error::{io_err, FileError, ManifestError, Result};
use super::path::{check_name_os, MAX_NAME};
use super::root::{DirHandle, Timestamp};

const MAGIC: &[u8; 8] = b"RCPMANIF";
/// Current manifest format version.
pub const VERSION: u32 = 2;

/// What identifies the source of a copy, so a resume never mixes two different
/// files: length, mtime, and a fingerprint (by default the SHA-256 of the first
/// 64 KiB, see [`super::reader::SourceFile::source_id`]; or any caller-given id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceId {
    pub len: u64,
    pub mtime: Timestamp,
    pub fingerprint: [u8; 32],
}

/// The resume state of one destination file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub final_name: OsString,
    pub temp_name: OsString,
    pub len: u64,
    pub block_size: u64,
    pub source: SourceId,
    /// The derived file digest announced by the sender ([`super::digest::file_digest`]).
    pub expected_digest: Option<Sha256Digest>,
    /// What the block digests are: a resume continues only a copy checked
    /// the same way.
    pub check: Check,
    /// Verified blocks: index -> digest of the block.
    pub blocks: BTreeMap<u64, Sha256Digest>,
}

/// Number of blocks of a `len`-byte file cut in `block_size` blocks.
pub fn block_count(len: u64, block_size: u64) -> u64 {
    len.div_ceil(block_size)
}

impl Manifest {
    pub fn block_count(&self) -> u64 {
        block_count(self.len, self.block_size)
    }

    /// Indices of blocks not yet verified, ascending: what the sender must still send.
    pub fn missing_blocks(&self) -> Vec<u64> {
        (0..self.block_count())
            .filter(|i| !self.blocks.contains_key(i))
            .collect()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(128 + self.blocks.len() * 32);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.check.id());
        for name in [&self.final_name, &self.temp_name] {
            b.extend_from_slice(&(name.len() as u32).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
        }
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&self.block_size.to_le_bytes());
        b.extend_from_slice(&self.source.len.to_le_bytes());
        b.extend_from_slice(&self.source.mtime.sec.to_le_bytes());
        b.extend_from_slice(&self.source.mtime.nsec.to_le_bytes());
        b.extend_from_slice(&self.source.fingerprint);
        b.push(self.expected_digest.is_some() as u8);
        b.extend_from_slice(&self.expected_digest.unwrap_or([0; 32]));
        let n = self.block_count();
        b.extend_from_slice(&n.to_le_bytes());
        let mut bitmap = vec![0u8; n.div_ceil(8) as usize];
        for &i in self.blocks.keys() {
            bitmap[(i / 8) as usize] |= 1 << (i % 8);
        }
        b.extend_from_slice(&bitmap);
        for d in self.blocks.values() {
            b.extend_from_slice(d);
        }
        let sum: [u8; 32] = Sha256::digest(&b).into();
        b.extend_from_slice(&sum);
        b
    }

    pub fn decode(bytes: &[u8]) -> std::result::Result<Manifest, ManifestError> {
        use ManifestError::*;
        if bytes.len() < MAGIC.len() || &bytes[..8] != MAGIC {
            return Err(BadMagic);
        }
        if bytes.len() < 12 + 32 {
            return Err(Truncated);
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if version != VERSION && version != 1 {
            return Err(UnsupportedVersion(version));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 32);
        if Sha256::digest(body).as_slice() != sum {
            return Err(Checksum);
        }
        let mut c = Cursor(&body[12..]);
        let check = match version {
            1 => Check::Sha256,
            _ => Check::from_id(c.take(1)?[0]).ok_or(Invalid("unknown check"))?,
        };
        let name = |c: &mut Cursor| -> std::result::Result<OsString, ManifestError> {
            let n = c.u32()? as usize;
            if n > MAX_NAME {
                return Err(Invalid("name longer than 255 bytes"));
            }
            let s = OsString::from_vec(c.take(n)?.to_vec());
            check_name_os(&s).map_err(|_| Invalid("bad file name"))?;
            Ok(s)
        };
        let final_name = name(&mut c)?;
        let temp_name = name(&mut c)?;
        let len = c.u64()?;
        let block_size = c.u64()?;
        let source = SourceId {
            len: c.u64()?,
            mtime: Timestamp {
                sec: c.u64()? as i64,
                nsec: c.u32()?,
            },
            fingerprint: c.take(32)?.try_into().unwrap(),
        };
        let has_expected = c.take(1)?[0];
        let expected: Sha256Digest = c.take(32)?.try_into().unwrap();
        let expected_digest = match has_expected {
            0 => None,
            1 => Some(expected),
            _ => return Err(Invalid("bad expected-digest flag")),
        };
        if block_size == 0 {
            return Err(Invalid("block size is zero"));
        }
        let n = c.u64()?;
        if n != block_count(len, block_size) {
            return Err(Invalid("block count does not match length and block size"));
        }
        let bitmap = c.take(n.div_ceil(8) as usize)?;
        let mut blocks = BTreeMap::new();
        for i in 0..n {
            if bitmap[(i / 8) as usize] & (1 << (i % 8)) != 0 {
                blocks.insert(i, c.take(32)?.try_into().unwrap());
            }
        }
        if n % 8 != 0 && bitmap.last().is_some_and(|&l| l >> (n % 8) != 0) {
            return Err(Invalid("bitmap has bits past the last block"));
        }
        if !c.0.is_empty() {
            return Err(Invalid("trailing bytes"));
        }
        Ok(Manifest {
            final_name,
            temp_name,
            len,
            block_size,
            source,
            expected_digest,
            check,
            blocks,
        })
    }

    /// Read and validate manifest `name` in `dir` (not following symlinks).
    pub fn load(dir: &DirHandle, name: &OsStr) -> Result<Manifest> {
        let path = dir.display().join(name);
        let fd = rfs::openat(
            dir.fd(),
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("open manifest", &path, e))?;
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut File::from(fd), &mut bytes)
            .map_err(|e| io_err("read manifest", &path, e))?;
        Manifest::decode(&bytes).map_err(|source| FileError::Manifest { path, source })
    }

    /// Atomically replace manifest `name` in `dir` with this one.
    pub fn save(&self, dir: &DirHandle, name: &OsStr) -> Result<()> {
        let mut tmp = name.to_owned();
        tmp.push(".tmp");
        let path = dir.display().join(name);
        let fd = rfs::openat(
            dir.fd(),
            &tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err("create manifest", &path, e))?;
        let mut f = File::from(fd);
        let r = f
            .write_all(&self.encode())
            .and_then(|()| f.sync_data())
            .map_err(|e| io_err("write manifest", &path, e))
            .and_then(|()| {
                rfs::renameat(dir.fd(), &tmp, dir.fd(), name)
                    .map_err(|e| io_err("rename manifest", &path, e))
            });
        if r.is_err() {
            let _ = rfs::unlinkat(dir.fd(), &tmp, rfs::AtFlags::empty());
        }
        r
    }
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], ManifestError> {
        if self.0.len() < n {
            return Err(ManifestError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> std::result::Result<u32, ManifestError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::result::Result<u64, ManifestError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let mut blocks = BTreeMap::new();
        for i in [0u64, 3, 7, 8, 10] {
            blocks.insert(i, [i as u8; 32]);
        }
        Manifest {
            final_name: "data.bin".into(),
            temp_name: ".rcp-data.bin.0011223344556677.part".into(),
            len: 10 * 4096 + 5,
            block_size: 4096,
            source: SourceId {
                len: 10 * 4096 + 5,
                mtime: Timestamp {
                    sec: 1_700_000_000,
                    nsec: 42,
                },
                fingerprint: [9; 32],
            },
            expected_digest: Some([7; 32]),
            check: Check::Xxh3,
            blocks,
        }
    }

    #[test]
    fn the_check_round_trips_and_version_1_means_sha256() {
        for c in Check::ALL {
            let mut m = sample();
            m.check = c;
            assert_eq!(Manifest::decode(&m.encode()).unwrap().check, c);
        }
        // A version 1 manifest: no check byte, SHA-256 digests.
        let m = sample();
        let v2 = m.encode();
        let mut v1 = v2[..8].to_vec();
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.extend_from_slice(&v2[13..v2.len() - 32]);
        let sum: [u8; 32] = Sha256::digest(&v1).into();
        v1.extend_from_slice(&sum);
        let back = Manifest::decode(&v1).unwrap();
        assert_eq!(back.check, Check::Sha256);
        assert_eq!(back.blocks, m.blocks);
    }

    #[test]
    fn round_trip() {
        let m = sample();
        let back = Manifest::decode(&m.encode()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.block_count(), 11);
        assert_eq!(back.missing_blocks(), vec![1, 2, 4, 5, 6, 9]);
        let mut e = m.clone();
        e.expected_digest = None;
        e.blocks.clear();
        e.len = 0;
        e.source.len = 0;
        assert_eq!(Manifest::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn corruption_detected() {
        let b = sample().encode();
        for i in [0, 9, 20, b.len() / 2, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 0x40;
            assert!(Manifest::decode(&c).is_err(), "flip at {i}");
        }
        assert_eq!(
            Manifest::decode(&b[..b.len() - 1]),
            Err(ManifestError::Checksum)
        );
        assert_eq!(Manifest::decode(b"garbage"), Err(ManifestError::BadMagic));
        assert_eq!(Manifest::decode(b"RCPMANIF"), Err(ManifestError::Truncated));
        let mut v3 = b.clone();
        v3[8] = 3;
        assert_eq!(
            Manifest::decode(&v3),
            Err(ManifestError::UnsupportedVersion(3))
        );
    }
}
