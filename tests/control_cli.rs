//! rcp's machine-facing flags over the TCP provider on 127.0.0.1, real
//! processes: `--json` (every stdout line parsed with serde_json, its
//! fields checked, failures as error lines with their exit codes),
//! `--dry-run` (nothing moves, nothing is made on either side),
//! `--bwlimit` and `RCPD_BWLIMIT` (a limited copy never finishes faster
//! than its limit allows). The schema is docs/json.md.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use common::*;
use serde_json::Value;

const T: &str = "tcp";

/// Every stdout line as JSON, each with `"type"` and `"version": 1`.
fn lines(r: &Run) -> Vec<Value> {
    let v: Vec<Value> = r
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\nstderr: {}", r.stderr))
        })
        .collect();
    for l in &v {
        assert!(l["type"].is_string(), "no type: {l}");
        assert_eq!(l["version"], 1, "{l}");
    }
    v
}

fn of_type<'a>(v: &'a [Value], t: &str) -> Vec<&'a Value> {
    v.iter().filter(|l| l["type"] == t).collect()
}

fn s<'a>(l: &'a Value, k: &str) -> &'a str {
    l[k].as_str()
        .unwrap_or_else(|| panic!("{k} is not a string: {l}"))
}

fn u(l: &Value, k: &str) -> u64 {
    l[k].as_u64()
        .unwrap_or_else(|| panic!("{k} is not a count: {l}"))
}

/// A small tree: three files (one in a subdirectory) and an empty
/// directory; its files by relative path.
fn tree(base: &Path) -> BTreeMap<String, u64> {
    std::fs::create_dir_all(base.join("sub/deeper")).unwrap();
    std::fs::create_dir_all(base.join("empty")).unwrap();
    let files = [("a.bin", 3 << 20), ("b.txt", 10_000), ("sub/c.bin", 5)];
    for (i, (rel, len)) in files.iter().enumerate() {
        make_file(&base.join(rel), *len, i as u64 + 1);
    }
    files.iter().map(|(r, l)| (r.to_string(), *l)).collect()
}

#[test]
fn json_lines_of_push_and_pull() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("src");
    let files = tree(&src);
    // --bwlimit keeps the copy long enough (3 MiB at 8 MiB/s) for
    // progress lines every 50 ms.
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "--json",
            "--sha256",
            "push",
            "-r",
            "--stats",
            "50ms",
            "--bwlimit",
            "8M",
            src.to_str().unwrap(),
            &remote("dst"),
        ],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let v = lines(&r);
    let done = of_type(&v, "file");
    assert_eq!(done.len(), files.len(), "{}", r.stdout);
    for l in &done {
        let rel = s(l, "path").strip_prefix("dst/").expect("beneath dst");
        let want = files[rel];
        assert_eq!(s(l, "direction"), "push");
        assert_eq!(s(l, "source"), src.join(rel).to_str().unwrap());
        assert_eq!((u(l, "bytes"), u(l, "moved")), (want, want), "{l}");
        assert!(l["seconds"].as_f64().unwrap() >= 0.0);
        assert_eq!(s(l, "check"), "blake3");
        assert_eq!(s(l, "digest_format"), "rcp-file-digest-blake3-v1");
        assert_eq!(s(l, "digest").len(), 64);
        assert_eq!(s(l, "sha256"), sha256sum(&src.join(rel)), "{l}");
        assert_eq!(s(l, "transport"), "tcp");
        assert!(l["retries"].is_null() && l["resumed"] == false, "{l}");
        assert_eq!(sha256sum(&root.join("dst").join(rel)), s(l, "sha256"));
    }
    let progress = of_type(&v, "progress");
    assert!(!progress.is_empty(), "no progress lines: {}", r.stdout);
    let total: u64 = files.values().sum();
    let mut last = 0;
    for p in &progress {
        assert_eq!(u(p, "bytes_total"), total);
        assert_eq!(u(p, "files_total"), 3);
        assert!(u(p, "bytes") >= last && u(p, "bytes") <= total, "{p}");
        assert!(p["bytes_per_second"].as_f64().unwrap() >= 0.0);
        last = u(p, "bytes");
    }
    let sum = v.last().unwrap();
    assert_eq!(s(sum, "type"), "summary", "the summary comes last");
    assert_eq!(of_type(&v, "summary").len(), 1);
    assert_eq!(sum["dry_run"], false);
    assert_eq!((u(sum, "files"), u(sum, "bytes")), (3, total));
    assert_eq!((u(sum, "moved"), u(sum, "dirs")), (total, 4));
    assert_eq!(s(sum, "transport"), "tcp");
    assert_eq!(u(sum, "reconnects"), 0);
    // Several files: no single digest.
    assert!(sum["digest"].is_null() && sum["sha256"].is_null(), "{sum}");
    assert!(root.join("dst/empty").is_dir());

    // Pull one file back: its line, and a summary with its digests.
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "pull",
            "--json",
            "--sha256",
            &remote("dst/a.bin"),
            back.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let v = lines(&r);
    assert_eq!(v.len(), 2, "{}", r.stdout);
    let (f, sum) = (&v[0], &v[1]);
    assert_eq!((s(f, "type"), s(f, "direction")), ("file", "pull"));
    assert_eq!(s(f, "source"), "dst/a.bin");
    assert_eq!(s(f, "path"), back.join("a.bin").to_str().unwrap());
    assert_eq!(s(f, "sha256"), sha256sum(&src.join("a.bin")));
    assert_eq!(s(sum, "type"), "summary");
    assert_eq!(s(sum, "digest"), s(f, "digest"));
    assert_eq!(s(sum, "sha256"), s(f, "sha256"));
    // Without --json the human summary is still the default.
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", &remote("dst/b.txt"), back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .starts_with("1 file, 9.77 KiB (10000 bytes, 10000 moved)"),
        "{}",
        r.stdout
    );
}

#[test]
fn json_failures_are_error_lines_with_their_exit_codes() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let dst = tmp.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let here = remote("");
    let dir_missing = remote("no/such/dir/x");
    let nothing = remote("nothing");
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["push", "/etc/hostname", "nowhere"], 1, "USAGE"),
        (vec!["push", "--no-such-flag", "a", "b"], 1, "USAGE"),
        (
            vec!["push", "--bwlimit", "1K", "/etc/hostname", &here],
            1,
            "USAGE",
        ),
        (
            vec!["push", "--bwlimit", "fast", "/etc/hostname", &here],
            1,
            "USAGE",
        ),
        (vec!["push", "/nonexistent/x", &here], 4, "FILE_NOT_FOUND"),
        (
            vec!["push", "/etc/hostname", &dir_missing],
            3,
            "DIR_NOT_FOUND",
        ),
        (
            vec!["pull", &nothing, dst.to_str().unwrap()],
            4,
            "FILE_NOT_FOUND",
        ),
    ];
    for (args, code, reason) in &cases {
        let mut a = vec!["--json"];
        a.extend(args);
        let r = rcp(d.port, T, None, &a);
        assert_eq!(r.code, *code, "{a:?}: {}{}", r.stdout, r.stderr);
        let v = lines(&r);
        assert_eq!(v.len(), 1, "{a:?}: one line: {}", r.stdout);
        let e = &v[0];
        assert_eq!(s(e, "type"), "error");
        assert_eq!(e["code"], *code);
        assert_eq!(s(e, "reason"), *reason, "{a:?}");
        assert!(!s(e, "message").is_empty());
        // The human message still goes to stderr.
        assert!(!r.stderr.trim().is_empty(), "{a:?}");
    }
    // RCP_JSON=true is --json; nothing listening is retryable (5).
    let out = rcp_cmd(1, T, None, &["push", "/etc/hostname", &here])
        .env("RCP_JSON", "true")
        .output()
        .unwrap();
    let r = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert_eq!(r.code, 5, "{}", r.stderr);
    let v = lines(&r);
    assert_eq!(
        (s(&v[0], "reason"), v[0]["code"].as_i64()),
        ("RETRYABLE", Some(5))
    );
    // bench refuses bad input before it touches a device (natively too).
    let r = rcp(d.port, T, None, &["bench", "--json", "--size", "0"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let v = lines(&r);
    assert_eq!((s(&v[0], "type"), s(&v[0], "reason")), ("error", "USAGE"));
    assert!(s(&v[0], "message").contains("--size 0"));
}

#[test]
fn doctor_json_lists_each_check_with_its_level_and_fix() {
    let (_tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, Some("tok"), &[]);
    let r = rcp(d.port, T, Some("tok"), &["doctor", "--json", &host()]);
    let v = lines(&r);
    let checks = of_type(&v, "check");
    assert!(checks.len() >= 2, "{}", r.stdout);
    for c in &checks {
        assert!(!s(c, "name").is_empty() && c["detail"].is_string(), "{c}");
        assert!(["ok", "warn", "fail"].contains(&s(c, "level")), "{c}");
        // A fix is given exactly where something is to be done.
        assert_eq!(c["fix"].is_null(), s(c, "level") == "ok", "{c}");
    }
    let rcpd = checks.iter().find(|c| c["name"] == "rcpd").expect("rcpd");
    assert_eq!(s(rcpd, "level"), "ok");
    let doc = of_type(&v, "doctor");
    assert_eq!(doc.len(), 1);
    let failures = checks.iter().filter(|c| c["level"] == "fail").count() as u64;
    assert_eq!(u(doc[0], "failures"), failures);
    assert_eq!(u(doc[0], "checks"), checks.len() as u64);
    assert_eq!(doc[0]["ok"], failures == 0);
    if failures == 0 {
        assert_eq!(r.code, 0, "{}", r.stderr);
    } else {
        assert_eq!(r.code, 6, "{}", r.stderr);
        assert_eq!(s(v.last().unwrap(), "type"), "error");
    }
}

/// Entries beneath `p`, relative, sorted (hidden temp files included).
fn listing(p: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            out.push(
                e.path()
                    .strip_prefix(p)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn dry_run_lists_every_file_and_creates_nothing() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("src");
    let files = tree(&src);
    let total: u64 = files.values().sum();
    let before = listing(&src);
    // Push, human output: a line per file with its size, then the totals.
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-r", "-n", src.to_str().unwrap(), &remote("dst")],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    for (rel, len) in &files {
        let l = r
            .stdout
            .lines()
            .find(|l| l.contains(&format!("-> dst/{rel} ")))
            .unwrap_or_else(|| panic!("{rel} not listed: {}", r.stdout));
        assert!(l.contains(&format!("({len} bytes)")), "{l}");
    }
    let last = r.stdout.lines().last().unwrap();
    assert!(
        last.contains(&format!("3 files, {total} bytes, 4 directories")),
        "{last}"
    );
    // ... and as JSON lines.
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "--json",
            "push",
            "--dry-run",
            "-r",
            src.to_str().unwrap(),
            &remote("dst"),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = lines(&r);
    let listed: BTreeMap<String, u64> = of_type(&v, "plan")
        .iter()
        .map(|l| {
            (
                s(l, "path").trim_start_matches("dst/").to_string(),
                u(l, "bytes"),
            )
        })
        .collect();
    assert_eq!(listed, files);
    let sum = v.last().unwrap();
    assert_eq!(
        (s(sum, "type"), &sum["dry_run"]),
        ("summary", &Value::Bool(true))
    );
    assert_eq!(
        (u(sum, "files"), u(sum, "bytes"), u(sum, "moved")),
        (3, total, 0)
    );
    assert!(sum["transport"].is_null());
    // Nothing on rcpd's side, not even a session.
    assert!(listing(&root).is_empty(), "{:?}", listing(&root));
    assert!(!d.log().contains("session opened"), "{}", d.log());

    // Pull of a tree that is there, into a directory that is not: nothing
    // is made locally, nothing changes remotely.
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-r", "-q", src.to_str().unwrap(), &remote("dst")],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let remote_before = listing(&root);
    let back = tmp.path().join("back");
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "pull",
            "-r",
            "-n",
            "--json",
            &remote("dst"),
            back.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = lines(&r);
    let listed: BTreeMap<String, u64> = of_type(&v, "plan")
        .iter()
        .map(|l| {
            let p = Path::new(s(l, "path")).strip_prefix(&back).unwrap();
            (p.to_string_lossy().into_owned(), u(l, "bytes"))
        })
        .collect();
    assert_eq!(listed, files);
    assert!(!back.exists(), "a dry run made {}", back.display());
    assert_eq!(listing(&root), remote_before);
    assert_eq!(listing(&src), before);
}

/// A dry run's lines (`would push`, `would delete`) name a file as it is,
/// unless its name holds a control character (a newline, ESC), a quote
/// or a backslash: then quoted and escaped, so that no name starts a line
/// of its own or reaches the terminal as an escape sequence.
#[test]
fn dry_run_escapes_names_it_cannot_print_as_they_are() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let odd = ["a\nb", "c\u{1b}[31mred", "q\"uote", "back\\slash"];
    for n in ["plain"].iter().chain(&odd) {
        make_file(&src.join(n), 10, 1);
    }
    let shown = [
        r#""dst/a\nb""#,
        r#""dst/c\u{1b}[31mred""#,
        r#""dst/q\"uote""#,
        r#""dst/back\\slash""#,
    ];
    let s = src.to_str().unwrap();
    let r = rcp(d.port, T, None, &["push", "-r", "-n", s, &remote("dst")]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines.len(),
        6,
        "a line per file and the totals: {}",
        r.stdout
    );
    for l in &lines[..5] {
        assert!(l.starts_with("would push "), "{l:?}");
    }
    assert!(!r.stdout.contains('\u{1b}'), "{:?}", r.stdout);
    assert!(
        r.stdout.contains(" -> dst/plain (10 bytes)"),
        "{}",
        r.stdout
    );
    for n in shown {
        assert!(
            r.stdout.contains(&format!(" -> {n} (10 bytes)")),
            "{n}: {}",
            r.stdout
        );
    }
    // What --delete would remove, named the same way.
    let r = rcp(d.port, T, None, &["push", "-r", "-q", s, &remote("dst")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    std::fs::write(root.join("dst/x\ny"), b"x").unwrap();
    // `SRC/`: the tree's contents, into `dst` as it exists now.
    let contents = format!("{s}/");
    let r = rcp(
        d.port,
        T,
        None,
        &["push", "-r", "-n", "--delete", &contents, &remote("dst")],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.lines().any(|l| l == r#"would delete "dst/x\ny""#),
        "{}",
        r.stdout
    );
    assert!(root.join("dst/x\ny").exists());
}

/// `bytes` pushed with `--bwlimit rate`: the seconds rcp took.
fn limited_push(d: &Rcpd, src: &Path, name: &str, rate: &str) -> f64 {
    let t = Instant::now();
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "push",
            "--bwlimit",
            rate,
            src.to_str().unwrap(),
            &remote(name),
        ],
    );
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(sha256sum(&d.root.join(name)), sha256sum(src));
    secs
}

/// Only what load cannot break: a limited copy never finishes faster than
/// its limit allows (the bucket starts empty, so by any time t at most
/// rate * t bytes have been posted). 8 MiB at 4 MiB/s: 2 s at least.
#[test]
fn a_limited_copy_never_finishes_faster_than_its_limit() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("eight");
    make_file(&src, 8 << 20, 5);
    let secs = limited_push(&d, &src, "eight", "4M");
    println!("8 MiB pushed at 4 MiB/s: {secs:.3} s (ideal 2.000)");
    assert!(secs >= 1.95, "8 MiB at 4 MiB/s pushed in {secs:.3} s");
    // Pull, with a fractional rate: 8 MiB at 5.5 MiB/s, 1.45 s at least.
    let back = tmp.path().join("back");
    let t = Instant::now();
    let r = rcp(
        d.port,
        T,
        None,
        &[
            "pull",
            "--bwlimit",
            "5.5M",
            &remote("eight"),
            back.to_str().unwrap(),
        ],
    );
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r.code, 0, "{}", r.stderr);
    println!("8 MiB pulled at 5.5 MiB/s: {secs:.3} s (ideal 1.455)");
    assert!(secs >= 1.40, "8 MiB at 5.5 MiB/s pulled in {secs:.3} s");
    assert_eq!(sha256sum(&back), sha256sum(&src));
    // Unlimited it is much faster (shows the limit is what held it back;
    // loose, as load may slow it).
    let t = Instant::now();
    let r = rcp(
        d.port,
        T,
        None,
        &["push", src.to_str().unwrap(), &remote("fast")],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    println!("8 MiB pushed unlimited: {:.3} s", t.elapsed().as_secs_f64());
}

/// RCPD_BWLIMIT caps each copy rcpd makes through the Copy API (as the
/// client of the other rcpd); a rate too low for rcpd's timeout is refused
/// at start.
#[test]
fn rcpd_bwlimit_caps_the_copies_it_makes() {
    use rcp::control::{Client, ClientOptions};
    use rcp::proto::{CopyRequest, Direction};
    let tmp = e2e::tmp();
    let (ra, rb) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&ra).unwrap();
    std::fs::create_dir_all(&rb).unwrap();
    let a = Rcpd::start(
        &ra,
        T,
        None,
        &["--bwlimit", "4M", "--copy-peers", &copy_peers()],
    );
    let b = Rcpd::start(&rb, T, None, &[]);
    make_file(&ra.join("x.bin"), 8 << 20, 9);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t = Instant::now();
    let last = rt.block_on(async {
        let c = Client::connect(&a.addr(), ClientOptions::default())
            .await
            .unwrap();
        let mut st = c
            .copy(CopyRequest {
                direction: Direction::Push as i32,
                local_path: "x.bin".into(),
                remote: b.addr(),
                remote_path: "x.bin".into(),
                transport: T.into(),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut last = None;
        while let Some(p) = st.message().await.unwrap() {
            last = Some(p);
        }
        last.unwrap()
    });
    let secs = t.elapsed().as_secs_f64();
    assert!(last.done && last.error.is_empty(), "{last:?}");
    assert_eq!(sha256sum(&rb.join("x.bin")), sha256sum(&ra.join("x.bin")));
    println!("8 MiB copied by rcpd at 4 MiB/s: {secs:.3} s (ideal 2.000)");
    assert!(secs >= 1.95, "8 MiB at 4 MiB/s copied in {secs:.3} s");

    let out = std::process::Command::new(bin("rcpd"))
        .args(["--root", ra.to_str().unwrap(), "--listen", "127.0.0.1:0"])
        .args(["--health-listen", "none", "--transport", T])
        .env("RCPD_BWLIMIT", "10K")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--bwlimit 10240 B/s") && err.contains("--timeout"),
        "{err}"
    );
}
