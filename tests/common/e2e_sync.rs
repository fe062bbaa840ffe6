//! End-to-end scenarios of keeping a tree in sync, rsync's habits: what is
//! unchanged at the destination is skipped (the quick check, `-c`, `-u`,
//! `--ignore-existing`), `-I` moves everything, `--delta` moves only the
//! blocks that differ; push and pull alike, over every transport
//! ([`crate::e2e_tests!`]). Counts come from `--json`'s summary; that a
//! rerun opened no session, from rcpd's log.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::e2e::tmp_with_root;
use super::*;

/// One side of a scenario: a tree copied by push (local source, remote
/// destination) or by pull (remote source, local destination).
pub struct Synced {
    _tmp: tempfile::TempDir,
    pub d: Rcpd,
    pub t: String,
    pub push: bool,
    /// The tree copied, and where its copy lands.
    pub src: PathBuf,
    pub dst: PathBuf,
    /// Files of the tree, relative to it.
    pub files: Vec<PathBuf>,
}

impl Synced {
    /// A tree of `n` files of a few KiB in subdirectories, copied once with
    /// `-r -p`.
    pub fn new(t: &str, push: bool, n: u64) -> Synced {
        let (tmp, root) = tmp_with_root();
        let d = Rcpd::start(&root, t, None, &[]);
        let local = tmp.path().join("local");
        std::fs::create_dir(&local).unwrap();
        let (src, dst) = if push {
            (local.join("tree"), root.join("tree"))
        } else {
            (root.join("tree"), local.join("tree"))
        };
        let mut files = Vec::new();
        for i in 0..n {
            let rel = PathBuf::from(format!("d{}", i % 3)).join(format!("f{i}"));
            std::fs::create_dir_all(src.join(&rel).parent().unwrap()).unwrap();
            make_file(&src.join(&rel), 3000 + i * 100, i + 1);
            files.push(rel);
        }
        let s = Synced {
            _tmp: tmp,
            d,
            t: t.to_string(),
            push,
            src,
            dst,
            files,
        };
        let first = s.copy(&["-p"]);
        assert_eq!(first["files"], n, "{first}");
        s
    }

    /// `rcp push|pull -r --json ARGS` of the tree; its summary line.
    pub fn copy(&self, args: &[&str]) -> serde_json::Value {
        let (sub, from, to) = if self.push {
            let from = self.src.to_str().unwrap().to_string();
            (
                "push",
                from,
                remote(
                    self.dst
                        .parent()
                        .unwrap()
                        .strip_prefix(&self.d.root)
                        .unwrap()
                        .to_str()
                        .unwrap(),
                ),
            )
        } else {
            (
                "pull",
                remote("tree"),
                self.dst.parent().unwrap().to_str().unwrap().to_string(),
            )
        };
        let mut a = vec![sub, "-r", "--json"];
        a.extend_from_slice(args);
        a.extend([from.as_str(), to.as_str()]);
        let r = rcp(self.d.port, &self.t, None, &a);
        assert_eq!(
            r.code,
            0,
            "{a:?}: {}{}\n{}",
            r.stdout,
            r.stderr,
            self.d.log()
        );
        summary(&r.stdout)
    }

    /// Sessions rcpd opened so far (its log's "session opened" lines).
    pub fn sessions(&self) -> usize {
        self.d.log().matches("session opened").count()
    }

    pub fn src(&self, i: usize) -> PathBuf {
        self.src.join(&self.files[i])
    }

    pub fn dst(&self, i: usize) -> PathBuf {
        self.dst.join(&self.files[i])
    }

    /// Whether file `i`'s copy holds what its source does.
    pub fn same(&self, i: usize) -> bool {
        std::fs::read(self.src(i)).unwrap() == std::fs::read(self.dst(i)).unwrap()
    }
}

/// The `summary` line of `--json` output.
pub fn summary(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["type"] == "summary")
        .unwrap_or_else(|| panic!("no summary line in {stdout}"))
}

/// Set `p`'s modification time.
pub fn set_mtime(p: &Path, t: SystemTime) {
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

fn mtime(p: &Path) -> SystemTime {
    std::fs::metadata(p).unwrap().modified().unwrap()
}

/// Overwrite `p` with other bytes of the same length, keeping its mtime.
fn same_size_other_bytes(p: &Path) {
    let t = mtime(p);
    let mut b = std::fs::read(p).unwrap();
    for x in b.iter_mut().take(100) {
        *x = !*x;
    }
    std::fs::write(p, &b).unwrap();
    set_mtime(p, t);
}

/// A rerun of an unchanged `-p` tree moves nothing and opens no session;
/// a file of another size or mtime moves again; `-I` moves every file.
pub fn rerun_skips_what_is_unchanged(t: &str, push: bool) {
    let n = 12;
    let s = Synced::new(t, push, n);
    let before = s.sessions();
    assert!(before >= 1, "the first copy opened a session");
    let r = s.copy(&["-p"]);
    assert_eq!(r["skipped"], n, "{r}");
    assert_eq!(r["files"], 0, "{r}");
    assert_eq!(r["moved"], 0, "{r}");
    assert!(r["transport"].is_null(), "{r}");
    assert_eq!(
        s.sessions(),
        before,
        "a rerun with nothing to move opened a session"
    );

    // Another size; another mtime.
    std::fs::OpenOptions::new()
        .append(true)
        .open(s.src(0))
        .unwrap()
        .write_all(b"more")
        .unwrap();
    set_mtime(&s.src(1), mtime(&s.src(1)) + Duration::from_secs(1000));
    let want =
        std::fs::metadata(s.src(0)).unwrap().len() + std::fs::metadata(s.src(1)).unwrap().len();
    let r = s.copy(&["-p"]);
    assert_eq!(r["files"], 2, "{r}");
    assert_eq!(r["skipped"], n - 2, "{r}");
    assert_eq!(r["moved"], want, "{r}");
    assert!(s.same(0) && s.same(1));
    assert_eq!(mtime(&s.dst(1)), mtime(&s.src(1)), "-p kept the new mtime");

    // -I: never skip on the quick check.
    let r = s.copy(&["-p", "-I"]);
    assert_eq!(r["files"], n, "{r}");
    assert_eq!(r["skipped"], 0, "{r}");
}

/// `-u` keeps a destination newer than its source; `--ignore-existing`
/// keeps whatever exists and copies only what is missing.
pub fn update_and_ignore_existing(t: &str, push: bool) {
    let n = 6;
    let s = Synced::new(t, push, n);
    // File 0: changed at the source, but newer at the destination.
    same_size_other_bytes(&s.src(0));
    set_mtime(&s.src(0), SystemTime::now());
    set_mtime(&s.dst(0), SystemTime::now() + Duration::from_secs(3600));
    // File 1: older at the destination, changed: -u copies it.
    std::fs::write(s.src(1), b"newer at the source").unwrap();
    set_mtime(&s.src(1), SystemTime::now() + Duration::from_secs(60));
    let r = s.copy(&["-p", "-u"]);
    assert_eq!(r["files"], 1, "{r}");
    assert_eq!(r["skipped"], n - 1, "{r}");
    assert!(!s.same(0), "-u overwrote a newer destination");
    assert!(s.same(1));

    // --ignore-existing: a new file goes, a changed existing one stays.
    let new = s.src.join("d0/new");
    std::fs::write(&new, b"a new file").unwrap();
    std::fs::write(s.src(2), b"changed").unwrap();
    let r = s.copy(&["-p", "--ignore-existing"]);
    assert_eq!(r["files"], 1, "{r}");
    assert_eq!(r["moved"], 10, "{r}");
    assert_eq!(r["skipped"], n, "{r}");
    assert_eq!(std::fs::read(s.dst.join("d0/new")).unwrap(), b"a new file");
    assert!(!s.same(2), "--ignore-existing overwrote an existing file");
    // Without it the quick check sees the change.
    let r = s.copy(&["-p"]);
    assert_eq!(r["files"], 2, "{r}");
    assert!(s.same(0) && s.same(2));
}

/// `-c` finds a change of content that kept size and mtime, which the
/// quick check cannot see.
pub fn checksum_finds_a_same_size_change(t: &str, push: bool) {
    let n = 5;
    let s = Synced::new(t, push, n);
    same_size_other_bytes(&s.src(3));
    let r = s.copy(&["-p"]);
    assert_eq!(r["skipped"], n, "the quick check is fooled: {r}");
    assert!(!s.same(3));
    let before = s.sessions();
    let r = s.copy(&["-p", "-c"]);
    assert_eq!(r["files"], 1, "{r}");
    assert_eq!(r["skipped"], n - 1, "{r}");
    assert_eq!(
        r["moved"],
        std::fs::metadata(s.src(3)).unwrap().len(),
        "{r}"
    );
    assert!(s.same(3));
    assert_eq!(s.sessions(), before + 1);
    // Nothing differs now: -c moves nothing, and opens no session.
    let r = s.copy(&["-p", "-c"]);
    assert_eq!(r["skipped"], n, "{r}");
    assert_eq!(s.sessions(), before + 1);
}

/// `--delta` of a file with one changed block moves that block, and the
/// copy matches the source; `--resume` of a finished, unchanged file (no
/// `-p`: the quick check would copy it) moves nothing.
pub fn delta_moves_only_the_changed_block(t: &str, push: bool) {
    const BS: u64 = 64 << 10;
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, &[]);
    let local = tmp.path().join("local");
    std::fs::create_dir(&local).unwrap();
    let (src, dst) = if push {
        (local.join("f"), root.join("f"))
    } else {
        (root.join("f"), local.join("f"))
    };
    let len = 16 * BS + 1000;
    make_file(&src, len, 7);
    let run = |args: &[&str]| {
        let (sub, from, to) = if push {
            ("push", src.to_str().unwrap().to_string(), remote("f"))
        } else {
            ("pull", remote("f"), dst.to_str().unwrap().to_string())
        };
        let mut a = vec![sub, "--json", "--block-size", "64K"];
        a.extend_from_slice(args);
        a.extend([from.as_str(), to.as_str()]);
        let r = rcp(d.port, t, None, &a);
        assert_eq!(r.code, 0, "{a:?}: {}{}\n{}", r.stdout, r.stderr, d.log());
        summary(&r.stdout)
    };
    let r = run(&[]);
    assert_eq!(r["moved"], len, "{r}");
    // One block changes in the middle, the size does not.
    let mut b = std::fs::read(&src).unwrap();
    for x in &mut b[(5 * BS + 10) as usize..(5 * BS + 500) as usize] {
        *x = !*x;
    }
    std::fs::write(&src, &b).unwrap();
    // An mtime of its own: the file system's clock is coarse (a tick of
    // a few ms), so a rewrite may carry the very mtime the first copy's
    // destination got, and the quick check would (rightly) skip it.
    set_mtime(
        &src,
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000),
    );
    let r = run(&["--delta"]);
    assert_eq!(r["files"], 1, "{r}");
    assert_eq!(r["moved"], BS, "one block moves: {r}");
    assert_eq!(sha256sum(&dst), sha256sum(&src));
    // Nothing changed since: --resume moves nothing (and commits the same
    // file again).
    let r = run(&["--resume"]);
    assert_eq!(r["files"], 1, "{r}");
    assert_eq!(r["moved"], 0, "{r}");
    assert_eq!(sha256sum(&dst), sha256sum(&src));
    // Without --delta, every block moves.
    let r = run(&[]);
    assert_eq!(r["moved"], len, "{r}");
    // Grown at its end: only its last block, now longer, moves (the old
    // copy's is short).
    let mut grown = b.clone();
    grown.extend((0..40_000u32).map(|i| (i % 251) as u8));
    std::fs::write(&src, &grown).unwrap();
    let r = run(&["--delta"]);
    assert_eq!(
        r["moved"],
        grown.len() as u64 - 16 * BS,
        "the last block moves: {r}"
    );
    assert_eq!(sha256sum(&dst), sha256sum(&src));
    // Cut inside a block: the new last block's bytes are the start of the
    // old copy's, so nothing moves.
    std::fs::write(&src, &grown[..(10 * BS + 5) as usize]).unwrap();
    let r = run(&["--delta"]);
    assert_eq!(r["moved"], 0, "a truncated file moves nothing: {r}");
    assert_eq!(sha256sum(&dst), sha256sum(&src));
    // No partial file or manifest is left beside the copy.
    for e in std::fs::read_dir(dst.parent().unwrap()).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.starts_with('.'), "left behind: {n}");
    }
}

/// `pull --delta` and `pull --resume` to a bare local name (`./f` an
/// existing file, no directory written): the directory is the current
/// one, as a plain pull takes it; the copy matches the source.
pub fn pull_delta_to_a_bare_local_name(t: &str) {
    const BS: u64 = 64 << 10;
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, &[]);
    let cwd = tmp.path().join("local");
    std::fs::create_dir(&cwd).unwrap();
    let (src, dst) = (root.join("f"), cwd.join("ldr"));
    let len = 8 * BS + 100;
    make_file(&src, len, 7);
    let run = |args: &[&str]| {
        let mut a = vec!["pull", "--json", "--block-size", "64K"];
        a.extend_from_slice(args);
        let from = remote("f");
        a.extend([from.as_str(), "ldr"]);
        let out = rcp_cmd(d.port, t, None, &a)
            .current_dir(&cwd)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{a:?}: {stdout}{stderr}\n{}",
            d.log()
        );
        summary(&stdout)
    };
    let r = run(&[]);
    assert_eq!(r["moved"], len, "{r}");
    let mut b = std::fs::read(&src).unwrap();
    for x in &mut b[(3 * BS + 10) as usize..(3 * BS + 20) as usize] {
        *x = !*x;
    }
    std::fs::write(&src, &b).unwrap();
    let r = run(&["--delta"]);
    assert_eq!(r["moved"], BS, "one block moves: {r}");
    assert_eq!(sha256sum(&dst), sha256sum(&src));
    let r = run(&["--resume"]);
    assert_eq!(r["moved"], 0, "{r}");
    assert_eq!(sha256sum(&dst), sha256sum(&src));
}
