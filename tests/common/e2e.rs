//! The end-to-end scenarios the issue asks for on every transport: push and
//! pull of edge sizes and of trees, resume after the client is killed, eight
//! clients against fewer transfer slots. control_tcp runs them natively over
//! tcp, control_verbs in the soft-RoCE VM over verbs ([`e2e_tests!`]); every
//! digest is compared with `sha256sum`.

use std::process::{Command, Stdio};

use super::*;
use rcp::control::WINDOW_SIZE;

/// A temp dir under `RCP_TEST_TMPDIR` when set (the VM suite points it at
/// the guest's tmpfs: every file syscall on the repository's 9p mount costs
/// tens of milliseconds under TCG), else under cargo's target tmp dir (the
/// VM mounts the repository writable, its /tmp may not be).
pub fn tmp() -> tempfile::TempDir {
    let base = std::env::var_os("RCP_TEST_TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_TARGET_TMPDIR").into());
    std::fs::create_dir_all(&base).unwrap();
    tempfile::Builder::new()
        .prefix("e2e")
        .tempdir_in(base)
        .unwrap()
}

/// A fresh temp dir with an empty `root` in it for rcpd (its log goes
/// beside `root`, inside the temp dir).
pub fn tmp_with_root() -> (tempfile::TempDir, PathBuf) {
    let tmp = tmp();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    (tmp, root)
}

const TOKEN: &str = "s3cret";

/// Push each size to rcpd and pull it back, comparing digests; nothing
/// (temp file, manifest) is left behind on either side.
pub fn roundtrip(t: &str, sizes: &[u64]) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, Some(TOKEN), &[]);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        let name = format!("f{len}");
        let src = tmp.path().join(&name);
        make_file(&src, len, i as u64 + 1);
        let want = sha256sum(&src);
        let r = rcp(
            d.port,
            t,
            Some(TOKEN),
            &["push", "--sha256", src.to_str().unwrap(), &remote("/")],
        );
        assert_eq!(
            r.code,
            0,
            "push {len}: {}{}\n{}",
            r.stdout,
            r.stderr,
            d.log()
        );
        assert_eq!(sha256sum(&root.join(&name)), want, "pushed {len} bytes");
        if len > 0 {
            assert!(
                r.stdout.contains(&want),
                "summary has the digest: {}",
                r.stdout
            );
        }
        assert!(r.stdout.contains(&format!("over {t}")), "{}", r.stdout);
        assert_eq!(moved(&r.stdout), len);
        let r = rcp(
            d.port,
            t,
            Some(TOKEN),
            &["pull", "--sha256", &remote(&name), back.to_str().unwrap()],
        );
        assert_eq!(
            r.code,
            0,
            "pull {len}: {}{}\n{}",
            r.stdout,
            r.stderr,
            d.log()
        );
        assert_eq!(sha256sum(&back.join(&name)), want, "pulled {len} bytes");
        if len > 0 {
            assert!(
                r.stdout.contains(&want),
                "summary has the digest: {}",
                r.stdout
            );
        }
        println!("{len} bytes pulled: {}", r.stdout.trim());
    }
    // No temp files or manifests left behind.
    for dir in [&root, &back] {
        for e in std::fs::read_dir(dir).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!n.starts_with('.'), "left behind: {n}");
        }
    }
}

/// `rcp -r` of a tree of 200 small files (and a symlink out of it, never
/// followed) to rcpd and back.
pub fn tree_of_200_files(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, &[]);
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
        t,
        None,
        &["push", "-r", tree.to_str().unwrap(), &remote("/")],
    );
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
    assert!(r.stdout.starts_with("200 files"), "{}", r.stdout);
    println!("pushed: {}", r.stdout.trim());
    assert!(!root.join("tree/escape").exists());
    let want = sha256sums(&tree, &files);
    same_digests(&files, &want, &sha256sums(&root.join("tree"), &files));
    let back = tmp.path().join("back");
    let r = rcp(
        d.port,
        t,
        None,
        &["pull", "-r", &remote("tree"), back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
    println!("pulled: {}", r.stdout.trim());
    same_digests(&files, &want, &sha256sums(&back, &files));
}

/// Each of `files` has the digest wanted.
fn same_digests(files: &[PathBuf], want: &[String], got: &[String]) {
    for ((f, w), g) in files.iter().zip(want).zip(got) {
        assert_eq!(w, g, "{}", f.display());
    }
}

/// `-r` copies empty directories too, both ways (scp -r, rsync -r), and a
/// tree that is nothing but empty directories; a non-directory in the way is
/// refused, not replaced.
pub fn tree_with_empty_directories(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, &[]);
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
            t,
            None,
            &["push", "-r", src.to_str().unwrap(), &remote("/")],
        );
        assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
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
            t,
            None,
            &["pull", "-r", &remote(name), back.to_str().unwrap()],
        );
        assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
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
        t,
        None,
        &[
            "push",
            "-r",
            tmp.path().join("clashing/etree").to_str().unwrap(),
            &remote("/"),
        ],
    );
    assert_ne!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(root.join("etree/empty-file-here").is_file());
}

/// How much the scenarios move on a transport: natively a lot, in the slow
/// (TCG) VM less, with the same assertions.
pub struct Scale {
    /// The file a copy of which is killed and resumed.
    pub resume_len: u64,
    /// rcp's `--block-size` for that copy, in bytes. Blocks are verified a
    /// window ([`WINDOW_SIZE`]) at a time; the client is killed once one
    /// window is, so a resumed copy has well under `resume_len` left.
    pub resume_block: u64,
    /// Bytes each of the eight clients pushes.
    pub client_len: u64,
}

/// rcpd with an arena of two 4 MiB windows, for the tests that stop a copy
/// once part of it is verified: with the default arena every window of a
/// small file is in flight at once, so under TCG its blocks are verified
/// together at the end and no manifest shows them part-way.
const FEW_WINDOWS: &[&str] = &["--arena-mib", "8"];

/// `rcp --block-size BLOCK ARGS` over `t`.
fn rcp_blocks(t: &str, port: u16, block: u64, args: &[&str]) -> Command {
    let bs = format!("{}K", block >> 10);
    rcp_cmd(port, t, None, &[&["--block-size", &bs][..], args].concat())
}

/// A push or pull's `args` held by `--bwlimit` (after the subcommand) to a
/// quarter of the resumed file a second: the copy lasts 4 s at least on
/// any machine, so a fault that comes once a window is verified comes
/// mid-copy (checked where it matters: nothing under the final name).
fn held<'a>(args: &[&'a str], rate: &'a str) -> Vec<&'a str> {
    let at = args
        .iter()
        .position(|a| *a == "push" || *a == "pull")
        .expect("a push or pull")
        + 1;
    let mut v = args[..at].to_vec();
    v.extend(["--bwlimit", rate]);
    v.extend_from_slice(&args[at..]);
    v
}

/// Start `rcp args` quietly, kill it once the manifest of `name` in `dir`
/// (the receiving side) shows a verified window, and check that nothing is
/// under the final name.
fn kill_mid_copy(t: &str, d: &Rcpd, s: &Scale, args: &[&str], dir: &Path, name: &str) {
    let rate = (s.resume_len / 4).to_string();
    let args = held(args, &rate);
    // Its stderr kept beside `dir`: what it said, should it end first.
    let err_path = dir.with_extension("rcp.stderr");
    let err = std::fs::File::create(&err_path).unwrap();
    let mut child = rcp_blocks(t, d.port, s.resume_block, &args)
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap();
    let blocks = WINDOW_SIZE as u64 / s.resume_block;
    wait_verified_while(dir, name, blocks, &mut child, || {
        let said = std::fs::read_to_string(&err_path).unwrap_or_default();
        format!("rcp {args:?}: {said}\nrcpd: {}", d.log())
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dir.join(name).exists(),
        "an interrupted copy is never under the final name"
    );
}

/// Run `rcp args` (a `--resume`) to success; it moves less than the file,
/// and `dir` then holds just `name` with the digest `want`.
fn resume(t: &str, port: u16, s: &Scale, args: &[&str], dir: &Path, name: &str, want: &str) {
    let out = rcp_blocks(t, port, s.resume_block, args).output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}{se}");
    let (m, len) = (moved(&so), s.resume_len);
    assert!(m < len, "resume moved {m} of {len} bytes");
    println!("resumed: {}", so.trim());
    assert_eq!(sha256sum(&dir.join(name)), want);
    assert_eq!(names(dir), vec![name.to_string()]);
}

/// A push killed mid-copy, then `--resume`d.
pub fn push_resume_after_client_killed(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    let src = tmp.path().join("big");
    make_file(&src, s.resume_len, 7);
    let want = sha256sum(&src);
    let p = src.to_str().unwrap();
    kill_mid_copy(t, &d, s, &["push", "-q", p, &remote("/")], &root, "big");
    assert!(find_manifest(&root, "big").is_some(), "{:?}", names(&root));
    let args = ["push", "--resume", p, &remote("/")];
    resume(t, d.port, s, &args, &root, "big", &want);
}

/// A pull killed mid-copy, then `--resume`d.
pub fn pull_resume_after_client_killed(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    make_file(&root.join("big"), s.resume_len, 9);
    let want = sha256sum(&root.join("big"));
    let dst = tmp.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let ds = dst.to_str().unwrap();
    let args = ["pull", "-q", &remote("big"), ds];
    kill_mid_copy(t, &d, s, &args, &dst, "big");
    let args = ["pull", "--resume", &remote("big"), ds];
    resume(t, d.port, s, &args, &dst, "big", &want);
}

/// Start `rcp args` held by `--bwlimit`, send it `sig` (`INT`, `TERM`)
/// once the manifest of `name` in `dir` (the receiving side) shows a
/// verified window, and return its exit code and stderr: nothing is under
/// the final name, the partial is kept.
fn interrupt_mid_copy(
    t: &str,
    d: &Rcpd,
    s: &Scale,
    args: &[&str],
    (dir, name): (&Path, &str),
    sig: &str,
) -> (i32, String) {
    let rate = (s.resume_len / 4).to_string();
    let args = held(args, &rate);
    let err_path = dir.with_extension("rcp.stderr");
    let err = std::fs::File::create(&err_path).unwrap();
    let mut child = rcp_blocks(t, d.port, s.resume_block, &args)
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap();
    let blocks = WINDOW_SIZE as u64 / s.resume_block;
    wait_verified_while(dir, name, blocks, &mut child, || {
        let said = std::fs::read_to_string(&err_path).unwrap_or_default();
        format!("rcp {args:?}: {said}\nrcpd: {}", d.log())
    });
    signal(child.id(), sig);
    let st = child.wait().unwrap();
    let said = std::fs::read_to_string(&err_path).unwrap();
    assert!(!dir.join(name).exists(), "nothing under the final name");
    assert!(find_manifest(dir, name).is_some(), "{:?}", names(dir));
    (st.code().unwrap_or(-1), said)
}

/// What an interrupted rcp said on stderr: the signal, what was done, and
/// the `--resume` command line (returned) that continues the copy.
fn says_how_to_resume(said: &str, sig: &str, sub: &str, len: u64) -> String {
    assert!(said.contains(&format!("interrupted by SIG{sig}")), "{said}");
    assert!(
        said.contains(&format!("0 of 1 files committed (0 of {len} bytes), ")),
        "{said}"
    );
    // What moved of the file before the signal is said too: some (a
    // window was verified), not all.
    let moved: u64 = said
        .split(" bytes), ")
        .nth(1)
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no bytes moved said: {said}"));
    assert!(
        said.contains(&format!("{moved} of {len} bytes moved")),
        "{said}"
    );
    assert!(moved > 0 && moved < len, "{said}");
    let cmd = said
        .lines()
        .find_map(|l| l.strip_prefix("rcp: to continue: "))
        .unwrap_or_else(|| panic!("no --resume command: {said}"));
    assert!(cmd.contains(&format!(" {sub} --resume ")), "{cmd}");
    cmd.to_string()
}

/// How an interrupted copy is taken up again.
#[derive(Clone, Copy)]
pub enum Then {
    /// The same command without `--resume`: it starts afresh and removes
    /// the partial the interrupted one kept.
    Rerun,
    /// The command the interrupted rcp printed (`--resume` in it): it
    /// moves less than the file.
    Printed,
}

/// A push or pull (`sub`) interrupted by `sig` mid-copy exits 128 + the
/// signal, says how to continue; taken up again (`then`) it ends with
/// the file and no `.rcp-*` partial in the destination directory.
pub fn interrupted_copy(t: &str, s: &Scale, sub: &str, sig: &str, then: Then) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    let (src, dst) = (tmp.path().join("big"), tmp.path().join("dst"));
    std::fs::create_dir(&dst).unwrap();
    let (args, dir) = if sub == "push" {
        make_file(&src, s.resume_len, 11);
        (vec![src.to_str().unwrap().to_string(), remote("/")], &root)
    } else {
        make_file(&root.join("big"), s.resume_len, 12);
        (vec![remote("big"), dst.to_str().unwrap().to_string()], &dst)
    };
    let want = sha256sum(&if sub == "push" { src } else { root.join("big") });
    let args: Vec<&str> = [sub, "-q"]
        .into_iter()
        .chain(args.iter().map(String::as_str))
        .collect();
    let (code, said) = interrupt_mid_copy(t, &d, s, &args, (dir, "big"), sig);
    let want_code = if sig == "INT" { 130 } else { 143 };
    assert_eq!(code, want_code, "{said}\nrcpd: {}", d.log());
    let cmd = says_how_to_resume(&said, sig, sub, s.resume_len);
    let out = match then {
        Then::Rerun => rcp_blocks(t, d.port, s.resume_block, &args)
            .output()
            .unwrap(),
        Then::Printed => run_printed(t, d.port, &cmd),
    };
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{so}{se}\nrcpd: {}", d.log());
    if let Then::Printed = then {
        let m = moved(&so);
        assert!(m < s.resume_len, "the resume moved {m} bytes: {so}");
    }
    assert_eq!(sha256sum(&dir.join("big")), want);
    assert_eq!(
        names(dir),
        vec!["big".to_string()],
        "no partial left: {so}{se}\nrcpd: {}",
        d.log()
    );
}

/// Run the command an interrupted rcp printed (without `-q`) as the user
/// would: in a shell, with rcp's environment.
fn run_printed(t: &str, port: u16, cmd: &str) -> std::process::Output {
    let rcp = rcp_cmd(port, t, None, &[]);
    let mut sh = Command::new("sh");
    sh.args(["-c", &cmd.replace(" -q ", " ")]);
    for (k, v) in rcp.get_envs() {
        match v {
            Some(v) => sh.env(k, v),
            None => sh.env_remove(k),
        };
    }
    sh.output().unwrap()
}

/// A tree copied (`sub`: push or pull) into a destination that does not
/// exist, which the tree becomes, interrupted by SIGINT mid-copy: the
/// printed command names the source as `SRC/` (rsync's "its contents"),
/// so that, the destination existing by then, the rest lands in the same
/// place and not nested inside it; it moves less than the file, and
/// leaves no partial or manifest behind.
pub fn interrupted_tree_into_a_new_directory(t: &str, s: &Scale, sub: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    let (src, dst) = match sub {
        "push" => (tmp.path().join("src"), root.join("new")),
        _ => (root.join("src"), tmp.path().join("new")),
    };
    std::fs::create_dir(&src).unwrap();
    make_file(&src.join("big"), s.resume_len, 15);
    let want = sha256sum(&src.join("big"));
    let (from, to) = match sub {
        "push" => (src.to_str().unwrap().to_string(), remote("new")),
        _ => (remote("src"), dst.to_str().unwrap().to_string()),
    };
    let args = [sub, "-q", "-r", &from, &to];
    let (code, said) = interrupt_mid_copy(t, &d, s, &args, (&dst, "big"), "INT");
    assert_eq!(code, 130, "{said}\nrcpd: {}", d.log());
    let cmd = says_how_to_resume(&said, "INT", sub, s.resume_len);
    assert!(cmd.contains(&format!("{from}/ ")), "{cmd}");
    let out = run_printed(t, d.port, &cmd);
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{cmd}: {so}{se}\nrcpd: {}", d.log());
    let m = moved(&so);
    assert!(m < s.resume_len, "the resume moved {m} bytes: {so}");
    assert_eq!(
        names(&dst),
        vec!["big".to_string()],
        "nested, or a partial left: {so}{se}"
    );
    assert_eq!(sha256sum(&dst.join("big")), want);
}

/// Eight clients push to an rcpd with three transfer slots: the excess
/// waits, none fails. Three clients are stopped (SIGSTOP) once rcpd runs
/// their transfers, so the other five meet full slots whatever the
/// machine's speed: rcpd counts each of them waiting (`transfers`) and
/// never runs more than three transfers while they wait. The per-client
/// share is lifted (all clients share one address): the limit under test
/// is `--max-transfers`.
pub fn eight_clients_with_back_pressure(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    // Long watchdogs on both ends: the stopped clients say nothing for as
    // long as the others take to arrive.
    let limits = [
        "--max-transfers",
        "3",
        "--max-transfers-per-client",
        "8",
        "--timeout",
        "600",
    ];
    let d = Rcpd::start(&root, t, None, &limits);
    let url = d.metrics.clone().expect("rcpd serves /metrics");
    let active = || metrics::sample(&metrics::scrape(&url), "rcp_active_transfers");
    let waited = || {
        let m = metrics::scrape(&url);
        metrics::sample(&m, r#"rcpd_client_limits_total{reason="transfers"}"#)
    };
    // The first three held by `--bwlimit` to a quarter of their file a
    // second (4 s at least): each is still running when it is stopped.
    let rate = (s.client_len / 4).to_string();
    let push = |i: u64, held_to: Option<&str>| {
        let src = tmp.path().join(format!("c{i}"));
        make_file(&src, s.client_len + i * 1000, 100 + i);
        let p = src.to_str().unwrap();
        let mut args = vec!["push", "--timeout", "600"];
        args.extend(held_to.map(|r| ["--bwlimit", r]).into_iter().flatten());
        let dst = remote("/");
        args.extend([p, &dst]);
        let child = rcp_cmd(d.port, t, None, &args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (src, child)
    };
    // One at a time: started, seen running by rcpd, stopped.
    let mut kids = Vec::new();
    let mut stopped = KillOnPanic(Vec::new());
    for i in 0..3u64 {
        let (src, mut child) = push(i, Some(&rate));
        let n = i as f64 + 1.0;
        wait_for(
            "rcpd running the new transfer",
            Duration::from_secs(120),
            || {
                if let Some(st) = child.try_wait().unwrap() {
                    let mut e = String::new();
                    let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e);
                    panic!("c{i} ended ({st}) before rcpd ran it: {e}\n{}", d.log());
                }
                active() == Some(n)
            },
        );
        signal(child.id(), "STOP");
        stopped.0.push(child.id());
        assert!(
            child.try_wait().unwrap().is_none(),
            "c{i} ended before SIGSTOP"
        );
        assert_eq!(active(), Some(n), "c{i}'s transfer ended before SIGSTOP");
        kids.push((src, child));
    }
    kids.extend((3..8).map(|i| push(i, None)));
    wait_for(
        "rcpd counting five Move streams waiting for a transfer slot",
        Duration::from_secs(120),
        || waited() == Some(5.0),
    );
    assert_eq!(active(), Some(3.0), "more than --max-transfers ran");
    for (_, c) in &kids[..3] {
        signal(c.id(), "CONT");
    }
    stopped.0.clear();
    for (src, child) in kids {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
        let name = src.file_name().unwrap();
        assert_eq!(sha256sum(&src), sha256sum(&root.join(name)));
    }
    assert_eq!(waited(), Some(5.0), "{}", d.log());
}

/// Processes a test stopped: killed should it fail before it lets them go
/// on, so none is left behind stopped.
struct KillOnPanic(Vec<u32>);

impl Drop for KillOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for pid in &self.0 {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// Send `sig` (STOP, CONT, KILL) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// A client stopped (SIGSTOP) mid-push holds rcpd's only transfer slot:
/// after `--timeout` rcpd evicts it, another client's copy proceeds, and
/// the stopped copy's temp file stays for `--resume`.
pub fn stopped_client_is_evicted(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    // The eviction limit: long enough that a copy on a slow, loaded machine
    // (TCG under load moved nothing for 3 s once, and was evicted before it
    // was stopped) makes progress within it; the test waits for the
    // eviction however long it takes.
    let d = Rcpd::start(&root, t, None, &["--max-transfers", "1", "--timeout", "15"]);
    // Four times the resumed file: far more windows than rcpd grants a
    // session at once, so the copy is mid-way when the client stops.
    let len = 4 * s.resume_len;
    let src = tmp.path().join("big");
    make_file(&src, len, 11);
    let want = sha256sum(&src);
    let p = src.to_str().unwrap();
    let err = tmp.path().join("stopped.err");
    let (rate, dst) = ((s.resume_len / 4).to_string(), remote("/"));
    let args = held(&["push", "-q", p, &dst], &rate);
    let mut stopped = rcp_blocks(t, d.port, s.resume_block, &args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    wait_verified_while(
        &root,
        "big",
        WINDOW_SIZE as u64 / s.resume_block,
        &mut stopped,
        || {
            format!(
                "{}\n{}",
                std::fs::read_to_string(&err).unwrap_or_default(),
                d.log()
            )
        },
    );
    signal(stopped.id(), "STOP");
    let t0 = std::time::Instant::now();
    let other = tmp.path().join("other");
    make_file(&other, 5000, 12);
    let r = rcp(
        d.port,
        t,
        None,
        &["push", other.to_str().unwrap(), &remote("/")],
    );
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
    assert_eq!(sha256sum(&root.join("other")), sha256sum(&other));
    println!(
        "the other client finished {:.1} s after the stop",
        t0.elapsed().as_secs_f64()
    );
    let log = d.log();
    assert!(
        log.contains("stopped answering")
            || log.contains("no progress")
            || log.contains("unfinished"),
        "rcpd says why it ended the stopped client's stream: {log}"
    );
    assert!(!root.join("big").exists(), "nothing under the final name");
    assert!(find_manifest(&root, "big").is_some(), "{:?}", names(&root));
    signal(stopped.id(), "KILL");
    stopped.wait().unwrap();
    // The resume goes to an rcpd on the same root with the default
    // timeout: 3 s is about what one 4 MiB window takes across the VM's
    // namespaces, and the timeout is what this test was about, not this.
    drop(d);
    let d = Rcpd::start(&root, t, None, &[]);
    let args = ["push", "--resume", p, &remote("/")];
    let out = rcp_blocks(t, d.port, s.resume_block, &args)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(moved(&so) < len, "resume moved {} of {len}", moved(&so));
    assert_eq!(sha256sum(&root.join("big")), want);
}

/// rcpd stopped (SIGSTOP) mid-copy: the client gives up with the retry
/// code (its `--timeout` is 15 s: a loaded machine's copy progresses
/// within it before the stop), and once rcpd runs again `--resume`
/// continues the copy.
pub fn stopped_server_makes_the_client_give_up(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    let src = tmp.path().join("big");
    make_file(&src, s.resume_len, 13);
    let want = sha256sum(&src);
    let p = src.to_str().unwrap();
    let (rate, dst) = ((s.resume_len / 4).to_string(), remote("/"));
    let args = [
        &["--timeout", "15"][..],
        &held(&["push", "-q", p, &dst], &rate),
    ]
    .concat();
    let child = rcp_blocks(t, d.port, s.resume_block, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_verified(&root, "big", WINDOW_SIZE as u64 / s.resume_block);
    signal(d.child.id(), "STOP");
    let t0 = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    let waited = t0.elapsed().as_secs_f64();
    signal(d.child.id(), "CONT");
    let se = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "exit 5 (retry): {se}");
    println!(
        "the client gave up {waited:.1} s after rcpd stopped: {}",
        se.trim()
    );
    // When it gives up is the core's and the transport's keepalives' to
    // say, not this machine's: the core's Pair tests check "within the
    // timeout" on a simulated clock.
    assert!(!root.join("big").exists());
    let args = ["push", "--resume", p, &remote("/")];
    let out = rcp_blocks(t, d.port, s.resume_block, &args)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    assert!(
        moved(&so) < s.resume_len,
        "resume moved {} of {}",
        moved(&so),
        s.resume_len
    );
    assert_eq!(sha256sum(&root.join("big")), want);
}

/// Every check (`--verify blake3|sha256|xxh3|none`, and the default)
/// round-trips a file both ways with the right bytes; the summary names the
/// check when it is not the default, blake3 (`none` loudly); `--json` names
/// the check and the digest's format. An rcpd that accepts only sha256
/// refuses the others by name, and the default offer (blake3, then sha256)
/// gets sha256 from it.
pub fn every_check_round_trips(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, &[]);
    let src = tmp.path().join("f");
    make_file(&src, (5 << 20) + 11, 21);
    let want = sha256sum(&src);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    for (check, says) in [
        ("blake3", "digest "),
        ("sha256", "checked with sha256"),
        ("xxh3", "checked with xxh3"),
        ("none", "NOT VERIFIED"),
        ("sha256,blake3", "checked with sha256"),
    ] {
        let name = format!("f-{check}");
        let r = rcp(
            d.port,
            t,
            None,
            &[
                "--verify",
                check,
                "push",
                src.to_str().unwrap(),
                &remote(&name),
            ],
        );
        assert_eq!(
            r.code,
            0,
            "push --verify {check}: {}{}\n{}",
            r.stdout,
            r.stderr,
            d.log()
        );
        assert!(
            r.stdout.contains(says),
            "push --verify {check}: {}",
            r.stdout
        );
        assert_eq!(sha256sum(&root.join(&name)), want, "pushed with {check}");
        let r = rcp(
            d.port,
            t,
            None,
            &[
                "--verify",
                check,
                "pull",
                &remote(&name),
                back.to_str().unwrap(),
            ],
        );
        assert_eq!(r.code, 0, "pull --verify {check}: {}{}", r.stdout, r.stderr);
        assert!(
            r.stdout.contains(says),
            "pull --verify {check}: {}",
            r.stdout
        );
        assert_eq!(sha256sum(&back.join(&name)), want, "pulled with {check}");
    }
    // No --verify: blake3, as --json says with its digest's format.
    let r = rcp(
        d.port,
        t,
        None,
        &[
            "push",
            "--json",
            src.to_str().unwrap(),
            &remote("f-default"),
        ],
    );
    assert_eq!(r.code, 0, "push: {}{}", r.stdout, r.stderr);
    for l in r.stdout.lines().filter(|l| l.contains("\"type\":\"file\"")) {
        assert!(l.contains("\"check\":\"blake3\""), "{l}");
        assert!(
            l.contains("\"digest_format\":\"rcp-file-digest-blake3-v1\""),
            "{l}"
        );
    }
    assert!(r.stdout.contains("\"type\":\"summary\""), "{}", r.stdout);
    assert_eq!(sha256sum(&root.join("f-default")), want);
    let strict_root = tmp.path().join("strict");
    std::fs::create_dir(&strict_root).unwrap();
    let strict = Rcpd::start(&strict_root, t, None, &["--verify", "sha256"]);
    for check in ["blake3", "xxh3", "none"] {
        let r = rcp(
            strict.port,
            t,
            None,
            &[
                "--verify",
                check,
                "push",
                src.to_str().unwrap(),
                &remote("/"),
            ],
        );
        assert_eq!(
            r.code, 6,
            "--verify {check} against RCPD_VERIFY=sha256: {}",
            r.stderr
        );
        assert!(
            r.stderr.contains("sha256") && r.stderr.contains(check),
            "the refusal names both: {}",
            r.stderr
        );
    }
    assert!(names(&strict_root).is_empty());
    // The default offer falls back to sha256, and says so.
    let r = rcp(
        strict.port,
        t,
        None,
        &["push", src.to_str().unwrap(), &remote("f")],
    );
    assert_eq!(
        r.code, 0,
        "default against RCPD_VERIFY=sha256: {}",
        r.stderr
    );
    assert!(r.stdout.contains("checked with sha256"), "{}", r.stdout);
    assert_eq!(sha256sum(&strict_root.join("f")), want);
}

/// A push interrupted under one check and resumed under another starts
/// afresh (never mixes blocks checked two ways) and ends right.
pub fn resume_across_a_change_of_check(t: &str, s: &Scale) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, None, FEW_WINDOWS);
    let src = tmp.path().join("big");
    make_file(&src, s.resume_len, 23);
    let want = sha256sum(&src);
    let p = src.to_str().unwrap();
    kill_mid_copy(
        t,
        &d,
        s,
        &["--verify", "sha256", "push", "-q", p, &remote("/")],
        &root,
        "big",
    );
    assert!(find_manifest(&root, "big").is_some());
    let args = ["--verify", "xxh3", "push", "--resume", p, &remote("/")];
    let out = rcp_blocks(t, d.port, s.resume_block, &args)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    assert_eq!(
        moved(&so),
        s.resume_len,
        "a change of check moves everything again: {so}"
    );
    assert!(
        d.log().contains("checked with another --verify"),
        "rcpd says why it did not resume: {}",
        d.log()
    );
    assert_eq!(sha256sum(&root.join("big")), want);
    assert_eq!(names(&root), vec!["big".to_string()]);
}

/// The client asks for no more staging windows than the job fills
/// (`Client::sized_for`): a 4 KiB push and pull each open a session of one
/// window, a push and a pull of two files of 5 MiB (each 2 windows of
/// 4 MiB, rounded up) one of three, as rcpd's "session opened" lines say.
pub fn staging_sized_to_the_job(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start(&root, t, Some(TOKEN), &[]);
    let small = tmp.path().join("small");
    make_file(&small, 4096, 7);
    let two = tmp.path().join("two");
    std::fs::create_dir(&two).unwrap();
    make_file(&two.join("a"), 5 << 20, 8);
    make_file(&two.join("b"), 5 << 20, 9);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let runs: [(&[&str], u32); 4] = [
        (&["push", small.to_str().unwrap(), &remote("/")], 1),
        (&["pull", &remote("small"), back.to_str().unwrap()], 1),
        (&["push", "-r", two.to_str().unwrap(), &remote("/")], 3),
        (&["pull", "-r", &remote("two"), back.to_str().unwrap()], 3),
    ];
    for (i, (args, windows)) in runs.iter().enumerate() {
        let r = rcp(d.port, t, Some(TOKEN), args);
        assert_eq!(r.code, 0, "{args:?}: {}{}\n{}", r.stdout, r.stderr, d.log());
        let log = d.log();
        let opened: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("session opened"))
            .collect();
        assert_eq!(opened.len(), i + 1, "one session per copy: {log}");
        let want = format!("window_count={windows} ");
        assert!(
            opened[i].contains(&want) && opened[i].contains(&format!("provider={t}")),
            "{args:?} asked for {windows} windows over {t}: {}",
            opened[i]
        );
    }
    assert_eq!(sha256sum(&back.join("small")), sha256sum(&small));
    for f in ["a", "b"] {
        assert_eq!(
            sha256sum(&back.join("two").join(f)),
            sha256sum(&two.join(f))
        );
    }
}

/// Permission bits of `p`.
pub fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Make `p` a file of `len` bytes with permission bits `mode`.
fn file_with_mode(p: &Path, len: u64, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    make_file(p, len, u64::from(mode));
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Modes without `-p`, as rsync has them, both ways and for trees (both
/// ends under umask 022): a new file keeps the source's bits (0600 stays
/// 0600, 0755 stays executable), a file replaced keeps its own (a 0600
/// key.pem stays 0600 under a 0644 source); with `-p` the source's win.
pub fn modes_of_new_and_replaced_files(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start_umask(&Topology::from_env(), &root, t, None, &[], Some(0o022));
    let run = |args: &[&str]| {
        let out = rcp_cmd_umask(d.port, t, None, args, 0o022)
            .output()
            .unwrap();
        let said = format!(
            "{args:?}: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
        assert!(out.status.success(), "{said}");
    };
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    // One file of several blocks (written with O_DIRECT where allowed).
    file_with_mode(&src.join("key.pem"), 3 * WINDOW_SIZE as u64 + 5, 0o600);
    file_with_mode(&src.join("run.sh"), 100, 0o755);
    file_with_mode(&src.join("open.txt"), 10, 0o644);
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let (s, r, b) = (src.to_str().unwrap(), remote("/"), back.to_str().unwrap());
    run(&["push", "-q", "-r", s, &r]);
    for (name, want) in [("key.pem", 0o600), ("run.sh", 0o755), ("open.txt", 0o644)] {
        assert_eq!(mode_of(&root.join("src").join(name)), want, "pushed {name}");
    }
    run(&["pull", "-q", "-r", &remote("src"), b]);
    for (name, want) in [("key.pem", 0o600), ("run.sh", 0o755), ("open.txt", 0o644)] {
        assert_eq!(mode_of(&back.join("src").join(name)), want, "pulled {name}");
    }
    // A 0644 source over an existing 0600 file, each way: the file keeps 0600.
    let loose = tmp.path().join("loose");
    std::fs::create_dir(&loose).unwrap();
    file_with_mode(&loose.join("key.pem"), 2 * WINDOW_SIZE as u64, 0o644);
    let key = loose.join("key.pem");
    run(&["push", "-q", key.to_str().unwrap(), &remote("src/key.pem")]);
    assert_eq!(sha256sum(&root.join("src/key.pem")), sha256sum(&key));
    assert_eq!(mode_of(&root.join("src/key.pem")), 0o600, "push kept 0600");
    let local_key = back.join("src/key.pem");
    std::fs::set_permissions(root.join("src/key.pem"), perm(0o644)).unwrap();
    run(&[
        "pull",
        "-q",
        &remote("src/key.pem"),
        local_key.to_str().unwrap(),
    ]);
    assert_eq!(sha256sum(&local_key), sha256sum(&key));
    assert_eq!(mode_of(&local_key), 0o600, "pull kept 0600");
    // The same in a tree pushed again (after the first file of a
    // directory, rcpd looks at each name once, through the directory's
    // handle): the files replaced keep 0600.
    let tree = tmp.path().join("tree");
    std::fs::create_dir(&tree).unwrap();
    for n in ["a", "b", "c"] {
        file_with_mode(&tree.join(n), 100, 0o644);
    }
    run(&["push", "-q", "-r", tree.to_str().unwrap(), &remote("/")]);
    for n in ["a", "b", "c"] {
        std::fs::set_permissions(root.join("tree").join(n), perm(0o600)).unwrap();
        // Changed, so that the quick check does not skip it.
        file_with_mode(&tree.join(n), 200, 0o644);
    }
    run(&["push", "-q", "-r", tree.to_str().unwrap(), &remote("/")]);
    for n in ["a", "b", "c"] {
        assert_eq!(
            sha256sum(&root.join("tree").join(n)),
            sha256sum(&tree.join(n))
        );
        assert_eq!(
            mode_of(&root.join("tree").join(n)),
            0o600,
            "push -r kept {n} 0600"
        );
    }
    std::fs::remove_dir_all(root.join("tree")).unwrap();
    // With -p the source's mode wins, each way.
    run(&[
        "push",
        "-q",
        "-p",
        key.to_str().unwrap(),
        &remote("src/run.sh"),
    ]);
    assert_eq!(mode_of(&root.join("src/run.sh")), 0o644, "push -p");
    run(&[
        "pull",
        "-q",
        "-p",
        &remote("src/key.pem"),
        local_key.to_str().unwrap(),
    ]);
    assert_eq!(mode_of(&local_key), 0o644, "pull -p");
    // No temp file left behind.
    assert_eq!(names(&root.join("src")), ["key.pem", "open.txt", "run.sh"]);
    assert_eq!(names(&back.join("src")), ["key.pem", "open.txt", "run.sh"]);
}

fn perm(mode: u32) -> std::fs::Permissions {
    use std::os::unix::fs::PermissionsExt;
    std::fs::Permissions::from_mode(mode)
}

/// Without `-p` a new file's bits are the source's masked by the
/// receiver's umask: rcpd's on push, rcp's on pull (077 here: 0755 lands
/// 0700, 0644 lands 0600), never wider than the source.
pub fn modes_masked_by_the_receivers_umask(t: &str) {
    let (tmp, root) = tmp_with_root();
    let d = Rcpd::start_umask(&Topology::from_env(), &root, t, None, &[], Some(0o077));
    let run = |args: &[&str]| {
        let out = rcp_cmd_umask(d.port, t, None, args, 0o077)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
    };
    let src = tmp.path().join("run.sh");
    file_with_mode(&src, 100, 0o755);
    let narrow = tmp.path().join("narrow");
    file_with_mode(&narrow, 100, 0o640);
    run(&[
        "push",
        "-q",
        src.to_str().unwrap(),
        narrow.to_str().unwrap(),
        &remote("/"),
    ]);
    assert_eq!(mode_of(&root.join("run.sh")), 0o700, "push: rcpd's umask");
    assert_eq!(mode_of(&root.join("narrow")), 0o600, "push: never wider");
    std::fs::set_permissions(root.join("run.sh"), perm(0o644)).unwrap();
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    run(&["pull", "-q", &remote("run.sh"), back.to_str().unwrap()]);
    assert_eq!(mode_of(&back.join("run.sh")), 0o600, "pull: rcp's umask");
}

/// The scenarios above as `#[test]`s over `$transport` at the [`Scale`]
/// given, each carrying the attributes given (the VM's `#[ignore = ...]`).
#[macro_export]
macro_rules! e2e_tests {
    ($t:expr, $scale:expr $(, #[$attr:meta])* $(,)?) => {
        #[test]
        $(#[$attr])*
        fn push_pull_small_sizes() {
            $crate::common::e2e::roundtrip($t, &[0, 1, 4095]);
        }

        #[test]
        $(#[$attr])*
        fn staging_sized_to_the_job() {
            $crate::common::e2e::staging_sized_to_the_job($t);
        }

        #[test]
        $(#[$attr])*
        fn push_pull_33mib_plus_7() {
            $crate::common::e2e::roundtrip($t, &[(33 << 20) + 7]);
        }

        #[test]
        $(#[$attr])*
        fn fanout_chain_of_three() {
            $crate::common::e2e_fanout::chain_of_three($t);
        }

        #[test]
        $(#[$attr])*
        fn push_pull_tree_of_200_files() {
            $crate::common::e2e::tree_of_200_files($t);
        }

        #[test]
        $(#[$attr])*
        fn push_pull_tree_with_empty_directories() {
            $crate::common::e2e::tree_with_empty_directories($t);
        }

        #[test]
        $(#[$attr])*
        fn push_resume_after_client_killed() {
            $crate::common::e2e::push_resume_after_client_killed($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn pull_resume_after_client_killed() {
            $crate::common::e2e::pull_resume_after_client_killed($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn push_interrupted_by_sigint_then_rerun_leaves_no_partial() {
            use $crate::common::e2e::{interrupted_copy, Then};
            interrupted_copy($t, &$scale, "push", "INT", Then::Rerun);
        }

        #[test]
        $(#[$attr])*
        fn pull_interrupted_by_sigint_then_rerun_leaves_no_partial() {
            use $crate::common::e2e::{interrupted_copy, Then};
            interrupted_copy($t, &$scale, "pull", "INT", Then::Rerun);
        }

        #[test]
        $(#[$attr])*
        fn push_terminated_resumes_with_the_printed_command() {
            use $crate::common::e2e::{interrupted_copy, Then};
            interrupted_copy($t, &$scale, "push", "TERM", Then::Printed);
        }

        #[test]
        $(#[$attr])*
        fn pull_terminated_resumes_with_the_printed_command() {
            use $crate::common::e2e::{interrupted_copy, Then};
            interrupted_copy($t, &$scale, "pull", "TERM", Then::Printed);
        }

        #[test]
        $(#[$attr])*
        fn push_interrupted_tree_into_a_new_directory_resumes_in_place() {
            $crate::common::e2e::interrupted_tree_into_a_new_directory($t, &$scale, "push");
        }

        #[test]
        $(#[$attr])*
        fn pull_interrupted_tree_into_a_new_directory_resumes_in_place() {
            $crate::common::e2e::interrupted_tree_into_a_new_directory($t, &$scale, "pull");
        }

        #[test]
        $(#[$attr])*
        fn eight_clients_at_once_with_back_pressure() {
            $crate::common::e2e::eight_clients_with_back_pressure($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn every_check_round_trips() {
            $crate::common::e2e::every_check_round_trips($t);
        }

        #[test]
        $(#[$attr])*
        fn resume_across_a_change_of_check() {
            $crate::common::e2e::resume_across_a_change_of_check($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn modes_of_new_and_replaced_files() {
            $crate::common::e2e::modes_of_new_and_replaced_files($t);
        }

        #[test]
        $(#[$attr])*
        fn modes_masked_by_the_receivers_umask() {
            $crate::common::e2e::modes_masked_by_the_receivers_umask($t);
        }

        #[test]
        $(#[$attr])*
        fn stopped_client_is_evicted() {
            $crate::common::e2e::stopped_client_is_evicted($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn stopped_server_makes_the_client_give_up() {
            $crate::common::e2e::stopped_server_makes_the_client_give_up($t, &$scale);
        }

        #[test]
        $(#[$attr])*
        fn push_rerun_skips_what_is_unchanged() {
            $crate::common::e2e_sync::rerun_skips_what_is_unchanged($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_rerun_skips_what_is_unchanged() {
            $crate::common::e2e_sync::rerun_skips_what_is_unchanged($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_update_and_ignore_existing() {
            $crate::common::e2e_sync::update_and_ignore_existing($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_update_and_ignore_existing() {
            $crate::common::e2e_sync::update_and_ignore_existing($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_checksum_finds_a_same_size_change() {
            $crate::common::e2e_sync::checksum_finds_a_same_size_change($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_checksum_finds_a_same_size_change() {
            $crate::common::e2e_sync::checksum_finds_a_same_size_change($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_delta_moves_only_the_changed_block() {
            $crate::common::e2e_sync::delta_moves_only_the_changed_block($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_delta_moves_only_the_changed_block() {
            $crate::common::e2e_sync::delta_moves_only_the_changed_block($t, false);
        }

        #[test]
        $(#[$attr])*
        fn pull_delta_to_a_bare_local_name() {
            $crate::common::e2e_sync::pull_delta_to_a_bare_local_name($t);
        }

        #[test]
        $(#[$attr])*
        fn push_archive_keeps_links_and_says_what_it_leaves_out() {
            $crate::common::e2e_tree::archive_keeps_links_and_says_what_it_leaves_out($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_archive_keeps_links_and_says_what_it_leaves_out() {
            $crate::common::e2e_tree::archive_keeps_links_and_says_what_it_leaves_out($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_a_file_over_a_directory_in_the_tree_is_refused() {
            $crate::common::e2e_tree::a_file_over_a_directory_in_the_tree_is_refused($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_a_file_over_a_directory_in_the_tree_is_refused() {
            $crate::common::e2e_tree::a_file_over_a_directory_in_the_tree_is_refused($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_a_directory_over_a_file_in_the_tree_is_refused() {
            $crate::common::e2e_tree::a_directory_over_a_file_in_the_tree_is_refused($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_a_directory_over_a_file_in_the_tree_is_refused() {
            $crate::common::e2e_tree::a_directory_over_a_file_in_the_tree_is_refused($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_a_symlinked_directory_at_the_destination_is_replaced() {
            $crate::common::e2e_tree::a_symlinked_directory_at_the_destination_is_replaced($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_a_symlinked_directory_at_the_destination_is_replaced() {
            $crate::common::e2e_tree::a_symlinked_directory_at_the_destination_is_replaced($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_a_symlink_named_as_source() {
            $crate::common::e2e_tree::a_symlink_named_as_source($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_a_symlink_named_as_source() {
            $crate::common::e2e_tree::a_symlink_named_as_source($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_names_not_utf8_are_left_out_and_never_deleted() {
            $crate::common::e2e_tree::names_not_utf8_are_left_out_and_never_deleted($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_names_not_utf8_are_left_out_and_never_deleted() {
            $crate::common::e2e_tree::names_not_utf8_are_left_out_and_never_deleted($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_delete_removes_what_the_source_lacks() {
            $crate::common::e2e_tree::delete_removes_what_the_source_lacks($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_delete_removes_what_the_source_lacks() {
            $crate::common::e2e_tree::delete_removes_what_the_source_lacks($t, false);
        }

        #[test]
        $(#[$attr])*
        fn push_exclude_and_include_follow_rsyncs_rules() {
            $crate::common::e2e_tree::exclude_and_include_follow_rsyncs_rules($t, true);
        }

        #[test]
        $(#[$attr])*
        fn pull_exclude_and_include_follow_rsyncs_rules() {
            $crate::common::e2e_tree::exclude_and_include_follow_rsyncs_rules($t, false);
        }
    };
}
