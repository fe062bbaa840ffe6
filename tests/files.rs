//! Behaviour tests of the file layer (src/files): confinement, atomic commit,
//! streaming digest, resume, O_DIRECT fallback, tree walk.

use std::fs;
use std::io::Read;
use std::os::unix::fs::symlink;
use std::path::Path;

use rcp::files::*;

fn assert_err<T: std::fmt::Debug>(r: Result<T>, pred: impl Fn(&FileError) -> bool, what: &str) {
    match r {
        Err(ref e) if pred(e) => {}
        other => panic!("{what}: unexpected {other:?}"),
    }
}

mod confinement {
    use super::*;

    /// root/ with nested files and hostile symlinks; a secret outside it.
    fn fixture() -> (tempfile::TempDir, std::path::PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/c.txt"), "hello").unwrap();
        fs::create_dir(t.path().join("outside")).unwrap();
        fs::write(t.path().join("outside/secret.txt"), "secret").unwrap();
        symlink("b", root.join("a/inner")).unwrap();
        symlink("../a/b", root.join("a/up")).unwrap();
        symlink("/etc", root.join("etc")).unwrap();
        symlink("..", root.join("out")).unwrap();
        symlink("../outside/secret.txt", root.join("sneak")).unwrap();
        symlink("chain2", root.join("chain1")).unwrap();
        symlink("a/../..", root.join("chain2")).unwrap();
        symlink("loop2", root.join("loop1")).unwrap();
        symlink("loop1", root.join("loop2")).unwrap();
        symlink("a/b/c.txt", root.join("direct")).unwrap();
        nix::unistd::mkfifo(
            &root.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        (t, root)
    }

    fn roots(dir: &Path) -> Vec<Root> {
        vec![
            Root::open_with(dir, Resolver::Openat2).unwrap(),
            Root::open_with(dir, Resolver::Walk).unwrap(),
        ]
    }

    fn read(root: &Root, rel: &str) -> Result<String> {
        let mut s = String::new();
        root.open_read(rel)?.read_to_string(&mut s).unwrap();
        Ok(s)
    }

    #[test]
    fn kernel_has_openat2() {
        let (_t, dir) = fixture();
        assert_eq!(Root::open(&dir).unwrap().resolver(), Resolver::Openat2);
    }

    #[test]
    fn normal_nested_paths_work() {
        let (_t, dir) = fixture();
        for root in roots(&dir) {
            let r = root.resolver();
            for p in [
                "a/b/c.txt",
                "./a//b/c.txt",
                "a/inner/c.txt",
                "a/up/c.txt",
                "direct",
                "a/x/../b/c.txt",
            ] {
                assert_eq!(read(&root, p).unwrap(), "hello", "{r:?} {p}");
            }
            let m = root.stat("a/b/c.txt").unwrap();
            assert_eq!((m.kind, m.len), (FileKind::File, 5));
            assert_eq!(root.stat("a/inner").unwrap().kind, FileKind::Dir, "{r:?}");
            assert_eq!(
                root.lstat("a/inner").unwrap().kind,
                FileKind::Symlink,
                "{r:?}"
            );
            assert_eq!(root.stat(".").unwrap().kind, FileKind::Dir);
        }
    }

    #[test]
    fn lexical_escapes_refused() {
        let (_t, dir) = fixture();
        for root in roots(&dir) {
            for p in ["../x", "a/../../x", "..", "../root/a/b/c.txt"] {
                assert_err(
                    root.open_read(p),
                    |e| matches!(e, FileError::Path(PathError::Escapes { path }) if path == p),
                    p,
                );
                assert_err(
                    root.stat(p),
                    |e| matches!(e, FileError::Path(PathError::Escapes { .. })),
                    p,
                );
            }
            assert_err(
                root.open_read("/etc/passwd"),
                |e| matches!(e, FileError::Path(PathError::Absolute { .. })),
                "abs",
            );
            let msg = root.open_read("a/../../x").unwrap_err().to_string();
            assert!(
                msg.contains("a/../../x") && msg.contains("escapes the root"),
                "{msg}"
            );
        }
    }

    #[test]
    fn symlinks_leaving_the_root_refused() {
        let (_t, dir) = fixture();
        for root in roots(&dir) {
            let r = root.resolver();
            for p in [
                "etc/passwd",
                "etc",
                "sneak",
                "out/outside/secret.txt",
                "chain1/root/a/b/c.txt",
                "chain1",
            ] {
                assert_err(
                    root.open_read(p),
                    |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                    &format!("{r:?} {p}"),
                );
                assert_err(
                    root.stat(p),
                    |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                    &format!("{r:?} stat {p}"),
                );
            }
            let msg = root.open_read("etc/passwd").unwrap_err().to_string();
            assert!(
                msg.contains("etc/passwd") && msg.contains("symlink pointing outside"),
                "{msg}"
            );
            // The link itself may be looked at, not through.
            assert_eq!(root.lstat("etc").unwrap().kind, FileKind::Symlink);
            assert_err(
                root.create_dir_all("etc/x"),
                |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                "mkdir via etc",
            );
            assert_err(
                root.open_dir("out"),
                |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                "open_dir out",
            );
            assert_err(
                root.list("etc"),
                |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                "list etc",
            );
        }
    }

    #[test]
    fn other_failures_named() {
        let (_t, dir) = fixture();
        for root in roots(&dir) {
            let r = root.resolver();
            assert_err(
                root.open_read("loop1"),
                |e| matches!(e, FileError::Path(PathError::SymlinkLoop { .. })),
                "loop",
            );
            assert_err(
                root.open_read("nope"),
                |e| matches!(e, FileError::Path(PathError::NotFound { path }) if path == "nope"),
                "nope",
            );
            assert_err(
                root.open_read("a/b/c.txt/x"),
                |e| matches!(e, FileError::Path(PathError::NotADirectory { .. })),
                "notdir",
            );
            assert_err(
                root.open_read("a"),
                |e| matches!(e, FileError::Path(PathError::NotRegularFile { .. })),
                &format!("{r:?} dir"),
            );
            // A FIFO is refused, and opening it does not block.
            assert_err(
                root.open_read("fifo"),
                |e| matches!(e, FileError::Path(PathError::NotRegularFile { .. })),
                "fifo",
            );
        }
    }

    #[test]
    fn list_sorted_lstat() {
        let (_t, dir) = fixture();
        for root in roots(&dir) {
            let l = root.list("a").unwrap();
            let names: Vec<_> = l.iter().map(|e| e.name.to_str().unwrap()).collect();
            assert_eq!(names, ["b", "inner", "up"]);
            assert_eq!(l[0].meta.kind, FileKind::Dir);
            assert_eq!(l[1].meta.kind, FileKind::Symlink);
            // Listing twice gives the same (the dir fd offset is rewound).
            assert_eq!(root.list("a").unwrap(), l);
            assert_eq!(root.list("a/inner").unwrap().len(), 1);
        }
    }

    #[test]
    fn create_dir_all_and_symlink() {
        let (_t, dir) = fixture();
        for (i, root) in roots(&dir).into_iter().enumerate() {
            let d = root.create_dir_all(&format!("new{i}/x/y")).unwrap();
            assert!(dir.join(format!("new{i}/x/y")).is_dir());
            assert_eq!(d.meta().unwrap().kind, FileKind::Dir);
            root.create_dir_all(&format!("new{i}/x/y")).unwrap(); // idempotent
            root.create_dir_all("a/inner/z").unwrap(); // through an in-root symlink
            assert!(dir.join("a/b/z").is_dir());
            assert_err(
                root.create_dir_all("a/b/c.txt/d"),
                |e| matches!(e, FileError::Path(PathError::NotADirectory { .. })),
                "mkdir through file",
            );

            root.symlink(&format!("a/ln{i}"), "b/c.txt").unwrap();
            assert_eq!(read(&root, &format!("a/ln{i}")).unwrap(), "hello");
            root.symlink(&format!("a/ln{i}"), "up/c.txt").unwrap(); // atomic replace
            assert_eq!(
                fs::read_link(dir.join(format!("a/ln{i}"))).unwrap(),
                Path::new("up/c.txt")
            );
            for t in ["../../x", "/etc", ""] {
                assert_err(
                    root.symlink("a/bad", t),
                    |e| matches!(e, FileError::Path(PathError::SymlinkOutside { .. })),
                    t,
                );
            }
            assert_err(
                root.symlink("a/b", "b"),
                |e| matches!(e, FileError::IsADirectory { .. }),
                "replace dir",
            );
        }
        // No temporary link names left behind.
        assert!(fs::read_dir(dir.join("a")).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".rcp-")));
    }
}

/// Names in `dir`, sorted.
/// The variable `var` a child process's test (an ignored `child_*`) gets
/// from its parent test `parent`; run any other way, the child fails:
/// alone it checks nothing.
fn child_env(var: &str, parent: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("not a test of its own: {parent} runs it in a child process, with {var} set")
    })
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Deterministic pseudo-random bytes.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The derived file digest of `data` cut in `bs` blocks (through `file_digest`,
/// whose encoding `derived_digest::fixed_vectors` checks independently).
fn derived(data: &[u8], bs: u64) -> Sha256Digest {
    let blocks: Vec<Sha256Digest> = data.chunks(bs as usize).map(block_digest).collect();
    file_digest(data.len() as u64, bs, &blocks)
}

/// Shuffle deterministically (Fisher-Yates with an xorshift).
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

mod destination {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn opts(bs: u64) -> DestinationOptions {
        DestinationOptions {
            block_size: bs,
            ..Default::default()
        }
    }

    /// Write all blocks of `data` in a shuffled order through write_block.
    fn fill(d: &mut Destination, data: &[u8], seed: u64) {
        let bs = d.block_size() as usize;
        let mut idx: Vec<u64> = (0..d.block_count()).collect();
        shuffle(&mut idx, seed);
        for i in idx {
            let b = &data[i as usize * bs..(i as usize * bs + bs).min(data.len())];
            d.write_block(i, b, block_digest(b)).unwrap();
        }
    }

    /// On tmpfs (/dev/shm) a file is sized sparse after a free-space check,
    /// not fallocated: one larger than the free space is refused at create,
    /// naming the shortfall, with no temp file left; one that fits is sized.
    #[test]
    fn tmpfs_destination_checks_free_space_and_sizes_sparse() {
        let t = tempfile::tempdir_in("/dev/shm").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let free = {
            let v = rustix::fs::statvfs(t.path()).unwrap();
            v.f_bavail * v.f_frsize
        };
        let e = Destination::create(&dir, "huge", free + (1 << 30), opts(1 << 20)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("bytes needed") && msg.contains("free"),
            "{msg}"
        );
        assert!(
            matches!(&e, FileError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull),
            "{e:?}"
        );
        assert_eq!(
            fs::read_dir(t.path()).unwrap().count(),
            0,
            "no temp file left"
        );
        let d = Destination::create(&dir, "fits", 8 << 20, opts(1 << 20)).unwrap();
        let m = fs::metadata(d.temp_path()).unwrap();
        assert_eq!(m.len(), 8 << 20);
        assert!(m.blocks() * 512 < 8 << 20, "sized sparse, not allocated");
    }

    #[test]
    fn commit_publishes_atomically_and_replaces() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f"), "old contents").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(100_000, 1);
        let mut d = Destination::create(&dir, "f", data.len() as u64, opts(4096)).unwrap();
        // Pre-sized temp beside the final name; the old file untouched meanwhile.
        let temp = d.temp_path();
        let tname = temp.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            tname.starts_with(".rcp-f.") && tname.ends_with(".part"),
            "{tname}"
        );
        assert_eq!(fs::metadata(&temp).unwrap().len(), 100_000);
        fill(&mut d, &data, 7);
        assert_eq!(fs::read(t.path().join("f")).unwrap(), b"old contents");
        let got = d.commit(derived(&data, 4096)).unwrap();
        assert_eq!(
            got,
            Published {
                path: t.path().join("f"),
                len: 100_000,
                derived_digest: derived(&data, 4096),
                flat_sha256: None,
            }
        );
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data);
        assert_eq!(names(t.path()), ["f"]);
    }

    #[test]
    fn drop_without_commit_leaves_nothing_and_keeps_existing() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("keep"), "precious").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        {
            let mut d = Destination::create(&dir, "keep", 10_000, opts(4096)).unwrap();
            d.write_block(0, &[1; 4096], block_digest(&[1; 4096]))
                .unwrap();
            assert_eq!(names(t.path()).len(), 2);
        } // interrupted
        assert_eq!(names(t.path()), ["keep"]);
        assert_eq!(fs::read(t.path().join("keep")).unwrap(), b"precious");
        {
            let _d = Destination::create(&dir, "new", 10, opts(4096)).unwrap();
        }
        assert_eq!(names(t.path()), ["keep"]);
        let d = Destination::create(&dir, "new", 10, opts(4096)).unwrap();
        d.abort();
        assert_eq!(names(t.path()), ["keep"]);
    }

    #[test]
    fn wrong_digest_leaves_nothing() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f"), "old").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(9000, 2);
        let mut d = Destination::create(&dir, "f", 9000, opts(4096)).unwrap();
        fill(&mut d, &data, 3);
        let e = d.commit(block_digest(b"something else")).unwrap_err();
        assert!(matches!(e, FileError::DigestMismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("mismatch"), "{e}");
        assert_eq!(names(t.path()), ["f"]);
        assert_eq!(fs::read(t.path().join("f")).unwrap(), b"old");
        // Same with a resumable destination: mismatch also drops the manifest.
        let mut o = opts(4096);
        o.resume = Some(SourceId {
            len: 9000,
            mtime: Timestamp::default(),
            fingerprint: [1; 32],
        });
        let mut d = Destination::create(&dir, "f", 9000, o).unwrap();
        fill(&mut d, &data, 4);
        assert!(d.commit([0; 32]).is_err());
        assert_eq!(names(t.path()), ["f"]);
    }

    #[test]
    fn incomplete_commit_refused() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(3 * 4096, 5);
        let mut d = Destination::create(&dir, "f", data.len() as u64, opts(4096)).unwrap();
        d.write_block(0, &data[..4096], block_digest(&data[..4096]))
            .unwrap();
        d.write_block(2, &data[8192..], block_digest(&data[8192..]))
            .unwrap();
        assert_eq!(d.missing_blocks(), vec![1]);
        let e = d.commit(block_digest(&data)).unwrap_err();
        assert!(
            matches!(
                e,
                FileError::Incomplete {
                    missing_from: 4096,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(names(t.path()).is_empty());
    }

    #[test]
    fn bad_writes_refused() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let mut d = Destination::create(&dir, "f", 5000, opts(4096)).unwrap();
        assert!(matches!(
            d.write_block(2, &[0; 10], [0; 32]),
            Err(FileError::OutOfRange { .. })
        ));
        assert!(matches!(
            d.write_block(1, &[0; 4096], [0; 32]),
            Err(FileError::BadBlock { expected: 904, .. })
        ));
        fs::create_dir(t.path().join("sub")).unwrap();
        assert!(matches!(
            Destination::create(&dir, "sub", 1, opts(4096)),
            Err(FileError::IsADirectory { .. })
        ));
        for bad in ["", "..", "a/b"] {
            assert!(
                matches!(
                    Destination::create(&dir, bad, 1, opts(4096)),
                    Err(FileError::Path(PathError::BadName { .. }))
                ),
                "{bad}"
            );
        }
    }

    /// A file of one block where nothing stands is written unnamed
    /// (O_TMPFILE) and linked into place: no name in the directory until
    /// then, its mode without `-p` the source's masked by the umask (with
    /// no chmod); `-p` bits the umask would mask are set all the same; a
    /// name that came in its way meanwhile is replaced, as a rename would,
    /// with no temp name left behind; a fan-out's reader of it reads it.
    #[test]
    fn unnamed_temp_for_one_block_linked_into_place() {
        let t = tempfile::tempdir_in("/dev/shm").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let umask = rcp::files::mode::process_umask();
        let mut o = opts(4096);
        o.source_mode = Some(0o755);
        let mut d = Destination::create(&dir, "new", 3, o.clone()).unwrap();
        d.write_block(0, b"abc", block_digest(b"abc")).unwrap();
        assert!(names(t.path()).is_empty(), "{:?}", names(t.path()));
        let mut back = String::new();
        d.temp_reader().unwrap().read_to_string(&mut back).unwrap();
        assert_eq!(back, "abc");
        d.commit(derived(b"abc", 4096)).unwrap();
        assert_eq!(names(t.path()), ["new"]);
        assert_eq!(fs::read(t.path().join("new")).unwrap(), b"abc");
        let m = fs::metadata(t.path().join("new")).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755 & !umask);

        let mtime = Timestamp {
            sec: 1_000_000_000,
            nsec: 5,
        };
        let m = preserved(&dir, "wide", 0o666 | umask, mtime);
        assert_eq!(m.permissions().mode() & 0o7777, 0o666 | umask);
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_000_000_000, 5));

        let mut d = Destination::create(&dir, "raced", 2, o).unwrap();
        d.write_block(0, b"ok", block_digest(b"ok")).unwrap();
        fs::write(t.path().join("raced"), "someone else's").unwrap();
        d.commit(derived(b"ok", 4096)).unwrap();
        assert_eq!(fs::read(t.path().join("raced")).unwrap(), b"ok");
        assert_eq!(names(t.path()), ["new", "raced", "wide"]);
    }

    /// `dir/name` of 3 bytes committed with `-p` (`mode`, `mtime`): its
    /// metadata.
    fn preserved(dir: &DirHandle, name: &str, mode: u32, mtime: Timestamp) -> fs::Metadata {
        let mut o = opts(4096);
        o.preserve = Some(Preserve { mode, mtime });
        let mut d = Destination::create(dir, name, 3, o).unwrap();
        d.write_block(0, b"abc", block_digest(b"abc")).unwrap();
        d.commit(derived(b"abc", 4096)).unwrap();
        fs::metadata(dir.display().join(name)).unwrap()
    }

    #[test]
    fn preserve_mode_and_mtime() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let mtime = Timestamp {
            sec: 1_234_567_890,
            nsec: 123_456_789,
        };
        let m = preserved(&dir, "p", 0o640, mtime);
        assert_eq!(m.permissions().mode() & 0o7777, 0o640);
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_234_567_890, 123_456_789));
    }

    #[test]
    fn empty_file() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let d = Destination::create(&dir, "e", 0, opts(4096)).unwrap();
        assert_eq!(d.block_count(), 0);
        d.commit(file_digest(0, 4096, [])).unwrap();
        assert_eq!(fs::metadata(t.path().join("e")).unwrap().len(), 0);
    }

    #[test]
    fn digest_backpressure_spills_to_disk() {
        // 1 KiB of digest memory, 64 x 512-byte blocks in reverse order: nearly all
        // pieces are re-read from the temp file, result still right.
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(64 * 512 - 100, 9);
        let mut o = opts(512);
        o.flat_sha256 = true;
        o.max_pending_digest_bytes = 1024;
        let mut d = Destination::create(&dir, "bp", data.len() as u64, o).unwrap();
        for i in (0..d.block_count()).rev() {
            let b = &data[i as usize * 512..(i as usize * 512 + 512).min(data.len())];
            d.write_block(i, b, block_digest(b)).unwrap();
            if i > 0 {
                assert_eq!(d.digested_up_to(), Some(0));
            }
        }
        assert_eq!(d.digested_up_to(), Some(data.len() as u64));
        let p = d.commit_flat(block_digest(&data)).unwrap();
        assert_eq!(p.flat_sha256, Some(block_digest(&data)));
        assert_eq!(p.derived_digest, derived(&data, 512));
        assert_eq!(fs::read(t.path().join("bp")).unwrap(), data);
    }
}

mod resume {
    use super::*;

    const BS: u64 = 4096;
    const LEN: u64 = 8 * BS - 10;

    fn src() -> SourceId {
        SourceId {
            len: LEN,
            mtime: Timestamp {
                sec: 1_700_000_000,
                nsec: 5,
            },
            fingerprint: [3; 32],
        }
    }

    fn opts(every: u64) -> DestinationOptions {
        DestinationOptions {
            block_size: BS,
            resume: Some(src()),
            manifest_every_blocks: every,
            manifest_interval: std::time::Duration::from_secs(3600),
            ..Default::default()
        }
    }

    fn block(data: &[u8], i: u64) -> &[u8] {
        &data[(i * BS) as usize..((i + 1) * BS).min(data.len() as u64) as usize]
    }

    fn write(d: &mut Destination, data: &[u8], blocks: &[u64]) {
        for &i in blocks {
            d.write_block(i, block(data, i), block_digest(block(data, i)))
                .unwrap();
        }
    }

    fn finish(d: &mut Destination, data: &[u8]) {
        let missing = d.missing_blocks();
        write(d, data, &missing);
    }

    /// Runs in a child process (see `killed_transfer_resumes`): writes some blocks,
    /// then dies by SIGKILL, so no destructor runs. Ignored: not a test of
    /// its own (run directly it would check nothing); the parent runs it
    /// with `--ignored --exact`.
    #[test]
    #[ignore = "the child process of killed_transfer_resumes, run by it"]
    fn child_writer() {
        let dir = child_env("RCP_FILES_CHILD_DIR", "killed_transfer_resumes");
        let data = pattern(LEN as usize, 11);
        let dir = DirHandle::open(dir).unwrap();
        let mut d = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        write(&mut d, &data, &[0, 2, 5, 6]);
        let _ = std::process::Command::new("kill")
            .args(["-9", &std::process::id().to_string()])
            .status();
        std::thread::sleep(std::time::Duration::from_secs(60));
        unreachable!("not killed");
    }

    #[test]
    fn killed_transfer_resumes() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f"), "old").unwrap();
        let st = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "resume::child_writer",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RCP_FILES_CHILD_DIR", t.path())
            .status()
            .unwrap();
        assert!(!st.success(), "child should have been killed");
        // Killed mid-copy: the old file is intact, a temp + manifest are left.
        assert_eq!(fs::read(t.path().join("f")).unwrap(), b"old");
        let n = names(t.path());
        assert_eq!(n.len(), 3, "{n:?}");
        assert!(
            n[0].ends_with(".part") && n[1].ends_with(".part.manifest"),
            "{n:?}"
        );

        let data = pattern(LEN as usize, 11);
        let dir = DirHandle::open(t.path()).unwrap();
        // Resumed with the flat SHA-256 on (the killed writer had it off).
        let mut o = opts(1);
        o.flat_sha256 = true;
        let mut d = Destination::resume(&dir, "f", &src(), o)
            .unwrap()
            .expect("resumable");
        assert_eq!(d.missing_blocks(), vec![1, 3, 4, 7]);
        // Blocks 0 was re-read and hashed; 2, 5, 6 wait for the gap at block 1.
        assert_eq!(d.digested_up_to(), Some(BS));
        finish(&mut d, &data);
        // Derived from the re-checked old blocks and the new ones alike.
        assert_eq!(d.derived_digest(), Some(derived(&data, BS)));
        let p = d.commit(derived(&data, BS)).unwrap();
        assert_eq!(p.flat_sha256, Some(block_digest(&data)));
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data);
        assert_eq!(names(t.path()), ["f"]);
    }

    #[test]
    fn dropped_destination_resumes_exact_set() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(LEN as usize, 12);
        {
            // Saves only on drop (every 1000 blocks otherwise).
            let mut d = Destination::create(&dir, "f", LEN, opts(1000)).unwrap();
            write(&mut d, &data, &[7, 1, 3]);
        }
        assert!(!t.path().join("f").exists());
        let mut d = Destination::resume(&dir, "f", &src(), opts(1000))
            .unwrap()
            .unwrap();
        assert_eq!(d.missing_blocks(), vec![0, 2, 4, 5, 6]);
        assert_eq!(d.manifest().blocks.len(), 3);
        // Suspend again half way, resume again.
        write(&mut d, &data, &[0, 2]);
        d.suspend().unwrap();
        let mut o = opts(1000);
        o.flat_sha256 = true;
        let mut d = Destination::resume(&dir, "f", &src(), o).unwrap().unwrap();
        assert_eq!(d.missing_blocks(), vec![4, 5, 6]);
        assert_eq!(d.digested_up_to(), Some(4 * BS));
        finish(&mut d, &data);
        let p = d.commit(derived(&data, BS)).unwrap();
        assert_eq!(p.flat_sha256, Some(block_digest(&data)));
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data);
        assert_eq!(names(t.path()), ["f"]);
    }

    #[test]
    fn mismatched_source_or_block_size_not_resumed() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(LEN as usize, 13);
        let mut d = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        write(&mut d, &data, &[0]);
        drop(d);
        let mut other = src();
        other.mtime.sec += 1;
        // Different block size: refused, and the stale pair is removed.
        let mut o = opts(1);
        o.block_size = 2 * BS;
        assert!(Destination::resume(&dir, "f", &src(), o).unwrap().is_none());
        assert!(names(t.path()).is_empty());

        let mut d = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        write(&mut d, &data, &[0]);
        drop(d);
        assert!(Destination::resume(&dir, "f", &other, opts(1))
            .unwrap()
            .is_none());
        assert!(names(t.path()).is_empty());
        // Another final name is not touched by a resume of "f".
        let d = Destination::create(&dir, "g", LEN, opts(1)).unwrap();
        drop(d);
        assert!(Destination::resume(&dir, "f", &src(), opts(1))
            .unwrap()
            .is_none());
        assert_eq!(names(t.path()).len(), 2);
    }

    #[test]
    fn corrupted_manifest_not_trusted() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(LEN as usize, 14);
        let mut d = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        write(&mut d, &data, &[0, 1]);
        drop(d);
        let mname = names(t.path())
            .into_iter()
            .find(|n| n.ends_with(".manifest"))
            .unwrap();
        let mpath = t.path().join(&mname);
        let mut bytes = fs::read(&mpath).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        fs::write(&mpath, &bytes).unwrap();
        let e = Manifest::load(&dir, std::ffi::OsStr::new(&mname)).unwrap_err();
        assert!(
            matches!(
                e,
                FileError::Manifest {
                    source: ManifestError::Checksum,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            e.to_string().contains(&mname) && e.to_string().contains("checksum"),
            "{e}"
        );
        assert!(Destination::resume(&dir, "f", &src(), opts(1))
            .unwrap()
            .is_none());
        assert!(names(t.path()).is_empty());
    }

    #[test]
    fn corrupted_temp_block_is_resent() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(LEN as usize, 15);
        let mut d = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        write(&mut d, &data, &[0, 1, 2]);
        let temp = d.temp_path();
        drop(d);
        // Damage block 1 on disk behind the manifest's back.
        use std::os::unix::fs::FileExt;
        fs::OpenOptions::new()
            .write(true)
            .open(&temp)
            .unwrap()
            .write_all_at(b"XX", BS + 7)
            .unwrap();
        let mut d = Destination::resume(&dir, "f", &src(), opts(1))
            .unwrap()
            .unwrap();
        assert_eq!(d.missing_blocks(), vec![1, 3, 4, 5, 6, 7]);
        finish(&mut d, &data);
        d.commit(derived(&data, BS)).unwrap();
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data);
    }

    /// A resume that races the end of the interrupted transfer (still
    /// writing its last blocks, then saving its manifest) waits for it and
    /// takes the manifest as it was left.
    #[test]
    fn resume_waits_for_the_interrupted_transfer_to_let_go() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = pattern(LEN as usize, 14);
        // Saves only on drop (every 1000 blocks otherwise).
        let mut old = Destination::create(&dir, "f", LEN, opts(1000)).unwrap();
        write(&mut old, &data, &[0, 1]);
        let data2 = data.clone();
        let let_go = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ending = {
            let let_go = let_go.clone();
            std::thread::spawn(move || {
                // Late enough that the resume is (almost surely) waiting;
                // the order is what is checked, not the time.
                std::thread::sleep(std::time::Duration::from_millis(300));
                write(&mut old, &data2, &[2]);
                let_go.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(old);
            })
        };
        let mut d = Destination::resume(&dir, "f", &src(), opts(1000))
            .unwrap()
            .expect("resumed once the old transfer let go");
        assert!(
            let_go.load(std::sync::atomic::Ordering::SeqCst),
            "resumed before the old transfer let go"
        );
        ending.join().unwrap();
        assert_eq!(d.missing_blocks(), vec![3, 4, 5, 6, 7]);
        finish(&mut d, &data);
        d.commit(derived(&data, BS)).unwrap();
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data);
    }

    #[test]
    fn live_transfer_neither_resumed_nor_swept() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let live = Destination::create(&dir, "f", LEN, opts(1)).unwrap();
        assert!(Destination::resume(&dir, "f", &src(), opts(1))
            .unwrap()
            .is_none());
        let mut other = src();
        other.fingerprint = [0; 32];
        assert!(Destination::resume(&dir, "f", &other, opts(1))
            .unwrap()
            .is_none());
        assert!(live.temp_path().exists());
        // A non-resumable transfer killed earlier leaves a bare .part: swept.
        let bare = t.path().join(".rcp-f.0000000000000000.part");
        fs::write(&bare, "junk").unwrap();
        assert!(Destination::resume(&dir, "f", &src(), opts(1))
            .unwrap()
            .is_none());
        assert!(!bare.exists());
        assert!(live.temp_path().exists());
        live.abort();
        assert!(names(t.path()).is_empty());
    }
}

mod whole_file_digest {
    use super::*;

    fn sha256sum(path: &Path) -> String {
        let out = std::process::Command::new("sha256sum")
            .arg(path)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn known_files_match_sha256sum() {
        let t = tempfile::tempdir().unwrap();
        let empty = t.path().join("empty");
        fs::write(&empty, b"").unwrap();
        assert_eq!(
            digest::to_hex(&StreamingFileDigest::new(Some(0), 0).finish().unwrap()),
            sha256sum(&empty)
        );
        let abc = t.path().join("abc");
        fs::write(&abc, b"abc").unwrap();
        assert_eq!(digest::to_hex(&block_digest(b"abc")), sha256sum(&abc));
    }

    #[test]
    fn shuffled_blocks_equal_sha256sum() {
        let t = tempfile::tempdir().unwrap();
        let len = (33 << 20) + 7;
        let data = pattern(len, 21);
        let path = t.path().join("big");
        fs::write(&path, &data).unwrap();
        let expect = sha256sum(&path);

        let bs = 1 << 20;
        let mut idx: Vec<usize> = (0..len.div_ceil(bs)).collect();
        shuffle(&mut idx, 5);
        let mut s = StreamingFileDigest::new(Some(len as u64), 64 << 20);
        for &i in &idx {
            s.update((i * bs) as u64, &data[i * bs..((i + 1) * bs).min(len)])
                .unwrap();
        }
        assert_eq!(s.pending_bytes(), 0);
        assert_eq!(digest::to_hex(&s.finish().unwrap()), expect);

        // The same through a Destination with a small memory bound (spills to disk).
        let dir = DirHandle::open(t.path()).unwrap();
        let o = DestinationOptions {
            block_size: bs as u64,
            flat_sha256: true,
            max_pending_digest_bytes: 4 << 20,
            ..Default::default()
        };
        let mut d = Destination::create(&dir, "copy", len as u64, o).unwrap();
        let blocks: Vec<&[u8]> = (0..idx.len())
            .map(|i| &data[i * bs..((i + 1) * bs).min(len)])
            .collect();
        let digests = digest_blocks_parallel(&blocks);
        for &i in &idx {
            d.write_block(i as u64, blocks[i], digests[i]).unwrap();
        }
        let got = d.commit_flat(digest::from_hex(&expect).unwrap()).unwrap();
        assert_eq!(digest::to_hex(&got.flat_sha256.unwrap()), expect);
        assert_eq!(
            got.derived_digest,
            file_digest(len as u64, bs as u64, &digests)
        );
        assert_eq!(sha256sum(&t.path().join("copy")), expect);
    }
}

mod source {
    use super::*;
    use std::os::fd::OwnedFd;

    /// A 4096-aligned window of `len` bytes inside a Vec (safe: align_offset).
    fn aligned(storage: &mut Vec<u8>, len: usize) -> &mut [u8] {
        storage.resize(len + DIRECT_ALIGN, 0);
        let off = storage.as_ptr().align_offset(DIRECT_ALIGN);
        &mut storage[off..off + len]
    }

    fn check_reads(f: &SourceFile, data: &[u8], expect_direct: bool) {
        let len = data.len();
        let bs = 16 * 1024;
        let mut st = Vec::new();
        let buf = aligned(&mut st, bs);
        let mut off = 0;
        while off < len {
            let (n, mode) = f.read_at_mode(off as u64, buf).unwrap();
            assert_eq!(n, bs.min(len - off), "read at {off}");
            assert_eq!(&buf[..n], &data[off..off + n]);
            // Whole aligned buffers go direct, including the short last block
            // (aligned over-read, truncated by the kernel at EOF).
            let want = if expect_direct {
                IoMode::Direct
            } else {
                IoMode::Buffered
            };
            assert_eq!(mode, want, "read at {off}");
            off += n;
        }
        // Exact-length last block (unaligned length) -> buffered path.
        let tail = len % bs;
        let last = (len - tail) as u64;
        let mut v = vec![0u8; tail];
        assert_eq!(
            f.read_at_mode(last, &mut v).unwrap(),
            (tail, IoMode::Buffered)
        );
        assert_eq!(&v[..], &data[len - tail..]);
        // Unaligned offset -> buffered.
        let mut st2 = Vec::new();
        let b2 = aligned(&mut st2, 4096);
        assert_eq!(f.read_at_mode(100, b2).unwrap().1, IoMode::Buffered);
        assert_eq!(&b2[..], &data[100..4196]);
        // Past the end.
        assert_eq!(f.read_at(len as u64 + 4096, b2).unwrap(), 0);
    }

    #[test]
    fn direct_when_possible_and_buffered_otherwise() {
        let t = tempfile::tempdir().unwrap();
        let data = pattern(5 * 16 * 1024 + 1234, 31);
        let p = t.path().join("src.bin");
        fs::write(&p, &data).unwrap();
        let f = SourceFile::open(&p).unwrap();
        eprintln!(
            "SourceFile on {}: io_mode = {:?} ({:?})",
            t.path().display(),
            f.io_mode(),
            f.direct_unavailable()
        );
        let direct = f.io_mode() == IoMode::Direct;
        check_reads(&f, &data, direct);
        let s = f.stats();
        assert!(s.buffered_reads >= 2);
        if direct {
            assert_eq!(s.direct_reads, 6);
        }
        assert_eq!(f.len(), data.len() as u64);
        assert_eq!(
            f.source_id().unwrap().fingerprint,
            block_digest(&data[..64 << 10])
        );
        f.check_unchanged().unwrap();
        // Growing the file is noticed.
        use std::io::Write;
        fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"more")
            .unwrap();
        assert!(matches!(
            f.check_unchanged(),
            Err(FileError::SourceChanged {
                what: "length changed",
                ..
            })
        ));
    }

    /// A file of at most DIRECT_READ_FROM bytes is read through one
    /// buffered fd: the opener is never asked for an O_DIRECT one.
    #[test]
    fn small_files_open_no_direct_fd() {
        let t = tempfile::tempdir().unwrap();
        let data = pattern(DIRECT_READ_FROM as usize - 1234, 33);
        let p = t.path().join("small.bin");
        fs::write(&p, &data).unwrap();
        let mut asked = Vec::new();
        let f = SourceFile::from_opener(&p, |direct| -> std::io::Result<OwnedFd> {
            asked.push(direct);
            Ok(fs::File::open(&p)?.into())
        })
        .unwrap();
        assert_eq!(asked, [false]);
        assert_eq!(f.io_mode(), IoMode::Buffered);
        assert!(f.direct_unavailable().unwrap().contains("64 KiB"));
        check_reads(&f, &data, false);
        assert_eq!(f.stats().direct_reads, 0);
    }

    #[test]
    fn o_direct_refused_falls_back_to_buffered() {
        // File systems that refuse O_DIRECT fail the open with EINVAL; this kernel's
        // tmpfs and ext4 both accept it, so the refusal is injected at the open.
        let t = tempfile::tempdir().unwrap();
        // Longer than DIRECT_READ_FROM: a smaller file never opens O_DIRECT.
        let data = pattern(5 * 16 * 1024 + 99, 32);
        let p = t.path().join("src.bin");
        fs::write(&p, &data).unwrap();
        let f = SourceFile::from_opener(&p, |direct| -> std::io::Result<OwnedFd> {
            if direct {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            Ok(fs::File::open(&p)?.into())
        })
        .unwrap();
        assert_eq!(f.io_mode(), IoMode::Buffered);
        assert!(f.direct_unavailable().unwrap().contains("Invalid argument"));
        eprintln!("injected EINVAL: io_mode = {:?}", f.io_mode());
        check_reads(&f, &data, false);
        assert_eq!(f.stats().direct_reads, 0);
    }

    #[test]
    fn tmpfs_mode_reported() {
        let Ok(t) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let p = t.path().join("x");
        fs::write(&p, pattern(10_000, 33)).unwrap();
        let f = SourceFile::open(&p).unwrap();
        eprintln!(
            "SourceFile on tmpfs /dev/shm: io_mode = {:?} ({:?})",
            f.io_mode(),
            f.direct_unavailable()
        );
        let data = fs::read(&p).unwrap();
        let mut st = Vec::new();
        let buf = aligned(&mut st, 16384);
        assert_eq!(f.read_at(0, buf).unwrap(), 10_000);
        assert_eq!(&buf[..10_000], &data[..]);
    }

    #[test]
    fn open_in_root_is_confined() {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir(t.path().join("r")).unwrap();
        fs::write(t.path().join("r/f"), "data").unwrap();
        fs::write(t.path().join("secret"), "s").unwrap();
        symlink("../secret", t.path().join("r/s")).unwrap();
        let root = Root::open(t.path().join("r")).unwrap();
        let f = SourceFile::open_in(&root, "f").unwrap();
        let mut b = [0u8; 4];
        assert_eq!(f.read_at(0, &mut b).unwrap(), 4);
        assert_eq!(&b, b"data");
        assert!(matches!(
            SourceFile::open_in(&root, "s"),
            Err(FileError::Path(PathError::SymlinkOutside { .. }))
        ));
        assert!(matches!(
            SourceFile::open_in(&root, "../secret"),
            Err(FileError::Path(PathError::Escapes { .. }))
        ));
        assert!(matches!(
            SourceFile::open_in(&root, "."),
            Err(FileError::Path(PathError::NotRegularFile { .. }))
        ));
    }
}

mod tree {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::path::PathBuf;

    /// `MakeDirs`' maker: a directory beneath one it made is made in the
    /// handle it holds, as `create_tree_dir` makes it from the root: a
    /// symlink standing there replaced (what it points at untouched), the
    /// same mode, a file in the way refused.
    #[test]
    fn tree_dirs_make_beneath_what_they_made_as_create_tree_dir() {
        use std::os::unix::fs::MetadataExt;
        let t = tempfile::tempdir().unwrap();
        let (rootp, outside) = (t.path().join("root"), t.path().join("outside"));
        fs::create_dir(&rootp).unwrap();
        fs::create_dir(&outside).unwrap();
        let root = Root::open(&rootp).unwrap();
        let mut dirs = root.tree_dirs();
        dirs.make("a", 0o750).unwrap();
        symlink(&outside, rootp.join("a/l")).unwrap();
        dirs.make("a/l", 0o505).unwrap();
        let l = fs::symlink_metadata(rootp.join("a/l")).unwrap();
        assert!(l.is_dir(), "{l:?}");
        dirs.make("a/l/m", 0).unwrap();
        assert!(rootp.join("a/l/m").is_dir());
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
        root.create_tree_dir("b", 0o505).unwrap();
        let b = fs::metadata(rootp.join("b")).unwrap();
        assert_eq!(l.mode(), b.mode());
        fs::write(rootp.join("a/f"), "x").unwrap();
        assert!(matches!(
            dirs.make("a/f", 0o755),
            Err(FileError::NotADirectory { .. })
        ));
        assert!(rootp.join("a/f").is_file());
    }

    /// The walk's order, the serial one (depth-first, a directory right
    /// before its contents, siblings by name bytes), whatever the tree's
    /// shape: sibling directories are walked side by side and put back.
    #[test]
    fn walk_order_of_a_wide_and_deep_tree() {
        fn reference(
            dir: &Path,
            rel: &Path,
            out: &mut Vec<(PathBuf, bool)>,
            skips: &mut Vec<PathBuf>,
        ) {
            let mut names: Vec<_> = fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            for n in names {
                let (p, r) = (dir.join(&n), rel.join(&n));
                let m = fs::symlink_metadata(&p).unwrap();
                if m.file_type().is_symlink() {
                    skips.push(r);
                } else if m.is_dir() {
                    out.push((r.clone(), true));
                    reference(&p, &r, out, skips);
                } else {
                    out.push((r, false));
                }
            }
        }
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("top");
        // Wide at the top, uneven below, a chain deeper than the parallel
        // levels, files and skipped links between the directories.
        for i in 0..12 {
            let d = top.join(format!("d{i:02}"));
            fs::create_dir_all(&d).unwrap();
            for j in 0..(i % 4) {
                let sub = d.join(format!("s{j}"));
                fs::create_dir_all(&sub).unwrap();
                fs::write(sub.join("f"), "x").unwrap();
                symlink("/etc", sub.join("g")).unwrap();
            }
            fs::write(d.join("m"), "x").unwrap();
            symlink("/etc", d.join("l")).unwrap();
            fs::write(top.join(format!("d{i:02}.f")), "x").unwrap();
        }
        let mut chain = top.join("d05");
        for k in 0..12 {
            fs::create_dir_all(chain.join("x")).unwrap();
            fs::write(chain.join(format!("w{k}")), "x").unwrap();
            chain = chain.join(format!("c{k}"));
            fs::create_dir_all(&chain).unwrap();
        }
        symlink("/etc", top.join("d03.l")).unwrap();
        let (mut want, mut want_skips) = (Vec::new(), Vec::new());
        reference(&top, Path::new(""), &mut want, &mut want_skips);
        let tree = walk(&top).unwrap();
        let got: Vec<(PathBuf, bool)> = tree
            .entries
            .iter()
            .map(|e| (e.rel_path.clone(), e.kind == EntryKind::Dir))
            .collect();
        assert_eq!(got, want);
        let skips: Vec<PathBuf> = tree.skipped.iter().map(|s| s.rel_path.clone()).collect();
        assert_eq!(skips, want_skips);
        assert!(want.len() > 100, "{}", want.len());
    }

    #[test]
    fn walk_order_kinds_and_symlink_policy() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("top");
        fs::create_dir_all(top.join("b/deep")).unwrap();
        fs::create_dir_all(top.join("a")).unwrap();
        fs::write(top.join("z.txt"), "zz").unwrap();
        fs::write(top.join("b/deep/f"), "f").unwrap();
        fs::write(top.join("a/1"), "1").unwrap();
        symlink("deep/f", top.join("b/in")).unwrap(); // inside: kept
        symlink("../a", top.join("b/up")).unwrap(); // inside: kept
        symlink("nowhere", top.join("dangling")).unwrap(); // inside, dangling: kept
        symlink("/etc", top.join("abs")).unwrap(); // skipped
        symlink("../../x", top.join("b/out")).unwrap(); // skipped
        symlink("..", top.join("parent")).unwrap(); // skipped: never followed
        nix::unistd::mkfifo(
            &top.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();

        let tree = walk(&top).unwrap();
        let got: Vec<(String, EntryKind)> = tree
            .entries
            .iter()
            .map(|e| (e.rel_path.to_string_lossy().into_owned(), e.kind))
            .collect();
        use EntryKind::*;
        let want = [
            ("a", Dir),
            ("a/1", File),
            ("b", Dir),
            ("b/deep", Dir),
            ("b/deep/f", File),
            ("b/in", Symlink),
            ("b/up", Symlink),
            ("dangling", Symlink),
            ("z.txt", File),
        ];
        let want: Vec<(String, EntryKind)> =
            want.iter().map(|(p, k)| (p.to_string(), *k)).collect();
        assert_eq!(got, want);
        let z = tree
            .entries
            .iter()
            .find(|e| e.rel_path == Path::new("z.txt"))
            .unwrap();
        assert_eq!(z.len, 2);
        let up = tree
            .entries
            .iter()
            .find(|e| e.rel_path == Path::new("b/up"))
            .unwrap();
        assert_eq!(up.symlink_target.as_deref(), Some(Path::new("../a")));
        let skipped: Vec<(String, &str)> = tree
            .skipped
            .iter()
            .map(|s| (s.rel_path.to_string_lossy().into_owned(), s.reason))
            .collect();
        assert_eq!(
            skipped,
            [
                ("abs".to_string(), "absolute symlink"),
                ("b/out".to_string(), "symlink pointing outside the tree"),
                (
                    "fifo".to_string(),
                    "not a regular file, directory or symlink"
                ),
                ("parent".to_string(), "symlink pointing outside the tree"),
            ]
        );
        // Deterministic.
        assert_eq!(walk(&top).unwrap(), tree);
        // Same through a Root (server side), and the kept links recreate fine.
        let root = Root::open(t.path()).unwrap();
        let rt = root.walk("top").unwrap();
        assert_eq!(rt.entries, tree.entries);
        fs::create_dir(t.path().join("copy")).unwrap();
        for e in &rt.entries {
            let dst = format!("copy/{}", e.rel_path.display());
            match e.kind {
                Dir => drop(root.create_dir_all(&dst).unwrap()),
                Symlink => root
                    .symlink(&dst, e.symlink_target.as_ref().unwrap().to_str().unwrap())
                    .unwrap(),
                File => {}
            }
        }
        assert_eq!(
            fs::read_link(t.path().join("copy/b/in")).unwrap(),
            Path::new("deep/f")
        );
    }

    #[test]
    fn scp_destination_semantics() {
        let rd = |d: &str, is_dir, s: &str, multi| {
            resolve_destination(Path::new(d), is_dir, std::ffi::OsStr::new(s), multi)
        };
        // push f to existing dir: inside.
        assert_eq!(rd("dir", true, "f", false).unwrap(), Path::new("dir/f"));
        assert_eq!(rd("dir/", true, "f", false).unwrap(), Path::new("dir/f"));
        // push f to a new name: that name.
        assert_eq!(rd("new", false, "f", false).unwrap(), Path::new("new"));
        // host: (empty) is ".".
        assert_eq!(rd("", true, "f", false).unwrap(), Path::new("./f"));
        // multiple sources need an existing dir.
        assert_eq!(rd("dir", true, "g", true).unwrap(), Path::new("dir/g"));
        let e = rd("new", false, "f", true).unwrap_err();
        assert!(e.to_string().contains("multiple sources"), "{e}");
        // trailing slash on something that is not a dir: refused.
        let e = rd("new/", false, "f", false).unwrap_err();
        assert!(e.to_string().contains("ends with '/'"), "{e}");
        // source names must be plain.
        assert!(rd("dir", true, "..", false).is_err());
        assert!(rd("dir", true, "a/b", false).is_err());
    }
}

mod derived_digest {
    use super::*;
    use sha2::{Digest, Sha256};

    /// `bytes(range(256)) * 40`: 10240 bytes, three 4 KiB blocks (the last short).
    fn three_blocks() -> Vec<u8> {
        (0..40).flat_map(|_| 0..=255u8).collect()
    }

    /// The encoding of the module doc, built by hand and hashed with sha2.
    fn by_hand(len: u64, bs: u64, data: &[u8]) -> Sha256Digest {
        let mut m = Vec::new();
        m.extend_from_slice(b"rcp-file-digest-v1\0");
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(&bs.to_le_bytes());
        for c in data.chunks(bs as usize) {
            m.extend_from_slice(&Sha256::digest(c));
        }
        Sha256::digest(&m).into()
    }

    #[test]
    fn fixed_vectors() {
        // Computed outside rcp (Python hashlib over the same encoding), for
        // 4 MiB blocks.
        let bs = 4 << 20;
        let empty = "9f1acdb3774ddf11778345d0ff5d75903a18f16613e9f5b5b1f88cec1af37521";
        let abc = "21b9da15cee8ddb6fefcf8ef3620fb98fb81bdba6fab8be53ac8e057b042dda0";
        let three = "ad2c54291de4cda373467e37371f1057d085aba7ad3dc39ace41bc643e4a6e12";
        assert_eq!(digest::to_hex(&file_digest(0, bs, [])), empty);
        assert_eq!(digest::to_hex(&by_hand(0, bs, b"")), empty);
        assert_eq!(
            digest::to_hex(&file_digest(3, bs, [&block_digest(b"abc")])),
            abc
        );
        assert_eq!(digest::to_hex(&by_hand(3, bs, b"abc")), abc);
        let data = three_blocks();
        assert_eq!(digest::to_hex(&derived(&data, 4096)), three);
        assert_eq!(digest::to_hex(&by_hand(10240, 4096, &data)), three);
        let mut inc = FileDigest::new(10240, 4096);
        for c in data.chunks(4096) {
            inc.push(&block_digest(c));
        }
        assert_eq!(inc.blocks(), 3);
        assert_eq!(digest::to_hex(&inc.finish()), three);
    }

    #[test]
    fn order_length_and_block_size_count() {
        let data = three_blocks();
        let d: Vec<Sha256Digest> = data.chunks(4096).map(block_digest).collect();
        let base = file_digest(10240, 4096, &d);
        let swapped = [d[0], d[2], d[1]]; // blocks 0 and 1 are equal
        assert_ne!(file_digest(10240, 4096, &swapped), base);
        assert_ne!(file_digest(10241, 4096, &d), base);
        assert_ne!(file_digest(10240, 8192, &d), base);
        assert_ne!(file_digest(10240, 4096, &d[..2]), base);
        // The flat SHA-256 is another value altogether.
        assert_ne!(block_digest(&data), base);
    }

    /// A destination derives the same digest from its recorded blocks, and
    /// computes the flat SHA-256 only when asked, equal to sha2 over the file.
    #[test]
    fn destination_derives_it_and_flat_sha256_on_request() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = three_blocks();
        for flat in [false, true] {
            let o = DestinationOptions {
                block_size: 4096,
                flat_sha256: flat,
                ..Default::default()
            };
            let name = format!("f{flat}");
            let mut d = Destination::create(&dir, &name, data.len() as u64, o).unwrap();
            for (i, c) in data.chunks(4096).enumerate().rev() {
                assert_eq!(d.derived_digest(), None);
                d.write_block(i as u64, c, block_digest(c)).unwrap();
            }
            let want = by_hand(10240, 4096, &data);
            assert_eq!(d.derived_digest(), Some(want));
            let sealed = d.seal(want).unwrap();
            assert_eq!(sealed.derived_digest(), want);
            let p = sealed.publish().unwrap();
            assert_eq!(p.derived_digest, want);
            let on_disk: Sha256Digest = Sha256::digest(fs::read(&p.path).unwrap()).into();
            assert_eq!(p.flat_sha256, flat.then_some(on_disk));
            assert_eq!(
                digest::to_hex(&on_disk),
                "e96760a87768717bcebcfd25ddc7d46b4dbc95a4b0014def080c08539f7d90d0"
            );
        }
        // seal_flat needs the flat SHA-256 on; the destination is then
        // dropped (not resumable: removed).
        let mut d = Destination::create(&dir, "g", 3, DestinationOptions::default()).unwrap();
        d.write_block(0, b"abc", block_digest(b"abc")).unwrap();
        assert!(matches!(
            d.seal_flat(block_digest(b"abc")),
            Err(FileError::Destination { .. })
        ));
        assert_eq!(names(t.path()), ["ffalse", "ftrue"]);
    }
}

mod batch {
    use super::*;

    fn resumable(len: u64, bs: u64, seed: u8) -> DestinationOptions {
        DestinationOptions {
            block_size: bs,
            resume: Some(SourceId {
                len,
                mtime: Timestamp::default(),
                fingerprint: [seed; 32],
            }),
            ..Default::default()
        }
    }

    /// A destination for `name` holding all of `data`.
    fn filled(dir: &DirHandle, name: &str, data: &[u8], o: DestinationOptions) -> Destination {
        let bs = o.block_size as usize;
        let mut d = Destination::create(dir, name, data.len() as u64, o).unwrap();
        for (i, c) in data.chunks(bs).enumerate() {
            d.write_block(i as u64, c, block_digest(c)).unwrap();
        }
        d
    }

    #[test]
    fn hundred_files_one_bad_digest() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let sub = t.path().join("sub");
        fs::create_dir(&sub).unwrap();
        let subdir = DirHandle::open(&sub).unwrap();
        const BAD: usize = 37;
        let bs = 4096u64;
        let mut sealed = Vec::new();
        let mut want = Vec::new();
        for i in 0..100usize {
            // Empty, one-block and multi-block files, resumable or not, in
            // two directories.
            let data = pattern([0, 100, 4096, 9000, 20_000][i % 5], i as u64);
            let o = if i % 2 == 0 {
                resumable(data.len() as u64, bs, i as u8)
            } else {
                DestinationOptions {
                    block_size: bs,
                    ..Default::default()
                }
            };
            let d = if i % 3 == 0 { &subdir } else { &dir };
            let name = format!("f{i:03}");
            let dest = filled(d, &name, &data, o);
            if i == BAD {
                let e = dest.seal(block_digest(b"not it")).unwrap_err();
                assert!(matches!(e, FileError::DigestMismatch { .. }), "{e}");
                assert!(e.to_string().contains("derived file digest"), "{e}");
                continue;
            }
            sealed.push(dest.seal(derived(&data, bs)).unwrap());
            want.push((d.display().join(&name), data));
        }
        // Sealed is not published: nothing under a final name yet.
        for (path, _) in &want {
            assert!(!path.exists(), "{path:?} visible before publish");
        }
        let results = publish(sealed);
        assert_eq!(results.len(), 99);
        for (r, (path, data)) in results.into_iter().zip(&want) {
            let p = r.unwrap();
            assert_eq!(&p.path, path);
            assert_eq!(p.len, data.len() as u64);
            assert_eq!(p.derived_digest, derived(data, bs));
            assert_eq!(p.flat_sha256, None);
            assert_eq!(&fs::read(path).unwrap(), data);
        }
        // The bad one never appeared; no temp file or manifest is left.
        let all: Vec<String> = names(t.path()).into_iter().chain(names(&sub)).collect();
        assert_eq!(all.len(), 99 + 1, "{all:?}"); // + "sub"
        assert!(!all.iter().any(|n| n.starts_with(".rcp-")), "{all:?}");
        assert!(!all.contains(&format!("f{BAD:03}")));
    }

    /// A directory appears under a final name between seal and publish: that
    /// file fails alone, keeping its temp and manifest if it is resumable, and
    /// the directory is untouched.
    #[test]
    fn final_name_is_a_directory() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let bs = 4096u64;
        let a = pattern(10_000, 1);
        let b = pattern(10_000, 2);
        let c = pattern(100, 3);
        let sa = filled(&dir, "a", &a, resumable(10_000, bs, 1))
            .seal(derived(&a, bs))
            .unwrap();
        let sb = filled(&dir, "b", &b, resumable(10_000, bs, 2))
            .seal(derived(&b, bs))
            .unwrap();
        let c_opts = DestinationOptions {
            block_size: bs,
            ..Default::default()
        };
        let sc = filled(&dir, "c", &c, c_opts.clone())
            .seal(derived(&c, bs))
            .unwrap();
        let b_temp = sb.temp_path();
        fs::create_dir(t.path().join("b")).unwrap();
        fs::write(t.path().join("b/inside"), "x").unwrap();
        let r = publish(vec![sa, sb, sc]);
        assert_eq!(r[0].as_ref().unwrap().path, t.path().join("a"));
        assert!(
            matches!(&r[1], Err(FileError::IsADirectory { path }) if *path == t.path().join("b")),
            "{:?}",
            r[1]
        );
        assert_eq!(r[2].as_ref().unwrap().len, 100);
        assert_eq!(fs::read(t.path().join("a")).unwrap(), a);
        assert_eq!(fs::read(t.path().join("c")).unwrap(), c);
        assert_eq!(names(&t.path().join("b")), ["inside"]);
        // b is resumable: its temp and manifest wait for a resume.
        let n = names(t.path());
        assert_eq!(n.len(), 5, "{n:?}");
        assert!(b_temp.exists());
        let src = SourceId {
            len: 10_000,
            mtime: Timestamp::default(),
            fingerprint: [2; 32],
        };
        fs::remove_dir_all(t.path().join("b")).unwrap();
        let d = Destination::resume(&dir, "b", &src, resumable(10_000, bs, 2))
            .unwrap()
            .expect("kept for resume");
        assert!(d.missing_blocks().is_empty());
        d.commit(derived(&b, bs)).unwrap();
        assert_eq!(fs::read(t.path().join("b")).unwrap(), b);
        // Not resumable: the temp file goes.
        let sc = filled(&dir, "d", &c, c_opts).seal(derived(&c, bs)).unwrap();
        fs::create_dir(t.path().join("d")).unwrap();
        assert!(matches!(sc.publish(), Err(FileError::IsADirectory { .. })));
        assert_eq!(names(t.path()), ["a", "b", "c", "d"]);
    }

    /// Runs in a child process (see `killed_between_write_and_rename`): a
    /// batch of small files written and sealed (every block verified, the
    /// file digests matched), then killed by SIGKILL before `publish`, as a
    /// receiver that batches its syncs and renames is between the two.
    /// Ignored: not a test of its own; the parent runs it with `--ignored`.
    #[test]
    #[ignore = "the child process of killed_between_write_and_rename, run by it"]
    fn child_batch_writer() {
        let dir = child_env(
            "RCP_FILES_BATCH_CHILD_DIR",
            "killed_between_write_and_rename",
        );
        let dir = DirHandle::open(dir).unwrap();
        let mut sealed = Vec::new();
        for i in 0..BATCH_KILLED {
            let data = pattern(16 << 10, 80 + i as u64);
            let o = DestinationOptions {
                block_size: 4096,
                ..Default::default()
            };
            let name = format!("f{i:02}");
            sealed.push(
                filled(&dir, &name, &data, o)
                    .seal(derived(&data, 4096))
                    .unwrap(),
            );
        }
        let _ = std::process::Command::new("kill")
            .args(["-9", &std::process::id().to_string()])
            .status();
        std::thread::sleep(std::time::Duration::from_secs(60));
        drop(sealed);
        unreachable!("not killed");
    }

    const BATCH_KILLED: usize = 24;

    /// The durability rule for a batch: files whose bytes are written and
    /// verified but not yet published (synced, then renamed) are not under
    /// their final names when the process dies, and an older file under one
    /// of those names is untouched.
    #[test]
    fn killed_between_write_and_rename() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f03"), "old").unwrap();
        let st = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "batch::child_batch_writer",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RCP_FILES_BATCH_CHILD_DIR", t.path())
            .status()
            .unwrap();
        assert!(!st.success(), "the child should have been killed");
        let n = names(t.path());
        // The old file, and a temp file for each of the batch (one block
        // of 16 KiB at 4 KiB blocks keeps a manifest only when resumable:
        // these are not).
        assert_eq!(fs::read(t.path().join("f03")).unwrap(), b"old");
        let temps: Vec<_> = n.iter().filter(|n| n.ends_with(".part")).collect();
        assert_eq!(temps.len(), BATCH_KILLED, "{n:?}");
        for i in 0..BATCH_KILLED {
            let name = format!("f{i:02}");
            if i != 3 {
                assert!(!t.path().join(&name).exists(), "{name} published: {n:?}");
            }
        }
        assert_eq!(n.len(), BATCH_KILLED + 1, "{n:?}");
    }

    /// Sealed files dropped before `publish` (a batch abandoned between
    /// write and rename) leave nothing behind, under any name.
    #[test]
    fn dropped_batch_leaves_nothing_under_the_final_names() {
        let t = tempfile::tempdir().unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        fs::write(t.path().join("g1"), "old").unwrap();
        let sealed: Vec<_> = (0..8)
            .map(|i| {
                let data = pattern(9000, 90 + i as u64);
                let o = DestinationOptions {
                    block_size: 4096,
                    ..Default::default()
                };
                filled(&dir, &format!("g{i}"), &data, o)
                    .seal(derived(&data, 4096))
                    .unwrap()
            })
            .collect();
        assert_eq!(names(t.path()).len(), 9);
        drop(sealed);
        assert_eq!(names(t.path()), ["g1"]);
        assert_eq!(fs::read(t.path().join("g1")).unwrap(), b"old");
    }

    /// Files on two file systems in one batch (a syncfs each, or an fdatasync
    /// for a file alone on its file system).
    #[test]
    fn batch_across_file_systems() {
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let t = tempfile::tempdir().unwrap();
        let dirs = [
            DirHandle::open(t.path()).unwrap(),
            DirHandle::open(shm.path()).unwrap(),
        ];
        let mut sealed = Vec::new();
        let mut want = Vec::new();
        // Three files on the first, one on the second.
        for (i, d) in [0, 0, 1, 0].into_iter().enumerate() {
            let data = pattern(5000 + i, 40 + i as u64);
            let o = DestinationOptions {
                block_size: 4096,
                ..Default::default()
            };
            let name = format!("x{i}");
            sealed.push(
                filled(&dirs[d], &name, &data, o)
                    .seal(derived(&data, 4096))
                    .unwrap(),
            );
            want.push((dirs[d].display().join(name), data));
        }
        for (r, (path, data)) in publish(sealed).into_iter().zip(want) {
            assert_eq!(r.unwrap().path, path);
            assert_eq!(fs::read(&path).unwrap(), data);
        }
        assert!(publish(Vec::new()).is_empty());
    }

    /// At most one block: no manifest ever, even with resume on; such a file is
    /// removed, not suspended. More blocks: a manifest from the start.
    #[test]
    fn single_block_files_keep_no_manifest() {
        // tmpfs: a file system with O_TMPFILE wherever the tests run.
        let t = tempfile::tempdir_in("/dev/shm").unwrap();
        let dir = DirHandle::open(t.path()).unwrap();
        let len = 16 << 10;
        let data = pattern(len, 50);
        let o = resumable(len as u64, DEFAULT_BLOCK_SIZE, 5);
        let mut d = Destination::create(&dir, "small", len as u64, o.clone()).unwrap();
        assert!(!d.keeps_manifest());
        // Where nothing stands, its temp file has no name (O_TMPFILE).
        assert!(names(t.path()).is_empty(), "{:?}", names(t.path()));
        d.write_block(0, &data, block_digest(&data)).unwrap();
        assert!(names(t.path()).is_empty(), "{:?}", names(t.path()));
        drop(d); // interrupted: nothing to resume, nothing left
        assert!(names(t.path()).is_empty());
        let src = o.resume.unwrap();
        assert!(Destination::resume(&dir, "small", &src, o.clone())
            .unwrap()
            .is_none());
        let d = Destination::create(&dir, "small", len as u64, o.clone()).unwrap();
        d.suspend().unwrap();
        assert!(names(t.path()).is_empty());
        let mut d = Destination::create(&dir, "small", len as u64, o.clone()).unwrap();
        d.write_block(0, &data, block_digest(&data)).unwrap();
        let p = d.commit(derived(&data, DEFAULT_BLOCK_SIZE)).unwrap();
        assert_eq!(fs::read(&p.path).unwrap(), data);
        assert_eq!(names(t.path()), ["small"]);
        // Empty files too.
        let e = Destination::create(&dir, "empty", 0, resumable(0, 4096, 6)).unwrap();
        assert!(!e.keeps_manifest());
        assert_eq!(names(t.path()), ["small"]);
        drop(e);
        // Over an existing file, a named temp beside it, the file untouched.
        let d = Destination::create(&dir, "small", len as u64, o.clone()).unwrap();
        let n = names(t.path());
        assert!(n.len() == 2 && n[0].ends_with(".part"), "{n:?}");
        drop(d);
        assert_eq!(names(t.path()), ["small"]);
        // Two blocks: the manifest is there right after create.
        let two = resumable(8192, 4096, 7);
        let d = Destination::create(&dir, "two", 8192, two).unwrap();
        assert!(d.keeps_manifest());
        let n = names(t.path());
        assert!(n.iter().any(|n| n.ends_with(".part.manifest")), "{n:?}");
        d.abort();
        assert_eq!(names(t.path()), ["small"]);
    }
}

/// The hashing pool: sized once, lives on (runs in a child process, so that
/// no other test has created the pool first).
mod pool {
    use super::*;

    /// Ids of this process's threads named `rcp-digest-*`.
    fn digest_threads() -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir("/proc/self/task")
            .unwrap()
            .map(|t| t.unwrap().path())
            .filter(|t| {
                fs::read_to_string(t.join("comm")).is_ok_and(|c| c.starts_with("rcp-digest-"))
            })
            .map(|t| t.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Runs in a child process (see `pool_is_sized_once_and_lives_on`): a
    /// fresh process whose pool nothing has sized yet. Ignored: not a test
    /// of its own; the parent runs it with `--ignored`.
    #[test]
    #[ignore = "the child process of pool_is_sized_once_and_lives_on, run by it"]
    fn child_pool() {
        child_env("RCP_FILES_POOL_CHILD", "pool_is_sized_once_and_lives_on");
        assert!(digest_threads().is_empty());
        set_pool_threads(3).unwrap();
        assert_eq!(digest::pool_threads(), 3);
        // The threads name themselves once they first run (later on a busy
        // machine).
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while digest_threads().len() < 3 && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let threads = digest_threads();
        assert_eq!(threads.len(), 3, "{threads:?}");
        let data: Vec<Vec<u8>> = (0..20u8).map(|i| vec![i; 10_000]).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        for _ in 0..5 {
            let got = digest_blocks_parallel(&refs);
            assert_eq!(
                got,
                refs.iter().map(|b| block_digest(b)).collect::<Vec<_>>()
            );
            let (got, side) = digests_alongside(&refs, || 7);
            assert_eq!((got.len(), side), (20, 7));
        }
        // The same three threads served every call.
        assert_eq!(digest_threads(), threads);
        assert!(matches!(
            set_pool_threads(2),
            Err(DigestError::PoolStarted { threads: 3 })
        ));
        println!("POOL-CHILD-OK");
    }

    #[test]
    fn pool_is_sized_once_and_lives_on() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "pool::child_pool",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RCP_FILES_POOL_CHILD", "1")
            .output()
            .unwrap();
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && so.contains("POOL-CHILD-OK"),
            "{so}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `O_DIRECT` writes of a destination: aligned blocks go direct where the file
/// system takes them (ext4 under /var/tmp here), the rest buffered, the bytes the
/// same either way, and buffered reads of the temp file see what went direct.
mod direct_writes {
    use super::*;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    const BS: usize = 16 * 1024;

    /// `len` bytes of `pattern(len, seed)` starting at a 4096-aligned address, as
    /// in registered memory (safe: align_offset).
    struct Aligned {
        storage: Vec<u8>,
        off: usize,
        len: usize,
    }

    impl Aligned {
        fn new(len: usize, seed: u64) -> Aligned {
            let mut storage = vec![0u8; len + DIRECT_ALIGN];
            let off = storage.as_ptr().align_offset(DIRECT_ALIGN);
            storage[off..off + len].copy_from_slice(&pattern(len, seed));
            Aligned { storage, off, len }
        }
        fn bytes(&self) -> &[u8] {
            &self.storage[self.off..self.off + self.len]
        }
    }

    /// Whether `dir` takes an aligned `O_DIRECT` write at all (probed apart from
    /// the code under test).
    fn takes_o_direct(dir: &Path) -> bool {
        let p = dir.join("probe");
        let Ok(f) = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
        else {
            return false;
        };
        let buf = Aligned::new(4096, 1);
        let ok = f.write_at(buf.bytes(), 0).is_ok();
        let _ = fs::remove_file(&p);
        ok
    }

    fn opts(direct_io: bool) -> DestinationOptions {
        DestinationOptions {
            block_size: BS as u64,
            direct_io,
            ..Default::default()
        }
    }

    /// Write every block of `data` (shuffled) into a new destination `name`.
    fn write_all(dir: &DirHandle, name: &str, data: &[u8], o: DestinationOptions) -> Destination {
        let mut d = Destination::create(dir, name, data.len() as u64, o).unwrap();
        let mut idx: Vec<u64> = (0..d.block_count()).collect();
        shuffle(&mut idx, 5);
        for i in idx {
            let b = &data[i as usize * BS..(i as usize * BS + BS).min(data.len())];
            d.write_block(i, b, block_digest(b)).unwrap();
        }
        d
    }

    fn var_tmp() -> tempfile::TempDir {
        tempfile::tempdir_in("/var/tmp").unwrap()
    }

    #[test]
    fn aligned_blocks_go_direct_the_short_last_one_buffered() {
        let t = var_tmp();
        let direct = takes_o_direct(t.path());
        eprintln!("/var/tmp takes O_DIRECT: {direct}");
        let dir = DirHandle::open(t.path()).unwrap();
        // 5 full blocks and a short one of 1234 bytes.
        let data = Aligned::new(5 * BS + 1234, 41);
        let d = write_all(&dir, "f", data.bytes(), opts(true));
        let s = d.write_stats();
        eprintln!("{s:?} {:?} {:?}", d.write_mode(), d.direct_unavailable());
        assert_eq!(s.direct_writes + s.buffered_writes, 6);
        if direct {
            assert_eq!(
                d.write_mode(),
                IoMode::Direct,
                "{:?}",
                d.direct_unavailable()
            );
            assert_eq!(s.direct_writes, 5, "{s:?}");
            assert_eq!(s.buffered_writes, 1, "the short last block: {s:?}");
        }
        let p = d.commit(derived(data.bytes(), BS as u64)).unwrap();
        assert_eq!(p.len, data.len as u64);
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data.bytes());

        // A last block whose length is aligned goes direct too.
        let data = Aligned::new(3 * BS + 8192, 42);
        let d = write_all(&dir, "g", data.bytes(), opts(true));
        if direct {
            assert_eq!(d.write_stats().direct_writes, 4, "{:?}", d.write_stats());
        }
        d.commit(derived(data.bytes(), BS as u64)).unwrap();
        assert_eq!(fs::read(t.path().join("g")).unwrap(), data.bytes());
    }

    #[test]
    fn data_equal_direct_or_buffered() {
        let t = var_tmp();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = Aligned::new(7 * BS + 4097, 43);
        for (name, on) in [("on", true), ("off", false)] {
            let d = write_all(&dir, name, data.bytes(), opts(on));
            if !on {
                assert_eq!(d.write_stats().direct_writes, 0);
                assert!(d.direct_unavailable().unwrap().contains("off"));
            }
            d.commit(derived(data.bytes(), BS as u64)).unwrap();
        }
        assert_eq!(fs::read(t.path().join("on")).unwrap(), data.bytes());
        assert_eq!(
            fs::read(t.path().join("on")).unwrap(),
            fs::read(t.path().join("off")).unwrap()
        );
    }

    #[test]
    fn unaligned_buffers_are_written_buffered() {
        let t = var_tmp();
        let dir = DirHandle::open(t.path()).unwrap();
        // The same bytes one past an aligned address.
        let mut storage = vec![0u8; 4 * BS + 1 + DIRECT_ALIGN];
        let off = storage.as_ptr().align_offset(DIRECT_ALIGN) + 1;
        let data = &mut storage[off..off + 4 * BS];
        data.copy_from_slice(&pattern(4 * BS, 44));
        let d = write_all(&dir, "u", data, opts(true));
        assert_eq!(d.write_stats().direct_writes, 0, "{:?}", d.write_stats());
        d.commit(derived(data, BS as u64)).unwrap();
        assert_eq!(fs::read(t.path().join("u")).unwrap(), &data[..]);
    }

    #[test]
    fn tmpfs_falls_back_to_buffered() {
        let Ok(t) = tempfile::tempdir_in("/dev/shm") else {
            eprintln!("no /dev/shm: skipped");
            return;
        };
        let dir = DirHandle::open(t.path()).unwrap();
        let data = Aligned::new(4 * BS + 100, 45);
        let d = write_all(&dir, "f", data.bytes(), opts(true));
        let s = d.write_stats();
        eprintln!("tmpfs: {s:?} ({:?})", d.direct_unavailable());
        assert_eq!(d.write_mode(), IoMode::Buffered);
        assert_eq!(s.direct_writes, 0);
        assert_eq!(s.buffered_writes, 5);
        assert!(d.direct_unavailable().is_some());
        d.commit(derived(data.bytes(), BS as u64)).unwrap();
        assert_eq!(fs::read(t.path().join("f")).unwrap(), data.bytes());
    }

    #[test]
    fn one_block_file_stays_buffered() {
        let t = var_tmp();
        let dir = DirHandle::open(t.path()).unwrap();
        let data = Aligned::new(BS, 46);
        let d = write_all(&dir, "one", data.bytes(), opts(true));
        assert_eq!(d.write_stats().direct_writes, 0);
        assert_eq!(d.write_stats().buffered_writes, 1);
        d.commit(derived(data.bytes(), BS as u64)).unwrap();
        assert_eq!(fs::read(t.path().join("one")).unwrap(), data.bytes());
    }

    /// Pages of the temp file cached before a direct write of their range do not
    /// hide it: a buffered read afterwards, the flat SHA-256's re-reads and a
    /// resume's re-check all see the new bytes.
    #[test]
    fn buffered_reads_see_direct_writes() {
        let t = var_tmp();
        let dir = DirHandle::open(t.path()).unwrap();
        let n = 8;
        let data = Aligned::new(n * BS, 47);
        let source = SourceId {
            len: data.len as u64,
            mtime: Timestamp::default(),
            fingerprint: [9; 32],
        };
        let o = DestinationOptions {
            flat_sha256: true,
            // Nothing held back in memory: every out-of-order piece is read
            // again from the temp file.
            max_pending_digest_bytes: 0,
            resume: Some(source),
            manifest_every_blocks: 1,
            ..opts(true)
        };
        let mut d = Destination::create(&dir, "c", data.len as u64, o.clone()).unwrap();
        // Cache the (zero) pages of the whole temp file first.
        let before = fs::read(d.temp_path()).unwrap();
        assert!(before.iter().all(|&b| b == 0));
        let block = |i: usize| &data.bytes()[i * BS..(i + 1) * BS];
        // Reverse order: the flat digest re-reads each piece when its turn comes.
        for i in (n / 2..n).rev() {
            d.write_block(i as u64, block(i), block_digest(block(i)))
                .unwrap();
        }
        let mid = fs::read(d.temp_path()).unwrap();
        assert_eq!(&mid[n / 2 * BS..], &data.bytes()[n / 2 * BS..]);
        // Interrupted here: the resume re-reads (buffered) what went direct.
        drop(d);
        let mut d = Destination::resume(&dir, "c", &source, o).unwrap().unwrap();
        assert_eq!(d.missing_blocks(), (0..n as u64 / 2).collect::<Vec<_>>());
        for i in (0..n / 2).rev() {
            d.write_block(i as u64, block(i), block_digest(block(i)))
                .unwrap();
        }
        let s = d.write_stats();
        if takes_o_direct(t.path()) {
            assert_eq!(s.direct_writes, n as u64 / 2, "{s:?}");
        }
        let p = d.commit_flat(block_digest(data.bytes())).unwrap();
        assert_eq!(p.flat_sha256, Some(block_digest(data.bytes())));
        assert_eq!(fs::read(t.path().join("c")).unwrap(), data.bytes());
    }
}
