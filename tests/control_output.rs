//! What rcp says, and only that (issue 33's items 7-9): nothing on
//! success with `-q`, no word about the expected tcp choice on a host
//! without RDMA, no colour codes into pipes, errors that say which side and
//! which path, a port that is not rcpd named as such, an unknown host that
//! is not worth retrying, progress that starts at zero and counts every
//! file, the summary's check named next to its digest, `--token-file`,
//! `user@` refused. Real processes over the TCP provider on 127.0.0.1.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;

use common::*;

const T: &str = "tcp";

fn pushed(d: &Rcpd, extra: &[&str], src: &Path, dst: &str, transport: &str) -> Run {
    let mut args = extra.to_vec();
    args.extend(["push", src.to_str().unwrap()]);
    let dst = remote(dst);
    args.push(&dst);
    rcp(d.port, transport, None, &args)
}

#[test]
fn quiet_success_prints_nothing() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 300_000, 1);
    // The host's usual choice, auto, too: on a host without RDMA it is tcp.
    for t in [T, "auto"] {
        let r = pushed(&d, &["-q"], &src, "a.bin", t);
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("", ""), "{t}");
        let back = tmp.path().join(format!("back-{t}.bin"));
        let r = rcp(
            d.port,
            t,
            None,
            &["-q", "pull", &remote("a.bin"), back.to_str().unwrap()],
        );
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("", ""), "{t}");
        assert_eq!(sha256sum(&back), sha256sum(&src));
    }
}

#[test]
fn the_expected_tcp_choice_is_said_only_with_v() {
    if !rcp::verbs::device_names().is_empty() {
        eprintln!("this host has RDMA devices: auto is not tcp here");
        return;
    }
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 100_000, 2);
    for extra in [&[][..], &["--json"][..]] {
        let r = pushed(&d, extra, &src, "a.bin", "auto");
        assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
        assert_eq!(r.stderr, "", "{extra:?}: stderr is not empty");
    }
    let r = pushed(&d, &["-v"], &src, "a.bin", "auto");
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("rcp: transport tcp: no RDMA device found"),
        "-v says why: {}",
        r.stderr
    );
}

#[test]
fn no_colour_codes_into_pipes() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 100_000, 3);
    // -vv: log lines on stderr, the level of each coloured on a terminal.
    let r = pushed(&d, &["-vv"], &src, "a.bin", T);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("INFO") || r.stderr.contains("DEBUG"),
        "{}",
        r.stderr
    );
    assert!(
        !r.stderr.contains('\x1b'),
        "ESC in rcp's stderr: {:?}",
        r.stderr
    );
    assert!(
        !r.stdout.contains('\x1b'),
        "ESC in rcp's stdout: {:?}",
        r.stdout
    );
    assert!(!d.log().contains('\x1b'), "ESC in rcpd's log");
}

#[test]
fn a_missing_remote_file_is_called_remote() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let r = rcp(
        d.port,
        T,
        None,
        &["pull", &remote("nope.bin"), tmp.path().to_str().unwrap()],
    );
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert_eq!(
        r.stderr.trim(),
        format!("rcp: remote {}:nope.bin: no such file", host())
    );
}

#[test]
fn rcpd_errors_name_the_path_beneath_its_root_and_the_os_error_once() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 100_000, 4);
    // An immutable file: rcpd (root) cannot rename over it.
    let locked = root.join("locked.bin");
    std::fs::write(&locked, b"x").unwrap();
    let chattr = |flag: &str| {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(&locked)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !chattr("+i") {
        eprintln!("chattr +i does not work here: nothing to check");
        return;
    }
    let r = pushed(&d, &[], &src, "locked.bin", T);
    chattr("-i");
    assert_eq!(r.code, 6, "{}", r.stderr);
    let line = r.stderr.trim();
    assert!(line.starts_with("rcp: rcpd: "), "which side: {line}");
    assert!(line.contains(" locked.bin: "), "which path: {line}");
    assert!(
        !line.contains(root.to_str().unwrap()),
        "rcpd's root in the message: {line}"
    );
    assert_eq!(line.matches("os error").count(), 1, "{line}");
}

/// A plain TCP listener that answers every connection with an HTTP/1.1
/// error and closes it, until the test ends.
fn http_listener() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    port
}

#[test]
fn a_port_that_is_not_rcpd_is_named() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let health: u16 = d
        .health
        .as_deref()
        .and_then(|h| h.rsplit(':').next())
        .unwrap()
        .parse()
        .unwrap();
    let out = tmp.path().to_str().unwrap();
    for port in [health, http_listener()] {
        let r = rcp(port, T, Some("tok"), &["pull", &remote("x.bin"), out]);
        let want = format!("{}:{port} answers but is not rcpd (", host());
        assert!(r.stderr.contains(&want), "port {port}: {}", r.stderr);
        assert_eq!(r.code, 6, "{}", r.stderr);
        for hint in ["RCP_TOKEN", "TLS", "tls"] {
            assert!(!r.stderr.contains(hint), "a wrong hint: {}", r.stderr);
        }
        // doctor says the same, without the token hint.
        let r = rcp(port, T, Some("tok"), &["doctor", &host()]);
        assert!(r.stdout.contains(&want), "doctor: {}", r.stdout);
        assert!(!r.stdout.contains("RCP_TOKEN"), "doctor: {}", r.stdout);
        assert_ne!(r.code, 0);
    }
}

#[test]
fn an_unknown_host_is_not_retryable() {
    let tmp = e2e::tmp();
    let r = rcp(
        7471,
        T,
        None,
        &[
            "pull",
            "no-such-host.invalid:x",
            tmp.path().to_str().unwrap(),
        ],
    );
    assert!(
        r.stderr.contains("unknown host \"no-such-host.invalid\""),
        "{}",
        r.stderr
    );
    assert_eq!(r.code, 6, "not 5 (retry): {}", r.stderr);
}

/// Every stdout line as JSON.
fn json_lines(r: &Run) -> Vec<serde_json::Value> {
    r.stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn progress_starts_at_zero_and_counts_every_file() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("tree");
    std::fs::create_dir(&src).unwrap();
    let n = 40u64;
    for i in 0..n {
        make_file(&src.join(format!("f{i}")), 50_000, i);
    }
    let total = n * 50_000;
    // --bwlimit: 2 MB at 2 MiB/s (in chains of 32 files), for lines in
    // between every 50 ms.
    let flags = ["push", "-r", "--stats", "50ms", "--bwlimit", "2M"];
    let mut args = vec!["--json"];
    args.extend(flags);
    let (s, dst) = (src.to_str().unwrap(), remote("dst"));
    args.extend([s, dst.as_str()]);
    let r = rcp(d.port, T, None, &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let v = json_lines(&r);
    let p: Vec<&serde_json::Value> = v.iter().filter(|l| l["type"] == "progress").collect();
    assert!(p.len() >= 3, "{}", r.stdout);
    let (first, last) = (p[0], p[p.len() - 1]);
    assert_eq!(
        (first["bytes"].as_u64(), first["files_done"].as_u64()),
        (Some(0), Some(0)),
        "{first}"
    );
    assert_eq!(first["bytes_total"].as_u64(), Some(total));
    assert_eq!(last["files_done"].as_u64(), Some(n), "{last}");
    assert_eq!(last["files_total"].as_u64(), Some(n), "{last}");
    assert_eq!(last["bytes"].as_u64(), Some(total), "{last}");
    let bytes: Vec<u64> = p.iter().map(|l| l["bytes"].as_u64().unwrap()).collect();
    assert!(bytes.windows(2).all(|w| w[0] <= w[1]), "{bytes:?}");
    assert!(
        bytes.iter().any(|&b| b > 0 && b < total),
        "nothing in between: {bytes:?}"
    );
    // The human lines: IEC units, as the bar and the summary.
    let dst2 = remote("dst2");
    let mut args = flags.to_vec();
    args.extend([s, dst2.as_str()]);
    let r = rcp(d.port, T, None, &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(
        lines[0].starts_with("rcp: push 0 B/1.91 MiB (0.0%), 0/40 files"),
        "{}",
        r.stderr
    );
    let end = format!("rcp: push 1.91 MiB/1.91 MiB (100.0%), {n}/{n} files");
    assert!(lines.last().unwrap().starts_with(&end), "{}", r.stderr);
    for bad in ["MB/s", "Gb/s", "kB"] {
        assert!(
            !r.stderr.contains(bad) && !r.stdout.contains(bad),
            "{bad}: {}{}",
            r.stdout,
            r.stderr
        );
    }
    assert!(
        r.stdout
            .contains("40 files, 1.91 MiB (2000000 bytes, 2000000 moved) in "),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("/s over tcp"), "{}", r.stdout);
}

/// The hex value after `key` in a summary line.
fn after<'a>(line: &'a str, key: &str) -> &'a str {
    let i = line
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {line}"))
        + key.len();
    line[i..]
        .split(|c: char| !c.is_ascii_hexdigit())
        .next()
        .unwrap()
}

#[test]
fn the_summary_names_its_check_and_sha256_is_sha256sum() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 1_500_000, 7);
    let want = sha256sum(&src);
    // The default check, BLAKE3: its tree digest, named.
    let r = pushed(&d, &[], &src, "a.bin", T);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        after(&r.stdout, "digest blake3-tree:").len(),
        64,
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains(&want), "{}", r.stdout);
    let r = pushed(&d, &["--verify", "sha256"], &src, "a.bin", T);
    assert_eq!(
        after(&r.stdout, "digest sha256-tree:").len(),
        64,
        "{}",
        r.stdout
    );
    let r = pushed(&d, &["--json"], &src, "a.bin", T);
    let sum = json_lines(&r).pop().unwrap();
    assert_eq!(
        (sum["type"].as_str(), sum["check"].as_str()),
        (Some("summary"), Some("blake3")),
        "{sum}"
    );
    // --sha256: the flat value, sha256sum's, both ways.
    let r = pushed(&d, &["--sha256"], &src, "a.bin", T);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(after(&r.stdout, ", sha256 "), want, "{}", r.stdout);
    let back = tmp.path().join("back.bin");
    let r = rcp(
        d.port,
        T,
        None,
        &["--sha256", "pull", &remote("a.bin"), back.to_str().unwrap()],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(after(&r.stdout, ", sha256 "), want, "{}", r.stdout);
    assert_eq!(sha256sum(&back), want);
}

#[test]
fn token_file_works_and_a_wrong_one_is_refused() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, Some("s3cret"), &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 10_000, 8);
    let file = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (good, wrong, empty) = (
        file("good", "s3cret\n"),
        file("wrong", "nope\n"),
        file("empty", "\n"),
    );
    let s = src.to_str().unwrap();
    let dst = remote("a.bin");
    let push = |f: &str| rcp(d.port, T, None, &["--token-file", f, "push", s, &dst]);
    let r = push(&good);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(sha256sum(&root.join("a.bin")), sha256sum(&src));
    let r = push(&wrong);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("token"), "{}", r.stderr);
    // It beats RCP_TOKEN.
    let r = rcp(
        d.port,
        T,
        Some("s3cret"),
        &["--token-file", &wrong, "push", s, &dst],
    );
    assert_eq!(r.code, 6, "{}", r.stderr);
    for (f, why) in [
        (empty.as_str(), "is empty"),
        ("/no/such/token", "No such file"),
    ] {
        let r = push(f);
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(
            r.stderr.contains(&format!("--token-file {f}: ")),
            "{}",
            r.stderr
        );
        assert!(r.stderr.contains(why), "{}", r.stderr);
    }
    // push --help and pull --help say where the token comes from.
    for cmd in ["push", "pull"] {
        let r = rcp(d.port, T, None, &[cmd, "--help"]);
        assert!(
            r.stdout.contains("RCP_TOKEN") && r.stdout.contains("--token-file"),
            "{}",
            r.stdout
        );
    }
}

#[test]
fn a_user_name_is_refused() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 1000, 9);
    let user_at = format!("me@{}", remote("a.bin"));
    for args in [
        vec!["push", src.to_str().unwrap(), &user_at],
        vec!["pull", &user_at, tmp.path().to_str().unwrap()],
    ] {
        let r = rcp(d.port, T, None, &args);
        assert_eq!(r.code, 1, "{}", r.stderr);
        assert!(r.stderr.contains("rcp has no users"), "{}", r.stderr);
    }
    assert!(!root.join("a.bin").exists());
}

#[test]
fn verbs_asked_for_without_rdma_is_an_error_not_a_retry() {
    if !rcp::verbs::device_names().is_empty() {
        eprintln!("this host has RDMA devices");
        return;
    }
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, T, None, &[]);
    let src = tmp.path().join("a.bin");
    make_file(&src, 1000, 10);
    let r = pushed(&d, &[], &src, "a.bin", "verbs");
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.starts_with("rcp: "), "{}", r.stderr);
    assert!(
        r.stderr.contains("ibverbs-providers"),
        "the fix: {}",
        r.stderr
    );
    assert_eq!(
        r.stderr.matches("errno").count() + r.stderr.matches("os error").count(),
        1,
        "{}",
        r.stderr
    );
    assert!(!root.join("a.bin").exists());
}
