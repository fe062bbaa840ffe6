//! rcp against rsync itself: the same tree, copied by both with the flags
//! that mean the same, must come out the same: names, kinds, contents,
//! permission bits and link targets, and the mtimes of files and
//! directories where times are kept. Push and pull, over the tcp provider
//! on loopback, both receivers under umask 027.
//!
//! The rsync side is given what rcp's flags mean in rsync's terms
//! (docs/rsync.md): rcp's `-a` is rsync's `-rlpt --safe-links` (no owner,
//! group or devices; links pointing out of the tree left out), `-r -p` is
//! `-rpt`, `-r` is `-r` (every symlink left out, "skipping non-regular
//! file"). A source directory is copied into an existing destination
//! directory, where scp's rule and rsync's agree (`SRC DIR` → `DIR/SRC`).
//!
//! rsync must be installed (`scripts/testbed.sh install` installs it); a
//! missing rsync fails these tests rather than skipping them.

mod common;

use common::e2e::tmp_with_root;
use common::*;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

const T: &str = "tcp";
const UMASK: u32 = 0o027;

/// What a tree holds at one relative path, as compared between the copies.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    File {
        perm: String,
        len: u64,
        content: u64,
        mtime: Option<(i64, i64)>,
    },
    Dir {
        perm: String,
        mtime: Option<(i64, i64)>,
    },
    Link(String),
    Other,
}

/// Every path beneath `top` (not `top` itself unless `with_top`), lstat'ed.
/// Times are taken only when `times` (rsync `-t`, rcp `-p`).
fn snapshot(top: &Path, times: bool) -> BTreeMap<String, Node> {
    fn walk(base: &Path, dir: &Path, times: bool, out: &mut BTreeMap<String, Node>) {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let rel = p.strip_prefix(base).unwrap().display().to_string();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let perm = format!("{:04o}", m.permissions().mode() & 0o7777);
            let mtime = times.then(|| (m.mtime(), m.mtime_nsec()));
            let ft = m.file_type();
            let node = if ft.is_symlink() {
                Node::Link(std::fs::read_link(&p).unwrap().display().to_string())
            } else if ft.is_dir() {
                walk(base, &p, times, out);
                Node::Dir { perm, mtime }
            } else if ft.is_file() {
                let bytes = std::fs::read(&p).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                bytes.hash(&mut h);
                Node::File {
                    perm,
                    len: m.len(),
                    content: h.finish(),
                    mtime,
                }
            } else {
                Node::Other
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    let m = std::fs::symlink_metadata(top)
        .unwrap_or_else(|e| panic!("{} was not made: {e}", top.display()));
    out.insert(
        ".".into(),
        Node::Dir {
            perm: format!("{:04o}", m.permissions().mode() & 0o7777),
            mtime: times.then(|| (m.mtime(), m.mtime_nsec())),
        },
    );
    walk(top, top, times, &mut out);
    out
}

/// The differences between two snapshots, one line each (empty: the same).
fn differences(rcp: &BTreeMap<String, Node>, rsync: &BTreeMap<String, Node>) -> Vec<String> {
    let mut d = Vec::new();
    for (k, v) in rcp {
        match rsync.get(k) {
            None => d.push(format!("{k}: rcp made {v:?}, rsync nothing")),
            Some(w) if w != v => d.push(format!("{k}: rcp {v:?}, rsync {w:?}")),
            _ => {}
        }
    }
    for (k, w) in rsync {
        if !rcp.contains_key(k) {
            d.push(format!("{k}: rsync made {w:?}, rcp nothing"));
        }
    }
    d
}

fn set_mtime(p: &Path, secs: i64, nsec: i64) {
    let t = std::time::UNIX_EPOCH
        + std::time::Duration::from_secs(secs as u64)
        + std::time::Duration::from_nanos(nsec as u64);
    let f = std::fs::File::options()
        .write(!p.is_dir())
        .read(p.is_dir())
        .open(p)
        .unwrap();
    f.set_modified(t).unwrap();
}

fn file(p: &Path, len: u64, mode: u32, age: i64) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    make_file(p, len, len ^ u64::from(mode));
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    set_mtime(p, 1_600_000_000 - age, 123_456_789);
}

/// The source tree: files and directories of several modes (0600 among
/// them, and a 0700 directory), an empty directory, hidden and spaced
/// names, a FIFO, and symlinks of every kind: relative inside the tree (to
/// a file, to a directory, up a level), escaping it, absolute, dangling.
fn make_source(src: &Path, outside: &Path) {
    std::fs::create_dir_all(src).unwrap();
    file(&src.join("a.txt"), 1000, 0o644, 1);
    file(&src.join("secret.key"), 300, 0o600, 2);
    file(&src.join("run.sh"), 70, 0o755, 3);
    file(&src.join("ro.txt"), 0, 0o444, 4);
    file(&src.join("name with space.txt"), 10, 0o640, 5);
    file(&src.join(".hidden"), 20, 0o644, 6);
    file(&src.join("app.log"), 30, 0o644, 7);
    file(&src.join("keep.log"), 31, 0o644, 8);
    file(&src.join("sub/b.bin"), 70_000, 0o664, 9);
    file(&src.join("sub/x.log"), 40, 0o644, 10);
    file(&src.join("sub/deeper/c"), 5000, 0o600, 11);
    file(&src.join("private/x"), 1, 0o600, 12);
    file(&src.join("tmp/t"), 2, 0o644, 13);
    file(&src.join("sub/tmp/u"), 3, 0o644, 14);
    std::fs::create_dir(src.join("empty")).unwrap();
    std::os::unix::fs::symlink("a.txt", src.join("rel_file")).unwrap();
    std::os::unix::fs::symlink("sub", src.join("rel_dir")).unwrap();
    std::os::unix::fs::symlink("../a.txt", src.join("sub/up")).unwrap();
    std::os::unix::fs::symlink("nothing-here", src.join("dangling")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", src.join("abs")).unwrap();
    let escaping = pathdiff(outside, src);
    std::os::unix::fs::symlink(escaping, src.join("escaping")).unwrap();
    let fifo = src.join("pipe");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success(), "mkfifo");
    for (d, mode, age) in [
        ("sub", 0o750, 20),
        ("sub/deeper", 0o700, 21),
        ("private", 0o700, 22),
        ("empty", 0o755, 23),
        ("tmp", 0o755, 24),
        ("sub/tmp", 0o755, 25),
    ] {
        let p = src.join(d);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        set_mtime(&p, 1_500_000_000 - age, 0);
    }
    set_mtime(src, 1_500_000_000, 5);
}

/// `to` relative to `from` (both absolute, sharing a prefix): `../..`-style.
fn pathdiff(to: &Path, from: &Path) -> String {
    let to: Vec<_> = to.components().collect();
    let from: Vec<_> = from.components().collect();
    let common = to.iter().zip(&from).take_while(|(a, b)| a == b).count();
    let mut s: Vec<String> = vec!["..".into(); from.len() - common];
    s.extend(
        to[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    s.join("/")
}

/// `rsync ARGS` under the receivers' umask; its output for messages.
fn rsync(args: &[&str]) -> String {
    let out = Command::new("sh")
        .args([
            "-c",
            &format!("umask {UMASK:03o}; exec \"$0\" \"$@\""),
            "rsync",
        ])
        .args(args)
        .output()
        .expect("rsync is installed (scripts/testbed.sh install installs it)");
    let said = format!(
        "rsync {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // 23: some files were not transferred (the FIFO and links rsync skips).
    assert!(
        out.status.success() || out.status.code() == Some(23),
        "{said}"
    );
    said
}

/// One scenario, both ways: the source tree copied by rcp and by rsync into
/// an existing directory `out`, with `rcp_flags` and `rsync_flags`; `setup`
/// prepares each destination's `out` first (the same for both), `change`
/// then alters the source and both copy again when given (a rerun).
struct Case<'a> {
    rcp_flags: &'a [&'a str],
    rsync_flags: &'a [&'a str],
    times: bool,
    setup: &'a dyn Fn(&Path),
    change: Option<&'a dyn Fn(&Path)>,
}

fn no_setup(_: &Path) {}

/// The directories a setup made, given one fixed mtime (deepest first), so
/// that the two destinations start alike to the nanosecond.
fn settle_dir_times(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            settle_dir_times(&p);
        }
    }
    set_mtime(dir, 1_450_000_000, 0);
}

fn run_case(case: &Case, push: bool) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start_umask(&Topology::from_env(), &root, T, None, &[], Some(UMASK));
    let local = tmp.path().join("local");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"outside").unwrap();
    // The source where its side is, the two destinations `out`.
    let (src, rcp_out) = if push {
        (local.join("tree"), root.join("out"))
    } else {
        (root.join("tree"), local.join("out"))
    };
    let rsync_out = tmp.path().join("rsync").join("out");
    make_source(&src, &outside);
    for o in [&rcp_out, &rsync_out] {
        std::fs::create_dir_all(o).unwrap();
        (case.setup)(o);
        settle_dir_times(o);
    }
    let copy = |what: &str| {
        let mut args: Vec<&str> = vec![if push { "push" } else { "pull" }, "-q"];
        args.extend_from_slice(case.rcp_flags);
        let (from, to) = if push {
            (src.display().to_string(), remote("out"))
        } else {
            (remote("tree"), rcp_out.display().to_string())
        };
        args.extend([from.as_str(), to.as_str()]);
        let out = rcp_cmd_umask(d.port, T, None, &args, UMASK)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{what}: rcp {args:?}: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
        let mut r: Vec<String> = case.rsync_flags.iter().map(|s| s.to_string()).collect();
        r.extend([
            src.display().to_string(),
            format!("{}/", rsync_out.display()),
        ]);
        let r: Vec<&str> = r.iter().map(String::as_str).collect();
        rsync(&r);
        let (a, b) = (
            snapshot(&rcp_out.join("tree"), case.times),
            snapshot(&rsync_out.join("tree"), case.times),
        );
        let diff = differences(&a, &b);
        assert!(
            diff.is_empty(),
            "{what}, {} with rcp {:?} / rsync {:?}: the copies differ:\n{}",
            if push { "push" } else { "pull" },
            case.rcp_flags,
            case.rsync_flags,
            diff.join("\n")
        );
        // Whatever else the destination held, compared as well.
        let diff = differences(&snapshot(&rcp_out, false), &snapshot(&rsync_out, false));
        assert!(
            diff.is_empty(),
            "{what}: beside the tree:\n{}",
            diff.join("\n")
        );
    };
    copy("first copy");
    if let Some(change) = case.change {
        change(&src);
        copy("rerun after the source changed");
    }
}

fn both_ways(case: Case) {
    run_case(&case, true);
    run_case(&case, false);
}

#[test]
fn recursive_copy_is_rsyncs() {
    both_ways(Case {
        rcp_flags: &["-r"],
        rsync_flags: &["-r"],
        times: false,
        setup: &no_setup,
        change: None,
    });
}

#[test]
fn recursive_with_modes_and_times_is_rsyncs() {
    both_ways(Case {
        rcp_flags: &["-r", "-p"],
        rsync_flags: &["-rpt"],
        times: true,
        setup: &no_setup,
        change: None,
    });
}

#[test]
fn archive_is_rsyncs_with_safe_links() {
    both_ways(Case {
        rcp_flags: &["-a"],
        rsync_flags: &["-rlpt", "--safe-links"],
        times: true,
        setup: &no_setup,
        change: None,
    });
}

/// The source changed between two runs: a file rewritten at the same size,
/// one made shorter, a mode changed, a file and a directory added, a file
/// removed; the rerun brings each change, as rsync's does.
fn change_source(src: &Path) {
    file(&src.join("a.txt"), 1000, 0o644, 100);
    file(&src.join("sub/b.bin"), 50_000, 0o664, 101);
    std::fs::set_permissions(
        src.join("secret.key"),
        std::fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    file(&src.join("new/n.txt"), 7, 0o600, 102);
    std::fs::remove_file(src.join("run.sh")).unwrap();
    // Directory times a second apart at least: rsync takes a directory's
    // time within the same second as its source's for the same.
    for (d, t) in [
        ("sub", 1_400_000_000),
        ("new", 1_400_000_001),
        ("", 1_400_000_002),
    ] {
        set_mtime(&src.join(d), t, 0);
    }
}

#[test]
fn archive_rerun_after_changes_is_rsyncs() {
    both_ways(Case {
        rcp_flags: &["-a"],
        rsync_flags: &["-rlpt", "--safe-links"],
        times: true,
        setup: &no_setup,
        change: Some(&change_source),
    });
}

/// A destination that already holds some of the tree and more: extra
/// files and directories (a deep one, an empty one), a file where the
/// source has a directory's worth of names, a file the filter excludes.
fn stale_destination(out: &Path) {
    let t = out.join("tree");
    file(&t.join("a.txt"), 999, 0o600, 50);
    file(&t.join("extra.txt"), 5, 0o644, 51);
    file(&t.join("old/deep/er/f"), 5, 0o644, 52);
    std::fs::create_dir_all(t.join("old/empty")).unwrap();
    file(&t.join("sub/gone.bin"), 5, 0o644, 53);
    file(&t.join("keep.me"), 5, 0o644, 54);
    file(&t.join("sub/old.log"), 5, 0o644, 55);
    file(&out.join("beside"), 5, 0o644, 56);
}

#[test]
fn delete_with_filters_is_rsyncs() {
    // rcp anchors a leading `/` at the copied directory (rsync's `SRC/`
    // form, docs/rsync.md); rsync's `SRC` form anchors it one level up.
    let filters = |anchored: &'static str| {
        [
            "--include",
            "keep.log",
            "--exclude",
            "*.log",
            "--exclude",
            "tmp/",
            "--exclude",
            anchored,
            "--exclude",
            "keep.me",
            "--exclude",
            "**/deeper/c",
        ]
    };
    let rcp_flags: Vec<&str> = ["-a", "--delete"]
        .into_iter()
        .chain(filters("/private"))
        .collect();
    let rsync_flags: Vec<&str> = ["-rlpt", "--safe-links", "--delete"]
        .into_iter()
        .chain(filters("/tree/private"))
        .collect();
    both_ways(Case {
        rcp_flags: &rcp_flags,
        rsync_flags: &rsync_flags,
        times: true,
        setup: &stale_destination,
        change: Some(&change_source),
    });
}

#[test]
fn filters_without_delete_leave_the_destination_as_rsync_does() {
    let filters = ["--exclude", "sub/", "--exclude", ".*", "--include", "*.txt"];
    let rcp_flags: Vec<&str> = ["-r", "-p"].iter().chain(&filters).copied().collect();
    let rsync_flags: Vec<&str> = ["-rpt"].iter().chain(&filters).copied().collect();
    both_ways(Case {
        rcp_flags: &rcp_flags,
        rsync_flags: &rsync_flags,
        times: true,
        setup: &stale_destination,
        change: None,
    });
}

/// --exclude-from and --include-from read as rsync reads them, in their
/// place among the command line's rules: comments and blank lines, CRLF,
/// `+ `/`- ` prefixes, and `!` dropping the rule before it (a.txt is
/// copied after all).
#[test]
fn rules_files_are_rsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let cleared = write("cleared", "; a comment\n!\nrun.sh\n");
    let inc = write("inc", "*.txt\n- sub/deeper/\n");
    let exc = write("exc", "# a comment\n\n+ keep.log\r\n*.log\r\n- tmp/\n");
    let filters = [
        "--exclude",
        "a.txt",
        "--exclude-from",
        &cleared,
        "--include-from",
        &inc,
        "--exclude-from",
        &exc,
        "--exclude",
        ".*",
    ];
    let rcp_flags: Vec<&str> = ["-r", "-p"].iter().chain(&filters).copied().collect();
    let rsync_flags: Vec<&str> = ["-rpt"].iter().chain(&filters).copied().collect();
    both_ways(Case {
        rcp_flags: &rcp_flags,
        rsync_flags: &rsync_flags,
        times: true,
        setup: &no_setup,
        change: None,
    });
}

#[test]
fn recursive_over_an_existing_tree_keeps_modes_as_rsync_does() {
    // Without -p a replaced file keeps its own bits (a.txt stays 0600).
    both_ways(Case {
        rcp_flags: &["-r"],
        rsync_flags: &["-r"],
        times: false,
        setup: &stale_destination,
        change: Some(&change_source),
    });
}

/// Entries that changed kind between runs: a file became a link, a link
/// became a file, an empty directory became a file, a file became a
/// directory.
fn change_kinds(src: &Path) {
    std::fs::remove_file(src.join("a.txt")).unwrap();
    std::os::unix::fs::symlink("run.sh", src.join("a.txt")).unwrap();
    std::fs::remove_file(src.join("rel_file")).unwrap();
    file(&src.join("rel_file"), 11, 0o644, 200);
    set_mtime(src, 1_400_000_004, 0);
}

#[test]
fn entries_that_changed_kind_are_replaced_as_rsync_does() {
    for (rcp_flags, rsync_flags) in [
        (&["-a"][..], &["-rlpt", "--safe-links"][..]),
        (
            &["-a", "--delete"][..],
            &["-rlpt", "--safe-links", "--delete"][..],
        ),
    ] {
        both_ways(Case {
            rcp_flags,
            rsync_flags,
            times: true,
            setup: &no_setup,
            change: Some(&change_kinds),
        });
    }
}

/// A destination whose files are, against the source: newer with other
/// content (secret.key), older with other content (a.txt), the same
/// content at another mtime and mode (run.sh), the same size, mode and
/// mtime but other content (sub/b.bin: only a checksum tells).
fn diverged_destination(out: &Path) {
    let t = out.join("tree");
    file(&t.join("secret.key"), 301, 0o644, -100);
    file(&t.join("a.txt"), 999, 0o600, 50);
    // Seeded as the source's (length and mode), then another mode and time.
    file(&t.join("run.sh"), 70, 0o755, 3);
    std::fs::set_permissions(t.join("run.sh"), std::fs::Permissions::from_mode(0o700)).unwrap();
    set_mtime(&t.join("run.sh"), 1_300_000_000, 0);
    // Seeded otherwise, then the source's mode (its mtime is the same).
    file(&t.join("sub/b.bin"), 70_000, 0o600, 9);
    std::fs::set_permissions(t.join("sub/b.bin"), std::fs::Permissions::from_mode(0o664)).unwrap();
    // The source's bytes and mode, another mtime.
    file(&t.join("keep.log"), 31, 0o644, 8);
    set_mtime(&t.join("keep.log"), 1_300_000_000, 0);
    // The source's size and mode, other bytes and an older mtime
    // (--size-only keeps the bytes; the quick check moves the source's).
    file(&t.join("tmp/t"), 2, 0o600, 40);
    std::fs::set_permissions(t.join("tmp/t"), std::fs::Permissions::from_mode(0o644)).unwrap();
}

#[test]
fn skip_rules_are_rsyncs() {
    let rsync_a = ["-rlpt", "--safe-links"];
    for (rcp_extra, rsync_extra) in [
        (&[][..], &[][..]),
        (&["-u"][..], &["-u"][..]),
        (&["--ignore-existing"][..], &["--ignore-existing"][..]),
        (&["-c"][..], &["-c"][..]),
        (&["--size-only"][..], &["--size-only"][..]),
        (&["-I"][..], &["-I"][..]),
        // rsync's delta transfer is its default; rcp's is a flag.
        (&["--delta", "-I"][..], &["-I", "--no-whole-file"][..]),
    ] {
        let rcp_flags: Vec<&str> = ["-a"].iter().chain(rcp_extra).copied().collect();
        let rsync_flags: Vec<&str> = rsync_a.iter().chain(rsync_extra).copied().collect();
        both_ways(Case {
            rcp_flags: &rcp_flags,
            rsync_flags: &rsync_flags,
            times: true,
            setup: &diverged_destination,
            change: None,
        });
    }
}

/// The destination's tree has a symlink where the source has a directory
/// (`sub -> ../elsewhere`), and another to a directory where the source
/// has a file.
fn linked_destination(out: &Path) {
    file(&out.join("elsewhere/inside"), 5, 0o644, 60);
    std::fs::create_dir_all(out.join("tree")).unwrap();
    std::os::unix::fs::symlink("../elsewhere", out.join("tree/sub")).unwrap();
}

#[test]
fn a_linked_directory_at_the_destination_is_replaced_as_rsync_does() {
    for (rcp_flags, rsync_flags) in [
        (&["-a"][..], &["-rlpt", "--safe-links"][..]),
        (&["-r"][..], &["-r"][..]),
    ] {
        both_ways(Case {
            rcp_flags,
            rsync_flags,
            times: rcp_flags == ["-a"],
            setup: &linked_destination,
            change: None,
        });
    }
}
