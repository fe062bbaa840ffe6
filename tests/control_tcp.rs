//! End-to-end tests of rcp and rcpd over the TCP provider on 127.0.0.1:
//! real processes, every digest compared with `sha256sum`. The scenarios
//! shared with the verbs VM tests (control_verbs) are in tests/common/e2e.rs.

mod common;

use common::*;
use std::time::Duration;

const T: &str = "tcp";

e2e_tests!(
    T,
    e2e::Scale {
        resume_len: (64 << 20) + 123,
        resume_block: 64 << 10,
        client_len: 3 << 20,
    }
);

#[test]
fn usage_errors_and_missing_paths_have_their_exit_codes() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    // Usage: no HOST: on the destination.
    let r = rcp(d.port, T, None, &["push", "/etc/hostname", "nowhere"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    // Bad block size.
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "--block-size",
            "5000",
            "push",
            "/etc/hostname",
            "127.0.0.1:/",
        ],
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    // A rules file that cannot be read, or is not text: named, nothing
    // copied.
    let missing = tmp.path().join("no-such-rules");
    let binary = tmp.path().join("binary-rules");
    std::fs::write(&binary, b"*.log\n\xff\xfe\n").unwrap();
    for (flag, f, says) in [
        ("--exclude-from", &missing, "No such file"),
        ("--include-from", &binary, "not UTF-8"),
    ] {
        let f = f.to_str().unwrap();
        let r = rcp(
            d.port,
            T,
            None,
            &["push", flag, f, "/etc/hostname", "127.0.0.1:/"],
        );
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(
            r.stderr.contains(&format!("{flag} {f}")) && r.stderr.contains(says),
            "{}",
            r.stderr
        );
        assert!(!root.join("hostname").exists(), "nothing copied");
    }
    // Local file not found.
    let r = rcp(d.port, T, None, &["push", "/nonexistent/x", "127.0.0.1:/"]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    // Remote file not found.
    let dst = tmp.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", "127.0.0.1:nothing", dst.to_str().unwrap()],
    );
    assert_eq!(r.code, 4, "{}", r.stderr);
    // Remote directory not found.
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "/etc/hostname", "127.0.0.1:no/such/dir/x"],
    );
    assert_eq!(r.code, 3, "{}", r.stderr);
    // Nothing listening: retryable.
    let r = rcp(1, T, None, &["push", "/etc/hostname", "127.0.0.1:/"]);
    assert_eq!(r.code, 5, "{}", r.stderr);
}

#[test]
fn preserve_keeps_mode_and_mtime_and_plain_copies_do_not() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("kept");
    make_file(&src, 10_000, 3);
    std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o640)).unwrap();
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    std::fs::File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .set_modified(t)
        .unwrap();
    // HOST: alone is the root.
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-p", src.to_str().unwrap(), "127.0.0.1:"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let m = std::fs::metadata(root.join("kept")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o640);
    assert_eq!(m.mtime(), 1_000_000_000);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", "-p", "127.0.0.1:kept", back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let m = std::fs::metadata(back.join("kept")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o640);
    assert_eq!(m.mtime(), 1_000_000_000);
    // Without -p the copy is new.
    let r = rcp(
        d.port,
        T,
        None,
        &["push", src.to_str().unwrap(), "127.0.0.1:plain"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let m = std::fs::metadata(root.join("plain")).unwrap();
    assert_ne!(m.mtime(), 1_000_000_000);
    assert_eq!(sha256sum(&root.join("plain")), sha256sum(&src));
}

#[test]
fn tree_directories_are_never_wider_than_the_source_and_archive_keeps_them() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("src");
    for (dir, mode) in [("private", 0o700), ("group", 0o750), ("readonly", 0o555)] {
        std::fs::create_dir_all(src.join(dir)).unwrap();
        make_file(&src.join(dir).join("f"), 5000, 1);
        std::fs::set_permissions(src.join(dir), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let t = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    std::fs::File::open(src.join("group"))
        .unwrap()
        .set_modified(t)
        .unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let s = src.to_str().unwrap();
    for (args, made) in [
        (["push", "-r", s, "127.0.0.1:r"], root.join("r")),
        (
            ["pull", "-r", "127.0.0.1:r", back.to_str().unwrap()],
            back.join("r"),
        ),
    ] {
        let r = rcp(d.port, T, None, &args);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
        for dir in ["private", "group", "readonly"] {
            let (want, got) = (mode(&src.join(dir)), mode(&made.join(dir)));
            // Group and others: never more than the source's (what the
            // umask leaves of them); the owner keeps rwx (the copy wrote
            // into it).
            assert_eq!(
                got & 0o077 & !(want & 0o077),
                0,
                "{made:?}/{dir}: {got:o} wider than {want:o}"
            );
            assert_eq!(got & 0o700, 0o700, "{made:?}/{dir}: {got:o}");
        }
        assert_eq!(mode(&made.join("private")), 0o700, "{made:?}");
    }
    // -a: each directory's mode and mtime exactly, after its files went in.
    let r = rcp(d.port, T, None, &["push", "-a", s, "127.0.0.1:a"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", "-a", "127.0.0.1:a", back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    for made in [root.join("a"), back.join("a")] {
        for dir in ["private", "group", "readonly"] {
            assert_eq!(
                mode(&made.join(dir)),
                mode(&src.join(dir)),
                "{made:?}/{dir}"
            );
            assert_eq!(
                sha256sum(&made.join(dir).join("f")),
                sha256sum(&src.join(dir).join("f"))
            );
        }
        let m = std::fs::metadata(made.join("group")).unwrap();
        assert_eq!(m.mtime(), 1_000_000_000, "{made:?}/group");
    }
}

#[test]
fn archive_rerun_brings_a_changed_mode_to_an_unchanged_file() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    make_file(&src.join("key.pem"), 3000, 5);
    let chmod = |p: &std::path::Path, m| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
    };
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    chmod(&src.join("key.pem"), 0o644);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let s = src.to_str().unwrap();
    let push = ["push", "-a", s, "127.0.0.1:"];
    let pull = ["pull", "-a", "127.0.0.1:src", back.to_str().unwrap()];
    for args in [push, pull] {
        let r = rcp(d.port, T, None, &args);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    }
    // Tightened at the source, size and mtime unchanged: the quick check
    // alone would leave the copies 0644.
    let (pushed, pulled) = (root.join("src/key.pem"), back.join("src/key.pem"));
    let mtime = std::fs::metadata(src.join("key.pem"))
        .unwrap()
        .modified()
        .unwrap();
    chmod(&src.join("key.pem"), 0o600);
    let r = rcp(d.port, T, None, &push);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(mode(&pushed), 0o600, "push -a: {}", r.stderr);
    let r = rcp(d.port, T, None, &pull);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(mode(&pulled), 0o600, "pull -a: {}", r.stderr);
    for p in [&pushed, &pulled] {
        assert_eq!(std::fs::metadata(p).unwrap().modified().unwrap(), mtime);
        assert_eq!(sha256sum(p), sha256sum(&src.join("key.pem")));
    }
}

/// rsync's rule for a destination that ends in `/`: a directory, made when
/// missing, the copy inside it (one file, several, a tree), push and pull;
/// a file standing at that name is refused (exit 3) and left as it was.
#[test]
fn a_destination_ending_in_a_slash_is_a_directory_made_when_missing() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let ok = |args: &[&str]| {
        let r = rcp(d.port, T, None, args);
        assert_eq!(r.code, 0, "{args:?}: {}\n{}", r.stderr, d.log());
    };
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("tree/sub")).unwrap();
    make_file(&src.join("a"), 5000, 1);
    make_file(&src.join("b"), 10, 2);
    make_file(&src.join("tree/sub/c"), 20, 3);
    let (a, b, tree) = (src.join("a"), src.join("b"), src.join("tree"));
    let (a, b, tree) = (
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        tree.to_str().unwrap(),
    );
    ok(&["push", "-q", a, &remote("one/")]);
    assert_eq!(sha256sum(&root.join("one/a")), sha256sum(&src.join("a")));
    ok(&["push", "-q", a, b, &remote("two/")]);
    assert!(root.join("two/a").is_file() && root.join("two/b").is_file());
    ok(&["push", "-q", "-r", tree, &remote("three/")]);
    assert!(root.join("three/tree/sub/c").is_file());
    // Already there: inside it, as before.
    ok(&["push", "-q", b, &remote("three/")]);
    assert!(root.join("three/b").is_file());
    let r = rcp(d.port, T, None, &["push", "-q", b, &remote("one/a/")]);
    assert_eq!(r.code, 3, "a file at the name: {}", r.stderr);
    assert!(r.stderr.contains("not a directory"), "{}", r.stderr);
    assert_eq!(sha256sum(&root.join("one/a")), sha256sum(&src.join("a")));

    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let at = |p: &str| back.join(p).to_str().unwrap().to_string() + "/";
    ok(&["pull", "-q", &remote("one/a"), &at("one")]);
    assert_eq!(sha256sum(&back.join("one/a")), sha256sum(&src.join("a")));
    ok(&["pull", "-q", &remote("two/a"), &remote("two/b"), &at("two")]);
    assert!(back.join("two/a").is_file() && back.join("two/b").is_file());
    ok(&["pull", "-q", "-r", &remote("three/tree"), &at("three")]);
    assert!(back.join("three/tree/sub/c").is_file());
    let file = back.join("one/a").to_str().unwrap().to_string() + "/";
    let r = rcp(d.port, T, None, &["pull", "-q", &remote("two/b"), &file]);
    assert_eq!(r.code, 3, "a file at the name: {}", r.stderr);
    assert_eq!(sha256sum(&back.join("one/a")), sha256sum(&src.join("a")));
}

#[test]
fn doctor_checks_the_remote_rcpd_and_its_token() {
    let (_tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, Some("tok"), &[]);
    let r = rcp(d.port, T, Some("tok"), &["doctor", "127.0.0.1"]);
    assert!(
        r.stdout.contains("[ok  ] rcpd") && r.stdout.contains("accepts the token"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    // Without an RDMA device (this host, natively) copies work over tcp:
    // doctor notes it, with the fix that would bring RDMA, and exits 0;
    // asked for verbs it fails (6). The VM suite checks the healthy case
    // (control_verbs::verbs_doctor_cli_is_healthy).
    let no_device =
        std::fs::read_dir("/sys/class/infiniband").map_or(true, |mut d| d.next().is_none());
    if no_device {
        assert!(r.stdout.contains("[warn] devices"), "{}", r.stdout);
        assert!(r.stdout.contains("copies go over tcp"), "{}", r.stdout);
        assert!(
            r.stdout.contains("fix: ") && r.stdout.contains("rdma_rxe"),
            "{}",
            r.stdout
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert_eq!(r.stderr, "");
        let r = rcp(d.port, "verbs", Some("tok"), &["doctor", "127.0.0.1"]);
        assert!(r.stdout.contains("[FAIL] devices"), "{}", r.stdout);
        assert_eq!(r.code, 6, "{}", r.stderr);
        assert!(r.stderr.contains("doctor found problems"), "{}", r.stderr);
    } else {
        assert!(r.code == 0 || r.code == 6, "{}", r.stderr);
    }
    // An rcpd that does not answer: retry (5).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let r = rcp(port, T, Some("tok"), &["doctor", "127.0.0.1"]);
    assert!(r.stdout.contains("[FAIL] rcpd"), "{}", r.stdout);
    assert_eq!(r.code, 5, "{}", r.stderr);
    let r = rcp(d.port, T, Some("nope"), &["doctor", "127.0.0.1"]);
    assert!(r.stdout.contains("[FAIL] rcpd"), "{}", r.stdout);
    assert!(r.stdout.contains("invalid token"), "{}", r.stdout);
    assert_eq!(r.code, 6);
}

/// A pulled block that arrives damaged (test fault injection in rcp, the
/// `fault-injection` feature) is read again and the copy completes with the
/// right digest; one damaged on every attempt fails the copy after 3
/// re-reads (exit 6), leaving no file.
#[cfg(feature = "fault-injection")]
#[test]
fn a_damaged_pulled_block_is_read_again() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    make_file(&root.join("src"), (3 << 20) + 5, 17);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let pull = |faults: &str, name: &str| {
        let out = rcp_cmd(
            d.port,
            T,
            None,
            &["pull", "127.0.0.1:src", back.join(name).to_str().unwrap()],
        )
        .env("RCP_TEST_CORRUPT_PULLED_BLOCKS", faults)
        .output()
        .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = pull("1", "once");
    assert_eq!(code, 0, "{stdout}{stderr}\n{}", d.log());
    assert!(
        stderr.contains("does not match the server's digest: reading it again"),
        "{stderr}"
    );
    assert!(stderr.contains("blocks read again"), "{stderr}");
    assert_eq!(sha256sum(&back.join("once")), sha256sum(&root.join("src")));
    for l in stderr.lines().filter(|l| l.contains("again")) {
        println!("{l}");
    }
    // Damaged every time: 1 read + 3 re-reads, then a clear error.
    let (code, stdout, stderr) = pull("100", "never");
    assert_eq!(code, 6, "{stdout}{stderr}");
    assert!(stderr.contains("after 3 re-reads"), "{stderr}");
    assert!(!back.join("never").exists());
    println!("{}", stderr.lines().last().unwrap_or_default());
}

/// What already stands at a pushed tree's names on rcpd's side decides as
/// it does for a single file, also once the tree's directory is open on
/// the stream (rcpd then looks names up in it, not from the root): an
/// existing directory where a file of the tree goes is refused (not taken
/// inside it, as scp does only for the top-level destination).
#[test]
fn a_pushed_tree_meets_what_stands_at_its_names() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let tree = tmp.path().join("tree");
    let sub = tree.join("d");
    std::fs::create_dir_all(&sub).unwrap();
    // Files whose names sort before "x" and "y": the directory is open on
    // the stream before those two are opened.
    for i in 0..40u64 {
        make_file(&sub.join(format!("a{i:02}")), 1000 + i, i);
    }
    make_file(&sub.join("x"), 5000, 100);
    make_file(&sub.join("y"), 6000, 101);
    std::fs::create_dir_all(root.join("tree/d/x")).unwrap();
    make_file(&root.join("tree/d/y"), 10, 102);
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-r", tree.to_str().unwrap(), &remote("/")],
    );
    // The open directory's shortcut settles no directory: d/x, a file of
    // the tree whose name is a directory there, is refused (never written
    // inside it: scp's rule is the top-level destination's only), and the
    // directory stays as it was.
    assert_eq!(r.code, 2, "{}{}\n{}", r.stdout, r.stderr, d.log());
    assert!(
        r.stderr
            .contains("tree/d/x: is a directory, refusing to replace it with a file"),
        "{}",
        r.stderr
    );
    let got = root.join("tree/d");
    assert!(got.join("x").is_dir(), "the directory stays");
    assert!(!got.join("x/x").exists(), "written inside the directory");
}

/// A file under `dir` last written `age` ago (or, negative, that far ahead).
fn partial_aged(p: &std::path::Path, age_s: i64) {
    std::fs::write(p, b"partial").unwrap();
    let now = std::time::SystemTime::now();
    let d = std::time::Duration::from_secs(age_s.unsigned_abs());
    let t = if age_s >= 0 { now - d } else { now + d };
    let f = std::fs::File::options().write(true).open(p).unwrap();
    f.set_modified(t).unwrap();
}

/// rcpd's --partial-ttl: at start it removes the partials (temp file and
/// manifest) beneath its root not written for longer than the ttl, keeps a
/// fresh one and every other file, and sweeps again while it runs. Ages
/// are mtimes set in the past (or the future, for the one that must stay):
/// nothing depends on how long the test takes.
#[test]
fn rcpd_sweeps_partials_unused_for_the_partial_ttl() {
    let (_tmp, root) = e2e::tmp_with_root();
    let sub = root.join("a/b");
    std::fs::create_dir_all(&sub).unwrap();
    let old = sub.join(".rcp-old.0011223344556677.part");
    partial_aged(&old, 7200);
    partial_aged(&sub.join(".rcp-old.0011223344556677.part.manifest"), 7200);
    let fresh = sub.join(".rcp-new.0011223344556677.part");
    partial_aged(&fresh, -7200);
    partial_aged(&sub.join(".rcp-new.0011223344556677.part.manifest"), -7200);
    let plain = root.join("plain");
    partial_aged(&plain, 7200);
    // 4 s: swept again every second.
    let d = Rcpd::start(&root, T, None, &["--partial-ttl", "4s"]);
    wait_for("the first sweep", Duration::from_secs(60), || {
        d.log().contains("partial files swept")
    });
    assert_eq!(
        names(&sub),
        [
            ".rcp-new.0011223344556677.part",
            ".rcp-new.0011223344556677.part.manifest"
        ],
        "{}",
        d.log()
    );
    assert!(plain.exists());
    // One left later is swept while rcpd runs.
    let later = root.join(".rcp-later.0011223344556677.part");
    partial_aged(&later, 7200);
    wait_for("a later sweep", Duration::from_secs(60), || !later.exists());
    assert!(fresh.exists() && plain.exists());
}

/// A pushed tree's directories, more than one `MakeDirs` call holds, are
/// made with their sources' modes, parents first; an rcpd that answers
/// `MakeDirs` UNIMPLEMENTED (as one before 2.11) gets one `MakeDir` each
/// and makes the same tree (the `fault-injection` feature).
#[cfg(feature = "fault-injection")]
#[test]
fn a_tree_s_directories_are_made_in_calls_of_many_or_one_each() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (tmp, root) = e2e::tmp_with_root();
    let src = tmp.path().join("top");
    // 4200 directories in one (more than a call's 4096), some with a
    // file, a deeper chain with modes of its own.
    const MANY: usize = 4200;
    for i in 0..MANY {
        let d = src.join(format!("many/d{i:04}"));
        std::fs::create_dir_all(&d).unwrap();
        if i % 37 == 0 {
            std::fs::write(d.join("f"), format!("{i}")).unwrap();
        }
    }
    std::fs::create_dir_all(src.join("a/b/c")).unwrap();
    std::fs::write(src.join("a/b/c/f"), "c").unwrap();
    for (d, mode) in [("a", 0o750), ("a/b", 0o705), ("a/b/c", 0o711)] {
        std::fs::set_permissions(src.join(d), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let umask = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .map(|v| u32::from_str_radix(v.trim(), 8).unwrap())
        .unwrap();
    let old_root = tmp.path().join("old-root");
    std::fs::create_dir(&old_root).unwrap();
    let new = Rcpd::start(&root, T, None, &[]);
    let old = Rcpd::start_env(&old_root, T, &[("RCP_TEST_NO_MAKE_DIRS", "4294967295")]);
    for (d, into) in [(&new, &root), (&old, &old_root)] {
        let r = rcp(
            d.port,
            T,
            None,
            &["push", "-r", src.to_str().unwrap(), "127.0.0.1:/"],
        );
        assert_eq!(r.code, 0, "{}", r.stderr);
        for i in (0..MANY).step_by(37) {
            let f = into.join(format!("top/many/d{i:04}/f"));
            assert_eq!(std::fs::read_to_string(&f).unwrap(), format!("{i}"));
        }
        for (dir, mode) in [("a", 0o750), ("a/b", 0o705), ("a/b/c", 0o711)] {
            let m = std::fs::metadata(into.join("top").join(dir)).unwrap();
            assert_eq!(m.mode() & 0o7777, (mode | 0o700) & !umask, "{dir}");
        }
        let dirs = std::fs::read_dir(into.join("top/many")).unwrap().count();
        assert_eq!(dirs, MANY);
    }
    assert!(!new.log().contains("test fault: MakeDirs"), "{}", new.log());
    assert!(old.log().contains("test fault: MakeDirs"), "{}", old.log());
}
