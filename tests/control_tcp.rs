//! End-to-end tests of rcp and rcpd over the TCP provider on 127.0.0.1:
//! real processes, every digest compared with `sha256sum`.

mod common;

use std::process::Stdio;

use common::*;

const T: &str = "tcp";

fn roundtrip(sizes: &[u64]) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &[]);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        let name = format!("f{len}");
        let src = tmp.path().join(&name);
        make_file(&src, len, i as u64 + 1);
        let want = sha256sum(&src);
        let r = rcp(
            d.port,
            T,
            None,
            &["push", src.to_str().unwrap(), "127.0.0.1:/"],
        );
        assert_eq!(r.code, 0, "push {len}: {}{}", r.stdout, r.stderr);
        assert_eq!(sha256sum(&root.join(&name)), want, "pushed {len} bytes");
        if len > 0 {
            assert!(
                r.stdout.contains(&want),
                "summary has the digest: {}",
                r.stdout
            );
        }
        assert_eq!(moved(&r.stdout), len);
        let r = rcp(
            d.port,
            T,
            None,
            &["pull", &format!("127.0.0.1:{name}"), back.to_str().unwrap()],
        );
        assert_eq!(r.code, 0, "pull {len}: {}{}", r.stdout, r.stderr);
        assert_eq!(sha256sum(&back.join(&name)), want, "pulled {len} bytes");
    }
    // No temp files or manifests left behind.
    for dir in [&root, &back] {
        for e in std::fs::read_dir(dir).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!n.starts_with('.'), "left behind: {n}");
        }
    }
}

#[test]
fn push_pull_small_sizes() {
    roundtrip(&[0, 1, 4095]);
}

#[test]
fn push_pull_33mib_plus_7() {
    roundtrip(&[(33 << 20) + 7]);
}

#[test]
fn push_pull_tree_of_200_files() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &[]);
    let tree = tmp.path().join("tree");
    let mut files = Vec::new();
    for i in 0..200u64 {
        let sub = tree.join(format!("d{}", i % 7)).join(format!("e{}", i % 3));
        std::fs::create_dir_all(&sub).unwrap();
        let f = sub.join(format!("file{i}"));
        make_file(&f, (i * 37) % 5000, i);
        files.push(f.strip_prefix(&tree).unwrap().to_path_buf());
    }
    // A symlink pointing out of the tree is never followed.
    std::os::unix::fs::symlink("/etc/passwd", tree.join("escape")).unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-r", tree.to_str().unwrap(), "127.0.0.1:/"],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.starts_with("200 files"), "{}", r.stdout);
    assert!(!root.join("tree/escape").exists());
    for f in &files {
        assert_eq!(
            sha256sum(&tree.join(f)),
            sha256sum(&root.join("tree").join(f)),
            "{}",
            f.display()
        );
    }
    let back = tmp.path().join("back");
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", "-r", "127.0.0.1:tree", back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    for f in &files {
        assert_eq!(
            sha256sum(&tree.join(f)),
            sha256sum(&back.join(f)),
            "{}",
            f.display()
        );
    }
}

/// `-r` copies empty directories too, both ways (scp -r, rsync -r), and a
/// tree that is nothing but empty directories.
#[test]
fn push_pull_tree_with_empty_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &[]);
    let tree = tmp.path().join("etree");
    let empties = ["empty", "deep/er/est", "full/empty-beside-a-file"];
    for e in empties {
        std::fs::create_dir_all(tree.join(e)).unwrap();
    }
    make_file(&tree.join("full/f"), 5000, 3);
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(bare.join("x/y")).unwrap();
    for src in [&tree, &bare] {
        let r = rcp(
            d.port,
            T,
            None,
            &["push", "-r", src.to_str().unwrap(), "127.0.0.1:/"],
        );
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    }
    for e in empties {
        assert!(root.join("etree").join(e).is_dir(), "pushed {e}");
        if e != "full/empty-beside-a-file" {
            assert!(names(&root.join("etree").join(e)).is_empty(), "{e}");
        }
    }
    assert_eq!(
        sha256sum(&tree.join("full/f")),
        sha256sum(&root.join("etree/full/f"))
    );
    assert!(
        root.join("bare/x/y").is_dir(),
        "an all-empty tree is pushed"
    );
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    for name in ["etree", "bare"] {
        let r = rcp(
            d.port,
            T,
            None,
            &[
                "pull",
                "-r",
                &format!("127.0.0.1:{name}"),
                back.to_str().unwrap(),
            ],
        );
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    }
    for e in empties {
        assert!(back.join("etree").join(e).is_dir(), "pulled {e}");
    }
    assert_eq!(
        sha256sum(&tree.join("full/f")),
        sha256sum(&back.join("etree/full/f"))
    );
    assert!(
        back.join("bare/x/y").is_dir(),
        "an all-empty tree is pulled"
    );
    // A non-directory in the way is refused, not replaced.
    std::fs::write(tmp.path().join("clash"), b"x").unwrap();
    std::fs::create_dir_all(tmp.path().join("clashing/etree")).unwrap();
    std::fs::write(root.join("etree/empty-file-here"), b"").unwrap();
    std::fs::create_dir_all(tmp.path().join("clashing/etree/empty-file-here")).unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "push",
            "-r",
            tmp.path().join("clashing/etree").to_str().unwrap(),
            "127.0.0.1:/",
        ],
    );
    assert_ne!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(root.join("etree/empty-file-here").is_file());
}

/// `rcp --block-size 64K ARGS` (small blocks: the manifest grows as
/// windows are verified, so the test can see progress).
fn rcp64(port: u16, args: &[&str]) -> std::process::Command {
    rcp_cmd(
        port,
        T,
        None,
        &[&["--block-size", "64K"][..], args].concat(),
    )
}

#[test]
fn push_resume_after_client_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &[]);
    let len = (64u64 << 20) + 123;
    let src = tmp.path().join("big");
    make_file(&src, len, 7);
    let want = sha256sum(&src);
    let s = src.to_str().unwrap();
    let mut child = rcp64(d.port, &["push", "-q", s, "127.0.0.1:/"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once the server has verified a window.
    wait_verified(&root, "big", 64);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !root.join("big").exists(),
        "an interrupted copy is never under the final name"
    );
    assert!(find_manifest(&root, "big").is_some(), "{:?}", names(&root));
    let out = rcp64(d.port, &["push", "--resume", s, "127.0.0.1:/"])
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}{se}");
    let m = moved(&so);
    assert!(m < len, "resume moved {m} of {len} bytes");
    assert_eq!(sha256sum(&root.join("big")), want);
    assert_eq!(names(&root), vec!["big".to_string()]);
}

#[test]
fn pull_resume_after_client_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &[]);
    let len = (64u64 << 20) + 5;
    make_file(&root.join("big"), len, 9);
    let want = sha256sum(&root.join("big"));
    let dst = tmp.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let ds = dst.to_str().unwrap();
    let mut child = rcp64(d.port, &["pull", "-q", "127.0.0.1:big", ds])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_verified(&dst, "big", 64);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dst.join("big").exists(),
        "an interrupted copy is never under the final name"
    );
    let out = rcp64(d.port, &["pull", "--resume", "127.0.0.1:big", ds])
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}{se}");
    let m = moved(&so);
    assert!(m < len, "resume moved {m} of {len} bytes");
    assert_eq!(sha256sum(&dst.join("big")), want);
    assert_eq!(names(&dst), vec!["big".to_string()]);
}

#[test]
fn eight_clients_at_once_with_back_pressure() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    // Fewer transfer slots than clients: the excess waits, none fails.
    let d = Rcpd::start(&root, T, None, &["--max-transfers", "3"]);
    let mut kids = Vec::new();
    for i in 0..8u64 {
        let src = tmp.path().join(format!("c{i}"));
        make_file(&src, (3 << 20) + i * 1000, 100 + i);
        let child = rcp_cmd(
            d.port,
            T,
            None,
            &["push", src.to_str().unwrap(), "127.0.0.1:/"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        kids.push((src, child));
    }
    for (src, child) in kids {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let name = src.file_name().unwrap();
        assert_eq!(sha256sum(&src), sha256sum(&root.join(name)));
    }
}

#[test]
fn usage_errors_and_missing_paths_have_their_exit_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
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
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
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
fn doctor_checks_the_remote_rcpd_and_its_token() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Rcpd::start(tmp.path(), T, Some("tok"), &[]);
    let r = rcp(d.port, T, Some("tok"), &["doctor", "127.0.0.1"]);
    assert!(
        r.stdout.contains("[ok  ] rcpd") && r.stdout.contains("accepts the token"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    // Without an RDMA device (this host, natively) doctor says so with the
    // fix and exits 6; the VM suite checks the healthy case
    // (control_verbs::verbs_doctor_cli_is_healthy).
    let no_device =
        std::fs::read_dir("/sys/class/infiniband").map_or(true, |mut d| d.next().is_none());
    if no_device {
        assert!(r.stdout.contains("[FAIL] devices"), "{}", r.stdout);
        assert!(r.stdout.contains("no RDMA device"), "{}", r.stdout);
        assert!(
            r.stdout.contains("fix: ") && r.stdout.contains("rdma_rxe"),
            "{}",
            r.stdout
        );
        assert_eq!(r.code, 6, "{}", r.stderr);
        assert!(r.stderr.contains("doctor found problems"), "{}", r.stderr);
    } else {
        assert!(r.code == 0 || r.code == 6, "{}", r.stderr);
    }
    let r = rcp(d.port, T, Some("nope"), &["doctor", "127.0.0.1"]);
    assert!(r.stdout.contains("[FAIL] rcpd"), "{}", r.stdout);
    assert!(r.stdout.contains("invalid token"), "{}", r.stdout);
    assert_eq!(r.code, 6);
}

/// A pulled block that arrives damaged (test fault injection in rcp) is read
/// again and the copy completes with the right digest; one damaged on every
/// attempt fails the copy after 3 re-reads (exit 6), leaving no file.
#[test]
fn a_damaged_pulled_block_is_read_again() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
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
